"""Wall time and peak host memory (RSS) of the quantization Job's stages, per model size and format:
the figures the Job sizing (operator/fewerbits_operator/planner/jobsize.py) is fitted to.

Each run is a fresh child process that does what the Job's `_quantize_and_evaluate` does, with the
Job's own functions: load the bf16 model on the CPU (``quantize.load_for_quantization``), run
llm-compressor's ``oneshot`` (``quantize.run_oneshot``, the built-in calibration text for formats
that need it), save the compressed checkpoint, release the model, then evaluate base and
quantized perplexity one model at a time (``evaluate.evaluate_pair``). The child's peak RSS is
``ru_maxrss`` of that process alone; the parent records it with the model's bf16 size, so a line
``peak = base + k × bf16 bytes`` can be fitted across sizes. Fetch and upload are left out: they
stream files (bounded memory) and their time is the network's.

Models are Llama-shaped with random weights, made on the machine (no Hub). The default widths
(hidden 2048, intermediate 5632, 32000 vocabulary: TinyLlama's) at 2, 8 and 16 layers give bf16
sizes of about 0.4, 1.0 and 1.7 GB: large enough that the weights, not the interpreter, decide the
peak; small enough for a 2-core, 24 GiB machine.

    python bench/job_footprint.py --layers 2,8,16 --formats fp8-dynamic,w4a16-gptq --json out.json
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WIDTH = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32, "num_key_value_heads": 4,
         "vocab_size": 32000}


class MemorySampler:
    """Peak anonymous and file-backed resident memory of this process (/proc/self/status RssAnon,
    RssFile), sampled every 20 ms: ``ru_maxrss`` counts the safetensors pages transformers maps
    from disk, which are file-backed and reclaimable; a cgroup memory limit has to hold the
    anonymous part (the tensors the Job builds)."""

    def __init__(self) -> None:
        import threading

        self.peak = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.sample()

    def sample(self) -> None:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in self.peak:
                self.peak[key] = max(self.peak[key], int(value.split()[0]) * 1024)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        self.sample()
        return dict(self.peak)


def child(src: Path, fmt_name: str, samples: int, seq_len: int, eval_samples: int, out: Path) -> dict:
    from fewerbits_api.formats import QuantFormat
    from fewerbits_quantjob import evaluate, quantize, recipes

    from tests.testmodel import heldout_text, paragraphs, training_text

    fmt = QuantFormat(fmt_name)
    sampler = MemorySampler()
    timings: dict[str, float] = {}
    t = time.monotonic()
    model, tokenizer = quantize.load_for_quantization(src, trust_remote_code=False)
    timings["load"] = time.monotonic() - t
    t = time.monotonic()
    specs = recipes.build_recipe_spec(fmt, ["lm_head"])
    texts = paragraphs(training_text())[:samples] if recipes.needs_calibration_data(fmt) else None
    model = quantize.run_oneshot(model, tokenizer, fmt, specs, texts, seq_len) or model
    timings["quantize"] = time.monotonic() - t
    t = time.monotonic()
    quantize.save_checkpoint(model, tokenizer, src, out)
    quantize.release(model)
    del model
    timings["save"] = time.monotonic() - t
    rss_after_quantize = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    anon_after_quantize = sampler.peak["RssAnon"]
    t = time.monotonic()
    ppl = evaluate.evaluate_pair(src, out, tokenizer, paragraphs(heldout_text()), seq_len, eval_samples, False)
    timings["evaluate"] = time.monotonic() - t
    return {"timings": {k: round(v, 2) for k, v in timings.items()},
            "peak_rss_quantize_bytes": rss_after_quantize,
            "peak_anon_quantize_bytes": anon_after_quantize,
            "peak_sampled": sampler.stop(),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "checkpoint_bytes": sum(p.stat().st_size for p in out.glob("*.safetensors")),
            "perplexity": [round(ppl.baseline, 3), round(ppl.quantized, 3)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="2,8,16")
    ap.add_argument("--formats", default="fp8-dynamic,w4a16-gptq")
    ap.add_argument("--samples", type=int, default=32, help="calibration samples")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=8)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--child", nargs=3, metavar=("SRC", "FORMAT", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        src, fmt, out = args.child
        print(json.dumps(child(Path(src), fmt, args.samples, args.seq_len, args.eval_samples, Path(out))))
        return 0

    from bench.gpu_quantize import make_model

    work = Path(tempfile.mkdtemp(prefix="job-footprint-"))
    rows = []
    try:
        for layers in [int(x) for x in args.layers.split(",")]:
            src = make_model(work / f"base-{layers}", WIDTH, layers)
            bf16 = sum(p.stat().st_size for p in src.glob("*.safetensors"))
            import json as _j
            cfg = _j.loads((src / "config.json").read_text())
            for fmt in args.formats.split(","):
                out = work / f"q-{layers}-{fmt}"
                t = time.monotonic()
                proc = subprocess.run(
                    [sys.executable, __file__, "--child", str(src), fmt, str(out), "--samples", str(args.samples),
                     "--seq-len", str(args.seq_len), "--eval-samples", str(args.eval_samples)],
                    capture_output=True, text=True)
                wall = time.monotonic() - t
                if proc.returncode != 0:
                    row = {"layers": layers, "format": fmt, "ok": False, "error": proc.stderr[-800:]}
                else:
                    row = {"layers": layers, "format": fmt, "ok": True, "bf16_bytes": bf16,
                           "hidden_size": cfg["hidden_size"], "wall_seconds": round(wall, 2),
                           **json.loads(proc.stdout.strip().splitlines()[-1])}
                rows.append(row)
                print(json.dumps(row), flush=True)
                shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(src, ignore_errors=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"width": WIDTH, "samples": args.samples, "seq_len": args.seq_len,
                                                   "eval_samples": args.eval_samples, "rows": rows}, indent=2) + "\n")
        return 0 if all(r["ok"] for r in rows) else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
