"""What is decided of a model's LoRA adapters in one pass (pure): ``status.adapters`` and the
``AdaptersServed`` condition, from the adapters' configs (observe), the plan (planner/lora.py) and
each base artifact's quality report (the Job measures every adapter on the 16-bit base and on the
artifact: quantjob/adapters.py).

An adapter is served on a pool only where its config fits the base, the pool holds LoRA
buffers for it, and it passed its gate on that pool's base (docs/adapters.md). The base does not
wait for its adapters: AdaptersServed stands beside the chain that ends in Ready.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from fewerbits_api.adapters import AdapterEvaluation, AdapterPoolStatus, AdapterQuality, AdapterSpec, AdapterStatus
from fewerbits_api.artifact import QualityReport
from fewerbits_api.conditions import Reason
from fewerbits_api.formats import QuantFormat
from fewerbits_api.quantizedmodel import PlanStatus, PlanVariant
from fewerbits_operator.planner.lora import AdapterFacts
from fewerbits_operator.serving.canary import AdapterVerdict
from fewerbits_operator.serving.serving_load import ServedAdapter


@dataclass(frozen=True)
class AdapterInputs:
    """What the adapters' step reads."""

    adapters: list[AdapterSpec]
    plan: PlanStatus
    evaluations: tuple[AdapterEvaluation, ...]
    """Each adapter's gate resolved against the model's (its threshold)."""
    facts: tuple[AdapterFacts, ...]
    problems: Mapping[str, str]
    served_name: str
    identity: str
    """The evaluation identity of the current gate with the adapters: a report of another one did
    not measure these adapters (an evaluation Job is on its way)."""
    artifact_keys: Mapping[str, str] = field(default_factory=dict)
    """By variant: its base artifact's key."""
    reports: Mapping[str, QualityReport | None] = field(default_factory=dict)
    """By artifact key: the quality report that answers its gate (None: not measured yet)."""
    old: list[AdapterStatus] = field(default_factory=list)
    """The last pass's status.adapters."""
    loaded: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """By pool: the ``--lora-modules`` entries (``NAME=PATH``) of its serving object as observed,
    rolled out or not: what a pool keeps loading while its adapters are measured again."""
    canary: Mapping[str, Mapping[str, AdapterVerdict]] = field(default_factory=dict)
    """By pool whose served configuration has a canary verdict: each adapter as the verdict judged
    it through vLLM (serving/canary.py ``adapter_verdicts``). There an adapter is loaded only if
    the canary measured it and it passed."""
    canary_unread: frozenset[str] = frozenset()
    """Pools whose canary verdict cannot be read now: no adapter is added there meanwhile."""


@dataclass(frozen=True)
class AdapterOutcome:
    statuses: list[AdapterStatus]
    failed: list[str]
    """One line per adapter and pool newly refused by its gate (for the events), with the figures."""

    @property
    def condition(self) -> tuple[bool, str, str] | None:
        """AdaptersServed on these statuses as they are (None: the model has no adapters); decide
        sets it once the pools' objects confirmed what they load (confirm_served)."""
        return adapters_condition(self.statuses) if self.statuses else None


def adapters_step(inp: AdapterInputs) -> AdapterOutcome:
    """The adapters' status (``served``: what the pods are to load) and the gate failures new since
    the last pass."""
    if not inp.adapters:
        return AdapterOutcome([], [])
    statuses = [_status(i, a, inp) for i, a in enumerate(inp.adapters)]
    before = {(s.name, p.variant, p.artifactKey) for s in inp.old for p in s.pools if p.state == "Failed"}
    failed = [f"adapter {s.name} on pool {p.variant}: {p.reason}" for s in statuses for p in s.pools
              if p.state == "Failed" and (s.name, p.variant, p.artifactKey) not in before]
    return AdapterOutcome(statuses, failed)


def _status(i: int, a: AdapterSpec, inp: AdapterInputs) -> AdapterStatus:
    fact = next((f for f in inp.facts if f.name == a.name), None)
    if a.name == inp.served_name:  # the API server refuses it when servedModelName is written out
        return AdapterStatus(name=a.name, problem=(
            f"spec.adapters[{i}].name: {a.name!r} is the name the base is served under (the model's name, "
            "as spec.serving.servedModelName is unset): a request naming it would reach the base; rename the adapter"))
    if fact is None:
        return AdapterStatus(name=a.name, problem=inp.problems.get(a.name, "its adapter_config.json was not read"))
    threshold = next(e.maxIncreasePercent for e in inp.evaluations if e.name == a.name)
    before = {p.variant: p for s in inp.old if s.name == a.name for p in s.pools}
    pools = [_pool(a.name, v, inp, threshold, before.get(v.pool)) for v in inp.plan.variants]
    return AdapterStatus(name=a.name, rank=fact.rank, targetModules=list(fact.target_modules), pools=pools)


def _pool(name: str, variant: PlanVariant, inp: AdapterInputs, threshold: float,
          old: AdapterPoolStatus | None) -> AdapterPoolStatus:
    """The adapter's verdict on one pool, the files it names (kept for retention whatever the
    verdict), and whether the pool's pods are to load them. While it is measured again (its source,
    its evaluation set or another adapter changed), the files that passed here keep serving."""
    artifact = inp.artifact_keys.get(variant.pool)
    pool = _on_pool(name, variant, artifact, inp, threshold)
    key, why_not = _adapter_key(inp, artifact, name)
    pool, unmeasured = _canary_judged(name, variant.pool, pool, inp)
    if key and (pool.state == "Failed" or unmeasured):
        return pool.model_copy(update={"adapterKey": key, "reason": f"{pool.reason}; not served: {unmeasured}"}
                               if unmeasured else {"adapterKey": key})
    loaded = inp.loaded.get(variant.pool, ())
    if pool.state == "Passed" and key and (variant.pool not in inp.canary_unread or
                                           f"{name}={ServedAdapter(name, key).path}" in loaded):
        return pool.model_copy(update={"adapterKey": key, "served": True})
    if pool.state == "Passed" and key:
        why_not = "its pool's canary verdict cannot be read now: added once it is"
    kept = old is not None and old.adapterKey and old.artifactKey == artifact and \
        f"{name}={ServedAdapter(name, old.adapterKey).path}" in loaded
    if pool.state == "Passed":
        pool = pool.model_copy(update={"reason": f"{pool.reason}; not served: {why_not}"})
    if kept and pool.state in ("Passed", "Pending"):
        assert old is not None
        return pool.model_copy(update={"adapterKey": old.adapterKey, "served": True, "reason": (
            f"{pool.reason}; the files that passed here before ({old.adapterKey[:12]}) serve meanwhile")})
    return pool


def _canary_judged(name: str, pool_name: str, pool: AdapterPoolStatus, inp: AdapterInputs
                   ) -> tuple[AdapterPoolStatus, str]:
    """A pass by the Job stands where the pool's canary measured the adapter through vLLM and it
    passed there too; refused there, it fails; not measured there, it is not served (the second
    item says why)."""
    verdicts = inp.canary.get(pool_name)
    if pool.state != "Passed" or verdicts is None:
        return pool, ""
    v = verdicts.get(name)
    if v is not None and v.measured and not v.passed:
        return pool.model_copy(update={"state": "Failed", "reason": f"{pool.reason}; refused through vLLM on the "
                                                                   f"canary: {v.why}"}), ""
    if v is None or not v.measured:
        return pool, "its canary did not measure it" + (f": {v.why}" if v is not None and v.why else
                                                         " (not loaded on the canary pod)")
    return pool, ""


def _measured(inp: AdapterInputs, key: str | None, name: str) -> AdapterQuality | None:
    report = inp.reports.get(key) if key else None
    if report is None or report.evalIdentity != inp.identity:
        return None
    return next((q for q in report.adapters if q.name == name), None)


def _adapter_key(inp: AdapterInputs, artifact_key: str | None, name: str) -> tuple[str | None, str]:
    """Where a Job published the adapter's files, or why none is known: the files judged on this
    pool's base, else (a 16-bit pool, judged without a Job) the one key every other pool's Job
    published (its content key: the same files give the same key)."""
    own = _measured(inp, artifact_key, name)
    if own is not None:
        return own.adapterKey, "measured by a Job that did not publish adapters (an older release): measured again"
    keys = {q.adapterKey for k in inp.artifact_keys.values() if (q := _measured(inp, k, name)) and q.adapterKey}
    if len(keys) > 1:
        return None, (f"the quantized pools' Jobs read {len(keys)} different sets of its files (an unpinned source "
                      "changed between them): pin its source.revision")
    if keys:
        return keys.pop(), ""
    return None, ("no Job has published its files yet: a quantized pool's Job does (a model served only at 16 bits "
                  "runs none: not in this version)")


def _on_pool(name: str, variant: PlanVariant, key: str | None, inp: AdapterInputs, threshold: float) -> AdapterPoolStatus:
    if variant.lora is None or name not in variant.lora.adapters:
        reason = variant.adaptersRefused or "this pool's plan holds no LoRA buffers"
        return AdapterPoolStatus(variant=variant.pool, artifactKey=key, state="NotPlanned", reason=reason)
    if variant.servedAsIs:
        return AdapterPoolStatus(variant=variant.pool, artifactKey=key, state="NotPlanned", reason=(
            "the source is already quantized and served as it is: there is no 16-bit base here to judge the "
            "adapter against"))
    if variant.format is QuantFormat.NONE:
        return AdapterPoolStatus(variant=variant.pool, artifactKey=key, state="Passed", increasePercent=0.0,
                                 reason="served on the 16-bit base it was trained on: nothing for the Job to judge")
    measured = _measured(inp, key, name)
    if measured is None:
        return AdapterPoolStatus(variant=variant.pool, artifactKey=key, state="Pending",
                                 reason="being measured on this pool's base" if key else "its base artifact is not planned yet")
    return _judged(variant.pool, key, measured, threshold)


def _judged(pool: str, key: str | None, q: AdapterQuality, threshold: float) -> AdapterPoolStatus:
    """The model's threshold on the Job's figures (a changed threshold is judged again, no Job)."""
    figures = dict(baselinePerplexity=q.baselinePerplexity, perplexity=q.perplexity, increasePercent=q.increasePercent,
                   maxIncreasePercent=threshold)
    if q.error is not None or q.increasePercent is None:
        return AdapterPoolStatus(variant=pool, artifactKey=key, state="Failed", reason=f"not measured: {q.error}", **figures)
    ok = q.increasePercent <= threshold
    text = (f"perplexity {q.perplexity:.3f} on this base against {q.baselinePerplexity:.3f} on the 16-bit base: "
            f"{q.increasePercent:+.2f}% ({'within' if ok else 'above'} {threshold:g}%)")
    return AdapterPoolStatus(variant=pool, artifactKey=key, state="Passed" if ok else "Failed", reason=text, **figures)


def adapters_condition(statuses: list[AdapterStatus]) -> tuple[bool, str, str]:
    """(status, reason, message) of AdaptersServed for a model with adapters."""
    invalid = [f"{s.name}: {s.problem}" for s in statuses if s.problem]
    if invalid:
        return False, Reason.ADAPTER_INVALID, "; ".join(invalid)
    pools = [(s.name, p) for s in statuses for p in s.pools]
    refused = sorted({f"{p.variant}: {p.reason}" for _, p in pools if p.state == "NotPlanned"})
    if refused and all(p.state == "NotPlanned" for _, p in pools):
        return False, Reason.ADAPTERS_NOT_PLANNED, "no pool holds the adapters: " + "; ".join(refused)
    parts = []
    for word, test in (("served", lambda p: p.served), ("passed, not served", lambda p: p.state == "Passed" and not p.served),
                       ("refused by its gate", lambda p: p.state == "Failed"),
                       ("being measured", lambda p: p.state == "Pending")):
        named = [f"{n} on {p.variant}" + (f" ({p.increasePercent:+.2f}%)" if p.increasePercent is not None else "")
                 for n, p in pools if test(p)]
        if named:
            parts.append(f"{word}: {', '.join(named)}")
    if refused:
        parts.append("not planned on " + "; ".join(refused))
    partial = sorted({n for n, p in pools if p.served} & {n for n, p in pools if not p.served})
    if partial:
        parts.append(f"{', '.join(partial)} not on every pool: a request through the model's Service can reach a pod "
                     "without it and get 404 (routing by adapter name is not built)")
    if any(p.state == "Pending" for _, p in pools):
        return False, Reason.AWAITING_ADAPTER_GATE, "; ".join(parts)
    served = any(p.served for _, p in pools) and not any(p.state == "Passed" and not p.served for _, p in pools)
    return served, Reason.ADAPTERS_JUDGED, "; ".join(parts)


def served_on(statuses: list[AdapterStatus] | None, pool: str) -> tuple[ServedAdapter, ...]:
    """The adapters a pool's pods load (by name): those served there in ``status.adapters``."""
    return tuple(sorted((ServedAdapter(s.name, p.adapterKey) for s in statuses or () for p in s.pools
                         if p.variant == pool and p.served and p.adapterKey), key=lambda a: a.name))


def confirm_served(statuses: list[AdapterStatus], loaded: Mapping[str, frozenset[str]], rolled_out: frozenset[str],
                   old: list[AdapterStatus]) -> list[AdapterStatus]:
    """``served`` as the cluster has it: the pool's serving object loads it (``loaded``: by pool, its
    ``--lora-modules`` entries) and its pods rolled out with it (``rolled_out``: the pools whose
    object is rolled out), or it was confirmed before and is still loaded (a scale change or
    another rollout does not take it away)."""
    before = {(s.name, p.variant, p.adapterKey) for s in old for p in s.pools if p.served}

    def confirmed(name: str, p: AdapterPoolStatus) -> AdapterPoolStatus:
        entry = f"{name}={ServedAdapter(name, p.adapterKey or '').path}"
        if not p.served or entry in loaded.get(p.variant, ()) and (
                p.variant in rolled_out or (name, p.variant, p.adapterKey) in before):
            return p
        return p.model_copy(update={"served": False, "reason": f"{p.reason}; its pods are rolling out to load it"})
    return [s.model_copy(update={"pools": [confirmed(s.name, p) for p in s.pools]}) for s in statuses]
