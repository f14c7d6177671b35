"""QuantizationPolicy status: the `Valid` condition and the conflicts with other policies, decided
by a pure function from the policies and the labels of the namespaces that hold models; written by
``Kube.patch_policy_status`` only where it changed (zero writes at rest).

A conflict exists only where two policies meet: in a namespace both select. The namespaces looked
at are those holding QuantizedModels (where a conflict refuses something); docs/policies.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from pydantic import ValidationError

from fewerbits_api.conditions import Condition, set_condition
from fewerbits_api.errors import format_validation_error
from fewerbits_api.policy import PolicyConflict, QuantizationPolicy, QuantizationPolicyStatus

from fewerbits_operator.artifacts.effective import combine_policies, matching_policies
from fewerbits_operator.base.queueing import queued_entries

VALID = "Valid"
REASON_VALID, REASON_INVALID, REASON_CONFLICT = "Valid", "Invalid", "Conflict"
MAX_CONFLICTS = 64


def _old_status(raw: Mapping[str, Any]) -> QuantizationPolicyStatus:
    try:
        return QuantizationPolicyStatus.model_validate(raw.get("status") or {})
    except ValidationError:
        return QuantizationPolicyStatus()


@dataclass(frozen=True)
class NamespaceModels:
    """What a policy governs in one namespace holding QuantizedModels."""

    labels: Mapping[str, str]
    models: int
    queued_jobs: int
    """Artifacts of its models whose quantization Job waits (``status.artifacts[].queue``)."""


def namespace_models(models: Iterable[Mapping[str, Any]], labels_of: Callable[[str], Mapping[str, str]]
                     ) -> list[NamespaceModels]:
    """Per namespace holding models: its labels, its models, their queued Jobs."""
    counts: dict[str, list[int]] = {}
    for m in models:
        c = counts.setdefault(str((m.get("metadata") or {}).get("namespace")), [0, 0])
        c[0] += 1
        c[1] += len(queued_entries(m))
    return [NamespaceModels(dict(labels_of(ns)), n, q) for ns, (n, q) in sorted(counts.items())]


def policy_statuses(raws: Iterable[Mapping[str, Any]], namespace_labels: Iterable[Mapping[str, str]],
                    now: str, governed: Iterable[NamespaceModels] | None = None) -> dict[str, QuantizationPolicyStatus]:
    """The status each policy should have, by name. Pure: the clock is ``now``. With ``governed``,
    each valid policy also counts the namespaces, models and queued Jobs it governs."""
    raws = list(raws)
    governed = list(governed) if governed is not None else None
    valid: list[QuantizationPolicy] = []
    invalid: dict[str, str] = {}
    for raw in raws:
        try:
            valid.append(QuantizationPolicy.model_validate(dict(raw)))
        except ValidationError as e:
            invalid[str((raw.get("metadata") or {}).get("name"))] = "; ".join(format_validation_error(e))
    conflicts: dict[str, dict[tuple[str, str], PolicyConflict]] = {}
    for labels in namespace_labels:
        for c in combine_policies(matching_policies(valid, dict(labels))).conflicts:
            for name in c.policies:
                for other in c.policies:
                    if other != name:
                        conflicts.setdefault(name, {})[(other, c.message)] = PolicyConflict(policy=other,
                                                                                          message=c.message[:1024])
    out: dict[str, QuantizationPolicyStatus] = {}
    for raw in raws:
        md = raw.get("metadata") or {}
        name, generation = str(md.get("name")), md.get("generation")
        old = _old_status(raw)
        mine = sorted(conflicts.get(name, {}).values(), key=lambda c: (c.policy, c.message))[:MAX_CONFLICTS]
        if name in invalid:
            ok, reason, message = False, REASON_INVALID, invalid[name][:1024]
        elif mine:
            ok, reason = False, REASON_CONFLICT
            message = "; ".join(f"with {c.policy}: {c.message}" for c in mine)[:1024]
        else:
            ok, reason, message = True, REASON_VALID, "the policy is valid and combines with every policy it meets"
        conditions: list[Condition] = set_condition(list(old.conditions), VALID, ok, reason, message, generation, now=now)
        out[name] = QuantizationPolicyStatus(observedGeneration=generation, conditions=conditions, conflicts=mine)
        policy = next((p for p in valid if p.metadata.name == name), None)
        if governed is not None and policy is not None:
            mine_ns = [g for g in governed if policy.spec.namespaceSelector.matches(dict(g.labels))]
            out[name].governedNamespaces = len(mine_ns)
            out[name].governedModels = sum(g.models for g in mine_ns)
            out[name].queuedJobs = sum(g.queued_jobs for g in mine_ns)
        elif policy is not None:  # not counted this time: keep what was counted
            out[name].governedNamespaces = old.governedNamespaces
            out[name].governedModels = old.governedModels
            out[name].queuedJobs = old.queuedJobs
    return out


def status_writes(raws: Iterable[Mapping[str, Any]], desired: Mapping[str, QuantizationPolicyStatus]
                  ) -> list[tuple[str, str | None, dict[str, Any]]]:
    """(name, resourceVersion, status) for each policy whose status differs from what it should be."""
    writes = []
    for raw in raws:
        md = raw.get("metadata") or {}
        want = desired.get(str(md.get("name")))
        if want is None:
            continue
        wire = want.to_wire()
        if _old_status(raw).to_wire() != wire:
            writes.append((str(md.get("name")), md.get("resourceVersion"), wire))
    return writes
