"""Trace-driven simulation of one variant under two autoscaling policies (issue 8).

    python bench/bench_autoscaler.py [--seed N] [--hours H]

Compares fewerbits' policy (``fewerbits_operator.autoscaler.algorithm.decide``, the code the
operator runs) with a plain threshold policy configured like AIBrix's KPA-style KV autoscaler:
KV metric only, scale up when the 60 s (panic window) average KV exceeds target +10%, scale down
when the 180 s (stable window) average is below target -10% and 300 s have passed since the last
scaling, both to ceil(ready x avgKV / target). Reports GPU-hours and minutes saturated (average KV
above 0.95, or any request waiting), each as a ratio ours / baseline, measured in the same run on
the same trace.

The trace: 24 h at 15 s steps, a diurnal curve (trough 25% of peak at 03:00, peak at 15:00) with
Poisson bursts (x1.5-2.5 for 5-20 min) and a few prefill-heavy phases (RAG/batch jobs: 8k-token
prompts, 50-token answers) where vLLM is bound by prefill compute with its KV cache a third full.

A replica is a fluid queue with three limits: KV cache (150k tokens), 128 concurrent sequences,
and 25k prefill tokens/s. In-flight sequences follow Little's law (served rate x duration), so
KV usage = in-flight KV tokens / capacity, running = in-flight sequences, waiting = backlog. A new
pod serves 180 s after it is created (image pull, weights, CUDA graphs) and costs GPU time from
creation. The Service spreads load evenly over ready pods; each pod's reported KV carries +-0.03
noise (imbalance, scrape timing).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import sys
import time
from dataclasses import dataclass, field

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", d) for d in ("operator", "crds")]

from fewerbits_api.quantizedmodel import AutoscalingSpec  # noqa: E402
from fewerbits_operator.autoscaler.algorithm import Decision, History, Observation, Tuning, bounds, decide  # noqa: E402
from fewerbits_operator.autoscaler.capacity import PoolEconomics, rebalance  # noqa: E402
from fewerbits_operator.autoscaler.forecast import Forecaster, ForecastTuning, foresight_step  # noqa: E402
from fewerbits_operator.autoscaler.metrics import PodSample  # noqa: E402

DT = 15.0
STARTUP_S = 180.0
KV_TOKENS = 150_000
MAX_SEQS = 128
PREFILL_TOKENS_PER_S = 25_000
DECODE_TOKENS_PER_S = 30.0
KV_NOISE = 0.03
SPEC = AutoscalingSpec(minReplicas=1, maxReplicas=24, targetKVCacheUsage=0.7, maxWaitingRequests=5,
                       scaleDownDelaySeconds=300)


@dataclass(frozen=True)
class PoolSpec:
    """One replica of a GPU pool in the fluid model; the defaults are the single-pool bench's H100."""

    name: str = "h100"
    product: str = "NVIDIA-H100-80GB-HBM3"
    kv_tokens: float = KV_TOKENS
    max_seqs: int = MAX_SEQS
    prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S
    decode_tokens_per_s: float = DECODE_TOKENS_PER_S
    """Per sequence, in a full batch."""
    cost: float = 1.0
    """Cost of one replica per hour, relative (the GPU cost weight)."""
    bandwidth_gbps: float = 3350.0
    """What the planner's decode estimate scales with (planner/catalog.py)."""


H100 = PoolSpec()


@dataclass(frozen=True)
class RequestClass:
    name: str
    prompt: int
    output: int

    def duration_on(self, pool: PoolSpec) -> float:
        return self.prompt / pool.prefill_tokens_per_s + self.output / pool.decode_tokens_per_s

    def kv_on(self, pool: PoolSpec) -> float:
        """Fraction of one replica's KV cache a sequence holds on average over its life."""
        return (self.prompt + self.output / 2) / pool.kv_tokens

    @property
    def duration(self) -> float:
        return self.duration_on(H100)

    @property
    def kv(self) -> float:
        return self.kv_on(H100)


CHAT = RequestClass("chat", 1500, 350)   # KV-bound: ~7.4 req/s per replica at full KV
RAG = RequestClass("rag", 8000, 50)      # prefill-bound: ~3.1 req/s per replica, KV ~0.33 then
CLASSES = (CHAT, RAG)


# ------------------------------------------------------------------ trace


DAY_S = 86400.0
SHAPES = ("seasonal", "launch", "flat")
LAUNCH_DAY = 2
"""The level-shift trace: from 09:00 of this day (0-based: the third) the load is x LAUNCH_FACTOR."""
LAUNCH_FACTOR = 1.5


def make_trace(seed: int, hours: float, shape: str = "seasonal") -> list[tuple[float, float]]:
    """Arrival rates (chat, rag) in requests/s for each step. ``seasonal``: the diurnal curve every
    day (the first 24 h are issue 8's trace); ``launch``: the same, with the load x1.5 from 09:00
    of the third day on (a launch: a 10-minute ramp, then a new level that stays); ``flat``: no
    seasonality, the curve's mean all day (bursts and prefill-heavy phases as in the others)."""
    events = trace_events(seed, hours, shape)
    return [rates_at(k * DT, shape, events) for k in range(int(hours * 3600 / DT))]


@dataclass(frozen=True)
class TraceEvents:
    """The random parts of a trace: bursts (start, length, multiplier) and prefill-heavy phases
    (start, length, rag rate), each sorted by start."""

    bursts: tuple[tuple[float, float, float], ...]
    rag_phases: tuple[tuple[float, float, float], ...]


def trace_events(seed: int, hours: float, shape: str = "seasonal") -> TraceEvents:
    """Draw the bursts and prefill-heavy phases of ``make_trace``'s trace."""
    if shape not in SHAPES:
        raise ValueError(f"trace shape {shape!r}: expected one of {', '.join(SHAPES)}")
    bursts, rag_phases = [], []
    for day in range(math.ceil(hours / 24)):
        # Day 1 draws from random.Random(seed) exactly as issue 8's 24 h trace did; each later day
        # from its own generator, so a longer trace starts with the same day.
        rng = random.Random(seed if day == 0 else seed * 1000 + day)
        start, end = day * DAY_S, min(hours * 3600, (day + 1) * DAY_S)
        t = start + rng.expovariate(8 / 86400)
        while t < end:
            bursts.append((t, rng.uniform(300, 1200), rng.uniform(1.5, 2.5)))
            t += rng.expovariate(8 / 86400)
        t = start + rng.expovariate(3 / 86400)
        while t < end:
            rag_phases.append((t, rng.uniform(1800, 3600), rng.uniform(8.0, 14.0)))
            t += rng.expovariate(3 / 86400)
    return TraceEvents(tuple(bursts), tuple(rag_phases))


def rates_at(t: float, shape: str, events: TraceEvents, known_until: float = math.inf) -> tuple[float, float]:
    """Arrival rates (chat, rag) at ``t``. With ``known_until``, as a forecast made then could
    know them at best: the deterministic parts (the diurnal curve), and only the bursts, phases
    and launch that had started by ``known_until`` (their height and length included)."""
    peak_chat = 38.0  # about 7-8 replicas at the 0.7 target
    day = (t % 86400) / 86400
    diurnal = 0.25 + 0.75 * (0.5 - 0.5 * math.cos(2 * math.pi * (day - 3 / 24)))
    if shape == "flat":
        diurnal = 0.625  # the diurnal curve's mean
    elif shape == "launch":
        launch = LAUNCH_DAY * DAY_S + 9 * 3600
        if launch <= known_until:
            diurnal *= 1 + (LAUNCH_FACTOR - 1) * min(1.0, max(0.0, (t - launch) / 600))
    mult = 1.0
    for start, length, m in events.bursts:
        if start > known_until:
            break
        if start <= t < start + length:
            ramp = min(1.0, (t - start) / 120, (start + length - t) / 120)
            mult = max(mult, 1 + (m - 1) * ramp)
    rag = 0.6 * diurnal
    for start, length, r in events.rag_phases:
        if start > known_until:
            break
        if start <= t < start + length:
            rag = max(rag, r * min(1.0, (t - start) / 300))
    return (peak_chat * diurnal * mult, rag * mult)


# ------------------------------------------------------------------ cluster


def draw(rates: tuple[float, float], rng: random.Random) -> list[float]:
    """Arrivals of one step for each request class."""
    arrivals = [rng.gauss(r * DT, math.sqrt(r * DT)) if r * DT > 30 else _poisson(rng, r * DT) for r in rates]
    return [max(0.0, a) for a in arrivals]


@dataclass
class Variant:
    """The fluid model of one variant's replicas."""

    replicas: int = 2
    ready_at: list[float] = field(default_factory=lambda: [-1e9, -1e9])
    backlog: list[float] = field(default_factory=lambda: [0.0, 0.0])
    inflight: list[float] = field(default_factory=lambda: [0.0, 0.0])
    pool: PoolSpec = H100
    prompt_per_pod: float = 0.0
    """``vllm:prompt_tokens_total`` of every ready pod (the Service spreads load evenly): the
    prompt tokens served per ready pod, summed over the steps. A pod that becomes ready shows it
    too: its first sample has no earlier one to take a rate against."""

    def ready(self, t: float) -> int:
        return sum(1 for r in self.ready_at if r <= t)

    def scale(self, t: float, desired: int) -> None:
        if desired > self.replicas:
            self.ready_at += [t + STARTUP_S] * (desired - self.replicas)
        elif desired < self.replicas:
            # Kubernetes removes not-ready pods first, then the newest.
            self.ready_at = sorted(self.ready_at)[:desired]
        self.replicas = desired

    def capacity(self, mix: list[float]) -> float:
        """Requests/s one replica serves at most for this mix of classes (its tightest limit)."""
        total = sum(mix)
        if total <= 0:
            return 0.0
        share = [m / total for m in mix]
        p = self.pool
        kv = sum(share[i] * CLASSES[i].duration_on(p) * CLASSES[i].kv_on(p) for i in range(2))
        seqs = sum(share[i] * CLASSES[i].duration_on(p) for i in range(2)) / p.max_seqs
        prefill = sum(share[i] * CLASSES[i].prompt for i in range(2)) / p.prefill_tokens_per_s
        return 1.0 / max(kv, seqs, prefill)

    def step(self, t: float, rates: tuple[float, float], rng: random.Random) -> None:
        self.serve(t, draw(rates, rng))

    def serve(self, t: float, arrivals: list[float]) -> None:
        ready = self.ready(t)
        p = self.pool
        # Offered rate this step: new arrivals plus the backlog, per second.
        offered = [(self.backlog[i] + arrivals[i]) / DT for i in range(2)]
        if ready == 0:
            self.backlog = [self.backlog[i] + arrivals[i] for i in range(2)]
            self.inflight = [0.0, 0.0]
            return
        kv_need = sum(offered[i] * CLASSES[i].duration_on(p) * CLASSES[i].kv_on(p) for i in range(2))
        seq_need = sum(offered[i] * CLASSES[i].duration_on(p) for i in range(2))
        prefill_need = sum(offered[i] * CLASSES[i].prompt for i in range(2))
        alpha = min(1.0,
                    ready * 1.0 / kv_need if kv_need else 1.0,
                    ready * p.max_seqs / seq_need if seq_need else 1.0,
                    ready * p.prefill_tokens_per_s / prefill_need if prefill_need else 1.0)
        served = [alpha * o for o in offered]
        self.prompt_per_pod += sum(served[i] * CLASSES[i].prompt for i in range(2)) * DT / ready
        self.inflight = [served[i] * CLASSES[i].duration_on(p) for i in range(2)]
        self.backlog = [max(0.0, (offered[i] - served[i]) * DT) for i in range(2)]

    def samples(self, t: float, rng: random.Random) -> list[PodSample]:
        ready = self.ready(t)
        if not ready:
            return []
        kv = sum(self.inflight[i] * CLASSES[i].kv_on(self.pool) for i in range(2)) / ready
        running = sum(self.inflight) / ready
        waiting = sum(self.backlog) / ready
        return [PodSample(f"p{j}", min(1.0, max(0.0, kv + rng.uniform(-KV_NOISE, KV_NOISE))), waiting, running,
                          prompt_tokens_total=self.prompt_per_pod)
                for j in range(ready)]

    def kv_true(self, t: float) -> float:
        ready = self.ready(t)
        return sum(self.inflight[i] * CLASSES[i].kv_on(self.pool) for i in range(2)) / ready if ready else 1.0


def _poisson(rng: random.Random, lam: float) -> float:
    if lam <= 0:
        return 0.0
    k, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p <= limit:
            return float(k)
        k += 1


# ------------------------------------------------------------------ policies


class Fewerbits:
    name = "fewerbits (KV + queue, HPA-style window)"

    def __init__(self, spec: AutoscalingSpec = SPEC, tuning: Tuning = Tuning()):
        self.spec = spec
        self.tuning = tuning
        self.history = History()
        self.last: tuple[Decision, Observation] | None = None

    def desired(self, t: float, v: Variant, samples: list[PodSample]) -> int:
        ready = v.ready(t)
        obs = Observation(v.replicas, tuple(samples), 0, v.replicas - ready)
        d = decide(self.spec, None, obs, self.history, t, self.tuning)
        self.history = d.history
        self.last = (d, obs)
        return d.desired


class Predictive(Fewerbits):
    """The operator's reactive decision followed by its predictive rule (``forecast.foresight_step``,
    the function the loop runs), forecasting one pod start-up plus one sync ahead."""

    name = "fewerbits predictive (forecast one start-up ahead)"

    def __init__(self, spec: AutoscalingSpec = SPEC, tuning: ForecastTuning = ForecastTuning(),
                 algorithm: Tuning = Tuning()):
        super().__init__(spec, algorithm)
        self.forecaster = Forecaster(tuning)
        self.scale_ups = self.unneeded = 0

    def desired(self, t: float, v: Variant, samples: list[PodSample]) -> int:
        ready = v.ready(t)
        obs = Observation(v.replicas, tuple(samples), 0, v.replicas - ready)
        d = decide(self.spec, None, obs, self.history, t, self.tuning)
        self.history = d.history
        step = foresight_step(self.forecaster, d, self.spec, None, t, STARTUP_S + DT, tuning=self.tuning)
        self.unneeded += step.unneeded
        if step.decision.cause == "predictive" and step.decision.desired > d.current:
            self.scale_ups += 1
        self.last = (step.decision, obs)
        return step.decision.desired


class Threshold:
    """AIBrix-style KPA on KV only: 60 s panic / 180 s stable averages, +-10% band, 300 s cooldown."""

    def __init__(self, spec: AutoscalingSpec = SPEC, name: str | None = None, cooldown: float = 300.0):
        self.spec = spec
        self.cooldown = cooldown
        self.name = name or f"threshold (KV only, target {spec.targetKVCacheUsage:.2f})"
        self.window: list[tuple[float, float]] = []
        self.last_scale = -1e9

    def desired(self, t: float, v: Variant, samples: list[PodSample]) -> int:
        if samples:
            self.window.append((t, sum(s.kv_cache_usage for s in samples) / len(samples)))
        self.window = [(ts, x) for ts, x in self.window if ts > t - 180]
        ready = v.ready(t)
        cur = v.replicas
        target = self.spec.targetKVCacheUsage
        if not self.window or not ready:
            return max(cur, self.spec.minReplicas)
        stable = sum(x for _, x in self.window) / len(self.window)
        panic_w = [x for ts, x in self.window if ts > t - 60]
        panic = sum(panic_w) / len(panic_w)
        want = cur
        if panic > target * 1.1:
            want = max(cur, math.ceil(ready * panic / target))
        elif stable < target * 0.9 and t - self.last_scale >= self.cooldown:
            want = min(cur, math.ceil(ready * stable / target))
        want = min(max(want, self.spec.minReplicas), self.spec.maxReplicas)
        if want != cur:
            self.last_scale = t
        return want


# ------------------------------------------------------------------ run


@dataclass
class Result:
    name: str
    gpu_hours: float
    saturated_min: float
    queued_request_min: float
    scale_events: int
    peak_replicas: int


def simulate(policy, trace: list[tuple[float, float]], seed: int) -> Result:
    """The whole trace."""
    return simulate_periods(policy, trace, seed, len(trace) * DT)[0]


def simulate_periods(policy, trace: list[tuple[float, float]], seed: int, split_s: float) -> tuple[Result, Result]:
    """One run, its figures split at ``split_s``: (before, from then on). The multi-day bench
    splits after the first day, which trains the forecast."""
    arrivals_rng = random.Random(seed * 7919 + 1)  # the same arrivals for every policy
    noise_rng = random.Random(seed * 7919 + 2)
    v = Variant()
    acc = [[0.0, 0.0, 0.0, 0, 0], [0.0, 0.0, 0.0, 0, 0]]  # gpu_s, sat_s, queued, events, peak
    for k, rates in enumerate(trace):
        t = k * DT
        a = acc[0 if t < split_s else 1]
        v.step(t, rates, arrivals_rng)
        a[0] += v.replicas * DT
        backlog = sum(v.backlog)
        if v.kv_true(t) > 0.95 or backlog >= 1.0:
            a[1] += DT
        a[2] += backlog * DT / 60
        want = policy.desired(t, v, v.samples(t, noise_rng))
        if want != v.replicas:
            a[3] += 1
            v.scale(t, want)
        a[4] = max(a[4], v.replicas)
    return tuple(Result(policy.name, g / 3600, s / 60, q, e, p) for g, s, q, e, p in acc)


def _replicas(load: float, u: float) -> int:
    """Replicas that serve ``load`` (replicas at full utilisation) at utilisation ``u``."""
    return math.ceil(load / u - 1e-9)


class Oracle:
    """The bound: a policy that knows the trace. At each step it holds the replicas the mean load of
    the next ``STARTUP_S`` + 2 steps needs at utilisation ``u`` of a replica's capacity (for that
    step's mix of requests), ordering them one start-up ahead and releasing them at once. No
    online policy sees the future, so the oracle's GPU-hours at a given saturation are a lower
    bound for any policy's (up to the Poisson noise of the arrivals, which it does not know).
    With ``foresight=False`` it sees only the present load, exactly (no noise, no averaging, no
    delay to scale down): the bound for any policy that reacts to what it measures, as every
    metrics-driven autoscaler does."""

    def __init__(self, trace: list[tuple[float, float]], u: float, foresight: bool = True):
        self.u = u
        self.name = (f"oracle (knows the trace, utilisation {u:.2f})" if foresight
                     else f"reactive oracle (exact load now, util. {u:.2f})")
        probe = Variant()
        need = []
        for rates in trace:
            cap = probe.capacity(list(rates))
            need.append(_replicas(sum(rates) / cap, u) if cap else SPEC.minReplicas)
        ahead = int(STARTUP_S / DT) + 2 if foresight else 0
        self.plan = [min(SPEC.maxReplicas, max([SPEC.minReplicas] + need[k:k + ahead + 1]))
                     for k in range(len(trace))]

    def desired(self, t: float, v: Variant, samples: list[PodSample]) -> int:
        k = min(len(self.plan) - 1, int(round(t / DT)))
        return self.plan[k]


class HistoryOracle(Oracle):
    """The bound for any forecast made from history: like ``Oracle`` (one start-up ahead, released
    at once), but at each step it knows of the future only what a forecast could learn then at
    best (``rates_at(..., known_until=now)``): the diurnal curve exactly, and the bursts,
    prefill-heavy phases and launch that have already started, with their height and length (more
    than any forecast knows). The bursts that start after now it does not know: nothing in a
    history predicts a Poisson arrival."""

    def __init__(self, loads: list[tuple[float, ...]], u: float):
        self.u = u
        self.name = f"history oracle (knowable future, util. {u:.2f})"
        self.plan = [min(SPEC.maxReplicas, max([SPEC.minReplicas] + [_replicas(x, u) for x in row]))
                     for row in loads]


def knowable_loads(seed: int, hours: float, shape: str, late_s: float = 0.0) -> list[tuple[float, ...]]:
    """For each step: the load (replicas at full utilisation) of it and the next ``STARTUP_S`` + 2
    steps, as known at that step (``HistoryOracle``). With ``late_s``, a burst, prefill-heavy phase
    or launch is known only ``late_s`` after it starts (the present load is still known exactly):
    ``LATE_S`` is the bound for a scaler that learns of a burst by measuring it."""
    events = trace_events(seed, hours, shape)
    steps, ahead, probe = int(hours * 3600 / DT), int(STARTUP_S / DT) + 2, Variant()
    out = []
    for k in range(steps):
        now = k * DT
        seen = now - late_s
        # Only the events started by then and still running within the window matter.
        known = TraceEvents(*(tuple(e for e in events_ if e[0] <= seen and e[0] + e[1] > now)
                              for events_ in (events.bursts, events.rag_phases)))
        row = []
        for j in range(k, min(steps, k + ahead + 1)):
            rates = rates_at(j * DT, shape, events) if j == k else rates_at(j * DT, shape, known, known_until=seen)
            cap = probe.capacity(list(rates))
            row.append(sum(rates) / cap if cap else 0.0)
        out.append(tuple(row))
    return out


LATE_S = DT
"""How late the late history oracle learns of a started burst: one autoscaler pass. No measurement
learns of it sooner, and statistics later still: a burst's first 15 s add at most 12.5% of its
excess (a 120 s ramp), within the Poisson noise of that many arrivals (docs/autoscaling.md)."""


# ------------------------------------------------------------------ two pools


L4 = PoolSpec("l4", "NVIDIA-L4", kv_tokens=30_000, max_seqs=64, prefill_tokens_per_s=3_000, decode_tokens_per_s=15.0,
              cost=0.27, bandwidth_gbps=300.0)
"""An L4 replica of the same model: a fifth of the KV cache (24 GB card), 1/8 of the prefill
compute, half the per-sequence decode speed in a full batch: ~1/10 of an H100 replica's chat
throughput in this model, for a cost weight of 0.27 (on-demand prices of the two, ~1:3.7).
Per served token it costs ~2.7x the H100 (``--l4-cost`` changes the weight)."""
TWO_POOL_SPEC = SPEC.model_copy(update={"maxReplicas": 40})


@dataclass
class TwoPoolResult:
    name: str
    cost: float
    """Sum over pools of replicas x cost weight, hours (H100-hour equivalents)."""
    saturated_min: float
    """Minutes in which any pool was saturated (average KV > 0.95 or a request waiting)."""
    replica_hours: dict[str, float]
    share: dict[str, float]
    """Share of requests each pool served."""


def route(pools: list[Variant], t: float, arrivals: list[float], routing: str) -> list[list[float]]:
    """Split one step's arrivals over the pools: ``service`` evenly over ready pods (a Service),
    ``capacity`` in proportion to each pool's ready capacity for this mix (an endpoint picker that
    scores on KV usage and queue keeps every pool at about the same utilisation)."""
    if routing == "service":
        weights = [float(v.ready(t)) for v in pools]
    else:
        weights = [v.ready(t) * v.capacity(arrivals) for v in pools]
    total = sum(weights)
    if total <= 0:
        weights, total = [1.0] + [0.0] * (len(pools) - 1), 1.0
    return [[a * w / total for a in arrivals] for w in weights]


def simulate_two_pools(name: str, trace: list[tuple[float, float]], seed: int, pools: tuple[PoolSpec, ...],
                       routing: str, capacity_aware: bool) -> TwoPoolResult:
    arrivals_rng = random.Random(seed * 7919 + 1)
    noise_rng = random.Random(seed * 7919 + 2)
    fleet = [Variant(pool=p) for p in pools]
    policies = [Fewerbits(TWO_POOL_SPEC) for _ in pools]
    # The planner's decode estimate is bandwidth / bytes read per token: for one model and format,
    # its ratio between pools is the bandwidth ratio.
    economics = {p.name: PoolEconomics(p.bandwidth_gbps, p.cost) for p in pools}
    lo, hi = bounds(TWO_POOL_SPEC, None)
    cost = sat_s = 0.0
    rh = {p.name: 0.0 for p in pools}
    served = {p.name: 0.0 for p in pools}
    for k, rates in enumerate(trace):
        t = k * DT
        arrivals = draw(rates, arrivals_rng)
        for v, part in zip(fleet, route(fleet, t, arrivals, routing)):
            v.serve(t, part)
            served[v.pool.name] += sum(part)
        saturated = False
        for v in fleet:
            cost += v.replicas * v.pool.cost * DT / 3600
            rh[v.pool.name] += v.replicas * DT / 3600
            saturated |= v.ready(t) > 0 and (v.kv_true(t) > 0.95 or sum(v.backlog) >= 1.0)
            saturated |= v.ready(t) == 0 and sum(v.backlog) >= 1.0
        sat_s += DT if saturated else 0.0
        wants = [pol.desired(t, v, v.samples(t, noise_rng)) for pol, v in zip(policies, fleet)]
        if capacity_aware:  # the operator's loop calls the same function for placement: cheapestPool
            wants = [d.desired for d in rebalance([(v.pool.name, pol.last[0], pol.last[1].complete)
                                                   for pol, v in zip(policies, fleet)], lo, hi, economics)]
        for v, w in zip(fleet, wants):
            if w != v.replicas:
                v.scale(t, w)
    total = sum(served.values()) or 1.0
    return TwoPoolResult(name, cost, sat_s / 60, rh, {n: x / total for n, x in served.items()})


def two_pool_rows(seed: int, hours: float, pools: tuple[PoolSpec, ...] = (H100, L4)) -> list[TwoPoolResult]:
    trace = make_trace(seed, hours)
    return [
        simulate_two_pools("independent, Service routing", trace, seed, pools, "service", False),
        simulate_two_pools("independent, capacity routing", trace, seed, pools, "capacity", False),
        simulate_two_pools("capacity-aware, capacity routing", trace, seed, pools, "capacity", True),
    ]


def interpolate(points: list[tuple[float, float]], x: float) -> float | None:
    """Linear interpolation on (x, y) points sorted by x; None outside their range."""
    points = sorted(points)
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def single_pool(seed: int, hours: float, verbose: bool = True) -> dict[str, float | None]:
    """One seed of the single-pool comparison; returns its ratios."""
    trace = make_trace(seed, hours)
    ours = simulate(Fewerbits(), trace, seed)
    base = simulate(Threshold(), trace, seed)
    ablation = simulate(Fewerbits(SPEC.model_copy(update={"maxWaitingRequests": 100000})), trace, seed)
    ablation.name = "fewerbits, queue rule off (ablation)"
    # The baseline's trade-off curve: the same threshold policy at other KV targets.
    sweep = [simulate(Threshold(SPEC.model_copy(update={"targetKVCacheUsage": round(x, 3)})), trace, seed)
             for x in [0.40 + 0.025 * i for i in range(17)]]
    # The bound's curve: the oracle at several utilisations.
    oracle = [simulate(Oracle(trace, u), trace, seed) for u in (0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1)]
    rows = [ours, base, ablation] + [r for r in reversed(sweep) if r.name.endswith(("0.60)", "0.50)", "0.40)"))]
    reactive = [simulate(Oracle(trace, u, foresight=False), trace, seed) for u in (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 1.0)]
    rows += [r for r in oracle if r.name.endswith(("0.80)", "0.90)"))]
    rows += [r for r in reactive if r.name.endswith(("0.60)", "0.70)", "0.80)"))]
    frontier = [(r.gpu_hours, r.saturated_min) for r in sweep]
    sat_at_our_gpu = interpolate(frontier, ours.gpu_hours)
    gpu_at_our_sat = interpolate([(y, x) for x, y in frontier], ours.saturated_min)
    oracle_at_our_sat = interpolate([(r.saturated_min, r.gpu_hours) for r in oracle], ours.saturated_min)
    reactive_at_our_sat = interpolate([(r.saturated_min, r.gpu_hours) for r in reactive], ours.saturated_min)
    out = {
        "prefill_heavy_min": None,
        "gpu_ratio_same_config": ours.gpu_hours / base.gpu_hours,
        "sat_ratio_same_config": ours.saturated_min / base.saturated_min if base.saturated_min else None,
        "sat_ratio_equal_gpu": ours.saturated_min / sat_at_our_gpu if sat_at_our_gpu else None,
        "gpu_ratio_equal_sat": ours.gpu_hours / gpu_at_our_sat if gpu_at_our_sat else None,
        "bound_equal_sat": oracle_at_our_sat / gpu_at_our_sat if oracle_at_our_sat and gpu_at_our_sat else None,
        "reactive_bound_equal_sat": reactive_at_our_sat / gpu_at_our_sat if reactive_at_our_sat and gpu_at_our_sat else None,
        "ours_sat": ours.saturated_min, "ours_gpu": ours.gpu_hours,
    }
    if not verbose:
        return out
    print(f"autoscaler bench: {hours:g} h at {DT:g} s steps, seed {seed}, pod start-up {STARTUP_S:g} s, "
          f"replicas {SPEC.minReplicas}-{SPEC.maxReplicas}, target KV 0.70, maxWaitingRequests 5, "
          f"scale-down delay 300 s")
    print(f"{'policy':46} {'GPU-h':>7} {'saturated min':>14} {'queued req-min':>15} {'scalings':>9} {'peak':>5}")
    for r in rows:
        print(f"{r.name:46} {r.gpu_hours:7.1f} {r.saturated_min:14.1f} {r.queued_request_min:15.0f} "
              f"{r.scale_events:9d} {r.peak_replicas:5d}")
    print(f"\nsame configuration (target 0.70), fewerbits / threshold: GPU-hours {out['gpu_ratio_same_config']:.3f}, "
          f"saturated minutes {ours.saturated_min / base.saturated_min if base.saturated_min else float('inf'):.3f}")
    if sat_at_our_gpu is not None:
        print(f"at equal GPU-hours ({ours.gpu_hours:.1f}), threshold (interpolated over its target sweep) is "
              f"saturated {sat_at_our_gpu:.1f} min: ratio {ours.saturated_min / sat_at_our_gpu:.3f}")
    if gpu_at_our_sat is not None:
        print(f"at equal saturated minutes ({ours.saturated_min:.1f}), threshold needs {gpu_at_our_sat:.1f} GPU-h: "
              f"ratio {ours.gpu_hours / gpu_at_our_sat:.3f}")
    if oracle_at_our_sat is not None and gpu_at_our_sat is not None:
        print(f"bound: at those saturated minutes the oracle (knows the trace) needs {oracle_at_our_sat:.1f} GPU-h, "
              f"{oracle_at_our_sat / gpu_at_our_sat:.3f} of the threshold's: no policy can do better")
    if reactive_at_our_sat is not None and gpu_at_our_sat is not None:
        print(f"bound for a reactive policy: the reactive oracle (exact present load) needs {reactive_at_our_sat:.1f} "
              f"GPU-h there, {reactive_at_our_sat / gpu_at_our_sat:.3f} of the threshold's")
    goal_a = gpu_at_our_sat is not None and ours.gpu_hours <= 0.85 * gpu_at_our_sat
    goal_b = sat_at_our_gpu is not None and ours.saturated_min < sat_at_our_gpu
    print(f"goal '<= saturated minutes with >= 15% fewer GPU-hours': {'met' if goal_a else 'NOT met'}; "
          f"goal 'fewer saturated minutes at equal GPU-hours': {'met' if goal_b else 'NOT met'}")
    return out


# ------------------------------------------------------------------ foresight (issue 33)

THRESHOLD_TARGETS = [round(0.35 + 0.05 * i, 3) for i in range(12)]
"""The threshold policy's curve (0.35-0.90 by 0.05: half issue 8's points, over a wider range, to
keep the multi-day runs short)."""
ORACLE_UTILISATIONS = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1)
REACTIVE_UTILISATIONS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
FORESIGHT_TRACES = [("seasonal", s) for s in range(1, 6)] + [("launch", 1), ("flat", 1)]
"""Seeds 1-5 of the diurnal trace, the launch day and the flat trace (issue 33)."""
TUNING_TRACES = [("seasonal", s) for s in range(6, 11)] + [("launch", 6), ("flat", 6)]
"""Traces the predictive autoscaler's setting is chosen on (``--tuning``): the evaluation's shapes,
never its seeds."""
Setting = tuple[float, int]
"""(``targetKVCacheUsage``, ``scaleDownDelaySeconds``): our own knobs."""
DEFAULT_SETTING: Setting = (SPEC.targetKVCacheUsage, SPEC.scaleDownDelaySeconds)
OUR_SETTINGS: tuple[Setting, ...] = tuple((x, d) for d in (300, 150, 60) for x in (0.7, 0.75))
"""Our knobs, swept like the threshold policy's target: the predictive autoscaler at each (a
forecast that orders ramps ahead may let the reactive part keep less headroom or give capacity
back sooner); the reactive one at ``REACTIVE_SETTINGS``."""
REACTIVE_SETTINGS: tuple[Setting, ...] = (DEFAULT_SETTING, (0.7, 60))
PREDICTIVE_SETTING: Setting = (0.70, 60)
"""The predictive autoscaler's setting in the table: what ``choose_setting`` picked on
``TUNING_TRACES`` (bench/results/autoscaler-tuning.json)."""
RATIO_NOISE = 0.01
"""Differences in a GPU-hours ratio this small are what one trace's noise moves (the same policy on
another seed's arrivals): ``choose_setting`` treats them as ties and takes the saturation margin."""
HOLDOUT_TRACES = [("seasonal", s) for s in range(11, 16)] + [("launch", 11), ("flat", 11)]
"""Traces neither the setting's choice nor any knob of the forecast has seen (``--holdout``): run
once, after the choice, to check that it carries."""
FAIRNESS_COOLDOWN = 60
"""The threshold policy's curve again with this cooldown (the shortest delay of ours swept): a
shorter scale-down delay of ours is also compared with the baseline given one."""


def setting_key(s: Setting) -> str:
    return f"{s[0]:.2f}/{s[1]}s"


def parse_setting(key: str) -> Setting:
    target, delay = key.split("/")
    return float(target), int(delay.rstrip("s"))


def _gpu_ratio_at(frontier: list[tuple[float, float]], r: Result) -> float | None:
    """GPU-hours of ``r`` over the threshold policy's at ``r``'s saturated minutes (its curve
    over the target sweep, interpolated); None outside the curve."""
    thr = interpolate([(sat, gpu) for gpu, sat in frontier], r.saturated_min)
    return r.gpu_hours / thr if thr else None


def _bound_at(curve: list[Result], frontier: list[tuple[float, float]], sat: float) -> float | None:
    """An oracle's GPU-hours at ``sat`` saturated minutes over the threshold policy's there."""
    o = interpolate([(r.saturated_min, r.gpu_hours) for r in curve], sat)
    thr = interpolate([(s, g) for g, s in frontier], sat)
    return o / thr if o and thr else None


def _best_bound(curve: list[Result], frontier: list[tuple[float, float]], sat_max: float) -> float | None:
    """The lowest ratio an oracle reaches at any saturation up to ``sat_max`` (the reactive
    autoscaler's saturated minutes: the issue's other goal), over 200 points of its curve."""
    lo = max(min(r.saturated_min for r in curve), min(s for _, s in frontier))
    if lo > sat_max:
        return None
    ratios = [_bound_at(curve, frontier, lo + (sat_max - lo) * k / 199) for k in range(200)]
    known = [x for x in ratios if x is not None]
    return min(known) if known else None


def _figures(r: Result, frontier: list[tuple[float, float]]) -> dict:
    ratio = _gpu_ratio_at(frontier, r)
    return {"gpu_hours": round(r.gpu_hours, 2), "saturated_min": round(r.saturated_min, 2),
            "scale_events": r.scale_events, "peak_replicas": r.peak_replicas,
            "gpu_ratio_equal_sat": None if ratio is None else round(ratio, 4)}


def foresight_run(shape: str, seed: int, days: int, setting: Setting = PREDICTIVE_SETTING) -> dict:
    """One multi-day trace: the reactive (its defaults) and the predictive (at ``setting``)
    autoscaler against the threshold policy's curve and the three oracles, ours also over
    ``OUR_SETTINGS``; the first day (which trains the forecast) and the days after reported apart."""
    trace = make_trace(seed, days * 24, shape)

    def run(policy) -> tuple[Result, Result]:
        return simulate_periods(policy, trace, seed, DAY_S)

    def at(x: float, delay: int = SPEC.scaleDownDelaySeconds) -> AutoscalingSpec:
        return SPEC.model_copy(update={"targetKVCacheUsage": x, "scaleDownDelaySeconds": delay})

    reactive = {setting_key(s): run(Fewerbits(at(*s))) for s in REACTIVE_SETTINGS}
    counted = {setting_key(s): Predictive(at(*s)) for s in sorted({*OUR_SETTINGS, setting})}
    predictive = {k: run(p) for k, p in counted.items()}
    sweep = [run(Threshold(at(x))) for x in THRESHOLD_TARGETS]
    fair = [run(Threshold(at(x), cooldown=FAIRNESS_COOLDOWN)) for x in THRESHOLD_TARGETS]
    key = setting_key(setting)
    baseline = sweep[THRESHOLD_TARGETS.index(SPEC.targetKVCacheUsage)]
    loads, late = knowable_loads(seed, days * 24, shape), knowable_loads(seed, days * 24, shape, LATE_S)
    curves = {"oracle": [run(Oracle(trace, u)) for u in ORACLE_UTILISATIONS],
              "history_oracle": [run(HistoryOracle(loads, u)) for u in ORACLE_UTILISATIONS],
              "history_oracle_late": [run(HistoryOracle(late, u)) for u in ORACLE_UTILISATIONS],
              "reactive_oracle": [run(Oracle(trace, u, foresight=False)) for u in REACTIVE_UTILISATIONS]}
    out: dict = {"trace": shape, "seed": seed, "days": days, "predictive_setting": key,
                 "predictive_scale_ups": counted[key].scale_ups,
                 "predictive_scale_ups_not_needed": counted[key].unneeded}
    for i, period in enumerate(("first_day", "after_first_day")):
        frontier = [(r[i].gpu_hours, r[i].saturated_min) for r in sweep]
        fair_frontier = [(r[i].gpu_hours, r[i].saturated_min) for r in fair]
        row = {"reactive": _figures(reactive[setting_key(DEFAULT_SETTING)][i], frontier),
               "predictive": _figures(predictive[key][i], frontier),
               "threshold": _figures(baseline[i], frontier),
               "sweep": {name: {k: _figures(r[i], frontier) for k, r in runs.items()}
                         for name, runs in (("reactive", reactive), ("predictive", predictive))}}
        for k, p in counted.items():  # over the whole run, as the table's column
            row["sweep"]["predictive"][k].update(scale_ups=p.scale_ups, scale_ups_not_needed=p.unneeded)
        for name, runs in (("reactive", reactive), ("predictive", predictive)):
            for k, r in runs.items():
                ratio = _gpu_ratio_at(fair_frontier, r[i])
                row["sweep"][name][k]["gpu_ratio_vs_threshold_short_cooldown"] = None if ratio is None else round(ratio, 4)
        del row["threshold"]["gpu_ratio_equal_sat"]
        for name, curve in curves.items():
            bound = _bound_at([o[i] for o in curve], frontier, predictive[key][i].saturated_min)
            row[name + "_bound_equal_sat"] = None if bound is None else round(bound, 4)
            best = _best_bound([o[i] for o in curve], frontier, row["reactive"]["saturated_min"])
            row[name + "_best_within_reactive_sat"] = None if best is None else round(best, 4)
        out[period] = row
    return out


def foresight_goals(rows: list[dict]) -> dict[str, bool]:
    """Issue 33's goals over the runs, after the first day: <= 0.85 of the threshold policy's
    GPU-hours at equal saturation on every seasonal seed; saturated minutes no higher than the
    reactive autoscaler's on every trace; no worse a ratio than the reactive one on the launch and
    flat traces."""
    after = [(r["trace"], r["after_first_day"]) for r in rows]
    seasonal = [a for t, a in after if t == "seasonal"]
    return {
        "ratio_at_most_0.85_every_seed": bool(seasonal) and all(
            a["predictive"]["gpu_ratio_equal_sat"] is not None and a["predictive"]["gpu_ratio_equal_sat"] <= 0.85
            for a in seasonal),
        "saturation_not_above_reactive": all(
            a["predictive"]["saturated_min"] <= a["reactive"]["saturated_min"] for _, a in after),
        "launch_and_flat_not_worse": all(
            a["predictive"]["gpu_ratio_equal_sat"] is not None and a["reactive"]["gpu_ratio_equal_sat"] is not None
            and a["predictive"]["gpu_ratio_equal_sat"] <= a["reactive"]["gpu_ratio_equal_sat"]
            for t, a in after if t in ("launch", "flat")),
    }


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def gap_to_bound(after: dict) -> float | None:
    """The predictive autoscaler's GPU-hours ratio minus the one-pass-late history oracle's at its
    saturated minutes (issue 45: the gap to the bound for any scaler that measures)."""
    ratio, bound = after["predictive"]["gpu_ratio_equal_sat"], after.get("history_oracle_late_bound_equal_sat")
    return None if ratio is None or bound is None else ratio - bound


TABLE_TRY = "prefill"
"""The try of ``bench/autoscaler_tries.py`` the table shows beside the landed autoscaler (issue 45)."""


def _try_rows(tries: dict | None) -> dict[tuple[str, int], dict]:
    if not tries:
        return {}
    for t in tries["tries"]:
        if t["name"] == TABLE_TRY:
            return {(r["trace"], r["seed"]): r for rows in t["rows"].values() for r in rows}
    return {}


def foresight_table(doc: dict, tries: dict | None = None) -> str:
    """docs/autoscaling.md's table (markdown) from the bench's JSON (``--json``), and the sweep of our knob;
    with ``tries`` (``bench/autoscaler_tries.py``'s JSON) a column for its ``TABLE_TRY``."""
    extra = _try_rows(tries)
    kept = next((t["kept"] for t in (tries or {}).get("tries", []) if t["name"] == TABLE_TRY), None)
    lines = [
        f"GPU-hours at equal saturated minutes, as a fraction of the threshold policy's (its curve over "
        f"targets {THRESHOLD_TARGETS[0]:.2f}-{THRESHOLD_TARGETS[-1]:.2f}), days 2-{doc['days']} of {doc['days']}-day "
        f"traces (day 1 trains the forecast: in brackets); pod start-up {doc['startup_s']:.0f} s; reactive at target "
        f"{setting_key(DEFAULT_SETTING)}, predictive at {doc['predictive_setting']} (target/scale-down delay). Bounds at the predictive "
        f"autoscaler's saturated minutes; the history oracles' (the bound for any forecast from history; the late one "
        f"learns of a started burst one pass, {LATE_S:.0f} s, after it starts: the bound for any scaler that measures) "
        f"also their best at any saturation up to the reactive autoscaler's, in brackets. *Gap*: predictive minus the "
        f"one-pass-late bound (issue 45's goal: at most 0.03)."
        + (f" *{TABLE_TRY} rule*: `bench/autoscaler_tries.py`'s try of that name "
           f"({'kept' if kept else 'tried, not kept'}): GPU-h ratio at equal saturation / gap to the late bound at "
           f"its own saturation / saturated min." if extra else ""),
        "",
        "| trace | reactive | **predictive** | reactive oracle | history oracle, one pass late | **gap** "
        "| history oracle | oracle with foresight | saturated min reactive / predictive | GPU-h reactive / predictive "
        "| predictive scale-ups (not needed) |" + (f" {TABLE_TRY} rule |" if extra else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if extra else ""),
    ]
    for r in doc["results"]:
        a, d1 = r["after_first_day"], r["first_day"]
        name = f"{r['trace']} seed {r['seed']}" if r["trace"] == "seasonal" else r["trace"]
        lines.append(
            f"| {name} | {_fmt(a['reactive']['gpu_ratio_equal_sat'])} ({_fmt(d1['reactive']['gpu_ratio_equal_sat'])}) "
            f"| **{_fmt(a['predictive']['gpu_ratio_equal_sat'])}** ({_fmt(d1['predictive']['gpu_ratio_equal_sat'])}) "
            f"| {_fmt(a['reactive_oracle_bound_equal_sat'])} "
            f"| {_fmt(a.get('history_oracle_late_bound_equal_sat'))} "
            f"({_fmt(a.get('history_oracle_late_best_within_reactive_sat'))}) "
            f"| **{_fmt(gap_to_bound(a))}** "
            f"| {_fmt(a['history_oracle_bound_equal_sat'])} ({_fmt(a.get('history_oracle_best_within_reactive_sat'))}) "
            f"| {_fmt(a['oracle_bound_equal_sat'])} "
            f"| {a['reactive']['saturated_min']:.1f} / {a['predictive']['saturated_min']:.1f} "
            f"| {a['reactive']['gpu_hours']:.1f} / {a['predictive']['gpu_hours']:.1f} "
            f"| {r['predictive_scale_ups']} ({r['predictive_scale_ups_not_needed']}) |"
            + (f" {_try_cell(extra.get((r['trace'], r['seed'])))} |" if extra else ""))
    goals = doc["goals"]
    for name, what in (("history_oracle", "The history oracle"), ("history_oracle_late", "The late history oracle")):
        seasonal = [r["after_first_day"].get(name + "_best_within_reactive_sat") for r in doc["results"]
                    if r["trace"] == "seasonal"]
        reachable = sum(1 for x in seasonal if x is not None and x <= 0.85)
        lines += ["", f"{what} reaches 0.85 at no more saturation than the reactive autoscaler on "
                      f"{reachable} of {len(seasonal)} seeds (days 2 on)."]
    lines += ["", "Goals (issue 33): " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in goals.items())
              + f". Command: `{doc['command']}` ({doc['seconds']:.0f} s).", ""] + sweep_table(doc)
    return "\n".join(lines)


def _try_cell(row: dict | None) -> str:
    if row is None:
        return "n/a"
    return f"{_fmt(row['gpu_ratio_equal_sat'])} / {_fmt(row['gap_to_bound'])} / {row['saturated_min']:.1f}"


def choose_setting(doc: dict) -> Setting | None:
    """The predictive setting a tuning run (``--tuning``) picks, by the issue's goals on its traces,
    days 2 on: among the swept settings whose saturated minutes are no higher than the reactive
    autoscaler's on every trace, those within ``RATIO_NOISE`` of the lowest worst-trace GPU-hours
    ratio, and of them the one with the most room under the saturation goal (the lowest worst-trace
    share of the reactive autoscaler's saturated minutes); None when no setting keeps saturation
    down."""
    after = [r["after_first_day"] for r in doc["results"]]
    kept: dict[str, tuple[float, float]] = {}
    for key in after[0]["sweep"]["predictive"]:
        rows = [a["sweep"]["predictive"][key] for a in after]
        shares = [r["saturated_min"] / a["reactive"]["saturated_min"] if a["reactive"]["saturated_min"]
                  else (math.inf if r["saturated_min"] else 0.0) for r, a in zip(rows, after)]
        if max(shares) > 1.0:
            continue
        worst = max(math.inf if r["gpu_ratio_equal_sat"] is None else r["gpu_ratio_equal_sat"] for r in rows)
        kept[key] = (worst, max(shares))
    if not kept:
        return None
    best = min(worst for worst, _ in kept.values())
    ties = [k for k, (worst, _) in kept.items() if worst <= best + RATIO_NOISE]
    return parse_setting(min(ties, key=lambda k: (kept[k][1], kept[k][0])))


def _span(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    text = f"{min(known):.3f}-{max(known):.3f}" if known else "n/a"
    return text + (f" ({len(values) - len(known)} n/a)" if len(known) < len(values) else "")


def sweep_table(doc: dict) -> list[str]:
    """Our knobs swept like the threshold policy's target, over all traces, days 2 on."""
    lines = [f"Our knobs swept (`targetKVCacheUsage`/`scaleDownDelaySeconds`), days 2-{doc['days']}, range over the "
             f"{len(doc['results'])} traces; ratios against the threshold policy's curve (cooldown 300 s; in brackets "
             f"with cooldown {FAIRNESS_COOLDOWN} s); saturated minutes over the reactive autoscaler's at "
             f"{setting_key(DEFAULT_SETTING)}:", "",
             "| autoscaler | setting | GPU-h ratio at equal saturation | saturated min / reactive's |", "|---|---|---|---|"]
    after = [r["after_first_day"] for r in doc["results"]]
    for name in ("reactive", "predictive"):
        for key in sorted(after[0]["sweep"][name], key=lambda k: (-parse_setting(k)[1], parse_setting(k)[0])):
            rows = [a["sweep"][name][key] for a in after]
            sat = [r["saturated_min"] / a["reactive"]["saturated_min"] if a["reactive"]["saturated_min"] else None
                   for r, a in zip(rows, after)]
            lines.append(f"| {name} | {key} | {_span([r['gpu_ratio_equal_sat'] for r in rows])} "
                         f"({_span([r['gpu_ratio_vs_threshold_short_cooldown'] for r in rows])}) | {_span(sat)} |")
    return lines


def record_demand(shape: str, seed: int, hours: float, every_s: float = 60.0) -> list[tuple[float, float]]:
    """The demand (``forecast.demand_of``: replicas at the KV target) the reactive autoscaler
    measures on a trace, one sample every ``every_s``: the recorded histories the forecast's unit
    tests replay (tests/fixtures/autoscaler/)."""
    from fewerbits_operator.autoscaler.forecast import demand_of
    trace = make_trace(seed, hours, shape)
    arrivals_rng, noise_rng = random.Random(seed * 7919 + 1), random.Random(seed * 7919 + 2)
    v, policy, out = Variant(), Fewerbits(), []
    for k, rates in enumerate(trace):
        t = k * DT
        v.step(t, rates, arrivals_rng)
        want = policy.desired(t, v, v.samples(t, noise_rng))
        demand = demand_of(policy.last[0], SPEC)
        if demand is not None and t % every_s < DT / 2:
            out.append((t, round(demand, 3)))
        if want != v.replicas:
            v.scale(t, want)
    return out


def _foresight_run(job: tuple[str, int, int, Setting]) -> dict:
    return foresight_run(*job)


def foresight(days: int, json_path: str | None, traces: list[tuple[str, int]] = FORESIGHT_TRACES,
              workers: int = 2, setting: Setting = PREDICTIVE_SETTING, flags: str = "") -> dict:
    """Every trace of issue 33 (one process per trace, ``workers`` at a time), the goals, the JSON."""
    started = time.perf_counter()
    jobs = [(shape, seed, days, setting) for shape, seed in traces]
    if workers > 1:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            rows = pool.map(_foresight_run, jobs)
    else:
        rows = [_foresight_run(j) for j in jobs]
    for r in rows:
        shape, seed, a = r["trace"], r["seed"], r["after_first_day"]
        print(f"{shape} seed {seed}: after day 1 reactive {_fmt(a['reactive']['gpu_ratio_equal_sat'])}, predictive "
              f"{_fmt(a['predictive']['gpu_ratio_equal_sat'])} (bounds: reactive "
              f"{_fmt(a['reactive_oracle_bound_equal_sat'])}, history one pass late "
              f"{_fmt(a['history_oracle_late_bound_equal_sat'])}, history {_fmt(a['history_oracle_bound_equal_sat'])}, "
              f"foresight {_fmt(a['oracle_bound_equal_sat'])}); saturated min {a['reactive']['saturated_min']:.1f} / "
              f"{a['predictive']['saturated_min']:.1f}; GPU-h {a['reactive']['gpu_hours']:.1f} / "
              f"{a['predictive']['gpu_hours']:.1f}", flush=True)
    doc = {"command": f"python bench/bench_autoscaler.py --foresight{flags} --days {days} --json {json_path or 'PATH'}",
           "workers": workers, "predictive_setting": setting_key(setting),
           "days": days, "startup_s": STARTUP_S, "step_s": DT, "results": rows, "goals": foresight_goals(rows),
           "seconds": round(time.perf_counter() - started, 1)}
    print(foresight_table(doc))
    print(f"setting chosen by these runs (choose_setting): {choose_setting(doc)}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
    return doc


def two_pools(seed: int, hours: float, pools: tuple[PoolSpec, ...], verbose: bool = True) -> dict[str, float]:
    """One seed of the two-pool comparison; returns capacity-aware / independent ratios."""
    service, independent, aware = two_pool_rows(seed, hours, pools)
    # What the independent run's capacity would have cost on the cheapest pool per token: the most
    # any placement can save (the other pools kept at minReplicas).
    cheapest = min(pools, key=lambda p: p.cost / Variant(pool=p).capacity([1.0, 0.0]))
    capacity_used = sum(independent.replica_hours[p.name] * Variant(pool=p).capacity([1.0, 0.0]) for p in pools)
    floor_cost = sum(TWO_POOL_SPEC.minReplicas * hours * p.cost for p in pools if p is not cheapest)
    floor_cap = sum(TWO_POOL_SPEC.minReplicas * hours * Variant(pool=p).capacity([1.0, 0.0])
                    for p in pools if p is not cheapest)
    best = floor_cost + cheapest.cost * (capacity_used - floor_cap) / Variant(pool=cheapest).capacity([1.0, 0.0])
    out = {
        "cost_vs_independent": aware.cost / independent.cost,
        "sat_vs_independent": aware.saturated_min - independent.saturated_min,
        "cost_vs_service": aware.cost / service.cost,
        "sat_vs_service": aware.saturated_min - service.saturated_min,
        "bound_vs_independent": best / independent.cost,
    }
    if verbose:
        names = ", ".join(f"{p.name} (cost {p.cost:g}/replica-h, chat capacity {Variant(pool=p).capacity([1.0, 0.0]):.2f} "
                          f"req/s/replica, estimate {p.bandwidth_gbps:g})" for p in pools)
        print(f"\ntwo pools, seed {seed}: {names}")
        print(f"{'policy':36} {'cost':>7} {'saturated min':>14} {'replica-h per pool':>30} {'share of requests':>24}")
        for r in (service, independent, aware):
            rh = " ".join(f"{n} {x:.0f}" for n, x in r.replica_hours.items())
            sh = " ".join(f"{n} {x:.2f}" for n, x in r.share.items())
            print(f"{r.name:36} {r.cost:7.1f} {r.saturated_min:14.1f} {rh:>30} {sh:>24}")
        print(f"capacity-aware / independent (same routing): cost {out['cost_vs_independent']:.3f}, saturated "
              f"minutes {aware.saturated_min:.1f} vs {independent.saturated_min:.1f}; best placement of the "
              f"independent run's capacity: {out['bound_vs_independent']:.3f}")
        print(f"capacity-aware / independent behind a Service: cost {out['cost_vs_service']:.3f}, saturated "
              f"minutes {aware.saturated_min:.1f} vs {service.saturated_min:.1f}")
    return out


def seeds_arg(text: str) -> list[int]:
    if "-" in text:
        a, b = text.split("-", 1)
        return list(range(int(a), int(b) + 1))
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=None, help="one seed (default: --seeds)")
    ap.add_argument("--seeds", type=seeds_arg, default=[1], help="seeds: 1-5 or 1,3,5")
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--only", choices=("single", "two"), default=None, help="run one comparison only")
    ap.add_argument("--l4-cost", type=float, default=L4.cost, help="cost weight of the L4 pool (H100: 1)")
    ap.add_argument("--foresight", action="store_true",
                    help="issue 33: multi-day traces, reactive vs predictive (seeds 1-5, launch day, flat)")
    ap.add_argument("--workers", type=int, default=2, help="--foresight: traces run in parallel")
    ap.add_argument("--days", type=int, default=3, help="--foresight: days per trace (the first trains)")
    ap.add_argument("--json", default=None, help="--foresight: write the results here")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--tuning", action="store_true", help="--foresight on the tuning traces (seeds 6-10, "
                        "launch and flat seed 6), where the predictive setting is chosen")
    which.add_argument("--holdout", action="store_true",
                        help="--foresight on traces nothing was chosen on (seeds 11-15, launch and flat seed 11)")
    ap.add_argument("--setting", type=parse_setting, default=PREDICTIVE_SETTING,
                    help="--foresight: the predictive autoscaler's TARGET/DELAYs in the table (e.g. 0.70/150s)")
    ap.add_argument("--table", default=None, metavar="JSON", help="print docs/autoscaling.md's table from a --json file")
    args = ap.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            doc = json.load(f)
        tries_path = os.path.join(os.path.dirname(args.table), "autoscaler-tries.json")
        tries = None
        if os.path.exists(tries_path):
            with open(tries_path) as f:
                tries = json.load(f)
        print(foresight_table(doc, tries))
        return 0
    if args.foresight:
        flags = (" --tuning" if args.tuning else " --holdout" if args.holdout else "") + \
            (f" --setting {setting_key(args.setting)}" if args.setting != PREDICTIVE_SETTING else "")
        traces = TUNING_TRACES if args.tuning else HOLDOUT_TRACES if args.holdout else FORESIGHT_TRACES
        doc = foresight(args.days, args.json, traces, args.workers, args.setting, flags)
        return 0 if all(doc["goals"].values()) else 1
    seeds = [args.seed] if args.seed is not None else args.seeds
    started = time.perf_counter()
    single, two = {}, {}
    pools = (H100, PoolSpec(**{**L4.__dict__, "cost": args.l4_cost}))
    for seed in seeds:
        if args.only in (None, "single"):
            single[seed] = single_pool(seed, args.hours)
        if args.only in (None, "two"):
            two[seed] = two_pools(seed, args.hours, pools)
    if len(seeds) > 1 and single:
        print("\nsingle pool, per seed: GPU-h at equal saturation (ours / threshold), and the oracles' bounds")
        for seed, r in single.items():
            print(f"  seed {seed}: {r['gpu_ratio_equal_sat'] or float('nan'):.3f}  bound: reactive "
                  f"{r['reactive_bound_equal_sat'] or float('nan'):.3f}, with foresight {r['bound_equal_sat'] or float('nan'):.3f}")
    if len(seeds) > 1 and two:
        print("\ntwo pools, per seed: cost capacity-aware / independent (same routing), saturated minutes difference, "
              "best possible; and against independent behind a Service")
        for seed, r in two.items():
            print(f"  seed {seed}: cost {r['cost_vs_independent']:.3f} (saturated {r['sat_vs_independent']:+.1f} min, "
                  f"best {r['bound_vs_independent']:.3f}); vs Service: cost {r['cost_vs_service']:.3f} "
                  f"(saturated {r['sat_vs_service']:+.1f} min)")
    print(f"({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
