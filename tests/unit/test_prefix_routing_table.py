"""docs/routing.md's prefix-routing table is the committed JSON's (``bench/prefix_routing.py
--markdown-from``), and every committed run shows the effect the e2e asserts."""

from __future__ import annotations

import json
from pathlib import Path

from tests.benchmod import load_bench

REPO = Path(__file__).resolve().parents[2]
RESULT = REPO / "bench" / "results" / "prefix-routing.json"


def test_the_doc_table_is_the_committed_runs():
    bench = load_bench("prefix_routing")
    table = bench.markdown(json.loads(RESULT.read_text()))
    assert table in (REPO / "docs" / "routing.md").read_text()


def test_every_committed_run_routed_each_follow_up_to_its_prefix_pod():
    runs = json.loads(RESULT.read_text())["runs"]
    assert {r["cpu"] for r in runs} == {"native", "AVX2"}  # both paths of vLLM's CPU build
    for run in runs:
        assert len(run["load_average"]) == 2  # the doc reads the machine's load beside the latencies
        pool, service = run["inference_pool"], run["service"]
        assert pool["same"] == run["groups"] * (run["requests_per_group"] - 1)
        assert pool["prefix_cache_hit_rate"] > service["prefix_cache_hit_rate"]
