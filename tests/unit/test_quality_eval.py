"""The quality gate as the Job measures it, on the CPU test model: perplexity with its noise
floor, the local lm-eval task (tests/fixtures/lmeval, its data in a JSON file beside the YAML),
and the custom set. A damaging quantization (every weight but the norms zeroed: a stand-in for a
broken 2-bit recipe, made only here) fails each gate type. That a sound fp8-dynamic passes them
all is shown by the real Job in tests/integration/test_quality.py (one lm-eval pass per model per
test keeps CI time down).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fewerbits_api.quantizedmodel import QualityGateSpec
from tests.testmodel import build_test_model

pytestmark = [pytest.mark.quantize]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lmeval"
WINDOW = 64
GATE = QualityGateSpec(
    maxPerplexityIncreasePercent=25.0, evalSamples=16,
    benchmarks=[{"task": "fewerbits_cloze", "limit": 24, "metric": "acc", "minRecoveryPercent": 80}],
    customEval={"dataset": "s3://fixtures/custom-eval.jsonl", "metric": "rougeL", "minRecoveryPercent": 80,
                "limit": 6, "maxNewTokens": 6},
)


@pytest.fixture(scope="module")
def base() -> Path:
    return build_test_model()


@pytest.fixture(scope="module")
def damaged(base, tmp_path_factory) -> Path:
    """Every weight but the norms zeroed (uniform next-token distribution): what a broken low-bit
    recipe does at its worst."""
    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("damaged")
    shutil.copytree(base, out, dirs_exist_ok=True)
    weights = load_file(str(out / "model.safetensors"))
    zeroed = {k: (v if "norm" in k else torch.zeros_like(v)) for k, v in weights.items()}
    save_file(zeroed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def measure(base: Path, quantized: Path, tmp_path: Path):
    from transformers import AutoTokenizer

    from fewerbits_quantjob import gate, lmeval, textdata

    prepared = lmeval.prepare(GATE, tmp_path, local_custom=(FIXTURES / "custom-eval.jsonl").read_bytes(),
                              local_task_dirs=[FIXTURES])
    texts = textdata.load_texts(GATE.evalDataset, {})
    tok = AutoTokenizer.from_pretrained(base)
    return gate.measure(base, quantized, tok, texts.texts, GATE.evalDataset, texts.sha256, GATE, WINDOW, False, prepared)


@pytest.fixture(scope="module")
def damaged_report(base, damaged, tmp_path_factory):
    return measure(base, damaged, tmp_path_factory.mktemp("m2"))


def by_kind(report) -> dict[str, object]:
    return {m.kind: m for m in report.metrics}


def test_damaged_model_fails_each_gate_type(damaged_report):
    metrics = by_kind(damaged_report)
    for kind in ("perplexity", "benchmark", "custom"):
        m = metrics[kind]
        assert not m.passed, m
        assert m.recoveryPercent < m.minRecoveryPercent, m
    assert not damaged_report.passed
    # The perplexity shortfall is far outside its own noise floor (the paired per-window interval).
    low, high = damaged_report.increaseCI95
    assert 25.0 < low <= damaged_report.increasePercent <= high and damaged_report.noiseFloorPercent > 0
    # The base model's scores are real ones: above chance on the cloze task, some ROUGE-L overlap.
    assert metrics["benchmark"].name == "benchmark:fewerbits_cloze/acc" and metrics["benchmark"].samples == 24
    assert metrics["benchmark"].base > 0.25 and metrics["custom"].base > 0
    assert all(m.seconds > 0 for m in damaged_report.metrics) and len(damaged_report.evalIdentity) == 64


def test_bad_input_is_refused_before_any_model_loads(tmp_path):
    from fewerbits_quantjob import lmeval
    from fewerbits_quantjob.errors import JobError

    def refused(gate, **kw) -> str:
        with pytest.raises(JobError) as e:
            lmeval.prepare(QualityGateSpec(**gate), tmp_path, **kw)
        return e.value.message

    msg = refused({"benchmarks": [{"task": "no_such_task_anywhere"}]}, local_task_dirs=[FIXTURES])
    assert "benchmarks[0].task" in msg and "no_such_task_anywhere" in msg
    msg = refused({"benchmarks": [{"task": "fewerbits_cloze", "metric": "exact_match"}]}, local_task_dirs=[FIXTURES])
    assert "benchmarks[0].metric" in msg and "acc" in msg
    custom = {"customEval": {"dataset": "s3://bucket/x.jsonl", "metric": "contains"}}
    assert "no records" in refused(custom, local_custom=b"\n\n")
    msg = refused(custom, local_custom=b'{"prompt": "a"}\n')
    assert "customEval.dataset" in msg and "line 1" in msg and "'reference'" in msg
