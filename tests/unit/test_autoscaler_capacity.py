"""Capacity-aware placement across the pools of one model (autoscaler/capacity.py)."""

from __future__ import annotations

import pytest

from fewerbits_api.quantizedmodel import AutoscalingSpec
from fewerbits_operator.autoscaler.algorithm import History, Observation, decide
from fewerbits_operator.autoscaler.capacity import (
    PoolEconomics,
    VariantState,
    economics_from_plan,
    prefer_cheapest,
    rebalance,
    state_of,
)
from fewerbits_operator.autoscaler.metrics import PodSample
from fewerbits_operator.base.settings import parse_cost_weights

# H100: 10 units per replica for cost 1 (0.1/unit); L4: 1 unit for 0.27 (0.27/unit).
ECON = {"h100": PoolEconomics(10.0, 1.0), "l4": PoolEconomics(1.0, 0.27)}


def st(variant, current, desired, wants=None, lo=1, hi=20, complete=True, step_limit=None):
    return VariantState(variant, current, desired, desired if wants is None else wants, lo, hi, complete, step_limit)


def by_variant(choices):
    return {c.variant: c.desired for c in choices}


def test_scale_up_goes_to_the_cheapest_pool_per_token():
    # Both pools at the same KV usage each want +50%: 3 H100 + 4 L4 -> the 15 + 2 units go to H100.
    out = prefer_cheapest([st("h100", 2, 3), st("l4", 4, 6)], ECON)
    assert by_variant(out) == {"h100": 4, "l4": 4}
    (h100,) = [c for c in out if c.variant == "h100"]
    assert "capacity-aware" in h100.reason and "own decision: 3" in h100.reason
    assert [c.reason for c in out if c.variant == "l4"][0]  # the held-back pool says why too


def test_scale_down_removes_the_most_expensive_per_token_first():
    # Demand fell by 12 units (delay passed in both own decisions): L4 goes to its minimum first.
    out = prefer_cheapest([st("h100", 4, 3), st("l4", 5, 3)], ECON)
    # 45 -> 33 units: the 4 L4 above minReplicas go (41 left); one H100 more would leave 31.
    assert by_variant(out) == {"h100": 4, "l4": 1}


def test_scale_down_never_below_the_capacity_wanted():
    # 42 units wanted of 45: dropping one H100 (10) would go below; 3 L4 (3 units) are removed.
    out = prefer_cheapest([st("h100", 4, 4, wants=4), st("l4", 5, 2, wants=2)], ECON)
    assert by_variant(out) == {"h100": 4, "l4": 2}
    assert sum(n * ECON[v].throughput for v, n in by_variant(out).items()) >= 42


def test_incomplete_pool_is_never_scaled_down_by_the_preference():
    # L4 has a pod not reporting: its own decision holds, and the preference does not take it.
    out = prefer_cheapest([st("h100", 4, 2), st("l4", 5, 5, wants=3, complete=False)], ECON)
    assert by_variant(out)["l4"] == 5


def test_starting_capacity_elsewhere_is_not_bought_twice():
    # H100 has 2 replicas starting (current 6, ready 4): L4's KV rule still fires on its own
    # ready pods, but the model's capacity in flight covers it: nothing is added.
    out = prefer_cheapest([st("h100", 6, 6, wants=4, complete=False), st("l4", 2, 4, wants=4)], ECON)
    assert by_variant(out) == {"h100": 6, "l4": 2}


def test_spills_over_when_the_cheapest_pool_is_full_or_step_limited():
    out = prefer_cheapest([st("h100", 3, 5, hi=4), st("l4", 2, 4)], ECON)
    # wanted 50 + 4 = 54 units, have 32: H100 can add 1 (10 units), L4 the remaining 12.
    assert by_variant(out) == {"h100": 4, "l4": 14}
    out = prefer_cheapest([st("h100", 3, 5, step_limit=4), st("l4", 2, 2)], ECON)
    assert by_variant(out) == {"h100": 4, "l4": 12}


def test_steady_demand_holds_and_one_pool_keeps_its_own_decision():
    assert by_variant(prefer_cheapest([st("h100", 3, 3), st("l4", 2, 2)], ECON)) == {"h100": 3, "l4": 2}
    # One pool with economics only: nothing to prefer.
    only = prefer_cheapest([st("h100", 3, 5), st("a100", 2, 4)], {"h100": ECON["h100"]})
    assert by_variant(only) == {"h100": 5, "a100": 4}
    # A pool outside its bounds (policy cap lowered) keeps its own decision.
    out = prefer_cheapest([st("h100", 3, 5), st("l4", 9, 4, hi=4)], ECON)
    assert by_variant(out)["l4"] == 4


def test_no_data_counts_as_present_capacity():
    out = prefer_cheapest([VariantState("h100", 3, 3, None, 1, 20, False), st("l4", 2, 3)], ECON)
    assert by_variant(out) == {"h100": 4, "l4": 2}


def test_economics_from_plan_and_cost_weights():
    plan = [
        {"pool": "h100-x1", "gpuProduct": "NVIDIA-H100-80GB-HBM3", "tensorParallelSize": 1, "decodeTokensPerSecond": 3000.0},
        {"pool": "l4-x2", "gpuProduct": "NVIDIA-L4", "tensorParallelSize": 2, "decodeTokensPerSecond": 500.0},
        {"pool": "odd", "gpuProduct": "X", "tensorParallelSize": 1, "decodeTokensPerSecond": 0},
    ]
    eco = economics_from_plan(plan, parse_cost_weights("NVIDIA-H100-80GB-HBM3=1, NVIDIA-L4=0.25"))
    assert set(eco) == {"h100-x1", "l4-x2"}
    assert eco["l4-x2"].cost == pytest.approx(0.5)  # two GPUs per replica
    assert eco["l4-x2"].cost_per_token / eco["h100-x1"].cost_per_token == pytest.approx(3.0)
    # A pool name wins over its product; unknown products weigh 1.
    eco = economics_from_plan(plan, {"l4-x2": 0.1})
    assert eco["l4-x2"].cost == pytest.approx(0.2) and eco["h100-x1"].cost == 1.0


@pytest.mark.parametrize("text", ["NVIDIA-L4", "NVIDIA-L4=0", "NVIDIA-L4=-1", "=1", "NVIDIA-L4=abc", "A=nan"])
def test_bad_cost_weight_names_the_entry(text):
    with pytest.raises(ValueError, match="GPU cost weight"):
        parse_cost_weights(text)


def test_bad_economics_refused():
    with pytest.raises(ValueError, match="throughput"):
        PoolEconomics(0.0, 1.0)
    with pytest.raises(ValueError, match="cost"):
        PoolEconomics(1.0, float("inf"))


def test_state_of_a_real_decision():
    spec = AutoscalingSpec(minReplicas=1, maxReplicas=10, targetKVCacheUsage=0.5, scaleDownDelaySeconds=0)
    samples = tuple(PodSample(f"p{i}", 0.9, 0.0, 8.0) for i in range(3))
    d = decide(spec, None, Observation(3, samples), History(), 0.0)
    s = state_of("h100", d, 1, 10, True)
    assert (s.current, s.desired, s.wants, s.step_limit) == (3, 6, 6, 7)
    assert state_of("h100", decide(spec, None, Observation(3), History(), 0.0), 1, 10, False).wants is None


def test_rebalance_rewrites_only_the_decisions_it_changes():
    # The loop's and the bench's entry point: real decisions in, the ones to act on out.
    spec = AutoscalingSpec(minReplicas=1, maxReplicas=20, targetKVCacheUsage=0.5, scaleDownDelaySeconds=0)
    hot = tuple(PodSample(f"p{i}", 0.75, 0.0, 8.0) for i in range(2))
    h100 = decide(spec, None, Observation(2, hot), History(), 0.0)
    l4 = decide(spec, None, Observation(2, hot), History(), 0.0)
    assert (h100.desired, l4.desired) == (3, 3)
    out = rebalance([("h100", h100, True), ("l4", l4, True)], 1, 20, ECON)
    assert [d.desired for d in out] == [4, 2]  # 30+3 units wanted of 22: +2 H100 (20 units), no L4
    assert out[0].act and out[0].direction == "up" and out[0].reason.startswith("capacity-aware")
    assert "scale up 2->3" in out[0].reason  # its own decision is kept in the reason
    assert not out[1].act and out[1].direction is None and out[1].history is l4.history
    # Unknown economics: every decision stands, untouched.
    assert rebalance([("h100", h100, True), ("l4", l4, True)], 1, 20, {}) == [h100, l4]


def test_economics_count_every_node_of_a_multinode_replica():
    plan = [{"pool": "h100", "gpuProduct": "H", "tensorParallelSize": 8, "nodesPerReplica": 2,
             "decodeTokensPerSecond": 100.0}]
    assert economics_from_plan(plan, {"H": 0.5})["h100"].cost == pytest.approx(8.0)
