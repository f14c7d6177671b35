"""A coalescing work queue of model keys, and the workers that drain it.

The semantics are client-go's ``workqueue`` (k8s.io/client-go/util/workqueue/queue.go), which
every Kubernetes controller relies on:

* a key waiting in the queue is there once, however often it is added (300 Deployments changing
  status for 300 models queue 300 reconciles, not one per event);
* a key being processed is never handed to a second worker; added again meanwhile, it is queued
  once more when the first worker is done (the change that came in during the reconcile is seen);
* ``add_after`` schedules a key for later (retry back-off, periodic resync); an earlier schedule
  of the same key wins, and an ``add`` makes it ready at once.

Reconcile is level-triggered (docs/architecture.md, house rule 2), so running a key once for many events loses nothing.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from typing import Callable, Generic, Hashable, TypeVar

log = logging.getLogger("fewerbits.workqueue")

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    """Thread-safe; ``get`` blocks. Call ``done(key)`` after processing every key ``get`` returned."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._cond = threading.Condition()
        self._ready: deque[K] = deque()
        self._dirty: set[K] = set()
        """Keys that need processing: in ``_ready``, or processing and to be run again after."""
        self._processing: set[K] = set()
        self._later: list[tuple[float, int, K]] = []
        self._later_due: dict[K, float] = {}
        self._seq = 0
        self._shutdown = False
        self.adds = 0
        """Every add, coalesced or not (for metrics)."""
        self.coalesced = 0
        """Adds that found the key already waiting."""

    # ------------------------------------------------------------ producers

    def add(self, key: K) -> None:
        with self._cond:
            self._add(key)

    def add_many(self, keys) -> None:
        with self._cond:
            for key in keys:
                self._add(key)

    def _add(self, key: K) -> None:
        if self._shutdown:
            return
        self.adds += 1
        self._later_due.pop(key, None)  # ready now: a pending schedule is moot (its heap entry is skipped)
        if key in self._dirty:
            self.coalesced += 1
            return
        self._dirty.add(key)
        if key not in self._processing:
            self._ready.append(key)
            self._cond.notify()

    def add_after(self, key: K, delay: float) -> None:
        """Make ``key`` ready in ``delay`` seconds, unless it is scheduled earlier or added meanwhile."""
        if delay <= 0:
            self.add(key)
            return
        with self._cond:
            if self._shutdown:
                return
            due = self._clock() + delay
            if key in self._later_due and self._later_due[key] <= due:
                return
            self._later_due[key] = due
            self._seq += 1
            heapq.heappush(self._later, (due, self._seq, key))
            self._cond.notify()  # a waiting worker may need to wake earlier than it planned

    def pending(self, key: K) -> bool:
        """Waiting, being processed, or scheduled for later."""
        with self._cond:
            return key in self._dirty or key in self._processing or key in self._later_due

    def scheduled(self, key: K) -> float | None:
        """When a scheduled key becomes ready (clock time), or None."""
        with self._cond:
            return self._later_due.get(key)

    # ------------------------------------------------------------ consumers

    def get(self, timeout: float | None = None) -> K | None:
        """The next ready key (now marked processing), or None on timeout or shutdown."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                self._promote()
                if self._ready:
                    key = self._ready.popleft()
                    self._processing.add(key)
                    self._dirty.discard(key)
                    return key
                if self._shutdown:
                    return None
                now = self._clock()
                wait = None if deadline is None else deadline - now
                if wait is not None and wait <= 0:
                    return None
                if self._later:
                    until_due = max(0.0, self._later[0][0] - now)
                    wait = until_due if wait is None else min(wait, until_due)
                self._cond.wait(wait)

    def done(self, key: K) -> None:
        with self._cond:
            self._processing.discard(key)
            if key in self._dirty:  # added while it was being processed: run it again
                self._ready.append(key)
                self._cond.notify()

    def _promote(self) -> None:
        now = self._clock()
        while self._later and self._later[0][0] <= now:
            due, _, key = heapq.heappop(self._later)
            if self._later_due.get(key) != due:
                continue  # superseded by an earlier schedule or an add
            del self._later_due[key]
            self._add(key)

    # ------------------------------------------------------------ lifecycle and figures

    def shut_down(self) -> None:
        """Workers return once the ready keys are drained; later adds are dropped."""
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()

    def __len__(self) -> int:
        """Keys ready or waiting to be re-run (not those only scheduled for later)."""
        with self._cond:
            return len(self._dirty)

    @property
    def processing(self) -> int:
        with self._cond:
            return len(self._processing)


def run_worker(queue: WorkQueue[K], handle: Callable[[K], None], on_error: Callable[[K, Exception], None],
               stop: threading.Event) -> None:
    """Thread entry: take keys until ``stop`` is set or the queue shuts down. An exception from
    ``handle`` goes to ``on_error`` (typically a back-off re-add) and never ends the worker."""
    while not stop.is_set():
        key = queue.get(timeout=1.0)
        if key is None:
            if queue._shutdown:  # noqa: SLF001 — the worker belongs to the queue's module
                return
            continue
        try:
            handle(key)
        except Exception as e:  # one key never stops the others
            try:
                on_error(key, e)
            except Exception:  # noqa: BLE001 — a failing error handler must not kill the worker either
                log.exception("error handler failed for %s", key)
        finally:
            queue.done(key)
