"""observe computes what decide would (the plan, the planned artifacts) once per pass and passes
the value on: the planner runs once per reconcile, planned_artifacts once in observe, and decide
on observe's plan decides exactly what it decides on its own."""

from __future__ import annotations

import dataclasses

from fewerbits_operator.artifacts import keys as artifacts

from fewerbits_operator.serving import canary_observe

from fewerbits_operator.core import acceptance

from fewerbits_operator.core import observe
from fewerbits_operator.core.decide import decide
from fewerbits_operator.core.acceptance import current_plan, effective_for
from fewerbits_operator.base.observed import Planning
from tests.unit.test_decide import SETTINGS, World
from tests.unit.test_reconcile_fake import NAME, NS, publish, world  # noqa: F401  (the fixture)


def counting(monkeypatch, module, name: str, *also) -> list[int]:
    calls = [0]
    real = getattr(module, name)

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    for m in (module, *also):
        monkeypatch.setattr(m, name, counted)
    return calls


def test_one_reconcile_runs_the_planner_once_and_planned_artifacts_once_in_observe(world, monkeypatch):
    kube, store, rec = world
    rec.reconcile(NS, NAME)
    publish(store, kube)  # an artifact to serve: every read of the pass happens
    planner = counting(monkeypatch, acceptance, "plan_of")
    planned = counting(monkeypatch, artifacts, "planned_artifacts", observe, canary_observe)
    rec.reconcile(NS, NAME)
    assert planner == [1]
    assert planned == [1]


def test_decide_on_observes_plan_decides_what_it_decides_alone():
    for w in (World(), World(shape=None, config_error="unreachable"), World(pools=[])):
        if w.shape is not None:
            w.publish()
        obs = w.observed()
        plan, verdict = current_plan(obs, effective_for(obs, SETTINGS))
        assert decide(dataclasses.replace(obs, planning=Planning(plan, verdict)), SETTINGS) == decide(obs, SETTINGS)
