"""The contracts the operator, the quantization Job and the serving runtime share, each defined
once in ``fewerbits_api``: built-in dataset hashes, manifest parsing, S3 error kinds and the
compute-capability verdict."""

from __future__ import annotations

import ast
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from botocore.exceptions import (
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)

from fewerbits_api.artifact import ArtifactKeyInputs, Manifest, ManifestError
from fewerbits_api.datasets import BUILTIN_DATASET_SHA256, BUILTIN_DATASETS
from fewerbits_api.formats import FORMAT_FACTS, QuantFormat as F, cc_verdict
from fewerbits_api.s3errors import S3ErrorKind, classify_s3_error

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- built-in datasets
def test_builtin_dataset_hashes_are_the_shipped_files():
    data = REPO / "quantjob" / "fewerbits_quantjob" / "data"
    shipped = {p.stem: hashlib.sha256(p.read_bytes()).hexdigest() for p in data.glob("*.txt")}
    assert shipped == BUILTIN_DATASET_SHA256
    assert BUILTIN_DATASETS == tuple(BUILTIN_DATASET_SHA256)


# ------------------------------------------------------------------ the operator's import diet
FORBIDDEN = ("fewerbits_quantjob", "fewerbits_runtime")


def test_operator_source_imports_nothing_from_the_job_or_the_runtime():
    offenders = []
    for path in (REPO / "operator" / "fewerbits_operator").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert offenders == []


def test_importing_the_operator_loads_neither_the_job_nor_the_runtime():
    code = ("import sys, pkgutil, importlib, fewerbits_operator\n"
            "for m in pkgutil.walk_packages(fewerbits_operator.__path__, 'fewerbits_operator.'):\n"
            "    importlib.import_module(m.name)\n"
            f"print(sorted(n for n in sys.modules if n.split('.')[0] in {FORBIDDEN!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


# ----------------------------------------------------------------------------- Manifest.parse
INPUTS = ArtifactKeyInputs(sourceUri="hf://org/m", format="fp8-dynamic")
KEY = INPUTS.key()


def _wire(**overrides) -> dict:
    doc = {"key": KEY, "keyInputs": INPUTS.to_wire(), "format": "fp8-dynamic", "createdAt": "2026-11-23T00:00:00Z",
           "files": [{"path": "config.json", "sizeBytes": 2, "sha256": "a" * 64},
                     {"path": "sub/model.safetensors", "sizeBytes": 3, "sha256": "b" * 64}],
           "totalBytes": 5}
    doc.update(overrides)
    return doc


def test_manifest_parse_accepts_a_good_manifest_and_ignores_unknown_fields():
    m = Manifest.parse(json.dumps(_wire(fromTheFuture=1)), KEY)
    assert m.key == KEY and [f.path for f in m.files] == ["config.json", "sub/model.safetensors"]


@pytest.mark.parametrize("raw, expected_key, field, needle", [
    (b"{not json", KEY, None, "not a valid manifest"),
    (_wire(totalBytes="many"), KEY, "totalBytes", "totalBytes"),
    (_wire(), "c" * 64, "key", "not the expected"),
    (_wire(key="d" * 64), "d" * 64, "key", "does not match its keyInputs"),
    (_wire(files=[{"path": "a", "sizeBytes": 1, "sha256": "a" * 64}] * 2, totalBytes=2), KEY, "files[1].path", "twice"),
    (_wire(files=[{"path": "a", "sizeBytes": 1, "sha256": "a" * 64},
                  {"path": "a/b", "sizeBytes": 1, "sha256": "a" * 64}], totalBytes=2), KEY, "files", "file and as a folder"),
    (_wire(totalBytes=6), KEY, "totalBytes", "not the sum"),
    (_wire(files=[{"path": "../up", "sizeBytes": 5, "sha256": "a" * 64}]), KEY, "files[0].path", "'..'"),
    (_wire(files=[{"path": "a//b", "sizeBytes": 5, "sha256": "a" * 64}]), KEY, "files[0].path", "empty"),
    (_wire(files=[{"path": "/etc/passwd", "sizeBytes": 5, "sha256": "a" * 64}]), KEY, "files[0].path", "pattern"),
])
def test_manifest_parse_refuses(raw, expected_key, field, needle):
    body = raw if isinstance(raw, bytes) else json.dumps(raw)
    with pytest.raises(ManifestError) as e:
        Manifest.parse(body, expected_key)
    assert needle in e.value.message and e.value.field == field, (e.value.message, e.value.field)


# ----------------------------------------------------------------------------- S3 error kinds
def _client_error(code: str, status: int | None = None) -> ClientError:
    response: dict = {"Error": {"Code": code, "Message": "m"}}
    if status:
        response["ResponseMetadata"] = {"HTTPStatusCode": status}
    return ClientError(response, "GetObject")


@pytest.mark.parametrize("exc, kind, code", [
    (_client_error("NoSuchKey", 404), S3ErrorKind.NOT_FOUND, "NoSuchKey"),
    (_client_error("404", 404), S3ErrorKind.NOT_FOUND, "404"),
    (_client_error("", 404), S3ErrorKind.NOT_FOUND, "404"),  # HeadObject/HeadBucket: no body
    (_client_error("NoSuchBucket", 404), S3ErrorKind.BUCKET_NOT_FOUND, "NoSuchBucket"),
    (_client_error("AccessDenied", 403), S3ErrorKind.ACCESS_DENIED, "AccessDenied"),
    (_client_error("SignatureDoesNotMatch", 403), S3ErrorKind.ACCESS_DENIED, "SignatureDoesNotMatch"),
    (_client_error("InvalidAccessKeyId", 403), S3ErrorKind.ACCESS_DENIED, "InvalidAccessKeyId"),
    (_client_error("SomethingNew", 403), S3ErrorKind.ACCESS_DENIED, "SomethingNew"),
    (_client_error("SlowDown", 503), S3ErrorKind.TRANSIENT, "SlowDown"),
    (_client_error("InternalError", 500), S3ErrorKind.TRANSIENT, "InternalError"),
    (_client_error("Weird", 502), S3ErrorKind.TRANSIENT, "Weird"),
    (_client_error("InvalidRange", 416), S3ErrorKind.OTHER, "InvalidRange"),
    (EndpointConnectionError(endpoint_url="http://s3.invalid"), S3ErrorKind.TRANSIENT, "EndpointConnectionError"),
    (ConnectTimeoutError(endpoint_url="http://s3.invalid"), S3ErrorKind.TRANSIENT, "ConnectTimeoutError"),
    (ReadTimeoutError(endpoint_url="http://s3.invalid"), S3ErrorKind.TRANSIENT, "ReadTimeoutError"),
    (TimeoutError(), S3ErrorKind.TRANSIENT, "TimeoutError"),
    (NoCredentialsError(), S3ErrorKind.ACCESS_DENIED, "NoCredentialsError"),
    (ValueError("x"), S3ErrorKind.OTHER, "ValueError"),
])
def test_s3_error_classification(exc, kind, code):
    c = classify_s3_error(exc)
    assert (c.kind, c.code) == (kind, code)
    assert c.retryable is (kind is S3ErrorKind.TRANSIENT)


def test_no_component_keeps_its_own_list_of_s3_error_codes():
    codes = ('"NoSuchKey"', '"AccessDenied"', '"SignatureDoesNotMatch"', '"NoSuchBucket"', '"SlowDown"')
    for root in ("operator/fewerbits_operator", "quantjob/fewerbits_quantjob", "runtime/fewerbits_runtime"):
        for path in (REPO / root).rglob("*.py"):
            text = path.read_text()
            assert not [c for c in codes if c in text], path


# -------------------------------------------------------------------------- compute capability
@pytest.mark.parametrize("fmt, cc, kind, needle", [
    (F.FP8_DYNAMIC, (9, 0), "native", ""),
    (F.FP8_DYNAMIC, (8, 9), "native", ""),
    (F.FP8_DYNAMIC, (8, 0), "fallback", "FP8 Marlin"),
    (F.FP8_DYNAMIC, (7, 5), "refused", "fp8-dynamic needs compute capability 8.0 or newer (native from 8.9)"),
    (F.FP8_BLOCK, (8, 9), "refused", "fp8-block needs compute capability 9.0 or newer"),
    (F.NVFP4, (10, 0), "native", ""),
    (F.NVFP4, (12, 1), "native", ""),
    (F.NVFP4, (9, 0), "fallback", "FP4 Marlin"),
    (F.NVFP4, (7, 5), "refused", "needs compute capability 8.0 or newer (native from 10.0)"),
    (F.W4AFP8, (9, 0), "native", ""),
    (F.W4AFP8, (8, 9), "refused", "only on compute capability 9.0 exactly"),
    (F.W4AFP8, (10, 0), "refused", "only on compute capability 9.0 exactly"),
    (F.W4A16_AWQ, (7, 5), "fallback", "Marlin kernel below CC 8.0"),
    (F.W4A16_GPTQ, (7, 0), "refused", "needs compute capability 7.5 or newer (native from 8.0)"),
    (F.W8A8_INT8, (7, 5), "native", ""),
    (F.NONE, (7, 0), "native", ""),
])
def test_cc_verdict_table(fmt, cc, kind, needle):
    v = cc_verdict(fmt, cc)
    assert v.kind == kind and needle in v.why and v.runs is (kind != "refused"), v


def test_every_format_runs_natively_at_its_native_minimum():
    for fmt, facts in FORMAT_FACTS.items():
        assert cc_verdict(fmt, facts.native_min_cc).kind == "native", fmt


def test_planner_and_launcher_give_the_same_verdict():
    from fewerbits_operator.planner.rules import kernel_support
    from fewerbits_runtime.launch import GPUInfo, check

    for fmt in FORMAT_FACTS:
        for cc in ((7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)):
            kind, _ = kernel_support(fmt, cc)
            v = check(fmt, GPUInfo(cc, None, "t"))
            assert (v.ok, v.fallback) == (kind != "refused", kind == "fallback"), (fmt, cc)
