"""kopf registration only: each handler is a one-line delegation (STYLE.md, crate-operator).

One idempotent reconcile runs on resume/create/update of a QuantizedModel, on every event of the
Jobs and Deployments it owns, on policy changes, and from a periodic resync loop. The resync is a
plain thread, not a kopf timer: kopf timers force a finalizer on every object, and fewerbits adds
finalizers only when artifact retention needs one.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import kopf

from fewerbits_api.base import GROUP, VERSION
from fewerbits_api.policy import PLURAL as POLICY_PLURAL
from fewerbits_api.quantizedmodel import PLURAL as QM_PLURAL

from .runner import Operator

MANAGED = {"app.kubernetes.io/managed-by": "fewerbits"}
_operator = Operator()


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    _operator.start(settings)


@kopf.on.cleanup()
def cleanup(**_: Any) -> None:
    _operator.stop()


@kopf.on.resume(GROUP, VERSION, QM_PLURAL)
@kopf.on.create(GROUP, VERSION, QM_PLURAL)
@kopf.on.update(GROUP, VERSION, QM_PLURAL)
def model_changed(namespace: str, name: str, **_: Any) -> None:
    _operator.reconcile(namespace, name)


@kopf.on.event("batch", "v1", "jobs", labels=MANAGED)
@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
def child_changed(body: kopf.Body, **_: Any) -> None:
    _operator.reconcile_owners(body)


@kopf.on.event(GROUP, VERSION, POLICY_PLURAL)
def policy_changed(type: str | None, **_: Any) -> None:
    if type is not None:  # None is the initial listing, covered by resume
        _operator.reconcile_all()


logging.getLogger("kopf.objects").setLevel(logging.WARNING)
_ = threading  # the resync thread lives in runner.Operator
