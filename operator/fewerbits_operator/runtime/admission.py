"""The reads and the lock behind the cap on running quantization Jobs (``queueing.py`` decides).

Several workers reconcile at once: two passes that both read "3 of 4 running" would both start
a Job. So a pass that may start one (a planned artifact with neither a manifest nor a Job: see
``Observed.needs_admission``) reads the queue's facts, decides and executes while holding one
lock, and the Jobs it created are remembered here until the watched cache of Jobs shows them
(the cache lags the create by a watch event). Passes that start nothing never take the lock.
One operator replica decides (the chart runs one), so a process-wide lock is the whole story.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from fewerbits_operator.base.actions import CreateJob
from fewerbits_operator.core.outcome import Outcome
from fewerbits_operator.base.kube import Kube
from fewerbits_operator.base.queueing import QueueFacts, facts_from, queued_entries

LEDGER_SECONDS = 60.0
"""A created Job the cache has not shown after this long is forgotten (its create failed)."""


class AdmissionGate:
    def __init__(self, kube: Kube, namespaces: list[str], clock: Callable[[], float] = time.monotonic):
        self.kube = kube
        self.namespaces = namespaces
        self.clock = clock
        self.lock = threading.Lock()
        self._created: dict[tuple[str, str], float] = {}

    def facts(self) -> QueueFacts:
        """The queue's facts now: the Jobs from the watched cache plus those this process created
        that it does not show yet, and the queued entries of every model. Call under ``lock``."""
        facts = facts_from(self.kube.list_managed_jobs(self.namespaces),
                           self.kube.list_models_where(self.namespaces, queued_entries))
        now = self.clock()
        self._created = {ref: t for ref, t in self._created.items()
                         if ref not in facts.existing and now - t < LEDGER_SECONDS}
        pending = frozenset(self._created)
        return QueueFacts(running=facts.running | pending, existing=facts.existing | pending, waiting=facts.waiting)

    def record(self, outcome: Outcome) -> None:
        """The Jobs a pass asked to create (under ``lock``, after executing it)."""
        now = self.clock()
        for action in outcome.actions:
            if isinstance(action, CreateJob) and not (action.job.get("spec") or {}).get("suspend"):
                md = action.job["metadata"]
                self._created[(md["namespace"], md["name"])] = now
