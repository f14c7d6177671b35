"""The ``QuantizationPolicy`` kind: cluster-wide defaults and rules set by a platform team.

A policy applies to the QuantizedModels in namespaces its ``namespaceSelector`` matches. Every
matching policy applies (docs/policies.md): their defaults are laid over one another by priority
and the model's own spec over them; their rules combine so that the most restrictive wins
(``Accepted=False`` names the broken rule and the policy that set it).
"""

from __future__ import annotations

import fnmatch
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from .base import API_VERSION, ApiModel
from .conditions import Condition
from .formats import QuantFormat
from .validation import DNS1123_SUBDOMAIN
from .quantizedmodel import (
    GPUFamily,
    LabelKey,
    LabelValue,
    ObjectMeta,
    QuantizationSpec,
    ServingSpec,
    StorageSpec,
    AutoscalingSpec,
)

KIND = "QuantizationPolicy"
PLURAL = "quantizationpolicies"
SHORT_NAMES = ["qp"]


class LabelSelectorRequirement(ApiModel):
    """A label selector requirement (metav1.LabelSelectorRequirement)."""

    key: LabelKey
    """The label key."""
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    """How the key relates to the values."""
    values: Annotated[list[LabelValue], Field(max_length=64)] = Field(default_factory=list)
    """Values for In and NotIn; empty for Exists and DoesNotExist."""


class LabelSelector(ApiModel):
    """A label selector (metav1.LabelSelector). Empty selects everything."""

    matchLabels: dict[LabelKey, LabelValue] = Field(default_factory=dict)
    """Labels that must all be present with these values."""
    matchExpressions: Annotated[list[LabelSelectorRequirement], Field(max_length=32)] = Field(default_factory=list)
    """Requirements that must all hold."""

    def matches(self, labels: dict[str, str]) -> bool:
        if any(labels.get(k) != v for k, v in self.matchLabels.items()):
            return False
        for req in self.matchExpressions:
            present = req.key in labels
            if req.operator == "In" and (not present or labels[req.key] not in req.values):
                return False
            if req.operator == "NotIn" and present and labels[req.key] in req.values:
                return False
            if req.operator == "Exists" and not present:
                return False
            if req.operator == "DoesNotExist" and present:
                return False
        return True


class Toleration(ApiModel):
    """A pod toleration (core/v1 Toleration)."""

    # The rules Kubernetes applies to a pod's tolerations (ValidateTolerations): checked here so a
    # policy cannot make every quantization Job it places fail to be created.
    model_config = ApiModel.model_config | {"json_schema_extra": {
        "x-kubernetes-validations": [
            {"rule": "!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
             "message": "value must be empty when operator is Exists"},
            {"rule": "(has(self.key) && self.key != '') || (has(self.operator) && self.operator == 'Exists')",
             "message": "operator must be Exists when key is empty"},
            {"rule": "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
             "message": "effect must be NoExecute when tolerationSeconds is set"},
        ]
    }}

    key: LabelKey | None = None
    """Taint key (a label key); empty with operator Exists matches every taint."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """Exists or Equal."""
    value: LabelValue | None = None
    """Taint value for Equal (a label value)."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches all."""
    tolerationSeconds: Annotated[int, Field(ge=-(10**18), le=10**18)] | None = None
    """For NoExecute: how long the pod stays bound after the taint appears."""

    @model_validator(mode="after")
    def _as_kubernetes_checks_it(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError("value must be empty when operator is Exists")
        if not self.key and self.operator != "Exists":
            raise ValueError("operator must be Exists when key is empty")
        if self.tolerationSeconds is not None and self.effect != "NoExecute":
            raise ValueError("effect must be NoExecute when tolerationSeconds is set")
        return self


class KueueQueueing(ApiModel):
    """Hand the quantization Jobs to Kueue: each is created suspended, labelled with its
    LocalQueue, and runs when Kueue admits it against its ClusterQueue's quota."""

    localQueueName: Annotated[str, Field(min_length=1, max_length=63, pattern=DNS1123_SUBDOMAIN)]
    """The Kueue LocalQueue, in each model's namespace, that admits the Job (the Job's label
    `kueue.x-k8s.io/queue-name`). A namespace without that LocalQueue leaves the Job suspended:
    Kueue reports it on the Job's Workload."""
    workloadPriorityClassName: Annotated[str, Field(max_length=63, pattern=DNS1123_SUBDOMAIN)] | None = None
    """Kueue WorkloadPriorityClass of the Job (label `kueue.x-k8s.io/priority-class`)."""


class QuantizationJobPlacement(ApiModel):
    """Where and how quantization Jobs run."""

    nodeSelector: dict[LabelKey, LabelValue] = Field(default_factory=dict)
    """Node labels the Job's pod must match (e.g. a calibration GPU pool)."""
    tolerations: Annotated[list[Toleration], Field(max_length=32)] = Field(default_factory=list)
    """Tolerations for tainted GPU nodes."""
    priorityClassName: Annotated[str, Field(max_length=253, pattern=DNS1123_SUBDOMAIN)] | None = None
    """Priority class of the Job's pod."""
    gpus: Annotated[int, Field(ge=0, le=16)] = 1
    """GPUs the Job requests (`nvidia.com/gpu`); 0 runs on CPU (small models only). Unset: sized
    from the model (the fewest GPUs that hold it for the evaluation, docs/jobs.md)."""
    activeDeadlineSeconds: Annotated[int, Field(ge=60, le=604800)] = 21600
    """How long a Job may run before Kubernetes stops it. Unset: three times the Job's estimated
    time, at least an hour."""
    backoffLimit: Annotated[int, Field(ge=0, le=10)] = 2
    """Retries of a failed Job pod."""
    storageClassName: Annotated[str, Field(max_length=253, pattern=DNS1123_SUBDOMAIN)] | None = None
    """StorageClass of the Job's work volume when it is larger than the operator's threshold (a
    generic ephemeral volume instead of node-local `emptyDir`). Unset: the operator's setting,
    else the cluster's default StorageClass."""
    kueue: KueueQueueing | None = None
    """Queue the Jobs in Kueue instead of under the operator's cap on running quantization Jobs
    (`maxRunningQuantizationJobs`): Kueue's quota decides when each runs. Once admitted they
    count towards the operator's cap, which then holds back only Jobs that are not Kueue's."""


class PolicyRules(ApiModel):
    """What models under this policy may and may not do."""

    allowedFormats: Annotated[list[QuantFormat], Field(max_length=16)] | None = None
    """Formats models may use (`auto` resolves only to these). Unset or empty: all. With several
    policies: the formats every policy that sets a list allows (none in common refuses the model)."""
    allowedSources: Annotated[list[Annotated[str, Field(min_length=1, max_length=512)]], Field(max_length=64)] | None = None
    """Glob patterns the source URI must match, e.g. `hf://meta-llama/*`, `s3://models/*`. Unset:
    any source. With several policies, the URI must match a pattern of every policy that sets one."""
    requireRevisionPin: bool = False
    """Require `spec.source.revision`. Any matching policy requiring it requires it."""
    requirePinnedData: bool = False
    """Require every remote dataset to be pinned: a Hub dataset in
    `spec.quantization.calibration.dataset` or `qualityGate.evalDataset` must name `@revision`
    (S3 objects are pinned by the ETag the operator reads into the artifact key). Any matching
    policy requiring it requires it."""
    requireQualityGate: bool = False
    """Require `spec.quantization.qualityGate` to be set explicitly. Any matching policy requiring
    it requires it."""
    requireServingCanary: bool = False
    """Refuse `spec.serving.canary.enabled: false`: every new variant is judged through its serving
    API before it takes traffic. Any matching policy requiring it requires it."""
    maxPerplexityIncreasePercent: Annotated[float, Field(gt=0, le=1000)] | None = None
    """Ceiling on `qualityGate.maxPerplexityIncreasePercent`; a model without a gate gets the
    default 3% lowered to it. With several policies: the lowest."""
    maxGPUsPerReplica: Annotated[int, Field(ge=1, le=64)] | None = None
    """Most GPUs one replica may use (caps the tensor-parallel size). With several policies: the
    lowest."""
    maxReplicas: Annotated[int, Field(ge=1, le=1000)] | None = None
    """Most replicas per variant (caps `autoscaling.maxReplicas`). With several policies: the
    lowest."""
    maxQuantizationJobGPUs: Annotated[int, Field(ge=0, le=64)] | None = None
    """Most GPUs one quantization Job may request. A Job sized for more GPUs gets this many (its
    evaluation offloads the rest of the model to host memory); a model whose calibration cannot run
    on this many is refused with the figures. With several policies: the lowest."""
    maxQuantizationJobMemoryGiB: Annotated[int, Field(ge=1, le=65536)] | None = None
    """Most host memory (GiB) one quantization Job may request. A model whose Job needs more is
    refused (`Quantized=False JobExceedsPolicy`) with the figures. With several policies: the
    lowest."""
    maxSourceCopyGiB: Annotated[int, Field(ge=0, le=1_048_576)] | None = None
    """Largest source (GiB) fewerbits copies unchanged into `spec.storage` to serve it as it is: an
    already-quantized checkpoint (FP8, int4), or any source with format `none`. Such a source needs
    no quantization, but its `none` Job still downloads it and uploads it unchanged (`status.plan.quantizationJobs` shows the disk and the
    time: DeepSeek-V3's FP8 checkpoint is about 630 GiB). A larger source is refused
    (`Quantized=False JobExceedsPolicy`) with the figures; 0 never copies. With several policies:
    the lowest."""
    allowTrustRemoteCode: bool = False
    """Allow `spec.source.trustRemoteCode`. With several policies: allowed only when one sets
    `true` and none sets `false` explicitly (a policy that leaves it unset has no say)."""
    allowedExtraArgs: Annotated[list[Annotated[str, Field(min_length=3, max_length=128, pattern=r"^--[a-z0-9][a-z0-9-]*$")]], Field(max_length=64)] | None = None
    """vLLM flags models may pass in `serving.extraArgs`, compared by the setting they name in
    vLLM's parser (so `--flag=value`, `--flag value` and `--flag_name` spellings are one flag).
    What an unlisted flag does depends on `extraArgsMode`. Unset: this policy lists nothing; with
    several policies, a flag must be listed by every policy that sets this list."""
    extraArgsMode: Literal["PlanAndTrust", "Strict"] = "PlanAndTrust"
    """`PlanAndTrust`: only flags that override the plan (e.g. `--max-model-len`,
    `--tensor-parallel-size`) or change what the server trusts (e.g. `--trust-remote-code`,
    `--chat-template`) must be listed in `allowedExtraArgs`; every other flag (e.g.
    `--enforce-eager`) passes. `Strict`: only flags listed in `allowedExtraArgs` pass; with no list,
    no flag passes. Any matching policy in `Strict` makes the model's flags strict."""
    allowedImages: Annotated[list[Annotated[str, Field(min_length=1, max_length=512)]], Field(max_length=64)] | None = None
    """Glob patterns `serving.image` must match (`*` spans `/` and `:`), e.g.
    `registry.example.com/vllm/*`, `vllm/vllm-openai:v0.11.*`, or a digest
    `vllm/vllm-openai@sha256:<hex>`. A model that leaves `serving.image` unset runs the operator's
    configured image and always passes. Unset: any image. With several policies, the image must
    match a pattern of every policy that sets this list."""
    allowedEndpoints: Annotated[list[Annotated[str, Field(min_length=1, max_length=512)]], Field(max_length=64)] | None = None
    """Glob patterns `spec.source.endpoint` and `spec.storage.endpoint` must match (`*` matches
    any run of characters but `/`, so a host pattern cannot be satisfied by a path), e.g. `https://minio.storage.svc:9000`, `https://*.r2.cloudflarestorage.com`. An unset
    endpoint (the provider's public service) always passes. Link-local and cloud metadata
    addresses are refused whatever this list says. Unset: any other endpoint. With several
    policies, an endpoint must match a pattern of every policy that sets this list."""
    artifactRetention: Literal["Retain", "Delete"] = "Retain"
    """What happens to published artifacts no QuantizedModel references any more. `Retain`: they
    stay. `Delete`: an artifact that no model has referenced for `artifactRetentionPeriodSeconds` is
    deleted from its storage location (manifest first, so no reader sees a half-deleted artifact),
    with an `ArtifactDeleted` event on the models using that location. A location is swept only
    while every model using it is under `Delete`. With several policies: `Delete` only when one
    sets it and none sets `Retain` explicitly."""
    artifactRetentionPeriodSeconds: Annotated[int, Field(ge=0, le=315360000)] | None = None
    """With `artifactRetention: Delete`: how long an artifact must stay unreferenced before it is
    deleted. Default 7 days. With several policies: the longest."""
    quantizationJob: QuantizationJobPlacement = Field(default_factory=QuantizationJobPlacement)
    """Placement and limits of quantization Jobs. With several policies, laid over one another by
    priority field by field, like `defaults`."""
    poolCostWeights: Annotated[dict[Annotated[str, Field(min_length=1, max_length=253)],
                                    Annotated[float, Field(gt=0, le=1000)]], Field(max_length=64)] | None = None
    """Relative cost of one GPU of each pool, by pool name or GPU product (`nvidia.com/gpu.product`),
    e.g. `{NVIDIA-H100-80GB-HBM3: 1.0, NVIDIA-L4: 0.27}`; a pool name wins over its product. With
    `serving.routing: inferencePool` and several variants, the autoscaler adds replicas to the pool
    with the lowest cost per served token (this weight x GPUs per replica / the plan's throughput
    estimate) and removes them from the most expensive first. Unlisted pools: the operator's
    `gpuCostWeights` setting, else 1. With several policies: per key, the highest priority's."""

    def source_allowed(self, uri: str) -> bool:
        return self.allowedSources is None or any(fnmatch.fnmatchcase(uri, p) for p in self.allowedSources)


class QuantizedModelDefaults(ApiModel):
    """Defaults for any part of a QuantizedModel spec (the source excepted). A field the model
    sets wins over the default."""

    quantization: QuantizationSpec | None = None
    """Default quantization settings."""
    storage: StorageSpec | None = None
    """Default artifact storage."""
    serving: ServingSpec | None = None
    """Default serving settings."""
    autoscaling: AutoscalingSpec | None = None
    """Default autoscaling settings."""


class QuantizationPolicySpec(ApiModel):
    """Defaults, rules and per-family format choices for the models in matching namespaces."""

    namespaceSelector: LabelSelector = Field(default_factory=LabelSelector)
    """Namespaces this policy applies to. Empty: all."""
    priority: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    """Order of layering when several policies match a namespace: defaults, job placement and
    `formatByGPUFamily` of a higher priority win over a lower one's (equal priorities: name order
    for defaults; two different formats for one family is a conflict). Rules always combine,
    most restrictive first, whatever the priority."""
    defaults: QuantizedModelDefaults = Field(default_factory=QuantizedModelDefaults)
    """Defaults merged under each model's spec."""
    rules: PolicyRules = Field(default_factory=PolicyRules)
    """Rules each model must satisfy."""
    formatByGPUFamily: dict[GPUFamily, QuantFormat] = Field(default_factory=dict, json_schema_extra={
        # Checked at admission too: a policy the models refuse would be no policy at all.
        "x-kubernetes-validations": [{"rule": "self.all(k, self[k] != 'auto')",
                                      "message": "formatByGPUFamily must name a concrete format, not 'auto'"}],
    })
    """Format the planner picks for `format: auto` on a GPU family, overriding its default. With
    several policies, the highest priority's entry for a family wins; two different entries at
    the same priority are a conflict reported on both policies and refuse the models they govern."""

    @field_validator("formatByGPUFamily")
    @classmethod
    def _concrete(cls, v: dict[str, QuantFormat]) -> dict[str, QuantFormat]:
        for family, fmt in v.items():
            if fmt is QuantFormat.AUTO:
                raise ValueError(f"formatByGPUFamily.{family}: must name a concrete format, not 'auto'")
        return v


class PolicyConflict(ApiModel):
    """A setting this policy and another matching policy set in ways that cannot be combined."""

    policy: Annotated[str, Field(max_length=253)]
    """The other policy."""
    message: Annotated[str, Field(max_length=1024)]
    """What conflicts (e.g. `formatByGPUFamily.hopper: fp8-dynamic vs w4a16-awq at priority 10`)."""


class QuantizationPolicyStatus(ApiModel):
    """Observed state, written only by the operator."""

    observedGeneration: int | None = None
    """The generation of the spec this status describes."""
    conditions: list[Condition] = Field(default_factory=list)
    """`Valid`: True when the policy parses and combines with the other policies it meets in a
    namespace; False (`Invalid` or `Conflict`) says why."""
    conflicts: Annotated[list[PolicyConflict], Field(max_length=64)] = Field(default_factory=list)
    """Conflicts with other policies matching a namespace this one matches."""
    governedNamespaces: int | None = None
    """Namespaces holding QuantizedModels that this policy selects."""
    governedModels: int | None = None
    """QuantizedModels this policy governs (in the watched namespaces)."""
    queuedJobs: int | None = None
    """Quantization Jobs of the models it governs that wait: under the operator's cap on running
    Jobs, or suspended until Kueue admits them from the LocalQueue it names."""


class QuantizationPolicy(ApiModel):
    """Cluster-wide defaults and rules for QuantizedModels."""

    KIND: ClassVar[str] = KIND
    model_config = ApiModel.model_config | {"extra": "ignore"}

    apiVersion: Literal["fewerbits.io/v1alpha1"] = API_VERSION
    """API version."""
    kind: Literal["QuantizationPolicy"] = KIND
    """Kind."""
    metadata: ObjectMeta
    """Standard object metadata."""
    spec: QuantizationPolicySpec = Field(default_factory=QuantizationPolicySpec)
    """Defaults and rules."""
    status: QuantizationPolicyStatus | None = None
    """Observed state, written only by the operator."""
