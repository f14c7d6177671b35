"""Prefix-cache-aware routing on real vLLM: the figures of tests/integration/test_prefix_routing.py.

    python bench/prefix_routing.py [--runs 2] [--avx2]          # runs the e2e, writes the JSON
    python bench/prefix_routing.py --markdown-from bench/results/prefix-routing.json   # docs/routing.md's table

Each run is the e2e itself (``scripts/test.sh tests/integration/test_prefix_routing.py``): two real
vLLM pods (the CPU build) of one variant, a workload of 8 shared system prompts (three of vLLM's
128-token KV blocks each) asked 6 times each with different questions, one request at a time,
through the model's Service (kube-proxy's random pick: the baseline) and then, with prefixes of its
own, through the InferencePool's endpoint picker with the operator's default profile (queue, KV
and prefix scorers), on the same pods in the same run. Figures per path: vLLM's own prefix-cache
hit rate over both pods (hit / queried prompt tokens), follow-up requests that reached the pod of
their group's first request, and the median latency of a one-token completion at the client
(through the gateway stand-in or the Service stand-in; the time to the first token as a client sees
it). The JSON also keeps vLLM's own mean time to first token (``vllm:time_to_first_token_seconds``),
which a few slow requests dominate here. ``--avx2`` runs the e2e with
``FEWERBITS_CPU_CAPABILITY=AVX2`` (vLLM's CPU build as on a CPU without AVX-512).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "bench" / "results" / "prefix-routing.json"


def run_once(avx2: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "FEWERBITS_RESULTS_DIR": out, "FEWERBITS_TEST_WORKERS": "0"}
        if avx2:
            env["FEWERBITS_CPU_CAPABILITY"] = "AVX2"
        load_before = os.getloadavg()[0]
        subprocess.run(["bash", "scripts/test.sh", "tests/integration/test_prefix_routing.py"], cwd=REPO,
                       env=env, check=True)
        run = json.loads(Path(out, "prefix-routing.json").read_text())
        # The machine's 1-minute load average around the run: the latencies mean little on a busy one.
        return {**run, "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def _row(label: str, f: dict[str, Any]) -> str:
    return (f"| {label} | {100 * f['prefix_cache_hit_rate']:.1f}% | {f['follow_ups_on_first_pod']} "
            f"| {f['ttft_ms_median']:.1f} / {f['ttft_ms_median_follow_ups']:.1f} |")


def markdown(d: dict[str, Any]) -> str:
    lines = ["| run | routing | prefix-cache hit rate (vLLM, tokens) | follow-ups on their prefix's pod "
             "| one-token latency at the client, median ms (all / follow-ups) |", "|---|---|---|---|---|"]
    for i, run in enumerate(d["runs"], 1):
        load = "/".join(f"{x:g}" for x in run.get("load_average", ()))
        label = f"{i} ({run['cpu']}{', load ' + load if load else ''})"
        lines.append(f"| {label} " + _row("Service (random pod)", run["service"]))
        lines.append(f"| {label} " + _row("InferencePool (queue + KV + prefix scorers)", run["inference_pool"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--avx2", action="store_true", help="also one run as on a CPU without AVX-512")
    ap.add_argument("--markdown-from", type=Path, metavar="JSON", help="print the table and exit")
    args = ap.parse_args(argv)
    if args.markdown_from:
        print(markdown(json.loads(args.markdown_from.read_text())))
        return 0
    runs = [run_once(avx2=False) for _ in range(args.runs)] + ([run_once(avx2=True)] if args.avx2 else [])
    RESULT.write_text(json.dumps({"command": "python bench/prefix_routing.py " + " ".join(argv or sys.argv[1:]),
                                  "runs": runs}, indent=2) + "\n")
    print(markdown(json.loads(RESULT.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
