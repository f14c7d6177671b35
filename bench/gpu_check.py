"""One GPU command: every format at real width, the default calibration size, and the Job's host
footprint, in under 8 minutes on one H100 or H200, written to one JSON (issue 31).

Built on ``bench/gpu_quantize.py``'s functions (the Job's own ``load_for_quantization``,
``run_oneshot``, ``save_checkpoint`` on a Llama with random weights made on the machine) and
``bench/job_footprint.py`` (a child process per run, its peak RSS). Each row carries the
planner's prediction for it (``planner/jobsize.py``: ``calibration_gpu_bytes`` and
``calibration_seconds_per_layer``) and the ratio, so the JSON says at once whether the Job's sizing
still holds; docs/jobs.md shows the latest figures with the GPU and the date.

Runs, in this order (the 8-minute budget in brackets, measured on one H200 in issue 31):
1. ``small``: every quantized format at Llama-3-8B width, 4 layers, 32 samples × 256 tokens (~50 s);
2. ``default-8b``: w4a16-gptq, w4a16-awq, w8a8-int8, nvfp4 at 8B width, 4 layers, 512 × 2048 (~160 s);
3. ``default-70b``: w4a16-awq, w4a16-gptq, w8a8-int8 at Llama-3-70B width, 2 layers, 512 × 2048 (~190 s);
4. ``footprint``: job_footprint.py's fp8-dynamic and w4a16-gptq at hidden 2048, 2 layers (~40 s).
A run that would start after ``--budget-seconds`` is recorded as skipped, not run.

    python bench/gpu_check.py --json bench/results/gpu-check.json     # on the GPU machine
    python bench/gpu_check.py --dry-run                               # the runs it would make, no torch
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

WIDTHS = {
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
           "vocab_size": 32000},
    "70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
            "vocab_size": 32000},
    "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 512},
}
DEFAULT_SAMPLES, DEFAULT_SEQ_LEN = 512, 2048
"""The API's default calibration size (CalibrationSpec)."""
BUDGET_SECONDS = 480


@dataclass(frozen=True)
class Run:
    group: str
    width: str
    layers: int
    formats: tuple[str, ...]
    samples: int
    seq_len: int


def planned_runs(formats: tuple[str, ...], tiny: bool, samples: int, seq_len: int) -> list[Run]:
    """The runs in order. ``tiny``: hidden 256 everywhere (the CPU check), at the sizes given."""
    calibrating = ("w4a16-gptq", "w4a16-awq", "w8a8-int8", "nvfp4")
    big = ("w4a16-awq", "w4a16-gptq", "w8a8-int8")
    w8, w70 = ("tiny", "tiny") if tiny else ("8b", "70b")

    def only(names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(f for f in names if f in formats)

    runs = [Run("small", w8, 4, formats, 32, 256),
            Run("default-8b", w8, 4, only(calibrating), samples, seq_len),
            Run("default-70b", w70, 2, only(big), samples, seq_len)]
    return [r for r in runs if r.formats]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from fewerbits_api.formats import QUANTIZED_FORMATS

    known = [f.value for f in QUANTIZED_FORMATS]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--formats", default=",".join(known), help="comma-separated (default: every quantized format)")
    ap.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="calibration samples of the default runs")
    ap.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help="tokens per sample of the default runs")
    ap.add_argument("--budget-seconds", type=float, default=BUDGET_SECONDS,
                    help="start no run after this many seconds (recorded as skipped)")
    ap.add_argument("--no-footprint", action="store_true", help="leave out job_footprint.py's host-memory runs")
    ap.add_argument("--dry-run", action="store_true", help="print the runs as JSON and exit (no torch needed)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    args.format_list = tuple(f for f in args.formats.split(",") if f)
    unknown = [f for f in args.format_list if f not in known]
    if unknown:
        ap.error(f"--formats: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    if args.samples < 1 or args.seq_len < 16:
        ap.error("--samples must be at least 1 and --seq-len at least 16")
    # On the CPU only the tiny width is sensible: the same code paths, minutes not hours.
    args.tiny = args.device == "cpu"
    return args


def calibration_texts(tokenizer, samples: int, seq_len: int) -> list[str]:
    """``samples`` distinct texts of at least ``seq_len`` tokens each (the built-in paragraphs,
    rotated per sample and repeated until long enough), so every sample fills its length."""
    from tests.testmodel import paragraphs, training_text

    paras = paragraphs(training_text())
    lengths = [len(tokenizer(p)["input_ids"]) for p in paras]
    texts = []
    for i in range(samples):
        parts: list[str] = []
        n, k = 0, i
        while n < seq_len:
            parts.append(paras[k % len(paras)])
            n += lengths[k % len(paras)]
            k += 1
        texts.append("\n\n".join(parts))
    return texts


def predicted(width: str, layers: int, fmt_name: str, samples: int, seq_len: int, tflops: float | None) -> dict:
    """The planner's figures for one row (the model of planner/jobsize.py)."""
    from fewerbits_api.formats import FORMAT_FACTS, QuantFormat
    from fewerbits_operator.planner.jobsize import calibration_gpu_bytes, calibration_seconds_per_layer
    from fewerbits_operator.planner.shape import shape_from_config

    shape = shape_from_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama", **WIDTHS[width],
                               "num_hidden_layers": layers, "max_position_embeddings": 4096,
                               "tie_word_embeddings": False, "torch_dtype": "bfloat16"})
    fmt = QuantFormat(fmt_name)
    out = {"gpu_need_gib": round(calibration_gpu_bytes(shape, fmt, samples, seq_len) / 2**30, 2),
           "whole_model_gib": round(shape.total_params * 2 / 2**30, 2)}
    if tflops and FORMAT_FACTS[fmt].needs_calibration_data:
        out["seconds_per_layer"] = round(calibration_seconds_per_layer(shape, fmt, samples * seq_len, tflops), 1)
    return out


def _gpu_facts(device: str) -> dict:
    import torch

    facts = {"device": device, "torch": torch.__version__}
    for mod in ("llmcompressor", "transformers", "compressed_tensors"):
        try:
            facts[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 — recorded as unknown
            facts[mod] = None
    if device == "cuda":
        from fewerbits_operator.planner.catalog import lookup_product

        name = torch.cuda.get_device_name(0)
        facts["gpu"] = name
        spec = lookup_product(name.replace(" ", "-"))
        facts["bf16_tflops"] = spec.bf16_tflops if spec else None
    return facts


def run_group(run: Run, device: str, work: Path, tflops: float | None, deadline: float) -> list[dict]:
    import shutil

    from gpu_quantize import make_model, run_format

    from fewerbits_api.formats import QuantFormat

    rows: list[dict] = []
    src = make_model(work / f"{run.group}-base", WIDTHS[run.width], run.layers)
    texts = None
    if run.samples * run.seq_len > 32 * 256:
        from transformers import AutoTokenizer

        texts = calibration_texts(AutoTokenizer.from_pretrained(src), run.samples, run.seq_len)
    for name in run.formats:
        base = {"group": run.group, "width": run.width, "layers": run.layers, "samples": run.samples,
                "seq_len": run.seq_len}
        if time.monotonic() > deadline:
            rows.append(base | {"format": name, "skipped": "budget"})
            continue
        row = run_format(src, QuantFormat(name), device, work, run.samples, run.seq_len, texts)
        row |= base
        pred = predicted(run.width, run.layers, name, run.samples, run.seq_len, tflops)
        row["predicted"] = pred
        if row.get("peak_memory_bytes") and device == "cuda":
            row["peak_gib"] = round(row["peak_memory_bytes"] / 2**30, 2)
            row["peak_over_need"] = round(row["peak_gib"] / pred["gpu_need_gib"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
        shutil.rmtree(work / name, ignore_errors=True)
    return rows


def footprint(deadline: float) -> dict:
    if time.monotonic() > deadline:
        return {"skipped": "budget"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "footprint.json"
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "job_footprint.py"), "--layers", "2",
                               "--formats", "fp8-dynamic,w4a16-gptq", "--json", str(out)],
                              capture_output=True, text=True, timeout=max(60, deadline - time.monotonic() + 60))
        if proc.returncode != 0 or not out.exists():
            return {"error": proc.stderr[-2000:]}
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = planned_runs(args.format_list, args.tiny, args.samples, args.seq_len)
    if args.dry_run:
        print(json.dumps({"runs": [asdict(r) for r in runs], "footprint": not args.no_footprint,
                          "budget_seconds": args.budget_seconds}, indent=2))
        return 0
    import shutil

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu", file=sys.stderr)
        return 2
    started = time.monotonic()
    deadline = started + args.budget_seconds
    facts = _gpu_facts(args.device)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        rows: list[dict] = []
        for run in runs:
            rows += run_group(run, args.device, work, facts.get("bf16_tflops"), deadline)
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True, exist_ok=True)
        result = facts | {"date": time.strftime("%Y-%m-%d", time.gmtime()), "command": " ".join(sys.argv),
                          "rows": rows, "footprint": None if args.no_footprint else footprint(deadline),
                          "seconds": round(time.monotonic() - started, 1)}
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return 0 if all(r.get("ok") or r.get("skipped") for r in rows) else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
