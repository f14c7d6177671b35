"""How many malloc arenas the process may use: glibc's ``M_ARENA_MAX``, set before any thread.

CPython's small objects come from its own pools, but every larger block (a dict of more than a
few keys, a list, a response body) comes from glibc's malloc. glibc gives each new thread its
own arena on its first allocation (a free one left by an exited thread, else a new one), up to
eight per core, and memory freed in an arena stays with it: the operator's threads (kopf's
executor, the work queue's workers, the probes) each keep their own high-water mark of free
blocks. Two arenas keep two.

``limit(n)`` is the same setting as the environment's ``MALLOC_ARENA_MAX``, made by the process
itself so that it holds wherever the operator runs (the chart's pod, ``bench/load_models.py``,
a developer's shell). It must run before the first thread starts: an arena made already stays.
Not glibc (musl has no ``mallopt``): nothing changes, and it says so.
"""

from __future__ import annotations

import ctypes

M_ARENA_MAX = -8
"""glibc's malloc.h."""
ARENAS = 2


def limit(arenas: int = ARENAS) -> bool:
    """True when the C library took the limit."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_ARENA_MAX, arenas) == 1
