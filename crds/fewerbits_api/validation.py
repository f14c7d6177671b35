"""Validators shared by the API models.

Each check here is also expressed, where the API server can evaluate it, as a CEL rule or a
pattern in the generated CRD (see ``crdgen``); the Python side gives the same verdict with a
message that names the field, for objects that never pass through the API server (policy
defaults merged into a spec, the Job contract, the CLI).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from pydantic import field_validator

from .base import ApiModel

# RFC 1123 DNS label / subdomain, as Kubernetes names use them.
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"

# Source URIs: hf://org/name, s3://bucket/prefix, pvc://claim/path.
HF_REPO = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
S3_BUCKET = r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"
SAFE_PATH = r"[A-Za-z0-9._/-]*"
SOURCE_URI = rf"^(hf://{HF_REPO}|s3://{S3_BUCKET}(/{SAFE_PATH})?|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/{SAFE_PATH})?)$"
STORAGE_URI = rf"^s3://{S3_BUCKET}(/{SAFE_PATH})?$"
# Calibration / evaluation data: a built-in name, an S3 JSONL object, or a Hub dataset.
BUILTIN_DATASET = r"[a-z0-9][a-z0-9-]{0,62}"
DATASET_URI = (
    rf"^({BUILTIN_DATASET}|s3://{S3_BUCKET}/{SAFE_PATH}\.jsonl|hf://datasets/{HF_REPO}(@[A-Za-z0-9._/-]+)?(#[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)?)?)$"
)
# Revisions: a commit hash, tag or branch name (git ref characters only).
REVISION = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$"
HTTP_ENDPOINT = r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._/-]*)?$"


# The same verdict as check_no_path_tricks, for the API server (CEL; `matches` finds a match
# anywhere): no '.' or '..' segment, no empty segment inside the path (backslashes are already
# outside every URI pattern). A policy default with such a path must be refused at admission:
# past it, the operator could only ignore the whole policy.
PATH_TRICKS_CEL = {
    "x-kubernetes-validations": [{
        "rule": r"!self.matches('/\\.\\.?(/|$)') && !self.matches('^[a-z0-9]+://[^/]*/.*[^/]//+[^/]')",
        "message": "path segments '.' and '..' and empty segments ('//') are not allowed",
    }]
}


def check_no_path_tricks(value: str, field: str) -> str:
    """Refuse ``..`` segments, empty segments and backslashes in a URI path.

    A regex on the whole URI cannot say *why* it failed; this names the problem.
    """
    path = urlsplit(value).path if "://" in value else value
    segments = path.split("/")
    if ".." in segments or "." in segments:
        raise ValueError(f"{field}: path segments '.' and '..' are not allowed (got {value!r})")
    if "//" in path.strip("/"):
        raise ValueError(f"{field}: empty path segments ('//') are not allowed (got {value!r})")
    if "\\" in value:
        raise ValueError(f"{field}: backslashes are not allowed (got {value!r})")
    return value


def check_pattern(value: str, pattern: str, field: str, what: str) -> str:
    if not re.fullmatch(pattern.removeprefix("^").removesuffix("$"), value):
        raise ValueError(f"{field}: {value!r} is not {what}")
    return value


class UriSource(ApiModel):
    """A source named by ``uri`` (``scheme://...``): its path checked for tricks, its scheme at hand.
    The subclass declares ``uri`` with the schemes it takes."""

    uri: str

    @field_validator("uri")
    @classmethod
    def _uri_has_no_path_tricks(cls, v: str) -> str:
        return check_no_path_tricks(v, "uri")

    @property
    def scheme(self) -> str:
        return self.uri.split("://", 1)[0]

