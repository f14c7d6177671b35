"""The garbage collector's pauses as a metric, and the freeze of what exists at startup (gcpause.py)."""

from __future__ import annotations

import gc

from prometheus_client import REGISTRY

from fewerbits_operator.base import gcpause


def _pauses(generation: str) -> tuple[float, float]:
    labels = {"generation": generation}
    return (REGISTRY.get_sample_value("fewerbits_gc_pause_seconds_count", labels) or 0.0,
            REGISTRY.get_sample_value("fewerbits_gc_pause_seconds_sum", labels) or 0.0)


def test_each_collection_is_timed_by_generation_and_startup_is_frozen_once(monkeypatch):
    frozen: list[int] = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(1))  # not this test process's objects
    monkeypatch.setattr(gc, "set_threshold", lambda *t: frozen.append(t))
    assert gcpause._timed not in gc.callbacks
    try:
        gcpause.install()
        gcpause.install()
        assert gc.callbacks.count(gcpause._timed) == 1 and frozen == [gcpause.THRESHOLDS, 1]
        count, total = _pauses("2")
        gc.collect(2)
        gc.collect(2)
        count2, total2 = _pauses("2")
        assert count2 >= count + 2 and total2 > total  # (>=: the interpreter may collect on its own too)
    finally:
        gc.callbacks.remove(gcpause._timed)
