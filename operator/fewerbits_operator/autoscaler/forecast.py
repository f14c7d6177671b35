"""Foresight for the autoscaler (issue 33): forecast a variant's demand one pod start-up ahead from
its own history, and add capacity early for the forecast's upper band (docs/autoscaling.md).

A vLLM pod serves minutes after it is created (image pull, weights, CUDA graphs: 180 s in the
bench, more for a 70B pull), so a scaler that sees only the present orders every ramp's capacity
one start-up late. This module adds one rule after ``algorithm.decide``:

- **Demand** is measured in the reactive rule's own unit, replicas at the KV target:
  ``max(ready x avgKV / target, queue_wants)`` (``demand_of``), once per pass.
- **The forecast** (``forecast``) at ``now + horizon`` (horizon: the variant's measured pod
  start-up plus one sync) is the present level (a line fitted to the last few minutes) times the
  daily seasonal ratio (the median over the last days of demand at the target time of day over
  demand at this time of day), blended with the same-weekday ratio of a week ago once a week is
  kept, plus the part of the recent slope the season does not explain (bursts, launches),
  damped. Before a day of history the seasonal ratio is 1 (trend only).
- **Bursts** (``track_burst``, ``burst_departure``): once a day is kept, a burst opens when the
  present level is 1.15x what earlier days saw at this time of day (``seasonal_level``) and ends
  under 1.05x; each ended one is kept (its peak over the seasonal level, its length; the last 64).
  While a burst is younger than the median past length and not yet falling from its peak, the
  forecast is at least the seasonal level times the 0.75 quantile of the past peaks: a burst that
  has started is forecast at the height past ones reached, not only its slope so far.
- **The band** is the forecast's own realised error: every forecast is checked against the demand
  measured when its time comes, and the upper band is the expected value plus the 90th percentile
  of the relative errors of the last day. No band (and so no action) before ``min_errors`` have
  been measured.
- **The rule** (``foresee``): when even the band's lower end exceeds the current replicas
  (starting pods included) by more than the reactive rule's tolerance, scale up now to the upper
  end (same step limit and bounds as ``decide``); a reactive scale-down stops at the forecast's
  expected value. The forecast only ever adds capacity early or holds it; it never removes any,
  and never holds back a reactive scale-up.

History is kept in the operator, in a bounded ring buffer per variant (``DemandSeries``: one
bucket a minute, 8 days, ~270 KiB), not read from Prometheus: the autoscaler's default metrics
source scrapes the pods directly (Prometheus is optional), and a week of history per variant per
pass would be a range query of 10,080 points every 15 s. A restart loses it: the variant scales
reactively until ``min_errors`` forecasts have been checked (~1 h), trend only until a day is
kept, and without the weekly term until a week is.

Why not statsmodels' Holt-Winters: its ``ExponentialSmoothing`` models one seasonal period (daily
and weekly at one-minute resolution are 1,440 and 10,080 seasonal states to estimate), and it
pulls numpy, scipy, pandas and patsy into the operator image: 258 MB installed (77 MB of wheels)
on an image of 252 MB today (docs/autoscaling.md has the figures). The ratio forecast above is
what a multiplicative Holt-Winters with its level reset to the present computes for a horizon of a
few minutes, in ~100 lines of the standard library.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass, replace
from typing import Literal

from fewerbits_api.quantizedmodel import AutoscalingSpec

from fewerbits_operator.autoscaler.algorithm import Decision, Tuning, bounds

EPS = 1e-9
DAY = 86400.0
WEEK = 7 * DAY


@dataclass(frozen=True)
class ForecastTuning:
    """Knobs of the forecast that are not in the API (the defaults are the documented method)."""

    bucket_seconds: float = 60.0
    """Resolution of the kept history."""
    keep_seconds: float = WEEK + DAY
    """History kept per variant: a week and a day (the weekly ratio needs a week plus the horizon)."""
    level_seconds: float = 120.0
    """The present level and slope: a line fitted to the raw samples of this long (8 passes: a
    burst's ramp shows within a minute; longer windows saw it too late in the bench)."""
    season_seconds: float = 600.0
    """Earlier days are compared on means over this long (a single minute is too noisy)."""
    season_days: int = 7
    """Days of the daily ratio (their median, so one day's burst does not move it)."""
    trend_damping: float = 1.0
    """Share of the slope the season does not explain that is extrapolated over the horizon."""
    trend_z: float = 2.0
    """The slope counts only when it is this many standard errors from zero (noise is no trend)."""
    band_quantile: float = 0.9
    """The upper band: this quantile of the realised relative errors."""
    min_errors: int = 60
    """Checked forecasts (one a minute) needed before the band exists and the rule acts."""
    error_keep: int = 1440
    """Checked forecasts kept for the band (one a minute: a day)."""
    unneeded_window_factor: float = 2.0
    """A predictive scale-up is judged over this many horizons after it (``Forecaster.settle``)."""
    burst_onset: float = 1.15
    """A burst starts when the present level is this many times what earlier days saw at this time
    of day (``seasonal_level``)..."""
    burst_end: float = 1.05
    """...and ends when it falls back under this many times."""
    burst_quantile: float = 0.75
    """A started burst is forecast to reach this quantile of the peaks (over their seasonal level)
    of the variant's past bursts..."""
    burst_min: int = 3
    """...once this many bursts have been measured..."""
    burst_keep: int = 64
    """...of the last this many..."""
    burst_passing: float = 0.8
    """...until it falls under this share of its own peak so far (it is passing: no lift)."""


class DemandSeries:
    """A bounded ring buffer of per-bucket demand means (the history of one variant)."""

    def __init__(self, bucket_seconds: float, keep_seconds: float):
        self.bucket = bucket_seconds
        self.size = max(1, int(keep_seconds // bucket_seconds))
        self._ids = array("q", [-1]) * self.size
        self._sums = array("d", [0.0]) * self.size
        self._counts = array("q", [0]) * self.size
        self.first: float | None = None

    def add(self, t: float, value: float) -> None:
        b = int(t // self.bucket)
        i = b % self.size
        if self._ids[i] != b:
            self._ids[i], self._sums[i], self._counts[i] = b, 0.0, 0
        self._sums[i] += value
        self._counts[i] += 1
        if self.first is None or t < self.first:
            self.first = t

    def mean(self, start: float, end: float) -> float | None:
        """Mean of the bucket means whose bucket starts in [start, end); None without data."""
        total, n = 0.0, 0
        for b in range(math.ceil(start / self.bucket - EPS), math.ceil(end / self.bucket - EPS)):
            i = b % self.size
            if self._ids[i] == b and self._counts[i]:
                total += self._sums[i] / self._counts[i]
                n += 1
        return total / n if n else None

    def span(self, now: float) -> float:
        return 0.0 if self.first is None else max(0.0, now - self.first)


@dataclass(frozen=True)
class Forecast:
    """Demand (replicas at the KV target) one horizon ahead, with its band."""

    phase: Literal["Training", "Trend", "Daily", "Weekly"]
    """`Training`: too few checked forecasts for a band, no action. `Trend`: under a day of
    history, the recent trend only. `Daily`/`Weekly`: the seasonal ratios in use."""
    history_seconds: float
    horizon_seconds: float
    demand: float
    """The present level."""
    expected: float
    upper: float | None
    lower: float | None
    checked: int
    """Forecasts checked against what came (the band's sample)."""
    since: float | None = None
    """The oldest sample kept (the history starts again after an operator restart)."""


def fit_line(points: deque[tuple[float, float]] | list[tuple[float, float]], now: float) -> tuple[float, float, float]:
    """Least-squares line through (t, y): (value at ``now``, slope per second, the slope's
    standard error); a flat line through the last point with fewer than 3 points."""
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if n < 3 or var <= EPS:
        return points[-1][1], 0.0, math.inf
    slope = sum((t - mt) * (y - my) for t, y in points) / var
    resid = sum((y - my - slope * (t - mt)) ** 2 for t, y in points)
    return my + slope * (now - mt), slope, math.sqrt(resid / (n - 2) / var)


def seasonal_ratio(series: DemandSeries, now: float, horizon: float, tuning: ForecastTuning) -> tuple[float, str]:
    """Demand at ``now + horizon`` over demand now, as earlier days saw it: the median of the daily
    ratios of the last ``season_days``, averaged with a week ago's once a week is kept."""
    w = tuning.season_seconds

    def ratio(back: float) -> float | None:
        base = series.mean(now - back - w, now - back)
        ahead = series.mean(now + horizon - back - w, now + horizon - back)
        if base is None or ahead is None:
            return None
        return (ahead + 0.5) / (base + 0.5)  # +0.5 replica: no blow-up near zero load

    daily = sorted(r for k in range(1, tuning.season_days + 1) if (r := ratio(k * DAY)) is not None)
    if not daily:
        return 1.0, "Trend"
    mid = len(daily) // 2
    r_day = daily[mid] if len(daily) % 2 else (daily[mid - 1] + daily[mid]) / 2
    r_week = ratio(WEEK) if series.span(now) >= WEEK + horizon else None
    if r_week is None:
        return r_day, "Daily"
    return (r_day + r_week) / 2, "Weekly"


def seasonal_level(series: DemandSeries, now: float, tuning: ForecastTuning) -> float | None:
    """The demand earlier days saw at this time of day: the median over the last ``season_days``
    of the mean over ``season_seconds`` up to this time; None under a day of history."""
    w = tuning.season_seconds
    seen = sorted(m for k in range(1, tuning.season_days + 1)
                  if (m := series.mean(now - k * DAY - w, now - k * DAY)) is not None)
    if not seen:
        return None
    mid = len(seen) // 2
    return seen[mid] if len(seen) % 2 else (seen[mid - 1] + seen[mid]) / 2


@dataclass(frozen=True)
class Burst:
    """A departure of the demand from the season: when it started, its peak so far (the level over
    the seasonal level), and the seconds it lasted (once it ended)."""

    start: float
    peak: float
    seconds: float | None = None


def track_burst(open_burst: Burst | None, departure: float | None, now: float,
                tuning: ForecastTuning) -> tuple[Burst | None, Burst | None]:
    """One pass of burst detection on ``departure`` (the level over the seasonal level):
    (the burst open after it, the burst that ended in it)."""
    if departure is None:
        return None, None
    if open_burst is None:
        return (Burst(now, departure), None) if departure >= tuning.burst_onset else (None, None)
    if departure < tuning.burst_end:
        return None, replace(open_burst, seconds=now - open_burst.start)
    return replace(open_burst, peak=max(open_burst.peak, departure)), None


def burst_departure(open_burst: Burst | None, departure: float, past: list[Burst], now: float,
                    horizon: float, tuning: ForecastTuning) -> float:
    """The departure from the season expected one ``horizon`` ahead: for a burst that has started
    and still rises or holds, the ``burst_quantile`` of the past bursts' peaks while it is younger
    than their typical (median) length; else the present departure (no burst, or it is passing)."""
    if open_burst is None or len(past) < tuning.burst_min or departure < tuning.burst_passing * open_burst.peak:
        return departure
    peaks = sorted(b.peak for b in past)
    lengths = sorted(b.seconds or 0.0 for b in past)
    if now + horizon - open_burst.start > quantile(lengths, 0.5):
        return departure
    return max(departure, quantile(peaks, tuning.burst_quantile))


def quantile(sorted_values: list[float], q: float) -> float:
    k = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


class Forecaster:
    """The forecast state of one variant: its history, its recent samples, the forecasts waiting to
    be checked and their realised errors, and the predictive scale-ups waiting to be judged. No I/O
    and no clock: the loop and the bench feed it the same way."""

    def __init__(self, tuning: ForecastTuning = ForecastTuning()):
        self.tuning = tuning
        self.series = DemandSeries(tuning.bucket_seconds, tuning.keep_seconds)
        self.recent: deque[tuple[float, float]] = deque()
        self.pending: deque[tuple[float, float]] = deque()
        """(due time, expected demand), one a bucket."""
        self.errors: deque[float] = deque(maxlen=tuning.error_keep)
        self._sorted: list[float] = []
        self._last_pending_bucket: int | None = None
        self.scale_ups: list[tuple[float, float, int]] = []
        """Predictive scale-ups to judge: (time, horizon, replicas before)."""
        self.burst: Burst | None = None
        self.bursts: deque[Burst] = deque(maxlen=tuning.burst_keep)
        """The variant's past bursts (``track_burst``): what a started one will look like."""

    # -------------------------------------------------------------- feeding

    def observe(self, now: float, demand: float) -> None:
        """One pass's demand (``demand_of``)."""
        self.series.add(now, demand)
        self.recent.append((now, demand))
        while self.recent and self.recent[0][0] < now - self.tuning.level_seconds:
            self.recent.popleft()
        while self.pending and self.pending[0][0] <= now:
            _, expected = self.pending.popleft()
            error = (demand - expected) / max(expected, 1.0)
            if len(self.errors) == self.errors.maxlen:
                self._sorted.pop(bisect_left(self._sorted, self.errors[0]))  # the one leaving the deque
            self.errors.append(error)
            insort(self._sorted, error)

    def predict(self, now: float, horizon: float) -> Forecast | None:
        """The forecast at ``now + horizon``; None before any demand was observed. Every call (one
        kept a bucket) is checked later against the demand that came, and tracks the bursts: call
        it once a pass."""
        if not self.recent:
            return None
        t = self.tuning
        level, slope, slope_se = fit_line(self.recent, now)
        if abs(slope) < t.trend_z * slope_se:
            slope = 0.0  # not distinguishable from the noise: no trend
        level = max(0.0, level)
        ratio, phase = seasonal_ratio(self.series, now, horizon, t)
        seasonal_slope = level * (ratio - 1.0) / horizon if horizon > 0 else 0.0
        expected = max(0.0, level * ratio + t.trend_damping * (slope - seasonal_slope) * horizon)
        expected = max(expected, self._burst_expected(now, horizon, level, ratio))
        bucket = int(now // t.bucket_seconds)
        if bucket != self._last_pending_bucket:
            self.pending.append((now + horizon, expected))
            self._last_pending_bucket = bucket
        checked = len(self._sorted)
        if checked < t.min_errors:
            return Forecast("Training", self.series.span(now), horizon, level, expected, None, None, checked,
                            self.series.first)
        scale = max(expected, 1.0)
        upper = expected + max(0.0, quantile(self._sorted, t.band_quantile)) * scale
        lower = max(0.0, expected + min(0.0, quantile(self._sorted, 1.0 - t.band_quantile)) * scale)
        return Forecast(phase, self.series.span(now), horizon, level, expected, upper, lower, checked,
                        self.series.first)

    def _burst_expected(self, now: float, horizon: float, level: float, ratio: float) -> float:
        """The demand one ``horizon`` ahead if a started burst reaches the height past ones did
        (``burst_departure``; 0 without a seasonal level). Tracks the bursts as it goes: called
        once a pass, by ``predict``."""
        base = seasonal_level(self.series, now, self.tuning)
        departure = None if base is None else (level + 0.5) / (base + 0.5)  # +0.5: as seasonal_ratio
        self.burst, ended = track_burst(self.burst, departure, now, self.tuning)
        if ended is not None:
            self.bursts.append(ended)
        if base is None or departure is None:
            return 0.0
        ahead = burst_departure(self.burst, departure, list(self.bursts), now, horizon, self.tuning)
        return (base + 0.5) * ahead * ratio - 0.5

    # -------------------------------------------------------------- judging

    def record_scale_up(self, now: float, horizon: float, before: int) -> None:
        self.scale_ups.append((now, horizon, before))

    def settle(self, now: float, demand: float | None, tolerance: float) -> tuple[int, int]:
        """Judge the predictive scale-ups: one was needed once the demand exceeded what the replicas
        it started from hold within the reactive rule's tolerance (``before x (1 + tolerance)``:
        the reactive rule would have scaled up for it); it was not needed when that never happened
        within ``unneeded_window_factor`` horizons. Returns (needed, not needed) judged now."""
        needed = unneeded = 0
        keep = []
        for at, horizon, before in self.scale_ups:
            if demand is not None and demand > before * (1 + tolerance) + EPS:
                needed += 1
            elif now - at > self.tuning.unneeded_window_factor * horizon:
                unneeded += 1
            else:
                keep.append((at, horizon, before))
        self.scale_ups = keep
        return needed, unneeded


def demand_of(d: Decision, spec: AutoscalingSpec) -> float | None:
    """The reactive rule's demand this instant, in replicas at the KV target and unrounded:
    ``max(ready x avgKV / target, queue_wants)``; None without samples."""
    if d.avg_kv is None:
        return None
    ready = d.figures.get("ready", 0.0)
    return max(ready * d.avg_kv / spec.targetKVCacheUsage, float(d.queue_wants or 0),
               d.figures.get("prefill_demand", 0.0))


def foresee(d: Decision, fc: Forecast | None, spec: AutoscalingSpec, policy_max: int | None,
            tuning: Tuning = Tuning()) -> Decision:
    """``d`` (the reactive decision) with capacity added early: when even the lower end of the
    forecast's band exceeds the current replicas (starting pods included) by more than the
    reactive rule's tolerance -- the KV rule applied one horizon ahead, on the forecast's
    confident side -- scale up to the upper band, ``ceil(upper)``, within the step limit and
    bounds; and a reactive scale-down stops at ``ceil(expected)``. Never lower than ``d.desired``
    when it scales up or holds; unchanged without a band or outside the bounds.

    Why the lower end triggers: triggered by the expected value, about 70% of the scale-ups in the
    bench were not needed (noise read as a ramp) and each holds a replica through its start-up;
    triggered by the lower end, about 25% (docs/autoscaling.md)."""
    lo, hi = bounds(spec, policy_max)
    cur = d.current
    if fc is None or fc.upper is None or fc.lower is None or not lo <= cur <= hi:
        return d
    why = (f"forecast {fc.expected:.1f} replicas (upper {fc.upper:.1f}) in {fc.horizon_seconds:.0f}s, "
           f"{fc.phase.lower()}")
    if d.desired < cur:
        floor = min(cur, hi, math.ceil(fc.expected - EPS))
        if floor <= d.desired:
            return d
        direction = "down" if floor < cur else None
        verb = f"scale down {cur}->{floor}" if floor < cur else f"hold {cur}"
        return replace(d, desired=floor, act=floor != cur, direction=direction, cause="predictive",
                       reason=f"{verb}: {why} (reactive: {d.desired}); {d.reason}")
    if fc.lower <= cur * (1 + tuning.tolerance) + EPS:
        return d
    limit = max(math.ceil(cur * tuning.max_scale_up_factor - EPS), cur + tuning.max_scale_up_add)
    want = min(hi, math.ceil(fc.upper - EPS), limit)
    if want <= d.desired:
        return d
    return replace(d, desired=want, act=True, direction="up", cause="predictive",
                   reason=f"predictive scale up {cur}->{want}: {why}; {d.reason}")


@dataclass(frozen=True)
class Foresight:
    """What one pass of the predictive rule did for one variant."""

    decision: Decision
    """The decision to act on (the reactive one, or with capacity added or held by the forecast)."""
    forecast: Forecast | None
    needed: int = 0
    unneeded: int = 0
    """Earlier predictive scale-ups judged in this pass (``Forecaster.settle``)."""


def foresight_step(forecaster: Forecaster, d: Decision, spec: AutoscalingSpec, policy_max: int | None, now: float,
                   horizon: float, enabled: bool = True, tuning: Tuning = Tuning()) -> Foresight:
    """One pass of the predictive rule after ``algorithm.decide``, the same in the operator's loop
    and in the bench: record this pass's demand, judge earlier predictive scale-ups, forecast one
    ``horizon`` ahead and apply ``foresee``. With ``enabled`` false the history is still kept and
    the forecast still published (so turning it on acts at once), but the decision is the
    reactive one."""
    demand = demand_of(d, spec)
    if demand is not None:
        forecaster.observe(now, demand)
    needed, unneeded = forecaster.settle(now, demand, tuning.tolerance)
    fc = forecaster.predict(now, horizon)
    out = foresee(d, fc, spec, policy_max, tuning) if enabled else d
    if out.cause == "predictive" and out.act and out.desired > d.current:
        forecaster.record_scale_up(now, horizon, d.current)
    return Foresight(out, fc, needed, unneeded)
