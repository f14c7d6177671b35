"""The S3 calibration object's ETag (datapins), remembered between reconcile passes.

Observe pins an S3 calibration object by its ETag, one HEAD. Read on every pass, that HEAD runs at
rest too, on every resync and every watched event of the model, though the answer rarely changes.
The rule (docs/artifacts.md, "Calibration data"):

* an ETag read is remembered under the model's uid and generation, the object's URI and the
  storage (endpoint, region): a spec edit (a new generation), another object or another store
  reads it again at once;
* it is reused for at most ``ttl_seconds`` after it was read
  (``OperatorSettings.calibration_etag_seconds``, 300 s by default, 0: never): an object replaced
  while the model stays the same is noticed at the first pass after that, and its new ETag is a
  new key and a new Job;
* it is reused only while the model is settled on it: every artifact its last status lists is
  published and ``status.calibrationData.etag`` is that ETag. While an artifact is missing (a Job
  to create, running or failed) every pass reads the ETag again, as before; the Job checks the
  ETag of what it reads against the key in any case (``DatasetChanged``);
* a failed read is not remembered (the next pass reads again), and the memory is bounded (expired
  entries go when a new one is stored; at most ``max_entries``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from fewerbits_api.quantizedmodel import QuantizedModelStatus, StorageSpec

from fewerbits_operator.base.datapins import DataPin

REUSE = object()
"""``settled`` for a pin no status settles (the evaluation set's): reused while fresh."""
MAX_ENTRIES = 10_000
"""One entry per model that uses S3 calibration data; past this the oldest reads go first."""


@dataclass(frozen=True)
class PinKey:
    """What an ETag read is remembered under: any change of these reads again."""

    uid: str
    generation: int | None
    uri: str
    endpoint: str | None
    region: str | None

    @classmethod
    def of(cls, uid: str, generation: int | None, storage: StorageSpec, uri: str) -> PinKey:
        return cls(uid, generation, uri, storage.endpoint, storage.region)


def settled_etag(old: QuantizedModelStatus) -> str | None:
    """The ETag the model's last status is settled on: every artifact it lists is published (a
    manifest was read: ``sizeBytes``). None while anything is missing or no ETag is recorded."""
    if not old.artifacts or any(a.sizeBytes is None for a in old.artifacts):
        return None
    return old.calibrationData.etag if old.calibrationData is not None else None


class PinCache:
    """ETag reads by ``PinKey``, each with the (monotonic) time it was read. Thread-safe: the
    reconcile workers share one."""

    def __init__(self, ttl_seconds: float, clock: Callable[[], float] = time.monotonic,
                 max_entries: int = MAX_ENTRIES):
        self.ttl_seconds = ttl_seconds
        self.clock = clock
        self.max_entries = max_entries
        self._pins: dict[PinKey, tuple[float, DataPin]] = {}
        self._lock = threading.Lock()

    def pin(self, key: PinKey, settled: str | None | object, read: Callable[[], DataPin]) -> DataPin:
        """The pin remembered under ``key`` when it is fresh and is the ETag the model is
        ``settled`` on (``settled_etag``); else ``read()``, remembered (an exception from ``read``
        propagates and is not)."""
        now = self.clock()
        with self._lock:
            entry = self._pins.get(key)
        if entry is not None and now - entry[0] < self.ttl_seconds and (settled is REUSE or entry[1].etag == settled):
            return entry[1]
        pin = read()
        with self._lock:
            for k in [k for k, (at, _) in self._pins.items() if now - at >= self.ttl_seconds]:
                del self._pins[k]
            while len(self._pins) >= self.max_entries:
                del self._pins[min(self._pins, key=lambda k: self._pins[k][0])]
            self._pins[key] = (now, pin)
        return pin

    def __len__(self) -> int:
        return len(self._pins)
