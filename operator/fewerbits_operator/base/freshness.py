"""The read-your-writes guard: the gap it fills is that a kopf index lags the API server by a
watch event (and kopf's batching window), and kopf offers no way to wait for a version.

A reader that must not act on an object older than one it wrote or read itself records that
object's resourceVersion as the key's *floor* (``note``); ``fresh(key, held)`` is False until the
index holds that version or a later one (``rv_at_least``), and the reader goes to the API server
meanwhile. A floor is dropped after ``FLOOR_SECONDS`` whatever happens (an object written again by
someone else at a version that never compares), so a reader falls back to the index, which
conditional writes keep safe. kube.py is the one user (through indexes.IndexView).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

FLOOR_SECONDS = 30.0
GONE = "gone"
"""A floor meaning: deleted by us; fresh once the index no longer holds the object."""
STALE = ""
"""A floor meaning: behind, whatever it holds; fresh once the caller has read live and noted it."""

HeldVersion = Callable[[str], "str | None | bool"]
"""The resourceVersion the index holds for a key; None when it holds no such object."""


def rv_at_least(rv: str | None, floor: str) -> bool:
    """Whether ``rv`` is ``floor`` or later. resourceVersions are compared as the integers the API
    server gives out (etcd revisions); anything else counts only when equal."""
    if rv is None:
        return False
    if rv == floor:
        return True
    if rv.isdigit() and floor.isdigit():
        return int(rv) >= int(floor)
    return False


class ReadYourWrites:
    """Floors per key (``namespace/name``) over what ``held(key)`` says the index holds."""

    def __init__(self, held: Callable[[str], str | None], clock: Callable[[], float] = time.monotonic):
        self._held = held
        self._clock = clock
        self._lock = threading.Lock()
        self._floors: dict[str, tuple[str, float]] = {}

    def _reached(self, key: str, floor: str) -> bool:
        if floor == STALE:
            return False
        held = self._held(key)
        if floor == GONE:
            return held is None
        return rv_at_least(held, floor)

    def note(self, key: str, resource_version: str | None) -> None:
        """The caller wrote or read ``key`` at this version (``GONE``: deleted it)."""
        if not resource_version:
            return
        with self._lock:
            if self._reached(key, resource_version):
                self._floors.pop(key, None)
            else:
                self._floors[key] = (resource_version, self._clock() + FLOOR_SECONDS)

    def invalidate(self, key: str) -> None:
        """``key`` is known to be behind (a conditional write conflicted): not fresh until the
        caller reads it live and notes what it read (or ``FLOOR_SECONDS`` pass)."""
        with self._lock:
            self._floors[key] = (STALE, self._clock() + FLOOR_SECONDS)

    def fresh(self, key: str) -> bool:
        """The index holds at least what the caller last wrote or read of ``key``."""
        with self._lock:
            floor = self._floors.get(key)
            if floor is None:
                return True
            if self._reached(key, floor[0]) or self._clock() >= floor[1]:
                del self._floors[key]
                return True
            return False

    def fresh_prefix(self, prefix: str) -> bool:
        """``fresh`` for every key that starts with ``prefix`` (``namespace/``: a list in it)."""
        with self._lock:
            keys = [k for k in self._floors if k.startswith(prefix)]
        return all(self.fresh(k) for k in keys)
