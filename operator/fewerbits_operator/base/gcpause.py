"""The garbage collector's pauses, and the objects it need not scan.

prometheus_client counts collections (``python_gc_collections_total``) but not their time, and a
full collection stops every thread: a reconcile that meets one is slower by the pause. At 300
models kopf's indexes, the Kubernetes client's classes and the pydantic models make a heap of
some hundred thousand objects that a generation-2 collection walks each time.

``install()`` adds a ``gc.callbacks`` hook that times each collection into
``fewerbits_gc_pause_seconds{generation}`` and calls ``gc.freeze()``: what exists at startup (the
imported modules, classes and functions, which live as long as the process) moves to the permanent
generation and is never scanned again. Objects made later are collected as before.

It also makes collections rarer (``THRESHOLDS``). Measured at 300 models at rest with CPython's
default (700, 10, 10): 90 full collections in 300 s, 86 ms each on average and every one over
50 ms, one every 3.3 s, while a pass at rest takes 13 ms at the median: enough passes meet one to
make the slowest 1 % (`bench/load_models.py`, the "full GC pauses" row). A pass allocates tens of
thousands of short-lived containers (the model's body frozen, pydantic models, the decision),
nearly all freed by reference counting; young collections 70 times rarer make full ones as rare,
at the cost of cyclic garbage living up to 50,000 allocations longer.
"""

from __future__ import annotations

import gc
import time

from prometheus_client import Histogram

GC_PAUSE = Histogram("fewerbits_gc_pause_seconds", "Time the garbage collector stopped the process, by generation",
                     ["generation"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
THRESHOLDS = (50_000, 10, 10)
"""gc.set_threshold's: a young collection every 50,000 net allocations (default 700), the older
generations' ratios as CPython's."""
_started: list[float] = []


def _timed(phase: str, info: dict) -> None:
    """A collection runs holding the GIL, one at a time: a start is always followed by its stop."""
    if phase == "start":
        _started[:] = [time.perf_counter()]
    elif _started:
        GC_PAUSE.labels(generation=str(info.get("generation"))).observe(time.perf_counter() - _started.pop())


def install() -> None:
    """Time collections from now on and freeze what exists, once per process (a second call, as
    in a test that starts the runtime twice, changes nothing)."""
    if _timed in gc.callbacks:
        return
    gc.callbacks.append(_timed)
    gc.set_threshold(*THRESHOLDS)
    gc.collect()  # what startup left as garbage goes first, so freeze keeps only what is live
    gc.freeze()
