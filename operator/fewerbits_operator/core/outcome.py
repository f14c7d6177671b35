"""The outcome of one pass of decide and the status it builds: ``Outcome`` (status, writes,
events) and ``StatusBuilder`` (the conditions set this pass, with their events). Below every step
module of decide (acceptance, artifact_steps, serving_steps) and decide itself."""

from __future__ import annotations

from dataclasses import dataclass, field

from fewerbits_api import conditions as C
from fewerbits_api.conditions import Condition, Reason, set_condition
from fewerbits_api.quantizedmodel import (
    QuantizedModelStatus,
)

from fewerbits_operator.base.actions import (
    Action,
    Event,
)
from fewerbits_operator.serving import routing

LATER = (C.PLANNED, C.QUANTIZED, C.QUALITY_GATE_PASSED, C.SERVING_QUALITY_PASSED, C.DEPLOYED, C.READY)
WARNING_REASONS = frozenset({
    Reason.INVALID_SPEC, Reason.POLICY_VIOLATION, Reason.MISSING_SECRET, Reason.NO_GPU_POOLS,
    Reason.NO_POOL_FITS, Reason.MODEL_CONFIG_UNAVAILABLE, Reason.JOB_FAILED, Reason.STORAGE_UNAVAILABLE,
    Reason.JOB_OOM_KILLED, Reason.JOB_EVICTED, Reason.JOB_OUT_OF_DISK, Reason.JOB_DEADLINE_EXCEEDED,
    Reason.JOB_EXCEEDS_POLICY, Reason.DATASET_UNREADABLE,
    Reason.GATE_FAILED, Reason.PODS_FAILING, Reason.POOL_GONE, Reason.SERVICE_CONFLICT,
    Reason.CALIBRATION_DATA_UNAVAILABLE, Reason.ADAPTER_INVALID, Reason.ADAPTERS_NOT_PLANNED,
    routing.REASON_UNAVAILABLE, routing.REASON_CONFLICT, Reason.METRICS_UNAVAILABLE,
    Reason.CANARY_FAILED, Reason.CANARY_NOT_READY, Reason.CANARY_ERROR,
})



# ------------------------------------------------------------------ the outcome


@dataclass(frozen=True)
class Outcome:
    """What one pass decided: the whole new status, the writes, the events."""

    status: QuantizedModelStatus
    actions: tuple[Action, ...] = ()
    events: tuple[Event, ...] = ()


# ------------------------------------------------------------------ condition bookkeeping


@dataclass
class StatusBuilder:
    """Conditions set in order, with an event for each real transition (status or reason)."""

    conditions: list[Condition]
    generation: int | None
    now: str
    events: list[Event] = field(default_factory=list)

    def set(self, type_: str, ok: bool | str, reason: str, message: str) -> None:
        before = C.get_condition(self.conditions, type_)
        self.conditions = set_condition(self.conditions, type_, ok, reason, message, self.generation, now=self.now)
        after = C.get_condition(self.conditions, type_)
        assert after is not None
        if before is None or before.status != after.status or before.reason != after.reason:
            kind = "Warning" if reason in WARNING_REASONS else "Normal"
            self.events.append(Event(kind, reason, f"{type_}={after.status}: {message}"[:1024]))

    def waiting(self, types: tuple[str, ...], reason: str, message: str) -> None:
        for t in types:
            self.set(t, False, reason, message)

    def note(self, type_: str, reason: str, message: str) -> None:
        self.events.append(Event(type_, reason, message[:1024]))
