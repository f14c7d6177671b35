"""Container terminations: read from pods once, and told as one line. Pure.

Every reader of a termination message lives here (the serving runtime's, the quantization Job's
and the canary Job's JSON summaries, or the last line of a plain message), below ``decide``,
``canary`` and ``observe``, which import it. The messages are the contracts of those programs
(``fewerbits_api.names.TERMINATION_LOG_DEFAULT``; ``fewerbits_api.canary.CanaryTermination``).
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from fewerbits_api.canary import CanaryTermination

from fewerbits_operator.base.observed import ContainerTermination, JobFacts, JobState

NOT_JSON = object()
"""``decoded``'s answer for a message that is not JSON."""


def decoded(message: str) -> Any:
    """The message as JSON, or ``NOT_JSON``."""
    try:
        return json.loads(message)
    except ValueError:
        return NOT_JSON


# ------------------------------------------------------------------ reading pods


def _newest_first(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "", reverse=True)


def terminations(pods: list[dict[str, Any]], *, init: bool = True) -> tuple[ContainerTermination, ...]:
    """Failed container terminations of ``pods``, newest pod first."""
    out: list[ContainerTermination] = []
    for pod in _newest_first(pods):
        ps = pod.get("status") or {}
        statuses = ((ps.get("initContainerStatuses") or []) if init else []) + (ps.get("containerStatuses") or [])
        for cs in statuses:
            state = cs.get("state") or {}
            term = state.get("terminated") or (cs.get("lastState") or {}).get("terminated") or {}
            if not term:
                continue
            out.append(ContainerTermination(
                pod=pod["metadata"]["name"], container=str(cs.get("name")),
                exit_code=int(term.get("exitCode") or 0), reason=str(term.get("reason") or ""),
                message=str(term.get("message") or ""),
                running_ready="running" in state and bool(cs.get("ready"))))
    return tuple(out)


def evictions(pods: list[dict[str, Any]]) -> tuple[tuple[str, str], ...]:
    """(pod, message) of the evicted ``pods`` (status.reason Evicted), newest first."""
    return tuple((p["metadata"]["name"], str((p.get("status") or {}).get("message") or ""))
                 for p in _newest_first(pods) if (p.get("status") or {}).get("reason") == "Evicted")


# ------------------------------------------------------------------ telling them


_BOILERPLATE = ("For further information visit",)
"""Trailing lines that name nothing (pydantic's link under each validation error)."""
_EXCEPTION = re.compile(r"^[\w.]*(Error|Exception)\b[^:]*:|\berror: ")
TAIL_LINES = 6
"""How far up from the end a failing program's own error line is looked for."""


def failure_line(message: str, limit: int = 600) -> str:
    """The line of a plain termination message (the end of a program's log) that says why: the
    last exception or ``error:`` line among the last few, with what follows it (pydantic puts the
    field's name on the next line: ``ValidationError: 1 validation error for SchedulerConfig
    max_num_seqs Input should be greater than 0``), else the last line that is not boilerplate."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip() and not ln.strip().startswith(_BOILERPLATE)]
    tail = lines[-TAIL_LINES:]
    for i in range(len(tail) - 1, -1, -1):
        if _EXCEPTION.search(tail[i]):
            return " ".join(tail[i:])[:limit]
    return tail[-1][:limit] if tail else ""


def termination_text(t: ContainerTermination) -> str:
    """A container's termination as one line: the runtime's JSON message when it wrote one."""
    msg = t.message.strip()
    doc = decoded(msg) if msg.startswith("{") else None
    if isinstance(doc, dict):
        parts = [str(doc.get("reason") or t.reason or "Error"), str(doc.get("message") or "")]
        return f"exit {t.exit_code}, " + ": ".join(p for p in parts if p)[:600]
    last = failure_line(msg)
    return f"exit {t.exit_code}, {t.reason or 'Error'}" + (f": {last}" if last else "")


def pod_failure(terms: tuple[ContainerTermination, ...], *, restarted_too: bool = False) -> str | None:
    """Why a variant's pods fail, from their containers' last termination (the runtime's JSON
    termination message: fetch integrity, access denied, GPU mismatch, vLLM's engine dying while
    serving), or None. ``restarted_too``: also a container that restarted and is healthy again (a
    server that died under the canary's requests and came back still failed them)."""
    for t in terms:
        if t.exit_code == 0 or (t.running_ready and not restarted_too):
            continue  # succeeded, or restarted and healthy again
        return f"pod {t.pod} container {t.container}: {termination_text(t)}"
    return None


def job_failure_text(job: JobFacts) -> str:
    """The failed pod's termination message (the quantjob's JSON summary), else the Job's."""
    for t in job.terminations:
        msg = t.message.strip()
        if not msg:
            continue
        summary = decoded(msg)
        if summary is NOT_JSON:
            return f"Job {job.name} failed: {failure_line(msg, 500)}"
        if isinstance(summary, dict):
            parts = [summary.get("stage") and f"stage {summary['stage']}", summary.get("reason"), summary.get("message")]
            return f"Job {job.name} failed: " + ": ".join(str(p) for p in parts if p)[:800]
    cond: Mapping[str, Any] = job.failed_condition or {}
    return f"Job {job.name} failed: {cond.get('reason', '')}: {cond.get('message', '')}".strip()


def json_message(terms: tuple[ContainerTermination, ...]) -> str | None:
    """The first termination message that is a JSON object (a Job's summary), as written."""
    return next((t.message for t in terms if t.message.strip().startswith("{")), None)


def canary_job_error(job: JobFacts, job_message: str | None) -> str:
    """Why the canary's evaluation Job gave no verdict: its ``CanaryTermination``, else how it ended."""
    if job_message:
        try:
            t = CanaryTermination.model_validate_json(job_message)
            return f"{t.outcome}: {t.reason}" if t.reason else t.outcome
        except ValueError:
            pass
    if job.state is JobState.SUCCEEDED:
        return "the Job ended without writing its result"
    return job_failure_text(job)
