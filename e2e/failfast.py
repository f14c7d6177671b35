"""When waiting for a QuantizedModel to become Ready is pointless: it has shown a failure that does
not pass by itself for HOLD_SECONDS (a serving pod failing over and over, a Job that failed, a gate
that failed). The demo and the tests' waits stop then and show the model's message, instead of
waiting out a timeout of 300-1,200 s. Pure: the caller reads the conditions and the clock.

A failure must hold for HOLD_SECONDS, not merely appear, because some recover: a pod that fails
once while storage restarts, a Job retried after a transient error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from fewerbits_api.conditions import Reason

STOP_REASONS = frozenset({
    Reason.INVALID_SPEC, Reason.POLICY_VIOLATION, Reason.JOB_FAILED, Reason.JOB_OOM_KILLED, Reason.JOB_OUT_OF_DISK,
    Reason.JOB_DEADLINE_EXCEEDED, Reason.JOB_EXCEEDS_POLICY, Reason.DATASET_UNREADABLE, Reason.GATE_FAILED,
    Reason.CANARY_FAILED, Reason.PODS_FAILING,
})
"""Reasons of a condition with status False that leave the model short of Ready until someone acts."""
HOLD_SECONDS = 60.0
"""How long one of them must hold. A serving pod that crash-loops shows PodsFailing from its first
failure on, so the demo stops about a minute after it (the issue's goal: within two)."""


class ModelFailed(AssertionError):
    """The model showed a failure that stops the wait (``message`` says which and why)."""


@dataclass
class FailFast:
    """Remembers since when each stopping failure has shown (keyed by condition type and reason)."""

    hold: float = HOLD_SECONDS
    since: dict[tuple[str, str], float] = field(default_factory=dict)

    def check(self, conditions: Iterable[Mapping[str, Any]], now: float) -> str | None:
        """The failure that has held ``hold`` seconds at ``now``, told as one line, or None."""
        failing = {(c["type"], c["reason"]): str(c.get("message") or "") for c in conditions
                   if c.get("status") == "False" and c.get("reason") in STOP_REASONS}
        self.since = {key: self.since.get(key, now) for key in failing}
        for (type_, reason), start in self.since.items():
            if now - start >= self.hold:
                return f"{type_}=False {reason} for {now - start:.0f} s: {failing[(type_, reason)]}"
        return None
