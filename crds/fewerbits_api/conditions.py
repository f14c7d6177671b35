"""Conditions in the ``metav1.Condition`` shape, one generic helper for every kind, and the
reason constants in one place (conditions only, each with observedGeneration: docs/architecture.md, house rule 3)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Literal

from pydantic import Field

from .base import ApiModel

# Condition types of QuantizedModel, in the order a model passes through them.
ACCEPTED = "Accepted"
PLANNED = "Planned"
QUANTIZED = "Quantized"
QUALITY_GATE_PASSED = "QualityGatePassed"
SERVING_QUALITY_PASSED = "ServingQualityPassed"
DEPLOYED = "Deployed"
READY = "Ready"
CONDITION_TYPES = (ACCEPTED, PLANNED, QUANTIZED, QUALITY_GATE_PASSED, SERVING_QUALITY_PASSED, DEPLOYED, READY)
ADAPTERS_SERVED = "AdaptersServed"
"""Only on a model with `spec.adapters`, after the chain above: the base is Ready without it."""


class Reason:
    """Every condition reason the operator writes. CamelCase, as metav1.Condition requires."""

    # Accepted
    VALID = "Valid"
    INVALID_SPEC = "InvalidSpec"
    POLICY_VIOLATION = "PolicyViolation"
    MISSING_SECRET = "MissingSecret"
    # Planned
    PLANNED = "Planned"
    NO_GPU_POOLS = "NoGPUPools"
    NO_POOL_FITS = "NoPoolFits"
    MODEL_CONFIG_UNAVAILABLE = "ModelConfigUnavailable"
    # Quantized
    CACHE_HIT = "CacheHit"
    JOB_RUNNING = "JobRunning"
    JOB_PENDING = "JobPending"
    JOB_SUCCEEDED = "JobSucceeded"
    JOB_FAILED = "JobFailed"
    JOB_OOM_KILLED = "JobOOMKilled"
    JOB_EVICTED = "JobEvicted"
    JOB_OUT_OF_DISK = "JobOutOfDisk"
    JOB_DEADLINE_EXCEEDED = "JobDeadlineExceeded"
    JOB_EXCEEDS_POLICY = "JobExceedsPolicy"
    DATASET_UNREADABLE = "DatasetUnreadable"
    STORAGE_UNAVAILABLE = "StorageUnavailable"
    CALIBRATION_DATA_UNAVAILABLE = "CalibrationDataUnavailable"
    CALIBRATION_REDUCED = "CalibrationReduced"
    """Quantized=True, but a Job calibrated on fewer samples than asked (`artifacts[].calibration`)."""
    QUEUED = "Queued"
    # QualityGatePassed
    GATE_PASSED = "GatePassed"
    GATE_FAILED = "GateFailed"
    AWAITING_ARTIFACT = "AwaitingArtifact"
    # ServingQualityPassed (the serving canary, docs/canary.md)
    CANARY_DISABLED = "CanaryDisabled"
    CANARY_PENDING = "CanaryPending"
    CANARY_EVALUATING = "CanaryEvaluating"
    CANARY_PASSED = "CanaryPassed"
    CANARY_FAILED = "CanaryFailed"
    CANARY_NOT_READY = "CanaryNotReady"
    CANARY_ERROR = "CanaryError"
    """The evaluation Job gave no verdict (canary unreachable, storage unreadable): fail closed."""
    # Deployed / Ready
    DEPLOYMENTS_CREATED = "DeploymentsCreated"
    ROLLING_OUT = "RollingOut"
    ALL_VARIANTS_READY = "AllVariantsReady"
    SOME_VARIANTS_READY = "SomeVariantsReady"
    NO_REPLICAS_READY = "NoReplicasReady"
    PODS_FAILING = "PodsFailing"
    POOL_GONE = "PoolGone"
    SERVICE_CONFLICT = "ServiceConflict"
    BLOCKED = "Blocked"
    LEADER_WORKER_SET_MISSING = "LeaderWorkerSetMissing"
    """Deployed: a variant's replica spans nodes and the cluster does not serve LeaderWorkerSet."""
    # Deployed, spec.serving.routing: inferencePool (fewerbits_operator.serving.routing)
    ROUTING_UNAVAILABLE = "RoutingUnavailable"
    INFERENCE_POOL_CONFLICT = "InferencePoolConflict"
    HTTP_ROUTE_CONFLICT = "HTTPRouteConflict"
    """Deployed, spec.serving.gateway: an HTTPRoute of the model's name it does not own (gatewayroute.py)."""
    METRICS_UNAVAILABLE = "MetricsUnavailable"
    # AdaptersServed
    ADAPTER_INVALID = "AdapterInvalid"
    ADAPTERS_NOT_PLANNED = "AdaptersNotPlanned"
    AWAITING_ADAPTER_GATE = "AwaitingAdapterGate"
    ADAPTERS_JUDGED = "AdaptersJudged"


class Condition(ApiModel):
    """One aspect of the object's state (metav1.Condition)."""

    type: Annotated[str, Field(max_length=316)]
    """Condition type: Accepted, Planned, Quantized, QualityGatePassed, ServingQualityPassed, Deployed or
    Ready."""
    status: Literal["True", "False", "Unknown"]
    """True, False or Unknown."""
    reason: Annotated[str, Field(max_length=1024)]
    """A CamelCase word for programs."""
    message: Annotated[str, Field(max_length=32768)] = ""
    """What happened, in words a person can act on."""
    lastTransitionTime: str
    """When the status last changed (RFC 3339)."""
    observedGeneration: int | None = None
    """The spec generation this condition was computed from."""


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def set_condition(
    conditions: list[Condition],
    type: str,
    status: bool | str,
    reason: str,
    message: str,
    generation: int | None,
    now: str | None = None,
) -> list[Condition]:
    """Return a new list with the condition set; ``lastTransitionTime`` moves only when the
    status changes, so re-running reconcile with the same facts changes nothing."""
    status_str = status if isinstance(status, str) else ("True" if status else "False")
    out: list[Condition] = []
    found = False
    for c in conditions:
        if c.type != type:
            out.append(c)
            continue
        found = True
        transition = c.lastTransitionTime if c.status == status_str else (now or now_rfc3339())
        out.append(Condition(type=type, status=status_str, reason=reason, message=message,
                             lastTransitionTime=transition, observedGeneration=generation))
    if not found:
        out.append(Condition(type=type, status=status_str, reason=reason, message=message,
                             lastTransitionTime=now or now_rfc3339(), observedGeneration=generation))
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(out, key=lambda c: order.get(c.type, len(order)))


def get_condition(conditions: list[Condition], type: str) -> Condition | None:
    return next((c for c in conditions if c.type == type), None)


def is_true(conditions: list[Condition], type: str) -> bool:
    c = get_condition(conditions, type)
    return c is not None and c.status == "True"
