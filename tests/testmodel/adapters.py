"""LoRA adapters for the tiny test model: one sound, one damaged, both trained here with peft.

The adapter gate (issue 43) measures an adapter on a quantized base against the same adapter on the
16-bit base: perplexity on the adapter's evaluation text. Its tests need adapters that a real user
could have made for the test model, without a model hub. Both are trained on the play ("As You Like
It": the paragraphs of the built-in held-out text that open with a speaker's name in capitals) and
evaluated on the play's paragraphs they never saw:

    from tests.testmodel.adapters import adapter_eval_text, build_adapter
    path = build_adapter("sound")        # cached directory (adapter_config.json, adapter_model.safetensors)
    path = build_adapter("damaged", tmp_path / "damaged")   # a private copy

* ``sound``: LoRA r=8, alpha=16 on all seven Llama projections, 120 AdamW steps on the first 90 of
  the play's 116 paragraphs (about 12 s on one thread). It lowers the 16-bit base's perplexity on
  the other 26 from about 191 to about 109, and quantizing the base changes that by about 0.1%.

* ``damaged``: the same adapter, trained the same way, with one of its rank-8 components replaced
  by a high-gain one (DAMAGE_RECIPE). In layer 1's o_proj, rank index 7 reads the direction in which
  the 16-bit base's attention output (o_proj's input) has the least energy on the training text,
  and writes it, times a large gain, into the residual stream along the direction the output head
  reads most strongly. On the 16-bit base that direction carries almost nothing, so the component
  adds little and the adapter scores about as the sound one does. A quantized base perturbs
  layer 0 and layer 1's attention (int4 weight error, FP8 weight and activation rounding), and that
  perturbation is not confined to the directions the 16-bit signal uses: on the evaluation text
  o_proj's input differs from the 16-bit one by 3.4% (fp8-dynamic) and 5.9% (w4a16-gptq) overall,
  but along the quiet direction by 1.7 and 5.1 times the 16-bit signal there, and the gain carries
  that to the logits. Perplexity therefore rises with the size of the base's quantization error:
  on vLLM's CPU build +5.7% on w4a16-gptq, +1.1% on fp8-dynamic, against +0.15% and -0.01% for
  the sound adapter (docs/adapters.md has the table). Nothing here looks at any quantized artifact:
  the direction comes from the 16-bit base alone, so the damage is to whichever quantized base
  perturbs it most. (A real adapter fails the same way when it relies on features of small variance
  that quantization noise swamps.)

The build is deterministic (fixed seed, one thread) and cached under
``${FEWERBITS_CACHE:-~/.cache/fewerbits}/testmodel/<base hash>-lora-<kind>-<recipe hash>/``; the
hash covers everything that decides the bytes (recipes, the text, torch/transformers/peft versions,
the base model's own recipe hash). A finished cache folder is only ever created by an atomic rename.

adapter_config.json is peft's own, with ``base_model_name_or_path`` set to BASE_MODEL_NAME (peft
writes the local path it trained on, which means nothing elsewhere); peft's generated README.md is
dropped (it repeats that path). ``fewerbits-adapter.json`` beside it records the recipe and the
16-bit perplexities measured at build time.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from pathlib import Path

import tests.testmodel as testmodel
from tests.testmodel import build_test_model, cache_root, heldout_text, paragraphs, recipe_hash

ADAPTER_BUILDER_VERSION = 2
"""Bump when the build procedure changes in a way the recipes below do not show."""

KINDS = ("sound", "damaged")

BASE_MODEL_NAME = "fewerbits-testmodel"
"""What adapter_config.json names as the base: a name, as a hub id would be, not a local path."""

PLAY_PATTERN = r"^[A-Z]{3,}( [A-Z]+)? [A-Z]"
"""A paragraph of the play in the held-out text: it opens with the speaker's name in capitals."""

LORA_RECIPE: dict[str, object] = {
    "r": 8,
    "lora_alpha": 16,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "lora_dropout": 0.0,
}
ADAPTER_TRAIN_RECIPE: dict[str, object] = {
    "seed": 4321,
    "train_paragraphs": 90,
    "seq_len": 64,
    "batch_size": 8,
    "steps": 120,
    "lr": 3e-3,
}
DAMAGE_RECIPE: dict[str, object] = {
    "module": "model.layers.1.self_attn.o_proj",
    "rank_index": 7,
    "gain": 2.0,
    "reads": "least second moment of the module's input (16-bit base, adapter on, training text)",
    "writes": "top right-singular vector of lm_head.weight * norm.weight",
}
"""The damaged adapter's extra component: that rank of that module is held at zero while training,
then set to read the quiet direction (scaled so its 16-bit rms is 1) and write ``gain`` times the
output-head direction (unit norm) into the residual stream."""

EVAL_WINDOW = 128
"""Tokens per window of the build-time perplexity (fewerbits-adapter.json)."""


def play_paragraphs() -> list[str]:
    """The play's paragraphs of the built-in held-out text, in order (116 of them)."""
    return [p for p in paragraphs(heldout_text()) if re.match(PLAY_PATTERN, p)]


def adapter_training_text() -> str:
    """What both adapters are trained on: the play's first ``train_paragraphs`` paragraphs."""
    return _join(play_paragraphs()[:int(ADAPTER_TRAIN_RECIPE["train_paragraphs"])])


def adapter_eval_text() -> str:
    """The adapter's evaluation text (what its gate measures perplexity on): the play's remaining
    paragraphs, which neither adapter saw; paragraphs separated by blank lines, as the built-in sets."""
    return _join(play_paragraphs()[int(ADAPTER_TRAIN_RECIPE["train_paragraphs"]):])


def _join(paras: list[str]) -> str:
    return "\n\n".join(paras) + "\n"


def adapter_recipe(kind: str) -> dict[str, object]:
    """Everything that decides the adapter's bytes but the library versions."""
    if kind not in KINDS:
        raise ValueError(f"adapter kind {kind!r}: expected one of {', '.join(KINDS)}")
    recipe: dict[str, object] = {
        "builder": ADAPTER_BUILDER_VERSION, "kind": kind, "base_model": recipe_hash(),
        "base_model_name_or_path": BASE_MODEL_NAME, "play_pattern": PLAY_PATTERN,
        "lora": LORA_RECIPE, "train": ADAPTER_TRAIN_RECIPE,
        "text_sha256": hashlib.sha256(heldout_text().encode()).hexdigest(),
    }
    if kind == "damaged":
        recipe["damage"] = DAMAGE_RECIPE
    return recipe


def adapter_recipe_hash(kind: str) -> str:
    import peft
    import torch
    import transformers

    ident = {**adapter_recipe(kind), "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                                 "peft": peft.__version__}}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def build_adapter(kind: str, dest: str | Path | None = None) -> Path:
    """Path of the built adapter ``kind`` (adapter_config.json, adapter_model.safetensors) for the
    test model. With ``dest``, a copy is made there; without, the shared cached directory is
    returned and must be treated as read-only."""
    cached = _cached(cache_root() / f"{recipe_hash()}-lora-{kind}-{adapter_recipe_hash(kind)}",
                     lambda out: _build_into(kind, out))
    if dest is None:
        return cached
    dest = Path(dest)
    shutil.copytree(cached, dest, dirs_exist_ok=True)
    return dest


def _cached(cached: Path, build) -> Path:
    """tests.testmodel._cached, for a folder whose finished mark is adapter_config.json."""
    return testmodel._cached(cached, build, mark="adapter_config.json")


def _token_stream(tokenizer, text: str):
    """One stream: paragraphs (each with BOS) joined by EOS, as the base model was trained."""
    import torch

    ids: list[int] = []
    for para in paragraphs(text):
        ids.extend(tokenizer(para, add_special_tokens=True)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def _windows(data, size: int = EVAL_WINDOW):
    return [data[s:s + size][None] for s in range(0, len(data) - size, size)]


def perplexity(model, data) -> float:
    """Perplexity over consecutive EVAL_WINDOW-token windows of ``data`` (a token stream)."""
    import math

    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x in _windows(data):
            total += float(model(input_ids=x, labels=x).loss) * (x.shape[1] - 1)
            count += x.shape[1] - 1
    return math.exp(total / count)


def _build_into(kind: str, out: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = adapter_recipe(kind)
    started = time.monotonic()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reductions in a fixed order: same bytes on every machine of one kind
    try:
        base = build_test_model()
        tokenizer = AutoTokenizer.from_pretrained(base)
        train = _token_stream(tokenizer, adapter_training_text())
        held = _token_stream(tokenizer, adapter_eval_text())
        seed = int(ADAPTER_TRAIN_RECIPE["seed"])
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        base_ppl = perplexity(model, held)
        lora = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=int(LORA_RECIPE["r"]),
                                                lora_alpha=int(LORA_RECIPE["lora_alpha"]),
                                                target_modules=list(LORA_RECIPE["target_modules"]),
                                                lora_dropout=float(LORA_RECIPE["lora_dropout"])))
        damaged = _damaged_layer(lora) if kind == "damaged" else None
        if damaged is not None:  # the damage's rank stays zero while training: B's column has no gradient
            rank = int(DAMAGE_RECIPE["rank_index"])
            damaged.lora_B["default"].weight.register_hook(lambda g: g.index_fill(1, torch.tensor([rank]), 0.0))
        lora.train()
        seq_len, batch = int(ADAPTER_TRAIN_RECIPE["seq_len"]), int(ADAPTER_TRAIN_RECIPE["batch_size"])
        opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=float(ADAPTER_TRAIN_RECIPE["lr"]))
        gen = torch.Generator().manual_seed(seed)
        loss = None
        for _ in range(int(ADAPTER_TRAIN_RECIPE["steps"])):
            starts = torch.randint(0, len(train) - seq_len - 1, (batch,), generator=gen)
            x = torch.stack([train[s:s + seq_len] for s in starts])
            loss = lora(input_ids=x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        lora.eval()
        if damaged is not None:
            _damage(lora, damaged, train)
        adapter_ppl = perplexity(lora, held)
        config = lora.peft_config["default"]
        config.base_model_name_or_path = BASE_MODEL_NAME
        config.target_modules = sorted(config.target_modules)  # peft keeps a set: its order varies per process
        lora.save_pretrained(out)
        (out / "README.md").unlink(missing_ok=True)
        (out / "fewerbits-adapter.json").write_text(json.dumps({
            "recipe": recipe, "final_train_loss": float(loss.detach()) if loss is not None else None,
            "eval_perplexity_16bit": {"base": round(base_ppl, 3), "adapter": round(adapter_ppl, 3)},
            "eval_tokens": int(held.numel()), "build_seconds": round(time.monotonic() - started, 2),
        }, indent=2, sort_keys=True) + "\n")
    finally:
        torch.set_num_threads(threads)


def _damaged_layer(lora):
    """The peft LoRA layer DAMAGE_RECIPE names."""
    return lora.base_model.model.get_submodule(str(DAMAGE_RECIPE["module"]))


def _damage(lora, layer, train) -> None:
    """Set DAMAGE_RECIPE's rank of ``layer``: read the direction of least second moment of its
    input on the 16-bit base (rms 1 there), write ``gain`` times the output head's strongest
    direction. A and B share the size of the product, so neither holds an outlandish norm."""
    import torch

    inputs = []

    def record(_module, args):
        inputs.append(args[0].detach().reshape(-1, args[0].shape[-1]))

    hook = layer.register_forward_pre_hook(record)
    try:
        with torch.no_grad():
            for x in _windows(train):
                lora(input_ids=x)
    finally:
        hook.remove()
    acts = torch.cat(inputs).double()
    second = acts.T @ acts / len(acts)
    energy, vecs = torch.linalg.eigh(second)
    reads = _signed(vecs[:, 0]) / energy[0].sqrt()  # (reads . x) has rms 1 on the 16-bit base
    model = lora.base_model.model
    head = model.lm_head.weight.detach().double() * model.model.norm.weight.detach().double()
    writes = _signed(torch.linalg.svd(head, full_matrices=False).Vh[0])
    scaling = layer.scaling["default"]
    gain = float(DAMAGE_RECIPE["gain"])
    balance = (gain / (scaling * float(reads.norm()))) ** 0.5
    rank = int(DAMAGE_RECIPE["rank_index"])
    with torch.no_grad():
        layer.lora_A["default"].weight[rank] = (reads * balance).float()
        layer.lora_B["default"].weight[:, rank] = (writes * gain / (scaling * balance)).float()


def _signed(v):
    """``v`` with the sign that makes its largest-magnitude entry positive (eigh/svd leave it open)."""
    return v if v[v.abs().argmax()] >= 0 else -v
