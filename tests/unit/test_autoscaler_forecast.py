"""The autoscaler's forecast and its predictive rule (``autoscaler.forecast``), replayed on recorded
demand histories (tests/fixtures/autoscaler/: what the reactive autoscaler measured on the bench's
traces, one sample a minute) and table-tested; the rule's one promise, never below the reactive
decision, as a Hypothesis property."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fewerbits_api.quantizedmodel import AutoscalingSpec
from fewerbits_operator.autoscaler.algorithm import History, Observation, decide
from fewerbits_operator.autoscaler.forecast import (
    DAY,
    WEEK,
    Burst,
    DemandSeries,
    Forecast,
    Forecaster,
    ForecastTuning,
    burst_departure,
    demand_of,
    fit_line,
    foresee,
    foresight_step,
    seasonal_level,
    seasonal_ratio,
    track_burst,
)
from fewerbits_operator.autoscaler.metrics import PodSample

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "autoscaler"
SPEC = AutoscalingSpec(minReplicas=1, maxReplicas=10, targetKVCacheUsage=0.7)
HORIZON = 195.0  # the bench's: 180 s start-up + one 15 s pass


def recorded(name: str) -> list[tuple[float, float]]:
    return [(float(t), float(d)) for t, d in json.loads((FIXTURES / name).read_text())["samples"]]


def replay(samples: list[tuple[float, float]], horizon: float = HORIZON) -> list[tuple[float, Forecast]]:
    f = Forecaster()
    out = []
    for t, d in samples:
        f.observe(t, d)
        out.append((t, f.predict(t, horizon)))
    return out


def reactive(current: int, kv: float, ready: int | None = None, now: float = 0.0):
    """A real reactive decision: ``ready`` pods (default: all) at this KV."""
    ready = current if ready is None else ready
    obs = Observation(current, tuple(PodSample(f"p{i}", kv, 0.0, 10.0) for i in range(ready)), 0, current - ready)
    return decide(SPEC, None, obs, History(), now)


def fc(expected: float, upper: float | None, phase: str = "Daily", lower: float | None = None) -> Forecast:
    """A forecast with a band (lower: 0.9 x expected unless given); none with ``upper`` None."""
    lower = None if upper is None else (expected * 0.9 if lower is None else lower)
    return Forecast(phase, DAY, HORIZON, expected, expected, upper, lower, 100)


# ------------------------------------------------------------------ history and fit


def test_ring_buffer_is_bounded_and_forgets_what_it_overwrote():
    s = DemandSeries(60.0, 600.0)  # 10 buckets
    assert s.size == 10 and s.mean(0, 600) is None
    s.add(0.0, 2.0)
    s.add(30.0, 4.0)
    assert s.mean(0, 60) == 3.0
    s.add(600.0, 9.0)  # same slot, ten buckets later: the old bucket is gone
    assert s.mean(0, 60) is None and s.mean(600, 660) == 9.0
    assert s.span(660.0) == 660.0


def test_fit_line_recovers_a_slope_and_tells_noise_from_trend():
    level, slope, se = fit_line([(t, 2.0 + 0.01 * t) for t in range(0, 121, 15)], 120.0)
    assert level == pytest.approx(3.2) and slope == pytest.approx(0.01) and se == pytest.approx(0.0, abs=1e-9)
    noisy = [(t, 5.0 + (0.3 if i % 2 else -0.3)) for i, t in enumerate(range(0, 121, 15))]
    _, slope, se = fit_line(noisy, 120.0)
    assert abs(slope) < 2 * se  # the predictor ignores it (trend_z = 2)


def _daily_steps(first_day: int, days: int, step_factor: dict[int, float]) -> DemandSeries:
    """One sample a minute: load 1.0, stepping to ``step_factor[day]`` (2.0 unless given) at 08:10."""
    s = DemandSeries(60.0, WEEK + DAY)
    for minute in range(int(first_day * DAY / 60), int((first_day + days) * DAY / 60)):
        t = minute * 60.0
        day, tod = int(t // DAY), t % DAY
        s.add(t, step_factor.get(day, 2.0) if tod >= 8 * 3600 + 600 else 1.0)
    return s


def test_seasonal_ratio_uses_earlier_days_and_a_week_ago_once_kept():
    tuning = ForecastTuning()  # 10-minute windows: at 08:00 + 15 min, half the window is past the step
    horizon = 900.0

    def ratio_of(ahead: float, base: float = 1.0) -> float:
        return (ahead + 0.5) / (base + 0.5)

    # Three days kept: the median daily ratio.
    s = _daily_steps(5, 3, {})
    assert seasonal_ratio(s, 8 * DAY + 8 * 3600, horizon, tuning) == (pytest.approx(ratio_of((1 + 2) / 2)), "Daily")
    # Eight days kept, and a week ago (day 1) the step was x3: half weekly, half the daily median.
    s = _daily_steps(0, 8, {1: 3.0})
    daily, weekly = ratio_of(1.5), ratio_of((1 + 3) / 2)
    assert seasonal_ratio(s, 8 * DAY + 8 * 3600, horizon, tuning) == (pytest.approx((daily + weekly) / 2), "Weekly")
    # Under a day: no season, the trend alone.
    s = _daily_steps(0, 1, {})
    assert seasonal_ratio(s, 20 * 3600, horizon, tuning) == (1.0, "Trend")


# ------------------------------------------------------------------ replays of recorded histories


def test_replay_diurnal_history_trains_then_forecasts_the_day_within_its_band():
    samples = recorded("demand-seasonal-seed1.json")
    out = replay(samples)
    phases = [f.phase for _, f in out]
    tuning = ForecastTuning()
    assert set(phases[: tuning.min_errors]) == {"Training"}  # no band: the rule does not act yet
    assert all(f.upper is None for _, f in out[: tuning.min_errors])
    assert {f.phase for t, f in out if tuning.min_errors * 60 + HORIZON < t < DAY} == {"Trend"}
    assert {f.phase for t, f in out if t >= DAY + HORIZON} == {"Daily"}
    # Calibration on day 2: the demand that came one horizon later is under the upper band about
    # as often as the band's quantile (0.9) says, and over the lower band as often.
    actual = dict(samples)
    later = [(f, actual.get(t + 180.0 + 60.0 * round(15 / 60))) for t, f in out if t >= DAY]
    pairs = [(f, a) for f, a in later if a is not None]
    assert len(pairs) > 600
    covered = sum(a <= f.upper for f, a in pairs) / len(pairs)
    above_lower = sum(a >= f.lower for f, a in pairs) / len(pairs)
    assert 0.8 <= covered <= 0.98 and 0.8 <= above_lower <= 0.98


def test_replay_diurnal_history_knows_the_morning_ramp_from_the_day_before():
    samples = recorded("demand-seasonal-seed1.json")
    f = Forecaster()
    morning, night = [], []
    for t, d in samples:
        f.observe(t, d)
        if t < DAY + 3600:
            continue
        ratio, phase = seasonal_ratio(f.series, t, HORIZON, f.tuning)
        assert phase == "Daily"
        tod = (t % DAY) / 3600
        (morning if 6 <= tod < 12 else night if tod < 2.5 else []).append(ratio)
    # The trace's diurnal curve rises from 03:00 to 15:00: yesterday says so. Over one horizon
    # (195 s) it changes the load by under 1%, less than one day's bursts and prefill-heavy phases
    # move a ratio (day 1 of this history has bursts at 00:30 and 01:30 and a prefill-heavy phase
    # at 02:30), so the claim is on medians.
    assert len(morning) > 300 and len(night) > 60
    assert sorted(morning)[len(morning) // 2] > 1.005
    assert sorted(morning)[len(morning) // 2] > sorted(night)[len(night) // 2]


def test_replay_launch_day_follows_the_new_level():
    samples = recorded("demand-launch-seed1.json")
    launch = 2 * DAY + 9 * 3600
    out = dict(replay(samples))
    actual = dict(samples)
    before = [actual[t] for t in actual if launch - 1800 <= t < launch]
    after = [actual[t] for t in actual if launch + 1800 <= t < launch + 3600]
    assert sum(after) / len(after) > 1.3 * sum(before) / len(before)  # the fixture has the shift
    # Half an hour after the 10-minute ramp the forecast is on the new level (the seasonal ratio
    # is multiplicative, so the day before still shapes it), not on yesterday's.
    times = [t for t in actual if launch + 1800 <= t < launch + 3600 and t + 240 in actual]
    expected = sum(out[t].expected for t in times) / len(times)
    came = sum(actual[t + 240] for t in times) / len(times)
    assert expected == pytest.approx(came, rel=0.05)
    assert all(out[t].phase == "Daily" and out[t].upper > out[t].expected for t in times)


# ------------------------------------------------------------------ bursts


def test_seasonal_level_is_the_median_of_earlier_days_at_this_time():
    tuning = ForecastTuning()
    series = DemandSeries(60.0, 8 * DAY)
    now = 3 * DAY + 12 * 3600
    assert seasonal_level(series, now, tuning) is None  # no earlier day: no seasonal level
    for day, level in ((0, 4.0), (1, 9.0), (2, 5.0)):  # day 1 had a burst at this hour
        for k in range(10):
            series.add(day * DAY + 12 * 3600 - 600 + 60 * k, level)
    assert seasonal_level(series, now, tuning) == 5.0  # the median: one day's burst does not move it
    assert seasonal_level(series, now - 3600, tuning) is None  # nothing kept an hour earlier


@pytest.mark.parametrize("open_burst, departure, expect_open, expect_ended", [
    (None, None, None, None),  # no seasonal level yet
    (None, 1.1, None, None),  # under the onset: no burst
    (None, 1.2, Burst(100.0, 1.2), None),  # the onset (1.15)
    (Burst(40.0, 1.2), 1.8, Burst(40.0, 1.8), None),  # rising: its peak follows
    (Burst(40.0, 1.8), 1.3, Burst(40.0, 1.8), None),  # passing, still over the end (1.05)
    (Burst(40.0, 1.8), 1.0, None, Burst(40.0, 1.8, 60.0)),  # ended: kept with its length
])
def test_track_burst_opens_follows_its_peak_and_ends(open_burst, departure, expect_open, expect_ended):
    assert track_burst(open_burst, departure, 100.0, ForecastTuning()) == (expect_open, expect_ended)


def test_a_started_burst_is_forecast_at_the_learned_height_while_it_is_young():
    tuning = ForecastTuning()
    past = [Burst(0.0, p, s) for p, s in ((1.5, 600.0), (2.0, 900.0), (2.5, 1200.0), (1.8, 300.0))]
    young = Burst(1000.0, 1.3)
    assert burst_departure(young, 1.3, past, 1030.0, HORIZON, tuning) == 2.0  # the 0.75 quantile of the peaks
    assert burst_departure(young, 2.6, past, 1030.0, HORIZON, tuning) == 2.6  # higher already: the present
    assert burst_departure(None, 1.1, past, 1030.0, HORIZON, tuning) == 1.1  # no burst
    assert burst_departure(young, 1.3, past[:2], 1030.0, HORIZON, tuning) == 1.3  # too few learned
    assert burst_departure(young, 1.3, past, 1700.0, HORIZON, tuning) == 1.3  # older than the median length
    passing = Burst(1000.0, 2.4)
    assert burst_departure(passing, 1.5, past, 1100.0, HORIZON, tuning) == 1.5  # falling from its peak


def test_replay_a_started_burst_is_forecast_at_its_learned_height_not_its_slope():
    """On the recorded history, within two minutes of a burst's start (as the forecaster detects
    it), the forecast with the learned burst height covers the demand that came one horizon later
    more often than the slope alone does, and is never lower."""
    samples = recorded("demand-seasonal-seed1.json")
    actual = dict(samples)
    with_bursts, slope_only = Forecaster(), Forecaster(ForecastTuning(burst_min=10**6))
    pairs = []
    for t, d in samples:
        for f in (with_bursts, slope_only):
            f.observe(t, d)
        a, b = with_bursts.predict(t, HORIZON), slope_only.predict(t, HORIZON)
        if with_bursts.burst is not None and t - with_bursts.burst.start <= 120 and t + 240 in actual:
            pairs.append((a.expected, b.expected, actual[t + 240]))
    assert len(with_bursts.bursts) >= ForecastTuning().burst_min and len(pairs) >= 10
    assert all(a >= b - 1e-9 for a, b, _ in pairs)
    assert sum(came <= a for a, _, came in pairs) > sum(came <= b for _, b, came in pairs)


# ------------------------------------------------------------------ the rule


def test_demand_is_the_reactive_rules_unit():
    d = reactive(4, 0.875)
    assert demand_of(d, SPEC) == pytest.approx(4 * 0.875 / 0.7)
    assert demand_of(reactive(4, 0.5, ready=0), SPEC) is None


@pytest.mark.parametrize("current,kv,forecast,desired,cause", [
    (4, 0.7, fc(4.0, 4.3), 4, "reactive"),            # within tolerance of what runs: nothing added
    (4, 0.7, fc(5.0, 6.2), 7, "predictive"),          # ramp ahead: up to the upper band now
    (4, 0.7, fc(5.0, 6.2, lower=4.4), 4, "reactive"),  # the band's lower end is within tolerance: not sure
    (4, 0.7, fc(20.0, 30.0), 8, "predictive"),        # step limit max(2x, +4)
    (8, 0.7, fc(20.0, 30.0), 10, "predictive"),       # maxReplicas
    (4, 1.0, fc(4.5, 4.9), 6, "reactive"),            # reactive wants more than the forecast: reactive
    (4, 0.7, fc(9.0, None), 4, "reactive"),           # no band yet (training): reactive only
    (4, 0.7, None, 4, "reactive"),
])
def test_foresee_adds_capacity_early_and_never_below_the_reactive_rule(current, kv, forecast, desired, cause):
    d = reactive(current, kv)
    out = foresee(d, forecast, SPEC, None)
    assert (out.desired, out.cause) == (desired, cause)
    if cause == "predictive":
        assert out.act and out.direction == "up" and out.reason.startswith(f"predictive scale up {current}->")


def test_a_reactive_scale_down_stops_at_the_forecast():
    d = replace(reactive(6, 0.3), desired=3, act=True, direction="down")
    held = foresee(d, fc(4.2, 5.0), SPEC, None)
    assert (held.desired, held.direction, held.cause) == (5, "down", "predictive")
    keep = foresee(d, fc(7.0, 9.0), SPEC, None)
    assert (keep.desired, keep.act, keep.cause) == (6, False, "predictive")  # holds, never up on a down
    assert foresee(d, fc(2.0, 2.5), SPEC, None) is d  # the forecast is lower: the reactive scale-down


@settings(max_examples=300, deadline=None)
@given(current=st.integers(1, 10), kv=st.floats(0.0, 1.0), expected=st.floats(0.0, 40.0),
       spread=st.floats(0.0, 10.0), down_to=st.integers(1, 10))
def test_foresee_is_never_below_the_reactive_decision_nor_above_its_bounds(current, kv, expected, spread, down_to):
    d = reactive(current, kv)
    if down_to < current:
        d = replace(d, desired=down_to, act=True, direction="down")
    out = foresee(d, fc(expected, expected + spread), SPEC, None)
    assert out.desired >= d.desired
    assert out.desired <= max(d.desired, SPEC.maxReplicas, current)
    assert out.desired <= max(d.desired, current) or out.cause == "predictive"
    if d.desired < current:
        assert out.desired <= current  # a scale-down is never turned into a scale-up


def test_predictive_scale_ups_are_judged_needed_or_not():
    f = Forecaster()
    f.record_scale_up(0.0, HORIZON, 4)
    f.record_scale_up(10.0, HORIZON, 4)
    assert f.settle(100.0, 4.3, 0.1) == (0, 0)  # 4.3 <= 4 x 1.1: not yet
    assert f.settle(200.0, 4.5, 0.1) == (2, 0)  # the reactive rule would have scaled up for 4.5
    f.record_scale_up(300.0, HORIZON, 4)
    assert f.settle(300.0 + 2 * HORIZON - 1, 4.0, 0.1) == (0, 0)
    assert f.settle(300.0 + 2 * HORIZON + 1, None, 0.1) == (0, 1)  # two horizons, never needed
    assert f.scale_ups == []


def test_foresight_step_off_keeps_the_reactive_decision_but_publishes_the_forecast():
    samples = recorded("demand-seasonal-seed1.json")[:200]
    on, off = Forecaster(), Forecaster()
    acted = 0
    for t, d in samples:
        current = max(1, math.floor(d))
        kv = min(1.0, d * SPEC.targetKVCacheUsage / current)
        r = reactive(current, kv, now=t)
        a = foresight_step(on, r, SPEC, None, t, HORIZON)
        b = foresight_step(off, r, SPEC, None, t, HORIZON, enabled=False)
        assert b.decision is r and b.forecast is not None
        assert a.forecast == b.forecast  # the same forecast either way
        acted += a.decision is not r
    assert acted > 0  # on, the rule did change decisions on this history


def test_demand_includes_the_prefill_rules_demand_when_it_runs():
    from fewerbits_operator.autoscaler.algorithm import History, Observation, Tuning, decide
    from fewerbits_operator.autoscaler.forecast import demand_of
    from fewerbits_operator.autoscaler.metrics import PodSample

    spec = AutoscalingSpec(minReplicas=1, maxReplicas=10, targetKVCacheUsage=0.7, maxWaitingRequests=5,
                           scaleDownDelaySeconds=300)
    known = Tuning(prefill_rule=True, prefill_capacity=25_000)

    def pods(total: float) -> tuple[PodSample, ...]:
        return tuple(PodSample(f"p{i}", 0.2, 0, 10, prompt_tokens_total=total) for i in range(2))

    h = decide(spec, None, Observation(2, pods(0.0)), History(), 0, known).history
    d = decide(spec, None, Observation(2, pods(15 * 20_000)), h, 15, known)
    assert demand_of(d, spec) == pytest.approx(2 * 20_000 / 17_500)  # over KV's 2 x 0.2 / 0.7
    d = decide(spec, None, Observation(2, pods(15 * 20_000)), h, 15)
    assert demand_of(d, spec) == pytest.approx(2 * 0.2 / 0.7)
