"""Perplexity of the base and the quantized model on the SAME held-out windows.

Windows are built once, from the base model's tokenizer: the held-out samples are tokenized in
order (no special tokens), joined by EOS, and cut into non-overlapping windows of a fixed length
(BOS first when the tokenizer has one); the first ``evalSamples`` windows are scored. Both models
see exactly these token ids. Perplexity = exp(total NLL / tokens scored), accumulated in float32.

Both models run in bfloat16: NVFP4 checkpoints do not reload in float32 (checked with llm-compressor 0.14 on
the CPU), and one dtype for both keeps the comparison fair.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass
from pathlib import Path

EVAL_WINDOW_MAX = 512
"""Upper bound on the window length (tokens); also capped by calibration.maxSeqLength and the
model's max_position_embeddings."""
LOGITS_BUDGET_ELEMENTS = 2**28
"""Batch windows while their float32 logits stay under ~1 GiB."""


@dataclass
class Perplexities:
    baseline: float
    quantized: float
    windows: int
    tokens: int
    window_length: int
    ci95: tuple[float, float] | None = None
    """95% interval of the increase (percent), paired per window."""
    noise_floor_percent: float | None = None
    """Half-width of ci95."""
    seconds: float = 0.0
    """Scoring time, both models (loads excluded)."""

    @property
    def increase_percent(self) -> float:
        return (self.quantized / self.baseline - 1.0) * 100.0


def window_length(max_seq_length: int, config) -> int:
    limit = getattr(config, "max_position_embeddings", None) or EVAL_WINDOW_MAX
    return max(16, min(EVAL_WINDOW_MAX, max_seq_length, int(limit)))


def build_windows(tokenizer, texts: list[str], length: int, count: int):
    """Token windows [n, length] (n <= count). Fewer tokens than one window: one shorter window."""
    import torch

    bos = tokenizer.bos_token_id
    body = length - 1 if bos is not None else length
    need = body * count
    stream: list[int] = []
    sep = tokenizer.eos_token_id
    for text in texts:
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if sep is not None:
            stream.append(sep)
        if len(stream) >= need:
            break
    n = min(count, len(stream) // body)
    if n == 0:  # tiny evaluation set: one window of whatever there is
        body, n = len(stream), 1
    chunks = [stream[i * body:(i + 1) * body] for i in range(n)]
    if bos is not None:
        chunks = [[bos] + c for c in chunks]
    return torch.tensor(chunks, dtype=torch.long)


def _eval_device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_bf16(path: Path, trust_remote_code: bool):
    import torch

    from .quantize import model_class

    kwargs: dict[str, object] = {"dtype": torch.bfloat16, "trust_remote_code": trust_remote_code}
    if _eval_device() == "cuda":
        kwargs["device_map"] = "auto"  # large models shard across the visible GPUs
    model = model_class(path, trust_remote_code).from_pretrained(path, **kwargs)
    model.eval()
    return model


def perplexity(model, windows, on_batch=None) -> tuple[float, int]:
    """(perplexity, tokens scored) of ``model`` on ``windows``."""
    nlls, tokens = window_nlls(model, windows, on_batch)
    return math.exp(sum(nlls) / max(sum(tokens), 1)), sum(tokens)


def window_nlls(model, windows, on_batch=None) -> tuple[list[float], list[int]]:
    """Summed negative log-likelihood and tokens scored, per window (for the noise floor)."""
    import torch

    vocab = int(getattr(model.config, "vocab_size", 32000) or 32000)
    per_window = windows.shape[1] * vocab
    batch = max(1, min(len(windows), LOGITS_BUDGET_ELEMENTS // max(per_window, 1)))
    device = next(model.parameters()).device
    nlls: list[float] = []
    tokens: list[int] = []
    with torch.inference_mode():
        for start in range(0, len(windows), batch):
            ids = windows[start:start + batch].to(device)
            logits = model(input_ids=ids).logits[:, :-1, :].float()
            targets = ids[:, 1:]
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none").sum(dim=1)
            nlls.extend(float(x) for x in nll)
            tokens.extend([int(targets.shape[1])] * int(targets.shape[0]))
            if on_batch:
                on_batch(min(start + batch, len(windows)), len(windows))
    return nlls, tokens


def paired_increase_interval(base_nlls: list[float], quant_nlls: list[float], tokens: list[int]) -> tuple[float, float, float]:
    """95% interval (low, high) and half-width, in percent, of the perplexity increase, from the
    per-window difference of mean NLL per token (both models see the same windows, so the
    difference is paired: window difficulty cancels). One window: no spread, (inc, inc, 0)."""
    diffs = [(q - b) / max(t, 1) for b, q, t in zip(base_nlls, quant_nlls, tokens)]
    n = len(diffs)
    total = sum(tokens)
    mean = (sum(quant_nlls) - sum(base_nlls)) / max(total, 1)
    if n < 2:
        inc = (math.exp(mean) - 1) * 100
        return inc, inc, 0.0
    m = sum(diffs) / n
    sd = math.sqrt(sum((d - m) ** 2 for d in diffs) / (n - 1))
    half = 1.96 * sd / math.sqrt(n)
    low, high = (math.exp(mean - half) - 1) * 100, (math.exp(mean + half) - 1) * 100
    return low, high, (high - low) / 2


def _free(model) -> None:
    import torch

    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def evaluate_pair(base: Path, quantized: Path, tokenizer, texts: list[str], max_seq_length: int, count: int,
                  trust_remote_code: bool, on_progress=None, with_model=None) -> Perplexities:
    """Baseline and quantized perplexity on the same windows (one model in memory at a time).

    ``with_model(which, model)``, when given, runs on each loaded model before it is freed
    (``which`` is "base", then "quantized"): the benchmark and custom evaluations reuse the load."""
    model = load_bf16(base, trust_remote_code)
    length = window_length(max_seq_length, model.config)
    windows = build_windows(tokenizer, texts, length, count)
    t0 = time.monotonic()
    base_nlls, tokens = window_nlls(model, windows, (lambda d, n: on_progress(0.5 * d / n)) if on_progress else None)
    seconds = time.monotonic() - t0
    if with_model:
        with_model("base", model)
    _free(model)
    model = load_bf16(quantized, trust_remote_code)
    t0 = time.monotonic()
    q_nlls, q_tokens = window_nlls(model, windows, (lambda d, n: on_progress(0.5 + 0.5 * d / n)) if on_progress else None)
    seconds += time.monotonic() - t0
    if with_model:
        with_model("quantized", model)
    _free(model)
    assert q_tokens == tokens
    total = max(sum(tokens), 1)
    low, high, half = paired_increase_interval(base_nlls, q_nlls, tokens)
    return Perplexities(baseline=math.exp(sum(base_nlls) / total), quantized=math.exp(sum(q_nlls) / total),
                        windows=len(windows), tokens=sum(tokens), window_length=int(windows.shape[1]),
                        ci95=(low, high), noise_floor_percent=half, seconds=seconds)
