"""The serving canary: what the operator hands the canary evaluation Job, and what it writes back.

A new variant (a new pool, or a new artifact or served configuration on an existing pool) first
runs one canary pod the model's Service does not select. A short Job evaluates that pod through
its OpenAI-compatible API, with the KV-cache dtype and kernels the variant really serves with, and
compares the served scores with the base model's scores the quantization Job measured (the base is
never served for this). The verdict decides whether the variant takes traffic.

* ``CanaryContract``: rendered as JSON into the Job's environment (``FEWERBITS_CANARY_CONTRACT``);
  it holds no secret (storage credentials come as environment variables from Secrets, under the
  same names as the quantization Job's).
* ``ServingQualityResult``: the verdict, written to ``<key>/serving/<configHash>.json`` in the
  artifact's storage location. The artifact's own files and manifest are never touched. The
  operator reads the result from there (status is rebuilt from storage, so nothing is lost when
  the operator restarts), and the Job's termination message carries a compact copy
  (``CanaryTermination``).

The **served configuration hash** names everything that decides what the served model computes:
the artifact key, the serving image, the vLLM arguments the plan sets (dtype, KV-cache dtype,
quantization, tensor- and pipeline-parallel sizes, max model length, extra arguments) and the GPU
product. A change to any of them is a new variant and is judged again; a change to replicas or
autoscaling is not.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal, Mapping

from pydantic import Field

from .base import API_VERSION, ApiModel
from .quantizedmodel import PinnedGateContract, QualityGateSpec, StorageSpec

__all__ = ["CANARY_CONTRACT_ENV", "SERVING_DIR", "CanaryContract", "CanaryLimits", "CanaryTermination",
           "ServingMetric", "SkippedMetric", "ServingQualityResult", "serving_config_hash",
           "serving_result_key"]

CANARY_CONTRACT_ENV = "FEWERBITS_CANARY_CONTRACT"
"""Environment variable holding the canary contract JSON."""

SERVING_DIR = "serving"
"""``<key>/serving/<configHash>.json``: a served configuration's verdict."""

CONFIG_HASH = r"^[0-9a-f]{16,64}$"


class CanaryLimits(ApiModel):
    """Bounds on the load the evaluation puts on the canary pod."""

    maxRequests: Annotated[int, Field(ge=1, le=100000)] = 256
    """Most requests the evaluation sends in all (perplexity windows, custom records and benchmark
    documents together); each part is cut to its share, and the result says how many were sent."""
    concurrency: Annotated[int, Field(ge=1, le=64)] = 4
    """Requests in flight at once."""
    requestTimeoutSeconds: Annotated[int, Field(ge=1, le=3600)] = 120
    """Per request. A request that times out is an error (fail closed), never a skipped document."""


class CanaryContract(PinnedGateContract):
    """Everything one canary evaluation needs: one served configuration, one verdict."""

    apiVersion: Literal["fewerbits.io/v1alpha1"] = API_VERSION
    """Contract version."""
    kind: Literal["CanaryEval"] = "CanaryEval"
    """Contract kind."""
    key: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    """The artifact the canary serves; its manifest holds the base scores to compare with."""
    configHash: Annotated[str, Field(pattern=CONFIG_HASH)]
    """``serving_config_hash`` of the served configuration: names the result object."""
    scoresKey: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
    """A 16-bit variant's (format `none`) artifact has no figures of its own: a quantized artifact
    of the same model whose report holds the 16-bit base's figures under the same evaluation
    identity (and its adapters'), which the served model is judged against."""
    variant: Annotated[str, Field(min_length=1, max_length=253)]
    """The pool the variant serves on."""
    kvCacheDtype: Annotated[str, Field(min_length=1, max_length=32)]
    """The KV-cache dtype the canary serves with (`auto`, `fp8`, ...), as vLLM was given it."""
    endpoint: Annotated[str, Field(pattern=r"^https?://[^/\s]+$")]
    """The canary pod's OpenAI-compatible API, scheme, host and port (`http://10.1.2.3:8000`)."""
    servedModelName: Annotated[str, Field(min_length=1, max_length=128)]
    """The `model` field of every request."""
    storage: StorageSpec
    """Where the artifact and its manifest are (credentials by environment)."""
    qualityGate: QualityGateSpec = Field(default_factory=QualityGateSpec)
    """The gate the quantization Job judged with: the same windows, benchmarks, custom set and
    thresholds are used here."""
    evalMaxSeqLength: Annotated[int, Field(ge=16, le=131072)] = 2048
    """Tokens per perplexity window, as the quantization Job cut them."""
    limits: CanaryLimits = Field(default_factory=CanaryLimits)
    """Request count, concurrency and timeout."""

    def to_json(self) -> str:
        return json.dumps(self.to_wire(), sort_keys=True, separators=(",", ":"))


class ServingMetric(ApiModel):
    """One metric of the gate measured through the serving API, beside the Job's figures."""

    name: str
    """As in the Job's report: `perplexity`, `benchmark:<task>/<metric>` or `custom:<metric>`; a LoRA
    adapter's perplexity is `adapter:<name>` (docs/adapters.md)."""
    kind: Literal["perplexity", "benchmark", "custom", "adapter"]
    """Which part of the gate measured it. `adapter`: an adapter the canary pod loads, asked for by
    its name, on the adapter's evaluation windows; `base` is then the same adapter on the 16-bit
    base as the Job measured it."""
    base: float
    """The base model's score, from the quantization Job (or its evaluation-only Job)."""
    jobQuantized: float | None = None
    """The quantized model's score in the Job (transformers, 16-bit KV cache), for comparison."""
    served: float
    """The score of the served configuration (its kernels, its KV-cache dtype)."""
    recoveryPercent: float
    """served / base x 100 (base / served where lower is better)."""
    minRecoveryPercent: float
    """The threshold it was judged against (the same as the Job's)."""
    passed: bool
    """recoveryPercent >= minRecoveryPercent."""
    higherIsBetter: bool = True
    """Whether a higher score is better."""
    samples: int = 0
    """Windows, records or documents scored."""
    method: str = ""
    """How it was measured (`prompt_logprobs`, `completions`, `lm-eval local-completions`, ...)."""


class SkippedMetric(ApiModel):
    """A metric of the gate the server could not be asked for, and why (e.g. perplexity on a
    server that offers no prompt logprobs). A skipped metric is never a pass by itself: a verdict
    needs at least one measured metric."""

    name: str
    """The metric's name, as in ``ServingMetric.name``."""
    reason: str
    """Why it was not measured."""


class ServingQualityResult(ApiModel):
    """``<key>/serving/<configHash>.json``: the canary verdict of one served configuration."""

    key: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    """The artifact key."""
    configHash: Annotated[str, Field(pattern=CONFIG_HASH)]
    """The served configuration."""
    variant: str
    """The pool it was judged on."""
    kvCacheDtype: str
    """The KV-cache dtype served."""
    passed: bool
    """Every measured metric passed and at least one was measured."""
    reason: str = ""
    """One line for a condition: the failing metric with its figures and the KV-cache dtype, or
    what could not be measured."""
    metrics: list[ServingMetric] = Field(default_factory=list)
    """Every measured metric."""
    skipped: list[SkippedMetric] = Field(default_factory=list)
    """Metrics of the gate not measured, with the reason."""
    requests: int = 0
    """Requests sent."""
    seconds: float = 0.0
    """Evaluation wall time."""
    server: str = ""
    """What answered (from the server's model list or headers), for the record."""
    measuredAt: str = ""
    """RFC 3339."""


class CanaryTermination(ApiModel):
    """The canary Job's termination message: the verdict in brief, or why there is none."""

    outcome: Literal["passed", "failed", "error"]
    """`error`: no verdict (canary unreachable, storage unreadable, ...): fail closed."""
    configHash: str = ""
    """The served configuration."""
    reason: str = ""
    """The failing metric, or the error with its cause."""


def serving_config_hash(doc: Mapping[str, Any]) -> str:
    """sha256 (first 32 hex digits) of the canonical JSON of what decides the served model's
    output (see the module doc); the operator builds ``doc``."""
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def serving_result_key(storage_prefix: str, config_hash: str) -> str:
    """Object key of a served configuration's verdict under an artifact's prefix (ending in '/')."""
    return f"{storage_prefix}{SERVING_DIR}/{config_hash}.json"
