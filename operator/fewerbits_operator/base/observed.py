"""The facts one reconcile decides from: ``Observed`` and its parts, immutable values.

``observe.Observer`` fills them (the only reads); ``decide.decide`` reads them (no I/O).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

from fewerbits_api.artifact import Manifest
from fewerbits_api.canary import ServingQualityResult
from fewerbits_api.policy import QuantizationPolicy
from fewerbits_api.quantizedmodel import PlanStatus, QuantizedModelStatus

from fewerbits_operator.base.claims import Claim
from fewerbits_operator.base.datapins import DataPin
from fewerbits_operator.planner import GPUPool, ModelShape
from fewerbits_operator.planner.lora import AdapterFacts
from fewerbits_operator.base.queueing import QueueFacts


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
    evictions: tuple[tuple[str, str], ...] = ()
    """(pod, the kubelet's message) for each of its pods evicted (pod status.reason Evicted), newest
    first (read only when it failed)."""
    limits: Mapping[str, str] = field(default_factory=dict)
    """Its container's resource limits as the Job asks for them (memory, ephemeral-storage)."""
    active_deadline_seconds: int | None = None
    suspended: bool = False
    """``spec.suspend``: created for Kueue and not admitted yet (or suspended by hand)."""
    queue_name: str | None = None
    """Its Kueue LocalQueue (label ``kueue.x-k8s.io/queue-name``)."""


@dataclass(frozen=True)
class ArtifactFacts:
    manifest: Manifest | None = None
    storage_error: str | None = None
    """Storage could not be read (the manifest's presence is unknown)."""
    storage_error_reason: str | None = None
    """The condition reason the error gives, when not StorageUnavailable (the S3 calibration
    object unread: CalibrationDataUnavailable)."""
    job: JobFacts | None = None
    claim_present: bool = False
    """``<key>/.claim`` exists (read only while there is no manifest and no Job of this model's)."""
    claim: Claim | None = None
    """The claim as read (None with ``claim_present``: unreadable)."""
    claim_holder_gone: bool | None = None
    """The claim's holder Job was looked up and is Failed or absent (None: not looked up)."""
    quality_result: Any = None
    """A ``QualityReport`` measured after publishing, under the current evaluation identity
    (``<key>/quality/<identity>.json``); read only when the manifest's figures do not answer the gate."""
    eval_job: JobFacts | None = None
    """The evaluation-only Job for the current evaluation identity, when one exists."""


@dataclass(frozen=True)
class CanaryFacts:
    """What observe read of one variant's canary for its current served configuration (canary.py)."""

    config_hash: str
    result: ServingQualityResult | None = None
    """The stored verdict (``<key>/serving/<hash>.json``)."""
    result_error: str | None = None
    """Storage could not be read now."""
    deployment: Mapping[str, Any] | None = None
    """The canary Deployment (or LeaderWorkerSet, ``kind`` set), when it exists."""
    pod_ip: str | None = None
    """The canary pod's IP: a LeaderWorkerSet group's leader's."""
    pod_ready: bool = False
    """The canary pod is Ready: for a LeaderWorkerSet, every pod of its group (leader included)."""
    terminations: tuple[ContainerTermination, ...] = ()
    """The canary pods' failed containers."""
    waiting: tuple[str, ...] = ()
    """``pod container: reason: message`` of containers waiting on something that will not pass."""
    unschedulable: str | None = None
    """The scheduler's message while the canary pod cannot be placed."""
    job: JobFacts | None = None
    job_message: str | None = None
    """The evaluation Job's termination message (a ``CanaryTermination``), when it ended."""


@dataclass(frozen=True)
class CanaryLeftovers:
    """The model's canaries that no variant needs any more (a canary whose variant left the plan,
    or whose configuration was judged): they are deleted, by kind."""

    deployments: tuple[str, ...] = ()
    leader_worker_sets: tuple[str, ...] = ()


@dataclass(frozen=True)
class PickerFacts:
    """The endpoint picker's objects as observe read them (None: absent), by kind (picker.py)."""

    objects: Mapping[str, Mapping[str, Any] | None]


@dataclass(frozen=True)
class RoutingFacts:
    """What observe read for a model that asks for an InferencePool (routing.py)."""

    crd_served: bool
    """Whether the API server serves inferencepools in inference.networking.k8s.io/v1."""
    pool: Mapping[str, Any] | None = None
    """The InferencePool of the model's name, if any."""
    picker: PickerFacts | None = None
    """The endpoint picker's objects, read once the CRD is served."""


@dataclass(frozen=True)
class GatewayFacts:
    """What observe read for a model that names a Gateway (gatewayroute.py): only to report what
    stops its HTTPRoute; the activator-path loop (runtime/atzero.py) writes the route."""

    crd_served: bool
    """Whether the API server serves httproutes in gateway.networking.k8s.io/v1."""
    route: Mapping[str, Any] | None = None
    """The HTTPRoute of the model's name, if any."""


@dataclass(frozen=True)
class PlanVerdict:
    """What the Planned condition says of a plan (core.acceptance.current_plan)."""

    plan: PlanStatus | None
    """None: nothing can be planned (the condition says why)."""
    ok: bool
    reason: str
    message: str


@dataclass(frozen=True)
class Planning:
    """The pass's plan and its verdict, computed once: observe needs it to know what to read
    (artifact keys, canaries), and decide reuses it instead of running the planner again."""

    plan: PlanStatus
    verdict: PlanVerdict


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
    adapters: tuple[AdapterFacts, ...] = ()
    """The adapters whose adapter_config.json was read and fits the base, in spec order."""
    adapter_problems: Mapping[str, str] = field(default_factory=dict)
    """By adapter name: why its config could not be read or does not fit the base (naming its field)."""
    artifacts: Mapping[str, ArtifactFacts] = field(default_factory=dict)
    """By artifact key, for the keys the plan names."""
    deployments: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """The model's Deployments (label fewerbits.io/model) by name, and its LeaderWorkerSets
    (multi-node variants, ``kind: LeaderWorkerSet``) when that API is served."""
    lws_available: bool | None = None
    """Whether the cluster serves LeaderWorkerSet (its CRD is installed); None: not asked (no
    variant spans nodes and nothing was read)."""
    service: Mapping[str, Any] | None = None
    service_read: bool = False
    """Whether the Service was looked up (only when something is planned)."""
    pod_terminations: Mapping[str, tuple[ContainerTermination, ...]] = field(default_factory=dict)
    """By variant, for variants short of ready replicas: their pods' failed containers."""
    data_pin: DataPin | None = None
    eval_pin: DataPin | None = None
    adapter_eval_pins: tuple[DataPin, ...] = ()
    """The ETags of the adapters' own S3 evaluation sets (the model's is eval_pin)."""
    """The S3 evaluation set's ETag (datapins.s3_eval_uri), when the gate names one."""
    """The S3 calibration object's ETag (and VersionId), read when the plan uses it (datapins.py)."""
    data_error: str | None = None
    """Why the S3 calibration object could not be read (no Job starts for the artifacts using it)."""
    dataset_errors: Mapping[str, str] = field(default_factory=dict)
    """By spec field: a custom S3 dataset a Job about to be created could not read (datasetcheck)."""
    queue: QueueFacts | None = None
    """The running and queued quantization Jobs of every watched namespace, read (under the
    admission lock, ``admission.py``) only when a planned artifact has neither a manifest nor a
    Job. None: not read, and a Job this pass wants is created without a cap."""

    @property
    def needs_admission(self) -> bool:
        """Some planned artifact has no manifest and no Job: whether one may start is decided."""
        return any(a.manifest is None and a.storage_error is None and a.job is None for a in self.artifacts.values())
    routing: RoutingFacts | None = None
    """When the model asks for an InferencePool (read only then), or a picker is left from before."""
    gateway: GatewayFacts | None = None
    """When the model names a Gateway (spec.serving.gateway): read only then."""
    canaries: Mapping[str, CanaryFacts] = field(default_factory=dict)
    """By pool: the canaries of the variants whose served configuration has no verdict yet (read
    only for those); on a model with adapters also the stored verdict of each configuration that
    serves (the adapters it refused stay refused)."""
    canary_leftovers: CanaryLeftovers = CanaryLeftovers()
    """The model's canaries no variant needs: deleted."""
    planning: Planning | None = None
    """The plan as observe computed it from these facts (None: decide plans)."""
