"""Text for calibration and evaluation: built-in sets, S3 JSON Lines, or a Hub dataset.

Forms (``CalibrationSpec.dataset`` / ``QualityGateSpec.evalDataset``):

- a built-in name: ``general-en`` (calibration) and ``general-en-heldout`` (evaluation), English
  prose shipped in this package (``data/*.txt``, one sample per paragraph; see data/README.md);
- ``s3://bucket/path.jsonl``: one JSON object per line with a ``text`` string, read with the
  storage endpoint and credentials;
- ``hf://datasets/org/name[@revision]``: its ``train`` split (or the first split), ``text``
  column, or a chat ``messages`` column (rendered later with the model's chat template), through
  ``datasets`` (``HF_TOKEN`` for gated sets);
- ``auto`` (calibration only, the default): ``AUTO_HUB_DATASET`` when the Hub answers (reached
  as its client reaches it, proxies included: hubprobe.py), else the built-in ``AUTO_FALLBACK``,
  with the reason kept in ``details["fallback"]``; the Job then publishes under the fallback's own
  key (job.py, fewerbits_api.artifact.auto_fallback_inputs).

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
from fewerbits_api.datasets import (
    AUTO_CALIBRATION,
    AUTO_FALLBACK,
    AUTO_HUB_DATASET,
    BUILTIN_DATASETS,
    CALIBRATION_SPLITS,
    named_dataset_hash,
)
from fewerbits_api.jobcontract import ENV_HF_TOKEN
from fewerbits_api.s3errors import S3ErrorKind, classify_s3_error

from . import errors
from .errors import JobError
from .hubprobe import hub_unreachable

_HF_DATASET = re.compile(r"^hf://datasets/(?P<repo>[^@#]+?)(?:@(?P<rev>[^#]+))?(?:#(?P<config>[^/]+)(?:/(?P<split>.+))?)?$")


@dataclass
class TextSet:
    """Samples of text, where they came from, and a hash of exactly what was read."""

    texts: list[str]
    source: str
    sha256: str
    details: dict[str, str] = field(default_factory=dict)
    """E.g. the S3 ETag or the Hub revision."""
    conversations: list[list[dict[str, str]]] | None = None
    """Chat rows (``messages``), one per text, for the model's chat template; None for plain text."""
    read_from: str = ""
    """What was actually read (for ``auto``: the Hub set or the fallback); ``source`` otherwise."""


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


def load_calibration(uri: str, env: Mapping[str, str], s3_client_factory=None, limit: int | None = None,
                     hub=None, hub_down: str | None = None) -> TextSet:
    """The calibration samples ``uri`` names; for ``auto``, the pinned Hub set or, when it cannot be
    read (or ``hub_down`` says why not, the Job already knowing it), the built-in fallback, the
    reason in ``details["fallback"]`` (``hub``: the Hub loader, replaced in tests, which have no
    network). Only the Hub set's read carries ``details["keyHash"]``, the hash its key names: the
    fallback's file hash is its own key's (fewerbits_api.artifact.auto_fallback_inputs)."""
    if uri != AUTO_CALIBRATION:
        return load_texts(uri, env, s3_client_factory, limit)
    try:
        if why := hub_down or (hub is None and hub_unreachable(env)):
            raise JobError(errors.DATASET_FETCH_FAILED, why)
        loaded = (hub or load_texts)(AUTO_HUB_DATASET, env, None, limit)
        loaded.details["keyHash"] = named_dataset_hash(AUTO_CALIBRATION) or ""
    except JobError as e:
        loaded = load_texts(AUTO_FALLBACK, env, None, limit)
        loaded.details["fallback"] = f"{AUTO_HUB_DATASET} could not be read ({e.reason}: {e.message[:300]})"
    loaded.source = AUTO_CALIBRATION
    return loaded


def load_texts(uri: str, env: Mapping[str, str], s3_client_factory=None, limit: int | None = None,
               splits: tuple[str, ...] = CALIBRATION_SPLITS) -> TextSet:
    """Load the samples named by ``uri`` (at most ``limit``; the hash covers what is returned)."""
    conversations = None
    if uri.startswith("s3://"):
        texts, details = _load_s3_jsonl(uri, s3_client_factory)
    elif uri.startswith("hf://"):
        texts, details, conversations = _load_hf(uri, env, limit, splits)
    else:
        body = _builtin_bytes(uri)
        texts = split_paragraphs(body.decode("utf-8"))
        details = {"builtin": uri, "fileSha256": hashlib.sha256(body).hexdigest()}
    if limit is not None:
        texts = texts[:limit]
        conversations = conversations[:limit] if conversations is not None else None
    digest = hashlib.sha256("\n\x1e".join(texts).encode()).hexdigest()
    return TextSet(texts=texts, source=uri, sha256=digest, details=details, conversations=conversations,
                   read_from=uri)


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


def chat_row(messages, where: str) -> list[dict[str, str]] | None:
    """A ``messages`` cell as [{role, content}], or None when it is not one."""
    if not isinstance(messages, list) or not messages:
        return None
    out = []
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise JobError(errors.DATASET_INVALID, f'{where}: a "messages" entry is not {{"role", "content"}} strings',
                           permanent=True)
        out.append({"role": m["role"], "content": m["content"]})
    return out


def plain_chat(messages: list[dict[str, str]]) -> str:
    """A conversation as plain text, for a model without a chat template (and for the hash)."""
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in messages)


def _load_hf(uri: str, env: Mapping[str, str], limit: int | None,
             splits: tuple[str, ...] = CALIBRATION_SPLITS) -> tuple[list[str], dict[str, str], list | None]:
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
    conversations: list[list[dict[str, str]]] = []
    for row in dsd[split]:
        text = row.get("text")
        chat = chat_row(row.get("messages"), f"{uri} split {split!r}") if not isinstance(text, str) else None
        if chat is not None:
            conversations.append(chat)
            texts.append(plain_chat(chat))
        elif not isinstance(text, str):
            raise JobError(errors.DATASET_INVALID, f'{uri}: split {split!r} has no "text" string or chat "messages" '
                                                   "column", permanent=True)
        elif text.strip():
            texts.append(text)
        if limit is not None and len(texts) >= limit:
            break
    if not texts:
        raise JobError(errors.DATASET_INVALID, f"{uri}: no text rows in split {split!r}", permanent=True)
    if conversations and len(conversations) != len(texts):
        raise JobError(errors.DATASET_INVALID, f"{uri}: split {split!r} mixes text and chat rows", permanent=True)
    return texts, {"split": split, "revision": revision or "default"}, conversations or None
