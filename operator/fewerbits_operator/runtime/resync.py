"""The periodic resync: the gap it fills is that kopf's only periodic trigger is a per-object timer
(``@kopf.timer``), and a timer puts a finalizer on every object it serves (kopf needs one to stop
it on deletion), a write per model that a level-triggered operator has no use for.

The runner (runner.py ``resync_tick``) gives every known model its next reconcile through the work
queue's ``add_after``: a steady model (Ready at its generation) every ``steady_period_seconds``,
others every ``resync_seconds``, each at its own phase of the period (``next_resync``), so 300
models applied at once do not come back at once.
"""

from __future__ import annotations

import zlib
from typing import Any

Key = tuple[str, str]


def next_resync(key: Key, now: float, period: float) -> float:
    """When a key is next due: the first time after ``now + period/2`` at the key's own phase of
    the period (from a stable hash of its name). Keys spread evenly over the period whatever the
    moment they were last reconciled, and two resyncs of one key are 0.5-1.5 periods apart, one
    period on average."""
    phase = (zlib.crc32(f"{key[0]}/{key[1]}".encode()) % 100_000) / 100_000 * period
    earliest = now + period / 2
    cycles = (earliest - phase) // period + 1
    return phase + cycles * period


def model_steady(obj: dict[str, Any]) -> bool:
    """Ready=True for the current generation: only a watched change can move it."""
    md, status = obj.get("metadata") or {}, obj.get("status") or {}
    if status.get("observedGeneration") != md.get("generation"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
