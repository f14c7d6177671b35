"""The vllm-check table and JSON (tools/vllm_check/report.py), without vLLM."""

from __future__ import annotations

import json

from tools.vllm_check import report


def test_rows_and_load_results_join_into_the_documented_shape(tmp_path):
    rows = [
        {"architecture": "llama", "format": "none", "artifact": "/a/llama", "detail": "the source itself"},
        {"architecture": "llama", "format": "fp8-dynamic", "artifact": "/a/llama-fp8", "artifact_ignore": ["lm_head"]},
        {"architecture": "gemma3", "format": "fp8-dynamic", "result": "refused", "detail": "format fp8-dynamic: ..."},
        {"architecture": "gemma3", "format": "none", "artifact": "/a/missing"},
    ]
    loads = [{"path": "/a/llama", "result": "loads", "detail": "21 tensors"},
             {"path": "/a/llama-fp8", "result": "fails", "detail": "KeyError: x (vllm/models/llama.py:1)"}]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    (tmp_path / "loads.json").write_text(json.dumps(loads))
    out = tmp_path / "out.json"
    assert report.main([str(tmp_path / "rows.json"), str(tmp_path / "loads.json"), "--json", str(out)]) == 1
    got = json.loads(out.read_text())
    assert [(r["architecture"], r["format"], r["result"]) for r in got] == [
        ("llama", "none", "loads"), ("llama", "fp8-dynamic", "fails"),
        ("gemma3", "fp8-dynamic", "refused"), ("gemma3", "none", "fails")]
    assert got[0]["detail"] == "the source itself: 21 tensors"
    assert "no result" in got[3]["detail"]
    assert all({"architecture", "format", "result", "detail"} <= set(r) for r in got)


def test_the_table_has_one_line_per_architecture_and_names_every_non_loading_cell():
    text = report.table([
        {"architecture": "llama", "format": "none", "result": "loads", "detail": ""},
        {"architecture": "llama", "format": "nvfp4", "result": "refused", "detail": "why"},
    ])
    lines = text.splitlines()
    assert lines[0].split() == ["architecture", "none", "nvfp4"]
    assert lines[1].split() == ["llama", "loads", "refused"]
    assert "llama × nvfp4: refused: why" in text
