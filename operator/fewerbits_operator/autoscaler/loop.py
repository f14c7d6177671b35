"""The autoscaler loop: observe every autoscaled variant, decide (``algorithm.decide``), act.

It writes exactly three things, like KubeAI's autoscaler and unlike KubeAI's model replicas or
vLLM production-stack's chart values (which write replicas into the user's spec and so fight
GitOps): the Deployment's **scale subresource**, the autoscaler-owned fields of the
QuantizedModel's ``status.serving`` entries (``desiredReplicas``, ``kvCacheUsage``,
``waitingRequests``, ``lastScaleTime``; reconcile keeps them as they are) and an **Event** per
scaling decision. It never writes a spec. Its bounds and targets are the ones reconcile resolved and
published in ``status.autoscaling`` (the spec over policy defaults, the policy's cap): one place
decides which policy governs a model, and an invalid or violated policy, which leaves that field
empty, stops scaling (fail closed). All API I/O goes through the ``AutoscalerIO`` protocol
(``fewerbits_operator.base.kube.Kube`` implements it).

Recommendation history lives in memory, per variant. Losing it on a restart is safe: a
scale-down waits the full ``scaleDownDelaySeconds`` again (``algorithm._record``). So does the
demand history the forecast is made from (``forecast.Forecaster``, a bounded ring buffer per
variant): after a restart the variant scales reactively until the forecast has a band again.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from dataclasses import replace
from typing import Any, Callable, Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from fewerbits_api.quantizedmodel import AUTOSCALER_FIELDS, EffectiveAutoscaling

from fewerbits_operator.serving.render import LABEL_COMPONENT, LABEL_MODEL, LABEL_VARIANT, VLLM_PORT
from fewerbits_operator.autoscaler.algorithm import Decision, History, Observation, Tuning, bounds, decide
from fewerbits_operator.autoscaler.capacity import economics_from_plan, rebalance
from fewerbits_operator.autoscaler.forecast import Forecast, Forecaster, foresight_step
from fewerbits_operator.autoscaler.metrics import MetricsSource, PodSample, PodTarget

log = logging.getLogger("fewerbits.autoscaler")

"""The fields of a status.serving entry this loop owns (reconcile owns the rest)."""


class AutoscalerIO(Protocol):
    """The API verbs the autoscaler needs. The first three and ``list_deployments``/``post_event``
    have the signatures of ``fewerbits_operator.base.kube.Kube``'s methods of the same names."""

    def list_models(self, namespaces: list[str]) -> list[dict[str, Any]]:
        """QuantizedModels (raw objects, status included) in these namespaces; empty: all."""
        ...

    def list_deployments(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        """Deployments matching a label selector (raw objects)."""
        ...

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        """Pods matching a label selector (raw objects)."""
        ...

    def read_scale(self, namespace: str, name: str) -> int | None:
        """spec.replicas of the Deployment's scale subresource; None when the Deployment is gone."""
        ...

    def patch_scale(self, namespace: str, name: str, replicas: int) -> None:
        """Set spec.replicas through the Deployment's scale subresource (nothing else)."""
        ...

    def patch_serving_status(self, namespace: str, name: str, updates: dict[str, dict[str, Any]]) -> None:
        """For each variant in ``updates``, set these autoscaler-owned fields of its
        ``status.serving`` entry (a None value removes the field), leaving every other field and
        entry as the server has them (``merge_serving``)."""
        ...

    def post_event(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on ``obj`` (best effort)."""
        ...


# ------------------------------------------------------------------ pure helpers


def merge_serving(serving: list[dict[str, Any]], updates: dict[str, dict[str, Any]]) -> list[dict[str, Any]] | None:
    """``status.serving`` with the autoscaler-owned fields of the named variants replaced; every
    other field and entry kept. None when nothing would change. Entries are created by reconcile
    only (it owns ``variant``/``deployment``/``replicas``), so an update for a variant that has no
    entry yet waits for the next sync."""
    out: list[dict[str, Any]] = []
    changed = False
    for entry in serving:
        new = dict(entry)
        for k, v in updates.get(entry.get("variant", ""), {}).items():
            if k not in AUTOSCALER_FIELDS:
                raise ValueError(f"the autoscaler does not own status.serving[].{k}")
            if v is None:
                new.pop(k, None)
            else:
                new[k] = v
        changed |= new != entry
        out.append(new)
    return out if changed else None


def is_ready(pod: dict[str, Any]) -> bool:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def http_port(pod: dict[str, Any]) -> int:
    """The container port named ``http`` (render.py names vLLM's port so), else vLLM's 8000."""
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == "http" and p.get("containerPort"):
                return int(p["containerPort"])
    return VLLM_PORT


def classify_pods(namespace: str, pods: list[dict[str, Any]]) -> tuple[list[PodTarget], int]:
    """Ready pods to sample, and the count of pods that exist but are not ready. Terminating and
    finished pods are neither: they are leaving and carry no capacity."""
    targets: list[PodTarget] = []
    not_ready = 0
    for pod in pods:
        md, st = pod.get("metadata") or {}, pod.get("status") or {}
        if md.get("deletionTimestamp") or st.get("phase") in ("Succeeded", "Failed"):
            continue
        if is_ready(pod) and st.get("podIP"):
            targets.append(PodTarget(namespace, md["name"], st["podIP"], http_port(pod)))
        else:
            not_ready += 1
    return targets, not_ready


def published_autoscaling(model: dict[str, Any]) -> EffectiveAutoscaling | None:
    """The autoscaling reconcile resolved for the model (``status.autoscaling``); None when it
    published none (not accepted yet, or refused by a policy) or wrote something unreadable."""
    raw = (model.get("status") or {}).get("autoscaling")
    if not isinstance(raw, dict):
        return None
    try:
        auto = EffectiveAutoscaling.model_validate(raw)
    except ValueError:
        return None
    return auto if auto.minReplicas <= auto.maxReplicas else None


def keep_awake(d: Decision, held_at: float | None, now: float, delay: float) -> Decision:
    """No scale-down to zero within ``scaleDownDelaySeconds`` of a request the activator held for
    the model: a pod woken for it may start between two passes, and the idle recommendations from
    before the wake would take it away again at the first (seen in the scale-from-zero test with a
    6 s delay). Knative's activator feeds its queue to the autoscaler for the same reason."""
    if held_at is None or d.desired > 0 or d.current == 0 or now - held_at >= delay:
        return d
    return replace(d, desired=d.current, act=False, direction=None,
                   reason=f"hold {d.current}: the activator held a request for this model {now - held_at:.0f}s ago "
                          f"(scaleDownDelaySeconds {delay:.0f}); {d.reason}")


DEFAULT_STARTUP_SECONDS = 180.0
"""A vLLM pod's start-up before one was seen (image pull, weights, CUDA graphs)."""


def through_one(decisions: list[Decision], may_reach_zero: bool) -> list[Decision]:
    """A model that would go from two or more replicas straight to zero in one pass keeps one (the
    variant holding most): the activator enters the model's Service (atzero.py: at most one ready
    serving pod) before its last pod leaves, so no request meets a Service with only terminating
    endpoints; the step from one to zero comes at a later pass (docs/routing.md, "Through the
    model's Service at zero"). Counted over the model's variants: two variants at one replica
    each going to zero together is the same window."""
    if not may_reach_zero or any(d.desired for d in decisions) or sum(d.current for d in decisions) < 2:
        return decisions
    keep = max(range(len(decisions)), key=lambda i: (decisions[i].current, -i))
    d = decisions[keep]
    kept = replace(d, desired=1, act=d.current != 1, direction="down" if d.current > 1 else None,
                   reason=f"{d.current} -> 1, not 0: the model's last replica goes at a later pass, once the "
                          f"activator is in its path; {d.reason}")
    return [kept if i == keep else x for i, x in enumerate(decisions)]


def _parse_time(text: str | None) -> float | None:
    try:
        return datetime.strptime(text or "", "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None


def startup_seconds(pods: list[dict[str, Any]]) -> float | None:
    """The variant's pod start-up as its ready pods show it: the median of creation to Ready
    (the Ready condition's ``lastTransitionTime``); None when no ready pod shows it."""
    spans = []
    for pod in pods:
        created = _parse_time((pod.get("metadata") or {}).get("creationTimestamp"))
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") == "Ready" and c.get("status") == "True":
                ready = _parse_time(c.get("lastTransitionTime"))
                if created is not None and ready is not None and ready >= created:
                    spans.append(ready - created)
    if not spans:
        return None
    spans.sort()
    return spans[len(spans) // 2]


def forecast_status(fc: Forecast | None) -> dict[str, Any] | None:
    """``status.serving[].forecast`` (``DemandForecast``), rounded so that noise does not rewrite it."""
    if fc is None:
        return None
    out = {"phase": fc.phase, "horizonSeconds": int(fc.horizon_seconds),
           "demandReplicas": round(fc.demand, 1), "expectedReplicas": round(fc.expected, 1)}
    if fc.since is not None:  # a time, not an age: the status is not rewritten at rest
        out["historySince"] = rfc3339(fc.since)
    if fc.upper is not None and fc.lower is not None:
        out |= {"upperReplicas": round(fc.upper, 1), "lowerReplicas": round(fc.lower, 1)}
    return out


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ------------------------------------------------------------------ telemetry


class AutoscalerMetrics:
    """The loop's Prometheus metrics, on the operator's registry by default."""

    _default: AutoscalerMetrics | None = None
    _lock = threading.Lock()

    def __init__(self, registry: CollectorRegistry):
        labels = ["namespace", "model", "variant"]
        self.desired = Gauge("fewerbits_autoscaler_desired_replicas", "Replicas the autoscaler wants per variant",
                             labels, registry=registry)
        self.kv = Gauge("fewerbits_autoscaler_kv_cache_usage", "Average KV-cache usage (0-1) over ready replicas",
                        labels, registry=registry)
        self.waiting = Gauge("fewerbits_autoscaler_waiting_requests", "Average waiting requests per ready replica",
                             labels, registry=registry)
        self.scale_events = Counter("fewerbits_autoscaler_scale_events_total", "Scale subresource writes, by direction",
                                    ["direction"], registry=registry)
        self.scrape_failures = Counter("fewerbits_autoscaler_scrape_failures_total",
                                       "Ready pods that gave no usable metrics sample", registry=registry)
        self.errors = Counter("fewerbits_autoscaler_errors_total", "Models whose autoscaling pass raised an error",
                              registry=registry)
        for d in ("up", "down"):
            self.scale_events.labels(d)
        self.predictive_ups = Counter(
            "fewerbits_autoscaler_predictive_scale_ups_total",
            "Scale-ups the forecast made ahead of the load (status.serving[].lastScaleCause Predictive)",
            labels, registry=registry)
        self.predictive_unneeded = Counter(
            "fewerbits_autoscaler_predictive_scale_ups_unneeded_total",
            "Predictive scale-ups not needed: within two horizons after one, the demand never exceeded what the "
            "replicas before it held within the reactive tolerance (the reactive rule never asked for it)",
            labels, registry=registry)
        self.forecast_upper = Gauge("fewerbits_autoscaler_forecast_upper_replicas",
                                    "Upper band of the demand forecast one pod start-up ahead (replicas at the "
                                    "KV target)", labels, registry=registry)

    @classmethod
    def for_registry(cls, registry: CollectorRegistry | None) -> AutoscalerMetrics:
        if registry is not None and registry is not REGISTRY:
            return cls(registry)
        with cls._lock:
            if cls._default is None:
                cls._default = cls(REGISTRY)
            return cls._default

    def forget(self, key: tuple[str, str, str]) -> None:
        for g in (self.desired, self.kv, self.waiting, self.forecast_upper, self.predictive_ups,
                  self.predictive_unneeded):
            try:
                g.remove(*key)
            except KeyError:
                pass


# ------------------------------------------------------------------ the loop


@dataclass(frozen=True)
class _Variant:
    """One variant as a pass saw it: its workload, and the decision of its own rules."""

    key: tuple[str, str, str]
    """(namespace, model, variant)."""
    workload: str
    multinode: bool
    decision: Decision
    complete: bool
    """Every ready pod gave metrics (capacity.rebalance moves no capacity on partial data)."""
    failures: int

    @property
    def variant(self) -> str:
        return self.key[2]


@dataclass
class VariantOutcome:
    """What one pass did for one variant (returned by run_once, for tests and logs)."""

    namespace: str
    model: str
    variant: str
    deployment: str
    decision: Decision
    scaled: bool


class Autoscaler:
    """Scales each variant Deployment of every QuantizedModel with ``spec.autoscaling.enabled``."""

    def __init__(self, io: AutoscalerIO, source: MetricsSource, namespaces: list[str] | None = None,
                 tuning: Tuning = Tuning(), status_interval_seconds: float = 60.0,
                 registry: CollectorRegistry | None = None,
                 held: Callable[[str, str], float | None] | None = None):
        """``source``: ``DirectScrapeSource()`` (scrape each pod) or ``PrometheusSource(url)``.
        ``status_interval_seconds``: least time between status writes that only refresh the load
        figures (a change of desiredReplicas or lastScaleTime is written at once)."""
        self.io = io
        self.source = source
        self.namespaces = list(namespaces or [])
        self.tuning = tuning
        self.status_interval = status_interval_seconds
        self.registry = registry if registry is not None else REGISTRY
        self.metrics = AutoscalerMetrics.for_registry(registry)
        self._history: dict[tuple[str, str, str], History] = {}
        self._forecasters: dict[tuple[str, str, str], Forecaster] = {}
        self._forecasts: dict[tuple[str, str, str], Forecast | None] = {}
        self.period = 15.0
        """Seconds between passes (``run_forever`` sets it): the forecast looks one start-up and
        one pass ahead."""
        self._status_written: dict[tuple[str, str], float] = {}
        self._unreported: set[tuple[str, str, str]] = set()
        self.held = held
        """When the model last woke: its latest serving pod became Ready (``runner.last_woken``), if known."""

    # -------------------------------------------------------------- entry points

    def run_once(self, now: float | None = None) -> list[VariantOutcome]:
        """One pass over every model. A model that fails is logged and skipped."""
        now = time.time() if now is None else now
        outcomes: list[VariantOutcome] = []
        seen: set[tuple[str, str, str]] = set()
        for model in self.io.list_models(self.namespaces):
            md = model.get("metadata") or {}
            ns, name = md.get("namespace", ""), md.get("name", "")
            try:
                outcomes += self._model(model, ns, name, now, seen)
            except Exception as e:  # one model never stops the rest; the next pass retries
                self.metrics.errors.inc()
                log.warning("autoscaling %s/%s failed: %s: %s", ns, name, type(e).__name__, e)
                seen |= {k for k in self._history if k[:2] == (ns, name)}  # keep its history
        self._unreported &= seen
        for key in set(self._history) - seen:
            del self._history[key]
            self._forecasters.pop(key, None)
            self._forecasts.pop(key, None)
            self.metrics.forget(key)
        live = {k[:2] for k in seen}
        for key in set(self._status_written) - live:
            del self._status_written[key]
        return outcomes

    def run_forever(self, stop: threading.Event, period: float = 15.0) -> None:
        """Thread entry: a pass every ``period`` seconds until ``stop`` is set."""
        log.info("autoscaler started (every %.0fs, metrics from %s)", period, type(self.source).__name__)
        self.period = period
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.run_once(time.time())
            except Exception as e:
                log.warning("autoscaler pass failed: %s: %s", type(e).__name__, e)
            stop.wait(max(0.0, period - (time.monotonic() - started)))

    # -------------------------------------------------------------- one model

    def _warn_missing_metrics(self, model: dict[str, Any], key: tuple[str, str, str], ready: int,
                              failures: int) -> None:
        """A Warning Event ``MetricsUnavailable`` when a variant's ready pods start giving no vLLM
        metrics (a wrong image, an old vLLM, a blocked port), once per episode; ``MetricsRestored``
        when they all report again. The variant keeps its replicas (no scale-down on missing data)
        and keeps being routed."""
        if failures and key not in self._unreported:
            self._unreported.add(key)
            self.io.post_event(model, "Warning", "MetricsUnavailable",
                               f"variant {key[2]}: {failures} of {ready} ready pod(s) expose no vLLM metrics "
                               f"(vllm:kv_cache_usage_perc, vllm:num_requests_waiting) on /metrics; it is still "
                               "served, but it is neither scaled down nor scored by the endpoint picker on its load")
        elif not failures and ready and key in self._unreported:
            self._unreported.discard(key)
            self.io.post_event(model, "Normal", "MetricsRestored",
                               f"variant {key[2]}: all {ready} ready pod(s) report vLLM metrics again")

    def _foresee(self, key: tuple[str, str, str], d: Decision, auto: EffectiveAutoscaling, cap: int | None,
                 now: float, pods: list[dict[str, Any]]) -> Decision:
        """The predictive rule after the reactive decision (``forecast.foresight_step``, the function
        the bench runs), one measured pod start-up plus one pass ahead."""
        forecaster = self._forecasters.setdefault(key, Forecaster())
        horizon = (startup_seconds(pods) or DEFAULT_STARTUP_SECONDS) + self.period
        step = foresight_step(forecaster, d, auto, cap, now, horizon, auto.predictive, self.tuning)
        if step.unneeded:
            self.metrics.predictive_unneeded.labels(*key).inc(step.unneeded)
        if step.forecast is not None and step.forecast.upper is not None:
            self.metrics.forecast_upper.labels(*key).set(step.forecast.upper)
        self._forecasts[key] = step.forecast
        return step.decision

    def _model(self, model: dict[str, Any], ns: str, name: str, now: float,
               seen: set[tuple[str, str, str]]) -> list[VariantOutcome]:
        auto = published_autoscaling(model)
        if auto is None or not auto.enabled:
            return []
        workloads = [(dep, False) for dep in self.io.list_deployments(ns, f"{LABEL_MODEL}={name}")]
        if hasattr(self.io, "list_lws") and self.io.lws_available():
            # Multi-node variants: LeaderWorkerSets, whose replicas are groups (one leader each).
            workloads += [(lws, True) for lws in self.io.list_lws(ns, f"{LABEL_MODEL}={name}")]
        observed = [v for dep, multinode in workloads
                    if (v := self._variant(model, ns, name, dep, multinode, auto, now)) is not None]
        seen |= {v.key for v in observed}
        decisions = self._place(model, auto, observed)
        held_at = self.held(ns, name) if self.held is not None else None
        decisions = through_one([keep_awake(d, held_at, now, float(auto.scaleDownDelaySeconds)) for d in decisions],
                                auto.minReplicas == 0)
        status_serving = {s.get("variant"): s for s in ((model.get("status") or {}).get("serving") or [])}
        outcomes: list[VariantOutcome] = []
        updates: dict[str, dict[str, Any]] = {}
        urgent = False
        for v, d in zip(observed, decisions):
            prev = status_serving.get(v.variant) or {}
            fields = self._act(model, v, d, prev, now)
            if prev and any(prev.get(k) != x for k, x in fields.items()):
                updates[v.variant] = fields
                urgent |= any(prev.get(k) != fields[k] for k in ("desiredReplicas", "lastScaleTime", "podsWithoutMetrics"))
            outcomes.append(VariantOutcome(ns, name, v.variant, v.workload, d, d.act))
        last = self._status_written.get((ns, name))
        if updates and (urgent or last is None or now - last >= self.status_interval):
            self.io.patch_serving_status(ns, name, updates)
            self._status_written[(ns, name)] = now
        return outcomes

    def _variant(self, model: dict[str, Any], ns: str, name: str, dep: dict[str, Any], multinode: bool,
                 auto: EffectiveAutoscaling, now: float) -> _Variant | None:
        """One variant's observation and its reactive + predictive decision (None: not a variant of
        the model, or its scale is unreadable)."""
        workload = dep["metadata"]["name"]
        variant = (dep["metadata"].get("labels") or {}).get(LABEL_VARIANT)
        if not variant:
            return None
        current = self.io.read_lws_scale(ns, workload) if multinode else self.io.read_scale(ns, workload)
        if current is None:
            return None
        key = (ns, name, variant)
        # A group's leader serves its API and metrics; headless workers serve neither.
        pods = self.io.list_pods(ns, f"{LABEL_MODEL}={name},{LABEL_VARIANT}={variant}"
                                     + (f",{LABEL_COMPONENT}=server" if multinode else ""))
        targets, not_ready = classify_pods(ns, pods)
        results = self.source.sample(targets) if targets else {}
        samples = [r for t in targets if isinstance(r := results.get(t.name), PodSample)]
        failures = len(targets) - len(samples)
        for t in targets:
            if not isinstance(r := results.get(t.name), PodSample):
                log.info("no metrics from %s/%s: %s", ns, t.name, getattr(r, "reason", "no result"))
        if failures:
            self.metrics.scrape_failures.inc(failures)
        self._warn_missing_metrics(model, key, len(targets), failures)
        obs = Observation(current, tuple(samples), failures, not_ready)
        cap = auto.policyMaxReplicas
        d = decide(auto, cap, obs, self._history.get(key, History()), now, self.tuning)
        self._history[key] = d.history
        d = self._foresee(key, d, auto, cap, now, pods)
        return _Variant(key, workload, multinode, d, obs.complete, failures)

    def _place(self, model: dict[str, Any], auto: EffectiveAutoscaling, observed: list[_Variant]) -> list[Decision]:
        """``placement: cheapestPool``: routing follows capacity, the model's extra capacity goes to
        the cheapest pool per token (capacity.rebalance, the function the bench runs)."""
        decisions = [v.decision for v in observed]
        if auto.placement != "cheapestPool" or len(observed) < 2:
            return decisions
        plan = ((model.get("status") or {}).get("plan") or {}).get("variants") or []
        economics = economics_from_plan(plan, auto.poolCostWeights or {})
        lo, hi = bounds(auto, auto.policyMaxReplicas)
        return rebalance([(v.variant, v.decision, v.complete) for v in observed], lo, hi, economics, self.tuning)

    def _act(self, model: dict[str, Any], v: _Variant, d: Decision, prev: dict[str, Any], now: float) -> dict[str, Any]:
        """Write the scale when the decision acts (with its Event and metrics); returns the variant's
        autoscaler-owned status fields."""
        ns, _, _ = v.key
        last_scale, cause = prev.get("lastScaleTime"), prev.get("lastScaleCause")
        if d.act:
            (self.io.patch_lws_scale if v.multinode else self.io.patch_scale)(ns, v.workload, d.desired)
            last_scale = rfc3339(now)
            cause = "Predictive" if d.cause == "predictive" else "Reactive"
            if d.cause == "predictive" and d.desired > d.current:
                self.metrics.predictive_ups.labels(*v.key).inc()
            self.metrics.scale_events.labels(d.direction or ("up" if d.desired > d.current else "down")).inc()
            log.info("%s/%s: %s", ns, v.workload, d.reason)
            self.io.post_event(model, "Normal", "ScaledUp" if d.desired > d.current else "ScaledDown",
                               f"{v.workload}: {d.reason}")
        self.metrics.desired.labels(*v.key).set(d.desired)
        if d.avg_kv is not None:
            self.metrics.kv.labels(*v.key).set(d.avg_kv)
            self.metrics.waiting.labels(*v.key).set(d.avg_waiting or 0.0)
        return {
            "desiredReplicas": d.desired,
            "kvCacheUsage": round(d.avg_kv, 3) if d.avg_kv is not None else None,
            "waitingRequests": round(d.avg_waiting, 1) if d.avg_waiting is not None else None,
            "lastScaleTime": last_scale,
            "podsWithoutMetrics": v.failures or None,
            "forecast": forecast_status(self._forecasts.get(v.key)),
            "lastScaleCause": cause,
        }
