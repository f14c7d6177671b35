"""``spec.serving.routing: inferencePool`` in ``decide`` (pure): the InferencePool is created,
repaired, refused without its CRD, and never taken from someone else; the Service stays."""

from __future__ import annotations

from dataclasses import replace

from fewerbits_api.quantizedmodel import QuantizedModelSpec
from fewerbits_operator.serving import routing
from fewerbits_operator.core.decide import CreateService, decide
from fewerbits_operator.core.execute import ordered
from fewerbits_operator.serving.render import Owner
from fewerbits_operator.serving.routing import CreateInferencePool, PatchInferencePool, RoutingFacts

from tests.unit.test_decide import NAME, NS, SETTINGS, UID, World, _ready_world, base_spec


def world(**routing_facts) -> World:
    w = World(spec=base_spec(serving={"maxModelLen": 4096, "routing": "inferencePool"}))
    _ready_world(w)
    return w


def run(w: World, facts: RoutingFacts | None):
    obs = replace(w.observed(), routing=facts)
    out = decide(obs, SETTINGS)
    return out, {c.type: c for c in out.status.conditions}


def owned_pool() -> dict:
    pool = routing.render_inference_pool(Owner(NAME, NS, UID))
    pool["metadata"]["ownerReferences"] = [{"uid": UID}]
    return pool


def test_default_is_service_and_reads_nothing():
    assert QuantizedModelSpec.model_fields["serving"].annotation  # the field exists on the model
    w = World()
    _ready_world(w)
    out, conds = run(w, None)
    assert not [a for a in out.actions if isinstance(a, (CreateInferencePool, PatchInferencePool))]
    assert (conds["Deployed"].status, conds["Ready"].status) == ("True", "True")


def test_pool_is_created_selecting_every_variant_with_its_picker():
    out, conds = run(world(), RoutingFacts(crd_served=True, pool=None))
    (create,) = [a for a in out.actions if isinstance(a, CreateInferencePool)]
    pool = create.pool
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["metadata"]["name"] == NAME
    assert pool["spec"]["selector"]["matchLabels"] == {"fewerbits.io/model": NAME, "app.kubernetes.io/component": "server"}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"]["name"] == f"{NAME}-epp"
    assert pool["metadata"]["ownerReferences"][0]["uid"] == UID
    assert conds["Deployed"].status == "True"


def test_at_rest_no_write_and_a_hand_edit_is_repaired():
    out, _ = run(world(), RoutingFacts(True, owned_pool()))
    assert out.actions == ()
    edited = owned_pool()
    edited["spec"]["targetPorts"] = [{"number": 9999}]
    out, _ = run(world(), RoutingFacts(True, edited))
    assert [type(a) for a in ordered(out.actions)] == [PatchInferencePool]


def test_without_the_crd_it_is_refused_and_the_service_serves():
    w = world()
    w.service = None
    out, conds = run(w, RoutingFacts(crd_served=False))
    assert [type(a) for a in out.actions] == [CreateService]
    d = conds["Deployed"]
    assert (d.status, d.reason) == ("False", "RoutingUnavailable")
    assert "spec.serving.routing" in d.message and "inferencepools.inference.networking.k8s.io" in d.message
    assert conds["Ready"].status == "True"  # still served through the Service


def test_someone_elses_pool_is_a_conflict_never_overwritten():
    theirs = owned_pool()
    theirs["metadata"]["ownerReferences"] = [{"uid": "someone-else"}]
    theirs["spec"]["targetPorts"] = [{"number": 1}]
    out, conds = run(world(), RoutingFacts(True, theirs))
    assert out.actions == ()
    assert (conds["Deployed"].status, conds["Deployed"].reason) == ("False", "InferencePoolConflict")
    assert "not owned by this QuantizedModel" in conds["Deployed"].message
    assert any(e.reason == "InferencePoolConflict" and e.type == "Warning" for e in out.events)


def test_routing_value_is_validated_at_admission():
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        QuantizedModelSpec.model_validate(base_spec(serving={"routing": "gateway"}))


def test_placement_follows_the_routing_and_publishes_the_cost_weights():
    # Capacity-following routing: cheapest pool first; the policy's weight wins over the setting's.
    settings = SETTINGS.model_copy(update={"gpu_cost_weights": "NVIDIA-L4=0.3,NVIDIA-A100-SXM4-80GB=0.6"})
    w = world()
    w.policies = [{"metadata": {"name": "costs"}, "spec": {"rules": {"poolCostWeights": {"NVIDIA-L4": 0.27}}}}]
    out = decide(replace(w.observed(), routing=RoutingFacts(True, owned_pool())), settings)
    auto = out.status.autoscaling
    assert auto.placement == "cheapestPool"
    assert auto.poolCostWeights == {"NVIDIA-L4": 0.27, "NVIDIA-A100-SXM4-80GB": 0.6}
    assert any(v.path == "rules.poolCostWeights.NVIDIA-L4" and v.value == "0.27" and v.source == "costs"
               for v in out.status.effective.values)
    # Behind the Service (or without the CRD, where the Service is all there is): per variant.
    out = decide(replace(w.observed(), routing=RoutingFacts(False)), settings)
    assert out.status.autoscaling.placement == "perVariant"
    plain = World()
    _ready_world(plain)
    assert decide(plain.observed(), SETTINGS).status.autoscaling.placement == "perVariant"


def test_cost_weight_setting_and_rule_are_checked():
    import pytest
    from pydantic import ValidationError

    from fewerbits_api.policy import PolicyRules
    from fewerbits_operator.base.settings import OperatorSettings
    with pytest.raises(ValidationError, match="FEWERBITS_GPU_COST_WEIGHTS: GPU cost weight 'NVIDIA-L4=0'"):
        OperatorSettings(gpu_cost_weights="NVIDIA-L4=0")
    with pytest.raises(ValidationError, match="poolCostWeights"):
        PolicyRules.model_validate({"poolCostWeights": {"NVIDIA-L4": -1}})


# ---------------------------------------------------------------- the operator's endpoint picker

from fewerbits_operator.serving import picker as epp  # noqa: E402


def picker_world(objects=None, unmetered=False):
    w = world()
    if unmetered:
        w.status["serving"][0]["podsWithoutMetrics"] = 2
    facts = RoutingFacts(True, owned_pool(), epp.PickerFacts(objects or {k: None for k in epp.KINDS}))
    return w, facts


def rendered(config=epp.SCORING_CONFIG):
    objs = epp.render_picker(Owner(NAME, NS, UID), SETTINGS.epp_image, SETTINGS.epp_cluster_role, config)
    for o in objs.values():
        o["metadata"]["ownerReferences"] = [{"uid": UID}]
        o["metadata"]["resourceVersion"] = "7"
    return objs


def test_the_picker_is_deployed_for_the_pool_with_least_privilege():
    w, facts = picker_world()
    out, conds = run(w, facts)
    created = {a.obj["kind"]: a.obj for a in out.actions if isinstance(a, epp.CreatePickerObject)}
    assert set(created) == set(epp.KINDS)
    assert all(o["metadata"]["name"] == f"{NAME}-epp" and o["metadata"]["ownerReferences"][0]["uid"] == UID
               for o in created.values())
    # Bound to the one ClusterRole the chart ships, for its own ServiceAccount only.
    rb = created["RoleBinding"]
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "fewerbits-epp"}
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": f"{NAME}-epp", "namespace": NS}]
    # The InferencePool's endpointPickerRef names this Service and port.
    ref = routing.render_inference_pool(Owner(NAME, NS, UID))["spec"]["endpointPickerRef"]
    svc = created["Service"]
    assert ref["name"] == svc["metadata"]["name"] and ref["port"]["number"] in [p["port"] for p in svc["spec"]["ports"]]
    dep = created["Deployment"]
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert c["image"] == "registry.k8s.io/gateway-api-inference-extension/epp:v1.1.0"
    assert c["args"][c["args"].index("--kv-cache-usage-percentage-metric") + 1] == "vllm:kv_cache_usage_perc"
    assert c["args"][c["args"].index("--pool-name") + 1] == NAME and "--config-file" in c["args"]
    assert pod["spec"]["serviceAccountName"] == f"{NAME}-epp"
    # Never selected as a serving pod: no model label on the picker's pods or objects.
    assert "fewerbits.io/model" not in pod["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert "kv-cache-utilization-scorer" in created["ConfigMap"]["data"]["epp.yaml"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False and pod["spec"]["securityContext"]["runAsNonRoot"]
    assert conds["Deployed"].status == "True"


def test_picker_at_rest_no_write_and_a_settings_change_rolls_it():
    w, facts = picker_world(rendered())
    out, _ = run(w, facts)
    assert out.actions == ()
    settings = SETTINGS.model_copy(update={"epp_image": "mirror.example.com/epp:v1.1.0"})
    out = decide(replace(w.observed(), routing=facts), settings)
    (update,) = out.actions
    assert isinstance(update, epp.UpdatePickerObject) and update.obj["kind"] == "Deployment"
    assert update.obj["metadata"]["resourceVersion"] == "7"


def test_pods_without_metrics_turn_the_picker_to_an_even_spread():
    # v1.1.0 rates a pod whose scrape fails the idlest: scoring would send it everything.
    w, facts = picker_world(rendered(), unmetered=True)
    out, conds = run(w, facts)
    updates = {a.obj["kind"]: a.obj for a in out.actions if isinstance(a, epp.UpdatePickerObject)}
    assert set(updates) == {"ConfigMap", "Deployment"}  # the template's config hash restarts the picker
    assert updates["ConfigMap"]["data"]["epp.yaml"] == epp.ROUND_ROBIN_CONFIG
    assert "random-picker" in epp.ROUND_ROBIN_CONFIG and "scorer" not in epp.ROUND_ROBIN_CONFIG
    variant = w.status["serving"][0]["variant"]
    assert (conds["Deployed"].status, conds["Deployed"].reason) == ("True", "MetricsUnavailable")
    assert variant in conds["Deployed"].message and "evenly" in conds["Deployed"].message


def test_a_picker_object_someone_else_owns_is_a_conflict_never_written():
    objs = rendered()
    objs["ConfigMap"]["metadata"]["ownerReferences"] = [{"uid": "someone-else"}]
    objs["Service"] = None
    w, facts = picker_world(objs)
    out, conds = run(w, facts)
    assert [a.obj["kind"] for a in out.actions] == ["Service"]
    assert (conds["Deployed"].status, conds["Deployed"].reason) == ("False", "InferencePoolConflict")
    assert f"ConfigMap {NS}/{NAME}-epp" in conds["Deployed"].message


def test_back_to_service_routing_removes_the_pickers_deployment_only():
    from fewerbits_operator.core.decide import DeleteDeployment
    w = World(spec=base_spec(serving={"maxModelLen": 4096}))
    _ready_world(w)
    dep = rendered()["Deployment"]
    out, conds = run(w, RoutingFacts(False, None, epp.PickerFacts({"Deployment": dep})))
    assert out.actions == (DeleteDeployment(NS, f"{NAME}-epp"),)
    assert conds["Deployed"].status == "True"
    dep["metadata"]["ownerReferences"] = [{"uid": "someone-else"}]  # not ours: left alone
    out, _ = run(w, RoutingFacts(False, None, epp.PickerFacts({"Deployment": dep})))
    assert out.actions == ()


def gateway_world(routing_value: str = "inferencePool") -> World:
    w = World(spec=base_spec(serving={"maxModelLen": 4096, "routing": routing_value,
                                      "gateway": {"name": "inference-gw"}}))
    _ready_world(w)
    return w


def test_gateway_without_the_httproute_crd_names_the_field_and_the_model_is_served():
    from fewerbits_operator.base.observed import GatewayFacts

    obs = replace(gateway_world().observed(), routing=RoutingFacts(True, owned_pool()), gateway=GatewayFacts(False))
    out = decide(obs, SETTINGS)
    conds = {c.type: c for c in out.status.conditions}
    assert (conds["Deployed"].status, conds["Deployed"].reason) == ("False", "RoutingUnavailable")
    assert "spec.serving.gateway" in conds["Deployed"].message and "httproutes" in conds["Deployed"].message
    assert conds["Ready"].status == "True" and out.actions == ()  # decide never writes the route
    assert out.status.route is None  # nothing for the route's loop to write


def test_gateway_route_of_someone_else_is_a_conflict_and_an_owned_one_is_fine():
    from fewerbits_operator.base.observed import GatewayFacts
    from fewerbits_operator.serving import gatewayroute

    theirs = {"metadata": {"name": NAME, "namespace": NS, "ownerReferences": [{"uid": "someone-else"}]}}
    for routing_value, pool in (("inferencePool", RoutingFacts(True, owned_pool())), ("service", None)):
        obs = replace(gateway_world(routing_value).observed(), routing=pool, gateway=GatewayFacts(True, theirs))
        out = decide(obs, SETTINGS)
        d = {c.type: c for c in out.status.conditions}["Deployed"]
        assert (d.status, d.reason) == ("False", "HTTPRouteConflict") and "spec.serving.gateway" in d.message
        assert out.status.route is None
    ours = gatewayroute.render_http_route(Owner(NAME, NS, UID), {"name": "inference-gw"}, gatewayroute.POOL)
    obs = replace(gateway_world().observed(), routing=RoutingFacts(True, owned_pool()), gateway=GatewayFacts(True, ours))
    out = decide(obs, SETTINGS)
    assert {c.type: c for c in out.status.conditions}["Deployed"].status == "True"
    assert out.status.route.to_wire() == {"gateway": {"name": "inference-gw"}, "inferencePool": True}


def test_the_published_route_uses_the_pool_only_when_it_is_the_models():
    from fewerbits_operator.base.observed import GatewayFacts

    def published(world, pool):
        obs = replace(world.observed(), routing=pool, gateway=GatewayFacts(True, None))
        return decide(obs, SETTINGS).status.route

    assert published(gateway_world("service"), None).inferencePool is False  # routing: service
    assert published(gateway_world(), RoutingFacts(False)).inferencePool is False  # no InferencePool CRD
    theirs = owned_pool()
    theirs["metadata"]["ownerReferences"] = [{"uid": "someone-else"}]
    assert published(gateway_world(), RoutingFacts(True, theirs)).inferencePool is False  # not its pool
    assert published(gateway_world(), RoutingFacts(True, None)).inferencePool is True  # being created


def test_the_scoring_profile_routes_by_prompt_prefix_and_load():
    import yaml
    config = yaml.safe_load(epp.SCORING_CONFIG)
    declared = [p["type"] for p in config["plugins"]]
    (profile,) = config["schedulingProfiles"]
    refs = {p["pluginRef"]: p.get("weight") for p in profile["plugins"]}
    # Every declared plugin is used by the profile (the handler is the profile's own), none twice.
    assert set(refs) == set(declared) - {"single-profile-handler"} and len(declared) == len(set(declared))
    # Prefix-cache-aware routing on by default, weighed like load (the extension chart's profile).
    assert refs["prefix-cache-scorer"] == refs["queue-scorer"] == refs["kv-cache-utilization-scorer"] == 1
    assert refs["max-score-picker"] is None
    # The even spread stays free of any scorer, prefix included.
    assert "prefix" not in epp.ROUND_ROBIN_CONFIG
