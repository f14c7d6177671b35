"""The facts one reconcile decides from: ``Observed`` and its parts, immutable values.

``observe.Observer`` fills them (the only reads); ``decide.decide`` reads them (no I/O).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

from fewerbits_api.artifact import Manifest
from fewerbits_api.policy import QuantizationPolicy
from fewerbits_api.quantizedmodel import QuantizedModelStatus

from .planner import GPUPool, ModelShape


class JobState(str, Enum):
    PENDING = "Pending"
    ACTIVE = "Active"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


@dataclass(frozen=True)
class ContainerTermination:
    """One container's last termination, as its pod reports it."""

    pod: str
    container: str
    exit_code: int
    reason: str
    message: str
    running_ready: bool = False
    """The container has since restarted and is running and ready."""


@dataclass(frozen=True)
class JobFacts:
    name: str
    owner_refs: tuple[Mapping[str, Any], ...]
    state: JobState
    failed_condition: Mapping[str, Any] | None = None
    """The Job's Failed condition (reason, message), when it failed."""
    terminations: tuple[ContainerTermination, ...] = ()
    """Its pods' container terminations, newest pod first (read only when it failed)."""
    pod_phases: tuple[str, ...] = ()
    """Its pods' phases (read only while it is active)."""


@dataclass(frozen=True)
class ArtifactFacts:
    manifest: Manifest | None = None
    storage_error: str | None = None
    """Storage could not be read (the manifest's presence is unknown)."""
    job: JobFacts | None = None


@dataclass(frozen=True)
class BrokenPolicy:
    """A QuantizationPolicy the API server stored but that does not validate."""

    name: str
    error: str
    may_select: bool
    """Whether it may select the model's namespace (True when even its selector is unreadable)."""


@dataclass(frozen=True)
class Observed:
    """Everything ``decide`` needs, read once per reconcile."""

    now: str
    """The time of the observation (RFC 3339): the only clock ``decide`` reads."""
    namespace: str
    name: str
    uid: str
    generation: int | None
    resource_version: str | None
    raw: Mapping[str, Any]
    """The model as read (for events: apiVersion, kind, metadata)."""
    spec: Mapping[str, Any]
    old_status_raw: Mapping[str, Any]
    old_status: QuantizedModelStatus
    policies: tuple[QuantizationPolicy, ...] = ()
    broken_policies: tuple[BrokenPolicy, ...] = ()
    namespace_labels: Mapping[str, str] = field(default_factory=dict)
    secrets: Mapping[str, frozenset[str] | None] | None = None
    """Secret name → the keys it has (None: no such Secret). Never the values. None when the
    Secrets were not read (the spec is not accepted)."""
    pools: tuple[GPUPool, ...] | None = None
    """GPU pools from the Node cache; None when not read (the spec is not accepted)."""
    shape: ModelShape | None = None
    config_error: str | None = None
    """Why the source's config.json could not be read or understood."""
    artifacts: Mapping[str, ArtifactFacts] = field(default_factory=dict)
    """By artifact key, for the keys the plan names."""
    deployments: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """The model's Deployments (label fewerbits.io/model) by name."""
    service: Mapping[str, Any] | None = None
    service_read: bool = False
    """Whether the Service was looked up (only when something is planned)."""
    pod_terminations: Mapping[str, tuple[ContainerTermination, ...]] = field(default_factory=dict)
    """By variant, for variants short of ready replicas: their pods' failed containers."""
    routing: Any = None
    """``routing.RoutingFacts`` when the model asks for an InferencePool (read only then)."""
