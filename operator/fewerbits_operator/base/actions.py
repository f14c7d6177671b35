"""The writes a reconcile can ask for: a closed union of small frozen values, and the events.

``decide`` (and the steps below it: canary.py, routing.py, picker.py) returns these; ``execute``
applies them, one executor per type (``execute.EXECUTORS``; a unit test fails when a type of
``Action`` has none). This module imports only apis.py of the operator: everything that decides sits
above it, the one writer too.

``WorkloadKind`` is the serving object of a variant, chosen from the plan (one node per replica: a
Deployment; several: a LeaderWorkerSet, lws.py) and carried as a value to the delete that
``execute`` dispatches on.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping, Union

from fewerbits_api.quantizedmodel import StorageSpec

from fewerbits_operator.base.apis import LWS_KIND


class WorkloadKind(str, Enum):
    """The API kind that serves a variant (its ``kind``, so it compares equal to the kind string)."""

    DEPLOYMENT = "Deployment"
    LEADER_WORKER_SET = LWS_KIND

    @classmethod
    def for_nodes(cls, nodes_per_replica: int) -> WorkloadKind:
        """A replica on one node is a Deployment; one spanning nodes a LeaderWorkerSet group."""
        return cls.LEADER_WORKER_SET if nodes_per_replica > 1 else cls.DEPLOYMENT

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> WorkloadKind:
        """The kind of a serving object as observed or rendered (a Deployment when unsaid)."""
        return cls(obj.get("kind") or cls.DEPLOYMENT.value)


@dataclass(frozen=True)
class CreateJob:
    job: Mapping[str, Any]


@dataclass(frozen=True)
class DeleteJob:
    """Delete a canary's evaluation Job once its verdict is read (its pods go with it)."""

    namespace: str
    name: str


@dataclass(frozen=True)
class AddJobOwner:
    """Several models asking for one artifact share its Job; each becomes an owner, so the Job
    goes only when the last of them does."""

    namespace: str
    name: str
    owner_refs: tuple[Mapping[str, Any], ...]


@dataclass(frozen=True)
class CreateDeployment:
    """Create a variant's serving object (``deployment["kind"]``: a Deployment or a LeaderWorkerSet)."""

    deployment: Mapping[str, Any]


@dataclass(frozen=True)
class ReplaceDeployment:
    """Replace at the resourceVersion in the object; a conflict (scaled meanwhile) retries the
    whole reconcile from a fresh read."""

    deployment: Mapping[str, Any]


@dataclass(frozen=True)
class DeleteDeployment:
    namespace: str
    name: str
    kind: WorkloadKind = WorkloadKind.DEPLOYMENT
    """``WorkloadKind.LEADER_WORKER_SET`` for a multi-node variant's (lws.py)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", WorkloadKind(self.kind))


@dataclass(frozen=True)
class CreateService:
    service: Mapping[str, Any]


@dataclass(frozen=True)
class PatchService:
    namespace: str
    name: str
    patch: Mapping[str, Any]


@dataclass(frozen=True)
class ClaimArtifact:
    """Claim ``<storage>/<key>/.claim`` create-only before creating the Job (claims.py); when
    another writer wins, execute raises StatusConflict and the pass observes the claim."""

    namespace: str
    storage: StorageSpec
    key: str
    body: bytes
    take_over: bool = False
    """The claim there is stale: delete it first."""


@dataclass(frozen=True)
class CreateInferencePool:
    pool: Mapping[str, Any]


@dataclass(frozen=True)
class PatchInferencePool:
    namespace: str
    name: str
    patch: Mapping[str, Any]


@dataclass(frozen=True)
class CreatePickerObject:
    """Create one of the endpoint picker's objects (picker.py)."""

    obj: Mapping[str, Any]


@dataclass(frozen=True)
class UpdatePickerObject:
    """Bring one of the picker's objects back to what is rendered: its Deployment replaced at its
    resourceVersion, the others patched."""

    obj: Mapping[str, Any]


Action = Union[DeleteDeployment, DeleteJob, ClaimArtifact, CreateJob, AddJobOwner, CreateDeployment,
               ReplaceDeployment, CreateService, PatchService, CreateInferencePool, PatchInferencePool,
               CreatePickerObject, UpdatePickerObject]
ACTION_TYPES: tuple[type, ...] = typing.get_args(Action)
"""Every action type, in the order ``execute`` applies them (deletes first: they free the GPUs the
new Deployments may need)."""


@dataclass(frozen=True)
class Event:
    """A core/v1 Event to post on the model: ``type`` is Normal or Warning, ``reason`` a CamelCase
    word, ``message`` at most 1024 characters."""

    type: str
    reason: str
    message: str
