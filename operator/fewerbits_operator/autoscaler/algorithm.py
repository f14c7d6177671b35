"""The scaling decision for one variant, as a pure function (docs/architecture.md, house rule 1): figures in, a
decision out, no clock and no I/O. The loop feeds it; tests and the bench drive it directly.

Rules (each answers a known failure of an existing LLM autoscaler):

1. **KV rule** (HPA's formula): ``kv_wants = ceil(ready x avgKV / target)``, but no change while
   ``|avgKV / target - 1| <= tolerance`` (0.1, as HPA and AIBrix), so noise around the target
   moves nothing.
2. **Queue rule** (llm-d found KV usage alone misses prefill-heavy saturation: KV near 0.3 while
   queues grow). When the average waiting requests per ready pod exceed ``maxWaitingRequests``
   (M), the excess ``(avgWaiting - M) x ready`` must be absorbed by new replicas, and a new
   replica absorbs about as many sequences as a saturated one runs now (vLLM queues a request
   only when it cannot schedule it, so a queueing pod's running count is its concurrency):
   ``queue_wants = ready + ceil(excess / max(1, avgRunning))``. The larger of the two rules wins.
   A backlog is not demand that lasts, so the queue rule holds (a) while pods are starting,
   (b) for one sync after new pods become ready, and (c) while the queue shrinks fast enough to
   be gone within 120 s -- without these, the backlog that builds during a pod's start-up
   doubled the variant again and again (seen in the bench: 3 -> 24 replicas for load needing 5).
2b. **Saturation memory**: when the queue rule fires, the running requests per pod are
   remembered (30 min) as what a pod can run under the present mix; a scale-down never goes
   below ``ceil(running total / (that x 0.9))``. KV usage understates prefill-bound load, and
   without this a KV-driven scale-down returned to the count that queued every ~7 minutes.
2c. **Prefill-token rate** (issue 45; tried, OFF: ``Tuning.prefill_rule``, and the scrape does not
   read the counter). ``vllm:prompt_tokens_total``'s rate per pod between two passes against
   what a pod prefills at most (learned when requests queue with KV usage under target, or
   ``Tuning.prefill_capacity``): ``prefill_wants = ceil(ready x rate / (capacity x target))``,
   with the KV rule's tolerance; it joins the larger-of and the forecast's demand. In the bench it
   cut saturated minutes by up to 35 on some traces but raised them on another and the GPU-hours
   ratio on several, so it failed the keep rule (docs/autoscaling.md, issue 45).
3. **Pods still starting count as capacity**: the wants are compared with the Deployment's
   current replicas (the scale subresource's spec, starting pods included), not with ready pods,
   so a scale-up in flight is not repeated every sync while its pods start.
4. **Scale up at once, bounded**: up to ``max(2 x current, current + 4)`` per decision (HPA's
   default scale-up policy), within one sync period of the signal.
5. **Scale down only after sustained lower demand**: every recommendation is kept for
   ``scaleDownDelaySeconds``; the decision scales down to the HIGHEST recommendation in that
   window (HPA stabilisation), and only once the window is fully observed (after a restart, or a
   gap in observations longer than the window, the wait starts again).
6. **Never scale down on missing data**: with no samples, a ready pod not reporting, a pod not
   ready, or fewer pods than replicas, the recommendation recorded is at least the current count
   (so the full delay runs again once data is back). Scale-up still works from the pods that
   report; a ready pod that does not report is assumed to carry the average load of those that
   do (assuming it fully loaded would let a blocked metrics port scale a variant to its maximum;
   assuming it idle would hide real pressure).
7. **Bounds**: ``[minReplicas, min(maxReplicas, policy rules.maxReplicas)]``; the policy cap wins
   over minReplicas. Bounds are enforced even without data (they are limits, not demand).
8. **No scale from zero**: at 0 replicas there are no pods and so no vLLM metrics; the variant
   stays at 0 until minReplicas (or a user) raises it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from fewerbits_api.quantizedmodel import AutoscalingSpec

from fewerbits_operator.autoscaler.metrics import PodSample

EPS = 1e-9


@dataclass(frozen=True)
class Tuning:
    """Knobs of the algorithm that are not in the API (the defaults are the documented policy)."""

    tolerance: float = 0.1
    """No KV-driven change while |avgKV/target - 1| is within this."""
    max_scale_up_factor: float = 2.0
    """A decision may at most multiply the replicas by this..."""
    max_scale_up_add: int = 4
    """...or add this many, whichever is more."""
    saturation_memory_seconds: float = 1800.0
    """How long the running-per-pod level at which the variant last queued is remembered as its
    capacity (it guards scale-downs when KV usage understates load; the mix of requests changes,
    so it expires)."""
    queue_drain_horizon_seconds: float = 120.0
    """The queue rule holds while the queue shrinks fast enough to be gone within this (a new pod
    would start too late to help)."""
    prefill_rule: bool = False
    """Rule 2c (the prefill-token rate) on."""
    prefill_capacity: float | None = None
    """Prompt tokens/s one pod prefills at most, when known; None: learned (rule 2c)."""


@dataclass(frozen=True)
class Observation:
    """What the loop saw of one variant at one instant."""

    current_replicas: int
    """spec.replicas of the Deployment's scale subresource."""
    samples: Sequence[PodSample] = ()
    """Samples of ready pods that reported."""
    scrape_failures: int = 0
    """Ready pods that gave no usable sample."""
    pods_not_ready: int = 0
    """Pods that exist but are not ready (starting, failing probes)."""

    @property
    def ready(self) -> int:
        return len(self.samples) + self.scrape_failures

    @property
    def pods_missing(self) -> int:
        """Replicas with no pod yet (not created or not scheduled)."""
        return max(0, self.current_replicas - self.ready - self.pods_not_ready)

    @property
    def complete(self) -> bool:
        """Every replica has a ready pod that reported."""
        return bool(self.samples) and not self.scrape_failures and not self.pods_not_ready and not self.pods_missing


@dataclass(frozen=True)
class History:
    """Recommendations of the last ``scaleDownDelaySeconds``, kept as a sliding-window maximum:
    an entry is dropped once a later entry is at least as high (it can never be the maximum
    again), so the first entry is the window's maximum and the list stays short."""

    entries: tuple[tuple[float, int], ...] = ()
    """(time, recommended replicas), oldest first, recommendations strictly decreasing."""
    since: float | None = None
    """Start of the current unbroken run of observations."""
    ready: int | None = None
    """Ready pods at the previous observation (the queue rule waits one observation after
    capacity grows: the backlog the new pods will absorb is still in the queue)."""
    waiting: float | None = None
    """Total waiting requests at the previous observation (to tell a draining queue)."""
    at: float | None = None
    """Time of the previous observation."""
    saturated_running: tuple[float, float] | None = None
    """(time, running requests per pod) when the queue rule last fired: what a pod runs at most
    under the present mix of requests."""
    prompt_totals: tuple[tuple[str, float], ...] = ()
    """(pod, ``vllm:prompt_tokens_total``) at the previous observation (rule 2c's rate)."""
    prefill_capacity: float | None = None
    """Prompt tokens/s per pod when requests last queued with KV usage under target: what a pod
    prefills at most (rule 2c; a property of the pod's GPU and model, not of the mix)."""


@dataclass(frozen=True)
class Decision:
    desired: int
    current: int
    act: bool
    """desired != current: write the scale subresource."""
    reason: str
    """Why, with the numbers (for the Event and the log)."""
    history: History
    direction: str | None = None
    """"up", "down" or None."""
    avg_kv: float | None = None
    avg_waiting: float | None = None
    kv_wants: int | None = None
    queue_wants: int | None = None
    figures: dict[str, float] = field(default_factory=dict)
    cause: str = "reactive"
    """What set ``desired``: "reactive" (these rules, the bounds, the placement) or "predictive"
    (``forecast.foresee`` added capacity early or held it for the forecast)."""


def bounds(spec: AutoscalingSpec, policy_max: int | None) -> tuple[int, int]:
    """[minReplicas, min(maxReplicas, policy cap)]; the policy cap wins over minReplicas."""
    hi = spec.maxReplicas if policy_max is None else min(spec.maxReplicas, policy_max)
    return min(spec.minReplicas, hi), hi


def _record(history: History, now: float, rec: int, window: float, ready: int, waiting: float | None,
            saturated: tuple[float, float] | None, prompt_totals: tuple[tuple[str, float], ...] = (),
            prefill_capacity: float | None = None) -> History:
    since = history.since
    if since is None or not history.entries or history.entries[-1][0] < now - window:
        since = now  # first observation, or a gap longer than the window: the wait starts again
    kept = [(t, r) for t, r in history.entries if t >= now - window and r > rec]
    kept.append((now, rec))
    return History(tuple(kept), since, ready, waiting, now, saturated, prompt_totals, prefill_capacity)


def _drain_eta(history: History, waiting: float, now: float) -> float | None:
    """Seconds until the queue is empty at the rate it shrank since the previous observation;
    None when it did not shrink."""
    if history.waiting is None or history.at is None or now <= history.at or waiting >= history.waiting:
        return None
    return waiting / ((history.waiting - waiting) / (now - history.at))


@dataclass(frozen=True)
class _Demand:
    """What the metrics ask for now (``_demand``): None throughout when no pod reported."""

    avg_kv: float | None = None
    avg_wait: float | None = None
    kv_wants: int | None = None
    queue_wants: int | None = None
    raw: int | None = None
    """The larger of the two rules, after the concurrency floor."""
    saturated: tuple[float, float] | None = None
    """(when, running per pod) the last time requests queued (History.saturated_running)."""
    prefill_wants: int | None = None
    prefill_demand: float | None = None
    """Rule 2c: replicas the prompt-token rate asks for (rounded, with the tolerance) and unrounded."""
    prefill_capacity: float | None = None


def decide(spec: AutoscalingSpec, policy_max: int | None, obs: Observation, history: History, now: float,
           tuning: Tuning = Tuning()) -> Decision:
    """The desired replica count of one variant now, and why."""
    lo, hi = bounds(spec, policy_max)
    cur = obs.current_replicas
    delay = float(spec.scaleDownDelaySeconds)
    notes: list[str] = []
    dem = _demand(spec, obs, history, now, tuning, notes) if obs.samples else \
        _Demand(saturated=history.saturated_running, prefill_capacity=history.prefill_capacity)
    missing = _missing_data(obs, notes)
    # What this instant asks for, as remembered for the scale-down window: never below the
    # current count when data is missing (rule 6).
    rec = cur if dem.raw is None else (dem.raw if obs.complete else max(dem.raw, cur))
    rec = min(max(rec, lo), hi)
    totals = tuple((s.pod, s.prompt_tokens_total) for s in obs.samples if s.prompt_tokens_total is not None)
    new_history = _record(history, now, rec, delay, obs.ready,
                          None if dem.avg_wait is None else dem.avg_wait * obs.ready, dem.saturated,
                          totals if tuning.prefill_rule else (), dem.prefill_capacity)
    figures = {"ready": float(obs.ready), "reporting": float(len(obs.samples)), "current": float(cur)}
    if dem.prefill_demand is not None:
        figures["prefill_demand"] = dem.prefill_demand

    def done(desired: int, direction: str | None, why: str) -> Decision:
        text = why + ("; " + "; ".join(notes) if notes else "")
        if missing:
            text += " (missing data: " + ", ".join(missing) + ")"
        return Decision(desired, cur, desired != cur, text, new_history, direction, dem.avg_kv, dem.avg_wait,
                        dem.kv_wants, dem.queue_wants, figures)

    if cur < lo:
        return done(lo, "up", f"scale up {cur}->{lo}: below minReplicas {lo}")
    if cur > hi:
        cap = "policy rules.maxReplicas" if policy_max is not None and policy_max < spec.maxReplicas else "maxReplicas"
        return done(hi, "down", f"scale down {cur}->{hi}: above {cap} {hi}")
    if dem.raw is not None and dem.raw > cur:
        limit = max(math.ceil(cur * tuning.max_scale_up_factor - EPS), cur + tuning.max_scale_up_add)
        desired = min(dem.raw, limit, hi)
        if desired == cur:
            return done(cur, None, f"hold {cur}: demand wants {dem.raw} but maxReplicas is {hi}")
        extra = f" (step limit {limit})" if dem.raw > limit and limit < hi else (f" (capped at {hi})" if dem.raw > hi else "")
        return done(desired, "up", f"scale up {cur}->{desired}{extra}")
    window_max = min(max(new_history.entries[0][1], lo), hi)
    if window_max < cur:
        waited = now - (new_history.since if new_history.since is not None else now)
        if not obs.complete:
            return done(cur, None, f"hold {cur}: demand is lower but scale-down waits for complete data")
        if waited + EPS < delay:
            return done(cur, None, f"hold {cur}: lower demand for {waited:.0f}s of scaleDownDelaySeconds {delay:.0f}")
        return done(window_max, "down", f"scale down {cur}->{window_max}: highest recommendation in the last "
                                          f"{delay:.0f}s is {window_max}")
    return done(cur, None, f"hold {cur}")


def _demand(spec: AutoscalingSpec, obs: Observation, history: History, now: float, tuning: Tuning,
            notes: list[str]) -> _Demand:
    """The KV rule and the queue rule over the reporting pods, and the concurrency floor."""
    n, ready, cur, target = len(obs.samples), obs.ready, obs.current_replicas, spec.targetKVCacheUsage
    avg_kv = sum(s.kv_cache_usage for s in obs.samples) / n
    avg_wait = sum(s.waiting for s in obs.samples) / n
    running = [s.running for s in obs.samples if s.running is not None]
    avg_run = sum(running) / len(running) if running else 0.0
    ratio = avg_kv / target
    if abs(ratio - 1.0) <= tuning.tolerance + EPS:
        kv_wants = cur
        notes.append(f"KV {avg_kv:.2f} avg over {n} pod(s) is within {tuning.tolerance:.0%} of target {target:.2f}")
    else:
        kv_wants = math.ceil(ready * ratio - EPS)
        notes.append(f"KV {avg_kv:.2f} avg over {n} pod(s) vs target {target:.2f} wants {kv_wants}")
    queue_wants = _queue_rule(spec, obs, history, now, tuning, avg_wait, avg_run, notes)
    saturated = (now, avg_run) if queue_wants is not None and running else history.saturated_running
    raw = max(kv_wants, queue_wants or 0)
    prefill_wants = prefill_demand = None
    capacity = history.prefill_capacity
    if tuning.prefill_rule:
        prefill_wants, prefill_demand, capacity = _prefill_rule(spec, obs, history, now, tuning, avg_kv, avg_wait,
                                                                notes)
        if prefill_wants is not None:
            raw = max(raw, prefill_wants)
    if saturated is not None and now - saturated[0] <= tuning.saturation_memory_seconds and running \
            and saturated[1] > EPS and raw < cur:
        # KV usage understates prefill-bound load: do not go below the count at which the
        # pods would run as many requests as they did when requests last queued.
        conc_floor = math.ceil(avg_run * ready / (saturated[1] * (1 - tuning.tolerance)) - EPS)
        if conc_floor > raw:
            raw = min(cur, conc_floor)
            notes.append(f"running {avg_run:.1f}/pod; requests queued at {saturated[1]:.1f}/pod "
                         f"{now - saturated[0]:.0f}s ago: keeps at least {raw}")
    return _Demand(avg_kv, avg_wait, kv_wants, queue_wants, raw, saturated, prefill_wants, prefill_demand, capacity)


def _prompt_rate(obs: Observation, history: History, now: float) -> float | None:
    """Prompt tokens/s per reporting pod since the previous observation, over the pods that
    reported ``vllm:prompt_tokens_total`` both times (a counter that went back, a restarted pod,
    is left out); None without such a pod."""
    if history.at is None or now <= history.at or not history.prompt_totals:
        return None
    before = dict(history.prompt_totals)
    deltas = [s.prompt_tokens_total - before[s.pod] for s in obs.samples
              if s.prompt_tokens_total is not None and s.pod in before and s.prompt_tokens_total >= before[s.pod]]
    if not deltas:
        return None
    return sum(deltas) / len(deltas) / (now - history.at)


def _prefill_rule(spec: AutoscalingSpec, obs: Observation, history: History, now: float, tuning: Tuning,
                  avg_kv: float, avg_wait: float, notes: list[str]) -> tuple[int | None, float | None, float | None]:
    """Rule 2c: (replicas the prompt-token rate asks for, the same unrounded, the per-pod prefill
    capacity known after this observation)."""
    rate = _prompt_rate(obs, history, now)
    capacity = tuning.prefill_capacity or history.prefill_capacity
    if rate is None:
        return None, None, capacity
    target = spec.targetKVCacheUsage
    if tuning.prefill_capacity is None and avg_wait > spec.maxWaitingRequests + EPS \
            and avg_kv < target * (1 - tuning.tolerance):
        # Requests queue while the KV cache has room: the pods are bound by prefill, and what
        # they prefill now is what a pod prefills at most.
        capacity = max(capacity or 0.0, rate)
    if not capacity:
        return None, None, capacity
    ratio = rate / (capacity * target)
    demand = obs.ready * ratio
    if abs(ratio - 1.0) <= tuning.tolerance + EPS:
        wants = obs.current_replicas
    else:
        wants = math.ceil(demand - EPS)
    notes.append(f"prefill {rate:.0f} tokens/s/pod of {capacity:.0f} at most wants {wants}")
    return wants, demand, capacity


def _queue_rule(spec: AutoscalingSpec, obs: Observation, history: History, now: float, tuning: Tuning,
                avg_wait: float, avg_run: float, notes: list[str]) -> int | None:
    """Replicas the waiting requests ask for, or None: within maxWaitingRequests, or a queue that
    starting pods, newly ready pods or its own drain will absorb."""
    ready, limit = obs.ready, spec.maxWaitingRequests
    if avg_wait <= limit + EPS:
        notes.append(f"{avg_wait:.1f} waiting/pod <= {limit}")
        return None
    starting = obs.pods_not_ready + obs.pods_missing
    if starting:
        notes.append(f"{avg_wait:.1f} waiting/pod > {limit}, but the queue rule waits for {starting} starting pod(s)")
        return None
    if history.ready is not None and ready > history.ready:
        notes.append(f"{avg_wait:.1f} waiting/pod > {limit}, but the queue rule waits one "
                     f"sync for {ready - history.ready} newly ready pod(s) to take their share")
        return None
    eta = _drain_eta(history, avg_wait * ready, now)
    if eta is not None and eta <= tuning.queue_drain_horizon_seconds:
        notes.append(f"{avg_wait:.1f} waiting/pod > {limit}, but the queue drains in ~{eta:.0f}s")
        return None
    queue_wants = ready + math.ceil((avg_wait - limit) * ready / max(1.0, avg_run) - EPS)
    notes.append(f"{avg_wait:.1f} waiting/pod > {limit} (running {avg_run:.1f}/pod) wants {queue_wants}")
    return queue_wants


def _missing_data(obs: Observation, notes: list[str]) -> list[str]:
    """What the pass could not see (said in the decision's reason; rule 6 holds the count)."""
    missing = []
    if not obs.samples:
        missing.append("no pod reported metrics")
    if obs.scrape_failures:
        missing.append(f"{obs.scrape_failures} ready pod(s) not reporting")
    if obs.pods_not_ready:
        missing.append(f"{obs.pods_not_ready} pod(s) not ready")
    if obs.pods_missing:
        missing.append(f"{obs.pods_missing} pod(s) not created yet")
    if obs.samples and obs.scrape_failures:
        notes.append(f"{obs.scrape_failures} unreported pod(s) assumed at the average")
    return missing
