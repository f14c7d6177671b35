"""The Action union is closed and every type of it has an executor (execute.EXECUTORS); the
serving object's kind is a value from the plan to the delete."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

from fewerbits_operator.base import actions

from fewerbits_operator.core import execute
from fewerbits_operator.base.actions import ACTION_TYPES, Action, DeleteDeployment, Event, WorkloadKind


def test_every_action_type_has_an_executor_and_a_place_in_the_order():
    assert set(execute.EXECUTORS) == set(typing.get_args(Action))
    assert execute.ORDER == ACTION_TYPES and len(set(ACTION_TYPES)) == len(ACTION_TYPES)
    assert set(execute.DELETE_WORKLOAD) == set(WorkloadKind)


def test_every_write_defined_in_actions_is_in_the_union():
    defined = {c for _, c in inspect.getmembers(actions, inspect.isclass)
               if dataclasses.is_dataclass(c) and c.__module__ == actions.__name__ and c is not Event}
    assert defined == set(ACTION_TYPES)


def test_an_action_without_an_executor_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Unknown:
        name: str

    with pytest.raises(TypeError, match="no executor"):
        execute.apply_action(object(), Unknown("x"))  # type: ignore[arg-type]


@pytest.mark.parametrize("nodes, obj, kind", [
    (1, {"kind": "Deployment"}, WorkloadKind.DEPLOYMENT),
    (1, {}, WorkloadKind.DEPLOYMENT),
    (2, {"kind": "LeaderWorkerSet"}, WorkloadKind.LEADER_WORKER_SET),
    (8, {"kind": "LeaderWorkerSet"}, WorkloadKind.LEADER_WORKER_SET),
])
def test_the_workload_kind_comes_from_the_plan_and_from_the_object(nodes, obj, kind):
    assert WorkloadKind.for_nodes(nodes) is kind and WorkloadKind.of(obj) is kind


def test_a_delete_carries_its_kind_as_a_value():
    assert DeleteDeployment("ns", "x", "LeaderWorkerSet").kind is WorkloadKind.LEADER_WORKER_SET
    with pytest.raises(ValueError):
        DeleteDeployment("ns", "x", "StatefulSet")  # type: ignore[arg-type]


def test_the_delete_of_each_kind_calls_its_own_api():
    calls = []

    class Kube:
        def delete_deployment(self, ns, name):
            calls.append(("Deployment", ns, name))

        def delete_lws(self, ns, name):
            calls.append(("LeaderWorkerSet", ns, name))

    for kind in WorkloadKind:
        execute.apply_action(Kube(), DeleteDeployment("ns", "x", kind))  # type: ignore[arg-type]
    assert calls == [("Deployment", "ns", "x"), ("LeaderWorkerSet", "ns", "x")]
