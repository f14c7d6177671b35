"""Reconcile one QuantizedModel: observe → decide → execute.

- ``observe.Observer.observe`` reads everything a decision needs into one immutable ``Observed``;
- ``decide.decide`` (pure) turns it into the new status, typed actions and events;
- ``execute.execute`` is the only code that writes.

Level-triggered and idempotent: running it twice changes nothing the second time, and status is
written only when it changed. An exception (API error, conflict) leaves status as it was: a
half-computed pass is never recorded as observedGeneration; a conflict observes again at once (up
to three times), anything else is retried by the work queue with back-off.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from fewerbits_operator.base import metrics
from fewerbits_operator.runtime.admission import AdmissionGate
from fewerbits_operator.core.decide import decide
from fewerbits_operator.core.execute import StatusConflict, execute
from fewerbits_operator.base.kube import Kube
from fewerbits_operator.core.observe import Observer
from fewerbits_operator.base.settings import OperatorSettings
from fewerbits_operator.base.storage import ObjectStore

log = logging.getLogger("fewerbits.reconcile")
CONFLICT_ATTEMPTS = 3

__all__ = ["Reconciler", "StatusConflict"]


class Reconciler:
    """Holds the collaborators; ``reconcile(namespace, name)`` is safe to call from any thread (one
    reconcile per model at a time)."""

    def __init__(self, kube: Kube, store: ObjectStore, settings: OperatorSettings):
        self.kube = kube
        self.store = store
        self.settings = settings
        self.observer = Observer(kube, store, settings)
        self.admission = AdmissionGate(kube, settings.namespaces)
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def reconcile(self, namespace: str, name: str) -> None:
        started = time.monotonic()
        with self._lock(namespace, name):
            try:
                for attempt in range(CONFLICT_ATTEMPTS):
                    body = self.kube.get_model(namespace, name)
                    if body is None or body["metadata"].get("deletionTimestamp"):
                        metrics.forget_model(namespace, name)
                        return
                    try:
                        self.reconcile_body(body)
                        break
                    except StatusConflict:
                        if attempt == CONFLICT_ATTEMPTS - 1:
                            raise
            except Exception:
                metrics.RECONCILE_ERRORS.inc()
                metrics.RECONCILES.labels(result="error").inc()
                raise
            else:
                metrics.RECONCILES.labels(result="ok").inc()
                metrics.MODEL_RECONCILES.labels(namespace, name).inc()
            finally:
                metrics.RECONCILE_DURATION.observe(time.monotonic() - started)

    def reconcile_body(self, body: dict) -> bool:
        """One pass over a model as read; returns whether anything was written."""
        observed = self.observer.observe(body)
        if observed.needs_admission:
            # Whether a Job may start is read, decided and executed under one lock (admission.py).
            with self.admission.lock:
                observed = dataclasses.replace(observed, queue=self.admission.facts())
                outcome = decide(observed, self.settings)
                try:
                    wrote = execute(self.kube, body, outcome, self.store)
                finally:
                    self.admission.record(outcome)
        else:
            outcome = decide(observed, self.settings)
            wrote = execute(self.kube, body, outcome, self.store)
        metrics.observe_model(observed.namespace, observed.name, outcome.status)
        return wrote
