"""Execute: the only code that writes for a reconcile. It applies an ``Outcome`` of ``decide``:

1. Deployments to delete (first: they free the GPUs new Deployments may need),
2. quantization Jobs to create, owners to add to shared Jobs,
3. Deployments to create or replace, the Service to create or repair,
4. the status, as a JSON merge patch conditional on the model's resourceVersion, only when it
   changed,
5. the events (best effort), only when something was written.

Creates treat AlreadyExists as success and deletes NotFound (``Kube`` does), so a pass repeated
after a crash or a conflict converges. A conflict (the Deployment scaled, the model written
meanwhile) raises ``StatusConflict``: the caller observes again and decides again.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping

from pydantic import ValidationError

from fewerbits_api.quantizedmodel import QuantizedModelStatus

from . import metrics
from .decide import (
    Action,
    AddJobOwner,
    CreateDeployment,
    CreateJob,
    CreateService,
    DeleteDeployment,
    Outcome,
    PatchService,
    ReplaceDeployment,
)
from .kube import Kube
from .routing import CreateInferencePool, PatchInferencePool

log = logging.getLogger("fewerbits.execute")

ORDER = (DeleteDeployment, CreateJob, AddJobOwner, CreateDeployment, ReplaceDeployment, CreateService, PatchService,
         CreateInferencePool, PatchInferencePool)


class StatusConflict(RuntimeError):
    """The object changed between our read and our write."""


def ordered(actions: tuple[Action, ...]) -> list[Action]:
    """Actions in execution order (stable within a kind)."""
    rank = {kind: i for i, kind in enumerate(ORDER)}
    return sorted(actions, key=lambda a: rank[type(a)])


def _plain(obj: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(obj))


def apply_action(kube: Kube, action: Action) -> None:
    if isinstance(action, DeleteDeployment):
        kube.delete_deployment(action.namespace, action.name)
    elif isinstance(action, CreateJob):
        if kube.create(_plain(action.job)) is not None:
            metrics.JOBS_CREATED.inc()
    elif isinstance(action, AddJobOwner):
        kube.add_owner("Job", action.namespace, action.name, [dict(r) for r in action.owner_refs])
    elif isinstance(action, (CreateDeployment, CreateService)):
        kube.create(_plain(action.deployment if isinstance(action, CreateDeployment) else action.service))
    elif isinstance(action, ReplaceDeployment):
        if not kube.replace_deployment(_plain(action.deployment)):
            md = action.deployment["metadata"]
            raise StatusConflict(f"Deployment {md['name']} changed while reconciling; retrying")
    elif isinstance(action, PatchService):
        kube.patch_service(action.namespace, action.name, _plain(action.patch))
    elif isinstance(action, CreateInferencePool):
        kube.create_inference_pool(_plain(action.pool))
    elif isinstance(action, PatchInferencePool):
        kube.patch_inference_pool(action.namespace, action.name, _plain(action.patch))
    else:  # pragma: no cover - the Action union is closed
        raise TypeError(f"unknown action {action!r}")


def normalized(raw: Mapping[str, Any]) -> str:
    try:
        return json.dumps(QuantizedModelStatus.model_validate(dict(raw)).to_wire(), sort_keys=True)
    except ValidationError:
        return json.dumps(raw, sort_keys=True)


def execute(kube: Kube, model: Mapping[str, Any], outcome: Outcome) -> bool:
    """Apply the outcome to ``model`` (the object as observed). Returns whether anything was
    written."""
    md = model["metadata"]
    for action in ordered(outcome.actions):
        apply_action(kube, action)
    wrote = bool(outcome.actions)
    old_raw = dict(model.get("status") or {})
    new_raw = outcome.status.to_wire()
    if normalized(new_raw) != normalized(old_raw):
        patch: dict[str, Any] = dict(new_raw)
        for k in old_raw:
            if k not in new_raw:
                patch[k] = None  # merge patch: null removes the field
        if not kube.patch_model_status(md["namespace"], md["name"], patch, md.get("resourceVersion")):
            # Written meanwhile (the autoscaler's fields, a spec change): decide again from a fresh read.
            raise StatusConflict(f"{md['namespace']}/{md['name']} changed while reconciling; retrying")
        wrote = True
        log.info("%s/%s: %s", md["namespace"], md["name"], ", ".join(
            f"{c.type}={c.status}({c.reason})" for c in outcome.status.conditions))
    if wrote:
        body = {"apiVersion": model.get("apiVersion"), "kind": model.get("kind"), "metadata": dict(md)}
        for event in outcome.events:
            if event.reason == "CacheHit":
                metrics.CACHE_HITS.inc()
            kube.post_event(body, event.type, event.reason, event.message)
    return wrote
