"""The scaling decision as a pure function: table tests for each rule and property tests for the
promises (bounds, no scale-down on missing data, no scale-down before the delay, no flapping)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fewerbits_api.quantizedmodel import AutoscalingSpec
from fewerbits_operator.autoscaler.algorithm import History, Observation, Tuning, bounds, decide
from fewerbits_operator.autoscaler.metrics import KV_USAGE_OLD, PodSample, parse_vllm_metrics

SPEC = AutoscalingSpec(minReplicas=1, maxReplicas=10, targetKVCacheUsage=0.7, maxWaitingRequests=5,
                       scaleDownDelaySeconds=300)
PERIOD = 15.0


def pods(*kv: float, waiting: float = 0.0, running: float = 10.0) -> list[PodSample]:
    return [PodSample(f"p{i}", k, waiting, running) for i, k in enumerate(kv)]


def obs(current: int, samples, failures: int = 0, not_ready: int = 0) -> Observation:
    return Observation(current, tuple(samples), failures, not_ready)


class Sim:
    """Drives decide() every PERIOD seconds over a load given in 'pods worth of KV'; new pods are
    ready after `startup` seconds. Records every scaling action."""

    def __init__(self, spec=SPEC, replicas=2, startup=0.0, cap=None, noise=0.0, seed=0):
        self.spec, self.cap, self.startup = spec, cap, startup
        self.replicas = replicas
        self.ready_at = [-1e9] * replicas
        self.history = History()
        self.t = 0.0
        self.actions: list[tuple[float, int, int]] = []
        self.rng = random.Random(seed)
        self.noise = noise

    def step(self, load: float, waiting_total: float = 0.0):
        ready = sum(1 for r in self.ready_at if r <= self.t)
        not_ready = self.replicas - ready
        samples = []
        for i in range(ready):
            kv = min(1.0, max(0.0, load / ready + self.rng.uniform(-self.noise, self.noise))) if ready else 0.0
            samples.append(PodSample(f"p{i}", kv, waiting_total / ready, 10.0))
        d = decide(self.spec, self.cap, Observation(self.replicas, tuple(samples), 0, not_ready), self.history, self.t)
        self.history = d.history
        if d.act:
            self.actions.append((self.t, self.replicas, d.desired))
            if d.desired > self.replicas:
                self.ready_at += [self.t + self.startup] * (d.desired - self.replicas)
            else:
                self.ready_at = sorted(self.ready_at)[: d.desired]
            self.replicas = d.desired
        self.t += PERIOD
        return d


# ------------------------------------------------------------------ table tests


def test_bounds_policy_cap_wins():
    assert bounds(SPEC, None) == (1, 10)
    assert bounds(SPEC, 4) == (1, 4)
    assert bounds(AutoscalingSpec(minReplicas=6, maxReplicas=10), 3) == (3, 3)


def test_steady_at_target_holds():
    sim = Sim(replicas=3)
    for _ in range(2000):
        d = sim.step(3 * 0.7)
    assert sim.actions == [] and d.desired == 3 and "within 10% of target" in d.reason


def test_within_tolerance_both_sides_holds():
    for kv in (0.64, 0.76):
        d = decide(SPEC, None, obs(4, pods(kv, kv, kv, kv)), History(), 0)
        assert not d.act, d.reason


def test_ramp_scales_up_promptly_and_lands_on_hpa_count():
    sim = Sim(replicas=1, startup=120)
    for k in range(400):
        load = min(5.0, 0.5 + k * 0.02)  # ramps to 5 pods' worth of KV over ~4 minutes... then holds
        sim.step(load)
    # lands inside the tolerance band, never above the HPA count ceil(5/0.7) = 8
    assert abs(5.0 / sim.replicas / 0.7 - 1) <= 0.1 and sim.replicas <= 8
    # every action is an increase: a ramp never causes a scale-down
    assert all(new > old for _, old, new in sim.actions)


def test_spike_acts_in_one_period_with_bounded_step():
    d = decide(SPEC, None, obs(2, pods(1.0, 1.0, waiting=30, running=20)), History(), 0)
    # KV wants ceil(2*1/0.7)=3; queue: (30-5)*2=50 excess / 20 per pod -> 2+3=5; step limit max(4, 2+4)=6
    assert d.act and d.desired == 5 and d.kv_wants == 3 and d.queue_wants == 5, d.reason
    d = decide(SPEC, None, obs(2, pods(1.0, 1.0, waiting=500, running=20)), History(), 0)
    assert d.desired == 6 and "step limit 6" in d.reason
    big = AutoscalingSpec(minReplicas=1, maxReplicas=100)
    d = decide(big, None, obs(10, pods(*[1.0] * 10, waiting=500, running=20)), History(), 0)
    assert d.desired == 20  # x2 beats +4 from 10 replicas


def test_queue_bound_with_low_kv_scales_up():
    # llm-d's prefill-heavy case: KV at 0.3 (KV rule alone would scale DOWN) while queues grow.
    d = decide(SPEC, None, obs(2, pods(0.3, 0.3, waiting=20, running=8)), History(), 0)
    assert d.act and d.desired > 2 and d.direction == "up", d.reason
    assert d.kv_wants == 1 and d.queue_wants == 2 + math.ceil((20 - 5) * 2 / 8)
    assert "20.0 waiting/pod > 5" in d.reason


def test_queue_at_threshold_does_not_scale():
    d = decide(SPEC, None, obs(2, pods(0.7, 0.7, waiting=5)), History(), 0)
    assert not d.act and d.queue_wants is None


def test_queue_threshold_zero_means_any_wait_scales():
    spec = SPEC.model_copy(update={"maxWaitingRequests": 0})
    d = decide(spec, None, obs(2, pods(0.7, 0.7, waiting=1, running=30)), History(), 0)
    assert d.desired == 3


def test_metric_rename_old_name_only_still_scales():
    text = ('vllm:gpu_cache_usage_perc{model_name="m"} 0.95\n'
            'vllm:num_requests_waiting{model_name="m"} 0\nvllm:num_requests_running{model_name="m"} 12\n')
    s = parse_vllm_metrics(text, "p0")
    assert isinstance(s, PodSample) and s.kv_metric == KV_USAGE_OLD
    d = decide(SPEC, None, obs(1, [s]), History(), 0)
    assert d.act and d.desired == 2


@pytest.mark.parametrize("current,kv,cap,want", [
    (1, 1.0, None, 2),      # normal
    (9, 1.0, None, 10),     # maxReplicas
    (3, 1.0, 3, 3),         # policy cap: hold, say why
    (5, 0.7, 3, 3),         # above the policy cap: down to it even at target
    (0, None, None, 1),     # below minReplicas with no pods: up to it
])
def test_clamping(current, kv, cap, want):
    samples = pods(*[kv] * current) if kv is not None else []
    d = decide(SPEC, cap, obs(current, samples), History(), 0)
    assert d.desired == want, d.reason
    if current == want:
        assert "maxReplicas" in d.reason


def test_scale_to_min_after_delay_and_not_before():
    sim = Sim(replicas=6)
    for _ in range(int(300 / PERIOD)):  # 0..285 s: 20 decisions of idle load
        sim.step(0.0)
    assert sim.actions == []
    sim.step(0.0)  # t = 300: the window [0, 300] is fully observed
    assert sim.actions == [(300.0, 6, 1)]


def test_scale_down_uses_highest_recommendation_in_window():
    h = History()
    loads = [2.8] + [0.7] * 20 + [0.7]  # one sample wanting 4 at t=0, then 1 pod's worth
    t = 0.0
    for load in loads:
        d = decide(SPEC, None, obs(6, pods(*[load / 6] * 6)), h, t)
        h, t = d.history, t + PERIOD
    assert d.desired == 1 and d.act  # t=315: the 4 at t=0 has left the window
    h = History()
    for i, load in enumerate([0.7] * 10 + [2.8] + [0.7] * 10):
        d = decide(SPEC, None, obs(6, pods(*[load / 6] * 6)), h, i * PERIOD)
        h = d.history
    assert d.desired == 4 and "highest recommendation" in d.reason


def test_gap_in_observations_restarts_the_wait():
    h = History()
    for i in range(10):
        h = decide(SPEC, None, obs(4, pods(0.1, 0.1, 0.1, 0.1)), h, i * PERIOD).history
    d = decide(SPEC, None, obs(4, pods(0.1, 0.1, 0.1, 0.1)), h, 10_000)
    assert not d.act and "lower demand for 0s" in d.reason


def test_missing_pods_never_scale_down():
    idle = pods(0.05, 0.05)
    h = History()
    for i in range(100):  # 25 minutes of idle, but one ready pod never reports
        d = decide(SPEC, None, obs(3, idle, failures=1), h, i * PERIOD)
        h = d.history
        assert d.desired == 3 and "1 ready pod(s) not reporting" in d.reason
    # data complete again: the full delay runs again before a scale-down
    t0 = 100 * PERIOD
    for i in range(20):
        d = decide(SPEC, None, obs(3, pods(0.05, 0.05, 0.05)), h, t0 + i * PERIOD)
        h = d.history
        assert not d.act
    d = decide(SPEC, None, obs(3, pods(0.05, 0.05, 0.05)), h, t0 + 20 * PERIOD)
    assert d.act and d.desired == 1


def test_no_samples_holds():
    d = decide(SPEC, None, obs(3, [], failures=3), History(), 0)
    assert not d.act and "no pod reported metrics" in d.reason


def test_scale_up_from_reporting_pods_with_unreported_at_average():
    # 2 report KV 1.0, 1 ready pod unreported (assumed 1.0 too): ceil(3 x 1/0.7) = 5
    d = decide(SPEC, None, obs(3, pods(1.0, 1.0), failures=1), History(), 0)
    assert d.desired == 5 and "assumed at the average" in d.reason


def test_starting_pods_count_as_capacity_no_double_scale():
    # Scaled 2 -> 3 because 2 ready pods ran at 1.0: the third starts; same load must not add more.
    d = decide(SPEC, None, obs(3, pods(1.0, 1.0), not_ready=1), History(), 0)
    assert not d.act, d.reason
    # a queue that built up while the pod starts is left to it: the queue rule waits
    d = decide(SPEC, None, obs(3, pods(1.0, 1.0, waiting=20, running=10), not_ready=1), History(), 0)
    assert not d.act and "waits for 1 starting pod(s)" in d.reason


def test_queue_rule_waits_one_sync_after_new_pods_become_ready():
    h = decide(SPEC, None, obs(4, pods(1.0, 1.0, waiting=20), not_ready=2), History(), 0).history
    d = decide(SPEC, None, obs(4, pods(1.0, 1.0, 1.0, 1.0, waiting=20)), h, 15)
    assert d.queue_wants is None and "newly ready" in d.reason
    d = decide(SPEC, None, obs(4, pods(1.0, 1.0, 1.0, 1.0, waiting=20)), d.history, 30)
    assert d.queue_wants == 4 + math.ceil(4 * 15 / 10) and d.act


def test_queue_rule_holds_while_the_queue_drains_fast():
    h = decide(SPEC, None, obs(2, pods(0.5, 0.5, waiting=40)), History(), 0).history
    d = decide(SPEC, None, obs(2, pods(0.5, 0.5, waiting=10)), h, 15)  # 80 -> 20 waiting in 15 s: gone in ~5 s
    assert d.queue_wants is None and "drains in ~5s" in d.reason
    h = decide(SPEC, None, obs(2, pods(0.5, 0.5, waiting=40)), History(), 0).history
    d = decide(SPEC, None, obs(2, pods(0.5, 0.5, waiting=39)), h, 15)  # draining, but over ~20 minutes
    assert d.queue_wants is not None and d.act


def test_prefill_bound_capacity_guards_scale_down():
    # Requests queued at 30 running/pod with KV 0.3; after scaling out, KV alone (0.2) would
    # scale back in to the count that queued. The remembered saturation keeps enough pods.
    spec = SPEC.model_copy(update={"scaleDownDelaySeconds": 0})
    h = decide(spec, None, obs(3, pods(0.3, 0.3, 0.3, waiting=30, running=30)), History(), 0).history
    d = decide(spec, None, obs(5, pods(0.2, 0.2, 0.2, 0.2, 0.2, running=18)), h, 400)
    # 90 running over pods that saturate at 30: ceil(90 / (30 x 0.9)) = 4, not KV's ceil(5 x 0.2/0.7) = 2
    assert d.desired == 4 and "requests queued at 30.0/pod" in d.reason
    d = decide(spec, None, obs(5, pods(0.2, 0.2, 0.2, 0.2, 0.2, running=18)), h, 400 + 1800)
    assert d.desired == 2  # forgotten after saturation_memory_seconds


def test_starting_pods_block_scale_down():
    d = decide(SPEC.model_copy(update={"scaleDownDelaySeconds": 0}), None, obs(4, pods(0.1, 0.1), not_ready=2),
               History(), 0)
    assert not d.act and "2 pod(s) not ready" in d.reason


def test_zero_delay_scales_down_at_once():
    spec = SPEC.model_copy(update={"scaleDownDelaySeconds": 0})
    d = decide(spec, None, obs(4, pods(0.1, 0.1, 0.1, 0.1)), History(), 0)
    assert d.act and d.desired == 1


class NoisySim(Sim):
    """Per-pod noise plus a common swing of the whole variant (bursty traffic)."""

    def __init__(self, common: float, **kw):
        super().__init__(**kw)
        self.common = common

    def step(self, load: float, waiting_total: float = 0.0):
        return super().step(load * (1 + self.rng.uniform(-self.common, self.common)), waiting_total)


@pytest.mark.parametrize("seed", range(5))
def test_no_flapping_on_noisy_signal_over_a_day(seed):
    # 3.5 pods' worth of load (0.70 on 5 pods, 0.58 on 6) with +-15% common swings and +-0.1
    # per-pod noise, often outside the tolerance band: a day of 15 s decisions may settle once
    # (5 -> 6) but must not oscillate.
    sim = NoisySim(common=0.15, replicas=5, startup=60, noise=0.1, seed=seed)
    for _ in range(5760):
        sim.step(3.5)
    assert len(sim.actions) <= 2, sim.actions
    directions = [new > old for _, old, new in sim.actions]
    assert all(directions) or not any(directions), sim.actions


def test_threshold_policy_would_flap_on_the_same_signal():
    """The same signal under a naive rule (act on each sample outside the band, no window) flaps:
    shows the no-flapping test above can fail."""
    sim = NoisySim(common=0.15, replicas=5, startup=60, noise=0.1, seed=0)
    sim.spec = SPEC.model_copy(update={"scaleDownDelaySeconds": 0})
    for _ in range(5760):
        sim.step(3.5)
    assert len(sim.actions) > 50


def test_reason_has_the_numbers():
    d = decide(SPEC, None, obs(2, pods(0.95, 0.9, waiting=1)), History(), 0)
    assert d.reason.startswith("scale up 2->3") and "KV 0.93" in d.reason and "target 0.70" in d.reason


def test_history_is_a_short_sliding_maximum():
    h = History()
    for i in range(10_000):
        h = decide(SPEC, None, obs(3, pods(0.7, 0.7, 0.7)), h, i * PERIOD).history
    assert len(h.entries) <= 2


# ------------------------------------------------------------------ properties

spec_st = st.builds(
    lambda lo, span, target, m, delay: AutoscalingSpec(minReplicas=lo, maxReplicas=max(1, lo + span),
                                                       targetKVCacheUsage=target, maxWaitingRequests=m,
                                                       scaleDownDelaySeconds=delay),
    st.integers(0, 8), st.integers(0, 12), st.floats(0.05, 1.0), st.integers(0, 50), st.integers(0, 900))
sample_st = st.builds(lambda kv, w, r: PodSample("p", kv, w, r),
                      st.floats(0, 1), st.floats(0, 500), st.one_of(st.none(), st.floats(0, 256)))
obs_st = st.builds(lambda cur, s, f, nr: Observation(cur, tuple(s), f, nr),
                   st.integers(0, 30), st.lists(sample_st, max_size=12), st.integers(0, 3), st.integers(0, 3))
cap_st = st.one_of(st.none(), st.integers(1, 20))


@settings(max_examples=200, deadline=None)
@given(spec_st, cap_st, st.lists(obs_st, min_size=1, max_size=30))
def test_property_always_within_bounds(spec, cap, series):
    lo, hi = bounds(spec, cap)
    h = History()
    for i, o in enumerate(series):
        d = decide(spec, cap, o, h, i * PERIOD)
        h = d.history
        assert lo <= d.desired <= hi
        assert d.act == (d.desired != o.current_replicas)


@settings(max_examples=200, deadline=None)
@given(spec_st, cap_st, st.lists(obs_st, min_size=1, max_size=30))
def test_property_never_scales_down_on_missing_data(spec, cap, series):
    _, hi = bounds(spec, cap)
    h = History()
    for i, o in enumerate(series):
        d = decide(spec, cap, o, h, i * PERIOD * 40)  # long gaps too
        h = d.history
        if not o.complete:
            # only a lowered maxReplicas / policy cap may take replicas away without data
            assert d.desired >= min(o.current_replicas, hi), d.reason


@settings(max_examples=200, deadline=None)
@given(spec_st, cap_st, st.lists(obs_st, min_size=1, max_size=40), st.floats(1, 60))
def test_property_never_scales_down_before_the_delay(spec, cap, series, period):
    _, hi = bounds(spec, cap)
    h = History()
    for i, o in enumerate(series):
        now = i * period
        d = decide(spec, cap, o, h, now)
        h = d.history
        if now < spec.scaleDownDelaySeconds:
            assert d.desired >= min(o.current_replicas, hi), d.reason


@settings(max_examples=300, deadline=None)
@given(spec_st, st.integers(1, 12), st.data())
def test_property_in_band_and_short_queue_never_scales_up(spec, current, data):
    lo, hi = bounds(spec, None)
    t = spec.targetKVCacheUsage
    kvs = data.draw(st.lists(st.floats(max(0.0, t * 0.9), min(1.0, t * 1.1)), min_size=current, max_size=current))
    avg = sum(kvs) / len(kvs)
    if abs(avg / t - 1) > 0.1:
        return
    samples = [PodSample("p", k, spec.maxWaitingRequests * 0.5, 4) for k in kvs]
    d = decide(spec, None, Observation(current, tuple(samples)), History(), 0)
    assert d.desired <= max(current, lo)


@settings(max_examples=300, deadline=None)
@given(spec_st, obs_st)
def test_property_scale_up_step_is_bounded(spec, o):
    lo, hi = bounds(spec, None)
    d = decide(spec, None, o, History(), 0)
    cur = o.current_replicas
    if cur >= lo and d.desired > cur:
        tu = Tuning()
        assert d.desired <= max(math.ceil(cur * tu.max_scale_up_factor), cur + tu.max_scale_up_add)


# ------------------------------------------------------------------ rule 2c: the prefill-token rate (tried, off)

PREFILL = Tuning(prefill_rule=True)


def prompt_pods(kv: float, n: int, total: float, waiting: float = 0.0, running: float = 10.0) -> list[PodSample]:
    return [PodSample(f"p{i}", kv, waiting, running, prompt_tokens_total=total) for i in range(n)]


def test_prefill_rule_is_off_by_default():
    h = decide(SPEC, None, obs(2, prompt_pods(0.3, 2, 0.0)), History(), 0).history
    assert h.prompt_totals == () and h.prefill_capacity is None
    d = decide(SPEC, None, obs(2, prompt_pods(0.3, 2, 15 * 25_000)), h, 15)
    assert "prefill" not in d.figures and "prefill" not in d.reason


def test_prefill_rule_learns_the_capacity_when_requests_queue_with_kv_under_target():
    # 2 pods at KV 0.3 with 20 waiting each, prefilling 25k tokens/s each: prefill-bound.
    h = decide(SPEC, None, obs(2, prompt_pods(0.3, 2, 0.0, waiting=20)), History(), 0, PREFILL).history
    d = decide(SPEC, None, obs(2, prompt_pods(0.3, 2, 15 * 25_000, waiting=20)), h, 15, PREFILL)
    assert d.history.prefill_capacity == pytest.approx(25_000)
    # at capacity: 2 x 1/0.7 = 2.86 replicas of prefill demand
    assert d.figures["prefill_demand"] == pytest.approx(2 / 0.7)
    # A chat-bound queue (KV over target) teaches nothing: KV explains it.
    h = decide(SPEC, None, obs(2, prompt_pods(0.95, 2, 0.0, waiting=20)), History(), 0, PREFILL).history
    d = decide(SPEC, None, obs(2, prompt_pods(0.95, 2, 15 * 11_000, waiting=20)), h, 15, PREFILL)
    assert d.history.prefill_capacity is None and "prefill_demand" not in d.figures


def test_prefill_rule_holds_a_scale_down_that_kv_usage_would_make():
    spec = SPEC.model_copy(update={"scaleDownDelaySeconds": 0})
    known = Tuning(prefill_rule=True, prefill_capacity=25_000, saturation_memory_seconds=0)
    # 4 pods at KV 0.2 (KV alone wants ceil(4 x 0.2 / 0.7) = 2), each prefilling 17.5k tokens/s: 0.7 of
    # capacity, so the prefill rule wants the 4 (within tolerance: hold).
    h = decide(spec, None, obs(4, prompt_pods(0.2, 4, 0.0)), History(), 0, known).history
    d = decide(spec, None, obs(4, prompt_pods(0.2, 4, 15 * 17_500)), h, 15, known)
    assert d.kv_wants == 2 and d.desired == 4 and "prefill 17500 tokens/s/pod" in d.reason
    # Without the rule, KV usage scales it in.
    h = decide(spec, None, obs(4, prompt_pods(0.2, 4, 0.0)), History(), 0).history
    assert decide(spec, None, obs(4, prompt_pods(0.2, 4, 15 * 17_500)), h, 15).desired == 2


def test_prefill_rule_scales_up_on_the_prompt_rate_before_requests_queue():
    known = Tuning(prefill_rule=True, prefill_capacity=25_000)
    h = decide(SPEC, None, obs(3, prompt_pods(0.3, 3, 0.0)), History(), 0, known).history
    d = decide(SPEC, None, obs(3, prompt_pods(0.3, 3, 15 * 24_000)), h, 15, known)
    # 3 x 24k / (25k x 0.7) = 4.11 -> 5, with no request waiting and KV at 0.3
    assert d.queue_wants is None and d.desired == 5 and d.direction == "up"


def test_prefill_rate_leaves_out_new_pods_and_counters_that_went_back():
    known = Tuning(prefill_rule=True, prefill_capacity=25_000)
    h = decide(SPEC, None, obs(2, [PodSample("a", 0.3, 0, 10, prompt_tokens_total=1e6),
                                   PodSample("b", 0.3, 0, 10, prompt_tokens_total=5e5)]), History(), 0, known).history
    samples = [PodSample("a", 0.3, 0, 10, prompt_tokens_total=1e6 + 15 * 10_000),
               PodSample("b", 0.3, 0, 10, prompt_tokens_total=1_000.0),  # restarted: left out
               PodSample("c", 0.3, 0, 10, prompt_tokens_total=9e9)]      # new: no earlier value
    d = decide(SPEC, None, obs(3, samples), h, 15, known)
    # the rate of pod a stands for every ready pod: 3 x 10k / 17.5k = 1.71
    assert d.figures["prefill_demand"] == pytest.approx(3 * 10_000 / 17_500)
