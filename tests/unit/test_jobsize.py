"""Quantization Jobs sized from the plan (planner.jobsize), rendered into the Job (jobresources,
render_job) and shown by `fewerbits plan`; typed Job failures (jobfailure)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fewerbits_api.conditions import Reason
from fewerbits_api.formats import QuantFormat
from fewerbits_api.policy import QuantizationJobPlacement, QuantizationPolicy
from fewerbits_api.quantizedmodel import QualityGateSpec, QuantizedModelSpec
from fewerbits_operator.artifacts.keys import planned_artifacts
from fewerbits_operator.cli.main import main
from fewerbits_operator.artifacts.jobfailure import classify
from fewerbits_operator.artifacts.jobresources import quantity_bytes
from fewerbits_operator.core.observe import evictions, job_limits
from fewerbits_operator.base.observed import ContainerTermination, JobFacts, JobState
from fewerbits_operator.planner import PlanRequest, load_model_shape, plan, pool_from_product
from fewerbits_operator.planner.jobsize import (
    DOWNLOAD_GBPS,
    START_MINUTES,
    UPLOAD_GBPS,
    JobInputs,
    cap_violations,
    deadline_seconds,
    inputs_from,
    size_job,
    size_plan_jobs,
    source_bytes,
)
from fewerbits_operator.serving.render import Owner, render_job
from fewerbits_operator.base.settings import OperatorSettings

CONFIGS = Path(__file__).parent / "fixtures" / "model_configs"
LLAMA_70B = CONFIGS / "llama-3.1-70b.json"
SETTINGS = OperatorSettings(_env_file=None)
H100 = pool_from_product("NVIDIA-H100-80GB-HBM3", 8)
L4 = pool_from_product("NVIDIA-L4", 1)
SPEC = QuantizedModelSpec.model_validate({
    "source": {"uri": "hf://meta-llama/Llama-3.1-70B", "revision": "abc"},
    "quantization": {"format": "fp8-dynamic"},
    "storage": {"uri": "s3://bkt/q"},
})


def _sized_70b(pools=(H100, L4), inputs: JobInputs | None = None):
    shape = load_model_shape(LLAMA_70B)
    the_plan = plan(shape, list(pools), PlanRequest())
    jobs, problems = size_plan_jobs(shape, the_plan, list(pools), inputs or inputs_from(None))
    assert not problems
    return shape, the_plan, jobs


def test_llama_70b_job_needs_140_gib_of_memory_and_200_gib_of_disk():
    _, the_plan, jobs = _sized_70b()
    assert [v.format for v in the_plan.variants] == [QuantFormat.FP8_DYNAMIC]
    (job,) = jobs
    # 70.6B parameters in bf16 are 131.5 GiB: the Job loads them all on the CPU.
    assert job.memoryGiB >= 140
    # Source download (131.5 GiB) + fp8 output (~66 GiB) + headroom.
    assert job.ephemeralStorageGiB >= 200
    assert job.volume == "ephemeral"  # above the 100 GiB default threshold
    # Evaluation in bf16 without offload needs two 80 GB GPUs; calibration one layer at a time.
    assert (job.pool, job.gpus, job.evaluationOffloadGiB) == (H100.name, 2, 0.0)
    assert 2 < job.gpuMemoryGiB < 20
    assert job.estimatedMinutes > 30
    assert deadline_seconds(job) == 3 * job.estimatedMinutes * 60


def test_the_rendered_70b_job_asks_for_what_the_sizing_says():
    _, the_plan, (size,) = _sized_70b()
    art = planned_artifacts(SPEC, the_plan)[0]
    settings = OperatorSettings(_env_file=None, job_storage_class="fast-nvme")
    job = render_job(Owner("llama", "ml", "u"), SPEC, art, QuantizationJobPlacement(), QualityGateSpec(), settings,
                     size, dict(H100.node_selector))
    pod = job["spec"]["template"]["spec"]
    res = pod["containers"][0]["resources"]
    assert res["requests"]["memory"] == res["limits"]["memory"] == f"{size.memoryGiB}Gi"
    assert quantity_bytes(res["limits"]["memory"]) >= 140 * 2**30
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "2"
    assert "cpu" not in res["limits"]
    work = next(v for v in pod["volumes"] if v["name"] == "work")
    claim = work["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == "fast-nvme"
    assert quantity_bytes(claim["resources"]["requests"]["storage"]) >= 200 * 2**30
    # The node's disk then only holds /tmp and the container's own files.
    assert res["limits"]["ephemeral-storage"] == "10Gi"
    assert pod["nodeSelector"] == dict(H100.node_selector)
    assert job["spec"]["activeDeadlineSeconds"] == deadline_seconds(size)


def test_a_policy_storage_class_and_deadline_win():
    _, the_plan, (size,) = _sized_70b()
    art = planned_artifacts(SPEC, the_plan)[0]
    placement = QuantizationJobPlacement(storageClassName="team-ssd", activeDeadlineSeconds=600,
                                         nodeSelector={"pool": "calib"})
    job = render_job(Owner("llama", "ml", "u"), SPEC, art, placement, QualityGateSpec(),
                     OperatorSettings(_env_file=None, job_storage_class="fast-nvme"), size, dict(H100.node_selector))
    pod = job["spec"]["template"]["spec"]
    work = next(v for v in pod["volumes"] if v["name"] == "work")
    assert work["ephemeral"]["volumeClaimTemplate"]["spec"]["storageClassName"] == "team-ssd"
    assert job["spec"]["activeDeadlineSeconds"] == 600
    assert pod["nodeSelector"] == {"pool": "calib"}  # the policy's placement, not the sized pool


def test_a_small_model_gets_an_emptydir_with_a_size_limit_and_the_memory_floor():
    shape = load_model_shape(CONFIGS / "llama-3.2-1b.json")
    size, why = size_job(shape, QuantFormat.W4A16_GPTQ, [L4], JobInputs(calibration_samples=16))
    assert why is None and size is not None and size.memoryGiB < 8
    assert size.volume == "emptyDir" and size.gpus == 1 and size.pool == L4.name
    spec = SPEC.model_copy(update={"quantization": SPEC.quantization.model_copy(update={"format": "w4a16-gptq"})})
    the_plan = plan(shape, [L4], PlanRequest(format=QuantFormat.W4A16_GPTQ))
    art = planned_artifacts(spec, the_plan)[0]
    job = render_job(Owner("m", "ml", "u"), spec, art, QuantizationJobPlacement(), QualityGateSpec(), SETTINGS, size)
    pod = job["spec"]["template"]["spec"]
    work = next(v for v in pod["volumes"] if v["name"] == "work")
    assert work["emptyDir"]["sizeLimit"] == f"{size.ephemeralStorageGiB}Gi"
    res = pod["containers"][0]["resources"]
    assert res["limits"]["memory"] == "8Gi"  # the operator's floor is above the sized figure
    assert res["limits"]["ephemeral-storage"] == f"{size.ephemeralStorageGiB}Gi"


def test_memory_grows_with_the_model_and_with_calibration_data():
    small = load_model_shape(CONFIGS / "llama-3.1-8b.json")
    big = load_model_shape(LLAMA_70B)
    s, _ = size_job(small, QuantFormat.W4A16_GPTQ, [H100], JobInputs())
    b, _ = size_job(big, QuantFormat.W4A16_GPTQ, [H100], JobInputs())
    more, _ = size_job(big, QuantFormat.W4A16_GPTQ, [H100], JobInputs(calibration_samples=4096))
    free, _ = size_job(big, QuantFormat.FP8_DYNAMIC, [H100], JobInputs(calibration_samples=4096))
    assert s.memoryGiB < b.memoryGiB < more.memoryGiB
    assert free.memoryGiB < more.memoryGiB  # data-free formats keep no calibration activations
    assert b.gpuMemoryGiB > free.gpuMemoryGiB  # GPTQ's Hessians


def test_a_gpu_cap_offloads_the_evaluation_and_a_single_gpu_pool_too():
    _, _, (capped,) = _sized_70b(inputs=JobInputs(max_gpus=1))
    assert capped.gpus == 1 and capped.evaluationOffloadGiB > 50
    _, _, (uncapped,) = _sized_70b()
    assert capped.estimatedMinutes > uncapped.estimatedMinutes  # offload streams layers over PCIe
    shape = load_model_shape(LLAMA_70B)
    on_l4, _ = size_job(shape, QuantFormat.W4A16_GPTQ, [L4], JobInputs())
    assert on_l4.gpus == 1 and on_l4.evaluationOffloadGiB > 100


def test_the_policy_gpus_and_node_selector_choose():
    shape = load_model_shape(CONFIGS / "llama-3.1-8b.json")
    cpu, _ = size_job(shape, QuantFormat.W4A16_GPTQ, [H100, L4], JobInputs(gpus=0))
    assert (cpu.gpus, cpu.pool, cpu.gpuMemoryGiB) == (0, None, 0.0)
    four, _ = size_job(shape, QuantFormat.W4A16_GPTQ, [H100], JobInputs(gpus=4))
    assert four.gpus == 4
    only_l4, _ = size_job(shape, QuantFormat.W4A16_GPTQ, [H100, L4],
                          JobInputs(node_selector={"nvidia.com/gpu.product": "NVIDIA-L4"}))
    assert only_l4.pool == L4.name
    # A selector no node carries yet (a node a cluster autoscaler adds, a label applied later):
    # sized on the pools there are; the Job keeps the policy's selector and waits for the node.
    waits, why = size_job(shape, QuantFormat.W4A16_GPTQ, [H100], JobInputs(node_selector={"no": "such"}))
    assert why is None and waits.pool == H100.name
    # A selector that matches only GPUs too small for one calibration layer is refused, naming it.
    big = load_model_shape(CONFIGS / "deepseek-v3.json")
    t4 = pool_from_product("Tesla-T4", 1)
    none, why = size_job(big, QuantFormat.W4A16_GPTQ, [H100, t4],
                         JobInputs(node_selector={"nvidia.com/gpu.product": "Tesla-T4"}))
    assert none is None and "matching the policy's quantizationJob.nodeSelector" in why


def test_a_layer_no_gpu_holds_is_refused_with_the_figures():
    shape = load_model_shape(CONFIGS / "deepseek-v3.json")
    t4 = pool_from_product("Tesla-T4", 1)
    job, why = size_job(shape, QuantFormat.W4A16_GPTQ, [t4], JobInputs())
    assert job is None
    assert "needs" in why and "GiB on one GPU" in why and "largest GPU has 15.0 GiB" in why


def test_served_as_is_needs_no_gpu_and_copies_the_source_once():
    shape = load_model_shape(CONFIGS / "deepseek-v3.json")
    h200 = pool_from_product("NVIDIA-H200", 8)
    the_plan = plan(shape, [h200], PlanRequest())
    jobs, problems = size_plan_jobs(shape, the_plan, [h200], JobInputs())
    assert not problems
    (job,) = jobs
    assert job.format is QuantFormat.NONE and job.gpus == 0 and job.memoryGiB == 2
    # The `none` Job uploads the files it downloaded (quantjob job.py: out = fetched.path): one copy of
    # the fp8 source's ~630 GiB plus headroom on disk, and its time is the download plus the upload.
    src_gib = source_bytes(shape) / 2**30
    assert 620 < src_gib < 640
    assert src_gib * 1.1 < job.ephemeralStorageGiB < src_gib * 1.1 + 10
    transfer = src_gib * 2**30 / 1e9 / DOWNLOAD_GBPS / 60 + src_gib * 2**30 / 1e9 / UPLOAD_GBPS / 60
    assert job.estimatedMinutes == math.ceil(START_MINUTES + transfer)


def test_memory_cap_violation_names_the_figures_and_the_policy():
    _, _, (job,) = _sized_70b()
    assert cap_violations(job, None, None) == []
    assert cap_violations(job, None, job.memoryGiB) == []
    (msg,) = cap_violations(job, None, 128, {"maxQuantizationJobMemoryGiB": "platform"})
    assert msg == (f"fp8-dynamic: the quantization Job needs {job.memoryGiB} GiB of memory; "
                   "rules.maxQuantizationJobMemoryGiB (policy platform) allows 128 GiB")


def test_inputs_come_from_the_spec_and_only_explicit_policy_gpus():
    spec = QuantizedModelSpec.model_validate({
        "source": {"uri": "hf://a/b"}, "storage": {"uri": "s3://bkt/q"},
        "quantization": {"calibration": {"samples": 128, "maxSeqLength": 1024}, "qualityGate": {"evalSamples": 16}}})
    i = inputs_from(spec, QuantizationJobPlacement(), None)
    assert (i.calibration_samples, i.calibration_seq_len, i.eval_samples, i.gpus) == (128, 1024, 16, None)
    policy = QuantizationPolicy.model_validate({"metadata": {"name": "p"}, "spec": {"rules": {
        "maxQuantizationJobGPUs": 2, "quantizationJob": {"gpus": 0}}}})
    i = inputs_from(spec, policy.spec.rules.quantizationJob, policy.spec.rules)
    assert (i.gpus, i.max_gpus) == (0, 2)


def test_fewerbits_plan_shows_the_jobs(capsys):
    assert main(["plan", "--model-config", str(LLAMA_70B), "--gpu", "NVIDIA-H100-80GB-HBM3:8", "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (job,) = out["quantizationJobs"]
    assert set(job) >= {"format", "gpus", "gpuMemoryGiB", "memoryGiB", "ephemeralStorageGiB", "estimatedMinutes",
                        "pool"}
    assert job["memoryGiB"] >= 140 and job["ephemeralStorageGiB"] >= 200
    assert main(["plan", "--model-config", str(LLAMA_70B), "--gpu", "NVIDIA-H100-80GB-HBM3:8"]) == 0
    table = capsys.readouterr().out
    assert "Quantization Jobs" in table
    row = next(line for line in table.splitlines() if line.startswith("fp8-dynamic"))
    assert f"{job['memoryGiB']} GiB" in row and f"{job['ephemeralStorageGiB']} GiB" in row and "ephemeral" in row


def test_fewerbits_plan_applies_the_policy_caps(tmp_path, capsys):
    policy = tmp_path / "p.yaml"
    policy.write_text("apiVersion: fewerbits.io/v1alpha1\nkind: QuantizationPolicy\nmetadata: {name: p}\n"
                      "spec: {rules: {maxQuantizationJobGPUs: 1}}\n")
    assert main(["plan", "--model-config", str(LLAMA_70B), "--gpu", "NVIDIA-H100-80GB-HBM3:8", "--policy",
                 str(policy), "-o", "json"]) == 0
    (job,) = json.loads(capsys.readouterr().out)["quantizationJobs"]
    assert job["gpus"] == 1 and job["evaluationOffloadGiB"] > 50


# ------------------------------------------------------------------ failures from pod status


def _job(**kw) -> JobFacts:
    return JobFacts("fewerbits-quantize-x", (), JobState.FAILED, **kw)


@pytest.mark.parametrize("facts,reason,text", [
    (_job(terminations=(ContainerTermination("p", "quantize", 137, "OOMKilled", ""),), limits={"memory": "64Gi"}),
     Reason.JOB_OOM_KILLED, "exceeded its memory limit of 64Gi"),
    (_job(evictions=(("p", "Container quantize exceeded its local ephemeral storage limit \"30Gi\". "),),
          limits={"ephemeral-storage": "30Gi"}), Reason.JOB_OUT_OF_DISK, "ephemeral-storage 30Gi"),
    (_job(evictions=(("p", "The node was low on resource: ephemeral-storage. "),)), Reason.JOB_OUT_OF_DISK,
     "ran out of disk"),
    (_job(evictions=(("p", "The node was low on resource: memory. "),), limits={"memory": "64Gi"}),
     Reason.JOB_EVICTED, "asks for memory 64Gi"),
    (_job(failed_condition={"reason": "DeadlineExceeded"}, active_deadline_seconds=3600),
     Reason.JOB_DEADLINE_EXCEEDED, "(3600 s"),
])
def test_failures_are_typed_with_the_resource_to_raise(facts, reason, text):
    got = classify(facts)
    assert got is not None and got[0] == reason and text in got[1], got


def test_a_job_that_failed_on_its_own_is_not_classified():
    assert classify(_job(terminations=(ContainerTermination("p", "quantize", 1, "Error", "{}"),))) is None


def test_observe_reads_evictions_and_limits_from_pod_and_job():
    pods = [{"metadata": {"name": "a", "creationTimestamp": "2026-01-01T00:00:00Z"},
             "status": {"phase": "Failed", "reason": "Evicted", "message": "low on ephemeral-storage"}},
            {"metadata": {"name": "b", "creationTimestamp": "2026-01-01T00:01:00Z"}, "status": {"phase": "Failed"}}]
    assert evictions(pods) == (("a", "low on ephemeral-storage"),)
    job = {"spec": {"activeDeadlineSeconds": 99, "template": {"spec": {"containers": [
        {"resources": {"limits": {"memory": "8Gi", "nvidia.com/gpu": "1"}}}]}}}}
    got = job_limits(job)
    assert dict(got["limits"]) == {"memory": "8Gi", "nvidia.com/gpu": "1"} and got["active_deadline_seconds"] == 99


def test_a_job_may_run_on_every_pool_that_can_hold_it_preferring_the_chosen_one():
    from fewerbits_operator.artifacts.jobresources import pool_placement
    from fewerbits_operator.planner.jobsize import job_pool_selectors

    shape = load_model_shape(CONFIGS / "llama-3.2-1b.json")
    size, _ = size_job(shape, QuantFormat.FP8_DYNAMIC, [H100, L4], JobInputs())
    assert size.pool == L4.name  # one GPU of the least memory holds the 1B model
    selectors = job_pool_selectors(size, [H100, L4])
    assert selectors == [dict(L4.node_selector), dict(H100.node_selector)]
    aff = pool_placement(selectors)["affinity"]["nodeAffinity"]
    terms = aff["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert len(terms) == 2
    assert aff["preferredDuringSchedulingIgnoredDuringExecution"][0]["preference"] == terms[0]
    # 70B's two-GPU Job cannot use a one-GPU L4 node.
    _, _, (big,) = _sized_70b()
    assert job_pool_selectors(big, [H100, L4]) == [dict(H100.node_selector)]
    assert pool_placement([dict(H100.node_selector)]) == {"nodeSelector": dict(H100.node_selector)}


# ------------------------------------------------------------------ datasets checked before a Job


def test_only_custom_s3_datasets_a_new_job_would_read_are_checked():
    from fewerbits_operator.artifacts.datasetcheck import EVAL_FIELD, datasets_to_check

    spec = QuantizedModelSpec.model_validate({
        "source": {"uri": "hf://a/b"}, "storage": {"uri": "s3://bkt/q"},
        "quantization": {"calibration": {"dataset": "s3://bkt/calib.jsonl"},
                         "qualityGate": {"evalDataset": "s3://bkt/eval.jsonl"}}})
    # The calibration object is read for its ETag before deciding (datapins), not here.
    assert datasets_to_check(spec, [QuantFormat.W4A16_GPTQ]) == [(EVAL_FIELD, "s3://bkt/eval.jsonl")]
    assert datasets_to_check(spec, [QuantFormat.FP8_DYNAMIC]) == [(EVAL_FIELD, "s3://bkt/eval.jsonl")]
    assert datasets_to_check(spec, [QuantFormat.NONE]) == []
    assert datasets_to_check(spec, []) == []  # no Job about to be created: nothing read
    builtin = SPEC.model_copy(update={"quantization": SPEC.quantization.model_copy(update={"format": "w4a16-gptq"})})
    assert datasets_to_check(builtin, [QuantFormat.W4A16_GPTQ]) == []


def test_an_unreadable_dataset_is_named_with_its_field():
    from botocore.exceptions import ClientError

    from fewerbits_api.quantizedmodel import StorageSpec
    from fewerbits_operator.artifacts.datasetcheck import EVAL_FIELD, check
    from fewerbits_operator.base.storage import ObjectStore, S3Credentials

    class Store(ObjectStore):
        """The real store over a stand-in S3 client (its HEAD answers ``code``)."""

        def __init__(self, code):
            super().__init__()
            self.code = code

        def _client(self, endpoint, region, creds):
            store = self

            class S3:
                def head_object(self, Bucket, Key):
                    if store.code:
                        raise ClientError({"Error": {"Code": store.code}}, "HeadObject")
            return S3()

    storage = StorageSpec(uri="s3://bkt/q", endpoint="http://127.0.0.1:9000")
    assert check(Store(None), storage, S3Credentials(), EVAL_FIELD, "s3://bkt/c.jsonl") is None
    why = check(Store("404"), storage, S3Credentials(), EVAL_FIELD, "s3://bkt/c.jsonl")
    assert why.startswith("spec.quantization.qualityGate.evalDataset: s3://bkt/c.jsonl does not exist")
    assert "http://127.0.0.1:9000" in why
    assert "access denied" in check(Store("AccessDenied"), storage, S3Credentials(), EVAL_FIELD, "s3://bkt/c.jsonl")


# ------------------------------------------------------------------ already-quantized sources: the copy


def test_the_plan_shows_the_copy_job_of_a_source_served_as_it_is(capsys):
    deepseek = str(CONFIGS / "deepseek-v3.json")
    assert main(["plan", "--model-config", deepseek, "--gpu", "NVIDIA-H200:8"]) == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("none (copy)"))
    assert " 0 " in row and "ephemeral" in row
    assert "downloads the source and uploads it unchanged" in table
    assert "copy Job (format none) publishes the source unchanged" in table


def test_a_policy_caps_the_copy_and_the_refusal_names_the_figures(tmp_path, capsys):
    from fewerbits_operator.artifacts.effective import combine_policies

    policies = [QuantizationPolicy.model_validate({"metadata": {"name": n}, "spec": {"rules": {"maxSourceCopyGiB": v}}})
                for n, v in (("team", 1000), ("platform", 100))]
    combined = combine_policies(policies)
    rules = combined.rules
    assert rules.maxSourceCopyGiB == 100 and combined.rule_sources["maxSourceCopyGiB"] == "platform"  # the lowest
    shape = load_model_shape(CONFIGS / "deepseek-v3.json")
    h200 = pool_from_product("NVIDIA-H200", 8)
    the_plan = plan(shape, [h200], PlanRequest())
    jobs, problems = size_plan_jobs(shape, the_plan, [h200], inputs_from(None, None, rules))
    assert jobs == []
    (why,) = problems
    assert why.startswith("none: the source is already fp8-block: served as it is, its `none` Job copies ")
    assert "rules.maxSourceCopyGiB allows 100 GiB" in why and " min)" in why
    # A cap above the source's size lets the copy run.
    jobs, problems = size_plan_jobs(shape, the_plan, [h200], JobInputs(max_copy_gib=1000))
    assert not problems and jobs[0].format is QuantFormat.NONE
    # The CLI says the same under --policy.
    policy = tmp_path / "p.yaml"
    policy.write_text("apiVersion: fewerbits.io/v1alpha1\nkind: QuantizationPolicy\nmetadata: {name: p}\n"
                      "spec: {rules: {maxSourceCopyGiB: 100}}\n")
    assert main(["plan", "--model-config", str(CONFIGS / "deepseek-v3.json"), "--gpu", "NVIDIA-H200:8",
                 "--policy", str(policy)]) == 0
    assert "no Job for none: the source is already fp8-block" in capsys.readouterr().out


def test_the_adapters_windows_count_in_the_jobs_estimate_and_deadline():
    """Each LoRA adapter's gate scores its windows on both models, in the Job's evaluation pass."""
    adapters = [{"name": f"a{i}", "source": {"uri": f"s3://adapters/a{i}"}, "gate": {"evalSamples": 512}}
                for i in range(8)]
    with_adapters = SPEC.model_copy(update={"adapters": QuantizedModelSpec.model_validate(
        {**SPEC.model_dump(mode="json", exclude_none=True), "adapters": adapters}).adapters})
    inputs = inputs_from(with_adapters)
    assert inputs.adapter_eval_samples == 8 * 512 and inputs_from(SPEC).adapter_eval_samples == 0
    (_, _, (plain,)), (_, _, (more,)) = _sized_70b(), _sized_70b(inputs=inputs)
    assert more.estimatedMinutes > plain.estimatedMinutes
    assert deadline_seconds(more) >= deadline_seconds(plain)
