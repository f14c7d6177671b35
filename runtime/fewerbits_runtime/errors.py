"""Failures the serving pod's containers report, with their exit codes and termination message.

The kubelet copies the file at ``terminationMessagePath`` (default ``/dev/termination-log``) into
the container's status, so the operator can turn a failed init container into a condition that
names the cause instead of "Init:CrashLoopBackOff". The message is one line of JSON, at most
4 KiB (the kubelet's limit, ``fewerbits_api.names.TERMINATION_MESSAGE_MAX_BYTES``).
"""

from __future__ import annotations

import json
import logging
import os

# fewerbits_api.names is standard library only; the launch wrapper carries a copy into the vLLM image.
from fewerbits_api.names import TERMINATION_LOG_DEFAULT, TERMINATION_LOG_ENV, TERMINATION_MESSAGE_MAX_BYTES

log = logging.getLogger("fewerbits.runtime")

# Exit codes: stable, documented in runtime/README.md; the operator maps them to reasons.
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_ARTIFACT_MISSING = 10
EXIT_ACCESS_DENIED = 11
EXIT_INTEGRITY = 12
EXIT_DISK_FULL = 13
EXIT_STORAGE = 14
EXIT_MANIFEST_INVALID = 15
EXIT_GPU_INCOMPATIBLE = 20
EXIT_ENGINE_DIED = 21
"""vLLM ended by itself with status 0 after its engine died (vLLM 0.32 does: its API server shuts
down cleanly on EngineDeadError); the launcher turns that into a failure (launch.py ``supervise``)."""
EXIT_EXEC_FAILED = 127


class RuntimeFailure(Exception):
    """A failure with a reason (CamelCase, for conditions) and a message a person can act on."""

    reason = "Failed"
    exit_code = EXIT_STORAGE

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class UsageError(RuntimeFailure):
    reason = "InvalidArguments"
    exit_code = EXIT_USAGE


class ArtifactMissing(RuntimeFailure):
    reason = "ArtifactMissing"
    exit_code = EXIT_ARTIFACT_MISSING


class AccessDenied(RuntimeFailure):
    reason = "StorageAccessDenied"
    exit_code = EXIT_ACCESS_DENIED


class IntegrityError(RuntimeFailure):
    reason = "DigestMismatch"
    exit_code = EXIT_INTEGRITY


class DiskFull(RuntimeFailure):
    reason = "DiskFull"
    exit_code = EXIT_DISK_FULL


class StorageError(RuntimeFailure):
    reason = "StorageError"
    exit_code = EXIT_STORAGE


class ManifestInvalid(RuntimeFailure):
    reason = "ManifestInvalid"
    exit_code = EXIT_MANIFEST_INVALID


class GPUIncompatible(RuntimeFailure):
    reason = "GPUIncompatible"
    exit_code = EXIT_GPU_INCOMPATIBLE


class ExecFailed(RuntimeFailure):
    reason = "ExecFailed"
    exit_code = EXIT_EXEC_FAILED


def termination_message(component: str, reason: str, message: str, exit_code: int,
                        **details: object) -> str:
    """One line of JSON, at most TERMINATION_MESSAGE_MAX_BYTES bytes (the message is shortened,
    never the structure)."""
    doc: dict[str, object] = {"component": component, "reason": reason, "exitCode": exit_code,
                              **details, "message": message}
    line = json.dumps(doc, separators=(",", ":"), ensure_ascii=True, default=str)
    if len(line.encode()) <= TERMINATION_MESSAGE_MAX_BYTES:
        return line
    doc["message"] = ""
    room = TERMINATION_MESSAGE_MAX_BYTES - len(json.dumps(doc, separators=(",", ":"),
                                                          ensure_ascii=True, default=str)) - 8
    short = message
    while short and len(json.dumps(short, ensure_ascii=True)) > room:
        short = short[: max(0, len(short) - max(1, len(short) // 8))]
    doc["message"] = short + "..."
    line = json.dumps(doc, separators=(",", ":"), ensure_ascii=True, default=str)
    if len(line.encode()) > TERMINATION_MESSAGE_MAX_BYTES:  # details alone too large: keep the essentials
        line = json.dumps({"component": component, "reason": reason, "exitCode": exit_code,
                           "message": short[:1024] + "..."}, separators=(",", ":"), ensure_ascii=True)
    return line


def write_termination_message(line: str) -> None:
    """Write the termination message; never fail the process over it (running outside a kubelet
    there may be no writable /dev/termination-log)."""
    path = os.environ.get(TERMINATION_LOG_ENV) or TERMINATION_LOG_DEFAULT
    try:
        with open(path, "w", encoding="ascii") as f:
            f.write(line + "\n")
    except OSError as e:
        log.debug("could not write the termination message to %s: %s", path, e)
