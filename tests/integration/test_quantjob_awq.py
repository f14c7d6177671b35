"""Canary for the CPU-only AWQ guard (fewerbits_quantjob.quantize.cpu_awq_pin_memory_guard).

llm-compressor 0.14.0.1 pins AWQ's cached activations unconditionally, which raises on a machine
with no accelerator. This test runs AWQ on the tiny model WITHOUT the guard and expects that
failure: when an llm-compressor upgrade fixes it upstream, this test fails and says the guard can
go. (With the guard, AWQ is covered by test_quantjob.py.)
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.quantize


def test_awq_on_cpu_still_needs_the_pin_memory_guard():
    torch = pytest.importorskip("torch")
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present: the guard is inactive here and pinning works")
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fewerbits_api.formats import QuantFormat
    from fewerbits_quantjob import recipes
    from tests.testmodel import build_test_model, paragraphs, training_text

    path = build_test_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(path)
    specs = recipes.build_recipe_spec(QuantFormat.W4A16_AWQ, ["lm_head"])
    specs[0].kwargs["n_grid"] = 2  # a coarse grid: this test needs AWQ to start, not to search well
    mods = recipes.instantiate(specs)
    data = Dataset.from_dict({"text": paragraphs(training_text())[:2]})
    with pytest.raises(RuntimeError) as e:
        oneshot(model=model, processor=tokenizer, recipe=mods, dataset=data, num_calibration_samples=2,
                max_seq_length=32, shuffle_calibration_samples=False)
    assert "pin_memory" in "".join(__import__("traceback").format_tb(e.tb)), (
        "AWQ failed on the CPU for another reason than pin_memory: " + str(e.value))
