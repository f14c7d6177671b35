"""LoRA adapters served on a model's quantized base (``spec.adapters[]``), what the planner gives
them per pool (``PlanVariant.lora``) and what is known of each (``status.adapters[]``).

An adapter is trained on the 16-bit base; on a quantized base it can lose what it learned. Each
adapter is therefore judged per pool, on the base that pool serves: its perplexity on its own
evaluation text over the quantized base against the same adapter over the 16-bit base, with the
model's gate thresholds unless the adapter sets its own (docs/adapters.md).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from .base import ApiModel
from .validation import (
    DATASET_URI,
    DNS1123_SUBDOMAIN,
    HF_REPO,
    HTTP_ENDPOINT,
    PATH_TRICKS_CEL,
    REVISION,
    S3_BUCKET,
    SAFE_PATH,
    UriSource,
    check_no_path_tricks,
)

ADAPTER_SOURCE_URI = rf"^(hf://{HF_REPO}|s3://{S3_BUCKET}(/{SAFE_PATH})?)$"
"""An adapter lives on the Hub or in S3: the operator reads its adapter_config.json before planning."""

ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
"""What a request names as its `model` to reach the adapter (vLLM's LoRA name): no `/`, so the name
is also a path segment of the adapter's folder in the serving pod."""

MAX_ADAPTERS = 32
"""Adapters per model: each one is evaluated on every pool's base (one Job pass each), and vLLM
keeps every one of them in host memory (`--max-cpu-loras`)."""

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.33 accepts for `--max-lora-rank` (vllm/config/lora.py MaxLoRARanks): the
planner rounds the largest adapter rank up to one of them."""

AdapterName = Annotated[str, Field(min_length=1, max_length=128, pattern=ADAPTER_NAME)]

_NAMES_UNIQUE_CEL = {"x-kubernetes-validations": [{
    "rule": "self.all(a, self.exists_one(b, b.name == a.name))",
    "message": "adapter names must be unique: a request names the adapter by it",
}]}


class AdapterSourceSpec(UriSource):
    """Where a LoRA adapter comes from (a peft adapter: adapter_config.json and its weights)."""

    uri: Annotated[str, Field(max_length=512, pattern=ADAPTER_SOURCE_URI, json_schema_extra=PATH_TRICKS_CEL)]
    """The adapter: `hf://org/name` (Hugging Face Hub) or `s3://bucket/prefix` (a directory with
    adapter_config.json and adapter_model.safetensors)."""

    revision: Annotated[str, Field(max_length=255, pattern=REVISION)] | None = None
    """The revision to serve: a commit hash (best: immutable), tag or branch. Part of the adapter's
    identity, as `spec.source.revision` is of the base's."""

    endpoint: Annotated[str, Field(max_length=512, pattern=HTTP_ENDPOINT)] | None = None
    """For `s3://` adapters on an S3-compatible store: its endpoint URL. Empty: AWS S3."""

    region: Annotated[str, Field(max_length=64, pattern=r"^[a-z0-9-]+$")] | None = None
    """For `s3://` adapters: the bucket's region."""

    credentialsSecret: Annotated[str, Field(min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN)] | None = None
    """A Secret in the same namespace with credentials for the adapter, keyed as for
    `spec.source.credentialsSecret`. Never copied anywhere else."""



class AdapterGateSpec(ApiModel):
    """How an adapter is judged on each pool's quantized base. Every field left out takes the
    model's `spec.quantization.qualityGate` value."""

    maxPerplexityIncreasePercent: Annotated[float, Field(gt=0, le=1000)] | None = None
    """Largest allowed perplexity increase of the adapter on the quantized base over the same
    adapter on the 16-bit base, in percent. Unset: the model's gate value (default 3)."""

    evalDataset: Annotated[str, Field(max_length=512, pattern=DATASET_URI, json_schema_extra=PATH_TRICKS_CEL)] | None = None
    """Text in the adapter's own domain for its perplexity, in the forms of
    `qualityGate.evalDataset`. Unset: the model's evaluation set (which may not be the text the
    adapter was trained for: name yours)."""

    evalSamples: Annotated[int, Field(ge=1, le=4096)] | None = None
    """Number of evaluation windows. Unset: the model's `qualityGate.evalSamples`."""

    @field_validator("evalDataset")
    @classmethod
    def _dataset_has_no_path_tricks(cls, v: str | None) -> str | None:
        return check_no_path_tricks(v, "evalDataset") if v is not None else v


class AdapterSpec(ApiModel):
    """One LoRA adapter served on the model's quantized base, on every pool where it passes."""

    name: AdapterName
    """The name a request puts in `model` to use the adapter (vLLM's LoRA name). Unique among the
    model's adapters and different from the model's served name."""

    source: AdapterSourceSpec
    """The adapter's files."""

    gate: AdapterGateSpec = Field(default_factory=AdapterGateSpec)
    """How the adapter is judged on each quantized base."""


AdapterList = Annotated[list[AdapterSpec], Field(max_length=MAX_ADAPTERS, json_schema_extra=_NAMES_UNIQUE_CEL)]


def duplicate_adapter(adapters: list[AdapterSpec]) -> str | None:
    """Why two adapters share a name (with both indexes), or None."""
    seen: dict[str, int] = {}
    for i, a in enumerate(adapters):
        j = seen.setdefault(a.name, i)
        if j != i:
            return f"adapters[{j}] and adapters[{i}] are both named {a.name!r}: a request names the adapter by it"
    return None


# ---------------------------------------------------------------- what a Job measures


class AdapterEvaluation(ApiModel):
    """One adapter as a quantization or evaluation Job measures it: where its files are, its
    evaluation set and threshold resolved against the model's gate. Credentials reach the Job as
    environment variables (``adapter_env``), never in here."""

    name: AdapterName
    """The adapter's name."""
    uri: Annotated[str, Field(max_length=512, pattern=ADAPTER_SOURCE_URI)]
    """Its files (hf:// or s3://)."""
    revision: str | None = None
    """Its revision."""
    endpoint: str | None = None
    """The S3-compatible endpoint of an s3:// adapter."""
    region: str | None = None
    """The bucket's region."""
    evalDataset: Annotated[str, Field(max_length=512, pattern=DATASET_URI)]
    """The text its perplexity is measured on."""
    evalSamples: Annotated[int, Field(ge=1, le=4096)]
    """Evaluation windows."""
    maxIncreasePercent: Annotated[float, Field(gt=0, le=1000)]
    """Largest allowed increase over the same adapter on the 16-bit base (the verdict only)."""
    hasCredentials: bool = False
    """Whether the Job's environment carries its Secret's keys (``adapter_env``)."""
    evalDatasetEtag: str | None = None
    """The ETag the operator read of an S3 evaluation set: the Job refuses other content, and the
    identity names it (a changed set is measured again)."""

    def identity_doc(self) -> dict:
        """What decides its figures (not its verdict), for the evaluation identity."""
        from .datasets import BUILTIN_DATASET_SHA256

        doc = {"name": self.name, "uri": self.uri, "revision": self.revision, "endpoint": self.endpoint,
               "evalDataset": self.evalDataset, "evalDatasetSha256": BUILTIN_DATASET_SHA256.get(self.evalDataset),
               "evalSamples": self.evalSamples,
               # Reports that publish the adapter's files (adapterKey): one from the release before
               # does not answer, so it is measured again, and published, once.
               "filesPublished": 1}
        if self.evalDatasetEtag:  # absent when unpinned: identities made before pins are unchanged
            doc["evalDatasetEtag"] = self.evalDatasetEtag
        return doc


def adapter_env(index: int, key: str) -> str:
    """The Job's environment variable for key ``key`` (HF_TOKEN, AWS_ACCESS_KEY_ID, ...) of the
    Secret of the adapter at ``index`` in the contract."""
    return f"FEWERBITS_ADAPTER_{index}_{key}"


def adapter_evaluations(adapters: list[AdapterSpec], gate, etags: dict[str, str] | None = None
                        ) -> list[AdapterEvaluation]:
    """Each adapter with its gate's unset fields taken from the model's ``gate`` (a QualityGateSpec),
    and its S3 evaluation set pinned to the ETag ``etags`` gives it (by URI)."""
    etags = etags or {}
    return [AdapterEvaluation(
        name=a.name, uri=a.source.uri, revision=a.source.revision, endpoint=a.source.endpoint,
        region=a.source.region, hasCredentials=a.source.credentialsSecret is not None,
        evalDataset=a.gate.evalDataset or gate.evalDataset, evalSamples=a.gate.evalSamples or gate.evalSamples,
        maxIncreasePercent=a.gate.maxPerplexityIncreasePercent or gate.maxPerplexityIncreasePercent,
        evalDatasetEtag=etags.get(a.gate.evalDataset or gate.evalDataset))
        for a in adapters]


class AdapterQuality(ApiModel):
    """One adapter measured on the 16-bit base and on an artifact, on the same windows of its
    evaluation text (written by the Job into the quality report)."""

    model_config = ApiModel.model_config | {"extra": "ignore"}  # read by images older than the writer

    name: str
    """The adapter."""
    baselinePerplexity: float | None = None
    """The adapter on the 16-bit base."""
    perplexity: float | None = None
    """The adapter on the artifact."""
    increasePercent: float | None = None
    """(perplexity / baselinePerplexity - 1) x 100."""
    maxIncreasePercent: float
    """The threshold it was judged against."""
    passed: bool
    """The verdict: never served on this artifact when false."""
    windows: int = 0
    """Evaluation windows scored."""
    tokens: int = 0
    """Tokens scored."""
    increaseCI95: list[float] | None = None
    """95% interval of the increase, percent (paired per window)."""
    error: str | None = None
    """Why it could not be measured (its files unreadable, its modules not the base's): not passed."""
    adapterKey: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
    """Where the Job published the adapter's files as it measured them, in the model's storage
    (``<storage.uri>/<adapterKey>/``, a manifest like an artifact's): the key is the SHA-256 of its
    source and the files' own digests, so the same files have the same key whichever Job read them."""
    sizeBytes: int | None = None
    """The published files' total size."""


# ---------------------------------------------------------------- plan


class LoraPlan(ApiModel):
    """What one pool's vLLM holds for the model's adapters (`--enable-lora` and its sizes)."""

    adapters: list[str] = Field(default_factory=list)
    """The adapters this pool can hold (each still needs its gate on this pool's base)."""

    maxLoras: int
    """Adapters in one batch at once (`--max-loras`): as many as the model has, narrowed where
    their GPU buffers would not leave the KV cache the sequences it needs."""

    maxLoraRank: int
    """The largest adapter rank, rounded up to a value vLLM accepts (`--max-lora-rank`)."""

    maxCpuLoras: int
    """Adapters kept in host memory (`--max-cpu-loras`): every one, so none is read again from disk
    when a request names it."""

    gpuMemoryGiB: float
    """What vLLM preallocates per GPU for `maxLoras` adapters of `maxLoraRank` on every layer it can
    adapt, taken from the KV cache's share."""


# ---------------------------------------------------------------- status


class AdapterPoolStatus(ApiModel):
    """One adapter on one pool's base."""

    variant: str
    """The pool (variant) name."""

    artifactKey: str | None = None
    """The base artifact the adapter was judged on."""

    state: Literal["Pending", "Passed", "Failed", "NotPlanned"]
    """Pending: not judged on this base yet; Passed: its gate passed here (it may be served here);
    Failed: its gate failed, never served on this pool; NotPlanned: the pool cannot hold it or
    there is no 16-bit base to judge it against (see `reason`)."""

    reason: str = ""
    """Why it is not served here, with the figures."""

    baselinePerplexity: float | None = None
    """The adapter's perplexity on its evaluation text over the 16-bit base."""

    perplexity: float | None = None
    """The same over this pool's quantized base."""

    increasePercent: float | None = None
    """How much higher, in percent."""

    maxIncreasePercent: float | None = None
    """The threshold it was held to."""

    adapterKey: str | None = None
    """The adapter's published files (`<storage.uri>/<adapterKey>/`), where known: a `Passed`
    adapter with a key is loaded by this pool's pods (`--lora-modules`)."""

    served: bool = False
    """Whether this pool's pods are rendered to load it."""


class AdapterStatus(ApiModel):
    """What is known of one adapter."""

    name: str
    """The adapter's name (`spec.adapters[].name`)."""

    rank: int | None = None
    """Its LoRA rank (largest of `rank_pattern` when it has one), read from adapter_config.json."""

    targetModules: list[str] = Field(default_factory=list)
    """The base's modules it adapts, as adapter_config.json names them."""

    problem: str | None = None
    """Why it cannot be served at all (its config unreadable or not fitting the base), naming the field."""

    pools: list[AdapterPoolStatus] = Field(default_factory=list)
    """Its verdict on each pool's base."""
