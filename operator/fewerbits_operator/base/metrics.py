"""Operator metrics (prometheus-client), served on FEWERBITS_METRICS_PORT."""

from __future__ import annotations

import threading
import time

from prometheus_client import Counter, Gauge, Histogram

from fewerbits_api.conditions import CONDITION_TYPES
from fewerbits_api.quantizedmodel import QuantizedModelStatus

RECONCILES = Counter("fewerbits_reconciles_total", "Reconciles of QuantizedModels, by result", ["result"])
MODEL_RECONCILES = Counter("fewerbits_model_reconciles_total",
                           "Reconciles of each QuantizedModel that completed (written or not)", ["namespace", "model"])
RECONCILE_ERRORS = Counter("fewerbits_reconcile_errors_total", "Reconciles that raised an error")
RECONCILE_DURATION = Histogram("fewerbits_reconcile_duration_seconds", "Time one reconcile takes",
                               buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
RECONCILE_DURATION_MAX = Gauge("fewerbits_reconcile_duration_max_seconds",
                               "The longest reconcile since the operator started (the histogram has no max)")
QUEUE_DEPTH = Gauge("fewerbits_workqueue_depth", "Models waiting in the work queue for a reconcile")
QUEUE_PROCESSING = Gauge("fewerbits_workqueue_processing", "Reconciles running now")
LEADER = Gauge("fewerbits_leader", "1 while this replica holds the leader Lease and acts; 0 on a standby "
               "(it keeps its indexes warm and writes nothing)", ["identity"])
JOBS_CREATED = Counter("fewerbits_quantization_jobs_created_total", "Quantization Jobs created")
CACHE_HITS = Counter("fewerbits_artifact_cache_hits_total", "Artifacts found already published (no Job needed)")
CLAIMS_LOST = Counter("fewerbits_artifact_claims_lost_total",
                      "Job creations given up because another namespace claimed the same key and storage first")
ARTIFACTS_DELETED = Counter("fewerbits_artifacts_deleted_total",
                            "Artifacts the retention sweep deleted from storage (unreferenced for the period)")
RETENTION_SWEEPS = Counter("fewerbits_retention_sweeps_total", "Retention sweeps run, by result", ["result"])
JOBS_RUNNING = Gauge("fewerbits_quantization_jobs_running", "Quantization Jobs not finished yet")
MODELS = Gauge("fewerbits_models", "QuantizedModels by condition and status", ["condition", "status"])
PERPLEXITY_INCREASE = Gauge("fewerbits_artifact_perplexity_increase_percent",
                            "Measured perplexity increase of each model's artifacts",
                            ["namespace", "model", "format"])
QUANTIZATION_DURATION = Gauge("fewerbits_quantization_job_duration_seconds",
                              "Seconds from the operator's first sight of an artifact's quantization Job to the "
                              "artifact published (resolution: the resync period)", ["namespace", "model", "format"])

_lock = threading.Lock()
_max_duration = 0.0
_models: dict[tuple[str, str], QuantizedModelStatus] = {}
_jobs_seen: dict[tuple[str, str, str], float] = {}
"""(namespace, model, artifact key) -> monotonic time its Job was first seen running."""


def observe_model(namespace: str, name: str, status: QuantizedModelStatus) -> None:
    with _lock:
        _models[(namespace, name)] = status
        _refresh()
        now = time.monotonic()
        for a in status.artifacts:
            key = (namespace, name, a.key)
            if a.job and a.sizeBytes is None and a.failure is None:
                _jobs_seen.setdefault(key, now)
            elif key in _jobs_seen:
                started = _jobs_seen.pop(key)
                if a.sizeBytes is not None:
                    QUANTIZATION_DURATION.labels(namespace, name, a.format.value).set(round(now - started, 3))
    for a in status.artifacts:
        if a.quality is not None:
            PERPLEXITY_INCREASE.labels(namespace, name, a.format.value).set(a.quality.increasePercent)


def forget_model(namespace: str, name: str) -> None:
    with _lock:
        gone = _models.pop((namespace, name), None)
        _refresh()
        for key in [k for k in _jobs_seen if k[:2] == (namespace, name)]:
            del _jobs_seen[key]
    try:
        MODEL_RECONCILES.remove(namespace, name)
    except KeyError:
        pass
    if gone is not None:
        for a in gone.artifacts:
            try:
                PERPLEXITY_INCREASE.remove(namespace, name, a.format.value)
            except KeyError:
                pass
            try:
                QUANTIZATION_DURATION.remove(namespace, name, a.format.value)
            except KeyError:
                pass


def _refresh() -> None:
    counts = {(t, s): 0 for t in CONDITION_TYPES for s in ("True", "False", "Unknown")}
    running = 0
    for status in _models.values():
        for c in status.conditions:
            counts[(c.type, c.status)] = counts.get((c.type, c.status), 0) + 1
        running += sum(1 for a in status.artifacts if a.job and a.sizeBytes is None)
    for (t, s), n in counts.items():
        MODELS.labels(t, s).set(n)
    JOBS_RUNNING.set(running)


def observe_reconcile_max(seconds: float) -> None:
    global _max_duration
    with _lock:
        if seconds > _max_duration:
            _max_duration = seconds
            RECONCILE_DURATION_MAX.set(seconds)
