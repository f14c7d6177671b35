"""Quantize every zoo architecture in every format the planner could choose for it, with the Job's
own code, and list what the vLLM load check must load.

Runs in the project's environment (llm-compressor, transformers); the load check itself runs in
vLLM's (tools/vllm_check/load_check.py). For each zoo model and each concrete format:

* the planner is asked for that format on one pool of each GPU family (T4, A100, L4, H100, B200);
  if it refuses on all of them the row is ``refused`` with the planner's reason;
* otherwise the artifact is made as the Job makes it: ``recipes.build_recipe_spec`` with the
  effective ignore list (user ``[lm_head]`` + the architecture table), ``quantize.run_oneshot``
  (llm-compressor, AWQ under the Job's CPU guard), ``quantize.save_checkpoint``; a source served
  as-is (``servedAsIs``) is its own artifact; ``none`` is the base checkpoint;
* an artifact that llm-compressor cannot make is ``fails`` with its error.

Artifacts are cached under ``${FEWERBITS_CACHE:-~/.cache/fewerbits}/vllm-check/artifacts/`` keyed by
the zoo model's hash, the format, the ignore list and this file's recipe version.

    python -m tools.vllm_check.zoo_quantize --out rows.json [--only llama,mixtral] [--formats fp8-dynamic]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ARTIFACT_VERSION = 5
FAMILY_POOLS = (("Tesla-T4", 1), ("NVIDIA-A100-SXM4-80GB", 1), ("NVIDIA-L4", 1), ("NVIDIA-H100-80GB-HBM3", 1),
                ("NVIDIA-B200", 1))
CALIBRATION_SAMPLES = 8
MAX_SEQ_LEN = 64


def cache_root() -> Path:
    return Path(os.environ.get("FEWERBITS_CACHE") or Path.home() / ".cache" / "fewerbits") / "vllm-check" / "artifacts"


def planner_verdict(config: dict, fmt) -> tuple[bool, bool, str]:
    """(planned somewhere, served as-is, reason when refused everywhere)."""
    from fewerbits_operator.planner import PlanRequest, plan_pool, pool_from_product
    from fewerbits_operator.planner.shape import shape_from_config
    from fewerbits_api.quantizedmodel import PlanVariant

    shape = shape_from_config(config)
    reasons = []
    for gpu in FAMILY_POOLS:
        out = plan_pool(shape, pool_from_product(*gpu), PlanRequest(format=fmt))
        if isinstance(out, PlanVariant):
            return True, out.servedAsIs, ""
        reasons.append(f"{gpu[0]}: {out.reason}")
    # The reason most pools give (a T4's float16 refusal of Gemma is not the one to read).
    tails = [r.split(": ", 1)[1] for r in reasons]
    common = max(set(tails), key=tails.count)
    others = len(tails) - tails.count(common)
    return False, False, common + (f" (and {others} pool(s) refused for other reasons)" if others else "")


def quantize(src: Path, fmt, ignore: list[str], out: Path) -> None:
    from fewerbits_quantjob import quantize as qj
    from fewerbits_quantjob import recipes

    from tests.testmodel import paragraphs, training_text

    model, tokenizer = qj.load_for_quantization(src, trust_remote_code=False)
    # Calibration only changes values, never the tensors' names, shapes or dtypes the load check
    # judges: AWQ searches 4 grid points instead of 20 (AWQModifier's n_grid; the Job keeps
    # llm-compressor's default) to keep the whole zoo within minutes on a CPU.
    specs = [recipes.ModifierSpec(s.kind, {**s.kwargs, "n_grid": 4}) if s.kind == "AWQModifier" else s
             for s in recipes.build_recipe_spec(fmt, ignore)]
    texts = paragraphs(training_text())[:CALIBRATION_SAMPLES] if recipes.needs_calibration_data(fmt) else None
    qj.run_oneshot(model, tokenizer, fmt, specs, texts, MAX_SEQ_LEN)
    qj.save_checkpoint(model, tokenizer, src, out)
    qj.release(model)


def main(argv: list[str] | None = None) -> int:
    from fewerbits_api.architectures import effective_ignore
    from fewerbits_api.formats import CONCRETE_FORMATS, FORMAT_FACTS, QuantFormat

    from tests.testmodel import zoo

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="rows (JSON) to write")
    ap.add_argument("--only", default="", help="comma-separated zoo names (default: all)")
    ap.add_argument("--formats", default="", help="comma-separated formats (default: all concrete formats)")
    args = ap.parse_args(argv)
    only = [n for n in args.only.split(",") if n] or zoo.names()
    formats = [QuantFormat(f) for f in args.formats.split(",") if f] or list(CONCRETE_FORMATS)

    rows = []
    for name in only:
        src = zoo.build_zoo_model(name)
        config = json.loads((src / "config.json").read_text())
        ignore = list(effective_ignore(config, ["lm_head"]).entries)
        for fmt in formats:
            row = {"architecture": name, "format": fmt.value, "ignore": ignore}
            planned, as_is, reason = planner_verdict(config, fmt)
            if not planned:
                rows.append(row | {"result": "refused", "detail": reason})
                print(f"{name:16} {fmt.value:12} refused", flush=True)
                continue
            # vLLM is asked to build the model as the GPU family that runs the format natively
            # would (the compute capability decides vLLM's quantization scheme).
            cc = FORMAT_FACTS[fmt].native_min_cc if fmt is not QuantFormat.NONE else None
            row["capability"] = f"{cc[0]}.{cc[1]}" if cc else None
            if as_is or fmt is QuantFormat.NONE:
                rows.append(row | {"artifact": str(src), "detail": "the source itself" + (" (served as-is)" if as_is else "")})
                print(f"{name:16} {fmt.value:12} source", flush=True)
                continue
            key = hashlib.sha256(json.dumps([ARTIFACT_VERSION, src.name, fmt.value, ignore]).encode()).hexdigest()[:12]
            art = cache_root() / f"{name}-{fmt.value}-{key}"
            started = time.monotonic()
            if not (art / "config.json").exists():
                art.parent.mkdir(parents=True, exist_ok=True)
                staging = Path(tempfile.mkdtemp(prefix=f".{art.name}.", dir=art.parent))
                try:
                    quantize(src, fmt, ignore, staging)
                    os.rename(staging, art)
                except Exception as e:  # noqa: BLE001 — llm-compressor's error is the row's detail
                    shutil.rmtree(staging, ignore_errors=True)
                    last = traceback.extract_tb(e.__traceback__)[-1]
                    rows.append(row | {"result": "fails", "detail": f"quantization failed: {type(e).__name__}: "
                                       f"{str(e)[:400]} ({Path(last.filename).name}:{last.lineno})"})
                    print(f"{name:16} {fmt.value:12} quantization failed: {e!s:.200}", flush=True)
                    continue
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
            qc = json.loads((art / "config.json").read_text()).get("quantization_config") or {}
            rows.append(row | {"artifact": str(art), "quantize_seconds": round(time.monotonic() - started, 1),
                               "artifact_ignore": qc.get("ignore")})
            print(f"{name:16} {fmt.value:12} {art.name} ({time.monotonic() - started:.1f} s)", flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
