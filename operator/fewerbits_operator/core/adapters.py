"""What is decided of a model's LoRA adapters in one pass (pure): ``status.adapters`` and the
``AdaptersServed`` condition, from the adapters' configs (observe) and the plan (planner/lora.py).

An adapter is served on a pool only where its config fits the base, the pool holds LoRA
buffers for it, and it passed its gate on that pool's base (docs/adapters.md). The base does not
wait for its adapters: AdaptersServed stands beside the chain that ends in Ready.
"""

from __future__ import annotations

from collections.abc import Mapping

from fewerbits_api.adapters import AdapterPoolStatus, AdapterSpec, AdapterStatus
from fewerbits_api.conditions import Reason
from fewerbits_api.quantizedmodel import PlanStatus, PlanVariant
from fewerbits_operator.planner.lora import AdapterFacts


def adapter_statuses(adapters: list[AdapterSpec], facts: tuple[AdapterFacts, ...], problems: Mapping[str, str],
                     the_plan: PlanStatus, artifact_keys: Mapping[str, str], served_name: str) -> list[AdapterStatus]:
    """Each adapter of the spec, in its order: its config's facts or its problem, and per variant
    whether the pool can hold it (``artifact_keys``: the base artifact of each variant)."""
    by_name = {f.name: f for f in facts}
    out = []
    for i, a in enumerate(adapters):
        fact = by_name.get(a.name)
        if a.name == served_name:  # the API server refuses it when servedModelName is written out
            out.append(AdapterStatus(name=a.name, problem=(
                f"spec.adapters[{i}].name: {a.name!r} is the name the base is served under (the model's name, "
                "as spec.serving.servedModelName is unset): a request naming it would reach the base; rename the adapter")))
            continue
        if fact is None:
            out.append(AdapterStatus(name=a.name, problem=problems.get(a.name, "its adapter_config.json was not read")))
            continue
        pools = [_on_pool(a.name, v, artifact_keys.get(v.pool)) for v in the_plan.variants]
        out.append(AdapterStatus(name=a.name, rank=fact.rank, targetModules=list(fact.target_modules), pools=pools))
    return out


def _on_pool(name: str, variant: PlanVariant, artifact_key: str | None) -> AdapterPoolStatus:
    if variant.lora is None or name not in variant.lora.adapters:
        reason = variant.adaptersRefused or "this pool's plan holds no LoRA buffers"
        return AdapterPoolStatus(variant=variant.pool, artifactKey=artifact_key, state="NotPlanned", reason=reason)
    return AdapterPoolStatus(variant=variant.pool, artifactKey=artifact_key, state="Pending",
                             reason="not judged on this pool's base yet")


def adapters_condition(statuses: list[AdapterStatus]) -> tuple[bool, str, str]:
    """(status, reason, message) of AdaptersServed for a model with adapters."""
    invalid = [f"{s.name}: {s.problem}" for s in statuses if s.problem]
    if invalid:
        return False, Reason.ADAPTER_INVALID, "; ".join(invalid)
    refused = sorted({f"{p.variant}: {p.reason}" for s in statuses for p in s.pools if p.state == "NotPlanned"})
    if refused and all(p.state == "NotPlanned" for s in statuses for p in s.pools):
        return False, Reason.ADAPTERS_NOT_PLANNED, "no pool holds the adapters: " + "; ".join(refused)
    pending = [s.name for s in statuses if any(p.state == "Pending" for p in s.pools)]
    message = (f"{len(pending)} adapter(s) ({', '.join(pending)}) await their gate on each pool's base; "
               "none is served before it passes there")
    if refused:
        message += "; not planned on " + "; ".join(refused)
    return False, Reason.AWAITING_ADAPTER_GATE, message


def adapters_step(adapters: list[AdapterSpec], facts: tuple[AdapterFacts, ...], problems: Mapping[str, str],
                  the_plan: PlanStatus, artifact_keys: Mapping[str, str], served_name: str
                  ) -> tuple[list[AdapterStatus], tuple[bool, str, str] | None]:
    """The adapters' status and their condition (None: the model has no adapters, no condition)."""
    if not adapters:
        return [], None
    statuses = adapter_statuses(adapters, facts, problems, the_plan, artifact_keys, served_name)
    return statuses, adapters_condition(statuses)

