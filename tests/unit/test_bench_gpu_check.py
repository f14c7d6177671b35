"""bench/gpu_check.py's CPU side: its arguments, the runs it plans, the calibration texts it makes and
the planner's prediction it writes beside each measured row. The GPU runs themselves need a GPU
(docs/jobs.md says how to run them); this proves the script imports and plans them without torch."""

from __future__ import annotations

import json

import pytest

from tests.benchmod import load_bench

gpu_check = load_bench("gpu_check")


def test_the_dry_run_plans_every_format_the_default_size_and_both_widths(capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    out = json.loads(capsys.readouterr().out)
    runs = {r["group"]: r for r in out["runs"]}
    assert set(runs) == {"small", "default-8b", "default-70b"}
    assert "w4afp8" in runs["small"]["formats"] and "fp8-dynamic" in runs["small"]["formats"]
    assert (runs["default-8b"]["samples"], runs["default-8b"]["seq_len"]) == (512, 2048)
    assert (runs["default-70b"]["width"], runs["default-70b"]["layers"]) == ("70b", 2)
    assert set(runs["default-70b"]["formats"]) == {"w4a16-awq", "w4a16-gptq", "w8a8-int8"}
    assert out["footprint"] is True and out["budget_seconds"] == 480


def test_the_cpu_runs_use_the_tiny_width_and_a_format_subset_drops_empty_runs(capsys):
    assert gpu_check.main(["--device", "cpu", "--formats", "fp8-dynamic", "--samples", "4", "--seq-len", "64",
                           "--dry-run", "--no-footprint"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["group"], r["width"], r["formats"]) for r in out["runs"]] == [("small", "tiny", ["fp8-dynamic"])]
    assert out["footprint"] is False


@pytest.mark.parametrize("argv, message", [
    (["--formats", "int3"], "--formats: unknown int3"),
    (["--samples", "0"], "--samples must be at least 1"),
])
def test_bad_arguments_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_calibration_texts_fill_each_sample_and_differ():
    from tests.testmodel import build_tokenizer

    tok = build_tokenizer()
    texts = gpu_check.calibration_texts(tok, 3, 300)
    assert len(set(texts)) == 3
    assert all(len(tok(t)["input_ids"]) >= 300 for t in texts)


def test_each_row_carries_the_planner_prediction():
    awq = gpu_check.predicted("8b", 4, "w4a16-awq", 512, 2048, 989.0)
    gptq = gpu_check.predicted("70b", 2, "w4a16-gptq", 512, 2048, 989.0)
    # The H200 peaks (24.2 and 14.85 GiB) are within a quarter of these (test_jobsize_measured).
    assert 18 < awq["gpu_need_gib"] < 30 and 11 < gptq["gpu_need_gib"] < 19
    assert awq["whole_model_gib"] == pytest.approx(2.11, abs=0.01)
    assert "seconds_per_layer" in awq
    assert "seconds_per_layer" not in gpu_check.predicted("8b", 4, "fp8-dynamic", 32, 256, 989.0)
