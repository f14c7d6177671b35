"""The artifact contract shared by the quantjob (writer), the operator (lookup) and the runtime
fetcher (reader).

Layout: ``<storage uri>/<key>/files/<relative path>`` for every file, then
``<storage uri>/<key>/manifest.json`` written **last**. No manifest means no artifact. Every reader
parses a manifest with :meth:`Manifest.parse`, which makes all the checks in one place.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated

from pydantic import Field, ValidationError, field_validator

from .adapters import AdapterQuality
from .base import ApiModel
from .datasets import AUTO_CALIBRATION, AUTO_FALLBACK_HASH, named_dataset_hash
from .errors import field_path, format_validation_error
from .formats import QuantFormat
from .names import FILES_DIR, MANIFEST_NAME
from .quality import MetricResult

__all__ = ["FILES_DIR", "MANIFEST_NAME", "ArtifactKeyInputs", "Manifest", "ManifestError", "ManifestFile",
           "QualityReport", "artifact_prefix", "auto_fallback_inputs", "calibrated_on_fallback", "split_s3_uri"]

MANIFEST_SCHEMA_VERSION = 1

# The tools baked into the quantjob image. Kept equal to the [quantjob] pins in pyproject.toml (a
# unit test checks it). They are recorded in every manifest (`Manifest.tools`) but are not part of
# new keys: an upgrade of the image re-quantizes nothing by itself (docs/artifacts.md).
QUANTJOB_TOOL_VERSIONS: dict[str, str] = {
    "llmcompressor": "0.14.0.1",
    "compressed-tensors": "0.19.0",
    "transformers": "5.17.0",
}


class ArtifactKeyInputs(ApiModel):
    """Everything that decides an artifact's bytes, and nothing else (not the storage location,
    not the serving settings, not the quality gate threshold, not the tool versions: those are
    recorded in the manifest, and re-quantizing with newer tools is asked for with ``rebuild``)."""

    sourceUri: str
    """Base model URI."""
    sourceRevision: str | None = None
    """Requested revision (a pin). The resolved commit is recorded in the manifest."""
    format: QuantFormat
    """Quantization format (names the recipe)."""
    recipe: dict[str, object] = Field(default_factory=dict)
    """Recipe parameters beyond the format (scheme, modifier arguments)."""
    ignore: list[str] = Field(default_factory=list)
    """Layers left unquantized."""
    calibrationDataset: str | None = None
    """Calibration dataset identity (None for formats without calibration data)."""
    calibrationDatasetHash: str | None = None
    """Content hash of the calibration data when known before the Job runs (built-in sets;
    an S3 object's ETag or version)."""
    calibrationSamples: int | None = None
    """Number of calibration samples (None without calibration data)."""
    calibrationMaxSeqLength: int | None = None
    """Calibration sequence length (None without calibration data)."""
    tools: dict[str, str] | None = None
    """Legacy keys only: releases before keys stopped depending on tool versions hashed the
    versions of llm-compressor, compressed-tensors and transformers here. New keys leave it unset
    (absent from the canonical JSON), so a manifest published under an old key still verifies."""
    rebuild: str | None = None
    """`spec.quantization.requantize`: an opaque token that asks for a new artifact made by the
    current tools. Unset: absent from the canonical JSON."""

    def canonical_json(self) -> str:
        """Sorted keys, no whitespace, ASCII: the same inputs give the same bytes everywhere. The
        optional fields added after keys were first computed (``tools`` once it became optional,
        ``rebuild``) are left out when unset, so every key published before them hashes the same."""
        doc = self.model_dump(mode="json", by_alias=True)
        for optional in KEY_FIELDS_OMITTED_WHEN_UNSET:
            if doc.get(optional) is None:
                doc.pop(optional, None)
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)

    def without_legacy_tools(self) -> "ArtifactKeyInputs":
        """These inputs as a current key names them: the tool versions a legacy key hashed are
        dropped. A legacy artifact whose inputs, so stripped, hash to a planned key holds the bytes
        that key asks for (made by older tools) and keeps serving it."""
        return self.model_copy(update={"tools": None})

    def key(self) -> str:
        """The artifact key: sha256 hex of the canonical JSON."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()


KEY_FIELDS_OMITTED_WHEN_UNSET = ("tools", "rebuild")


LORA_ADAPTER_RECIPE = "loraAdapter"
"""The recipe entry that marks a published LoRA adapter (its files' digests), not a model."""


def adapter_key_inputs(uri: str, revision: str | None, digests: dict[str, str]) -> ArtifactKeyInputs:
    """What a published LoRA adapter's key is computed from: its source and the SHA-256 of each of
    its files, so the key names these bytes (content-addressed: the same files read by any Job of
    any pool give the same key; changed files a new one). Published like an artifact of format
    ``none`` (``<storage>/<key>/files/``, a manifest written last), so the serving pod's fetcher and
    node cache verify it as they verify a model."""
    return ArtifactKeyInputs(sourceUri=uri, sourceRevision=revision, format=QuantFormat.NONE,
                             recipe={LORA_ADAPTER_RECIPE: dict(sorted(digests.items()))})


def auto_fallback_inputs(inputs: ArtifactKeyInputs) -> ArtifactKeyInputs | None:
    """The key inputs of the artifact an ``auto`` calibration makes on the built-in fallback: the
    planned inputs (which name the Hub set) with the fallback's hash. The Job that cannot read the
    Hub set publishes under this key instead of the planned one, and the operator reads it only for
    a model whose own Job did so (docs/artifacts.md): a later model with the same inputs asks for the
    Hub set again. None for inputs that do not name ``auto``'s Hub set."""
    if inputs.calibrationDataset != AUTO_CALIBRATION or inputs.calibrationDatasetHash != named_dataset_hash(
            AUTO_CALIBRATION):
        return None
    return inputs.model_copy(update={"calibrationDatasetHash": AUTO_FALLBACK_HASH})


def calibrated_on_fallback(inputs: ArtifactKeyInputs) -> bool:
    """Whether these key inputs name ``auto``'s built-in fallback (``auto_fallback_inputs``)."""
    return inputs.calibrationDataset == AUTO_CALIBRATION and inputs.calibrationDatasetHash == AUTO_FALLBACK_HASH


class ManifestModel(ApiModel):
    """Manifests are read by images older than the writer: unknown fields are ignored, not errors."""

    model_config = ApiModel.model_config | {"extra": "ignore"}


class ManifestFile(ManifestModel):
    """One file of the artifact."""

    path: Annotated[str, Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z0-9._-][A-Za-z0-9._/-]*$")]
    """Path relative to ``<key>/files/`` (no leading slash, no '..')."""
    sizeBytes: Annotated[int, Field(ge=0)]
    """Size in bytes."""
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    """SHA-256 of the content, hex."""

    @field_validator("path")
    @classmethod
    def _inside_the_artifact(cls, v: str) -> str:
        parts = v.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"path {v!r} must be relative, without '.', '..' or empty segments")
        return v


class QualityReport(ManifestModel):
    """Perplexity of the base and quantized model on the same held-out windows."""

    baselinePerplexity: float
    """Base model perplexity."""
    perplexity: float
    """Quantized model perplexity."""
    increasePercent: float
    """(perplexity / baselinePerplexity - 1) x 100."""
    maxIncreasePercent: float
    """The gate it was judged against."""
    passed: bool
    """The gate verdict. The operator never rolls out an artifact with passed=false."""
    evalDataset: str
    """Where the held-out text came from."""
    evalWindows: int
    """Number of windows evaluated."""
    evalTokens: int
    """Tokens scored."""
    metrics: list[MetricResult] = Field(default_factory=list)
    """Every metric of the gate (perplexity first): base, quantized, recovery, threshold, verdict
    and evaluation seconds."""
    evalIdentity: str | None = None
    """``fewerbits_api.quality.eval_identity`` of the gate these figures were measured under."""
    increaseCI95: list[float] | None = None
    """95% interval of the perplexity increase, percent, from the per-window spread (paired)."""
    noiseFloorPercent: float | None = None
    """Half-width of that interval: an increase below it is not told apart from noise."""
    evalDatasetSha256: str | None = None
    """Hash of the evaluation text as read (S3 ETag-independent)."""
    adapters: list[AdapterQuality] = Field(default_factory=list)
    """Each LoRA adapter of the model measured on the 16-bit base and on this artifact."""
    baseEvalIdentity: str | None = None
    """With adapters: the identity of the base's own figures (``quality.base_eval_identity``), which
    answer a gate without those adapters."""


class CalibrationUsed(ManifestModel):
    """The calibration data a Job actually used, beside what the key asked for."""

    dataset: str
    """What the key names (`auto`, a built-in name, an S3 or Hub URI)."""
    source: str
    """What was read: the Hub URI with its revision for `auto` when the Hub was reachable, the
    built-in fallback otherwise, else the dataset itself."""
    samples: Annotated[int, Field(ge=0)]
    """Samples calibrated on."""
    tokens: Annotated[int, Field(ge=0)]
    """Tokens calibrated on (each sample cut at the sequence length)."""
    requestedSamples: Annotated[int, Field(ge=0)]
    """`calibration.samples` of the key."""
    maxSeqLength: Annotated[int, Field(ge=0)]
    """`calibration.maxSeqLength` of the key."""
    chatTemplate: bool = False
    """Whether the samples were rendered with the model's chat template (chat data, a chat model)."""
    shortfall: str | None = None
    """Why fewer samples than asked were used (None: as many as asked)."""


class Manifest(ManifestModel):
    """``<key>/manifest.json``: the artifact exists when, and only when, this is present."""

    schemaVersion: int = MANIFEST_SCHEMA_VERSION
    """Manifest schema version."""
    key: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    """The artifact key (equals the sha256 of keyInputs' canonical JSON)."""
    keyInputs: ArtifactKeyInputs
    """What the key was computed from."""
    format: QuantFormat
    """Quantization format."""
    resolvedRevision: str | None = None
    """The source revision actually fetched (a commit hash where the source has one)."""
    files: list[ManifestFile]
    """Every file under ``<key>/files/``."""
    totalBytes: int
    """Sum of the file sizes."""
    quality: QualityReport | None = None
    """Measured quality and gate verdict (absent only for format `none`)."""
    calibration: CalibrationUsed | None = None
    """The calibration data used (formats that calibrate; absent in manifests made before it was
    recorded)."""
    tools: dict[str, str] = Field(default_factory=dict)
    """Versions of every tool involved (torch included)."""
    timings: dict[str, float] = Field(default_factory=dict)
    """Seconds per stage (fetch, calibrate, quantize, save, evaluate, upload)."""
    createdAt: str
    """When it was published (RFC 3339)."""

    def verify_key(self) -> None:
        """Raise ManifestError if the key does not match its inputs (a manifest from elsewhere, or edited)."""
        expected = self.keyInputs.key()
        if expected != self.key:
            raise ManifestError(f"key {self.key} does not match its keyInputs (they hash to {expected})",
                                field="key")

    @classmethod
    def parse(cls, raw: bytes | str, expected_key: str) -> Manifest:
        """The manifest in ``raw``, checked as every reader needs it: valid JSON of this schema,
        its key equal to ``expected_key`` and to the hash of its keyInputs, no file listed twice
        or as both a file and a folder, every path inside the artifact (relative, no '.', '..'
        or empty segment), and totalBytes the sum of the file sizes. Raises :class:`ManifestError`
        naming the first problem."""
        try:
            manifest = cls.model_validate_json(raw)
        except ValidationError as e:
            lines = format_validation_error(e)
            more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
            field = field_path(tuple(e.errors()[0]["loc"])) or None
            raise ManifestError(f"not a valid manifest: {lines[0]}{more}", field=field) from None
        if manifest.key != expected_key:
            raise ManifestError(f"is for artifact {manifest.key}, not the expected {expected_key}", field="key")
        manifest.verify_key()
        files: set[str] = set()
        for i, f in enumerate(manifest.files):
            if f.path in files:
                raise ManifestError(f"lists {f.path!r} twice", field=f"files[{i}].path")
            files.add(f.path)
        folders = {"/".join(f.path.split("/")[:n]) for f in manifest.files for n in range(1, f.path.count("/") + 1)}
        clash = sorted(files & folders)
        if clash:
            raise ManifestError(f"lists {clash[0]!r} both as a file and as a folder", field="files")
        total = sum(f.sizeBytes for f in manifest.files)
        if total != manifest.totalBytes:
            raise ManifestError(f"totalBytes {manifest.totalBytes} is not the sum of its file sizes ({total})",
                                field="totalBytes")
        named = manifest.keyInputs.recipe.get(LORA_ADAPTER_RECIPE)
        if named is not None and named != {f.path: f.sha256 for f in manifest.files}:
            raise ManifestError("lists files other than the ones its key names (a LoRA adapter's key is its files' "
                                "digests)", field="files")
        return manifest


class ManifestError(ValueError):
    """A manifest that no reader may trust; the message names the problem (and ``field`` the
    manifest field, when there is one). Prefix it with where the manifest was read."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


def split_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/key`` -> ("bucket", "some/key")."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


def artifact_prefix(storage_uri: str, key: str) -> tuple[str, str]:
    """(bucket, key prefix ending in '/') of an artifact under an ``s3://bucket/prefix`` URI."""
    bucket, prefix = split_s3_uri(storage_uri)
    prefix = prefix.strip("/")
    return bucket, (f"{prefix}/{key}/" if prefix else f"{key}/")
