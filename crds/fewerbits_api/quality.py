"""Quality evaluation: what a gate asks for (benchmarks, a custom set) and what a result records.

Shared by the operator (admission, the gate verdict, status, the CLI), the quantization Job (what
to run, what to write) and anything reading a manifest. No torch, no lm-eval here.

Three kinds of metric, one rule: **recovery = quantized / base x 100** for a score where higher
is better (accuracy, exact match, ROUGE-L), **base / quantized x 100** where lower is better
(perplexity); a metric passes when its recovery is at least its ``minRecoveryPercent``
(perplexity keeps its ``maxPerplexityIncreasePercent`` form: recovery >= 100 / (1 + max/100)).

The **evaluation identity** ties a quality result to an artifact: the sha256 of everything that
decides the *figures* (evaluation data and its built-in hash, window count, benchmark tasks,
limits, metrics, seeds, generation length) and nothing that decides only the *verdict* (the
thresholds: a changed threshold is judged again by the operator, with no Job). A changed identity
re-evaluates the existing artifact in an evaluation-only Job; its result is stored beside the
artifact at ``<key>/quality/<identity>.json`` and the artifact's bytes are never rewritten.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Literal

from pydantic import Field, field_validator

from .base import ApiModel
from .datasets import (
    AUTO_CALIBRATION,
    AUTO_FALLBACK,
    AUTO_HUB_DATASET,
    BUILTIN_DATASET_SHA256,
    CALIBRATION_SPLITS,
    EVALUATION_SPLITS,
)
from .validation import PATH_TRICKS_CEL, S3_BUCKET, SAFE_PATH, check_no_path_tricks

__all__ = ["BENCHMARK_SEED", "BENCHMARKS_UNIQUE_CEL", "CUSTOM_EVAL_METRICS", "BenchmarkSpec", "CustomEvalSpec",
           "MetricResult", "QUALITY_DIR", "answers", "base_eval_identity", "duplicate_benchmarks", "eval_identity",
           "eval_overlaps_calibration",
           "quality_result_key", "recovery_percent"]

QUALITY_DIR = "quality"
"""``<key>/quality/<identity>.json``: a quality result measured after the artifact was published."""

BENCHMARK_SEED = 1234
"""lm-eval's random, numpy, torch and few-shot seeds, the same for the base and the quantized model."""

CUSTOM_EVAL_METRICS = ("exact_match", "contains", "rougeL", "perplexity")

TASK_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
METRIC_NAME = r"^[A-Za-z][A-Za-z0-9_,.-]{0,63}$"
S3_PREFIX = rf"^s3://{S3_BUCKET}(/{SAFE_PATH})?$"
S3_JSONL = rf"^s3://{S3_BUCKET}/{SAFE_PATH}\.jsonl$"

# What each lm-eval output type can be scored with (lm-eval's own metric names). A benchmark whose
# metric does not fit its task's output type is refused by the Job before any model is loaded.
METRICS_BY_OUTPUT_TYPE: dict[str, tuple[str, ...]] = {
    "multiple_choice": ("acc", "acc_norm", "acc_mutual_info", "mcc", "f1", "brier_score", "likelihood"),
    "loglikelihood": ("acc", "perplexity"),
    "loglikelihood_rolling": ("word_perplexity", "byte_perplexity", "bits_per_byte"),
    "generate_until": ("exact_match", "bleu", "chrf", "ter", "contains", "rougeL"),
}
LOWER_IS_BETTER = frozenset({"perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte", "brier_score", "ter"})


class BenchmarkSpec(ApiModel):
    """One lm-evaluation-harness task, run on the base and the quantized model with the same
    settings and seeds; the gate compares the two scores."""

    task: Annotated[str, Field(min_length=1, max_length=128, pattern=TASK_NAME)]
    """The lm-eval task name (e.g. `arc_easy`, `hellaswag`, `gsm8k`), or the name a task YAML in
    `taskSource` defines. Unknown tasks fail the Job before any model is loaded."""

    taskSource: Annotated[str, Field(max_length=512, pattern=S3_PREFIX, json_schema_extra=PATH_TRICKS_CEL)] | None = None
    """Bring your own task: an S3 prefix (`s3://bucket/tasks/mytask/`) holding lm-eval task YAML
    and its data files, read with the storage credentials. Relative `data_files` in the YAML
    resolve against the prefix. Empty: lm-eval's built-in tasks (their data from the Hub)."""

    limit: Annotated[int, Field(ge=1, le=100000)] = 250
    """Documents evaluated (the first `limit` of the test split). Default 250: a standard error of
    about 3 points of accuracy, minutes on an 8B model (see docs/quality.md)."""

    metric: Annotated[str, Field(min_length=1, max_length=64, pattern=METRIC_NAME)] = "acc"
    """The task's metric to compare, as lm-eval reports it (`acc`, `acc_norm`, `exact_match`,
    ...). A metric the task does not report fails the Job before any model is loaded."""

    numFewshot: Annotated[int, Field(ge=0, le=25)] = 0
    """Few-shot examples per document."""

    minRecoveryPercent: Annotated[float, Field(gt=0, le=200)] = 95.0
    """Smallest allowed quantized score as a share of the base score, in percent (for a
    lower-is-better metric: base / quantized)."""

    @field_validator("taskSource")
    @classmethod
    def _no_path_tricks(cls, v: str | None) -> str | None:
        return check_no_path_tricks(v, "taskSource") if v is not None else v


# The gate keeps one threshold per `benchmark:<task>/<metric>` (quality_gate.py, the Job's gate.py): a
# second entry for the same task and metric would silently replace the first (the stricter one the
# user wrote may be the one dropped). The API server refuses it (CEL on the list; a missing metric is
# lm-eval's default `acc`, as the model's default says), the models refuse it too.
BENCHMARKS_UNIQUE_CEL = {"x-kubernetes-validations": [{
    "rule": "self.all(b, self.exists_one(c, c.task == b.task && "
            "(has(c.metric) ? c.metric : 'acc') == (has(b.metric) ? b.metric : 'acc')))",
    "message": "each task and metric may be listed once: the gate keeps one minRecoveryPercent per task and "
               "metric; remove the duplicate entry (keep the threshold you mean)",
}]}


def duplicate_benchmarks(benchmarks: list[BenchmarkSpec], where: str = "benchmarks") -> str | None:
    """Why a list names one task and metric twice (with the thresholds), or None."""
    seen: dict[tuple[str, str], int] = {}
    for i, b in enumerate(benchmarks):
        j = seen.setdefault((b.task, b.metric), i)
        if j != i:
            first = benchmarks[j]
            return (f"{where}[{j}] and {where}[{i}] both check task {b.task!r} metric {b.metric!r} "
                    f"(minRecoveryPercent {first.minRecoveryPercent:g} and {b.minRecoveryPercent:g}): the gate keeps "
                    "one threshold per task and metric; remove the duplicate entry (keep the threshold you mean)")
    return None


HubSet = tuple[str, str, str]
"""A Hub dataset's repository, revision and configuration: what names its rows but the split."""


def _hub_dataset(uri: str) -> tuple[HubSet, str | None] | None:
    """(the set, the split it names or None) of a Hub dataset URI
    (``hf://datasets/org/name[@revision][#config[/split]]``), else None."""
    if not uri.startswith("hf://datasets/"):
        return None
    rest, _, fragment = uri[len("hf://datasets/"):].partition("#")
    repo, _, revision = rest.partition("@")
    config, _, split = fragment.partition("/")
    return (repo, revision, config), split or None


def _splits_may_meet(calibration_split: str | None, eval_split: str | None) -> bool:
    """Whether two readers of one Hub set may read the same split: the same one named, or either
    named none. A reader without a named split falls back (``CALIBRATION_SPLITS``,
    ``EVALUATION_SPLITS``, then the set's first split), and which splits a set has is not known
    without reading it: on a set with only a `train` split, evaluation reads the calibration rows."""
    return calibration_split is None or eval_split is None or calibration_split == eval_split


def eval_overlaps_calibration(calibration_dataset: str, eval_dataset: str) -> str | None:
    """Why the evaluation set may be the calibration set (perplexity on the data the quantizer was
    fitted to flatters the quantized model), or None. By identity: the same built-in set or S3
    object, or the same Hub dataset (repository, revision, configuration) where the two may read one
    split (``_splits_may_meet``); content shared under different names is not seen."""
    # `auto` calibrates on the pinned Hub set, or on the built-in fallback where the Hub is out of reach.
    calibrated = ([AUTO_HUB_DATASET, AUTO_FALLBACK] if calibration_dataset == AUTO_CALIBRATION
                  else [calibration_dataset])
    evaluated = _hub_dataset(eval_dataset)
    for uri in calibrated:
        hub = _hub_dataset(uri)
        if hub is None or evaluated is None:
            if uri == eval_dataset:
                return (f"qualityGate.evalDataset {eval_dataset!r} is the calibration data (calibration.dataset "
                        f"{calibration_dataset!r}): perplexity measured on the data the quantizer was fitted to "
                        "flatters the quantized model; use held-out text (the built-in general-en-heldout, another "
                        "S3 object, or another split of the Hub set)")
        elif hub[0] == evaluated[0] and _splits_may_meet(hub[1], evaluated[1]):
            return _shared_split(calibration_dataset, eval_dataset, hub, evaluated[1])
    return None


def _shared_split(calibration_dataset: str, eval_dataset: str, calibrated: tuple[HubSet, str | None],
                  eval_split: str | None) -> str:
    """The refusal for one Hub set read by both: the same named split, or the fields naming none."""
    (repo, revision, config), cal_split = calibrated
    unnamed = [f for f, split in (("qualityGate.evalDataset", eval_split), ("calibration.dataset", cal_split))
               if split is None]
    if unnamed:
        why = (f"{' and '.join(unnamed)} {'name' if len(unnamed) > 1 else 'names'} no split, and a reader without "
               f"one falls back (evaluation: {', '.join(EVALUATION_SPLITS)}, then the first split; calibration: "
               f"{', '.join(CALIBRATION_SPLITS)}, then the first split): on a set without those splits the "
               "evaluation reads the calibration rows")
    else:
        why = f"both read its split {cal_split!r}"
    base = f"hf://datasets/{repo}{'@' + revision if revision else ''}#{config or 'default'}"
    fix = (f"name another split of it in qualityGate.evalDataset (`auto` calibrates on {cal_split!r})"
           if calibration_dataset == AUTO_CALIBRATION else
           f"name two different splits (e.g. {base}/train to calibrate and {base}/test to evaluate)")
    return (f"qualityGate.evalDataset {eval_dataset!r} and calibration.dataset {calibration_dataset!r} read the same "
            f"Hub dataset, and {why}; perplexity measured on the data the quantizer was fitted to flatters the "
            f"quantized model: {fix}, or use held-out text such as the built-in general-en-heldout")


class CustomEvalSpec(ApiModel):
    """Your own prompts and references: greedy generation scored by a metric, base against
    quantized."""

    dataset: Annotated[str, Field(max_length=512, pattern=S3_JSONL, json_schema_extra=PATH_TRICKS_CEL)]
    """`s3://bucket/path.jsonl`: one JSON object per line with a `prompt` and a `reference`
    string. For `perplexity` the score is the reference's perplexity given the prompt."""

    metric: Literal["exact_match", "contains", "rougeL", "perplexity"]
    """`exact_match`: the generation equals the reference (after trimming); `contains`: the
    reference occurs in the generation; `rougeL`: ROUGE-L F1 of generation against reference;
    `perplexity`: of the reference given the prompt (no generation)."""

    minRecoveryPercent: Annotated[float, Field(gt=0, le=200)] = 95.0
    """Smallest allowed quantized score as a share of the base score, in percent."""

    limit: Annotated[int, Field(ge=1, le=100000)] = 200
    """Records evaluated (the first `limit`)."""

    maxNewTokens: Annotated[int, Field(ge=1, le=4096)] = 64
    """Tokens generated per prompt (greedy), stopping early at a newline."""

    @field_validator("dataset")
    @classmethod
    def _no_path_tricks(cls, v: str) -> str:
        return check_no_path_tricks(v, "dataset")


class MetricResult(ApiModel):
    """One metric measured on the base and the quantized model, and its verdict."""

    name: str
    """`perplexity`, `benchmark:<task>/<metric>` or `custom:<metric>`."""
    kind: Literal["perplexity", "benchmark", "custom"]
    """Which part of the gate measured it."""
    base: float
    """The base model's score."""
    quantized: float
    """The quantized model's score."""
    recoveryPercent: float
    """quantized / base x 100 (base / quantized for lower-is-better metrics)."""
    minRecoveryPercent: float
    """The threshold it was judged against."""
    passed: bool
    """recoveryPercent >= minRecoveryPercent (for perplexity: increase <= the allowed increase)."""
    higherIsBetter: bool = True
    """Whether a higher score is better."""
    samples: int = 0
    """Documents, records or evaluation windows scored."""
    seconds: float = 0.0
    """Evaluation time for this metric, base and quantized together."""
    noisePercent: float | None = None
    """Half-width of the 95% interval of the recovery, in points, from the per-window or
    per-document spread: a shortfall below this is not told apart from noise."""


def recovery_percent(base: float, quantized: float, higher_is_better: bool) -> float:
    """quantized / base x 100, or base / quantized x 100 when lower is better. A zero base score
    with a zero quantized score is full recovery (nothing to lose); a zero base with a positive
    quantized score is over 100%."""
    num, den = (quantized, base) if higher_is_better else (base, quantized)
    if den == 0:
        return 100.0 if num == 0 else 1000.0
    return num / den * 100.0


def eval_identity(gate) -> str:
    """sha256 of what decides a quality result's figures (not its verdict) for ``gate``, a
    ``QualityGateSpec``: evaluation set (and a built-in set's file hash, an S3 set's ETag when the
    gate is pinned, ``QualityGateSpec.pinned``), window count, benchmarks and custom set less their
    thresholds, the seed, and the LoRA adapters measured with it (``QualityGateSpec.with_adapters``)."""
    doc = {
        "evalDataset": gate.evalDataset,
        "evalDatasetSha256": BUILTIN_DATASET_SHA256.get(gate.evalDataset),
        "evalSamples": gate.evalSamples,
        "benchmarks": [b.model_dump(mode="json", exclude={"minRecoveryPercent"}, exclude_none=True)
                       for b in getattr(gate, "benchmarks", [])],
        "customEval": (gate.customEval.model_dump(mode="json", exclude={"minRecoveryPercent"}, exclude_none=True)
                       if getattr(gate, "customEval", None) is not None else None),
        "seed": BENCHMARK_SEED,
    }
    if etag := getattr(gate, "eval_dataset_etag", None):
        # An S3 set by its content, as the calibration set enters the artifact key (issue 31);
        # absent for built-in and Hub sets, so their identities stay what they were.
        doc["evalDatasetEtag"] = etag
    if adapters := getattr(gate, "adapters", ()):
        # The LoRA adapters measured beside it (docs/adapters.md): a model without adapters keeps
        # the identity it had; adding or changing one re-evaluates, never re-quantizes.
        doc["adapters"] = [a.identity_doc() for a in adapters]
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def base_eval_identity(gate) -> str:
    """The identity of the base's own figures under ``gate``: its adapters left out. A report
    measured with adapters answers a gate without them (models sharing an artifact, one of them
    with adapters, one without), and the canary's base scores are the base's."""
    return eval_identity(gate.with_adapters([]) if getattr(gate, "adapters", ()) else gate)


def answers(q, gate) -> bool:
    """Whether the report ``q`` was measured under ``gate``: its identity, or, for a gate without
    adapters, the base identity of a report measured with some."""
    identity = eval_identity(gate)
    return q.evalIdentity == identity or (not getattr(gate, "adapters", ()) and q.baseEvalIdentity == identity)


def quality_result_key(storage_prefix: str, identity: str) -> str:
    """Object key of a re-evaluation's result under an artifact's prefix (ending in '/')."""
    return f"{storage_prefix}{QUALITY_DIR}/{identity}.json"
