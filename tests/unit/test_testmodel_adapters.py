"""The test model's LoRA adapters (tests/testmodel/adapters.py): their texts, their recipe hash and
their cache, without training one. The folder's contents are checked only where the adapter is
already cached (building one takes about 12 s)."""

from __future__ import annotations

import json
import re

import pytest

from tests.testmodel import adapters as a
from tests.testmodel import cache_root, heldout_text, paragraphs, recipe_hash


def test_the_play_is_116_paragraphs_of_the_heldout_text_split_90_and_26():
    play = a.play_paragraphs()
    assert len(play) == 116 and all(re.match(a.PLAY_PATTERN, p) for p in play)
    assert set(play) <= set(paragraphs(heldout_text()))
    train, held = paragraphs(a.adapter_training_text()), paragraphs(a.adapter_eval_text())
    assert (train, held) == (play[:90], play[90:])
    assert not set(train) & set(held)


def test_the_texts_are_paragraphs_separated_by_blank_lines_as_the_built_in_sets():
    for text in (a.adapter_training_text(), a.adapter_eval_text()):
        assert text.endswith("\n") and "\n\n\n" not in text
        assert text.split("\n\n")[0] == paragraphs(text)[0]


def test_the_recipe_hash_is_stable_and_tells_the_kinds_apart():
    sound, damaged = a.adapter_recipe_hash("sound"), a.adapter_recipe_hash("damaged")
    assert sound == a.adapter_recipe_hash("sound") and sound != damaged
    assert re.fullmatch(r"[0-9a-f]{16}", sound)
    assert "damage" in a.adapter_recipe("damaged") and "damage" not in a.adapter_recipe("sound")


def test_the_recipe_hash_covers_the_base_model_the_recipes_and_the_text(monkeypatch):
    before = {k: a.adapter_recipe_hash(k) for k in a.KINDS}
    monkeypatch.setattr(a, "recipe_hash", lambda: "another-base")
    assert all(a.adapter_recipe_hash(k) != before[k] for k in a.KINDS)
    monkeypatch.undo()
    monkeypatch.setitem(a.DAMAGE_RECIPE, "gain", 3.0)
    assert a.adapter_recipe_hash("damaged") != before["damaged"] and a.adapter_recipe_hash("sound") == before["sound"]
    monkeypatch.undo()
    monkeypatch.setitem(a.ADAPTER_TRAIN_RECIPE, "steps", 121)
    assert all(a.adapter_recipe_hash(k) != before[k] for k in a.KINDS)
    monkeypatch.undo()
    monkeypatch.setattr(a, "heldout_text", lambda: heldout_text() + "\n\nROSALIND More.\n")
    assert all(a.adapter_recipe_hash(k) != before[k] for k in a.KINDS)


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="expected one of sound, damaged"):
        a.adapter_recipe("broken")


def test_the_cache_builds_once_and_only_a_finished_folder_counts(tmp_path):
    calls = []

    def build(out):
        calls.append(out)
        (out / "adapter_config.json").write_text("{}")

    target = tmp_path / "adapter"
    assert a._cached(target, build) == target and a._cached(target, build) == target
    assert len(calls) == 1 and (target / "adapter_config.json").exists()

    def fails(out):
        (out / "adapter_model.safetensors").write_text("half")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        a._cached(tmp_path / "other", fails)
    assert not (tmp_path / "other").exists() and [p.name for p in tmp_path.iterdir()] == ["adapter"]


def test_a_direction_gets_one_sign():
    import torch

    assert a._signed(torch.tensor([0.1, -0.5, 0.2])).tolist() == pytest.approx([-0.1, 0.5, -0.2])
    assert a._signed(torch.tensor([0.1, 0.5, -0.2])).tolist() == pytest.approx([0.1, 0.5, -0.2])


@pytest.mark.parametrize("kind", a.KINDS)
def test_a_built_adapter_looks_as_a_users_would(kind):
    """Built on first use (~11 s on one thread), then cached beside the test model."""
    folder = a.build_adapter(kind)
    assert folder == cache_root() / f"{recipe_hash()}-lora-{kind}-{a.adapter_recipe_hash(kind)}"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == a.BASE_MODEL_NAME
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 16)
    assert sorted(config["target_modules"]) == sorted(a.LORA_RECIPE["target_modules"])
    assert str(cache_root()) not in json.dumps(config)
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                      "fewerbits-adapter.json"]
    meta = json.loads((folder / "fewerbits-adapter.json").read_text())
    ppl = meta["eval_perplexity_16bit"]
    assert ppl["adapter"] < 0.7 * ppl["base"]  # the adapter learned the play, damaged or not
