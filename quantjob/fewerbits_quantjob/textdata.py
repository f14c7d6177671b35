"""Text for calibration and evaluation: built-in sets, S3 JSON Lines, or a Hub dataset.

Forms (``CalibrationSpec.dataset`` / ``QualityGateSpec.evalDataset``):

- a built-in name: ``general-en`` (calibration) and ``general-en-heldout`` (evaluation), English
  prose shipped in this package (``data/*.txt``, one sample per paragraph; see data/README.md);
- ``s3://bucket/path.jsonl``: one JSON object per line with a ``text`` string, read with the
  storage endpoint and credentials;
- ``hf://datasets/org/name[@revision]``: its ``train`` split (or the first split), ``text``
  column, through ``datasets`` (``HF_TOKEN`` for gated sets).

No torch here. The names and file hashes of the built-in sets are ``fewerbits_api.datasets``
(the operator puts the hash into the artifact key without importing this package).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources

from fewerbits_api.artifact import split_s3_uri
from fewerbits_api.datasets import BUILTIN_DATASETS
from fewerbits_api.jobcontract import ENV_HF_TOKEN
from fewerbits_api.s3errors import S3ErrorKind, classify_s3_error

from . import errors
from .errors import JobError

_HF_DATASET = re.compile(r"^hf://datasets/(?P<repo>[^@#]+?)(?:@(?P<rev>[^#]+))?(?:#(?P<config>[^/]+)(?:/(?P<split>.+))?)?$")


@dataclass
class TextSet:
    """Samples of text, where they came from, and a hash of exactly what was read."""

    texts: list[str]
    source: str
    sha256: str
    details: dict[str, str] = field(default_factory=dict)
    """E.g. the S3 ETag or the Hub revision."""


def _builtin_bytes(name: str) -> bytes:
    if name not in BUILTIN_DATASETS:
        raise JobError(errors.DATASET_NOT_FOUND,
                       f"unknown built-in dataset {name!r} (built-in: {', '.join(BUILTIN_DATASETS)})", permanent=True)
    return resources.files(__package__).joinpath("data", f"{name}.txt").read_bytes()


def split_paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]


def parse_jsonl(body: bytes, source: str) -> list[str]:
    """``{"text": ...}`` per line; blank lines skipped; anything else is an error naming the line."""
    texts: list[str] = []
    for number, raw in enumerate(body.decode("utf-8", errors="strict").splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise JobError(errors.DATASET_INVALID, f"{source} line {number}: not JSON ({e.msg})", permanent=True) from e
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise JobError(errors.DATASET_INVALID, f'{source} line {number}: expected an object with a "text" string',
                           permanent=True)
        if record["text"].strip():
            texts.append(record["text"])
    if not texts:
        raise JobError(errors.DATASET_INVALID, f"{source}: no text records", permanent=True)
    return texts


def parse_hf_dataset_uri(uri: str) -> tuple[str, str | None]:
    m = _HF_DATASET.match(uri)
    if not m:
        raise JobError(errors.DATASET_INVALID, f"{uri!r} is not hf://datasets/org/name[@revision]", permanent=True)
    return m.group("repo"), m.group("rev")


def hf_config_and_split(uri: str) -> tuple[str | None, str | None]:
    """The ``#config[/split]`` part of a Hub dataset URI (None, None when absent)."""
    m = _HF_DATASET.match(uri)
    return (m.group("config"), m.group("split")) if m else (None, None)


def load_texts(uri: str, env: Mapping[str, str], s3_client_factory=None, limit: int | None = None,
               splits: tuple[str, ...] = ("train",)) -> TextSet:
    """Load the samples named by ``uri`` (at most ``limit``; the hash covers what is returned)."""
    if uri.startswith("s3://"):
        texts, details = _load_s3_jsonl(uri, s3_client_factory)
    elif uri.startswith("hf://"):
        texts, details = _load_hf(uri, env, limit, splits)
    else:
        body = _builtin_bytes(uri)
        texts = split_paragraphs(body.decode("utf-8"))
        details = {"builtin": uri, "fileSha256": hashlib.sha256(body).hexdigest()}
    if limit is not None:
        texts = texts[:limit]
    digest = hashlib.sha256("\n\x1e".join(texts).encode()).hexdigest()
    return TextSet(texts=texts, source=uri, sha256=digest, details=details)


def _load_s3_jsonl(uri: str, s3_client_factory) -> tuple[list[str], dict[str, str]]:
    from .storage import classify_client_error

    if s3_client_factory is None:
        raise JobError(errors.DATASET_FETCH_FAILED, f"{uri}: no S3 client configured")
    bucket, key = split_s3_uri(uri)
    client = s3_client_factory()
    try:
        obj = client.get_object(Bucket=bucket, Key=key)
        body = obj["Body"].read()
    except Exception as e:  # noqa: BLE001
        if classify_s3_error(e).kind in (S3ErrorKind.NOT_FOUND, S3ErrorKind.BUCKET_NOT_FOUND):
            raise JobError(errors.DATASET_NOT_FOUND, f"{uri}: no such object", permanent=True) from e
        err = classify_client_error(e, f"reading {uri}")
        err.reason = errors.DATASET_FETCH_FAILED if err.reason == errors.STORAGE_UNAVAILABLE else err.reason
        raise err from e
    details = {"etag": str(obj.get("ETag", "")).strip('"'), "sha256": hashlib.sha256(body).hexdigest()}
    return parse_jsonl(body, uri), details


def _load_hf(uri: str, env: Mapping[str, str], limit: int | None,
             splits: tuple[str, ...] = ("train",)) -> tuple[list[str], dict[str, str]]:
    import datasets

    repo, revision = parse_hf_dataset_uri(uri)
    config, wanted_split = hf_config_and_split(uri)
    token = env.get(ENV_HF_TOKEN) or None
    try:
        dsd = datasets.load_dataset(repo, *([config] if config else []), revision=revision, token=token, streaming=True)
    except Exception as e:  # noqa: BLE001 — network, auth or a missing set: one line, no traceback
        name = type(e).__name__
        reason = errors.DATASET_NOT_FOUND if "NotFound" in name or "FileNotFound" in name else errors.DATASET_FETCH_FAILED
        raise JobError(reason, f"{uri}: {name}: {e}", permanent=reason == errors.DATASET_NOT_FOUND) from e
    if wanted_split is not None and wanted_split not in dsd:
        raise JobError(errors.DATASET_INVALID, f"{uri}: no split {wanted_split!r} (has {', '.join(dsd)})", permanent=True)
    split = wanted_split or next((s for s in splits if s in dsd), next(iter(dsd)))
    texts: list[str] = []
    for row in dsd[split]:
        text = row.get("text")
        if not isinstance(text, str):
            raise JobError(errors.DATASET_INVALID, f'{uri}: split {split!r} has no "text" string column', permanent=True)
        if text.strip():
            texts.append(text)
        if limit is not None and len(texts) >= limit:
            break
    if not texts:
        raise JobError(errors.DATASET_INVALID, f"{uri}: no text rows in split {split!r}", permanent=True)
    return texts, {"split": split, "revision": revision or "default"}
