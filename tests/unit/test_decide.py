"""``decide`` as a table (the KubeAI ``calculatePodPlan`` style): a world of observed facts in, the
conditions, actions and events out. No cluster, no storage, no clock: each case builds an
``Observed`` by hand and checks what the pure function decides of it.

The world starts as "a fresh model, one H100 pool, nothing in storage"; each case changes what it
needs (a manifest published, a Job failed, a Deployment rolled out...) and names what must follow.
"""

from __future__ import annotations

import hashlib

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import pytest

from fewerbits_api.adapters import AdapterQuality
from fewerbits_api.artifact import CalibrationUsed, Manifest, QualityReport
from fewerbits_api.jobcontract import QuantJobContract
from fewerbits_api.quality import eval_identity
from fewerbits_api.conditions import ADAPTERS_SERVED, CONDITION_TYPES, Condition
from fewerbits_api.policy import QuantizationPolicy
from fewerbits_api.quantizedmodel import ArtifactStatus, QuantizedModelStatus
from fewerbits_operator.artifacts.keys import job_name, planned_artifacts
from fewerbits_operator.core.decide import (
    AddJobOwner,
    ClaimArtifact,
    CreateDeployment,
    CreateJob,
    CreateService,
    DeleteDeployment,
    PatchService,
    ReplaceDeployment,
    decide,
)
from fewerbits_operator.core.acceptance import current_plan, effective_for
from fewerbits_operator.core.execute import ordered
from fewerbits_operator.base.observed import (
    ArtifactFacts,
    BrokenPolicy,
    ContainerTermination,
    JobFacts,
    JobState,
    Observed,
)
from fewerbits_operator.planner import pool_from_product, shape_from_config
from fewerbits_operator.planner.lora import AdapterFacts
from fewerbits_operator.serving.render import deployment_name, render_deployment, render_service, Owner
from fewerbits_operator.serving.routing import RoutingFacts
from fewerbits_operator.base.observed import GatewayFacts
from fewerbits_operator.base.settings import OperatorSettings

CONFIGS = Path(__file__).parent / "fixtures" / "model_configs"
NOW = "2026-11-23T12:00:00Z"
SETTINGS = OperatorSettings(_env_file=None)
NS, NAME, UID = "team", "m", "uid-m"
SHAPE = shape_from_config(json.loads((CONFIGS / "llama-3.2-1b.json").read_text()), where="test")
H100 = pool_from_product("NVIDIA-H100-80GB-HBM3", 1)
H200X8 = pool_from_product("NVIDIA-H200", 8)
DEEPSEEK_FP8 = shape_from_config(json.loads((CONFIGS / "deepseek-v3.json").read_text()), where="test")
MIXTRAL = shape_from_config(json.loads((CONFIGS / "mixtral-8x7b.json").read_text()), where="test")
A100 = pool_from_product("NVIDIA-A100-SXM4-80GB", 1)
S3_KEYS = frozenset({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"})


def base_spec(**over: Any) -> dict[str, Any]:
    spec = {
        "source": {"uri": "s3://models/llama", "endpoint": "http://127.0.0.1:9000", "credentialsSecret": "s3"},
        "quantization": {"format": "auto", "qualityGate": {"maxPerplexityIncreasePercent": 5}},
        "storage": {"uri": "s3://artifacts/p", "endpoint": "http://127.0.0.1:9000", "credentialsSecret": "s3"},
        # The serving canary has its own cases (test_canary.py); these judge the steps around it.
        "serving": {"maxModelLen": 4096, "canary": {"enabled": False}},
        "autoscaling": {"enabled": False},
    }
    for k, v in over.items():
        spec[k] = {**spec[k], **v} if isinstance(v, dict) and isinstance(spec.get(k), dict) else v
    return spec


@dataclass
class World:
    """The facts of one case, built up by the case, then turned into an ``Observed``."""

    spec: dict[str, Any] = field(default_factory=base_spec)
    generation: int = 1
    status: dict[str, Any] = field(default_factory=dict)
    policies: list[dict[str, Any]] = field(default_factory=list)
    broken: list[BrokenPolicy] = field(default_factory=list)
    secrets: dict[str, frozenset[str] | None] | None = field(default_factory=lambda: {"s3": S3_KEYS})
    pools: list[Any] = field(default_factory=lambda: [H100])
    shape: Any = SHAPE
    config_error: str | None = None
    artifacts: dict[str, ArtifactFacts] = field(default_factory=dict)
    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)
    service: dict[str, Any] | None = None
    pod_terminations: dict[str, tuple[ContainerTermination, ...]] = field(default_factory=dict)
    dataset_errors: dict[str, str] = field(default_factory=dict)
    routing: Any = None
    gateway: Any = None
    adapters: tuple[AdapterFacts, ...] = ()
    adapter_problems: dict[str, str] = field(default_factory=dict)

    def observed(self) -> Observed:
        valid = tuple(QuantizationPolicy.model_validate(p) for p in self.policies)
        old = QuantizedModelStatus.model_validate(self.status)
        return Observed(
            now=NOW, namespace=NS, name=NAME, uid=UID, generation=self.generation, resource_version="7",
            raw={"apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizedModel"}, spec=self.spec,
            old_status_raw=self.status, old_status=old, policies=valid, broken_policies=tuple(self.broken),
            namespace_labels={"kubernetes.io/metadata.name": NS, "team": "a"}, secrets=self.secrets,
            pools=tuple(self.pools), shape=self.shape, config_error=self.config_error, artifacts=self.artifacts,
            deployments=self.deployments, service=self.service, service_read=True,
            pod_terminations=self.pod_terminations, dataset_errors=self.dataset_errors,
            routing=self.routing, gateway=self.gateway, adapters=self.adapters,
            adapter_problems=self.adapter_problems)

    # --- what the pure functions say this world plans, for the case to fill in facts
    def planned(self):
        obs = self.observed()
        acc = effective_for(obs, SETTINGS)
        the_plan, _ = current_plan(obs, acc)
        return acc, the_plan, planned_artifacts(acc.spec, the_plan)

    def publish(self, increase: float = 0.5, job: JobFacts | None = None, calibration: Any = None) -> None:
        for a in self.planned()[2]:
            m = manifest(a, increase).model_copy(update={"calibration": calibration})
            self.artifacts[a.key] = ArtifactFacts(manifest=m, job=job)

    def job(self, state: JobState, **kw: Any) -> None:
        for a in self.planned()[2]:
            self.artifacts[a.key] = ArtifactFacts(job=JobFacts(a.job_name, kw.pop("owner_refs", ({"uid": UID},)),
                                                               state, **kw))

    def no_job(self) -> None:
        for a in self.planned()[2]:
            self.artifacts[a.key] = ArtifactFacts()

    def serve(self, ready: int = 1, *, stale: bool = False) -> None:
        """Deployments as the operator rendered them, rolled out with ``ready`` pods, and its Service."""
        acc, the_plan, arts = self.planned()
        owner = Owner(NAME, NS, UID)
        by_fmt = {a.format: a for a in arts}
        for v in the_plan.variants:
            pool = next(p for p in self.pools if p.name == v.pool)
            d = render_deployment(owner, acc.spec, v, dict(pool.node_selector), pool.cc_str,
                                  ("0" * 64) if stale else by_fmt[v.format].key, 1000, 1, SETTINGS)
            d["metadata"].update(resourceVersion="5", generation=1)
            d["status"] = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": ready}
            self.deployments[d["metadata"]["name"]] = d
        svc = render_service(owner)
        svc["metadata"]["ownerReferences"] = [{"uid": UID}]
        self.service = svc

    def settle(self) -> None:
        """Feed the decided status back, as the next pass would read it."""
        self.status = decide(self.observed(), SETTINGS).status.to_wire()


def manifest(a, increase: float) -> Manifest:
    base = 10.0
    return Manifest(key=a.key, keyInputs=a.inputs, format=a.format, files=[], totalBytes=1000,
                    quality=QualityReport(baselinePerplexity=base, perplexity=base * (1 + increase / 100),
                                          increasePercent=increase, maxIncreasePercent=5, passed=True,
                                          evalDataset="general-en-heldout", evalWindows=2, evalTokens=1000),
                    tools={"llmcompressor": "0.14.0.1"}, createdAt=NOW)


REDUCED = CalibrationUsed(dataset="auto", source="general-en", samples=44, tokens=5000, requestedSamples=512,
                          maxSeqLength=2048, shortfall="calibrated on 44 samples (5000 tokens) of the 512 asked: "
                                                    "the Hub could not be read")


def policy(name: str = "p", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizationPolicy", "metadata": {"name": name},
            "spec": {"namespaceSelector": {"matchLabels": {"team": "a"}}, **spec}}


def baseline(**rules: Any) -> dict[str, Any]:
    """A platform baseline: every namespace, low priority."""
    return {**policy("platform"), "spec": {"namespaceSelector": {}, "priority": 0, "rules": rules,
                                           "defaults": {"serving": {"replicas": 1}}}}


def _values(o) -> dict[str, tuple[str, str]]:
    return {v.path: (v.value, v.source) for v in o.status.effective.values}


def term(exit_code: int = 12, message: str = "", **kw: Any) -> ContainerTermination:
    return ContainerTermination(pod=kw.pop("pod", "m-pod-1"), container=kw.pop("container", "fetch"),
                                exit_code=exit_code, reason=kw.pop("reason", "Error"), message=message, **kw)


def _moved_job(o) -> None:
    job = next(a.job for a in o.actions if isinstance(a, CreateJob))
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert json.loads(env["FEWERBITS_JOB_CONTRACT"])["storage"]["uri"] == "s3://artifacts/moved"
    key = o.status.artifacts[0].key
    assert job["metadata"]["name"] == job_name(key, "s3://artifacts/moved", "http://127.0.0.1:9000")
    assert job["metadata"]["name"] != job_name(key, "s3://artifacts/p", "http://127.0.0.1:9000")
    assert o.status.artifacts[0].uri == f"s3://artifacts/moved/{key}/"


def _not_the_shared_job(o) -> None:
    job = next(a.job for a in o.actions if isinstance(a, CreateJob))
    key = o.status.artifacts[0].key
    assert job["metadata"]["name"] != job_name(key, "s3://artifacts/p", "http://127.0.0.1:9000")


def _old_job_name(key: str) -> str:
    return "fewerbits-quantize-" + key[:24]


def _old_job_name_in_status(w: World) -> None:
    """As an operator that named Jobs by key alone left the status: the Job is long gone (TTL)."""
    for a in w.status["artifacts"]:
        a["job"], a["cacheHit"] = _old_job_name(a["key"]), False
    w.status["conditions"] = [{**c, "reason": "JobSucceeded"} if c["type"] == "Quantized" else c
                              for c in w.status["conditions"]]


def _sized_job(o) -> None:
    job = next(a.job for a in o.actions if isinstance(a, CreateJob))
    size = o.status.plan.quantizationJobs[0]
    pod = job["spec"]["template"]["spec"]
    res = pod["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == str(size.gpus)
    assert res["limits"]["ephemeral-storage"] == f"{size.ephemeralStorageGiB}Gi"
    # The 1B test model needs less than the operator's 8Gi floor.
    assert res["requests"]["memory"] == res["limits"]["memory"] == "8Gi"
    assert size.pool == H100.name and pod["nodeSelector"] == dict(H100.node_selector)
    assert job["spec"]["activeDeadlineSeconds"] == 3600


# ------------------------------------------------------------------ the cases


@dataclass
class Case:
    id: str
    build: Callable[[World], None]
    conditions: dict[str, tuple[str, str]]
    """Condition type → (status, reason) that must hold; types not named are not checked."""
    actions: list[type] = field(default_factory=list)
    """Kinds of the actions, in execution order."""
    events: set[str] = field(default_factory=set)
    """Event reasons that must be among the events."""
    message: dict[str, str] = field(default_factory=dict)
    """Condition type → a substring its message must contain."""
    check: Callable[[Any], None] | None = None
    """Any further check on the outcome."""


def _set(**kw):
    def build(w: World) -> None:
        for k, v in kw.items():
            setattr(w, k, v)
    return build


def _seq(*steps):
    def build(w: World) -> None:
        for s in steps:
            s(w)
    return build


def _ready_world(w: World) -> None:
    w.publish()
    w.serve()
    w.settle()


def _failed_job_then_gone(generation_of_failure: int, now_generation: int):
    def build(w: World) -> None:
        w.generation = generation_of_failure
        w.job(JobState.FAILED, terminations=(term(1, json.dumps(
            {"stage": "calibrate", "reason": "DatasetUnreadable", "message": "calibration.jsonl: NoSuchKey"}),
            container="quantize"),), failed_condition={"reason": "PodFailurePolicy"})
        w.settle()
        w.no_job()  # its TTL removed it
        w.generation = now_generation
    return build


CASES = [
    # ---- Accepted
    Case("fresh model: a Job per artifact, nothing served yet", lambda w: w.no_job(),
         {"Accepted": ("True", "Valid"), "Planned": ("True", "Planned"), "Quantized": ("False", "JobPending"),
          "QualityGatePassed": ("False", "AwaitingArtifact"), "Deployed": ("False", "AwaitingArtifact"),
          "Ready": ("False", "NoReplicasReady")},
         actions=[ClaimArtifact, CreateJob, CreateService], events={"QuantizationStarted"}),
    Case("name too long for Deployment names", lambda w: None,
         {"Accepted": ("False", "InvalidSpec"), "Ready": ("False", "Blocked")},
         message={"Accepted": "metadata.name"}),
    Case("invalid spec names the field", _set(spec=base_spec(source={"uri": "ftp://x"})),
         {"Accepted": ("False", "InvalidSpec"), "Planned": ("False", "Blocked")},
         message={"Accepted": "spec.source.uri"}),
    Case("a cloud metadata endpoint is refused before anything is read",
         _set(spec=base_spec(storage={"endpoint": "http://169.254.169.254"})),
         {"Accepted": ("False", "InvalidSpec"), "Quantized": ("False", "Blocked")},
         message={"Accepted": "spec.storage.endpoint: http://169.254.169.254 is refused"},
         check=lambda o: not o.actions),
    Case("no storage anywhere", _set(spec={k: v for k, v in base_spec().items() if k != "storage"}),
         {"Accepted": ("False", "InvalidSpec")}, message={"Accepted": "spec.storage"}),
    Case("policy forbids the format", _set(spec=base_spec(quantization={"format": "nvfp4"}),
                                           policies=[policy(rules={"allowedFormats": ["fp8-dynamic"]})]),
         {"Accepted": ("False", "PolicyViolation"), "Quantized": ("False", "Blocked")},
         message={"Accepted": "rule allowedFormats"}),
    Case("policy forbids trust-remote-code flags", _set(spec=base_spec(serving={"extraArgs": ["--trust_remote_code"]})),
         {"Accepted": ("False", "PolicyViolation")}, message={"Accepted": "spec.serving.extraArgs[0]"}),
    Case("an invalid policy for this namespace fails closed",
         _set(broken=[BrokenPolicy("legacy", "spec.rules: bad", may_select=True)]),
         {"Accepted": ("False", "PolicyViolation")}, message={"Accepted": "QuantizationPolicy legacy"},
         check=lambda o: o.status.autoscaling is None),
    Case("an invalid policy for other namespaces does not apply",
         _seq(_set(broken=[BrokenPolicy("other", "bad", may_select=False)]), lambda w: w.no_job()),
         {"Accepted": ("True", "Valid")}, actions=[ClaimArtifact, CreateJob, CreateService]),
    Case("policy applies and is named", _seq(_set(policies=[policy(priority=3)]), lambda w: w.no_job()),
         {"Accepted": ("True", "Valid")}, message={"Accepted": "policy p applies"}, actions=[ClaimArtifact, CreateJob, CreateService]),
    Case("missing Secret is named", _set(secrets={"s3": None}),
         {"Accepted": ("False", "MissingSecret"), "Ready": ("False", "Blocked")},
         message={"Accepted": "spec.source.credentialsSecret: Secret s3 not found in namespace team"}),
    Case("Secret without its keys", _set(secrets={"s3": frozenset({"AWS_ACCESS_KEY_ID"})}),
         {"Accepted": ("False", "MissingSecret")}, message={"Accepted": "has no key AWS_SECRET_ACCESS_KEY"}),
    # ---- Planned
    Case("no GPU pools", _set(pools=[]), {"Planned": ("False", "NoGPUPools"), "Quantized": ("False", "Blocked")}),
    Case("nothing fits", _set(shape=shape_from_config(json.loads((CONFIGS / "llama-3.1-70b.json").read_text()),
                                                      where="t"),
                              pools=[pool_from_product("NVIDIA-L4", 1)]),
         {"Planned": ("False", "NoPoolFits"), "Deployed": ("False", "Blocked")}, message={"Planned": "l4-x1: does not fit"}),
    Case("a serving target matching no pool is named",
         _set(spec=base_spec(serving={"targets": [{"family": "blackwell"}]})),
         {"Planned": ("False", "NoPoolFits")}, message={"Planned": "spec.serving.targets[0] (family blackwell)"}),
    Case("config unreadable, never planned", _set(shape=None, config_error="NoSuchKey: config.json"),
         {"Planned": ("False", "ModelConfigUnavailable"), "Quantized": ("False", "Blocked")},
         message={"Planned": "NoSuchKey"}),
    Case("config unreadable with this generation's plan kept",
         _seq(_ready_world, _set(shape=None, config_error="AccessDenied")),
         {"Planned": ("True", "Planned"), "Ready": ("True", "AllVariantsReady")},
         message={"Planned": "kept from an earlier pass"}),
    Case("config unreadable after a spec edit: the old plan is not this generation's",
         _seq(_ready_world, _set(shape=None, config_error="AccessDenied", generation=2)),
         {"Planned": ("False", "ModelConfigUnavailable")}),
    Case("a pool gone keeps its Deployment",
         _seq(_set(pools=[H100, A100]), _ready_world, _set(pools=[H100])),
         {"Planned": ("True", "PoolGone"), "Ready": ("True", "AllVariantsReady")},
         message={"Planned": "Deployment m-a100-sxm4-80gb-x1 kept"},
         check=lambda o: any(r.pool == "a100-sxm4-80gb-x1" for r in o.status.plan.rejected)),
    Case("the last pool gone", _seq(_ready_world, _set(pools=[])),
         {"Planned": ("False", "PoolGone"), "Deployed": ("False", "Blocked")}),
    Case("a pool no longer planned is removed",
         _seq(_set(pools=[H100, A100]), _ready_world,
              _set(spec=base_spec(serving={"targets": [{"family": "hopper"}]}))),
         {"Planned": ("True", "Planned")}, actions=[DeleteDeployment], events={"DeploymentRemoved"}),
    # ---- Quantized
    Case("Job pending: no pod yet", lambda w: w.job(JobState.PENDING),
         {"Quantized": ("False", "JobPending")}, message={"Quantized": "waiting for a node with room"},
         actions=[CreateService]),
    Case("Job active with its pod unscheduled is pending", lambda w: w.job(JobState.ACTIVE, pod_phases=("Pending",)),
         {"Quantized": ("False", "JobPending")}, message={"Quantized": "pod Pending: waiting for a node"},
         actions=[CreateService]),
    Case("Job running shows its pods", lambda w: w.job(JobState.ACTIVE, pod_phases=("Running",)),
         {"Quantized": ("False", "JobRunning")}, message={"Quantized": "pod Running"}, actions=[CreateService]),
    Case("another model's Job for the same key gains this owner",
         lambda w: w.job(JobState.ACTIVE, owner_refs=({"uid": "other"},), pod_phases=("Running",)),
         {"Quantized": ("False", "JobRunning")}, actions=[AddJobOwner, CreateService],
         check=lambda o: [r["uid"] for r in o.actions[0].owner_refs] == ["other", UID]),
    Case("Job failed: the pod's termination message", lambda w: w.job(
        JobState.FAILED, terminations=(term(1, json.dumps({"stage": "calibrate", "reason": "DatasetUnreadable",
                                                             "message": "s3://x/calibration.jsonl: NoSuchKey"}),
                                            container="quantize"),)),
         {"Quantized": ("False", "JobFailed"), "Deployed": ("False", "AwaitingArtifact")},
         message={"Quantized": "stage calibrate: DatasetUnreadable: s3://x/calibration.jsonl"},
         actions=[CreateService],
         check=lambda o: o.status.artifacts[0].failure.generation == 1 and o.status.artifacts[0].failure.job),
    Case("Job failed without a message: the Job's condition", lambda w: w.job(
        JobState.FAILED, failed_condition={"reason": "BackoffLimitExceeded", "message": "backoff limit"}),
         {"Quantized": ("False", "JobFailed")}, message={"Quantized": "BackoffLimitExceeded: backoff limit"},
         actions=[CreateService]),
    Case("Job past its deadline: JobDeadlineExceeded with the deadline", lambda w: w.job(
        JobState.FAILED, failed_condition={"reason": "DeadlineExceeded", "message": "active deadline"},
        active_deadline_seconds=7200),
         {"Quantized": ("False", "JobDeadlineExceeded")}, message={"Quantized": "activeDeadlineSeconds (7200 s"},
         actions=[CreateService], check=lambda o: o.status.artifacts[0].failure.reason == "JobDeadlineExceeded"),
    Case("Job OOM-killed: JobOOMKilled names the memory limit", lambda w: w.job(
        JobState.FAILED, failed_condition={"reason": "BackoffLimitExceeded", "message": "backoff"},
        terminations=(term(137, "", reason="OOMKilled", container="quantize"),), limits={"memory": "190Gi"}),
         {"Quantized": ("False", "JobOOMKilled")},
         message={"Quantized": "exceeded its memory limit of 190Gi; raise the operator's floor FEWERBITS_JOB_MEMORY_REQUEST"},
         actions=[CreateService], check=lambda o: o.status.artifacts[0].failure.reason == "JobOOMKilled"),
    Case("Job evicted for disk: JobOutOfDisk names the ephemeral-storage it asked for", lambda w: w.job(
        JobState.FAILED, failed_condition={"reason": "BackoffLimitExceeded", "message": "backoff"},
        evictions=(("m-pod-1", "Pod ephemeral local storage usage exceeds the total limit of containers 224Gi."),),
        limits={"memory": "190Gi", "ephemeral-storage": "224Gi"}),
         {"Quantized": ("False", "JobOutOfDisk")},
         message={"Quantized": "the Job asks for ephemeral-storage 224Gi; raise the operator's "
                               "FEWERBITS_JOB_EPHEMERAL_STORAGE_REQUEST"},
         actions=[CreateService]),
    Case("Job evicted for another reason: JobEvicted with the kubelet's message", lambda w: w.job(
        JobState.FAILED, failed_condition={"reason": "BackoffLimitExceeded", "message": "backoff"},
        evictions=(("m-pod-1", "Pod was terminated in response to imminent node shutdown."),)),
         {"Quantized": ("False", "JobEvicted")}, message={"Quantized": "imminent node shutdown"},
         actions=[CreateService]),
    Case("Job evicted, node low on memory: JobEvicted names the memory it asked for", lambda w: w.job(
        JobState.FAILED, failed_condition={"reason": "BackoffLimitExceeded", "message": "backoff"},
        evictions=(("m-pod-1", "The node was low on resource: memory. Threshold quantity: 100Mi."),),
        limits={"memory": "190Gi"}),
         {"Quantized": ("False", "JobEvicted")}, message={"Quantized": "the Job asks for memory 190Gi"},
         actions=[CreateService]),
    Case("a Job above the policy's memory cap is refused with the figures, no Job",
         _seq(_set(policies=[baseline(maxQuantizationJobMemoryGiB=1)]), lambda w: w.no_job()),
         {"Accepted": ("True", "Valid"), "Quantized": ("False", "JobExceedsPolicy")},
         message={"Quantized": "GiB of memory; rules.maxQuantizationJobMemoryGiB (policy platform) allows 1 GiB"},
         actions=[CreateService],
         check=lambda o: o.status.plan.quantizationJobs and o.status.plan.quantizationJobs[0].memoryGiB > 1),
    Case("a custom S3 evaluation set that cannot be read is named before any Job",
         _seq(_set(spec=base_spec(quantization={"format": "w4a16-gptq",
                                                "qualityGate": {"evalDataset": "s3://artifacts/eval.jsonl"}}),
                   dataset_errors={"spec.quantization.qualityGate.evalDataset":
                                   "spec.quantization.qualityGate.evalDataset: s3://artifacts/eval.jsonl does not exist"}),
              lambda w: w.no_job()),
         {"Quantized": ("False", "DatasetUnreadable")},
         message={"Quantized": "spec.quantization.qualityGate.evalDataset: s3://artifacts/eval.jsonl does not exist"},
         actions=[CreateService]),
    Case("the Job is sized from the plan: requests, limits, pool and deadline", lambda w: w.no_job(),
         {"Quantized": ("False", "JobPending")}, actions=[ClaimArtifact, CreateJob, CreateService], check=lambda o: _sized_job(o)),
    Case("failed Job removed by its TTL: not re-run for the same generation", _failed_job_then_gone(1, 1),
         {"Quantized": ("False", "JobFailed")}, message={"Quantized": "edit the spec"}, actions=[CreateService],
         check=lambda o: o.status.artifacts[0].failure.reason == "JobFailed"),
    Case("failed Job removed, spec edited: a new Job", _failed_job_then_gone(1, 2),
         {"Quantized": ("False", "JobPending")}, actions=[ClaimArtifact, CreateJob, CreateService]),
    Case("Job succeeded but storage has no manifest", lambda w: w.job(JobState.SUCCEEDED),
         {"Quantized": ("False", "JobFailed")}, message={"Quantized": "no manifest is at the artifact key"},
         actions=[CreateService]),
    Case("a Ready model's storage moved: a Job of its own publishes at the new location",
         _seq(_ready_world, _set(spec=base_spec(storage={"uri": "s3://artifacts/moved"}), generation=2),
              lambda w: w.no_job()),
         {"Quantized": ("False", "JobPending"), "Ready": ("True", "AllVariantsReady")},
         actions=[ClaimArtifact, CreateJob], events={"QuantizationStarted"}, check=_moved_job),
    Case("another model's Job for the same key elsewhere is not this one's",
         _seq(_set(spec=base_spec(storage={"uri": "s3://artifacts/team-b"})), lambda w: w.no_job()),
         {"Quantized": ("False", "JobPending")}, actions=[ClaimArtifact, CreateJob, CreateService], check=_not_the_shared_job),
    Case("upgrade: the status names a Job by its old name and the manifest is published: nothing re-runs",
         _seq(_ready_world, _old_job_name_in_status),
         {"Quantized": ("True", "JobSucceeded"), "Ready": ("True", "AllVariantsReady")},
         check=lambda o: not o.actions and o.status.artifacts[0].job == _old_job_name(o.status.artifacts[0].key)
         and o.status.artifacts[0].cacheHit is False),
    Case("storage unreachable", lambda w: [w.artifacts.__setitem__(a.key, ArtifactFacts(
        storage_error="storage s3://artifacts unreachable")) for a in w.planned()[2]],
         {"Quantized": ("False", "StorageUnavailable")}, message={"Quantized": "unreachable"},
         actions=[CreateService]),
    Case("cache hit: no Job, rolled out", lambda w: w.publish(),
         {"Quantized": ("True", "CacheHit"), "QualityGatePassed": ("True", "GatePassed"),
          "Deployed": ("False", "RollingOut")},
         actions=[CreateDeployment, CreateService], events={"CacheHit", "DeploymentCreated"},
         check=lambda o: o.status.artifacts[0].cacheHit is True and o.status.artifacts[0].job is None),
    Case("our own Job's artifact is not a cache hit",
         lambda w: w.publish(job=JobFacts("j", ({"uid": UID},), JobState.SUCCEEDED)),
         {"Quantized": ("True", "JobSucceeded")}, actions=[CreateDeployment, CreateService],
         check=lambda o: o.status.artifacts[0].job == "j" and "CacheHit" not in {e.reason for e in o.events}),
    Case("calibrated on fewer samples than asked: served, and status says so (issue 31)",
         lambda w: w.publish(calibration=REDUCED),
         {"Quantized": ("True", "CalibrationReduced"), "QualityGatePassed": ("True", "GatePassed")},
         message={"Quantized": "calibrated on 44 samples (5000 tokens) of the 512 asked: the Hub could not be read"},
         actions=[CreateDeployment, CreateService],
         check=lambda o: o.status.artifacts[0].calibration == REDUCED),
    Case("a cache hit already recorded emits no second event", _seq(lambda w: w.publish(), lambda w: w.settle()),
         {"Quantized": ("True", "CacheHit")}, actions=[CreateDeployment, CreateService],
         check=lambda o: "CacheHit" not in {e.reason for e in o.events}),
    # ---- QualityGatePassed
    Case("gate failed: nothing rolled out", lambda w: w.publish(increase=9.0),
         {"QualityGatePassed": ("False", "GateFailed"), "Deployed": ("False", "Blocked"),
          "Ready": ("False", "NoReplicasReady")},
         message={"QualityGatePassed": "exceeds the gate of 5%"}, actions=[CreateService],
         check=lambda o: o.status.artifacts[0].quality.passed is False),
    Case("gate failed for a new artifact keeps the old Deployment serving",
         _seq(lambda w: w.serve(stale=True), lambda w: w.publish(increase=9.0)),
         {"QualityGatePassed": ("False", "GateFailed"), "Ready": ("True", "AllVariantsReady")}, actions=[]),
    Case("policy ceiling lowers the default gate",
         _seq(_set(spec=base_spec(quantization={"qualityGate": None}),
                   policies=[policy(rules={"maxPerplexityIncreasePercent": 1})]), lambda w: w.publish(increase=2.0)),
         {"QualityGatePassed": ("False", "GateFailed")}, message={"QualityGatePassed": "gate of 1%"},
         actions=[CreateService]),
    # ---- Deployed / Ready
    Case("rolled out and ready", _ready_world,
         {"Accepted": ("True", "Valid"), "Planned": ("True", "Planned"), "Quantized": ("True", "CacheHit"),
          "QualityGatePassed": ("True", "GatePassed"), "Deployed": ("True", "DeploymentsCreated"),
          "Ready": ("True", "AllVariantsReady")},
         check=lambda o: o.status.endpoint == "http://m.team.svc:8000" and o.status.replicas == "1/1"),
    Case("at rest: no action, no event", _ready_world, {"Ready": ("True", "AllVariantsReady")},
         check=lambda o: o.events == ()),
    Case("a new artifact rolls out by replacing the Deployment",
         _seq(lambda w: w.serve(stale=True), lambda w: w.publish()),
         {"Deployed": ("False", "RollingOut"), "Ready": ("True", "AllVariantsReady")},
         actions=[ReplaceDeployment], events={"RollingOut"},
         check=lambda o: o.actions[0].deployment["metadata"]["resourceVersion"] == "5"),
    Case("fixed replicas drifted: replaced", _seq(_ready_world, lambda w: w.deployments[
        deployment_name(NAME, H100.name)]["spec"].update(replicas=3)),
         {"Deployed": ("False", "RollingOut")}, actions=[ReplaceDeployment]),
    Case("autoscaled replicas are the autoscaler's: left alone",
         _seq(_set(spec=base_spec(autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 4})), _ready_world,
              lambda w: w.deployments[deployment_name(NAME, H100.name)]["spec"].update(replicas=3)),
         {}, actions=[], check=lambda o: o.status.serving[0].replicas == 3),
    Case("pods failing name the container and reason",
         _seq(lambda w: w.publish(), lambda w: w.serve(ready=0),
              _set(pod_terminations={H100.name: (term(12, json.dumps({"reason": "DigestMismatch",
                                                                       "message": "sha256 of a.safetensors"})),)})),
         {"Ready": ("False", "PodsFailing")}, message={"Ready": "container fetch: exit 12, DigestMismatch"}),
    Case("a restarted healthy container is not a failure",
         _seq(lambda w: w.publish(), lambda w: w.serve(ready=0),
              _set(pod_terminations={H100.name: (term(1, "boom", running_ready=True),)})),
         {"Ready": ("False", "NoReplicasReady")}),
    Case("some variants ready", _seq(_set(pools=[H100, A100]), lambda w: w.publish(), lambda w: w.serve(),
                                     lambda w: w.deployments[deployment_name(NAME, A100.name)]["status"].update(
                                         readyReplicas=0)),
         {"Ready": ("False", "SomeVariantsReady")}, message={"Ready": "waiting for a100"}),
    Case("someone else's Service is never touched", _seq(_ready_world, lambda w: w.service["metadata"].update(
        ownerReferences=[{"uid": "someone-else"}])),
         {"Deployed": ("False", "ServiceConflict"), "Ready": ("False", "ServiceConflict")}, actions=[],
         check=lambda o: o.status.endpoint is None),
    Case("inferencePool routing without its CRD is refused, the Service serves",
         _seq(_set(spec=base_spec(serving={"maxModelLen": 4096, "routing": "inferencePool"})), _ready_world,
              _set(routing=RoutingFacts(crd_served=False))),
         {"Deployed": ("False", "RoutingUnavailable"), "Ready": ("True", "AllVariantsReady")}),
    Case("someone else's InferencePool is never touched",
         _seq(_set(spec=base_spec(serving={"maxModelLen": 4096, "routing": "inferencePool"})), _ready_world,
              _set(routing=RoutingFacts(True, {"metadata": {"ownerReferences": [{"uid": "someone-else"}]}}))),
         {"Deployed": ("False", "InferencePoolConflict")}, actions=[]),
    Case("someone else's HTTPRoute is never touched (spec.serving.gateway), the Service serves",
         _seq(_set(spec=base_spec(serving={"maxModelLen": 4096, "gateway": {"name": "gw"}})), _ready_world,
              _set(gateway=GatewayFacts(True, {"metadata": {"ownerReferences": [{"uid": "someone-else"}]}}))),
         {"Deployed": ("False", "HTTPRouteConflict"), "Ready": ("True", "AllVariantsReady")}, actions=[],
         message={"Deployed": "spec.serving.gateway"}),
    Case("a variant whose pods expose no metrics is served, and said so",
         _seq(_ready_world, lambda w: w.status["serving"][0].update(podsWithoutMetrics=1)),
         {"Deployed": ("True", "MetricsUnavailable"), "Ready": ("True", "AllVariantsReady")},
         message={"Deployed": "expose no vLLM metrics"}, events={"MetricsUnavailable"}),
    Case("our Service edited by hand is repaired", _seq(_ready_world, lambda w: w.service["spec"].update(
        selector={"app": "x"})), {"Ready": ("True", "AllVariantsReady")}, actions=[PatchService]),
    Case("autoscaler fields survive a reconcile",
         _seq(_ready_world, lambda w: w.status["serving"][0].update(desiredReplicas=2, kvCacheUsage=0.8)),
         {}, check=lambda o: (o.status.serving[0].desiredReplicas, o.status.serving[0].kvCacheUsage) == (2, 0.8)),
    Case("effective autoscaling published with the policy cap",
         _seq(_set(spec=base_spec(autoscaling={"enabled": True, "maxReplicas": 3}),
                   policies=[policy(defaults={"autoscaling": {"targetKVCacheUsage": 0.5}}, rules={"maxReplicas": 3})]),
              lambda w: w.no_job()), {"Accepted": ("True", "Valid")}, actions=[ClaimArtifact, CreateJob, CreateService],
         check=lambda o: (o.status.autoscaling.targetKVCacheUsage, o.status.autoscaling.policyMaxReplicas,
                          o.status.autoscaling.maxReplicas) == (0.5, 3, 3)),
    Case("a source already in the pool's format is published as-is: a `none` artifact, no quantization",
         _seq(_set(shape=DEEPSEEK_FP8, pools=[H200X8], spec=base_spec(serving={"maxModelLen": 8192})),
              lambda w: w.no_job()),
         {"Planned": ("True", "Planned"), "Quantized": ("False", "JobPending")}, actions=[ClaimArtifact, CreateJob, CreateService],
         check=lambda o: o.status.plan.variants[0].servedAsIs and o.status.plan.variants[0].format.value == "fp8-block"
         and [a.format.value for a in o.status.artifacts] == ["none"]
         and json.loads(next(e["value"] for e in o.actions[1].job["spec"]["template"]["spec"]["containers"][0]["env"]
                             if e["name"] == "FEWERBITS_JOB_CONTRACT"))["keyInputs"]["format"] == "none"),
    Case("the as-is artifact rolls out on the variant that serves the source's format",
         _seq(_set(shape=DEEPSEEK_FP8, pools=[H200X8], spec=base_spec(serving={"maxModelLen": 8192})),
              lambda w: w.publish()),
         {"QualityGatePassed": ("True", "GatePassed"), "Deployed": ("False", "RollingOut")},
         actions=[CreateDeployment, CreateService]),
    Case("a variant spanning nodes on a cluster without LeaderWorkerSet is refused, nothing created for it",
         _seq(_set(shape=DEEPSEEK_FP8, pools=[pool_from_product("NVIDIA-H100-80GB-HBM3", 8, 4)],
                   spec=base_spec(serving={"maxModelLen": 8192})), lambda w: w.publish()),
         {"Deployed": ("False", "LeaderWorkerSetMissing")}, actions=[CreateService],
         message={"Deployed": "install LeaderWorkerSet"}),
    Case("an MoE model's routers join the ignore list the plan sized and the key hashes",
         _seq(_set(shape=MIXTRAL, pools=[pool_from_product("NVIDIA-H100-80GB-HBM3", 8)]), lambda w: w.no_job()),
         {"Planned": ("True", "Planned")}, actions=[ClaimArtifact, CreateJob, CreateService],
         check=lambda o: "lm_head" in o.status.plan.ignore and len(o.status.plan.ignore) > 1
         and all(set(o.status.plan.ignore) == set(json.loads(next(
             e["value"] for e in a.job["spec"]["template"]["spec"]["containers"][0]["env"]
             if e["name"] == "FEWERBITS_JOB_CONTRACT"))["keyInputs"]["ignore"]) for a in o.actions[1:2])),
    Case("a spec error keeps the last accepted autoscaling",
         _seq(_set(spec=base_spec(autoscaling={"enabled": True})), _ready_world,
              _set(spec=base_spec(source={"uri": "ftp://typo"}, autoscaling={"enabled": True}), generation=2)),
         {"Accepted": ("False", "InvalidSpec")}, check=lambda o: o.status.autoscaling is not None),
    Case("a policy violation stops autoscaling",
         _seq(_set(spec=base_spec(autoscaling={"enabled": True})), _ready_world,
              _set(policies=[policy(rules={"requireRevisionPin": True})], generation=2)),
         {"Accepted": ("False", "PolicyViolation")}, check=lambda o: o.status.autoscaling is None),
    # ---- layered policies
    Case("a baseline and a team policy both constrain the model",
         _set(spec=base_spec(quantization={"format": "nvfp4"}),
              policies=[baseline(allowedSources=["hf://*"]), policy("team", priority=10, rules={
                  "allowedFormats": ["fp8-dynamic"]})]),
         {"Accepted": ("False", "PolicyViolation")},
         message={"Accepted": "policy platform rule allowedSources: spec.source.uri s3://models/llama"},
         check=lambda o: "policy team rule allowedFormats" in o.status.conditions[0].message
         and o.status.effective.policies == ["team", "platform"]),
    Case("disjoint allowedFormats allow nothing: refused with both policies named",
         _set(policies=[baseline(allowedFormats=["nvfp4"]), policy("team", priority=10, rules={
             "allowedFormats": ["fp8-dynamic"]})]),
         {"Accepted": ("False", "PolicyViolation")},
         message={"Accepted": "policies team and platform conflict: rules.allowedFormats"}),
    Case("status.effective names the policy behind each value",
         _seq(_set(spec=base_spec(quantization={"format": "auto", "qualityGate": None}),
                   policies=[baseline(maxPerplexityIncreasePercent=2, maxReplicas=8),
                             policy("team", priority=10, rules={"maxReplicas": 20},
                                    defaults={"serving": {"replicas": 2}})]), lambda w: w.no_job()),
         {"Accepted": ("True", "Valid")}, actions=[ClaimArtifact, CreateJob, CreateService],
         message={"Accepted": "policies team, platform apply"},
         check=lambda o: _values(o)["spec.serving.replicas"] == ("2", "team")
         and _values(o)["rules.maxReplicas"] == ("8", "platform")
         and _values(o)["spec.quantization.qualityGate.maxPerplexityIncreasePercent"] == ("2.0", "platform")
         and o.status.autoscaling.policyMaxReplicas == 8),
    Case("a policy edit that changes the effective spec is an event on the model",
         _seq(_set(policies=[baseline(maxReplicas=8)]), _ready_world,
              _set(policies=[baseline(maxReplicas=4)])),
         {"Accepted": ("True", "Valid")}, events={"EffectiveSpecChanged"},
         check=lambda o: _values(o)["rules.maxReplicas"] == ("4", "platform")),
    Case("an S3 calibration object whose ETag was not read starts no Job (the key would not name the data)",
         _set(spec=base_spec(quantization={"format": "w4a16-gptq", "calibration": {"dataset": "s3://data/c.jsonl"}})),
         {"Quantized": ("False", "CalibrationDataUnavailable")},
         message={"Quantized": "spec.quantization.calibration.dataset"}, actions=[CreateService]),
    # ---- queueing (more in test_queueing.py)
    Case("a policy naming a Kueue LocalQueue: the Job is created suspended in it, the model says Queued",
         _seq(_set(policies=[policy(rules={"quantizationJob": {"kueue": {"localQueueName": "gpu"}}})]),
              lambda w: w.no_job()),
         {"Quantized": ("False", "Queued")}, actions=[ClaimArtifact, CreateJob, CreateService], events={"QuantizationStarted"},
         message={"Quantized": "suspended until Kueue admits it from LocalQueue gpu"},
         check=lambda o: o.actions[1].job["spec"]["suspend"] is True
         and o.actions[1].job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu"
         and o.status.artifacts[0].queue.reason == "Kueue" and o.status.artifacts[0].queue.position is None),
]
def _pod(o) -> dict[str, Any]:
    """The pod template of the Deployment a pass creates."""
    return next(a.deployment for a in o.actions if isinstance(a, CreateDeployment))["spec"]["template"]["spec"]


def _contract(job: dict[str, Any]) -> dict[str, Any]:
    env = job["spec"]["template"]["spec"]["containers"][0]["env"]
    return json.loads(next(e["value"] for e in env if e["name"] == "FEWERBITS_JOB_CONTRACT"))


def adapter_key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def _adapter_results(increase: dict[str, float], published: bool = False):
    """The published manifests' quality reports measured with the model's adapters (the Job's figures;
    ``published``: with the keys the Job published each adapter's files under)."""
    def build(w: World) -> None:
        gate = effective_for(w.observed(), SETTINGS).effective.gate()
        for key, facts in w.artifacts.items():
            q = facts.manifest.quality.model_copy(update={"evalIdentity": eval_identity(gate), "adapters": [
                AdapterQuality(name=n, baselinePerplexity=100.0, perplexity=100.0 * (1 + x / 100), increasePercent=x,
                               maxIncreasePercent=3.0, passed=x <= 3.0, windows=16, tokens=2032,
                               adapterKey=adapter_key(n) if published else None)
                for n, x in increase.items()]})
            w.artifacts[key] = replace(facts, manifest=facts.manifest.model_copy(update={"quality": q}))
    return build


# ---- LoRA adapters
PLAYS = {"name": "plays", "source": {"uri": "hf://org/plays-lora", "revision": "v1"}}
CASES += [
    Case("adapters whose configs fit: each pool holds them, each waits for its gate there; the base goes on",
         _seq(_set(spec=base_spec(adapters=[PLAYS]), adapters=(AdapterFacts("plays", 16, ("q_proj", "v_proj")),)),
              lambda w: w.no_job()),
         {"Quantized": ("False", "JobPending"), "AdaptersServed": ("False", "AwaitingAdapterGate")},
         actions=[ClaimArtifact, CreateJob, CreateService], message={"AdaptersServed": "plays"},
         check=lambda o: o.status.plan.variants[0].lora.maxLoraRank == 16
         and "--enable-lora" not in o.status.plan.variants[0].vllmArgs
         and [p.state for p in o.status.adapters[0].pools] == ["Pending"]),
    Case("an adapter whose config does not fit the base: AdaptersServed names its field",
         _seq(_set(spec=base_spec(adapters=[PLAYS]), adapter_problems={
             "plays": "spec.adapters[0].source: adapter_config.json: target_modules c_attn name no linear layer"}),
              lambda w: w.no_job()),
         {"Quantized": ("False", "JobPending"), "AdaptersServed": ("False", "AdapterInvalid")},
         actions=[ClaimArtifact, CreateJob, CreateService], message={"AdaptersServed": "spec.adapters[0].source"},
         check=lambda o: o.status.adapters[0].problem is not None and o.status.plan.variants[0].lora is None),
    Case("an adapter named as the model is served by default (its name) is refused, naming the field",
         _seq(_set(spec=base_spec(adapters=[{**PLAYS, "name": NAME}]),
                   adapters=(AdapterFacts(NAME, 16, ("q_proj",)),)), lambda w: w.no_job()),
         {"AdaptersServed": ("False", "AdapterInvalid")}, actions=[ClaimArtifact, CreateJob, CreateService],
         message={"AdaptersServed": "spec.adapters[0].name"}),
    Case("adapters added to a model whose artifact serves: an evaluation Job measures them, nothing re-quantizes",
         _seq(_set(spec=base_spec(adapters=[PLAYS]), adapters=(AdapterFacts("plays", 16, ("q_proj",)),)),
              lambda w: w.publish()),
         {"QualityGatePassed": ("True", "GatePassed"), "AdaptersServed": ("False", "AwaitingAdapterGate")},
         actions=[CreateJob, CreateDeployment, CreateService],
         check=lambda o: o.actions[0].job["metadata"]["name"].startswith("fewerbits-evaluate-")
         and [a["name"] for a in _contract(o.actions[0].job)["adapters"]] == ["plays"]
         and [a.name for a in QuantJobContract.model_validate(_contract(o.actions[0].job)).qualityGate.adapters]
         == ["plays"]
         and o.status.adapters[0].pools[0].state == "Pending"),
    Case("adapters measured on the base artifact: each judged with the model's threshold, a failure is an event",
         _seq(_set(spec=base_spec(adapters=[PLAYS, {**PLAYS, "name": "chat"}]),
                   adapters=(AdapterFacts("plays", 16, ("q_proj",)), AdapterFacts("chat", 8, ("q_proj",)))),
              lambda w: w.publish(), _adapter_results({"plays": 0.4, "chat": 6.3}, published=True)),
         {"QualityGatePassed": ("True", "GatePassed"), "AdaptersServed": ("False", "AdaptersJudged")},
         actions=[CreateDeployment, CreateService], events={"AdapterGateFailed"},
         message={"AdaptersServed": "refused by its gate: chat on h100-80gb-hbm3-x1 (+6.30%)"},
         check=lambda o: [p.state for s in o.status.adapters for p in s.pools] == ["Passed", "Failed"]
         and "above 5%" in o.status.adapters[1].pools[0].reason),
    Case("adapters published by the Job: the pool's pods fetch and load those that passed there, not the others",
         _seq(_set(spec=base_spec(adapters=[PLAYS, {**PLAYS, "name": "chat"}]),
                   adapters=(AdapterFacts("plays", 16, ("q_proj",)), AdapterFacts("chat", 8, ("q_proj",)))),
              lambda w: w.publish(), _adapter_results({"plays": 0.4, "chat": 6.3}, published=True)),
         {"AdaptersServed": ("False", "AdaptersJudged")}, actions=[CreateDeployment, CreateService],
         message={"AdaptersServed": "passed, not served: plays on h100-80gb-hbm3-x1 (+0.40%); refused by its gate: chat"},
         check=lambda o: _pod(o)["containers"][0]["command"][-9:] == [
             "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "2",
             "--lora-modules", f"plays=/adapters/{adapter_key('plays')}"]
         and _pod(o)["initContainers"][0]["args"][5:10] == ["--dest", f"/models/{_pod(o)['initContainers'][0]['args'][4]}",
                                                            "--adapter", adapter_key("plays"), "--adapters-dir"]
         and {"name": "adapters", "mountPath": "/adapters", "readOnly": True} in _pod(o)["containers"][0]["volumeMounts"]
         and [(p.served, p.adapterKey) for s in o.status.adapters for p in s.pools]
         == [(False, adapter_key("plays")), (False, adapter_key("chat"))]
         and "its pods are rolling out to load it" in o.status.adapters[0].pools[0].reason),
    Case("adapters no pool can hold: AdaptersNotPlanned with the figures, the base served without LoRA",
         _seq(_set(spec=base_spec(adapters=[PLAYS], serving={"maxModelLen": 4208, "minConcurrentSequences": 1024,
                                                              "canary": {"enabled": False}}),
                   adapters=(AdapterFacts("plays", 512, ("q_proj",)),)), lambda w: w.no_job()),
         {"Planned": ("True", "Planned"), "AdaptersServed": ("False", "AdaptersNotPlanned")},
         actions=[ClaimArtifact, CreateJob, CreateService], message={"AdaptersServed": "GiB per GPU"},
         check=lambda o: o.status.plan.variants[0].lora is None and o.status.plan.variants[0].adaptersRefused),
]
CASES[1].build = lambda w: None  # uses a long name: see test_decide_table


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_decide_table(case: Case):
    w = World()
    case.build(w)
    obs = w.observed()
    if case.id.startswith("name too long"):
        obs = replace(obs, name="x" * 41)
    out = decide(obs, SETTINGS)
    conds = {c.type: c for c in out.status.conditions}
    for type_, (status, reason) in case.conditions.items():
        c = conds[type_]
        assert (c.status, c.reason) == (status, reason), f"{type_}: {c.status} {c.reason}: {c.message}"
    for type_, text in case.message.items():
        assert text in conds[type_].message, conds[type_].message
    assert [type(a) for a in ordered(out.actions)] == case.actions
    assert case.events <= {e.reason for e in out.events}, out.events
    if case.check is not None:
        result = case.check(out)
        assert result is None or result, f"check failed: {out.status}"
    # Every pass writes all seven conditions (and AdaptersServed with adapters), each for the
    # generation it saw, at the observed time.
    assert [c.type for c in out.status.conditions] == list(CONDITION_TYPES) + [ADAPTERS_SERVED] * bool(w.spec.get("adapters"))
    assert all(c.observedGeneration == obs.generation for c in out.status.conditions)
    assert out.status.observedGeneration == obs.generation


def test_cases_cover_every_reason_the_operator_writes():
    from fewerbits_api.conditions import Reason

    seen: set[str] = set()
    for case in CASES:
        seen |= {r for _, r in case.conditions.values()}
    written = {v for k, v in vars(Reason).items() if k.isupper() and not k.startswith("CANARY_")}
    # The serving canary's reasons: test_canary.py::test_cases_cover_every_canary_reason.
    assert written - seen == set(), f"reasons no case produces: {sorted(written - seen)}"


def test_decide_is_pure_and_idempotent():
    """Same facts, same outcome; the outcome fed back as the old status decides no more changes."""
    w = World()
    w.publish()
    w.serve()
    first = decide(w.observed(), SETTINGS)
    assert decide(w.observed(), SETTINGS) == first
    w.status = first.status.to_wire()
    second = decide(w.observed(), SETTINGS)
    assert second.status.to_wire() == first.status.to_wire()
    assert second.actions == () and second.events == ()


def test_transition_times_come_from_the_observation_only():
    w = World()
    w.no_job()
    out = decide(w.observed(), SETTINGS)
    assert {c.lastTransitionTime for c in out.status.conditions} == {NOW}
    w.status = out.status.to_wire()
    later = replace(w.observed(), now="2026-11-23T13:00:00Z")
    assert {c.lastTransitionTime for c in decide(later, SETTINGS).status.conditions} == {NOW}


def test_deletes_run_before_creates():
    from fewerbits_operator.core.decide import CreateJob as CJ, DeleteDeployment as DD

    assert [type(a) for a in ordered((CJ({}), DD("n", "d"), CreateService({})))] == [DD, CJ, CreateService]


def test_a_failure_recorded_by_the_previous_status_shape_is_not_parsed():
    """Upgrade from wave 1's status (no artifacts[].failure, the failure only in the Quantized
    message): the message is never read back, so a Job is created once more."""
    w = World()
    w.no_job()
    w.status = {"observedGeneration": 1, "conditions": [Condition(
        type="Quantized", status="False", reason="JobFailed", lastTransitionTime=NOW, observedGeneration=1,
        message="fp8-dynamic: Job fewerbits-quantize-x failed: boom").to_wire()],
        "artifacts": [ArtifactStatus(key=w.planned()[2][0].key, uri="s3://x/", format="fp8-dynamic",
                                     job="fewerbits-quantize-x").to_wire()]}
    assert CreateJob in {type(a) for a in decide(w.observed(), SETTINGS).actions}


def test_the_wave1_status_shape_still_reads():
    """A status written by the previous operator (captured fixture) is read as the old status."""
    raw = json.loads((Path(__file__).parents[1] / "fixtures" / "status" / "captured-ready.json").read_text())
    status = QuantizedModelStatus.model_validate(raw["object"]["status"])
    assert status.artifacts and all(a.failure is None for a in status.artifacts)
    assert status.autoscaling is None and status.plan and status.plan.variants
    assert all(v.gpuMemoryUtilization == 0.9 for v in status.plan.variants)


def test_effective_spec_change_events_are_bounded():
    w = World(policies=[baseline(maxReplicas=8)])
    _ready_world(w)
    w.policies = [baseline(maxReplicas=4, maxGPUsPerReplica=2, requireRevisionPin=False, maxPerplexityIncreasePercent=9,
                           allowedSources=["s3://*"], allowedImages=["x/*"], allowedExtraArgs=["--max-num-seqs"],
                           extraArgsMode="Strict", allowedFormats=["fp8-dynamic"], requireQualityGate=True)]
    events = [e for e in decide(w.observed(), SETTINGS).events if e.reason == "EffectiveSpecChanged"]
    assert len(events) == 9 and events[-1].message.startswith("... and ")
    w.settle()
    assert [e for e in decide(w.observed(), SETTINGS).events if e.reason == "EffectiveSpecChanged"] == []
