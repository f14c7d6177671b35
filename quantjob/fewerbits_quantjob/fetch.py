"""Fetch the base model into a local directory: ``hf://``, ``s3://`` or a mounted ``pvc://``.

- ``hf://org/name``: ``huggingface_hub.snapshot_download`` of the weights, config and tokenizer
  files at the requested revision, resolved to a commit first so the manifest records exactly what
  was quantized. ``HF_TOKEN`` for gated or private repositories.
- ``s3://bucket/prefix``: every object under the prefix, in parallel, with the source credentials
  (``FEWERBITS_SOURCE_AWS_*``) at ``source.endpoint``/``source.region``, else the storage's
  (``FEWERBITS_SOURCE_S3_ENDPOINT`` overrides the storage fallback).
- ``pvc://claim/path``: the operator mounts the claim's root read-only at ``source.mountPath``; the
  model is ``<source.mountPath>/<path>``, read in place (no copy).

Which model and revision: ``keyInputs.sourceUri`` / ``sourceRevision`` (the key names them once).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fewerbits_api.artifact import split_s3_uri
from fewerbits_api.jobcontract import ENV_HF_TOKEN, QuantJobContract

from . import errors
from .errors import JobError
from .report import StageHandle, human_bytes

HF_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


@dataclass
class FetchedModel:
    path: Path
    resolved_revision: str | None


def fetch_source(contract: QuantJobContract, env: Mapping[str, str], workdir: Path, stage: StageHandle) -> FetchedModel:
    uri = contract.keyInputs.sourceUri
    scheme, _, rest = uri.partition("://")
    if scheme == "hf":
        fetched = _fetch_hf(rest, contract.keyInputs.sourceRevision, contract.source.trustRemoteCode, env,
                            workdir / "source")
    elif scheme == "s3":
        fetched = _fetch_s3(contract, env, workdir / "source", stage)
    elif scheme == "pvc":
        fetched = _fetch_pvc(rest, contract.source.mountPath)
    else:
        raise JobError(errors.CONTRACT_INVALID, f"keyInputs.sourceUri: unsupported scheme {scheme!r}", permanent=True)
    if not (fetched.path / "config.json").is_file():
        raise JobError(errors.SOURCE_NOT_FOUND, f"{uri}: no config.json at the source (is the path a model directory?)",
                       permanent=True)
    size = sum(p.stat().st_size for p in fetched.path.rglob("*") if p.is_file())
    stage.summary.update(bytes=human_bytes(size), revision=fetched.resolved_revision or "-")
    return fetched


def _fetch_hf(repo: str, revision: str | None, trust_remote_code: bool, env: Mapping[str, str], dest: Path) -> FetchedModel:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    token = env.get(ENV_HF_TOKEN) or None
    try:
        sha = HfApi(token=token).model_info(repo, revision=revision).sha
        path = snapshot_download(repo, revision=sha or revision, token=token, local_dir=str(dest),
                                 allow_patterns=HF_ALLOW_PATTERNS + (["*.py"] if trust_remote_code else []))
    except GatedRepoError as e:
        raise JobError(errors.SOURCE_ACCESS_DENIED, f"hf://{repo} is gated: set source.credentialsSecret with an HF_TOKEN "
                       "that has accepted its terms", permanent=True) from e
    except RepositoryNotFoundError as e:
        raise JobError(errors.SOURCE_NOT_FOUND, f"hf://{repo}: repository not found (or private without a token)",
                       permanent=True) from e
    except RevisionNotFoundError as e:
        raise JobError(errors.SOURCE_NOT_FOUND, f"hf://{repo}: revision {revision!r} not found", permanent=True) from e
    except Exception as e:  # noqa: BLE001 — network errors: one line, retryable
        raise JobError(errors.SOURCE_FETCH_FAILED, f"hf://{repo}: {type(e).__name__}: {e}") from e
    return FetchedModel(Path(path), sha or revision)


def _fetch_s3(contract: QuantJobContract, env: Mapping[str, str], dest: Path, stage: StageHandle) -> FetchedModel:
    from .storage import classify_client_error, download_prefix, source_client

    uri = contract.keyInputs.sourceUri
    bucket, prefix = split_s3_uri(uri)
    client = source_client(contract.source, contract.storage, env)
    dest.mkdir(parents=True, exist_ok=True)

    def progress(done: int, total: int) -> None:
        stage.report(done / max(total, 1), bytes=f"{human_bytes(done)}/{human_bytes(total)}")

    try:
        files = download_prefix(client, bucket, prefix, dest, progress)
    except JobError:
        raise
    except Exception as e:  # noqa: BLE001
        err = classify_client_error(e, f"reading {uri}")
        err.reason = {errors.STORAGE_ACCESS_DENIED: errors.SOURCE_ACCESS_DENIED,
                      errors.STORAGE_BUCKET_NOT_FOUND: errors.SOURCE_NOT_FOUND}.get(err.reason, errors.SOURCE_FETCH_FAILED)
        raise err from e
    if not files:
        raise JobError(errors.SOURCE_NOT_FOUND, f"{uri}: no objects under this prefix", permanent=True)
    # An S3 prefix has no commit; the requested revision (if any) is recorded as given.
    return FetchedModel(dest, contract.keyInputs.sourceRevision)


def _fetch_pvc(rest: str, mount: str | None) -> FetchedModel:
    if not mount:
        raise JobError(errors.CONTRACT_INVALID, "source.mountPath: required for a pvc:// source (where the claim is mounted)",
                       permanent=True)
    _claim, _, sub = rest.partition("/")
    path = Path(mount) / sub if sub else Path(mount)
    if not path.is_dir():
        raise JobError(errors.SOURCE_NOT_FOUND, f"pvc://{rest}: {path} is not a directory in the mounted claim",
                       permanent=True)
    return FetchedModel(path, None)


ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]


def fetch_adapter(adapter, index: int, contract: QuantJobContract, env: Mapping[str, str], dest: Path) -> Path:
    """One LoRA adapter's two files (``adapter``: a contract ``AdapterEvaluation`` at ``index``) into
    ``dest``, with its own credentials (``adapter_env``) and never another's: without a Secret it
    is read anonymously. A JobError naming it when they cannot be read (permanent when they are
    not there; a transient one makes the Job retry)."""
    from fewerbits_api.adapters import adapter_env
    from fewerbits_api.names import SECRET_ACCESS_KEY_ID, SECRET_HF_TOKEN, SECRET_SECRET_ACCESS_KEY
    from fewerbits_api.s3errors import S3ErrorKind, classify_s3_error

    where = f"adapter {adapter.name!r} ({adapter.uri})"
    dest.mkdir(parents=True, exist_ok=True)
    if adapter.uri.startswith("hf://"):
        _fetch_hf_adapter(adapter, env.get(adapter_env(index, SECRET_HF_TOKEN)) or False, dest, where)
        return dest
    from .storage import classify_client_error, s3_client

    bucket, prefix = split_s3_uri(adapter.uri)
    keys = (env.get(adapter_env(index, SECRET_ACCESS_KEY_ID)), env.get(adapter_env(index, SECRET_SECRET_ACCESS_KEY)))
    client = s3_client(adapter.endpoint, adapter.region, *keys, unsigned=not all(keys))  # no endpoint: AWS S3
    for name in ADAPTER_FILES:
        key = f"{prefix.strip('/')}/{name}" if prefix.strip("/") else name
        try:
            client.download_file(bucket, key, str(dest / name))
        except Exception as e:  # noqa: BLE001
            if classify_s3_error(e).kind is S3ErrorKind.NOT_FOUND:
                raise JobError(errors.SOURCE_NOT_FOUND, f"{where}: no {name} there", permanent=True) from e
            raise classify_client_error(e, f"reading {where}: {name}") from e
    return dest


def _fetch_hf_adapter(adapter, token, dest: Path, where: str) -> None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        snapshot_download(adapter.uri.removeprefix("hf://"), revision=adapter.revision, token=token,
                          local_dir=str(dest), allow_patterns=ADAPTER_FILES)
    except (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise JobError(errors.SOURCE_NOT_FOUND, f"{where}: {type(e).__name__} (gated, private without its "
                       "Secret, or not there)", permanent=True) from e
    except Exception as e:  # noqa: BLE001 — network errors: one line, retryable
        raise JobError(errors.SOURCE_FETCH_FAILED, f"{where}: {type(e).__name__}: {e}") from e
