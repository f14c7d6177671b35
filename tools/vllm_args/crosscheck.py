"""Cross-check ``check_vllm_args`` (which reads the JSON dump) against vLLM's real parser.

Run in the throwaway vLLM environment (see NOTES.md); prints one line per case and exits 1 when
the two disagree on any case other than the known limitation listed in NOTES.md.

    VLLM_TARGET_DEVICE=cpu /tmp/vllm-venv/bin/python tools/vllm_args/crosscheck.py
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
PLANNER = Path(__file__).resolve().parents[2] / "operator" / "fewerbits_operator" / "planner"

CASES = [
    ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8", "--tensor-parallel-size", "2", "--max-model-len", "8192",
     "--gpu-memory-utilization", "0.9"],
    ["--served-model-name", "a", "b", "--dtype", "float16"],
    ["--dtype", "bf16"],
    ["--tensor-parallel-size", "two"],
    ["--max-model-len", "32k"],
    ["--max-model-len", "-1"],
    ["--max-model-len", "auto"],
    ["--max-model-len", "lots"],
    ["--gpu-memory-utilization=0.85"],
    ["--enforce-eager"],
    ["--no-enforce-eager"],
    ["--enforce_eager"],
    ["--max_num_seqs", "64"],
    ["--max-num-seqs"],
    ["--made-up-flag", "1"],
    ["-tp", "4"],
    ["-O3"],
    ["--compilation-config", "{bad"],
    ["--compilation-config.mode", "3"],
    ["--quantization", "compressed-tensors"],
    ["--quantization", "nonsense"],
    ["--kv-cache-dtype", "fp9"],
    ["--max-num-batched-tokens", "16k"],
    ["--tensor-parallel-size", "2", "extra"],
    ["--enable-prefix-caching", "--max-num-seqs", "128"],
    ["--swap-space", "4"],
    ["--hf-overrides", '{"max_position_embeddings": 4096}'],
    # A multi-node replica (planner/multinode.py, lws.py): the leader, a headless worker, bad ranks.
    ["--tensor-parallel-size", "8", "--pipeline-parallel-size", "2", "--nnodes", "2", "--node-rank", "0",
     "--master-addr", "big-h100-0.big-h100.ns", "--master-port", "29501"],
    ["--tensor-parallel-size", "8", "--pipeline-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
     "--master-addr", "big-h100-0.big-h100.ns", "--master-port", "29501", "--headless"],
    ["--nnodes", "two"],
    ["--node-rank", "$(LWS_WORKER_INDEX)"],
    ["--headless=1"],
    ["--load-format", "runai_streamer"],
]


def _load_checker():
    # Load vllm_args.py alone (the operator's package needs pydantic etc., not installed here).
    spec = importlib.util.spec_from_file_location("vllm_args", PLANNER / "vllm_args.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import json

    dump = json.loads((PLANNER / f"vllm_args_v{module.VLLM_VERSION}.json").read_text())
    module.vllm_arg_spec = lambda version=module.VLLM_VERSION: dump
    return module, dump


def main() -> int:
    checker, dump = _load_checker()
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    parser.exit_on_error = False
    kv_choices = dump["options"]["--kv-cache-dtype"]["choices"]
    q_choices = dump["options"]["--quantization"]["choices"]
    disagree = 0
    for case in CASES:
        mine = checker.check_vllm_args(case)
        try:
            ns = parser.parse_args(["some/model", *case])
            # What vLLM validates after parsing (CacheConfig, the quantization registry).
            ok = ns.kv_cache_dtype in kv_choices and (not ns.quantization or ns.quantization in q_choices)
        except SystemExit:
            ok = False
        except Exception:
            ok = False
        same = ok == (mine == [])
        disagree += not same
        print("same" if same else "DIFFERENT", case, "vllm:", "accepts" if ok else "refuses", "checker:", mine or "accepts")
    print(f"{len(CASES) - disagree}/{len(CASES)} agree")
    return 1 if disagree else 0


if __name__ == "__main__":
    sys.exit(main())
