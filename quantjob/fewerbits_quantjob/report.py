"""What the Job tells people and the operator: stage lines in the log, and the termination message.

No torch here: the operator's tests import this module to parse what the Job writes.

Log lines (stderr, one per event, ``key=value`` so they grep and parse)::

    fewerbits-quantjob stage=fetch event=start progress=2% elapsed=0.4s
    fewerbits-quantjob stage=fetch event=end progress=15% elapsed=3.1s took=2.7s
    fewerbits-quantjob stage=upload event=progress progress=91% elapsed=40.2s bytes=1.2GiB/2.0GiB rate=180.4MiB/s

Nothing that could hold a credential is logged: no environment dumps, URLs lose their userinfo
and the values of the credential variables are masked wherever they would appear.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from fewerbits_api.jobcontract import (
    ENV_HF_TOKEN,
    ENV_SOURCE_ACCESS_KEY,
    ENV_SOURCE_SECRET_KEY,
    ENV_STORAGE_ACCESS_KEY,
    ENV_STORAGE_SECRET_KEY,
    TERMINATION_MESSAGE_MAX_BYTES,
)

log = logging.getLogger("fewerbits-quantjob")

ADAPTER_SECRET_PREFIX = "FEWERBITS_ADAPTER_"
"""Each LoRA adapter's Secret keys (fewerbits_api.adapters.adapter_env): every one is a secret."""
SECRET_ENV_NAMES = (ENV_HF_TOKEN, ENV_SOURCE_ACCESS_KEY, ENV_SOURCE_SECRET_KEY, ENV_STORAGE_ACCESS_KEY,
                    ENV_STORAGE_SECRET_KEY, "AWS_SESSION_TOKEN", "HUGGING_FACE_HUB_TOKEN")

# Where each stage starts and ends on the overall progress scale (percent). Quantization and
# evaluation dominate on a GPU; fetch and upload dominate for large models on slow storage.
STAGE_SPAN: dict[str, tuple[int, int]] = {
    "contract": (0, 1),
    "cache-check": (1, 2),
    "fetch": (2, 15),
    "calibration-data": (15, 17),
    "eval-data": (17, 17),
    "quantize": (17, 60),
    "save": (60, 65),
    "evaluate": (65, 85),
    "upload": (85, 99),
    "manifest": (99, 100),
}

_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]+@")
# Query parameters that carry credentials in presigned URLs and token-bearing links.
_SECRET_QUERY = re.compile(r"(?i)\b(X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token|Signature|token|access_token|"
                           r"AWSAccessKeyId)=[^&\s\"']+")
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")


def redact(text: str, secrets: Mapping[str, str] | None = None) -> str:
    """Mask userinfo in URLs, credential query parameters, Hub tokens and the given secret values."""
    text = _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}***@", text)
    text = _SECRET_QUERY.sub(lambda m: f"{m.group(1)}=***", text)
    text = _HF_TOKEN.sub("hf_***", text)
    for value in (secrets or {}).values():
        if value and len(value) >= 4:  # a 1-3 character "secret" would mask half the message
            text = text.replace(value, "***")
    return text


def secret_values(env: Mapping[str, str]) -> dict[str, str]:
    """The credential values present in ``env`` (to mask them, never to print them)."""
    return {k: env[k] for k in env if env.get(k) and (k in SECRET_ENV_NAMES or k.startswith(ADAPTER_SECRET_PREFIX))}


def one_line(text: str, limit: int = 600) -> str:
    """Collapse whitespace to one line and cut it to ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1024
    return f"{n:.1f}TiB"


@dataclass
class Progress:
    """Stage timer and logger for one Job run."""

    secrets: Mapping[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    timings: dict[str, float] = field(default_factory=dict)
    current: str = "contract"

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def line(self, stage: str, event: str, percent: float, **extra: object) -> None:
        parts = [f"stage={stage}", f"event={event}", f"progress={percent:.0f}%", f"elapsed={self.elapsed():.1f}s"]
        parts += [f"{k}={v}" for k, v in extra.items()]
        log.info(redact(" ".join(parts), self.secrets))

    def note(self, message: str) -> None:
        """A free-text line attributed to the current stage."""
        log.info(redact(f"stage={self.current} {one_line(message, 2000)}", self.secrets))

    @contextmanager
    def stage(self, name: str) -> Iterator[StageHandle]:
        start_pct, end_pct = STAGE_SPAN[name]
        self.current = name
        self.line(name, "start", start_pct)
        t0 = time.monotonic()
        handle = StageHandle(self, name, start_pct, end_pct)
        yield handle
        took = time.monotonic() - t0
        self.timings[name] = round(self.timings.get(name, 0.0) + took, 3)
        self.line(name, "end", end_pct, took=f"{took:.1f}s", **handle.summary)


@dataclass
class StageHandle:
    progress: Progress
    name: str
    start_pct: int
    end_pct: int
    summary: dict[str, object] = field(default_factory=dict)

    def report(self, fraction: float, **extra: object) -> None:
        """A progress line inside the stage; ``fraction`` is how much of the stage is done (0-1)."""
        fraction = min(max(fraction, 0.0), 1.0)
        pct = self.start_pct + (self.end_pct - self.start_pct) * fraction
        self.progress.line(self.name, "progress", pct, **extra)


def configure_logging(stream=None) -> None:
    """One plain line per record on stderr (kubectl logs shows it as is)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s", "%Y-%m-%dT%H:%M:%S"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


_PROTECTED = frozenset({"result", "stage", "reason", "key", "format"})


def termination_message(summary: Mapping[str, object], limit: int = TERMINATION_MESSAGE_MAX_BYTES) -> str:
    """Compact JSON of ``summary`` that fits in ``limit`` bytes (the kubelet keeps at most 4 KiB).

    Long strings are shortened first (the message, then any other), never the structure; if the
    summary still does not fit, only the fields the operator acts on are kept. The result always
    parses as JSON.
    """
    data = json.loads(json.dumps(summary, default=str))

    def encoded(d: object) -> str:
        return json.dumps(d, separators=(",", ":"), ensure_ascii=False, allow_nan=False)

    text = encoded(data)
    if len(text.encode()) <= limit:
        return text
    # Shorten the longest free-text values (never the fields the operator matches on), one at a
    # time, cutting on a UTF-8 boundary, until it fits.
    for _ in range(64):
        strings = [(k, v) for k, v in data.items() if isinstance(v, str) and k not in _PROTECTED and v]
        if not strings:
            break
        key, value = max(strings, key=lambda kv: len(kv[1].encode()))
        excess = len(text.encode()) - limit
        keep_bytes = max(0, len(value.encode()) - excess - 8)
        data[key] = value.encode()[:keep_bytes].decode("utf-8", errors="ignore") + "…" if keep_bytes else ""
        text = encoded(data)
        if len(text.encode()) <= limit:
            return text
    essential = {k: data[k] for k in (*sorted(_PROTECTED), "sizeBytes") if k in data}
    if isinstance(data.get("quality"), dict) and "passed" in data["quality"]:
        essential["quality"] = {"passed": data["quality"]["passed"]}
    essential["truncated"] = True
    return encoded(essential)[:limit]
