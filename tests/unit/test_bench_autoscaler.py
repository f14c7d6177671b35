"""The autoscaler bench's two-pool and oracle parts run and compare what they claim to (short
traces; the figures themselves are in bench/README.md, never asserted as timings)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

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


def test_history_oracle_knows_less_than_foresight_and_more_than_the_present():
    """The history oracle (the bound for any forecast from history) sees the present exactly and
    never more of the future than the trace holds: pointwise between the two other oracles."""
    hours, u = 6, 0.8
    trace = bench.make_trace(4, hours, "launch")
    loads = bench.knowable_loads(4, hours, "launch")
    present = bench.Oracle(trace, u, foresight=False).plan
    history = bench.HistoryOracle(loads, u).plan
    future = bench.Oracle(trace, u).plan
    assert all(p <= h <= f for p, h, f in zip(present, history, future))
    # It knows more than the present (a started burst's height) and less than the future (the
    # bursts still to start).
    assert sum(history) > sum(present) and sum(history) < sum(future)
    events = bench.trace_events(4, hours, "launch")
    burst = events.bursts[0]
    k = int(burst[0] // bench.DT) + 1  # the step just after the first burst starts
    peak = bench.rates_at(burst[0] + 200, "launch", events)
    assert bench.rates_at(burst[0] + 200, "launch", events, known_until=k * bench.DT) == peak
    assert bench.rates_at(burst[0] + 200, "launch", events, known_until=burst[0] - 1) < peak


def test_late_history_oracle_knows_less_than_the_history_oracle_and_the_present_exactly():
    """Learning of a started burst one pass late (the bound for a scaler that measures) holds
    pointwise no more than the history oracle and no less than the present load needs, and less
    in all: some steps it has not yet seen a burst that started."""
    hours, u = 6, 0.8
    trace = bench.make_trace(4, hours, "launch")
    present = bench.Oracle(trace, u, foresight=False).plan
    history = bench.HistoryOracle(bench.knowable_loads(4, hours, "launch"), u).plan
    late = bench.HistoryOracle(bench.knowable_loads(4, hours, "launch", bench.LATE_S), u).plan
    assert all(p <= lt <= h for p, lt, h in zip(present, late, history))
    assert sum(present) < sum(late) < sum(history)


def test_seeds_argument():
    assert bench.seeds_arg("1-5") == [1, 2, 3, 4, 5] and bench.seeds_arg("2,7") == [2, 7]


# ------------------------------------------------------------------ foresight (issue 33)

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "autoscaler.json"
TUNING = RESULTS.with_name("autoscaler-tuning.json")
HOLDOUT = RESULTS.with_name("autoscaler-holdout.json")


def test_trace_shapes_are_what_they_claim():
    day = int(bench.DAY_S / bench.DT)
    seasonal, flat, launch = (bench.make_trace(3, 72, s) for s in ("seasonal", "flat", "launch"))
    assert seasonal[:day] == bench.make_trace(3, 24)  # day 1 is issue 8's trace
    # Flat: the 03:00 trough and the 15:00 peak carry the same base load (bursts aside).
    at = lambda trace, h: min(trace[int(h * 3600 / bench.DT) + k][0] for k in range(-20, 20))  # noqa: E731
    assert at(flat, 3) == at(flat, 15) and at(seasonal, 3) < at(seasonal, 15) / 2
    # Launch: the same load as the seasonal trace until 09:00 of day 3, x1.5 after the ramp.
    shift = int((2 * bench.DAY_S + 9 * 3600) / bench.DT)
    assert launch[:shift] == seasonal[:shift]
    later = shift + int(3600 / bench.DT)
    assert launch[later][0] == pytest.approx(seasonal[later][0] * bench.LAUNCH_FACTOR)
    with pytest.raises(ValueError, match="trace shape"):
        bench.make_trace(1, 1, "weekly")


def test_periods_split_one_run():
    trace = bench.make_trace(2, 4)
    whole = bench.simulate(bench.Fewerbits(), trace, 2)
    first, rest = bench.simulate_periods(bench.Fewerbits(), trace, 2, 2 * 3600)
    assert first.gpu_hours + rest.gpu_hours == pytest.approx(whole.gpu_hours)
    assert first.saturated_min + rest.saturated_min == pytest.approx(whole.saturated_min)
    assert first.scale_events + rest.scale_events == whole.scale_events


def test_predictive_policy_runs_the_operators_rule_and_counts_its_scale_ups():
    trace = bench.make_trace(1, 6)
    policy = bench.Predictive()
    result = bench.simulate(policy, trace, 1)
    reactive = bench.simulate(bench.Fewerbits(), trace, 1)
    assert policy.forecaster.series.span(6 * 3600 - bench.DT) > 5 * 3600  # it kept the history
    assert 0 <= policy.unneeded <= policy.scale_ups
    # The rule only adds capacity: never fewer GPU-hours than the reactive decisions alone.
    assert result.gpu_hours >= reactive.gpu_hours


def test_committed_results_give_the_readme_table_and_their_goals():
    doc = json.loads(RESULTS.read_text())
    assert [(r["trace"], r["seed"]) for r in doc["results"]] == bench.FORESIGHT_TRACES
    assert doc["goals"] == bench.foresight_goals(doc["results"])
    table = bench.foresight_table(doc)
    rows = [line for line in table.splitlines() if line.startswith("| ") and "seed" in line or line.startswith("| flat")
            or line.startswith("| launch")]
    assert len(rows) == len(doc["results"])
    for r, line in zip(doc["results"], rows):
        assert f"**{r['after_first_day']['predictive']['gpu_ratio_equal_sat']:.3f}**" in line
    assert doc["command"] in table
    # The hold-out run: its own traces, the same setting, its goals read from its rows.
    holdout = json.loads(HOLDOUT.read_text())
    assert [(r["trace"], r["seed"]) for r in holdout["results"]] == bench.HOLDOUT_TRACES
    assert holdout["predictive_setting"] == doc["predictive_setting"]
    assert holdout["goals"] == bench.foresight_goals(holdout["results"])
    seen = {*bench.FORESIGHT_TRACES, *bench.TUNING_TRACES}
    assert not seen & set(bench.HOLDOUT_TRACES)


def test_the_setting_is_chosen_on_the_tuning_seeds_by_the_goals():
    def run(reactive_sat, sweep):
        return {"after_first_day": {"reactive": {"saturated_min": reactive_sat}, "sweep": {"predictive": {
            x: {"saturated_min": sat, "gpu_ratio_equal_sat": ratio} for x, (sat, ratio) in sweep.items()}}}}

    doc = {"results": [run(40, {"0.70/300s": (30, 0.95), "0.70/150s": (38, 0.90), "0.75/60s": (45, 0.80)}),
                       run(60, {"0.70/300s": (40, 0.97), "0.70/150s": (55, 0.93), "0.75/60s": (58, None)})]}
    # 0.75/60s saturates more than the reactive autoscaler on the first trace; of the two left,
    # 0.70/150s has the lower worst-trace ratio.
    assert bench.choose_setting(doc) == (0.70, 150)
    # A ratio within RATIO_NOISE of the lowest is a tie: the one with more room under the
    # reactive autoscaler's saturation is taken (0.80 of it against 0.95).
    for r, sat, ratio in zip(doc["results"], (32, 45), (0.92, 0.93 + bench.RATIO_NOISE / 2)):
        r["after_first_day"]["sweep"]["predictive"]["0.75/150s"] = {"saturated_min": sat, "gpu_ratio_equal_sat": ratio}
    assert bench.choose_setting(doc) == (0.75, 150)
    doc["results"][1]["after_first_day"]["reactive"]["saturated_min"] = 35
    assert bench.choose_setting(doc) is None
    # The committed evaluation uses what the committed tuning run chose (never the evaluation days).
    tuning = json.loads(TUNING.read_text())
    assert [(r["trace"], r["seed"]) for r in tuning["results"]] == bench.TUNING_TRACES
    chosen = bench.choose_setting(tuning) or bench.DEFAULT_SETTING
    assert json.loads(RESULTS.read_text())["predictive_setting"] == bench.setting_key(bench.PREDICTIVE_SETTING) \
        == bench.setting_key(chosen)


def test_goals_read_the_runs():
    row = {"trace": "seasonal", "after_first_day": {"predictive": {"gpu_ratio_equal_sat": 0.84, "saturated_min": 5},
                                                    "reactive": {"gpu_ratio_equal_sat": 0.9, "saturated_min": 6}}}
    flat = {**row, "trace": "flat"}
    assert all(bench.foresight_goals([row, flat]).values())
    worse = {**flat, "after_first_day": {**flat["after_first_day"],
                                         "predictive": {"gpu_ratio_equal_sat": 0.95, "saturated_min": 7}}}
    goals = bench.foresight_goals([row, worse])
    assert goals == {"ratio_at_most_0.85_every_seed": True, "saturation_not_above_reactive": False,
                     "launch_and_flat_not_worse": False}


# ------------------------------------------------------------------ issue 45: the gap to the bound, the tries

TRIES = RESULTS.with_name("autoscaler-tries.json")


def test_table_has_the_gap_to_the_late_bound_and_the_tries_column():
    import autoscaler_tries as tries_bench

    doc, tries = json.loads(RESULTS.read_text()), json.loads(TRIES.read_text())
    holdout = json.loads(HOLDOUT.read_text())
    assert [t["name"] for t in tries["tries"]] == [t.name for t in tries_bench.TRIES]
    landed = tries["tries"][0]
    for kind, run in (("evaluation", doc), ("holdout", holdout)):
        table = bench.foresight_table(run, tries)
        rows = {(r["trace"], r["seed"]): r for r in landed["rows"][kind]}
        assert list(rows) == [(r["trace"], r["seed"]) for r in run["results"]]
        for r in run["results"]:
            a, mine = r["after_first_day"], rows[(r["trace"], r["seed"])]
            # The tries' landed rows are the committed run's predictive autoscaler, figure for figure.
            assert mine["gpu_hours"] == a["predictive"]["gpu_hours"]
            assert mine["saturated_min"] == a["predictive"]["saturated_min"]
            assert mine["gpu_ratio_equal_sat"] == a["predictive"]["gpu_ratio_equal_sat"]
            assert mine["late_bound_equal_sat"] == a["history_oracle_late_bound_equal_sat"]
            gap = bench.gap_to_bound(a)
            assert mine["gap_to_bound"] == pytest.approx(gap, abs=2e-4)  # each side rounded to 4 places
            line = next(x for x in table.splitlines() if f"**{a['predictive']['gpu_ratio_equal_sat']:.3f}**" in x)
            assert f"**{gap:.3f}**" in line
            tried = next(rr for t in tries["tries"] if t["name"] == bench.TABLE_TRY
                         for rr in t["rows"][kind] if (rr["trace"], rr["seed"]) == (r["trace"], r["seed"]))
            assert line.endswith(f" {bench._try_cell(tried)} |")
    # The keep rule, read from the rows: saturation and gap no higher than the landed on any trace.
    base = {(r["trace"], r["seed"]): r for rows in landed["rows"].values() for r in rows}
    for t in tries["tries"][1:]:
        mine = [r for rows in t["rows"].values() for r in rows]
        assert t["kept"] == all(r["saturated_min"] <= base[(r["trace"], r["seed"])]["saturated_min"]
                                and r["gap_to_bound"] <= base[(r["trace"], r["seed"])]["gap_to_bound"] for r in mine)
        assert t["gap_goal_met"] == all(r["gap_to_bound"] <= tries["goal_gap"] for r in mine)
