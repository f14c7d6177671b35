"""One owner for each fact the plan hands to vLLM: the flags ``plan_args`` emits are the flags
``serving.extraArgs`` may not override (derived, not a second list), and the served name is
resolved in one place."""

from __future__ import annotations

import pytest

from fewerbits_api import conditions as C
from fewerbits_operator.core.decide import decide
from fewerbits_operator.core.acceptance import effective_for
from fewerbits_operator.artifacts.effective import PLAN_OWNED_FLAGS
from fewerbits_operator.planner.vllm_args import RENDERER_FLAGS, plan_args, served_model_name
from tests.unit.test_decide import SETTINGS, World
from tests.unit.test_decide_lws import H100X8X2, H200X8, world as lws_world

def test_every_flag_plan_args_emits_for_real_plans_is_plan_owned():
    w = lws_world([H100X8X2, H200X8])
    variants = w.planned()[1].variants
    assert {v.nodesPerReplica for v in variants} == {1, 2}  # both branches of plan_args
    emitted = {a for v in variants for a in plan_args(v, "name") if a.startswith("--")}
    assert "--nnodes" in emitted and emitted <= PLAN_OWNED_FLAGS
    assert PLAN_OWNED_FLAGS - emitted == RENDERER_FLAGS

@pytest.mark.parametrize("flag", ["--nnodes", "--pipeline-parallel-size", "--node-rank", "--served-model-name"])
def test_extra_args_cannot_override_what_the_plan_or_the_renderer_sets(flag):
    w = World()
    w.spec["serving"] = {**w.spec.get("serving", {}), "extraArgs": [flag, "2"]}
    accepted = next(c for c in decide(w.observed(), SETTINGS).status.conditions if c.type == C.ACCEPTED)
    assert accepted.status == "False" and f"{flag} overrides the plan" in accepted.message

def test_the_served_name_defaults_to_the_models_name():
    w = World()
    spec = effective_for(w.observed(), SETTINGS).spec
    assert served_model_name(spec, "m") == "m"
    named = spec.model_copy(update={"serving": spec.serving.model_copy(update={"servedModelName": "chat"})})
    assert served_model_name(named, "m") == "chat"


def test_lora_flags_stay_the_users_until_pods_serve_adapters():
    """No pod serves an adapter in this version (docs/adapters.md): the LoRA flags are neither
    rendered nor owned, so a model passing them through extraArgs keeps working."""
    assert not {"--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras", "--lora-modules"} & PLAN_OWNED_FLAGS
