"""Pins of custom calibration data: what makes a key name the data's bytes (issue 16, item 3).

A built-in dataset is pinned by the sha256 of the file the quantization image ships
(``fewerbits_api.datasets``). An S3 object (`s3://bucket/path.jsonl`, read by the Job from the
model's artifact storage with its credentials) is pinned by its ETag, read by observe with one
HEAD before anything is decided: the ETag goes into the artifact key, so changed data is a new key
and a new Job, and the same bytes (re-uploaded as they were) keep the key and the artifact. The
ETag, not the VersionId: a VersionId changes on every upload, identical bytes included, and does
not exist on unversioned buckets; it is recorded in status when the bucket has one. The Job checks
the ETag of what it reads against the key (``DatasetChanged`` when the object changed meanwhile).
A Hub dataset (`hf://datasets/org/name@revision`) is pinned by its revision, which is part of the
URI and so of the key; without one it is unpinned, and a policy with `rules.requirePinnedData`
refuses it. Pure: observe does the reading (``storage.ObjectStore.head_object``).

An S3 evaluation set (`qualityGate.evalDataset`) is pinned the same way: its ETag enters the
evaluation identity (``QualityGateSpec.pinned``, fewerbits_api.quality.eval_identity), so changed
evaluation data is measured again, and the Job refuses other bytes than the ETag it was given.
"""

from __future__ import annotations

from dataclasses import dataclass

from fewerbits_api.datasets import is_builtin_dataset_uri
from fewerbits_api.formats import FORMAT_FACTS, QuantFormat
from fewerbits_api.quantizedmodel import CalibrationDataStatus, PlanStatus, PlanVariant, QuantizedModelSpec

CALIBRATION_FIELD = "spec.quantization.calibration.dataset"
EVAL_FIELD = "spec.quantization.qualityGate.evalDataset"


@dataclass(frozen=True)
class DataPin:
    """What observe read of an S3 calibration object: its ETag (quotes stripped) and VersionId."""

    uri: str
    etag: str
    version_id: str | None = None


def hub_revision(uri: str) -> str | None:
    """The revision of `hf://datasets/org/name@revision`, or None."""
    _, at, rev = uri.partition("@")
    return rev if at and rev else None


def artifact_format(variant: PlanVariant) -> QuantFormat:
    """The format of the artifact a variant serves. A source that already is the variant's format
    (``servedAsIs``) is published unchanged, as a `none` artifact: no quantization, no
    calibration, but the same content-addressed copy, manifest and integrity checks as any other
    artifact, pinned by the source revision. (artifacts.py re-exports it; it lives here, below
    artifacts.py, because the calibration pins need it too.)"""
    return QuantFormat.NONE if variant.servedAsIs else variant.format


def uses_calibration_data(spec: QuantizedModelSpec, plan: PlanStatus) -> bool:
    """Whether any artifact of the plan is made with calibration data."""
    return any(FORMAT_FACTS[artifact_format(v)].needs_calibration_data for v in plan.variants)


def s3_calibration_uri(spec: QuantizedModelSpec, plan: PlanStatus) -> str | None:
    """The S3 calibration object observe must HEAD for this plan, or None."""
    uri = spec.quantization.calibration.dataset
    return uri if uri.startswith("s3://") and uses_calibration_data(spec, plan) else None


def s3_eval_uri(spec: QuantizedModelSpec) -> str | None:
    """The S3 evaluation set observe must HEAD (its ETag enters the evaluation identity, as the
    calibration set's enters the key), or None."""
    gate = spec.quantization.qualityGate
    uri = gate.evalDataset if gate is not None else None
    return uri if uri and uri.startswith("s3://") else None


def unpinned_data(spec: QuantizedModelSpec) -> list[str]:
    """The remote datasets of the spec that nothing pins (a Hub dataset without `@revision`), each
    as `<field> <uri>`. S3 objects are always pinned (by the ETag observe reads)."""
    out = []
    for field, uri in ((CALIBRATION_FIELD, spec.quantization.calibration.dataset),
                       (EVAL_FIELD, spec.quantization.qualityGate.evalDataset if spec.quantization.qualityGate else None)):
        if uri and uri.startswith("hf://") and hub_revision(uri) is None:
            out.append(f"{field} {uri} names no revision (write {uri}@<commit>)")
    return out


def key_hash(dataset: str, pin: DataPin | None) -> str | None:
    """``calibrationDatasetHash`` for a dataset that is not built in: the S3 ETag when pinned (the
    Job accepts the ETag of what it reads, ``fewerbits_quantjob.job.verify_dataset_hash``); None for
    a Hub dataset (its revision is in the URI)."""
    if is_builtin_dataset_uri(dataset) or pin is None or pin.uri != dataset:
        return None
    return pin.etag


def calibration_status(spec: QuantizedModelSpec, plan: PlanStatus, pin: DataPin | None) -> CalibrationDataStatus | None:
    """What status records of the calibration data in use (None when no artifact uses any)."""
    if not uses_calibration_data(spec, plan):
        return None
    uri = spec.quantization.calibration.dataset
    if uri.startswith("s3://"):
        return CalibrationDataStatus(dataset=uri, pinned=pin is not None and pin.uri == uri,
                                     etag=pin.etag if pin and pin.uri == uri else None,
                                     versionId=pin.version_id if pin and pin.uri == uri else None)
    if uri.startswith("hf://"):
        rev = hub_revision(uri)
        return CalibrationDataStatus(dataset=uri, pinned=rev is not None, revision=rev)
    return CalibrationDataStatus(dataset=uri, pinned=True)
