"""vLLM's own loader as the judge (scripts/vllm-check.sh): every zoo architecture, quantized in
every format the planner could choose for it with the Job's code, loads into vLLM 0.33.0's model
classes with vLLM's weight loader, or is refused by the planner with a reason. A ``fails`` row
fails this test.

Builds the vLLM environment on first use (tools/vllm_check/setup.sh: 3-8 min, 9.4 GB, cached
under $FEWERBITS_CACHE/vllm-check, keyed by the vLLM version) and the zoo's artifacts (cached).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from fewerbits_api.formats import CONCRETE_FORMATS
from tests.testmodel import zoo

pytestmark = [pytest.mark.quantize, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm-check") / "out.json"
    proc = subprocess.run([str(REPO / "scripts" / "vllm-check.sh"), "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=3600)
    rows = json.loads(out.read_text()) if out.exists() else []
    return proc, rows


def test_no_artifact_fails_to_load_in_vllm(check):
    proc, rows = check
    failed = [r for r in rows if r["result"] == "fails"]
    assert not failed, "\n".join(f"{r['architecture']} × {r['format']}: {r['detail']}" for r in failed)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def test_every_architecture_and_format_has_a_row_and_each_architecture_loads_somewhere(check):
    _, rows = check
    cells = {(r["architecture"], r["format"]) for r in rows}
    assert cells == {(a, f.value) for a in zoo.names() for f in CONCRETE_FORMATS}
    for arch in zoo.names():
        assert any(r["result"] == "loads" for r in rows if r["architecture"] == arch), arch
    assert all(r["result"] in ("loads", "refused", "fails") and r["detail"] for r in rows)


def test_quantized_artifacts_keep_routers_and_vision_layers_16bit(check):
    _, rows = check
    for r in rows:
        ignore = r.get("artifact_ignore")
        if ignore is None:
            continue
        if r["architecture"] in ("mixtral", "qwen3_moe", "deepseek_v3"):
            # llm-compressor lists the modules it left alone; routers that are not nn.Linear in
            # transformers 5 (Qwen3-MoE's, DeepSeek's) are never quantized and not listed.
            assert "lm_head" in ignore
        if r["architecture"] == "mixtral":
            assert any(n.endswith("block_sparse_moe.gate") for n in ignore), ignore


def test_the_already_fp8_source_is_served_as_is_and_other_formats_refused(check):
    _, rows = check
    fp8 = {r["format"]: r for r in rows if r["architecture"] == "deepseek_v3_fp8"}
    # format none ("do not quantize") on an FP8 source is the same as-is artifact.
    for fmt in ("fp8-block", "none"):
        assert fp8[fmt]["result"] == "loads" and "served as-is" in fp8[fmt]["detail"], fp8[fmt]
    for fmt, r in fp8.items():
        if fmt not in ("fp8-block", "none"):
            assert r["result"] == "refused" and "already quantized" in r["detail"], r
