"""Why a quantization Job failed, as a typed reason: OOM-killed, evicted, out of disk, past its
deadline, or a failure of its own (the Job's termination message). Pure; ``decide`` records the
result in ``status.artifacts[].failure`` and the Quantized condition.

The kubelet reports these causes in pod status, not in the Job: a container killed at its memory
limit has ``lastState/state.terminated.reason: OOMKilled``; a pod evicted has ``status.reason:
Evicted`` and a message naming the resource (``The node was low on resource: ephemeral-storage``,
``Pod ephemeral local storage usage exceeds the total limit of containers 224Gi``, ``... memory``).
A Job past ``activeDeadlineSeconds`` has the Failed condition reason ``DeadlineExceeded``. Each
message names the resource, the figure the Job asked for and how to raise it.
"""

from __future__ import annotations

from fewerbits_api.conditions import Reason

from fewerbits_operator.base.observed import JobFacts

RAISE_MEMORY = ("raise the operator's floor FEWERBITS_JOB_MEMORY_REQUEST (chart: config.quantizationJob.memoryRequest) "
                "above it, then edit the model's spec to retry")
RAISE_DISK = ("raise the operator's FEWERBITS_JOB_EPHEMERAL_STORAGE_REQUEST floor (chart: "
              "config.quantizationJob.ephemeralStorageRequest), or lower FEWERBITS_JOB_VOLUME_THRESHOLD_GIB so the work "
              "directory goes to a volume from a StorageClass, then edit the model's spec to retry")


def classify(job: JobFacts) -> tuple[str, str] | None:
    """(reason, message) when the Job failed for a resource or its deadline; None: its own failure
    (the termination message says what)."""
    memory = job.limits.get("memory", "unset")
    disk = job.limits.get("ephemeral-storage", "unset")
    for pod, message in job.evictions:
        text = message.lower()
        if "ephemeral" in text or "disk" in text or "storage" in text:
            return Reason.JOB_OUT_OF_DISK, (
                f"Job {job.name} ran out of disk: pod {pod} was evicted ({message.strip()[:300]}); the Job asks for "
                f"ephemeral-storage {disk}; {RAISE_DISK}")
        if "memory" in text:
            return Reason.JOB_EVICTED, (
                f"Job {job.name}: pod {pod} was evicted for memory ({message.strip()[:300]}); the Job asks for "
                f"memory {memory}: if it used more than that, {RAISE_MEMORY}; else the node was overcommitted by "
                "other pods")
        return Reason.JOB_EVICTED, (f"Job {job.name}: pod {pod} was evicted ({message.strip()[:300] or 'no message'}); "
                                    "the Job retries on another node up to its backoffLimit")
    for t in job.terminations:
        if t.reason == "OOMKilled":
            return Reason.JOB_OOM_KILLED, (
                f"Job {job.name} was OOM-killed: container {t.container} of pod {t.pod} exceeded its memory limit "
                f"of {memory}; {RAISE_MEMORY}")
    cond = job.failed_condition or {}
    if cond.get("reason") == "DeadlineExceeded":
        deadline = job.active_deadline_seconds
        return Reason.JOB_DEADLINE_EXCEEDED, (
            f"Job {job.name} ran past its activeDeadlineSeconds ({deadline if deadline is not None else 'unset'} s, "
            "three times the estimate in status.plan.quantizationJobs); set the policy's "
            "rules.quantizationJob.activeDeadlineSeconds higher, then edit the model's spec to retry")
    return None
