"""The one exception type a stage raises when it knows why it failed.

``reason`` is a CamelCase constant the operator puts in a condition; ``message`` is one line a
person can act on. ``permanent`` failures (a bad contract, a missing model) exit with code 2 so a
Job ``podFailurePolicy`` can stop retrying them; anything else exits with code 1.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_PERMANENT = 2


class JobError(Exception):
    def __init__(self, reason: str, message: str, *, permanent: bool = False, stage: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.permanent = permanent
        self.stage = stage


# Reasons (one place, so the operator can import and match them).
CONTRACT_INVALID = "ContractInvalid"
ENDPOINT_REFUSED = "EndpointRefused"
KEY_MISMATCH = "KeyMismatch"
TOOL_VERSION_MISMATCH = "ToolVersionMismatch"
RECIPE_INVALID = "RecipeInvalid"
STORAGE_UNAVAILABLE = "StorageUnavailable"
STORAGE_ACCESS_DENIED = "StorageAccessDenied"
STORAGE_BUCKET_NOT_FOUND = "StorageBucketNotFound"
SOURCE_NOT_FOUND = "SourceNotFound"
SOURCE_ACCESS_DENIED = "SourceAccessDenied"
SOURCE_FETCH_FAILED = "SourceFetchFailed"
DATASET_NOT_FOUND = "DatasetNotFound"
DATASET_INVALID = "DatasetInvalid"
DATASET_CHANGED = "DatasetChanged"
DATASET_FETCH_FAILED = "DatasetFetchFailed"
BENCHMARK_INVALID = "BenchmarkInvalid"
ARTIFACT_MISSING = "ArtifactMissing"
NO_GPU = "NoGPU"
QUANTIZATION_FAILED = "QuantizationFailed"
SAVE_FAILED = "SaveFailed"
EVALUATION_FAILED = "EvaluationFailed"
PERPLEXITY_NOT_FINITE = "PerplexityNotFinite"
UPLOAD_FAILED = "UploadFailed"
OUT_OF_MEMORY = "OutOfMemory"

# Reason used when a stage fails with an exception it did not anticipate.
STAGE_FAILED_REASON = {
    "contract": CONTRACT_INVALID,
    "cache-check": STORAGE_UNAVAILABLE,
    "fetch": SOURCE_FETCH_FAILED,
    "calibration-data": DATASET_FETCH_FAILED,
    "eval-data": DATASET_FETCH_FAILED,
    "quantize": QUANTIZATION_FAILED,
    "save": SAVE_FAILED,
    "evaluate": EVALUATION_FAILED,
    "upload": UPLOAD_FAILED,
    "manifest": UPLOAD_FAILED,
}
