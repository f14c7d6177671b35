"""The tiny test model: a 2-layer Llama trained for a few seconds on the built-in English text.

Tests of the quantization Job (and, later, the operator and the runtime fetcher) need a real
checkpoint that llm-compressor can quantize on a CPU and whose perplexity means something. Nothing
may come from a model hub, so the model is built here: a byte-level BPE tokenizer trained with
`tokenizers` on the built-in calibration text (`general-en`), and a small Llama trained briefly
on the same text. Held-out perplexity is then measured on `general-en-heldout`, text the model
never saw.

    from tests.testmodel import build_test_model
    path = build_test_model()            # cached directory, build on first use (~15-30 s on 2 cores)
    path = build_test_model(tmp_path)    # a private copy in tmp_path

The build is deterministic (fixed seed, single thread, deterministic algorithms) and cached under
``${FEWERBITS_CACHE:-~/.cache/fewerbits}/testmodel/<recipe hash>/``; the hash covers everything
that decides the bytes (recipe, text, torch/transformers/tokenizers versions), so a change of any
of them builds a new one. A finished cache folder is only ever created by an atomic rename.

Shapes: hidden 256, intermediate 512, 4 heads of 64, 2 KV heads: every Linear's input width is a
multiple of 128 (group-128 int4 schemes), and every output width too (FP8 block 128x128).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from importlib import resources
from pathlib import Path

BUILDER_VERSION = 1
"""Bump when the build procedure changes in a way the recipe below does not show."""

MODEL_RECIPE: dict[str, object] = {
    "architecture": "LlamaForCausalLM",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "saved_dtype": "bfloat16",
}
TRAIN_RECIPE: dict[str, object] = {
    "seed": 1234,
    "seq_len": 64,
    "batch_size": 8,
    "steps": 160,
    "lr": 3e-3,
    "weight_decay": 0.1,
    "warmup_steps": 10,
}

CALIBRATION_DATASET = "general-en"
HELDOUT_DATASET = "general-en-heldout"


def _dataset_text(name: str) -> str:
    return resources.files("fewerbits_quantjob").joinpath("data", f"{name}.txt").read_text(encoding="utf-8")


def training_text() -> str:
    """The fixed text the model (and its tokenizer) is trained on: the built-in calibration set."""
    return _dataset_text(CALIBRATION_DATASET)


def heldout_text() -> str:
    """Text the model never saw: the built-in evaluation set."""
    return _dataset_text(HELDOUT_DATASET)


def paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def cache_root() -> Path:
    return Path(os.environ.get("FEWERBITS_CACHE") or Path.home() / ".cache" / "fewerbits") / "testmodel"


def recipe_hash() -> str:
    import tokenizers
    import torch
    import transformers

    ident = {
        "builder": BUILDER_VERSION,
        "model": MODEL_RECIPE,
        "train": TRAIN_RECIPE,
        "text_sha256": hashlib.sha256(training_text().encode()).hexdigest(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def build_test_model(dest: str | Path | None = None) -> Path:
    """Path of the built test model (config.json, model.safetensors, tokenizer files).

    With ``dest``, a copy is made there (callers that modify the directory should pass one);
    without, the shared cached directory is returned and must be treated as read-only.
    """
    cached = _cached(cache_root() / recipe_hash(), _build_into)
    if dest is None:
        return cached
    dest = Path(dest)
    shutil.copytree(cached, dest, dirs_exist_ok=True)
    return dest


def build_quantized_test_model(fmt: str) -> Path:
    """The test model quantized to ``fmt`` (a QuantFormat value) by the Job's own recipe and code,
    as the vLLM check's zoo does (tools/vllm_check/zoo_quantize.py); cached beside the model, read-only."""
    from fewerbits_api.formats import QuantFormat
    from tools.vllm_check.zoo_quantize import quantize

    src = build_test_model()
    return _cached(cache_root() / f"{src.name}-{fmt}", lambda out: quantize(src, QuantFormat(fmt), ["lm_head"], out))


def _cached(cached: Path, build, mark: str = "config.json") -> Path:
    """``cached``, built by ``build(staging)`` into a fresh folder and renamed into place when its
    ``mark`` file is missing (atomic: a half-built folder never counts; another process winning the
    race is harmless)."""
    if not (cached / mark).exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{cached.name}.tmp.", dir=cached.parent))
        try:
            build(staging)
            try:
                os.rename(staging, cached)
            except OSError:
                if not (cached / mark).exists():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return cached


def build_tokenizer():
    """A byte-level BPE tokenizer trained on the fixed text (deterministic: one pass, fixed order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=int(MODEL_RECIPE["vocab_size"]), special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(paragraphs(training_text()), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                      special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   model_max_length=int(MODEL_RECIPE["max_position_embeddings"]))


def _build_into(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    started = time.monotonic()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reductions in a fixed order: same bytes on every machine of one kind
    try:
        torch.manual_seed(int(TRAIN_RECIPE["seed"]))
        tokenizer = build_tokenizer()
        # One stream: paragraphs joined by EOS, tokenized once.
        ids: list[int] = []
        for para in paragraphs(training_text()):
            ids.extend(tokenizer(para, add_special_tokens=True)["input_ids"])
            ids.append(tokenizer.eos_token_id)
        data = torch.tensor(ids, dtype=torch.long)

        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=MODEL_RECIPE["hidden_size"],
            intermediate_size=MODEL_RECIPE["intermediate_size"], num_hidden_layers=MODEL_RECIPE["num_hidden_layers"],
            num_attention_heads=MODEL_RECIPE["num_attention_heads"],
            num_key_value_heads=MODEL_RECIPE["num_key_value_heads"],
            max_position_embeddings=MODEL_RECIPE["max_position_embeddings"],
            tie_word_embeddings=MODEL_RECIPE["tie_word_embeddings"],
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        model = LlamaForCausalLM(config)
        model.train()
        seq_len, batch = int(TRAIN_RECIPE["seq_len"]), int(TRAIN_RECIPE["batch_size"])
        steps, warmup = int(TRAIN_RECIPE["steps"]), int(TRAIN_RECIPE["warmup_steps"])
        opt = torch.optim.AdamW(model.parameters(), lr=float(TRAIN_RECIPE["lr"]),
                                weight_decay=float(TRAIN_RECIPE["weight_decay"]))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1 - s / steps))
        gen = torch.Generator().manual_seed(int(TRAIN_RECIPE["seed"]))
        loss = None
        for _ in range(steps):
            starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
            x = torch.stack([data[s:s + seq_len] for s in starts])
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
        model.eval()
        model.to(getattr(torch, str(MODEL_RECIPE["saved_dtype"])))
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        (out / "fewerbits-testmodel.json").write_text(json.dumps({
            "recipe": {"model": MODEL_RECIPE, "train": TRAIN_RECIPE, "builder": BUILDER_VERSION},
            "final_train_loss": float(loss.detach()) if loss is not None else None,
            "tokens": len(ids), "build_seconds": round(time.monotonic() - started, 2),
        }, indent=2, sort_keys=True) + "\n")
    finally:
        torch.set_num_threads(threads)
