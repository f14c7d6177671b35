"""kopf registration only: each handler is a one-line delegation (STYLE.md, crate-operator).

Every handler only enqueues the model's key (runner.Operator, workqueue.py): the operator's own
workers run one idempotent reconcile per key, however many events named it. The handlers are
async and never raise: kopf's threads never block on a reconcile, and kopf never retries one (the
queue does, with back-off). A model's own create/update/resume handler awaits its reconcile so
that kopf's bookkeeping patch comes after the status write, as it did when it reconciled inline.
Resync, Node and QuantizationPolicy changes are the runner's (watched caches in kube.py and a
plain scheduler thread, not kopf timers: kopf timers force a finalizer on every object, and
fewerbits adds finalizers only when artifact retention needs one).
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from fewerbits_api.base import GROUP, VERSION
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
async def model_changed(namespace: str, name: str, **_: Any) -> None:
    await _operator.reconcile_soon(namespace, name)


@kopf.on.event("batch", "v1", "jobs", labels=MANAGED)
@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
async def child_changed(body: kopf.Body, **_: Any) -> None:
    _operator.enqueue_owners(body)


logging.getLogger("kopf.objects").setLevel(logging.WARNING)
