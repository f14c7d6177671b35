"""Run llm-compressor's ``oneshot`` on the base model and save a compressed-tensors checkpoint."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fewerbits_api.formats import QuantFormat

from . import recipes
from .report import Progress

# Files save_pretrained writes itself, or that describe the base weights and must not be carried over.
_NOT_CARRIED = {"config.json", "model.safetensors.index.json", "generation_config.json"}
_CARRIED_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken", ".py")


def accelerator_available() -> bool:
    import torch

    return bool(torch.accelerator.is_available())


@contextmanager
def cpu_awq_pin_memory_guard(fmt: QuantFormat, progress: Progress | None = None) -> Iterator[bool]:
    """Let AWQ run on a machine without an accelerator (llm-compressor 0.14.0.1).

    ``AWQModifier._apply_smoothing`` calls ``IntermediatesCache.pin_memory`` for every batch, which
    calls ``Tensor.pin_memory()`` unconditionally; with no accelerator torch raises ("Found no NVIDIA
    driver on your system" with the CUDA wheel, "Cannot access accelerator device when none is
    available" with others). Pinning only speeds host-to-device copies, so with no device there is
    nothing to speed up and skipping it changes no result.

    Scope, deliberately narrow: only for AWQ, only when ``torch.accelerator.is_available()`` is
    False, only for the duration of the ``oneshot`` call, restored afterwards. On a GPU node nothing
    is patched. Upstream fix worth proposing: pin only when an accelerator is available, as
    ``llmcompressor/datasets/utils.py`` already does for the calibration DataLoader
    (``pin_memory = torch.accelerator.is_available() and num_workers > 0``).
    """
    if fmt is not QuantFormat.W4A16_AWQ or accelerator_available():
        yield False
        return
    from llmcompressor.pipelines.cache import IntermediatesCache

    original = IntermediatesCache.__dict__["pin_memory"]

    def pin_memory_without_accelerator(self, batch_index, input_names=None):  # noqa: ARG001 — same signature
        return None

    IntermediatesCache.pin_memory = pin_memory_without_accelerator
    if progress:
        progress.note("no accelerator: AWQ runs with IntermediatesCache.pin_memory disabled (llm-compressor 0.14 pins "
                      "unconditionally; pinning only speeds host-to-device copies)")
    try:
        yield True
    finally:
        IntermediatesCache.pin_memory = original


def model_class(source: Path, trust_remote_code: bool):
    """The transformers auto class that loads ``source`` whole: ``AutoModelForCausalLM``, or for a
    vision-language model it does not map (transformers 5.17: qwen2_vl, qwen2_5_vl, llava)
    ``AutoModelForImageTextToText``, whose classes are the layout vLLM loads (the vision encoder
    stays in the checkpoint, 16-bit by the architecture's ignore rules). The operator plans no
    quantized format for qwen2_vl and qwen2_5_vl (``fewerbits_api.architectures.QUANTIZE_BLOCKERS``:
    this class cannot reload their quantized checkpoint for the evaluation); scripts/vllm-check.sh
    quantizes its zoo's Qwen2.5-VL through these functions directly."""
    import json

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    config = json.loads((Path(source) / "config.json").read_text())
    model_type = config.get("model_type", "")
    if trust_remote_code and "AutoModelForCausalLM" in (config.get("auto_map") or {}):
        return AutoModelForCausalLM
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_for_quantization(source: Path, trust_remote_code: bool):
    """The base model and its tokenizer, as llm-compressor wants them: dtype from the checkpoint, on
    the CPU (oneshot's pipelines move one layer at a time to the accelerator)."""
    from transformers import AutoTokenizer

    model = model_class(source, trust_remote_code).from_pretrained(source, dtype="auto",
                                                                   trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    return model, tokenizer


@dataclass(frozen=True)
class CalibrationSamples:
    """The calibration samples as llm-compressor gets them, and what they amount to."""

    texts: list[str]
    input_ids: list[list[int]]
    """Each sample tokenized and cut at the sequence length: what oneshot calibrates on."""
    chat_template: bool

    @property
    def count(self) -> int:
        return len(self.input_ids)

    @property
    def tokens(self) -> int:
        return sum(len(i) for i in self.input_ids)


def calibration_samples(loaded, tokenizer, max_seq_length: int) -> CalibrationSamples:
    """Chat rows rendered with the model's chat template when it has one (as llm-compressor's own
    examples prepare ultrachat), plain text otherwise. Tokenized here, as those examples do: a
    rendered template already holds the BOS, so no special tokens are added to it (oneshot's own
    tokenizer call would add a second)."""
    chat = loaded.conversations is not None and bool(getattr(tokenizer, "chat_template", None))
    texts = ([tokenizer.apply_chat_template(c, tokenize=False) for c in loaded.conversations] if chat
             else list(loaded.texts))
    ids = tokenizer(texts, add_special_tokens=not chat, truncation=True, max_length=max_seq_length)["input_ids"]
    return CalibrationSamples(texts=texts, input_ids=[list(i) for i in ids], chat_template=chat)


def run_oneshot(model, tokenizer, fmt: QuantFormat, specs: list[recipes.ModifierSpec],
                texts: list[str] | CalibrationSamples | None, max_seq_length: int | None,
                progress: Progress | None = None):
    """Quantize ``model`` in place. ``texts``: calibration samples (text, or ``calibration_samples``
    already tokenized), or None for data-free formats."""
    from llmcompressor import oneshot

    kwargs: dict[str, object] = {}
    if texts is not None:
        from datasets import Dataset

        data = (Dataset.from_dict({"input_ids": texts.input_ids,
                                   "attention_mask": [[1] * len(i) for i in texts.input_ids]})
                if isinstance(texts, CalibrationSamples) else Dataset.from_dict({"text": list(texts)}))
        kwargs.update(dataset=data, num_calibration_samples=len(data),
                      max_seq_length=max_seq_length,
                      # The key promises the same bytes for the same inputs: no random sample order.
                      shuffle_calibration_samples=False)
    modifiers = recipes.instantiate(recipes.for_model(specs, getattr(model.config, "model_type", None)))
    with cpu_awq_pin_memory_guard(fmt, progress):
        return oneshot(model=model, processor=tokenizer, recipe=modifiers, **kwargs)


def release(model) -> None:
    """Drop every reference llm-compressor keeps to the quantized model, so evaluation can load
    the base and the saved checkpoint into the memory it occupied (a 70B model is 140 GB)."""
    import gc

    import torch
    from llmcompressor.core import reset_session

    reset_session()
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


PUBLISHED_LAYOUT: dict[str, tuple[tuple[str, str], ...]] = {
    # transformers 5.17 saves Gemma-3's SigLIP tower as vision_tower.*; the published checkpoints
    # and vLLM's Gemma3ForConditionalGeneration (its hf_to_vllm_mapper keeps the name) load
    # vision_tower.vision_model.* (found by scripts/vllm-check.sh, tools/vllm_check/NOTES.md).
    "gemma3": (("vision_tower.", "vision_tower.vision_model."),
               ("model.vision_tower.", "model.vision_tower.vision_model.")),
}
PUBLISHED_IGNORE: dict[str, tuple[str, ...]] = {
    # The tower under every spelling (transformers' module names when the Job's evaluation
    # reloads the checkpoint are model.vision_tower.*, vLLM's vision_tower.vision_model.*).
    "gemma3": (r"re:.*vision_tower\..*",),
}
"""model_type -> tensor-name prefix renames that give a saved checkpoint the published layout."""


def renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """``name`` with the first matching prefix renamed (a name already in the new layout stays)."""
    for old, new in renames:
        if name.startswith(new):
            return name
        if name.startswith(old):
            return new + name[len(old):]
    return name


def publish_layout(out: Path) -> list[str]:
    """Give the saved checkpoint in ``out`` the published tensor names of its architecture
    (``PUBLISHED_LAYOUT``): every safetensors file, the index's weight map, and the names in
    ``quantization_config.ignore`` (which vLLM matches against its own module names: the
    published names are added beside transformers'). Returns the files rewritten."""
    import json

    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    renames = PUBLISHED_LAYOUT.get(config.get("model_type", ""))
    if not renames:
        return []
    from safetensors import safe_open
    from safetensors.torch import save_file

    changed = []
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            metadata = st.metadata() or {"format": "pt"}
            names = list(st.keys())
            if all(renamed(n, renames) == n for n in names):
                continue
            tensors = {renamed(n, renames): st.get_tensor(n) for n in names}
        save_file(tensors, f, metadata=metadata)
        changed.append(f.name)
    index = out / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        doc["weight_map"] = {renamed(k, renames): v for k, v in doc.get("weight_map", {}).items()}
        index.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    qc = config.get("quantization_config") or {}
    if isinstance(qc.get("ignore"), list):
        # Both spellings: vLLM matches its module names (the published ones), transformers its
        # own when the Job's evaluation reloads the checkpoint; an ignore entry naming no module
        # is ignored by both.
        published = [renamed(i, renames) for i in qc["ignore"] if not i.startswith("re:")]
        qc["ignore"] = list(dict.fromkeys([*qc["ignore"], *published,
                                           *PUBLISHED_IGNORE.get(config.get("model_type", ""), ())]))
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return changed


def save_checkpoint(model, tokenizer, source: Path, out: Path) -> None:
    """Save compressed-tensors weights, config (with quantization_config) and tokenizer in the
    published tensor layout of the architecture (``publish_layout``), and carry over the base
    model's other small files (chat template, tokenizer extras)."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, save_compressed=True)
    publish_layout(out)
    tokenizer.save_pretrained(out)
    for p in sorted(source.iterdir()):
        if (p.is_file() and p.suffix in _CARRIED_SUFFIXES and p.name not in _NOT_CARRIED
                and not p.name.startswith(".") and not (out / p.name).exists()):
            shutil.copy2(p, out / p.name)
