"""Which quantization Jobs may start now: the operator-wide cap on running Jobs and the queue in
front of it. Pure: facts in, decisions out (``admission.py`` reads the facts, ``decide`` asks).

The cap (``OperatorSettings.max_running_quantization_jobs``) counts the fewerbits Jobs that hold
or will hold a GPU: every managed Job that has not finished and is not suspended, in every
watched namespace. A Job over the cap is simply not created yet; its model records why in
``status.artifacts[].queue`` (``reason: OperatorCap``, a position, and ``since``, the time the
model first wanted the Job and could not start it). Every model computes the same order from the
same facts: by ``since``, then namespace, model name and Job name. The queued entries of other
models come from their status (the watched cache of models), so the order survives a restart of
the operator and needs no store of its own.

Kueue: a policy's ``quantizationJob.kueue`` hands its Jobs to Kueue instead. They are created at
once, suspended, and Kueue admits them against its ClusterQueue's quota; the operator never holds
them back. Once admitted (no longer suspended) they run and count towards the cap like any other,
so the cap bounds every running fewerbits Job and holds back only the Jobs that are not Kueue's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from fewerbits_api.quantizedmodel import ArtifactQueue

KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""The label Kueue's batch/job integration reads: the LocalQueue (in the Job's namespace)."""
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
"""Kueue's WorkloadPriorityClass of a Job."""
OPERATOR_CAP = "OperatorCap"
KUEUE = "Kueue"


@dataclass(frozen=True, order=True)
class Waiter:
    """One quantization Job a model wants and could not start. The field order is the queue's
    order (dataclass ordering compares them in turn)."""

    since: str
    namespace: str
    model: str
    job: str


@dataclass(frozen=True)
class QueueFacts:
    """What every admission decision reads, the same for every model."""

    running: frozenset[tuple[str, str]] = frozenset()
    """(namespace, Job) of the managed Jobs that run or will: not finished, not suspended."""
    existing: frozenset[tuple[str, str]] = frozenset()
    """(namespace, Job) of every managed Job that exists (a waiter whose Job exists waits no more)."""
    waiting: tuple[Waiter, ...] = ()
    """The Jobs other models record as queued under the cap (their ``status.artifacts[].queue``)."""


def job_finished(job: Mapping[str, Any]) -> bool:
    conds = (job.get("status") or {}).get("conditions") or []
    return any(c.get("type") in ("Complete", "Failed", "SuccessCriteriaMet") and c.get("status") == "True"
               for c in conds)


def job_suspended(job: Mapping[str, Any]) -> bool:
    return bool((job.get("spec") or {}).get("suspend"))


def job_holds_slot(job: Mapping[str, Any]) -> bool:
    """Counts towards the cap: it runs, or its pods wait for a node (they will run)."""
    return not job_finished(job) and not job_suspended(job)


def slot_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> bool:
    """A Job event that can move the queue: a Job created or removed, or one that stopped or
    started holding a slot (finished, suspended, admitted by Kueue)."""
    if old is None or new is None:
        return True
    return job_holds_slot(old) != job_holds_slot(new)


def queued_entries(model: Mapping[str, Any]) -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """(artifact status, its queue) of a raw model's artifacts that wait."""
    out = []
    for art in (model.get("status") or {}).get("artifacts") or []:
        if isinstance(art, Mapping) and isinstance(art.get("queue"), Mapping):
            out.append((art, art["queue"]))
    return out


def waiters_of(models: Iterable[Mapping[str, Any]]) -> tuple[Waiter, ...]:
    """The Jobs waiting under the cap, as the models' status records them."""
    out = []
    for m in models:
        md = m.get("metadata") or {}
        for art, q in queued_entries(m):
            if q.get("reason") == OPERATOR_CAP and art.get("job") and q.get("since"):
                out.append(Waiter(str(q["since"]), str(md.get("namespace")), str(md.get("name")), str(art["job"])))
    return tuple(out)


def facts_from(jobs: Iterable[Mapping[str, Any]], models: Iterable[Mapping[str, Any]]) -> QueueFacts:
    jobs = list(jobs)
    ref = lambda j: ((j.get("metadata") or {}).get("namespace"), (j.get("metadata") or {}).get("name"))  # noqa: E731
    return QueueFacts(running=frozenset(ref(j) for j in jobs if job_holds_slot(j)),
                      existing=frozenset(ref(j) for j in jobs), waiting=waiters_of(models))


@dataclass
class Admission:
    """The admissions of one reconcile pass: ``admit`` in turn for each Job the model wants; a Job
    admitted here holds a slot for the later ones of the same pass."""

    cap: int
    """0: no cap."""
    facts: QueueFacts
    admitted: list[tuple[str, str]] = field(default_factory=list)

    @property
    def running(self) -> int:
        return len(self.facts.running | set(self.admitted))

    def admit(self, mine: Waiter) -> int | None:
        """None: ``mine`` may start now. Else its position in the queue (1 starts next)."""
        if self.cap <= 0:
            self.admitted.append((mine.namespace, mine.job))
            return None
        # One entry per Job (two models of a namespace may share one), at its earliest; a Job that
        # exists (started meanwhile) or was admitted in this pass waits no more.
        gone = self.facts.existing | set(self.admitted)
        first: dict[tuple[str, str], Waiter] = {}
        for w in (*self.facts.waiting, mine):
            ref = (w.namespace, w.job)
            if ref in gone and w is not mine:
                continue
            if ref not in first or w < first[ref]:
                first[ref] = w
        order = sorted(first.values())
        rank = next(i for i, w in enumerate(order, 1) if (w.namespace, w.job) == (mine.namespace, mine.job))
        free = max(0, self.cap - self.running)
        if rank <= free:
            self.admitted.append((mine.namespace, mine.job))
            return None
        return rank - free


def operator_queue(position: int, since: str) -> ArtifactQueue:
    return ArtifactQueue(reason=OPERATOR_CAP, position=position, since=since)


def kueue_queue(local_queue: str | None, since: str) -> ArtifactQueue:
    return ArtifactQueue(reason=KUEUE, since=since, localQueue=local_queue)


def kueue_labels(local_queue: str, priority_class: str | None) -> dict[str, str]:
    labels = {KUEUE_QUEUE_LABEL: local_queue}
    if priority_class:
        labels[KUEUE_PRIORITY_LABEL] = priority_class
    return labels
