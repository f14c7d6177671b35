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
from .formats import QuantFormat
from .quantizedmodel import CalibrationSpec, QualityGateSpec, SourceSpec, StorageSpec

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

TERMINATION_LOG_DEFAULT = "/dev/termination-log"
TERMINATION_LOG_ENV = "FEWERBITS_TERMINATION_LOG"
"""Overrides where the Job writes its termination message (for running outside a kubelet)."""
TERMINATION_MESSAGE_MAX_BYTES = 4096


class QuantJobContract(ApiModel):
    """Everything one quantization Job needs: one Job, one artifact key, one result."""

    apiVersion: Literal["fewerbits.io/v1alpha1"] = API_VERSION
    """Contract version."""
    kind: Literal["QuantJob"] = "QuantJob"
    """Contract kind."""
    key: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    """The artifact key; must equal ``keyInputs.key()``."""
    keyInputs: ArtifactKeyInputs
    """What the key hashes."""
    source: SourceSpec
    """The base model (credentials by environment, see module doc)."""
    format: QuantFormat
    """The concrete format to produce (never `auto`)."""
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    """Layers left unquantized."""
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)
    """Calibration data (used by formats that need it)."""
    qualityGate: QualityGateSpec = Field(default_factory=QualityGateSpec)
    """Evaluation data and the gate to judge against."""
    storage: StorageSpec
    """Where to publish (credentials by environment)."""
    sourceMountPath: str | None = None
    """For `pvc://` sources: where the claim is mounted in the Job's pod."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where to run: `auto` uses a GPU when one is visible."""

    @model_validator(mode="after")
    def _consistent(self) -> QuantJobContract:
        if self.format is QuantFormat.AUTO:
            raise ValueError("format: a Job quantizes to a concrete format, never 'auto'")
        if self.keyInputs.format != self.format:
            raise ValueError(f"keyInputs.format ({self.keyInputs.format.value}) differs from format ({self.format.value})")
        if self.keyInputs.key() != self.key:
            raise ValueError("key: does not equal the sha256 of keyInputs' canonical JSON")
        return self

    def to_json(self) -> str:
        return json.dumps(self.to_wire(), sort_keys=True, separators=(",", ":"))
