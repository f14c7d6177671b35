"""Per-pod load figures from vLLM's own metrics: parsed from a pod's ``/metrics`` text, or asked of a
Prometheus server. Each pod yields a typed ``PodSample`` or a typed ``ScrapeFailure``, never an
exception, so one bad pod cannot stop a variant's decision (the algorithm treats a failure as
missing data and never scales down on it).

docs/architecture.md: vLLM exposes ``vllm:kv_cache_usage_perc`` (0-1; named ``vllm:gpu_cache_usage_perc``
before 0.10/0.11 -- AIBrix's KV autoscaler silently lost its signal on that rename, so we accept
both and prefer the new name), ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:num_preemptions_total``, each labelled ``model_name`` (and ``engine`` with data parallel).
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Protocol

from prometheus_client.parser import text_string_to_metric_families

KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # vLLM before 0.10/0.11
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
PREEMPTIONS = "vllm:num_preemptions_total"

MAX_METRICS_BYTES = 8 * 2**20
"""A vLLM /metrics page is tens of KiB (histograms included); more is not a vLLM server."""


@dataclass(frozen=True)
class PodSample:
    """One pod's load at one instant."""

    pod: str
    kv_cache_usage: float
    """Fraction (0-1) of the KV cache in use, averaged over the pod's engines/model names."""
    waiting: float
    """Requests queued in the pod (summed over its engines/model names)."""
    running: float | None = None
    """Requests being processed (summed); None when the pod does not report it."""
    preemptions_total: float | None = None
    """Cumulative preemptions (summed); None when not reported."""
    kv_metric: str = KV_USAGE
    """Which KV metric name the pod reported (the old name means vLLM < 0.10)."""
    prompt_tokens_total: float | None = None
    """Cumulative prompt (prefill) tokens processed (``vllm:prompt_tokens_total``, summed); None when
    not read. The scrape does not read it today: only the bench feeds it, for rule 2c of
    ``algorithm`` (tried, off), which takes its rate between two passes."""


@dataclass(frozen=True)
class ScrapeFailure:
    """Why a pod gave no usable sample."""

    pod: str
    reason: str


SampleResult = PodSample | ScrapeFailure


@dataclass(frozen=True)
class PodTarget:
    """A ready pod to sample."""

    namespace: str
    name: str
    ip: str
    port: int = 8000

    @property
    def metrics_url(self) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip  # IPv6 pod IPs
        return f"http://{host}:{self.port}/metrics"


class MetricsSource(Protocol):
    """Where per-pod figures come from: the pods themselves or a Prometheus server."""

    def sample(self, pods: list[PodTarget]) -> dict[str, SampleResult]:
        """One result per pod, keyed by pod name."""
        ...


# ------------------------------------------------------------------ parsing


def _finite(values: Iterable[float]) -> list[float]:
    return [v for v in values if not math.isnan(v) and not math.isinf(v)]


def parse_vllm_metrics(text: str, pod: str = "", model_name: str | None = None) -> SampleResult:
    """Figures from a Prometheus text exposition of vLLM.

    Several series of one metric (several ``model_name`` or ``engine`` labels) are combined: KV
    usage is averaged (each series is one engine's cache, a fraction of its own size), request
    counts and preemptions are summed. ``model_name`` narrows to the series of that served model
    when the page has any; otherwise every series counts.
    """
    series: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in (KV_USAGE, KV_USAGE_OLD, WAITING, RUNNING, PREEMPTIONS):
                    series.setdefault(s.name, []).append((s.labels, float(s.value)))
    except (ValueError, TypeError, IndexError) as e:
        return ScrapeFailure(pod, f"unparseable metrics text: {e}")

    def values(name: str) -> list[float]:
        got = series.get(name, [])
        if model_name is not None:
            mine = [v for labels, v in got if labels.get("model_name") == model_name]
            if mine:
                return _finite(mine)
        return _finite(v for _, v in got)

    kv_metric = KV_USAGE
    kv = values(KV_USAGE)
    if not kv:
        kv_metric, kv = KV_USAGE_OLD, values(KV_USAGE_OLD)
    if not kv:
        return ScrapeFailure(pod, f"no KV-cache metric ({KV_USAGE} or {KV_USAGE_OLD}): not a vLLM server?")
    waiting = values(WAITING)
    if not waiting:
        return ScrapeFailure(pod, f"no {WAITING}")
    running = values(RUNNING)
    preempt = values(PREEMPTIONS)
    return PodSample(
        pod=pod,
        kv_cache_usage=min(1.0, max(0.0, sum(kv) / len(kv))),
        waiting=max(0.0, sum(waiting)),
        running=max(0.0, sum(running)) if running else None,
        preemptions_total=sum(preempt) if preempt else None,
        kv_metric=kv_metric,
    )


# ------------------------------------------------------------------ direct scrape


def scrape_pod(target: PodTarget, timeout: float = 2.0, model_name: str | None = None) -> SampleResult:
    """GET the pod's /metrics with a short timeout; every failure comes back typed."""
    try:
        req = urllib.request.Request(target.metrics_url, headers={"Accept": "text/plain"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (pod IP, http only)
            body = resp.read(MAX_METRICS_BYTES + 1)
    except urllib.error.HTTPError as e:
        return ScrapeFailure(target.name, f"HTTP {e.code} from {target.metrics_url}")
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return ScrapeFailure(target.name, f"cannot read {target.metrics_url}: {reason}")
    if len(body) > MAX_METRICS_BYTES:
        return ScrapeFailure(target.name, f"{target.metrics_url} returned more than {MAX_METRICS_BYTES} bytes")
    return parse_vllm_metrics(body.decode("utf-8", errors="replace"), target.name, model_name)


class DirectScrapeSource:
    """Scrapes each ready pod's ``/metrics`` itself, in parallel (no Prometheus needed)."""

    def __init__(self, timeout: float = 2.0, workers: int = 16, model_name: str | None = None):
        self.timeout = timeout
        self.workers = workers
        self.model_name = model_name

    def sample(self, pods: list[PodTarget]) -> dict[str, SampleResult]:
        if not pods:
            return {}
        with ThreadPoolExecutor(max_workers=min(self.workers, len(pods))) as pool:
            results = pool.map(lambda p: scrape_pod(p, self.timeout, self.model_name), pods)
            return {p.name: r for p, r in zip(pods, results)}


# ------------------------------------------------------------------ Prometheus


def _promql_string(v: str) -> str:
    return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'


class PrometheusSource:
    """The same per-pod figures from a Prometheus HTTP API (``/api/v1/query`` instant queries).

    Series are matched by the pod and namespace labels the scrape config attaches (``pod`` and
    ``namespace`` with the usual kubernetes_sd relabelling; configurable). The KV query is
    ``avg by (pod)(new) or avg by (pod)(old)``: PromQL ``or`` keeps the left side where a pod has
    both, so the new name wins. A pod whose newest sample is older than ``max_age_seconds`` is a
    failure (Prometheus answers an instant query with anything up to 5 minutes old).
    """

    def __init__(self, url: str, timeout: float = 3.0, pod_label: str = "pod", namespace_label: str = "namespace",
                 max_age_seconds: float = 60.0, headers: dict[str, str] | None = None):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.pod_label = pod_label
        self.namespace_label = namespace_label
        self.max_age_seconds = max_age_seconds
        self.headers = dict(headers or {})

    def queries(self, namespace: str, pods: list[str]) -> dict[str, str]:
        import re
        regex = "|".join(re.escape(p) for p in sorted(pods))
        sel = f"{{{self.namespace_label}={_promql_string(namespace)},{self.pod_label}=~{_promql_string(regex)}}}"
        by = f"by ({self.pod_label})"
        return {
            "kv": f"avg {by} ({KV_USAGE}{sel}) or avg {by} ({KV_USAGE_OLD}{sel})",
            "kv_old": f"avg {by} ({KV_USAGE_OLD}{sel}) unless avg {by} ({KV_USAGE}{sel})",
            "waiting": f"sum {by} ({WAITING}{sel})",
            "running": f"sum {by} ({RUNNING}{sel})",
            "preemptions": f"sum {by} ({PREEMPTIONS}{sel})",
            "age": f"time() - max {by} (timestamp({WAITING}{sel}))",
        }

    def _query(self, promql: str) -> dict[str, float]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        req = urllib.request.Request(url, headers={"Accept": "application/json", **self.headers})
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:  # noqa: S310
            body = json.loads(resp.read(MAX_METRICS_BYTES))
        if body.get("status") != "success":
            raise ValueError(f"Prometheus: {body.get('errorType')}: {body.get('error')}")
        out: dict[str, float] = {}
        for r in body.get("data", {}).get("result", []):
            pod = r.get("metric", {}).get(self.pod_label)
            if pod is not None:
                out[pod] = float(r["value"][1])
        return out

    def sample(self, pods: list[PodTarget]) -> dict[str, SampleResult]:
        results: dict[str, SampleResult] = {}
        by_ns: dict[str, list[PodTarget]] = {}
        for p in pods:
            by_ns.setdefault(p.namespace, []).append(p)
        for ns, targets in by_ns.items():
            names = [t.name for t in targets]
            try:
                got = {k: self._query(q) for k, q in self.queries(ns, names).items()}
            except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as e:
                reason = getattr(e, "reason", e)
                results.update({n: ScrapeFailure(n, f"Prometheus query failed: {reason}") for n in names})
                continue
            for n in names:
                kv, waiting = got["kv"].get(n), got["waiting"].get(n)
                age = got["age"].get(n)
                if kv is None or math.isnan(kv):
                    results[n] = ScrapeFailure(n, f"Prometheus has no {KV_USAGE} or {KV_USAGE_OLD} for pod {n}")
                elif waiting is None or math.isnan(waiting):
                    results[n] = ScrapeFailure(n, f"Prometheus has no {WAITING} for pod {n}")
                elif age is not None and age > self.max_age_seconds:
                    results[n] = ScrapeFailure(n, f"Prometheus' newest sample for pod {n} is {age:.0f}s old")
                else:
                    running = got["running"].get(n)
                    results[n] = PodSample(
                        pod=n, kv_cache_usage=min(1.0, max(0.0, kv)), waiting=max(0.0, waiting),
                        running=running if running is not None and not math.isnan(running) else None,
                        preemptions_total=got["preemptions"].get(n),
                        kv_metric=KV_USAGE_OLD if n in got["kv_old"] else KV_USAGE)
        return results
