"""Artifact keys for a plan: one artifact per distinct format. Pure.

The key hashes everything that decides the bytes: source URI and revision,
format and recipe parameters, ignore list, calibration dataset identity and content hash, sample
count, sequence length, and `spec.quantization.requantize` when set. Not the tool versions: they
are recorded in the manifest (docs/artifacts.md, "Upgrades").
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

from fewerbits_api.artifact import ArtifactKeyInputs, Manifest, auto_fallback_inputs
from fewerbits_api.formats import FORMAT_FACTS, QuantFormat
from fewerbits_api.quantizedmodel import PlanStatus, QuantizedModelSpec, QuantizedModelStatus
from fewerbits_api.datasets import is_builtin_dataset_uri, named_dataset_hash

from fewerbits_operator.base.datapins import DataPin, artifact_format, key_hash  # noqa: F401  (artifact_format re-exported)

# Jobs are named by key and destination, so two models asking for the same bytes in the same
# storage location share one Job, and a model publishing elsewhere gets its own.
JOB_PREFIX = "fewerbits-quantize-"
JOB_KEY_CHARS = 24
JOB_DESTINATION_CHARS = 10


@dataclass(frozen=True)
class PlannedArtifact:
    format: QuantFormat
    inputs: ArtifactKeyInputs
    variants: tuple[str, ...]
    """Pools that will serve it."""
    storage_uri: str = ""
    """Where its Job publishes (`spec.storage.uri`); part of the Job's name, never of the key."""
    storage_endpoint: str | None = None

    @property
    def key(self) -> str:
        return self.inputs.key()

    @property
    def job_name(self) -> str:
        return job_name(self.key, self.storage_uri, self.storage_endpoint)


def destination_digest(storage_uri: str, storage_endpoint: str | None) -> str:
    """A short, stable digest of where a Job publishes: the storage URI (trailing `/` ignored) and
    endpoint (unset and empty are one)."""
    where = f"{storage_uri.rstrip('/')}\n{(storage_endpoint or '').rstrip('/')}"
    return hashlib.sha256(where.encode()).hexdigest()[:JOB_DESTINATION_CHARS]


def job_name(key: str, storage_uri: str, storage_endpoint: str | None = None) -> str:
    """``fewerbits-quantize-<key[:24]>-<destination[:10]>`` (54 characters, a DNS label).

    The key alone names the bytes, but a Job also decides where they land: two models with the
    same source and recipe but different ``spec.storage`` (or one model whose storage changed)
    need two Jobs, else the second finds the first's Job succeeded and no manifest at its own
    location. Models asking for the same bytes in the same place still share one Job.

    The same key already published in another location is quantized again, not copied: a Job
    holds the credentials of its own storage only (two locations may be two stores, two
    accounts), and the manifest's integrity and quality figures stay those of bytes that Job
    wrote and measured itself.

    Upgrades: Jobs created before the destination was part of the name were named
    ``fewerbits-quantize-<key[:24]>``. Observe looks Jobs up by the new name only. A model whose
    manifest is published never creates a Job (decide creates one only when no manifest is at the
    key), so a finished old Job changes nothing. A Job still running under the old name when the
    operator is upgraded is not adopted: the model gets a second Job under the new name, which
    publishes the same content-addressed key (the manifest is written last, so a reader sees one
    complete artifact; a Job that finds a valid manifest already there ends at its cache check);
    the old Job ends on its own and its TTL removes it. At worst one duplicate quantization per
    Job in flight at the upgrade, once."""
    return f"{JOB_PREFIX}{key[:JOB_KEY_CHARS]}-{destination_digest(storage_uri, storage_endpoint)}"


def key_inputs(spec: QuantizedModelSpec, fmt: QuantFormat, ignore: list[str] | None = None,
               data_pin: DataPin | None = None) -> ArtifactKeyInputs:
    """``ignore``: the effective list the plan sized (``PlanStatus.ignore``: the spec's plus the
    architecture's); the spec's own list when the plan predates it. ``data_pin``: the S3
    calibration object's ETag as observe read it (datapins.py); without it an S3 dataset's key
    names no bytes, and decide starts no Job for it."""
    facts = FORMAT_FACTS[fmt]
    calib = spec.quantization.calibration
    uses_data = facts.needs_calibration_data
    dataset = calib.dataset if uses_data else None
    dataset_hash = None
    if dataset is not None and is_builtin_dataset_uri(dataset):
        # The sha256 of the file the quantjob image ships (the Job checks it: a key always names
        # the bytes it was computed from); for `auto`, of the pinned Hub set and the fallback
        # file: the Hub set's key (a Job without the Hub publishes under fallback_key). An
        # unknown name is refused before planning (effective.py).
        dataset_hash = named_dataset_hash(dataset)
    elif dataset is not None:
        dataset_hash = key_hash(dataset, data_pin)
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
        rebuild=spec.quantization.requantize,
    )


def planned_artifacts(spec: QuantizedModelSpec, plan: PlanStatus, data_pin: DataPin | None = None
                      ) -> list[PlannedArtifact]:
    """One artifact per distinct artifact format of the plan's variants."""
    by_format: dict[QuantFormat, list[str]] = {}
    for v in plan.variants:
        by_format.setdefault(artifact_format(v), []).append(v.pool)
    storage_uri = spec.storage.uri if spec.storage is not None else ""
    storage_endpoint = spec.storage.endpoint if spec.storage is not None else None
    return [PlannedArtifact(fmt, key_inputs(spec, fmt, plan.ignore, data_pin), tuple(pools), storage_uri,
                            storage_endpoint)
            for fmt, pools in by_format.items()]


# ---- artifacts published under a legacy key (one that hashed the tool versions)


def legacy_candidates(old: QuantizedModelStatus, planned: PlannedArtifact) -> list[str]:
    """Keys this model used before for the planned artifact's format, other than the planned key:
    where an artifact published under a legacy key (tool versions hashed in), or the one this
    model's `auto` Job made on the built-in fallback, may be. Status is the memory: a model never
    reconciled by a release that recorded its key has none."""
    return [a.key for a in old.artifacts if a.format is planned.format and a.key != planned.key]


def fallback_key(planned: PlannedArtifact) -> str | None:
    """The key an `auto` calibration's Job publishes under when it cannot read the Hub set
    (``fewerbits_api.artifact.auto_fallback_inputs``); None for other calibration data."""
    inputs = auto_fallback_inputs(planned.inputs)
    return inputs.key() if inputs is not None else None


def serves_planned(manifest: Manifest, planned: PlannedArtifact) -> bool:
    """A manifest under another key holds what the planned key asks for: its inputs, without the
    tool versions a legacy key hashed, are the planned inputs (a `requantize` token in the plan
    never matches, so asking for re-quantization always makes a new artifact); or it is the
    artifact the planned `auto` calibration made on the built-in fallback (read only where this
    model's own Job made it or its status names it: observe, ``fallback_key``)."""
    legacy = manifest.keyInputs.tools is not None and manifest.keyInputs.without_legacy_tools().key() == planned.key
    return legacy or manifest.key == fallback_key(planned)


def published_at(planned: PlannedArtifact, manifest: Manifest | None) -> PlannedArtifact:
    """The planned artifact under the key its manifest is published at: one under a legacy key or
    the fallback's (``serves_planned``) keeps its own key and inputs; nothing is re-quantized."""
    if manifest is not None and manifest.key != planned.key:
        return dataclasses.replace(planned, inputs=manifest.keyInputs)
    return planned


def outdated_tools(manifest: Manifest, current: dict[str, str]) -> dict[str, tuple[str, str]]:
    """tool -> (version that made the artifact, version of the current quantization image), for
    the keyed tools that differ."""
    return {t: (manifest.tools.get(t, "?"), v) for t, v in sorted(current.items())
            if manifest.tools.get(t) not in (None, v)}
