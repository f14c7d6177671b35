"""The periodic pass every background loop of the runtime runs (atzero.ZeroRouter,
metricsprobe.MetricsProbe): one pass every ``period`` seconds, measured from the start of the
last, until ``stop``; a failing pass is logged and the next one retries (one model's failure is
the pass's own business). What each pass reads comes from kopf's indexes or a watch, not from a
list per pass, so a pass at rest costs no API request."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable


def run_periodically(stop: threading.Event, period: float, once: Callable[[], Any], what: str,
                     log: logging.Logger) -> None:
    """Thread entry: ``once()`` every ``period`` seconds until ``stop`` is set."""
    while not stop.is_set():
        started = time.monotonic()
        try:
            once()
        except Exception as e:  # noqa: BLE001 - the next pass retries
            log.warning("%s pass failed: %s: %s", what, type(e).__name__, e)
        stop.wait(max(0.0, period - (time.monotonic() - started)))
