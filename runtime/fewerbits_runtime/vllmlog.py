"""What vLLM's own log says when it dies: its root cause, for the container's termination message.

vLLM runs its engine core in a child process. When that process fails at start (a format with no
kernel on this GPU, a cache that does not fit), the API server ends with its own wrapper,
``RuntimeError: Engine core initialization failed. See root cause above``, after a long traceback
of its own; the kubelet's ``FallbackToLogsOnError`` keeps only the last 2,048 bytes of the log, so
without this the model's condition would say "see root cause above" and not the cause. The launcher
(launch.py ``supervise``) keeps the end of vLLM's output and writes this line as its termination
message. Standard library only: it is copied into the vLLM image with the launcher.
"""

from __future__ import annotations

import re

_LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\))?\s*(?:(?:ERROR|WARNING|INFO|DEBUG) \S+ \S+ \[[^\]]*\]\s?)?")
"""vLLM's prefix on a process's log lines: ``(EngineCore pid=7) ERROR 11-26 09:43:58 [core.py:1512] ``."""
_EXCEPTION_LINE = re.compile(r"^[\w.]*(?:Error|Exception)\b[^:]*:.*$")
_WRAPPERS = ("Engine core initialization failed", "EngineCore encountered an issue")
"""The API server's own lines when its engine core died: they name no cause ("See root cause above")."""
_NOT_CONTINUATION = ("Traceback", "File ", "During handling", "The above exception", "Process ", "[")
CONTINUATION_LINES = 5
"""vLLM lists the kernels it tried, and why each refused, on the lines after "Reasons:"."""


def root_cause(log_text: str, limit: int = 600) -> str | None:
    """vLLM's first exception line that is not the API server's wrapper (the engine core's own
    error, printed above the wrapper), with the lines of the same process that continue its
    message, or None (no exception: an argument error, or a clean exit)."""
    lines = []
    for raw in log_text.splitlines():
        m = _LOG_PREFIX.match(raw.strip())
        lines.append((m.group(1), raw.strip()[m.end():].strip()))
    for i, (proc, line) in enumerate(lines):
        if _EXCEPTION_LINE.match(line) and not any(w in line for w in _WRAPPERS):
            more = []
            for nxt_proc, nxt in lines[i + 1:i + 1 + CONTINUATION_LINES]:
                if nxt_proc != proc or not nxt or nxt.startswith(_NOT_CONTINUATION):
                    break
                more.append(nxt)
            return " ".join([line, *more])[:limit]
    return None
