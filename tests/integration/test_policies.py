"""Policies a platform team can rely on, on the real control plane: a Strict allow-list refuses an
unlisted flag; a platform baseline and a team policy both constrain a model; allowedImages refuses
an unlisted image; status.effective and `fewerbits explain` show where each value came from; a
policy edit that changes it is an event on the model; a conflict is reported on both policies.

No model here quantizes anything: each is judged at Accepted, and the one accepted model's Job is
parked by its policy's nodeSelector on a label no node has.

Simulator: none starts. No model here reaches serving (each is judged at Accepted; the accepted
ones' Jobs wait on a node label no node has); `vllm/vllm-openai` appears only as an image name a
policy's allowedImages judges.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from typing import Any

import pytest
from kubernetes import client

from tests.integration.hostile_corpus import PARKED_JOB_PLACEMENT
from tests.integration.operator_harness import REPO

pytestmark = [pytest.mark.cluster]

GROUP, VERSION, PLURAL = "fewerbits.io", "v1alpha1", "quantizationpolicies"
RUN_LABEL = "fewerbits.io/policies-run"


@pytest.fixture
def run(cluster, namespace, operator):
    """A label on this test's namespace for the 'baseline' to select (so it never governs another
    test's namespace), set before any model is read; and cleanup of the policies made."""
    run_id = uuid.uuid4().hex[:8]
    core = client.CoreV1Api(cluster.api_client())
    core.patch_namespace(namespace, {"metadata": {"labels": {RUN_LABEL: run_id}}})
    made: list[str] = []

    class Run:
        id = run_id
        custom = client.CustomObjectsApi(cluster.api_client())

        def policy(self, name: str, spec: dict[str, Any], *, baseline: bool = False) -> str:
            full = f"{name}-{run_id}"
            selector = {"matchLabels": {RUN_LABEL: run_id}} if baseline else \
                {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
            self.custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, {
                "apiVersion": f"{GROUP}/{VERSION}", "kind": "QuantizationPolicy", "metadata": {"name": full},
                "spec": {"namespaceSelector": selector, **spec}})
            made.append(full)
            return full

        def patch_policy(self, name: str, spec: dict[str, Any]) -> None:
            self.custom.patch_cluster_custom_object(GROUP, VERSION, PLURAL, name, {"spec": spec})

        def get_policy(self, name: str) -> dict[str, Any]:
            return self.custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, name)

    yield Run()
    for name in made:
        cluster.kubectl("delete", "quantizationpolicy", name, "--wait=false")


def refused(models, namespace: str, name: str) -> str:
    return models.wait_condition(namespace, name, "Accepted", status="False", reason="PolicyViolation")["message"]


def test_strict_allow_list_refuses_an_unlisted_flag(run, namespace, models, model_spec):
    team = run.policy("strict", {"rules": {"extraArgsMode": "Strict", "allowedExtraArgs": ["--max-num-seqs"],
                                           "quantizationJob": PARKED_JOB_PLACEMENT}})
    models.apply(namespace, "eager", model_spec(serving={"maxModelLen": 512, "extraArgs": ["--enforce-eager"]}))
    models.apply(namespace, "listed", model_spec(serving={"maxModelLen": 512, "extraArgs": ["--max_num_seqs=8"]}))
    msg = refused(models, namespace, "eager")
    assert f"policy {team} rule allowedExtraArgs: spec.serving.extraArgs[0]: --enforce-eager is not listed" in msg
    assert "extraArgsMode Strict" in msg
    models.wait_condition(namespace, "listed", "Accepted")  # the listed flag, in another spelling, passes
    assert models.deployments(namespace, "eager") == []


def test_a_baseline_and_a_team_policy_both_constrain_a_model(run, namespace, models, model_spec):
    base = run.policy("baseline", {"priority": 0, "rules": {"allowedSources": ["hf://*"]}}, baseline=True)
    team = run.policy("team", {"priority": 10, "rules": {"allowedFormats": ["fp8-dynamic"]}})
    models.apply(namespace, "both", model_spec(quantization={"format": "nvfp4"}))
    # Each policy reaches the operator's cache by its own watch event: wait until both judge it.
    wanted = (f"policy {base} rule allowedSources: spec.source.uri s3://",
              f"policy {team} rule allowedFormats: spec.quantization.format nvfp4")
    models.wait("both policies' violations", lambda: all(
        w in (models.condition(namespace, "both", "Accepted") or {}).get("message", "") for w in wanted),
        timeout=120, namespace=namespace, name="both")
    assert models.condition(namespace, "both", "Accepted")["reason"] == "PolicyViolation"
    assert models.get(namespace, "both")["status"]["effective"]["policies"] == [team, base]
    # Disjoint allow-lists allow nothing: refused, both policies named.
    run.patch_policy(base, {"rules": {"allowedFormats": ["w4a16-awq"]}})
    models.wait("both policies named as a conflict",
                lambda: f"policies {team} and {base} conflict: rules.allowedFormats" in
                (models.condition(namespace, "both", "Accepted") or {}).get("message", ""),
                timeout=120, namespace=namespace, name="both")


def test_allowed_images_refuses_an_unlisted_image(run, namespace, models, model_spec):
    pol = run.policy("images", {"rules": {"allowedImages": ["registry.example.com/vllm/*"],
                                          "quantizationJob": PARKED_JOB_PLACEMENT}})
    models.apply(namespace, "img", model_spec(serving={"maxModelLen": 512, "image": "docker.io/evil/vllm:latest"}))
    msg = refused(models, namespace, "img")
    assert f"policy {pol} rule allowedImages: spec.serving.image docker.io/evil/vllm:latest matches none of " \
           "registry.example.com/vllm/*" in msg
    models.apply(namespace, "img-ok", model_spec(serving={"maxModelLen": 512,
                                                          "image": "registry.example.com/vllm/vllm-openai:v0.11.0"}))
    models.wait_condition(namespace, "img-ok", "Accepted")


def test_explain_shows_sources_and_a_policy_edit_is_an_event(cluster, run, namespace, models, model_spec):
    base = run.policy("baseline", {"priority": 0, "defaults": {"serving": {"replicas": 2}},
                                   "rules": {"maxReplicas": 8, "quantizationJob": PARKED_JOB_PLACEMENT}},
                      baseline=True)
    team = run.policy("team", {"priority": 10, "defaults": {"serving": {"gpuMemoryUtilization": 0.85}}})
    spec = model_spec(serving={"maxModelLen": 512})
    spec["autoscaling"] = {"enabled": False}
    spec["serving"].pop("replicas", None)
    models.apply(namespace, "explained", spec)
    models.wait_condition(namespace, "explained", "Accepted")

    def effective() -> dict[str, tuple[str, str]]:
        eff = (models.get(namespace, "explained").get("status") or {}).get("effective") or {}
        return {v["path"]: (v["value"], v["source"]) for v in eff.get("values", [])}

    # Both policies reach the operator's cache by their own watch events: wait for both.
    want = {"rules.maxReplicas": ("8", base), "spec.serving.replicas": ("2", base),
            "spec.serving.gpuMemoryUtilization": ("0.85", team)}
    models.wait("status.effective from both policies", lambda: want.items() <= effective().items(),
                timeout=60, namespace=namespace, name="explained")

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("crds", "operator", "quantjob",
                                                                                "runtime", "."))}
    out = subprocess.run([sys.executable, "-m", "fewerbits_operator.cli.main", "explain", "explained", "-n", namespace,
                          "--kubeconfig", str(cluster.kubeconfig)], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines() if line.startswith(("spec.", "rules."))}
    assert rows["spec.serving.replicas"] == ["2", "policy", base]
    assert rows["spec.serving.gpuMemoryUtilization"] == ["0.85", "policy", team]
    assert rows["spec.serving.maxModelLen"] == ["512", "model"]
    assert rows["rules.maxReplicas"] == ["8", "policy", base]
    assert f"Policies (highest priority first): {team}, {base}" in out.stdout
    out = subprocess.run([sys.executable, "-m", "fewerbits_operator.cli.main", "explain", "explained", "-n", namespace,
                          "--kubeconfig", str(cluster.kubeconfig), "-o", "json"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert json.loads(out.stdout)["policies"] == [team, base]

    # A policy edit that changes the effective spec: an event on the model naming path and policy.
    run.patch_policy(base, {"rules": {"maxReplicas": 4}})
    models.wait("an EffectiveSpecChanged event", lambda: any(
        e.reason == "EffectiveSpecChanged" and "rules.maxReplicas = 4" in e.message and base in e.message
        for e in models.events(namespace, "explained")), timeout=60, namespace=namespace, name="explained")


def test_a_conflict_is_reported_on_both_policies_and_the_model(run, namespace, models, model_spec):
    # Conflicts are looked for where models are: the model first (its Job parked), then the policies.
    run.policy("park", {"priority": 1, "rules": {"quantizationJob": PARKED_JOB_PLACEMENT}})
    models.apply(namespace, "torn", model_spec())
    models.wait_condition(namespace, "torn", "Accepted")
    a = run.policy("hopper-fp8", {"priority": 5, "formatByGPUFamily": {"hopper": "fp8-dynamic"}})
    b = run.policy("hopper-awq", {"priority": 5, "formatByGPUFamily": {"hopper": "w4a16-awq"}}, baseline=True)
    msg = refused(models, namespace, "torn")
    assert "formatByGPUFamily.hopper" in msg and a in msg and b in msg
    for me, other in ((a, b), (b, a)):
        def conflicted(me=me, other=other):
            st = run.get_policy(me).get("status") or {}
            valid = next((c for c in st.get("conditions", []) if c["type"] == "Valid"), None)
            return valid and valid["reason"] == "Conflict" and [c["policy"] for c in st.get("conflicts", [])] == [other]
        models.wait(f"Valid=False Conflict on {me}", conflicted, timeout=60)
