"""QuantizationPolicy status, decided purely: Valid, Invalid, Conflict with the other policy named on
both; written only where it changed (zero writes at rest)."""

from __future__ import annotations

from fewerbits_operator.runtime.policy_status import policy_statuses, status_writes

NOW = "2026-11-23T12:00:00Z"


def raw(name: str, spec: dict, status: dict | None = None, generation: int = 1) -> dict:
    return {"metadata": {"name": name, "generation": generation, "resourceVersion": "9"}, "spec": spec,
            **({"status": status} if status else {})}


A = raw("a", {"priority": 5, "formatByGPUFamily": {"hopper": "fp8-dynamic"}})
B = raw("b", {"priority": 5, "namespaceSelector": {"matchLabels": {"team": "x"}},
              "formatByGPUFamily": {"hopper": "w4a16-awq"}})
BAD = raw("bad", {"priority": -1})


def test_conflict_is_reported_on_both_policies_only_where_they_meet():
    st = policy_statuses([A, B, BAD], [{"team": "x"}], NOW)
    for me, other in (("a", "b"), ("b", "a")):
        cond = st[me].conditions[0]
        assert (cond.type, cond.status, cond.reason) == ("Valid", "False", "Conflict")
        assert [c.policy for c in st[me].conflicts] == [other]
        assert "formatByGPUFamily.hopper" in st[me].conflicts[0].message
    assert (st["bad"].conditions[0].reason, st["bad"].conditions[0].message.startswith("spec.priority")) == \
        ("Invalid", True)
    # No namespace holds both: no conflict.
    st = policy_statuses([A, B], [{"team": "y"}], NOW)
    assert st["a"].conditions[0].status == "True" and st["a"].conflicts == []


def test_written_once_then_nothing_at_rest():
    desired = policy_statuses([A], [{}], NOW)
    writes = status_writes([A], desired)
    assert [(n, rv) for n, rv, _ in writes] == [("a", "9")]
    settled = raw("a", A["spec"], writes[0][2])
    assert status_writes([settled], policy_statuses([settled], [{}], "2026-11-23T13:00:00Z")) == []
