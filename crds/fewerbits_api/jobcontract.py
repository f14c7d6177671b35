"""The contract between the operator and the quantization Job.

The operator renders it as JSON into the Job's environment (``FEWERBITS_JOB_CONTRACT``); it holds
no secret. Credentials reach the Job only as environment variables set from Secrets
(``valueFrom.secretKeyRef``), under the names below.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field, model_validator

from .artifact import ArtifactKeyInputs
from .base import API_VERSION, ApiModel
from .formats import FORMAT_FACTS, QuantFormat
from .names import (  # noqa: F401 - re-exported: the Job's termination message
    TERMINATION_LOG_DEFAULT,
    TERMINATION_LOG_ENV,
    TERMINATION_MESSAGE_MAX_BYTES,
)
from .quantizedmodel import CalibrationSpec, PinnedGateContract, QualityGateSpec, StorageSpec

CONTRACT_ENV = "FEWERBITS_JOB_CONTRACT"
"""Environment variable holding the contract JSON."""
CONTRACT_FILE_ENV = "FEWERBITS_JOB_CONTRACT_FILE"
"""Alternative: path of a mounted file holding the contract JSON."""

# Credentials, each set from a Secret key by the operator.
ENV_HF_TOKEN = "HF_TOKEN"
ENV_SOURCE_ACCESS_KEY = "FEWERBITS_SOURCE_AWS_ACCESS_KEY_ID"
ENV_SOURCE_SECRET_KEY = "FEWERBITS_SOURCE_AWS_SECRET_ACCESS_KEY"
ENV_STORAGE_ACCESS_KEY = "AWS_ACCESS_KEY_ID"
ENV_STORAGE_SECRET_KEY = "AWS_SECRET_ACCESS_KEY"


class JobSource(ApiModel):
    """How the Job reaches the base model. Which model (URI and revision) is in ``keyInputs``."""

    endpoint: str | None = None
    """For `s3://` sources on an S3-compatible store: its endpoint URL."""
    region: str | None = None
    """For `s3://` sources: the bucket's region."""
    trustRemoteCode: bool = False
    """Allow the model's own Python code to run (`trust_remote_code`)."""
    mountPath: str | None = None
    """For `pvc://` sources: where the claim's root is mounted in the Job's pod."""


class QuantJobContract(PinnedGateContract):
    """Everything one quantization Job needs: one Job, one artifact key, one result.

    What decides the artifact's bytes (source URI and revision, format, ignore list, calibration
    data, tool versions) is stated once, in ``keyInputs``; the Job reads it from there and checks
    that ``key`` is its hash. The other fields say how to reach the source and the store and how
    to judge the result, which the key does not cover."""

    apiVersion: Literal["fewerbits.io/v1alpha1"] = API_VERSION
    """Contract version."""
    kind: Literal["QuantJob"] = "QuantJob"
    """Contract kind."""
    key: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    """The artifact key; must equal ``keyInputs.key()``."""
    keyInputs: ArtifactKeyInputs
    """What the key hashes, and so what the Job produces."""
    source: JobSource = Field(default_factory=JobSource)
    """How to reach the base model (credentials by environment, see module doc)."""
    qualityGate: QualityGateSpec = Field(default_factory=QualityGateSpec)
    """Evaluation data and the gate to judge against."""
    evalMaxSeqLength: Annotated[int, Field(ge=16, le=131072)] = 2048
    """Tokens per evaluation window (the model's calibration sequence length)."""
    storage: StorageSpec
    """Where to publish (credentials by environment)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where to run: `auto` uses a GPU when one is visible."""
    mode: Literal["quantize", "evaluate"] = "quantize"
    """`evaluate`: the artifact exists; measure it under ``qualityGate`` and write the result to
    ``<key>/quality/<evaluation identity>.json`` (fewerbits_api.quality), never touching its files
    or manifest."""

    @model_validator(mode="after")
    def _consistent(self) -> QuantJobContract:
        ki = self.keyInputs
        if ki.format is QuantFormat.AUTO:
            raise ValueError("keyInputs.format: a Job quantizes to a concrete format, never 'auto'")
        if ki.recipe:
            raise ValueError(f"keyInputs.recipe: this Job takes no recipe parameters (got {sorted(ki.recipe)})")
        calibration = (ki.calibrationDataset, ki.calibrationSamples, ki.calibrationMaxSeqLength)
        if FORMAT_FACTS[ki.format].needs_calibration_data:
            if None in calibration:
                raise ValueError(f"keyInputs: format {ki.format.value} needs calibrationDataset, "
                                 "calibrationSamples and calibrationMaxSeqLength")
        elif calibration != (None, None, None) or ki.calibrationDatasetHash is not None:
            raise ValueError(f"keyInputs: format {ki.format.value} uses no calibration data; leave the "
                             "calibration fields unset")
        if ki.key() != self.key:
            raise ValueError(KEY_MISMATCH_MESSAGE)
        return self

    @property
    def format(self) -> QuantFormat:
        return self.keyInputs.format

    @property
    def calibration(self) -> CalibrationSpec | None:
        """The calibration data the key names (None for formats that take none)."""
        ki = self.keyInputs
        if ki.calibrationDataset is None:
            return None
        return CalibrationSpec(dataset=ki.calibrationDataset, samples=ki.calibrationSamples,
                               maxSeqLength=ki.calibrationMaxSeqLength)

    def to_json(self) -> str:
        return json.dumps(self.to_wire(), sort_keys=True, separators=(",", ":"))


KEY_MISMATCH_MESSAGE = "key: does not equal the sha256 of keyInputs' canonical JSON"
