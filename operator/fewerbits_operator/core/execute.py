"""Execute: the only code that writes for a reconcile. It applies an ``Outcome`` of ``decide``:

1. Deployments to delete (first: they free the GPUs new Deployments may need),
2. quantization Jobs to create, owners to add to shared Jobs,
3. Deployments to create or replace, the Service to create or repair,
4. the status, as a JSON merge patch conditional on the model's resourceVersion, only when it
   changed,
5. the events (best effort), only when something was written.

Two writes go to object storage, not the API server: the create-only claim before a Job
(claims.py) and the retention sweep's marks and deletions (retention.py). Their credentials are
read here from the storage Secret for the write only: never kept, logged or put in an action.

Creates treat AlreadyExists as success and deletes NotFound (``Kube`` does), so a pass repeated
after a crash or a conflict converges. A conflict (the Deployment scaled, the model written
meanwhile) raises ``StatusConflict``: the caller observes again and decides again.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Mapping

from pydantic import ValidationError

from fewerbits_api.artifact import artifact_prefix
from fewerbits_api.quantizedmodel import QuantizedModelStatus

from fewerbits_operator.base import metrics
from fewerbits_operator.base.actions import (
    ACTION_TYPES,
    Action,
    AddJobOwner,
    ClaimArtifact,
    CreateDeployment,
    CreateInferencePool,
    CreateJob,
    CreatePickerObject,
    CreateService,
    DeleteDeployment,
    DeleteJob,
    PatchInferencePool,
    PatchService,
    ReplaceDeployment,
    UpdatePickerObject,
    WorkloadKind,
)
from fewerbits_operator.core.outcome import Outcome
from fewerbits_operator.base.kube import Kube
from fewerbits_operator.core.nodecache import REFERENCES_CONFIGMAP, ApplyReferences, ReferencesAction
from fewerbits_operator.core.retention import ARTIFACT_DELETED, MARKER_NAME, ClearMark, DeleteArtifact, MarkUnreferenced, RetentionAction
from fewerbits_operator.base.storage import ObjectStore, S3Credentials

log = logging.getLogger("fewerbits.execute")

ORDER = ACTION_TYPES
"""Execution order: the ``Action`` union's (deletes first: they free the GPUs new Deployments need)."""


class StatusConflict(RuntimeError):
    """The object changed between our read and our write."""


def ordered(actions: tuple[Action, ...]) -> list[Action]:
    """Actions in execution order (stable within a kind)."""
    rank = {kind: i for i, kind in enumerate(ORDER)}
    return sorted(actions, key=lambda a: rank[type(a)])


def _plain(obj: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(obj))


def _claim(kube: Kube, action: ClaimArtifact, store: ObjectStore | None) -> None:
    assert store is not None, "claims need the object store"
    secret = action.storage.credentialsSecret
    creds = S3Credentials.from_secret(kube.secret_data(action.namespace, secret) if secret else None)
    if not store.put_claim(action.storage, action.key, creds, action.body, action.take_over):
        metrics.CLAIMS_LOST.inc()
        raise StatusConflict(f"artifact {action.key[:12]} was claimed meanwhile by another namespace; observing again")


DELETE_WORKLOAD = {WorkloadKind.DEPLOYMENT: "delete_deployment", WorkloadKind.LEADER_WORKER_SET: "delete_lws"}
"""``Kube``'s delete for each kind of serving object."""


def _delete_workload(kube: Kube, action: DeleteDeployment) -> None:
    getattr(kube, DELETE_WORKLOAD[action.kind])(action.namespace, action.name)


def _create_job(kube: Kube, action: CreateJob) -> None:
    if kube.create(_plain(action.job)) is not None:
        metrics.JOBS_CREATED.inc()


def _replace(kube: Kube, obj: Mapping[str, Any]) -> None:
    if not kube.replace_deployment(_plain(obj)):
        raise StatusConflict(f"Deployment {obj['metadata']['name']} changed while reconciling; retrying")


def _update_picker_object(kube: Kube, action: UpdatePickerObject) -> None:
    if action.obj["kind"] == "Deployment":
        _replace(kube, action.obj)
    else:
        kube.patch_picker_object(_plain(action.obj))


Executor = Callable[[Kube, Any, "ObjectStore | None"], None]
EXECUTORS: dict[type, Executor] = {
    DeleteDeployment: lambda kube, a, _: _delete_workload(kube, a),
    DeleteJob: lambda kube, a, _: kube.delete_job(a.namespace, a.name),
    ClaimArtifact: _claim,
    CreateJob: lambda kube, a, _: _create_job(kube, a),
    AddJobOwner: lambda kube, a, _: kube.add_owner("Job", a.namespace, a.name, [dict(r) for r in a.owner_refs]),
    CreateDeployment: lambda kube, a, _: kube.create(_plain(a.deployment)),
    ReplaceDeployment: lambda kube, a, _: _replace(kube, a.deployment),
    CreateService: lambda kube, a, _: kube.create(_plain(a.service)),
    PatchService: lambda kube, a, _: kube.patch_service(a.namespace, a.name, _plain(a.patch)),
    CreateInferencePool: lambda kube, a, _: kube.create_inference_pool(_plain(a.pool)),
    PatchInferencePool: lambda kube, a, _: kube.patch_inference_pool(a.namespace, a.name, _plain(a.patch)),
    CreatePickerObject: lambda kube, a, _: kube.create(_plain(a.obj)),
    UpdatePickerObject: lambda kube, a, _: _update_picker_object(kube, a),
}
"""One executor per action type: the ``Action`` union is closed, and a unit test fails when a type
of it has no executor here."""


def apply_action(kube: Kube, action: Action, store: ObjectStore | None = None) -> None:
    executor = EXECUTORS.get(type(action))
    if executor is None:
        raise TypeError(f"no executor for action {action!r}")
    executor(kube, action, store)


def normalized(raw: Mapping[str, Any]) -> str:
    try:
        return json.dumps(QuantizedModelStatus.model_validate(dict(raw)).to_wire(), sort_keys=True)
    except ValidationError:
        return json.dumps(raw, sort_keys=True)


def execute(kube: Kube, model: Mapping[str, Any], outcome: Outcome, store: ObjectStore | None = None) -> bool:
    """Apply the outcome to ``model`` (the object as observed). Returns whether anything was
    written."""
    md = model["metadata"]
    for action in ordered(outcome.actions):
        apply_action(kube, action, store)
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


# ------------------------------------------------------------------ retention (retention.py)


def execute_retention(kube: Kube, store: ObjectStore, actions: list[RetentionAction], now: str) -> int:
    """Apply a retention sweep's actions; returns how many artifacts were deleted. An artifact is
    deleted manifest first (no manifest, no artifact: every reader from then on sees none), then
    its files, then its claim and marker; a failure part-way leaves an unpublished remainder that
    the next sweep, which still lists it unreferenced and marked, deletes."""
    deleted = 0
    secrets: dict[tuple[str, str | None], S3Credentials] = {}

    def creds(namespace: str, secret: str | None) -> S3Credentials:
        if (namespace, secret) not in secrets:
            secrets[(namespace, secret)] = S3Credentials.from_secret(
                kube.secret_data(namespace, secret) if secret else None)
        return secrets[(namespace, secret)]

    for action in actions:
        storage = action.location.storage(action.secret)
        c = creds(action.namespace, action.secret)
        _, prefix = artifact_prefix(storage.uri, action.key)
        if isinstance(action, MarkUnreferenced):
            store.put_object(storage, c, prefix + MARKER_NAME, json.dumps({"since": now}).encode())
        elif isinstance(action, ClearMark):
            store.delete_object(storage, c, prefix + MARKER_NAME)
        elif isinstance(action, DeleteArtifact):
            for obj in action.objects:  # in retention.deletion_order: the manifest first
                store.delete_object(storage, c, obj)
            deleted += 1
            metrics.ARTIFACTS_DELETED.inc()
            log.info("deleted artifact %s from %s (unreferenced since %s)", action.key, action.location.uri,
                     action.unreferenced_since)
            for namespace, name in action.models:
                body = kube.get_model(namespace, name)
                if body is not None:
                    kube.post_event(body, "Normal", ARTIFACT_DELETED,
                                    f"artifact {action.key[:12]} deleted from {action.location.uri}: no QuantizedModel "
                                    f"has referenced it since {action.unreferenced_since} (rules.artifactRetention: "
                                    "Delete)")
    return deleted


# ------------------------------------------------------------------ node-cache references (nodecache.py)


def execute_references(kube: Kube, actions: list[ReferencesAction]) -> int:
    """Write the referenced-keys ConfigMaps ``nodecache.decide_references`` asked for; returns how
    many writes the API server took (a conflict is left to the next sync)."""
    done = 0
    for action in actions:
        if isinstance(action, ApplyReferences):
            done += kube.apply_configmap(action.body, action.resource_version)
        else:
            kube.delete_configmap(action.namespace, REFERENCES_CONFIGMAP, action.resource_version)
            done += 1
    return done
