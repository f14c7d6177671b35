"""Artifact keys for a plan: one artifact per distinct format. Pure.

The key hashes everything that decides the bytes: source URI and revision,
format and recipe parameters, ignore list, calibration dataset identity and content hash, sample
count, sequence length, and the tool versions.
"""

from __future__ import annotations

from dataclasses import dataclass

from fewerbits_api.artifact import ArtifactKeyInputs
from fewerbits_api.formats import FORMAT_FACTS, QuantFormat
from fewerbits_api.quantizedmodel import PlanStatus, PlanVariant, QuantizedModelSpec
from fewerbits_api.datasets import BUILTIN_DATASET_SHA256, is_builtin_dataset_uri

# Jobs are named by key, so two models asking for the same bytes share one Job.
JOB_PREFIX = "fewerbits-quantize-"
JOB_KEY_CHARS = 24


@dataclass(frozen=True)
class PlannedArtifact:
    format: QuantFormat
    inputs: ArtifactKeyInputs
    variants: tuple[str, ...]
    """Pools that will serve it."""

    @property
    def key(self) -> str:
        return self.inputs.key()

    @property
    def job_name(self) -> str:
        return job_name(self.key)


def job_name(key: str) -> str:
    return f"{JOB_PREFIX}{key[:JOB_KEY_CHARS]}"


def artifact_format(variant: PlanVariant) -> QuantFormat:
    """The format of the artifact a variant serves. A source that already is the variant's format
    (``servedAsIs``) is published unchanged, as a `none` artifact: no quantization, no
    calibration, but the same content-addressed copy, manifest and integrity checks as any other
    artifact, pinned by the source revision."""
    return QuantFormat.NONE if variant.servedAsIs else variant.format


def key_inputs(spec: QuantizedModelSpec, fmt: QuantFormat, ignore: list[str] | None = None) -> ArtifactKeyInputs:
    """``ignore``: the effective list the plan sized (``PlanStatus.ignore``: the spec's plus the
    architecture's); the spec's own list when the plan predates it."""
    facts = FORMAT_FACTS[fmt]
    calib = spec.quantization.calibration
    uses_data = facts.needs_calibration_data
    dataset = calib.dataset if uses_data else None
    dataset_hash = None
    if dataset is not None and is_builtin_dataset_uri(dataset):
        # The sha256 of the file the quantjob image ships (the Job checks it: a key always names
        # the bytes it was computed from). An unknown name is refused before planning (effective.py).
        dataset_hash = BUILTIN_DATASET_SHA256.get(dataset)
    return ArtifactKeyInputs(
        sourceUri=spec.source.uri,
        sourceRevision=spec.source.revision,
        format=fmt,
        # The format names the recipe; parameters beyond it (none yet from the spec) would go here.
        recipe={},
        ignore=list(spec.quantization.ignore if ignore is None else ignore) if fmt is not QuantFormat.NONE else [],
        calibrationDataset=dataset,
        calibrationDatasetHash=dataset_hash,
        calibrationSamples=calib.samples if uses_data else None,
        calibrationMaxSeqLength=calib.maxSeqLength if uses_data else None,
    )


def planned_artifacts(spec: QuantizedModelSpec, plan: PlanStatus) -> list[PlannedArtifact]:
    """One artifact per distinct artifact format of the plan's variants."""
    by_format: dict[QuantFormat, list[str]] = {}
    for v in plan.variants:
        by_format.setdefault(artifact_format(v), []).append(v.pool)
    return [PlannedArtifact(fmt, key_inputs(spec, fmt, plan.ignore), tuple(pools)) for fmt, pools in by_format.items()]
