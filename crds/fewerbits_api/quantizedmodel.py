"""The ``QuantizedModel`` kind: one base model taken to a quantized, served, autoscaled endpoint.

These models are the single source of truth of the API: the CRD schema, its descriptions
(``kubectl explain``) and its CEL rules are generated from them by ``fewerbits_api.crdgen``.

Defaults live here, not in the CRD: the API server must not fill in a value the user did not
write, or a cluster-wide ``QuantizationPolicy`` default could never apply. The effective spec is
the user's spec laid over the policy defaults, then validated by these models.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from .adapters import MAX_ADAPTERS, AdapterEvaluation, AdapterList, AdapterStatus, LoraPlan, duplicate_adapter
from .artifact import CalibrationUsed
from .base import API_VERSION, ApiModel
from .conditions import Condition
from .formats import FORMAT_FACTS, KVCacheSetting, QuantFormat
from .quality import (
    BENCHMARKS_UNIQUE_CEL,
    BenchmarkSpec,
    CustomEvalSpec,
    MetricResult,
    duplicate_benchmarks,
    eval_overlaps_calibration,
)
from .validation import (
    DATASET_URI,
    DNS1123_LABEL,
    DNS1123_SUBDOMAIN,
    HTTP_ENDPOINT,
    PATH_TRICKS_CEL,
    REVISION,
    SOURCE_URI,
    STORAGE_URI,
    UriSource,
    check_no_path_tricks,
)

KIND = "QuantizedModel"
PLURAL = "quantizedmodels"
SHORT_NAMES = ["qm"]

SecretName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN)]
GPU_FAMILIES = ("turing", "ampere", "ada-lovelace", "hopper", "blackwell")
GPUFamily = Literal["turing", "ampere", "ada-lovelace", "hopper", "blackwell"]
# A qualified name as Kubernetes checks label keys: an optional DNS-subdomain prefix, then a name
# of at most 63 characters. Looser than that, a key would pass here and make the API server refuse
# the Job or Deployment that carries it.
LabelKey = Annotated[str, Field(min_length=1, max_length=317, pattern=(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"))]
LabelValue = Annotated[str, Field(max_length=63, pattern=r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")]
# A vLLM flag or its value; no whitespace or control characters so nothing can smuggle a second
# argument or a newline into a log line. The operator passes arguments as a list (no shell).
ExtraArg = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\s\x00-\x1f\x7f]+$")]


class SourceSpec(UriSource):
    """Where the base (unquantized) model comes from."""

    uri: Annotated[str, Field(max_length=512, pattern=SOURCE_URI, json_schema_extra=PATH_TRICKS_CEL)]
    """The base model: `hf://org/name` (Hugging Face Hub), `s3://bucket/prefix` (a directory of
    safetensors files and config.json) or `pvc://claim/path` (a PersistentVolumeClaim in the same
    namespace, mounted read-only)."""

    revision: Annotated[str, Field(max_length=255, pattern=REVISION)] | None = None
    """The revision to quantize: a commit hash (best: immutable), tag or branch. Part of the
    artifact key. Policies may require a pin (`rules.requireRevisionPin`)."""

    endpoint: Annotated[str, Field(max_length=512, pattern=HTTP_ENDPOINT)] | None = None
    """For `s3://` sources on an S3-compatible store: its endpoint URL. Empty: AWS S3."""

    region: Annotated[str, Field(max_length=64, pattern=r"^[a-z0-9-]+$")] | None = None
    """For `s3://` sources: the bucket's region."""

    credentialsSecret: SecretName | None = None
    """A Secret in the same namespace with credentials for the source: key `HF_TOKEN` for
    `hf://`, keys `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY` for `s3://`. Its values are
    passed to the Job as environment variables from the Secret and never copied anywhere else."""

    trustRemoteCode: bool = False
    """Allow the model's own Python code from its repository to run (`trust_remote_code`).
    Refused unless a policy allows it (`rules.allowTrustRemoteCode`)."""



class CalibrationSpec(ApiModel):
    """The data that calibration-based formats (AWQ, GPTQ, INT8, NVFP4) observe activations on."""

    dataset: Annotated[str, Field(max_length=512, pattern=DATASET_URI, json_schema_extra=PATH_TRICKS_CEL)] = "auto"
    """`auto` (default): llm-compressor's own calibration set, HuggingFaceH4/ultrachat_200k
    (`train_sft`, at a pinned commit), rendered with the model's chat template, when the Job
    reaches the Hub (through the proxy its environment names, as the Hub client does); the
    built-in `general-en` (44 paragraphs) when it cannot, published under an artifact key of its
    own (never taken for the Hub set's by a later model), which status then reports
    (`artifacts[].calibration`, reason CalibrationReduced). Or a built-in name
    (`general-en`), an S3 JSON Lines object (`s3://bucket/path.jsonl`, one `{"text": ...}` per line) or a
    Hub dataset (`hf://datasets/org/name[@revision]`, a `text` or a chat `messages` column). Its identity and content hash are part of the artifact key."""

    samples: Annotated[int, Field(ge=1, le=65536)] = 512
    """Number of calibration samples. Default 512 (llm-compressor's usual recipe)."""

    maxSeqLength: Annotated[int, Field(ge=16, le=131072)] = 2048
    """Tokens per calibration sample (longer samples are truncated)."""

    @field_validator("dataset")
    @classmethod
    def _dataset_has_no_path_tricks(cls, v: str) -> str:
        return check_no_path_tricks(v, "dataset")


class QualityGateSpec(ApiModel):
    """The quality an artifact must keep to be rolled out."""

    maxPerplexityIncreasePercent: Annotated[float, Field(gt=0, le=1000)] = 3.0
    """Largest allowed perplexity increase of the quantized model over the base model, in
    percent, measured by the quantization Job on the same held-out windows. An artifact above it
    is published (with its verdict) but never rolled out."""

    evalDataset: Annotated[str, Field(max_length=512, pattern=DATASET_URI, json_schema_extra=PATH_TRICKS_CEL)] = "general-en-heldout"
    """Held-out text for perplexity, in the same forms as `calibration.dataset`, where a Hub set
    may name its configuration and split: `hf://datasets/Salesforce/wikitext#wikitext-2-raw-v1/test`
    (default split: `test`, else `validation`, else `train`, else the first). Must not overlap the
    calibration data: the same Hub set as `calibration.dataset` is refused unless both name a
    split, and different ones. The built-in `general-en-heldout` (≥32k tokens of public-domain
    English) does not overlap."""

    evalSamples: Annotated[int, Field(ge=1, le=4096)] = 64
    """Number of evaluation windows (of up to 512 tokens: 64 windows score about 32k tokens of
    the built-in set)."""

    benchmarks: Annotated[list[BenchmarkSpec], Field(max_length=16, json_schema_extra=BENCHMARKS_UNIQUE_CEL)] = Field(
        default_factory=list)
    """lm-evaluation-harness tasks run on the base and the quantized model with the same settings
    and seeds; each must keep `minRecoveryPercent` of the base score. Each task and metric once
    (the gate keeps one threshold per pair). See docs/quality.md."""

    customEval: CustomEvalSpec | None = None
    """Your own prompts and references (S3 JSON Lines), greedy generation scored by a metric,
    base against quantized."""

    @field_validator("evalDataset")
    @classmethod
    def _dataset_has_no_path_tricks(cls, v: str) -> str:
        return check_no_path_tricks(v, "evalDataset")

    @field_validator("benchmarks")
    @classmethod
    def _each_task_and_metric_once(cls, v: list[BenchmarkSpec]) -> list[BenchmarkSpec]:
        why = duplicate_benchmarks(v)
        if why is not None:
            raise ValueError(why)
        return v


    _eval_dataset_etag: str | None = PrivateAttr(default=None)

    @property
    def eval_dataset_etag(self) -> str | None:
        """The ETag the S3 `evalDataset` was read at (``pinned``), or None: not part of the spec,
        the CRD or the wire; it enters the evaluation identity (fewerbits_api.quality)."""
        return self._eval_dataset_etag

    def pinned(self, etag: str | None) -> QualityGateSpec:
        """This gate with its S3 evaluation set pinned to ``etag`` (None: unpinned), a copy."""
        if etag == self._eval_dataset_etag:
            return self
        out = self.model_copy()
        out._eval_dataset_etag = etag
        return out

    _adapters: tuple[AdapterEvaluation, ...] = PrivateAttr(default=())

    @property
    def adapters(self) -> tuple[AdapterEvaluation, ...]:
        """The LoRA adapters measured with this gate (``with_adapters``): not part of the spec, the
        CRD or the wire; they enter the evaluation identity (fewerbits_api.quality)."""
        return self._adapters

    def with_adapters(self, adapters: list[AdapterEvaluation] | tuple[AdapterEvaluation, ...]) -> QualityGateSpec:
        """This gate measuring ``adapters`` too, a copy (the etag pin kept)."""
        if tuple(adapters) == self._adapters:
            return self
        out = self.model_copy()
        out._eval_dataset_etag = self._eval_dataset_etag
        out._adapters = tuple(adapters)
        return out


class PinnedGateContract(ApiModel):
    """A Job contract's S3 evaluation-set pin (the quantization and canary contracts): the ETag the
    operator read travels beside ``qualityGate`` on the wire and is put back on it when read."""

    evalDatasetEtag: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    """The ETag the operator read of an S3 `qualityGate.evalDataset`: part of the evaluation
    identity (fewerbits_api.quality.eval_identity); the Job refuses other bytes (DatasetChanged)."""

    adapters: Annotated[list[AdapterEvaluation], Field(max_length=MAX_ADAPTERS)] | None = None
    """The model's LoRA adapters to measure on the 16-bit base and on the artifact (docs/adapters.md):
    part of the evaluation identity, put back on ``qualityGate`` when read. Absent: none (a model
    without adapters renders the contract it always did)."""

    @model_validator(mode="after")
    def _pin_eval_dataset(self):
        self.qualityGate._eval_dataset_etag = self.evalDatasetEtag  # type: ignore[attr-defined]
        self.qualityGate._adapters = tuple(self.adapters or ())  # type: ignore[attr-defined]
        return self

_DATA_FREE = ", ".join(f"'{f.value}'" for f in QuantFormat
                       if f is not QuantFormat.AUTO and not FORMAT_FACTS[f].needs_calibration_data)
_EVAL = "(has(self.qualityGate.evalDataset) ? self.qualityGate.evalDataset : 'general-en-heldout')"
_CALIB = "(has(self.calibration) && has(self.calibration.dataset) ? self.calibration.dataset : 'auto')"


class QuantizationSpec(ApiModel):
    """How to quantize: the format (or `auto`), the KV cache, what to leave alone, calibration
    and the quality gate."""

    # The API server refuses what it can see by exact equality (eval_overlaps_calibration's plainest
    # part: the same built-in set, S3 object or Hub URI, split or none); the model also refuses one
    # Hub set read with the same split or without a split on either side (the readers' fallbacks).
    # `auto` falls back to the built-in general-en where the Hub is out of reach, so it overlaps
    # that set. Data-free formats read no calibration data: nothing to overlap.
    model_config = ApiModel.model_config | {"json_schema_extra": {
        "x-kubernetes-validations": [{
            "rule": (f"!has(self.qualityGate) || (has(self.format) && self.format in [{_DATA_FREE}]) || "
                     f"({_EVAL} != {_CALIB} && !({_CALIB} == 'auto' && {_EVAL} == 'general-en'))"),
            "message": "qualityGate.evalDataset is the calibration data (calibration.dataset): perplexity measured on "
                       "the data the quantizer was fitted to flatters the quantized model; use held-out text",
            "fieldPath": ".qualityGate.evalDataset",
        }]
    }}

    format: QuantFormat = QuantFormat.AUTO
    """The quantization format. `auto` lets the planner choose per GPU pool from the GPU's
    compute capability and memory (blackwell: nvfp4, hopper/ada: fp8-dynamic, ampere:
    w4a16-awq, turing: w8a8-int8, stepping down in bits when the model does not fit). An explicit
    format is used on every pool that can run it; `none` serves the base model unquantized."""

    kvCache: KVCacheSetting = KVCacheSetting.AUTO
    """The KV-cache dtype. `auto`: FP8 from compute capability 8.9 (halves KV bytes, doubles
    the sequences that fit), the model dtype below. `fp8`: FP8 where supported. `none`: the
    model dtype everywhere."""

    ignore: Annotated[list[Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.:*\[\]-]+$")]], Field(max_length=64)] = Field(
        default_factory=lambda: ["lm_head"]
    )
    """Layers left unquantized (module names or `re:` patterns as llm-compressor takes them).
    Default `[lm_head]`: the LM head is the most sensitive layer; it is kept at 16 bits and
    counted so in the memory estimate. The architecture adds what it needs to this list, by
    config.json `model_type`: MoE routers (mixtral, qwen2_moe, qwen3_moe, deepseek_v2/v3),
    Qwen shared-expert gates, DeepSeek-V3 multi-token-prediction layers, and the vision tower
    and projector of vision-language models (qwen2_vl, qwen2_5_vl, llava, llava_next, gemma3,
    mistral3); an unknown model type keeps only this list, with a warning. The planner sizes,
    and the recipe gets, the same effective list. An entry matching no layer is a warning; `*`
    or a list matching every Linear is refused (nothing would be quantized)."""

    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)
    """Calibration data for formats that need it."""

    qualityGate: QualityGateSpec | None = None
    """The quality gate. Evaluation always runs; without this field the gate of the matching
    policy, or 3% perplexity increase, applies."""

    requantize: Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")] | None = None
    """Ask for a new artifact made by the tools of the operator's current quantization image: any
    new value (e.g. `2026-11`, `llmcompressor-0.15`) is part of the artifact key, so it starts one
    Job per artifact; the artifact in use keeps serving until the new one passes its gate.
    Unset: upgrading fewerbits (and so llm-compressor) never re-quantizes an existing artifact;
    `status.artifacts[].tools` shows the versions that made it. A policy default sets it for
    every model the policy governs."""

    @model_validator(mode="after")
    def _eval_is_not_the_calibration_data(self) -> QuantizationSpec:
        if self.qualityGate is None or not (self.format is QuantFormat.AUTO
                                            or FORMAT_FACTS[self.format].needs_calibration_data):
            return self
        why = eval_overlaps_calibration(self.calibration.dataset, self.qualityGate.evalDataset)
        if why is not None:
            raise ValueError(why)
        return self


class StorageSpec(ApiModel):
    """Object storage for artifacts, content-addressed: `<uri>/<key>/files/...` and
    `<uri>/<key>/manifest.json` written last."""

    uri: Annotated[str, Field(max_length=512, pattern=STORAGE_URI, json_schema_extra=PATH_TRICKS_CEL)]
    """`s3://bucket/prefix` under which artifacts are published."""

    endpoint: Annotated[str, Field(max_length=512, pattern=HTTP_ENDPOINT)] | None = None
    """S3 endpoint URL for S3-compatible stores (MinIO, Ceph, R2...). Empty: AWS S3."""

    region: Annotated[str, Field(max_length=64, pattern=r"^[a-z0-9-]+$")] | None = None
    """Region of the bucket."""

    credentialsSecret: SecretName | None = None
    """A Secret in the model's namespace with keys `AWS_ACCESS_KEY_ID` and
    `AWS_SECRET_ACCESS_KEY`. Empty: the pod's own identity (IRSA, workload identity)."""

    @field_validator("uri")
    @classmethod
    def _uri_has_no_path_tricks(cls, v: str) -> str:
        return check_no_path_tricks(v, "uri")


# The canary's contract types (fewerbits_api.canary) import QualityGateSpec and StorageSpec from
# here, so that module is imported only now, after them. Imported first itself, it is still
# partial here: its names are then a NameError, which pydantic takes as "resolve on first use".
from . import canary as _canary_module  # noqa: E402


class _CanaryNames:
    def __getattr__(self, name: str) -> object:
        try:
            return getattr(_canary_module, name)
        except AttributeError:
            raise NameError(name) from None


_canary = _CanaryNames()


class CanarySpec(ApiModel):
    """The serving canary (docs/canary.md): every new variant (a new pool, a new artifact, or a
    new served configuration such as a KV-cache dtype or a vLLM image) first runs one pod the
    model's Service does not select; a short Job evaluates it through its OpenAI-compatible API
    with the same quality gate as the quantization Job, and only a passing variant takes traffic.
    The artifact in use keeps serving meanwhile and after a failed verdict."""

    enabled: bool = True
    """Judge each new variant through its serving API before it takes traffic. Turn it off only
    where the served output cannot be judged (a simulator that returns random text): then a
    variant serves on the quantization Job's verdict alone, whose transformers run uses a 16-bit
    KV cache and not the kernels vLLM serves with. A policy's `rules.requireServingCanary`
    refuses `false`."""

    limits: "_canary.CanaryLimits" = Field(default_factory=lambda: _canary.CanaryLimits())
    """Bounds on the evaluation's requests (count, concurrency, per-request timeout)."""


class ServingTarget(ApiModel):
    """One GPU pool to serve on, chosen by exactly one of family, product or node selector."""

    family: GPUFamily | None = None
    """GPU architecture family, as the `nvidia.com/gpu.family` node label names it."""

    product: Annotated[str, Field(max_length=63, pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.]*$")] | None = None
    """GPU product, as the `nvidia.com/gpu.product` node label names it (e.g. `NVIDIA-L4`,
    `NVIDIA-H100-80GB-HBM3`)."""

    nodeSelector: Annotated[dict[LabelKey, LabelValue], Field(min_length=1, max_length=16)] | None = None
    """Node labels that select the pool's nodes."""

    model_config = ApiModel.model_config | {"json_schema_extra": {
        "x-kubernetes-validations": [{
            "rule": "[has(self.family), has(self.product), has(self.nodeSelector)].filter(x, x).size() == 1",
            "message": "a serving target sets exactly one of family, product or nodeSelector",
        }]
    }}

    @model_validator(mode="after")
    def _exactly_one(self) -> ServingTarget:
        chosen = [n for n in ("family", "product", "nodeSelector") if getattr(self, n) is not None]
        if len(chosen) != 1:
            raise ValueError(
                "a serving target sets exactly one of family, product or nodeSelector"
                + (f" (got {', '.join(chosen)})" if chosen else " (got none)")
            )
        return self


class GatewayRef(ApiModel):
    """A Gateway (gateway.networking.k8s.io) the operator attaches the model's HTTPRoute to: the
    route's one `parentRef`."""

    name: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")]
    """The Gateway's name."""

    namespace: Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")] | None = None
    """The Gateway's namespace. Default: the model's. A Gateway in another namespace must allow
    routes from the model's (its listeners' `allowedRoutes`)."""

    sectionName: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")] | None = None
    """The Gateway listener to attach to. Default: every listener that admits the route."""


class PublishedRoute(ApiModel):
    """The HTTPRoute the operator keeps for the model (`spec.serving.gateway`, with the policies'
    defaults), as reconcile resolved it; the loop that writes the route reads only this."""

    gateway: GatewayRef
    """The Gateway the route attaches to."""
    inferencePool: bool = False
    """Whether the model's InferencePool can be the route's backend (routing through one, its CRD
    served, the pool and its picker the model's own). False: the backend is always the Service."""


class ServingSpec(ApiModel):
    """How the quantized model is served: vLLM, one Deployment per GPU pool behind one Service."""

    model_config = ApiModel.model_config | {"json_schema_extra": {
        "x-kubernetes-validations": [
            {"rule": "!has(self.loadFormat) || self.loadFormat != 'stream' || !has(self.artifactCache) "
                     "|| self.artifactCache != 'Node'",
             "message": "artifactCache: Node needs loadFormat: fetch (a streamed load keeps nothing on the node)"},
        ]
    }}

    targets: Annotated[list[ServingTarget], Field(max_length=16)] = Field(default_factory=list)
    """GPU pools to serve on. Empty: every pool the planner finds able to run the model."""

    maxModelLen: Annotated[int, Field(ge=128, le=10_485_760)] | None = None
    """Longest sequence (prompt + output) to serve. Default: the model's own limit, clamped to
    what fits. The KV cache is sized for at least `minConcurrentSequences` of this length."""

    minConcurrentSequences: Annotated[int, Field(ge=1, le=1024)] = 4
    """Sequences of `maxModelLen` the KV cache must hold at once for a pool to qualify; raises
    the tensor-parallel size when a single GPU leaves too little room."""

    gpuMemoryUtilization: Annotated[float, Field(ge=0.3, le=0.98)] = 0.9
    """Fraction of each GPU's memory vLLM may use (`--gpu-memory-utilization`)."""

    servedModelName: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")] | None = None
    """The model name clients send in requests. Default: the QuantizedModel's name."""

    image: Annotated[str, Field(max_length=512, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")] | None = None
    """The vLLM image. Default: the operator's configured vLLM image."""

    replicas: Annotated[int, Field(ge=0, le=1000)] = 1
    """Replicas per variant when autoscaling is off."""

    extraArgs: Annotated[list[ExtraArg], Field(max_length=64)] = Field(default_factory=list)
    """Extra vLLM arguments, appended after the planned ones. Flags that the plan owns or that
    change trust (`--quantization`, `--kv-cache-dtype`, `--dtype`, `--tensor-parallel-size`,
    `--trust-remote-code`, ...) are refused unless a policy allows them."""

    routing: Literal["service", "inferencePool"] | None = None
    """How requests reach the variants. `service` (the default): the model's Service, which
    spreads requests evenly over every pod. `inferencePool`: also an InferencePool
    (inference.networking.k8s.io/v1, Gateway API Inference Extension) whose endpoint picker sends
    each request to the pod with the most free KV cache, the shortest queue and the longest
    cached prefix of its prompt, so a slow pool gets less traffic and requests that share a prompt
    prefix reach the pod that holds it; needs that CRD in the cluster and a gateway that
    implements it. The Service stays either way."""

    gateway: GatewayRef | None = None
    """A Gateway to reach the model through: the operator keeps an HTTPRoute
    (gateway.networking.k8s.io/v1) named like the model, attached to it, with one backend. With
    `routing: inferencePool` that backend is the model's InferencePool, except while the model may
    reach zero (autoscaling with `minReplicas: 0`) and has at most one ready pod: then it is the
    model's Service, which reaches the activator at zero, so a request through the gateway is held
    while a replica starts instead of failing; it returns to the InferencePool once a second pod is
    ready. With `routing: service` the backend is always the Service. Needs the HTTPRoute CRD in the
    cluster; an HTTPRoute of the model's name that the model does not own is left untouched."""

    loadFormat: Literal["fetch", "stream"] = "fetch"
    """How vLLM gets the weights. `fetch`: the init container downloads and verifies every file
    (sha256 against the manifest) to local disk, then vLLM loads them. `stream`: vLLM reads the
    safetensors straight from object storage with the Run:ai model streamer
    (`--load-format runai_streamer`); the init container only checks the manifest, so the files'
    digests are not verified before serving. See docs/cache.md for the measured trade-off."""

    artifactCache: Literal["Pod", "Node"] = "Pod"
    """Where a fetched artifact is kept. `Pod`: an emptyDir per pod (every pod downloads).
    `Node`: one verified copy per node, shared read-only by every pod of the artifact there, so a
    scale-up on a node that holds it fetches nothing. `Node` mounts a hostPath, which only the
    `privileged` Pod Security level admits (docs/cache.md)."""

    canary: CanarySpec = Field(default_factory=CanarySpec)
    """The serving canary: a new variant is judged through its own serving API (its kernels, its
    KV-cache dtype) before it takes traffic. See docs/canary.md."""

    @model_validator(mode="after")
    def _stream_keeps_nothing_on_the_node(self) -> "ServingSpec":
        if self.loadFormat == "stream" and self.artifactCache == "Node":
            raise ValueError("artifactCache: Node needs loadFormat: fetch (a streamed load keeps nothing on the node)")
        return self


class AutoscalingSpec(ApiModel):
    """Scaling of each variant on vLLM's KV-cache usage and queue depth."""

    enabled: bool = True
    """Scale each variant between minReplicas and maxReplicas. Off: `serving.replicas`."""

    minReplicas: Annotated[int, Field(ge=0, le=1000)] = 1
    """Fewest replicas per variant."""

    maxReplicas: Annotated[int, Field(ge=1, le=1000)] = 4
    """Most replicas per variant (a policy's `rules.maxReplicas` caps it)."""

    targetKVCacheUsage: Annotated[float, Field(gt=0, le=1)] = 0.7
    """Average KV-cache usage (0-1, `vllm:kv_cache_usage_perc`) to hold each variant at."""

    maxWaitingRequests: Annotated[int, Field(ge=0, le=100000)] = 5
    """Waiting requests per replica (`vllm:num_requests_waiting`) above which the variant scales
    up even when KV usage is low (prefill-heavy load)."""

    scaleDownDelaySeconds: Annotated[int, Field(ge=0, le=86400)] = 300
    """Seconds of sustained lower demand before scaling down."""

    predictive: bool = True
    """Also scale ahead of the load: forecast each variant's demand one pod start-up ahead from its
    own history (daily and weekly seasonality, recent trend) and add replicas early for the
    forecast's upper band. It only adds capacity early or holds it; it never scales below what
    the reactive rules need now. Off: the forecast is still shown in `status.serving[].forecast`,
    but only the reactive rules scale."""

    model_config = ApiModel.model_config | {"json_schema_extra": {
        "x-kubernetes-validations": [{
            "rule": "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
            "message": "minReplicas must be less than or equal to maxReplicas",
        }]
    }}

    @model_validator(mode="after")
    def _min_le_max(self) -> AutoscalingSpec:
        # Only when both are written here: a policy's defaults may set one and leave the other to
        # the model. The complete spec checks the effective pair (QuantizedModelSpec).
        if {"minReplicas", "maxReplicas"} <= self.model_fields_set and self.minReplicas > self.maxReplicas:
            raise ValueError(
                f"minReplicas ({self.minReplicas}) must be less than or equal to maxReplicas ({self.maxReplicas})"
            )
        return self


class QuantizedModelSpec(ApiModel):
    """What to quantize, how, where to store it, and how to serve and scale it."""

    model_config = ApiModel.model_config | {"json_schema_extra": {
        "x-kubernetes-validations": [
            {"rule": "!has(self.adapters) || !has(self.serving) || !has(self.serving.servedModelName) "
                     "|| self.adapters.all(a, a.name != self.serving.servedModelName)",
             "message": "an adapter may not be named as the model is served (serving.servedModelName): a request "
                        "naming it would reach the base, not the adapter"},
        ]
    }}

    source: SourceSpec
    """The base model."""

    quantization: QuantizationSpec = Field(default_factory=QuantizationSpec)
    """Format, KV cache, ignored layers, calibration and quality gate."""

    storage: StorageSpec | None = None
    """Where artifacts are published. Default: the matching policy's, else the operator's."""

    serving: ServingSpec = Field(default_factory=ServingSpec)
    """Serving with vLLM."""

    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    """Autoscaling of each variant."""

    adapters: AdapterList = Field(default_factory=list)
    """LoRA adapters served on the quantized base, each judged on every pool's base before it is
    served there (docs/adapters.md). A request names an adapter as its `model`."""

    @model_validator(mode="after")
    def _adapters_named_apart(self) -> QuantizedModelSpec:
        why = duplicate_adapter(self.adapters)
        if why is not None:
            raise ValueError(why)
        served = self.serving.servedModelName
        for i, a in enumerate(self.adapters):
            if served is not None and a.name == served:
                raise ValueError(f"adapters[{i}].name {a.name!r} is serving.servedModelName: a request naming it "
                                 "would reach the base, not the adapter")
        return self

    @model_validator(mode="after")
    def _effective_min_le_max(self) -> QuantizedModelSpec:
        a = self.autoscaling
        if a.minReplicas > a.maxReplicas:
            raise ValueError(
                f"autoscaling.minReplicas ({a.minReplicas}) must be less than or equal to "
                f"autoscaling.maxReplicas ({a.maxReplicas})"
            )
        return self


# ---------------------------------------------------------------- status


class PlanVariant(ApiModel):
    """What the planner chose for one GPU pool."""

    pool: str
    """The pool's name (derived from its GPU product and node selector)."""
    gpuProduct: str
    """`nvidia.com/gpu.product` of the pool's nodes."""
    family: str | None = None
    """`nvidia.com/gpu.family` of the pool's nodes."""
    format: QuantFormat
    """The quantization format for this pool."""
    kvCacheDtype: str
    """vLLM `--kv-cache-dtype` (`fp8` or `auto`)."""
    dtype: str
    """vLLM `--dtype` (`bfloat16` from compute capability 8.0, else `float16`)."""
    tensorParallelSize: int
    """GPUs per replica."""
    maxModelLen: int
    """vLLM `--max-model-len`."""
    gpuMemoryUtilization: float = 0.9
    """vLLM `--gpu-memory-utilization`: the share of each GPU's memory the plan sized for."""
    weightsGiB: float
    """Estimated weight memory per replica, GiB."""
    kvCacheTokens: int
    """Estimated tokens the KV cache holds per replica."""
    decodeTokensPerSecond: float
    """Estimated batch-1 decode speed (memory-bound: bandwidth / bytes read per token)."""
    warnings: list[str] = Field(default_factory=list)
    """What a person should know (fallback kernels, clamped lengths...)."""
    vllmArgs: list[str] = Field(default_factory=list)
    """The vLLM arguments the plan implies, for display. Serving pods are rendered from the typed
    fields above, never from this list."""
    servedAsIs: bool = False
    """True when the source checkpoint already is `format` (its config.json carries a
    `quantization_config`): nothing is quantized; the artifact is the source itself, pinned by
    `spec.source.revision`, copied unchanged into `spec.storage` by a `none` Job (its disk and time
    in `quantizationJobs`; a policy's `rules.maxSourceCopyGiB` caps the copy)."""
    nodesPerReplica: Annotated[int, Field(ge=1, le=64)] = 1
    """Nodes one replica spans. 1: a Deployment, `tensorParallelSize` GPUs on one node. Above 1:
    the model fits no single node of the pool, so each replica is a LeaderWorkerSet group of this
    many pods, one per node, each with `tensorParallelSize` GPUs (tensor parallel inside the node,
    pipeline parallel across nodes: `--pipeline-parallel-size` = nodesPerReplica)."""
    lora: LoraPlan | None = None
    """What this pool's vLLM holds for `spec.adapters` (absent: no adapters, or none fits here)."""
    adaptersRefused: str | None = None
    """Why this pool serves none of `spec.adapters` (their buffers do not fit), with the figures."""


class RejectedPool(ApiModel):
    """A pool the model will not be served on, and why."""

    pool: str
    """The pool's name."""
    reason: str
    """Why, in words a person can act on."""


class QuantizationJobSize(ApiModel):
    """What the quantization Job of one artifact needs, sized from the model's shape (docs/jobs.md):
    its requests and limits are rendered from these figures."""

    format: QuantFormat
    """The artifact's format."""
    gpus: int
    """GPUs the Job requests (`nvidia.com/gpu`): the fewest GPUs of its pool that hold the bf16
    model for the evaluation, capped by the pool's GPUs per node and the policy; 0 runs on CPU."""
    gpuMemoryGiB: float
    """GPU memory one GPU needs for calibration (the peak torch allocates; the pool must also hold
    the CUDA context): llm-compressor onloads one decoder layer at a time, with one sample's
    activations, GPTQ's Hessians and solve, and AWQ's cache of every calibration sample's layer
    outputs (it grows with samples × maxSeqLength × hidden size). See docs/jobs.md."""
    memoryGiB: int
    """Host memory (request and limit): the whole model as llm-compressor loads it, calibration
    activations, and headroom."""
    ephemeralStorageGiB: int
    """Disk for the source download, the quantized output and headroom."""
    estimatedMinutes: int
    """Estimated wall time; the Job's deadline is derived from it."""
    pool: str | None = None
    """The GPU pool the Job runs on (None: CPU, or the policy's nodeSelector decides)."""
    evaluationOffloadGiB: float = 0.0
    """bf16 weights the evaluation keeps in host memory because the Job's GPUs cannot hold them
    (accelerate's CPU offload: slower, never two copies)."""
    volume: Literal["emptyDir", "ephemeral"] = "emptyDir"
    """Where the work directory lives: node-local `emptyDir`, or a generic ephemeral volume (a PVC
    from a StorageClass) above the operator's size threshold."""


class PlanStatus(ApiModel):
    """The planner's decision for every pool."""

    variants: list[PlanVariant] = Field(default_factory=list)
    """One entry per pool the model is served on."""
    rejected: list[RejectedPool] = Field(default_factory=list)
    """Pools left out, each with its reason."""
    ignore: list[str] | None = None
    """The layers kept at 16 bits: `spec.quantization.ignore` plus what the model's architecture
    requires (routers, shared-expert gates, multi-token-prediction layers, vision towers). The
    plan sized exactly these, and the quantization recipe gets exactly these (they are part of the
    artifact key)."""
    quantizationJobs: list[QuantizationJobSize] = Field(default_factory=list)
    """What each artifact's quantization Job needs (one entry per artifact format to produce)."""


class QualityStatus(ApiModel):
    """Quality measured by the quantization Job."""

    baselinePerplexity: float
    """Perplexity of the base model on the evaluation windows."""
    perplexity: float
    """Perplexity of the quantized model on the same windows."""
    increasePercent: float
    """(perplexity / baselinePerplexity - 1) x 100."""
    maxIncreasePercent: float
    """The gate it was judged against."""
    passed: bool
    """Whether the artifact passed the gate."""
    metrics: list[MetricResult] = Field(default_factory=list)
    """Every metric of the gate: base, quantized, recovery, threshold, verdict, evaluation time."""
    worstRecoveryPercent: float | None = None
    """The lowest recovery over the metrics."""
    evalIdentity: str | None = None
    """The evaluation identity the figures were measured under (docs/quality.md)."""
    missing: list[str] = Field(default_factory=list)
    """Metrics the gate asks for that were not measured under its evaluation identity (the gate
    fails closed until they are)."""


class ArtifactFailure(ApiModel):
    """Why an artifact could not be produced, recorded for the generation that tried. A Job that
    failed is not re-run for the same generation (it would fail the same way); any edit of the spec
    retries."""

    generation: int
    """The spec generation whose Job failed."""
    reason: str
    """A CamelCase word for programs: JobFailed, or the Job's own failure reason (e.g. the
    quantization stage's error class)."""
    message: str
    """What happened, from the failed pod's termination message."""
    job: str
    """The Job that failed."""


class ArtifactQueue(ApiModel):
    """Why the artifact's quantization Job has not started yet, and where it stands."""

    reason: Literal["OperatorCap", "Kueue"]
    """`OperatorCap`: the operator-wide cap on running quantization Jobs is reached and the Job
    is not created yet; `Kueue`: the Job exists, suspended, until Kueue admits it from its
    LocalQueue."""
    position: Annotated[int, Field(ge=1)] | None = None
    """1 starts next. Under the operator cap: the order is by `since`, then namespace, model name
    and Job name, the same for every model. Absent for Kueue (Kueue orders its own queue)."""
    since: str
    """When this model first wanted the Job and could not start it (RFC 3339)."""
    localQueue: str | None = None
    """The Kueue LocalQueue (in the model's namespace) the Job waits in."""


class ArtifactStatus(ApiModel):
    """A quantized artifact this model uses or is producing."""

    key: str
    """The content-addressed key (sha256 of everything that decides the bytes)."""
    uri: str
    """Where it lives (`<storage uri>/<key>/`)."""
    format: QuantFormat
    """Its format."""
    variants: list[str] = Field(default_factory=list)
    """The pools that serve it."""
    sizeBytes: int | None = None
    """Total size of its files."""
    job: str | None = None
    """The quantization Job that produces it (absent on a cache hit)."""
    cacheHit: bool | None = None
    """True when the artifact already existed and no Job ran."""
    quality: QualityStatus | None = None
    """Measured quality and the gate verdict."""
    tools: dict[str, str] = Field(default_factory=dict)
    """Versions of the tools that made it."""
    failure: ArtifactFailure | None = None
    """Set when its Job failed; kept after the Job's TTL removes it."""
    queue: ArtifactQueue | None = None
    """Set while its quantization Job waits for a slot (operator cap) or for Kueue's admission."""
    calibration: CalibrationUsed | None = None
    """The calibration data its Job used (samples, tokens, source), from the manifest; `shortfall`
    says why fewer samples than asked (the Quantized condition's reason is then
    CalibrationReduced)."""


class CalibrationDataStatus(ApiModel):
    """The calibration data the model's artifacts are made with, and what pins it."""

    dataset: str
    """`spec.quantization.calibration.dataset`."""
    pinned: bool
    """Whether the artifact key names these exact bytes: a built-in set (its sha256), an S3 object
    whose ETag was read, a Hub dataset with `@revision`."""
    etag: str | None = None
    """S3: the object's ETag, part of the artifact key (changed data, new key, new Job)."""
    versionId: str | None = None
    """S3: the object's VersionId on a versioned bucket (recorded, not keyed: it changes on every
    upload, identical bytes included)."""
    revision: str | None = None
    """Hub: the dataset revision (part of the URI, so of the key)."""


class DemandForecast(ApiModel):
    """A variant's demand one pod start-up ahead, in replicas at the KV target
    (`ready x avgKV / targetKVCacheUsage`, or what the queue rule wants when it fires)."""

    phase: Literal["Training", "Trend", "Daily", "Weekly"]
    """`Training`: too few forecasts checked against what came to know the band; the forecast
    does not scale yet (after an operator restart, ~1 h). `Trend`: under a day of history, the
    recent trend only. `Daily`: with the daily seasonality. `Weekly`: with the weekly too."""
    historySince: str | None = None
    """Oldest sample the forecast is made from (RFC 3339; kept in the operator's memory, so an
    operator restart starts the history again)."""
    horizonSeconds: int
    """How far ahead: the variant's pod start-up (measured) plus one autoscaler pass."""
    demandReplicas: float
    """The present demand."""
    expectedReplicas: float
    """The forecast."""
    upperReplicas: float | None = None
    """Upper end of the band (the forecast's realised errors, 90th percentile): the predictive
    rule scales for this."""
    lowerReplicas: float | None = None
    """Lower end of the band (10th percentile; informative: the forecast never removes capacity)."""


class VariantServingStatus(ApiModel):
    """Live state of one variant's Deployment."""

    variant: str
    """The pool it serves on."""
    deployment: str
    """Its Deployment's name."""
    artifactKey: str | None = None
    """The artifact it serves."""
    replicas: int = 0
    """Replicas the Deployment has."""
    readyReplicas: int = 0
    """Replicas ready to serve."""
    desiredReplicas: int | None = None
    """Replicas the autoscaler wants."""
    kvCacheUsage: float | None = None
    """Average KV-cache usage over ready replicas (0-1)."""
    waitingRequests: float | None = None
    """Average waiting requests per ready replica."""
    lastScaleTime: str | None = None
    """When the autoscaler last changed the replica count (RFC 3339)."""
    nodesPerReplica: Annotated[int, Field(ge=1, le=64)] = 1
    """Nodes (pods) per replica: above 1 the variant runs as a LeaderWorkerSet named `deployment`,
    whose replicas are groups of this many pods."""
    podsWithoutMetrics: Annotated[int, Field(ge=0)] | None = None
    """Ready pods of this variant that exposed no vLLM metrics at the autoscaler's last pass (a
    wrong image, an old vLLM): they are served but not scaled down, and with InferencePool routing
    the endpoint picker spreads requests evenly until they report (event `MetricsUnavailable`)."""
    forecast: DemandForecast | None = None
    """The autoscaler's forecast of this variant's demand one pod start-up ahead (absent before
    its first sample)."""
    lastScaleCause: Literal["Reactive", "Predictive"] | None = None
    """Why the autoscaler last changed the replica count: `Reactive` (the KV and queue rules, the
    bounds, the placement across pools) or `Predictive` (the forecast's upper band, ahead of the
    load)."""
    canary: CanaryStatus | None = None
    """The serving canary of the variant's current served configuration (absent with
    `serving.canary.enabled: false`, and for a variant serving since before it existed)."""


class CanaryStatus(ApiModel):
    """The serving canary of one variant's served configuration, and its verdict."""

    configHash: str
    """The served configuration judged (`fewerbits_api.canary.serving_config_hash`: artifact,
    image, planned vLLM arguments with the KV-cache dtype, GPU product; not replicas)."""
    artifactKey: str
    """The artifact the canary serves."""
    kvCacheDtype: str
    """The KV-cache dtype the canary serves with."""
    phase: Literal["Pending", "Evaluating", "Passed", "Failed", "Error"]
    """`Pending`: the canary pod is starting. `Evaluating`: the evaluation Job runs. `Passed`: the
    variant takes traffic. `Failed`: a metric missed its threshold; the variant is not rolled out.
    `Error`: no verdict (the canary pod never became ready, or the evaluation could not run); the
    variant is not rolled out (fail closed)."""
    reason: str = ""
    """Why, in one line: the failing metric with its figures and the KV-cache dtype, or the
    pod's or the Job's error."""
    since: str | None = None
    """When the phase began (RFC 3339)."""
    job: str | None = None
    """The evaluation Job."""
    metrics: list["_canary.ServingMetric"] = Field(default_factory=list)
    """The served scores, each beside the base model's and the quantization Job's."""
    skipped: list["_canary.SkippedMetric"] = Field(default_factory=list)
    """Metrics of the gate the server could not be asked for, with the reason."""
    requests: int = 0
    """Requests the evaluation sent."""
    seconds: float = 0.0
    """Evaluation wall time."""


class EffectiveAutoscaling(AutoscalingSpec):
    """The autoscaling the operator applies to each variant, as reconcile resolved it."""

    policyMaxReplicas: Annotated[int, Field(ge=1, le=1000)] | None = None
    """The matching policy's `rules.maxReplicas`: the autoscaler never goes above it, even when
    `minReplicas` is higher."""
    placement: Literal["perVariant", "cheapestPool"] = "perVariant"
    """Where extra capacity goes. `cheapestPool` (routing through an InferencePool, whose picker
    follows each pod's free capacity): the model's demand is added on the pool with the lowest cost
    per served token and removed from the most expensive first. `perVariant` (routing through the
    Service, which splits requests evenly over pods): each variant scales on its own load, since
    with an even split a replica of any pool takes the same share of requests."""
    poolCostWeights: Annotated[dict[Annotated[str, Field(max_length=253)], float], Field(max_length=128)] | None = None
    """The cost weight per GPU of each pool (by pool name or GPU product) the `cheapestPool`
    placement uses: the policy's `rules.poolCostWeights` over the operator's `gpuCostWeights`."""


AUTOSCALER_FIELDS = ("desiredReplicas", "kvCacheUsage", "waitingRequests", "lastScaleTime", "podsWithoutMetrics",
                     "forecast", "lastScaleCause")
"""The fields of `status.serving[]` the autoscaler writes; reconcile keeps them as they are."""


class EffectiveValue(ApiModel):
    """One value of the effective spec that a policy set, and which policy."""

    path: Annotated[str, Field(max_length=256)]
    """Where the value applies: `spec.<field>` for a policy default the model leaves unset,
    `rules.<rule>` for a binding rule (a ceiling, a cap, an allow-list)."""
    value: Annotated[str, Field(max_length=256)]
    """The value as compact JSON (cut at 256 characters)."""
    source: Annotated[str, Field(max_length=512)]
    """The QuantizationPolicy that set it (comma-separated when several allow-lists combine)."""


class EffectivePolicies(ApiModel):
    """What the matching QuantizationPolicies contributed to this model (`fewerbits explain`)."""

    policies: Annotated[list[Annotated[str, Field(max_length=253)]], Field(max_length=64)] = Field(default_factory=list)
    """The policies that govern the model, highest priority first."""
    values: Annotated[list[EffectiveValue], Field(max_length=64)] = Field(default_factory=list)
    """The values that came from policies (the model's own fields are not listed)."""


class QuantizedModelStatus(ApiModel):
    """Observed state, written only by the operator."""

    observedGeneration: int | None = None
    """The generation of the spec this status describes."""
    conditions: list[Condition] = Field(default_factory=list)
    """Accepted, Planned, Quantized, QualityGatePassed, ServingQualityPassed, Deployed, Ready."""
    plan: PlanStatus | None = None
    """The planner's decision."""
    artifacts: list[ArtifactStatus] = Field(default_factory=list)
    """Artifacts in use or in the making."""
    serving: list[VariantServingStatus] = Field(default_factory=list)
    """Per-variant serving state."""
    endpoint: str | None = None
    """The OpenAI-compatible endpoint, `http://<name>.<namespace>.svc:8000`."""
    formats: str | None = None
    """Formats in the plan, comma-separated (for `kubectl get`)."""
    replicas: str | None = None
    """Ready/desired replicas over all variants, e.g. `3/4` (for `kubectl get`)."""
    worstRecovery: str | None = None
    """The lowest quality recovery over the artifacts' metrics, e.g. `98.2% benchmark:arc_easy/acc`
    (for `kubectl get -o wide`)."""
    autoscaling: EffectiveAutoscaling | None = None
    """The autoscaling the operator applies: the model's spec over the matching policy's defaults,
    with the policy's replica cap. Absent while the spec is not accepted (an invalid or
    violated policy fails closed: nothing is scaled). The autoscaler reads only this."""
    route: PublishedRoute | None = None
    """The HTTPRoute the operator keeps (`spec.serving.gateway`): absent when none is named, the
    cluster does not serve HTTPRoutes, or a route of the model's name is not its own (see the
    Deployed condition). Its backend switches between the InferencePool and the Service at zero."""
    effective: EffectivePolicies | None = None
    """The policies governing the model and the effective values they set, each with its source."""
    calibrationData: CalibrationDataStatus | None = None
    """The calibration data in use and its pin (absent when no artifact uses calibration data)."""
    adapters: list[AdapterStatus] | None = None
    """Each of `spec.adapters`: its rank and modules, and its verdict on every pool's base (absent
    without adapters)."""


class ObjectMeta(ApiModel):
    """The parts of metadata the operator reads; the rest is kept as the API server sent it."""

    model_config = ApiModel.model_config | {"extra": "allow"}

    name: str
    """Object name."""
    namespace: str | None = None
    """Namespace (absent for cluster-scoped kinds)."""
    uid: str | None = None
    """Unique id."""
    generation: int | None = None
    """Spec generation."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Labels."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Annotations."""


class QuantizedModel(ApiModel):
    """A base model quantized per GPU pool, quality-gated, served by vLLM and autoscaled."""

    KIND: ClassVar[str] = KIND
    model_config = ApiModel.model_config | {"extra": "ignore"}

    apiVersion: Literal["fewerbits.io/v1alpha1"] = API_VERSION
    """API version."""
    kind: Literal["QuantizedModel"] = KIND
    """Kind."""
    metadata: ObjectMeta
    """Standard object metadata."""
    spec: QuantizedModelSpec
    """Desired state."""
    status: QuantizedModelStatus | None = None
    """Observed state."""

    @field_validator("metadata")
    @classmethod
    def _name_is_dns_label(cls, m: ObjectMeta) -> ObjectMeta:
        # The name becomes Deployment, Service and Job names: a DNS label, short enough for
        # suffixes (pool and hash) to fit in 63 characters.
        import re

        if not re.fullmatch(DNS1123_LABEL.strip("^$"), m.name) or len(m.name) > 40:
            raise ValueError(
                f"name: {m.name!r} must be a DNS label (lowercase letters, digits, '-') of at most 40 characters"
            )
        return m
