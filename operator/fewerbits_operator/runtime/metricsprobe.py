"""Pods without metrics, found by the routing loop whether or not a model autoscales
(docs/routing.md, "Pods without metrics").

The endpoint picker (GIE v1.1.0) scores pods on the vLLM metrics it scrapes; a pod that exposes
none keeps zero load in its datastore, is rated the idlest, and gets every request. The autoscaler
finds such pods while it scrapes, but only for models it scales. This loop covers the rest: every
model routed through an InferencePool whose variants the autoscaler does not scrape (autoscaling
off on the model, or the operator's autoscaler loop off). It samples each variant's ready pods
with the same ``MetricsSource`` the autoscaler uses and writes what the autoscaler would:

- ``status.serving[].podsWithoutMetrics`` (an autoscaler-owned field: written through
  ``patch_serving_status``, the same conditional status write), which reconcile turns into
  ``Deployed=True MetricsUnavailable`` and the picker's round-robin profile;
- a Warning event ``MetricsUnavailable`` once per episode, ``MetricsRestored`` when every ready
  pod reports again.

A model routed through its Service only is not probed: a Service spreads requests evenly and reads
no metrics, so a pod without them changes nothing in routing. Deciding is pure
(``variant_findings``, ``metrics_event``); ``MetricsProbe`` does the I/O, whose reads (models,
Deployments, pods) come from kopf's indexes through Kube: a pass costs no API request but the
status write and the event when something changed (periodic.py runs it).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from fewerbits_operator.autoscaler.loop import AutoscalerIO, classify_pods, published_autoscaling
from fewerbits_operator.autoscaler.metrics import MetricsSource, PodSample
from fewerbits_operator.runtime.periodic import run_periodically
from fewerbits_operator.serving.render import LABEL_MODEL, LABEL_VARIANT
from fewerbits_operator.serving.routing import DEFAULT_ROUTING, INFERENCE_POOL

log = logging.getLogger("fewerbits.metricsprobe")

UNAVAILABLE = "MetricsUnavailable"
RESTORED = "MetricsRestored"


def probed(model: dict[str, Any], autoscaler_running: bool) -> bool:
    """Whether this loop must read the model's pods: routed through an InferencePool and not
    scraped by the autoscaler (which writes the same findings itself)."""
    routing = (((model.get("spec") or {}).get("serving")) or {}).get("routing") or DEFAULT_ROUTING
    if routing != INFERENCE_POOL:
        return False
    auto = published_autoscaling(model)
    return not (autoscaler_running and auto is not None and auto.enabled)


def metrics_event(variant: str, ready: int, failures: int, unreported: bool) -> tuple[str, str, str] | None:
    """(type, reason, message) of the event to post for a variant, or None: one Warning when its
    ready pods start giving no metrics, one Normal when all of them report again."""
    if failures and not unreported:
        return ("Warning", UNAVAILABLE,
                f"variant {variant}: {failures} of {ready} ready pod(s) expose no vLLM metrics "
                "(vllm:kv_cache_usage_perc, vllm:num_requests_waiting) on /metrics; it is still served, "
                "but the endpoint picker cannot score it on its load (round-robin until it reports)")
    if not failures and ready and unreported:
        return ("Normal", RESTORED, f"variant {variant}: all {ready} ready pod(s) report vLLM metrics again")
    return None


@dataclass(frozen=True)
class VariantFinding:
    variant: str
    ready: int
    failures: int


class MetricsProbe:
    """The loop: every ``period`` seconds, each probed model's variants are sampled."""

    def __init__(self, io: AutoscalerIO, source: MetricsSource, namespaces: list[str] | None = None,
                 autoscaler_running: bool = True):
        self.io = io
        self.source = source
        self.namespaces = list(namespaces or [])
        self.autoscaler_running = autoscaler_running
        self._unreported: set[tuple[str, str, str]] = set()
        self.passes = 0
        """Completed passes (tests wait on it instead of sleeping)."""

    def run_once(self) -> list[tuple[str, str, VariantFinding]]:
        found: list[tuple[str, str, VariantFinding]] = []
        live: set[tuple[str, str, str]] = set()
        for model in self.io.list_models(self.namespaces):
            md = model.get("metadata") or {}
            ns, name = md.get("namespace", ""), md.get("name", "")
            try:
                if not probed(model, self.autoscaler_running):
                    continue
                for f in self._model(model, ns, name):
                    live.add((ns, name, f.variant))
                    found.append((ns, name, f))
            except Exception as e:  # one model never stops the rest; the next pass retries
                log.warning("metrics probe of %s/%s failed: %s: %s", ns, name, type(e).__name__, e)
                live |= {k for k in self._unreported if k[:2] == (ns, name)}
        self._unreported &= live
        self.passes += 1
        return found

    def _model(self, model: dict[str, Any], ns: str, name: str) -> list[VariantFinding]:
        findings: list[VariantFinding] = []
        for dep in self.io.list_deployments(ns, f"{LABEL_MODEL}={name}"):
            variant = (dep["metadata"].get("labels") or {}).get(LABEL_VARIANT)
            if not variant:
                continue
            targets, _ = classify_pods(ns, self.io.list_pods(ns, f"{LABEL_MODEL}={name},{LABEL_VARIANT}={variant}"))
            results = self.source.sample(targets) if targets else {}
            failures = sum(1 for t in targets if not isinstance(results.get(t.name), PodSample))
            findings.append(VariantFinding(variant, len(targets), failures))
        serving = {s.get("variant"): s for s in ((model.get("status") or {}).get("serving") or [])}
        updates = {f.variant: {"podsWithoutMetrics": f.failures or None} for f in findings
                   if f.variant in serving and serving[f.variant].get("podsWithoutMetrics") != (f.failures or None)}
        if updates:
            self.io.patch_serving_status(ns, name, updates)
        for f in findings:
            key = (ns, name, f.variant)
            event = metrics_event(f.variant, f.ready, f.failures, key in self._unreported)
            if event is not None:
                self.io.post_event(model, *event)
                (self._unreported.add if event[1] == UNAVAILABLE else self._unreported.discard)(key)
        return findings

    def run_forever(self, stop: threading.Event, period: float = 15.0) -> None:
        log.info("metrics probe started (every %.0fs)", period)
        run_periodically(stop, period, self.run_once, "metrics probe", log)
