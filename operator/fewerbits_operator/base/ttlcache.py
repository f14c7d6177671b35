"""Values kept for a while: what no kopf index serves and observe reads often (a namespace's labels,
the Secrets a model names)."""

from __future__ import annotations

import copy
import threading
import time
from typing import Any, Callable


class TTLCache:
    """Values kept for ``ttl`` seconds (0: not kept)."""

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._values: dict[Any, tuple[float, Any]] = {}

    def get(self, key: Any, load: Callable[[], Any], keep: Callable[[Any], bool] = lambda _: True) -> Any:
        """The kept value of ``key``, else ``load()``'s, kept when ``keep`` says so."""
        if self.ttl <= 0:
            return load()
        now = self._clock()
        with self._lock:
            hit = self._values.get(key)
            if hit is not None and hit[0] > now:
                return copy.deepcopy(hit[1])
        value = load()
        if keep(value):
            with self._lock:
                self._values[key] = (now + self.ttl, value)
        return copy.deepcopy(value)
