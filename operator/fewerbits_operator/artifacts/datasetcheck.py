"""A custom calibration or evaluation dataset the Job could not read is named before any Job
starts. The Job reads `s3://` datasets from the artifact storage with the storage credentials
(quantjob textdata); the operator asks the same store for the object (a HEAD, no body) with the
same credentials just before it would create a Job, so a wrong key, bucket or permission is a
condition naming the field, not a GPU Job that fails at its calibration stage.

`datasets_to_check` is pure (which fields, for which artifacts); `check` does the one read and is
called from observe only. Built-in datasets ship in the Job's image (their hashes are checked by
the Job); `hf://datasets/...` are read by the Job from the Hub (not checked here).
"""

from __future__ import annotations

from fewerbits_api.formats import QuantFormat
from fewerbits_api.quantizedmodel import QuantizedModelSpec, StorageSpec
from fewerbits_api.s3errors import S3ErrorKind

from fewerbits_operator.base.datapins import EVAL_FIELD
from fewerbits_operator.base.storage import ObjectStore, S3Credentials


def datasets_to_check(spec: QuantizedModelSpec, formats_needing_a_job: list[QuantFormat]) -> list[tuple[str, str]]:
    """(field, s3 URI) of each custom S3 dataset a Job about to be created would read."""
    # The S3 calibration object is read before anything is decided, since its ETag is part of the
    # key (datapins); only the evaluation set is left to check here.
    out: list[tuple[str, str]] = []
    if any(f is not QuantFormat.NONE for f in formats_needing_a_job):
        gate = spec.quantization.qualityGate
        if gate is not None:
            out.append((EVAL_FIELD, gate.evalDataset))
    return [(f, uri) for f, uri in out if uri.startswith("s3://")]


def check(store: ObjectStore, storage: StorageSpec, creds: S3Credentials, field: str, uri: str) -> str | None:
    """None when the object can be read with the storage credentials; else why, naming the field."""
    failure = store.unreadable(storage, uri, creds)
    if failure is None:
        return None
    where = f"{field}: {uri}"
    reads = f"the Job reads it from the artifact storage ({storage.endpoint or 'AWS S3'}) with spec.storage's credentials"
    if failure.kind in (S3ErrorKind.NOT_FOUND, S3ErrorKind.BUCKET_NOT_FOUND):
        return f"{where} does not exist ({failure.code}); {reads}"
    if failure.kind is S3ErrorKind.ACCESS_DENIED:
        return f"{where} cannot be read: access denied ({failure.code}); {reads}"
    return f"{where} cannot be read now ({failure.code or failure.kind.value}); {reads}"
