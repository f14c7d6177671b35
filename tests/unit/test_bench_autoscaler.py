"""The autoscaler bench's two-pool and oracle parts run and compare what they claim to (short
traces; the figures themselves are in bench/README.md, never asserted as timings)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_autoscaler as bench  # noqa: E402


def test_two_pools_capacity_aware_buys_the_cheaper_tokens():
    service, independent, aware = bench.two_pool_rows(seed=1, hours=6)
    assert aware.cost < independent.cost < service.cost
    assert aware.replica_hours["l4"] < independent.replica_hours["l4"]
    # Behind a Service the slow pool gets requests by pod count, far beyond its capacity share.
    assert service.share["l4"] > independent.share["l4"]


def test_oracles_bound_the_policies():
    trace = bench.make_trace(1, 6)
    foresight = bench.simulate(bench.Oracle(trace, 0.8), trace, 1)
    reactive = bench.simulate(bench.Oracle(trace, 0.8, foresight=False), trace, 1)
    # Same utilisation: knowing the load one start-up ahead saturates less.
    assert foresight.saturated_min <= reactive.saturated_min


def test_seeds_argument():
    assert bench.seeds_arg("1-5") == [1, 2, 3, 4, 5] and bench.seeds_arg("2,7") == [2, 7]
