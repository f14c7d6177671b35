"""Capacity-aware scaling across the variants (GPU pools) of one model, as a pure function.

One model can be served on several pools at once (H100 and L4, say). When the routing in front of
them follows capacity (an InferencePool's endpoint picker scoring on KV usage and queue, beside
the prompt's cached prefix), load spreads so that every pool runs at about the same KV usage
(requests sharing a prompt prefix stay on their pod until its queue or KV usage outweighs the
match: docs/routing.md), and each variant's own decision
(``algorithm.decide``) asks for about ``ready x avgKV / target`` replicas: every pool grows and
shrinks in proportion to its present size. Where one pool serves a token for a fraction of the
other's cost, that proportional growth buys expensive capacity.

``prefer_cheapest`` keeps the per-variant decisions as the measure of demand (their KV and queue
rules, step limits and scale-down delays are unchanged) and only changes WHERE the capacity goes:

- the capacity the variants want in total is ``sum(desired_v x throughput_v)`` (throughput: the
  planner's estimate per replica; ``PoolEconomics``);
- a net scale-up adds that extra capacity to the pool with the lowest cost per served token that
  has room (``maxReplicas``, the per-decision step limit), spilling over to the next cheapest;
- a net scale-down (which the per-variant decisions only ask for after ``scaleDownDelaySeconds``
  of lower demand) removes replicas from the pool with the HIGHEST cost per token first, never
  below ``minReplicas`` and never below the capacity wanted;
- a variant whose data is incomplete (a pod starting, a pod not reporting) or that is held at a
  bound keeps its own decision, and so does every variant when no economics are known: the
  preference never turns missing data into a scale-down.

Cost per token = ``cost weight of the pool's GPU x GPUs per replica / throughput per replica``.
The weight is a relative price (H100 1.0, L4 0.25, ...) from the operator's setting; the
throughput is the plan's decode estimate (``status.plan.variants[].decodeTokensPerSecond``, memory
bandwidth over bytes read per token). Only the ratio between pools matters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from fewerbits_operator.autoscaler.algorithm import Decision, Tuning

EPS = 1e-9


@dataclass(frozen=True)
class PoolEconomics:
    """What one replica of a variant serves and costs."""

    throughput: float
    """Tokens/s one replica serves (any unit, the same for every pool of the model)."""
    cost: float
    """Cost of one replica per unit of time (relative: GPU cost weight x GPUs per replica)."""

    def __post_init__(self) -> None:
        if not (self.throughput > 0 and math.isfinite(self.throughput)):
            raise ValueError(f"throughput must be a positive number (got {self.throughput!r})")
        if not (self.cost > 0 and math.isfinite(self.cost)):
            raise ValueError(f"cost must be a positive number (got {self.cost!r})")

    @property
    def cost_per_token(self) -> float:
        return self.cost / self.throughput


@dataclass(frozen=True)
class VariantState:
    """One variant as its own decision (``algorithm.decide``) left it."""

    variant: str
    current: int
    """spec.replicas of its scale subresource (starting pods included)."""
    desired: int
    """What its own decision wants (scale-downs only after its delay, never on missing data)."""
    wants: int | None
    """Its demand this instant in replicas, ``max(kv_wants, queue_wants)`` of the decision,
    measured on its ready pods; None without data."""
    lo: int
    hi: int
    """Its bounds (``algorithm.bounds``)."""
    complete: bool = True
    """Every replica has a ready pod that reported (``Observation.complete``): only then may the
    preference take replicas away from it."""
    step_limit: int | None = None
    """Most replicas one decision may reach (``max(2 x current, current + 4)``); None: no limit."""


@dataclass(frozen=True)
class Choice:
    variant: str
    desired: int
    reason: str
    """Empty when the variant's own decision stands."""


def economics_from_plan(plan_variants: Sequence[Mapping], cost_weights: Mapping[str, float],
                        default_weight: float = 1.0) -> dict[str, PoolEconomics]:
    """``PoolEconomics`` per pool from the plan (``status.plan.variants``: ``pool``, ``gpuProduct``,
    ``tensorParallelSize``, ``nodesPerReplica``, ``decodeTokensPerSecond``) and cost weights by GPU product (or pool
    name). A variant without a usable estimate is left out (it keeps its own decision)."""
    out: dict[str, PoolEconomics] = {}
    for v in plan_variants:
        pool, product = v.get("pool"), v.get("gpuProduct")
        tps, tp = v.get("decodeTokensPerSecond"), v.get("tensorParallelSize") or 1
        nodes = v.get("nodesPerReplica") or 1
        if not pool or not isinstance(tps, (int, float)) or tps <= 0:
            continue
        weight = cost_weights.get(pool, cost_weights.get(product or "", default_weight))
        out[pool] = PoolEconomics(float(tps), float(weight) * int(tp) * int(nodes))
    return out


def prefer_cheapest(states: Sequence[VariantState], economics: Mapping[str, PoolEconomics]) -> list[Choice]:
    """The desired replicas of each variant with the model's extra capacity placed on the pools
    with the lowest cost per token, and removed from the highest first (module docstring).

    Demand is compared with capacity over the whole model: ``need = sum(wants_v x throughput_v)``
    against ``have = sum(current_v x throughput_v)``, starting pods included, so a pool whose own
    KV rule still fires while another pool's new replicas start is not scaled up a second time
    (rule 3 of ``algorithm``, across pools). A scale-down removes at most what the variants' own
    (delayed) decisions give up, ``have - max(sum(desired_v x throughput_v), need)``."""
    keep = [Choice(s.variant, s.desired, "") for s in states]
    movable = [s for s in states if s.variant in economics and s.lo <= s.current <= s.hi]
    if len(movable) < 2:
        return keep
    fixed = {s.variant for s in states} - {s.variant for s in movable}
    thr = {s.variant: economics[s.variant].throughput for s in movable}
    have = sum(s.current * thr[s.variant] for s in movable)
    need = sum((s.current if s.wants is None else s.wants) * thr[s.variant] for s in movable)
    allowed = sum(s.desired * thr[s.variant] for s in movable)
    target = {s.variant: s.current for s in movable}
    by_cost = sorted(movable, key=lambda s: (economics[s.variant].cost_per_token, s.variant))
    if need > have + EPS:
        missing = need - have
        for s in by_cost:
            cap = s.hi if s.step_limit is None else min(s.hi, s.step_limit)
            room = cap - target[s.variant]
            if room <= 0:
                continue
            add = min(room, math.ceil(missing / thr[s.variant] - EPS))
            target[s.variant] += add
            missing -= add * thr[s.variant]
            if missing <= EPS:
                break
    elif max(allowed, need) < have - EPS:
        surplus = have - max(allowed, need)
        for s in reversed(by_cost):
            floor = s.lo if s.complete else s.current
            drop = min(target[s.variant] - floor, math.floor(surplus / thr[s.variant] + EPS))
            if drop > 0:
                target[s.variant] -= drop
                surplus -= drop * thr[s.variant]
    out: list[Choice] = []
    cheapest = economics[by_cost[0].variant].cost_per_token
    for s in states:
        if s.variant in fixed or target[s.variant] == s.desired:
            out.append(Choice(s.variant, s.desired, ""))
            continue
        cpt = economics[s.variant].cost_per_token
        out.append(Choice(s.variant, target[s.variant],
                          f"capacity-aware: the model's pools want {need:.0f} of {have:.0f} units of "
                          f"throughput; this pool costs {cpt / cheapest:.2f}x the cheapest per token, so "
                          f"{s.variant} goes to {target[s.variant]} (its own decision: {s.desired})"))
    return out


def state_of(variant: str, decision, lo: int, hi: int, complete: bool, max_scale_up_factor: float = 2.0,
             max_scale_up_add: int = 4) -> VariantState:
    """The ``VariantState`` of a variant from its ``algorithm.Decision`` (same step limit as decide)."""
    cur = decision.current
    wants = None
    if decision.kv_wants is not None:
        wants = max(decision.kv_wants, decision.queue_wants or 0)
    limit = max(math.ceil(cur * max_scale_up_factor - EPS), cur + max_scale_up_add)
    return VariantState(variant, cur, decision.desired, wants, lo, hi, complete, limit)


def rebalance(variants: Sequence[tuple[str, Decision, bool]], lo: int, hi: int,
              economics: Mapping[str, PoolEconomics], tuning: Tuning = Tuning()) -> list[Decision]:
    """The one entry point of the preference, called by the autoscaler loop (for a model with
    ``status.autoscaling.placement: cheapestPool``) and by the bench: each variant's own
    ``algorithm.Decision`` (with whether its data was complete, ``Observation.complete``) in, the
    decisions to act on out, in the same order. A decision the preference changes gets its new
    ``desired``, ``act``, ``direction`` and the preference's reason (its own kept after it); the
    others are returned as they were (their history is the variant's own in every case)."""
    states = [state_of(v, d, lo, hi, complete, tuning.max_scale_up_factor, tuning.max_scale_up_add)
              for v, d, complete in variants]
    out = []
    for (_, d, _), choice in zip(variants, prefer_cheapest(states, economics)):
        if not choice.reason:
            out.append(d)
            continue
        direction = "up" if choice.desired > d.current else "down" if choice.desired < d.current else None
        out.append(replace(d, desired=choice.desired, act=choice.desired != d.current, direction=direction,
                           reason=f"{choice.reason}; {d.reason}"))
    return out
