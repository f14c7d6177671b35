"""Admission checks benchmarks against lm-eval's own task registry (fewerbits_api.lmeval_tasks)."""

from __future__ import annotations

import re
from pathlib import Path

from fewerbits_api.lmeval_tasks import benchmark_problems, index
from fewerbits_api.quantizedmodel import QuantizedModelSpec
from fewerbits_operator.artifacts.effective import effective_spec

REPO = Path(__file__).resolve().parents[2]


def _gate(*benchmarks):
    return QuantizedModelSpec.model_validate({
        "source": {"uri": "hf://a/b"}, "storage": {"uri": "s3://bkt/q"},
        "quantization": {"qualityGate": {"benchmarks": list(benchmarks)}}}).quantization.qualityGate


def test_the_index_is_the_pinned_lm_eval_registry():
    pinned = re.search(r'"lm-eval==([^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    idx = index()
    assert idx["lm_eval"] == pinned
    assert idx["tasks"]["arc_easy"] == ["multiple_choice", ["acc", "acc_norm"]]
    assert "mmlu" in idx["groups"] and len(idx["tasks"]) > 10000
    # Regenerated from the installed lm-eval (the quantjob extra): the same bytes.
    from tools.lmeval_index.build import OUT, build, encode

    assert OUT.read_bytes() == encode(build()), "run tools/lmeval_index/build.py"


def test_unknown_tasks_and_unfit_metrics_are_named_by_field():
    gate = _gate({"task": "arc_easy", "metric": "acc_norm"}, {"task": "arc_eazy"},
                 {"task": "gsm8k", "metric": "acc"}, {"task": "mmlu"},
                 {"task": "my_task", "taskSource": "s3://bkt/tasks/my/"})
    problems = benchmark_problems(gate)
    assert problems == [
        "spec.quantization.qualityGate.benchmarks[1].task: 'arc_eazy' is not a task of lm-eval 0.4.13 "
        "(bring your own task YAML with taskSource)",
        "spec.quantization.qualityGate.benchmarks[2].metric: 'acc' does not fit task 'gsm8k' (generate_until); "
        "it reports exact_match"]
    assert benchmark_problems(None) == []


def test_the_model_is_not_accepted_with_an_unknown_task():
    eff = effective_spec({"source": {"uri": "hf://a/b"}, "storage": {"uri": "s3://bkt/q"},
                          "quantization": {"qualityGate": {"benchmarks": [{"task": "hellaswagg"}]}}}, None)
    assert not eff.accepted
    assert any(e.startswith("spec.quantization.qualityGate.benchmarks[0].task: 'hellaswagg'") for e in eff.errors)
