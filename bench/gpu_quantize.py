"""Quantize a Llama-shaped model of real width in every format with the Job's own code, on a GPU.

The model is made on the machine (random weights, no Hub): hidden 4096, intermediate 14336,
32 heads of 128 with 8 KV heads, vocabulary 32000 (Llama-3-8B/Mistral-7B widths), a few layers.
For each format it runs what the quantization Job runs (``fewerbits_quantjob.recipes`` and
``fewerbits_quantjob.quantize``: llm-compressor's ``oneshot``, the built-in calibration text for
formats that need it) and records the wall time, the peak accelerator memory (CUDA's
``max_memory_allocated``; on ``--device cpu`` the process's peak RSS instead), the checkpoint's
size, and whether the saved checkpoint reloads with transformers and gives finite logits.

On a GPU, AWQ runs without the Job's CPU guard (the guard only patches llm-compressor when no
accelerator is present). ``--device cpu`` runs the same code on the CPU, at the tiny size unless
told otherwise; CI runs it so (tests/unit/test_bench_gpu_quantize.py).

    python bench/gpu_quantize.py                          # GPU, real width, 2 layers, all formats
    python bench/gpu_quantize.py --layers 4 --formats fp8-dynamic,w4a16-awq --json out.json
    python bench/gpu_quantize.py --device cpu --tiny      # CPU, hidden 256
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REAL = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 32000}
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 512}


def make_model(out: Path, shape: dict, layers: int, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.testmodel import build_tokenizer

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    config = LlamaConfig(**shape, num_hidden_layers=layers, max_position_embeddings=4096, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def peak_reset(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_bytes(device: str) -> int:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def reload_ok(path: Path, device: str) -> tuple[bool, str]:
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([[1, 5, 9, 42]], device=device)).logits
        ok = bool(torch.isfinite(logits).all())
        del model
        return ok, "" if ok else "non-finite logits"
    except Exception as e:  # noqa: BLE001 — the error is the result
        return False, f"{type(e).__name__}: {str(e)[:300]}"


def run_format(src: Path, fmt, device: str, workdir: Path, samples: int, seq_len: int,
               texts: list[str] | None = None) -> dict:
    """``texts``: the calibration samples (default: the first ``samples`` built-in paragraphs)."""
    import torch
    from fewerbits_quantjob import quantize as qj
    from fewerbits_quantjob import recipes

    from tests.testmodel import paragraphs, training_text

    out = workdir / fmt.value
    peak_reset(device)
    started = time.monotonic()
    row: dict = {"format": fmt.value}
    try:
        model, tokenizer = qj.load_for_quantization(src, trust_remote_code=False)
        specs = recipes.build_recipe_spec(fmt, ["lm_head"])
        if not recipes.needs_calibration_data(fmt):
            texts = None
        elif texts is None:
            texts = paragraphs(training_text())[:samples]
        qj.run_oneshot(model, tokenizer, fmt, specs, texts, seq_len)
        qj.save_checkpoint(model, tokenizer, src, out)
        qj.release(model)
    except Exception as e:  # noqa: BLE001 — recorded, the other formats still run
        return row | {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}",
                      "seconds": round(time.monotonic() - started, 2)}
    row["seconds"] = round(time.monotonic() - started, 2)
    row["peak_memory_bytes"] = peak_bytes(device)
    row["peak_memory_kind"] = "cuda max_memory_allocated" if device == "cuda" else "process peak RSS"
    row["checkpoint_bytes"] = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    row["awq_cpu_guard"] = fmt.value == "w4a16-awq" and not qj.accelerator_available()
    ok, why = reload_ok(out, device)
    row["reloads"] = ok
    row["ok"] = ok
    if why:
        row["error"] = why
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    from fewerbits_api.formats import CONCRETE_FORMATS, QuantFormat

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="hidden 256 instead of 4096 (the default on --device cpu)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--formats", default="", help="comma-separated (default: every quantized format)")
    ap.add_argument("--samples", type=int, default=32, help="calibration samples")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu", file=sys.stderr)
        return 2
    formats = ([QuantFormat(f) for f in args.formats.split(",") if f]
               or [f for f in CONCRETE_FORMATS if f is not QuantFormat.NONE])
    shape = TINY if (args.tiny or args.device == "cpu") else REAL
    work = Path(tempfile.mkdtemp(prefix="gpu-quantize-"))
    try:
        t = time.monotonic()
        src = make_model(work / "base", shape, args.layers)
        made = round(time.monotonic() - t, 2)
        rows = []
        for fmt in formats:
            row = run_format(src, fmt, args.device, work, args.samples, args.seq_len)
            rows.append(row)
            print(json.dumps(row), flush=True)
            shutil.rmtree(work / fmt.value, ignore_errors=True)
        result = {"device": args.device,
                  "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
                  "shape": shape | {"num_hidden_layers": args.layers}, "model_seconds": made, "rows": rows}
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return 0 if all(r["ok"] for r in rows) else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
