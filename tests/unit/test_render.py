"""Renderers against golden files (NIM-operator style): the Job, Deployment and Service exactly as
the operator would create them. Regenerate with FEWERBITS_UPDATE_GOLDEN=1 after an intended change,
and read the diff."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from fewerbits_api.formats import QuantFormat
from fewerbits_api.jobcontract import CONTRACT_ENV, QuantJobContract
from fewerbits_api.policy import QuantizationJobPlacement
from fewerbits_api.quantizedmodel import PlanStatus, PlanVariant, QualityGateSpec, QuantizedModelSpec
from fewerbits_operator.artifacts.keys import job_name, key_inputs, planned_artifacts
from fewerbits_operator.serving.render import (
    ANNOTATION_SPEC_HASH,
    Owner,
    render_deployment,
    render_job,
    render_service,
    startup_budget_seconds,
)
from fewerbits_operator.base.settings import OperatorSettings

GOLDEN = Path(__file__).parent / "golden"
OWNER = Owner("llama", "ml", "0b1c2d3e-0000-4000-8000-000000000001")
SETTINGS = OperatorSettings(quantjob_image="ghcr.io/fewerbits/fewerbits-quantjob:0.1.0",
                            runtime_image="ghcr.io/fewerbits/fewerbits-runtime:0.1.0")
SPEC = QuantizedModelSpec.model_validate({
    "source": {"uri": "hf://meta-llama/Llama-3.1-8B", "revision": "abc", "credentialsSecret": "hf"},
    "quantization": {"format": "w4a16-gptq", "calibration": {"samples": 64}},
    "storage": {"uri": "s3://bkt/q", "endpoint": "http://minio.storage:9000", "credentialsSecret": "s3"},
    "serving": {"extraArgs": ["--enforce-eager"]},
})
VARIANT = PlanVariant(pool="a100-sxm4-80gb-x8", gpuProduct="NVIDIA-A100-SXM4-80GB", family="ampere",
                      format="w4a16-gptq", kvCacheDtype="auto", dtype="bfloat16", tensorParallelSize=1,
                      maxModelLen=8192, weightsGiB=5.4, kvCacheTokens=400000, decodeTokensPerSecond=300.0,
                      vllmArgs=["--dtype", "bfloat16", "--kv-cache-dtype", "auto", "--tensor-parallel-size", "1",
                                "--max-model-len", "8192", "--gpu-memory-utilization", "0.9"])


def golden(name: str, obj: dict) -> None:
    path = GOLDEN / name
    text = yaml.safe_dump(obj, sort_keys=True, width=120)
    if os.environ.get("FEWERBITS_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with FEWERBITS_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name} differs from its golden file"


def job():
    art = planned_artifacts(SPEC, PlanStatus(variants=[VARIANT]))[0]
    return art, render_job(OWNER, SPEC, art, QuantizationJobPlacement(nodeSelector={"pool": "calib"}),
                           QualityGateSpec(maxPerplexityIncreasePercent=2.5), SETTINGS)


def test_job_golden():
    golden("job.yaml", job()[1])


def test_job_carries_a_valid_contract_and_no_secret_values():
    art, j = job()
    env = {e["name"]: e for e in j["spec"]["template"]["spec"]["containers"][0]["env"]}
    contract = QuantJobContract.model_validate_json(env[CONTRACT_ENV]["value"])
    assert contract.key == art.key and contract.format.value == "w4a16-gptq"
    assert contract.qualityGate.maxPerplexityIncreasePercent == 2.5
    # Credentials only by reference.
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "s3"
    assert all("value" not in e for e in env.values() if "KEY" in e["name"] or "TOKEN" in e["name"])
    assert j["metadata"]["name"] == job_name(art.key, "s3://bkt/q", "http://minio.storage:9000") and len(j["metadata"]["name"]) <= 63
    pod = j["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert j["spec"]["ttlSecondsAfterFinished"] > 0 and j["spec"]["activeDeadlineSeconds"] > 0


def test_key_ignores_calibration_for_formats_without_data():
    fp8 = key_inputs(SPEC, "fp8-dynamic")
    assert fp8.calibrationDataset is None and fp8.calibrationSamples is None
    other = SPEC.model_copy(update={"quantization": SPEC.quantization.model_copy(
        update={"calibration": SPEC.quantization.calibration.model_copy(update={"samples": 999})})})
    assert key_inputs(other, "fp8-dynamic").key() == fp8.key()
    assert key_inputs(other, "w4a16-gptq").key() != key_inputs(SPEC, "w4a16-gptq").key()


def deployment(replicas=2, key="f" * 64):
    return render_deployment(OWNER, SPEC, VARIANT, {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}, "8.0",
                             key, 5 * 2**30, replicas, SETTINGS)


def test_deployment_golden():
    golden("deployment.yaml", deployment())


def test_deployment_runs_launcher_then_vllm_with_planned_args():
    d = deployment()
    pod = d["spec"]["template"]["spec"]
    cmd = pod["containers"][0]["command"]
    sep = cmd.index("--")
    assert cmd[:4] == ["python3", "-m", "fewerbits_runtime", "launch"] and cmd[cmd.index("--node-cc") + 1] == "8.0"
    vllm = cmd[sep + 1:]
    assert vllm[:3] == ["vllm", "serve", "/models/" + "f" * 64]
    assert vllm[vllm.index("--served-model-name") + 1] == "llama"
    assert vllm[-1] == "--enforce-eager"
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert pod["initContainers"][0]["args"][:1] == ["fetch"]
    assert d["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    startup = pod["containers"][0]["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= startup_budget_seconds(VARIANT.weightsGiB)


def test_spec_hash_ignores_replicas_and_follows_artifact():
    assert deployment(1)["metadata"]["annotations"][ANNOTATION_SPEC_HASH] == \
        deployment(5)["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
    assert deployment(key="e" * 64)["metadata"]["annotations"][ANNOTATION_SPEC_HASH] != \
        deployment()["metadata"]["annotations"][ANNOTATION_SPEC_HASH]


def test_service_golden():
    golden("service.yaml", render_service(OWNER))


@pytest.mark.parametrize("weights, minimum", [(1, 180), (140, 460)])
def test_startup_budget_grows_with_weights(weights, minimum):
    assert startup_budget_seconds(weights) >= minimum


def test_builtin_calibration_hash_is_the_shipped_text():
    from fewerbits_api.datasets import AUTO_HUB_DATASET, BUILTIN_DATASET_SHA256, named_dataset_hash

    explicit = SPEC.model_copy(deep=True)
    explicit.quantization.calibration.dataset = "general-en"
    assert key_inputs(explicit, "w4a16-gptq").calibrationDatasetHash == BUILTIN_DATASET_SHA256["general-en"]
    # The default, `auto`: the pinned Hub set and its fallback file, both in the key.
    assert SPEC.quantization.calibration.dataset == "auto"
    assert key_inputs(SPEC, "w4a16-gptq").calibrationDatasetHash == named_dataset_hash("auto")
    assert "@8049631c405ae6576f93f445c6b8166f76f5505a" in AUTO_HUB_DATASET
    assert len({named_dataset_hash("auto"), *BUILTIN_DATASET_SHA256.values()}) == 3


def test_pvc_source_mounts_the_claim_root():
    spec = SPEC.model_copy(update={"source": SPEC.source.model_copy(update={"uri": "pvc://models/llama/8b",
                                                                          "credentialsSecret": None})})
    art = planned_artifacts(spec, PlanStatus(variants=[VARIANT]))[0]
    j = render_job(OWNER, spec, art, QuantizationJobPlacement(), QualityGateSpec(), SETTINGS)
    pod = j["spec"]["template"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert QuantJobContract.model_validate_json(env[CONTRACT_ENV]["value"]).source.mountPath == "/source"
    assert {"name": "source", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]


@pytest.mark.parametrize("fmt", [f.value for f in __import__("fewerbits_api.formats", fromlist=["x"]).CONCRETE_FORMATS])
def test_every_rendered_contract_passes_the_jobs_own_checks(fmt):
    """The operator's contract for each format is one the quantjob accepts (no cluster, no torch):
    its recomputed key, fields, tool versions and recipe parameters."""
    from fewerbits_quantjob import recipes
    from fewerbits_quantjob.job import installed_tool_versions, verify_contract

    variant = VARIANT.model_copy(update={"format": QuantFormat(fmt)})
    art = planned_artifacts(SPEC, PlanStatus(variants=[variant]))[0]
    j = render_job(OWNER, SPEC, art, QuantizationJobPlacement(), QualityGateSpec(), SETTINGS)
    env = {e["name"]: e for e in j["spec"]["template"]["spec"]["containers"][0]["env"]}
    contract = QuantJobContract.model_validate_json(env[CONTRACT_ENV]["value"])
    verify_contract(contract, installed_tool_versions())
    recipes.build_recipe_spec(contract.format, contract.keyInputs.ignore)


def test_policy_tolerations_are_added_to_the_gpu_toleration():
    from fewerbits_api.policy import Toleration

    art = planned_artifacts(SPEC, PlanStatus(variants=[VARIANT]))[0]
    placement = QuantizationJobPlacement(tolerations=[Toleration(key="team", operator="Exists")])
    j = render_job(OWNER, SPEC, art, placement, QualityGateSpec(), SETTINGS)
    keys = [t.get("key") for t in j["spec"]["template"]["spec"]["tolerations"]]
    assert keys == ["nvidia.com/gpu", "team"]


def test_job_name_names_the_destination_too():
    """Same bytes, another storage location: another Job (else the second model would find the
    first's Job succeeded and no manifest at its own location). Same location: the same Job."""
    art = planned_artifacts(SPEC, PlanStatus(variants=[VARIANT]))[0]
    moved = SPEC.model_copy(update={"storage": SPEC.storage.model_copy(update={"uri": "s3://bkt/other"})})
    other_endpoint = SPEC.model_copy(update={"storage": SPEC.storage.model_copy(update={"endpoint": "http://b:9000"})})
    trailing = SPEC.model_copy(update={"storage": SPEC.storage.model_copy(update={"uri": "s3://bkt/q/"})})
    names = {planned_artifacts(s, PlanStatus(variants=[VARIANT]))[0].job_name for s in (moved, other_endpoint)}
    assert art.job_name not in names and len(names) == 2
    assert planned_artifacts(trailing, PlanStatus(variants=[VARIANT]))[0].job_name == art.job_name
    assert {planned_artifacts(s, PlanStatus(variants=[VARIANT]))[0].key for s in (moved, other_endpoint)} == {art.key}
    assert art.job_name.startswith("fewerbits-quantize-" + art.key[:24] + "-") and len(art.job_name) <= 63
    rendered = render_job(OWNER, SPEC, art, QuantizationJobPlacement(), QualityGateSpec(), SETTINGS)
    assert rendered["metadata"]["annotations"]["fewerbits.io/artifact-key"] == art.key
