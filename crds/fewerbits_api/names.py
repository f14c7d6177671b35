"""Names every process agrees on: object names in storage, files in the serving pod's model
directory, the termination message. Standard library only: the launch wrapper copies this module
into the vLLM image (``fewerbits_runtime.install``), which has no pydantic of ours."""

from __future__ import annotations

# ---- an artifact in object storage: <storage uri>/<key>/files/<path>, then <key>/manifest.json
MANIFEST_NAME = "manifest.json"
"""The artifact's manifest, written last: no manifest, no artifact."""
FILES_DIR = "files"
"""The folder, under the key, that holds the artifact's files."""

# ---- the serving pod's model directory (filled by the fetcher, read by the launcher and vLLM)
DEST_MANIFEST_NAME = "fewerbits-manifest.json"
"""The artifact's manifest, copied beside its files (the launcher reads the format from it)."""

# ---- keys of the Secrets a QuantizedModel names (spec.source / spec.storage credentialsSecret)
SECRET_HF_TOKEN = "HF_TOKEN"
"""Hugging Face token, for hf:// sources."""
SECRET_ACCESS_KEY_ID = "AWS_ACCESS_KEY_ID"
"""S3 access key id, for s3:// sources and for artifact storage."""
SECRET_SECRET_ACCESS_KEY = "AWS_SECRET_ACCESS_KEY"
"""S3 secret access key, for s3:// sources and for artifact storage."""

# ---- termination messages (the quantization Job and the serving pod's containers)
TERMINATION_LOG_DEFAULT = "/dev/termination-log"
"""Where the kubelet reads a container's termination message (``terminationMessagePath``)."""
TERMINATION_LOG_ENV = "FEWERBITS_TERMINATION_LOG"
"""Overrides where a process writes its termination message (for running outside a kubelet)."""
TERMINATION_MESSAGE_MAX_BYTES = 4096
"""The kubelet keeps at most this much of a termination message."""

UNREFERENCED_MARKER = ".unreferenced"
"""Under a key's prefix: written by the operator's retention sweep when it first sees the key
unreferenced (core/retention.py); a Job that reuses the key (a LoRA adapter's files) removes it."""
