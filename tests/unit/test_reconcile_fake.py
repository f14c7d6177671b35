"""A whole reconcile (observe → decide → execute) against in-memory fakes of the API server and
object storage: what it reads, what it writes, in which order, and that a second pass over the
same world writes nothing. The real control plane runs the same code in tests/integration."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from fewerbits_api.artifact import Manifest, QualityReport
from fewerbits_operator.core.execute import StatusConflict
from fewerbits_operator.planner import pool_from_product
from fewerbits_operator.runtime.reconcile import Reconciler
from fewerbits_operator.base.settings import OperatorSettings
from fewerbits_operator.base.storage import ModelConfigError

CONFIG = json.loads((Path(__file__).parent / "fixtures" / "model_configs" / "llama-3.2-1b.json").read_text())
NS, NAME = "team", "m"
SECRET_VALUE = "s3cr3t-value-never-shown"


def node(pool) -> dict[str, Any]:
    return {"metadata": {"name": "n1", "labels": dict(pool.common_labels)},
            "status": {"allocatable": {"nvidia.com/gpu": "1"},
                       "conditions": [{"type": "Ready", "status": "True"}]}}


class FakeKube:
    """The Kube verbs reconcile uses, over dicts; records every write in order."""

    def __init__(self):
        self.model = {"apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizedModel",
                      "metadata": {"name": NAME, "namespace": NS, "uid": "uid-m", "generation": 1,
                                   "resourceVersion": "1"},
                      "spec": {"source": {"uri": "s3://models/llama", "credentialsSecret": "s3"},
                               "quantization": {"format": "fp8-dynamic"},
                               "storage": {"uri": "s3://artifacts/p", "credentialsSecret": "s3"},
                               "serving": {"canary": {"enabled": False}},
                               "autoscaling": {"enabled": False}}}
        self.secrets = {"s3": {"AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": SECRET_VALUE}}
        self.nodes = [node(pool_from_product("NVIDIA-H100-80GB-HBM3", 1))]
        self.jobs: dict[str, dict] = {}
        self.deployments: dict[str, dict] = {}
        self.services: dict[str, dict] = {}
        self.writes: list[tuple[str, str]] = []
        self.events: list[tuple[str, str, str]] = []
        self.reads: list[str] = []
        self.conflict_next_status = False

    # reads
    def get_model(self, namespace, name):
        return copy.deepcopy(self.model)

    def namespace_labels(self, namespace):
        return {"kubernetes.io/metadata.name": namespace}

    def list_policies(self):
        return []

    def list_nodes(self):
        return copy.deepcopy(self.nodes)

    def secret_data(self, namespace, name):
        self.reads.append(f"secret/{name}")
        return dict(self.secrets[name]) if name in self.secrets else None

    def get_job(self, namespace, name):
        return copy.deepcopy(self.jobs.get(name))

    def job_pods(self, namespace, job_name):
        return []

    def list_managed_jobs(self, namespaces):  # the cap on running quantization Jobs
        return [copy.deepcopy(j) for j in self.jobs.values()]

    def list_models_where(self, namespaces, where):
        return [copy.deepcopy(m) for m in [self.model] if where(m)]

    def list_pods(self, namespace, selector):
        self.reads.append(f"pods/{selector}")
        return []

    def list_deployments(self, namespace, selector):
        want = dict(term.split("=", 1) for term in selector.split(","))
        return [copy.deepcopy(d) for d in self.deployments.values()
                if want.items() <= (d["metadata"].get("labels") or {}).items()]

    def get_service(self, namespace, name):
        return copy.deepcopy(self.services.get(name))

    # writes
    def create(self, body):
        kind, name = body["kind"], body["metadata"]["name"]
        store = {"Job": self.jobs, "Deployment": self.deployments, "Service": self.services}[kind]
        self.writes.append((f"create {kind}", name))
        if name in store:
            return None
        store[name] = copy.deepcopy(body)
        return body

    def add_owner(self, kind, namespace, name, owner_refs):
        self.writes.append(("owner Job", name))

    def replace_deployment(self, body):
        self.writes.append(("replace Deployment", body["metadata"]["name"]))
        self.deployments[body["metadata"]["name"]] = copy.deepcopy(body)
        return True

    def delete_deployment(self, namespace, name):
        self.writes.append(("delete Deployment", name))
        self.deployments.pop(name, None)

    def patch_service(self, namespace, name, patch):
        self.writes.append(("patch Service", name))

    def patch_model_status(self, namespace, name, patch, resource_version=None):
        if self.conflict_next_status:
            self.conflict_next_status = False
            return False
        assert resource_version == self.model["metadata"]["resourceVersion"]
        self.writes.append(("status", name))
        status = dict(self.model.get("status") or {})
        for k, v in patch.items():
            if v is None:
                status.pop(k, None)
            else:
                status[k] = v
        self.model["status"] = status
        self.model["metadata"]["resourceVersion"] = str(int(self.model["metadata"]["resourceVersion"]) + 1)
        return True

    def post_event(self, obj, type_, reason, message):
        self.events.append((type_, reason, message))


class FakeStore:
    def __init__(self):
        self.manifests: dict[str, Manifest] = {}
        self.config_error: str | None = None

    def model_config(self, source, secret, hf_endpoint):
        assert secret and secret["AWS_SECRET_ACCESS_KEY"] == SECRET_VALUE  # credentials reach the read
        if self.config_error:
            raise ModelConfigError(self.config_error)
        return dict(CONFIG)

    def get_manifest(self, storage, key, creds):
        return self.manifests.get(key)

    claims: dict[str, bytes] = {}

    def get_claim(self, storage, key, creds):
        return key in self.claims, self.claims.get(key)

    def put_claim(self, storage, key, creds, body, take_over):
        if key in self.claims and not take_over:
            return False
        self.claims = {**self.claims, key: body}
        return True


@pytest.fixture
def world():
    kube, store = FakeKube(), FakeStore()
    return kube, store, Reconciler(kube, store, OperatorSettings(_env_file=None, resync_seconds=30))


def conditions(kube) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in kube.model["status"]["conditions"]}


def publish(store, kube) -> None:
    (job,) = kube.jobs.values()
    contract = next(e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]
                    if e["name"] == "FEWERBITS_JOB_CONTRACT")
    key = json.loads(contract)["key"]
    inputs = json.loads(contract)["keyInputs"]
    store.manifests[key] = Manifest.model_validate({
        "key": key, "keyInputs": inputs, "format": "fp8-dynamic", "files": [], "totalBytes": 10,
        "quality": QualityReport(baselinePerplexity=10, perplexity=10.1, increasePercent=1, maxIncreasePercent=3,
                                 passed=True, evalDataset="x", evalWindows=2, evalTokens=100).model_dump(),
        "createdAt": "2026-11-23T00:00:00Z"})


def test_fresh_model_creates_its_job_and_service_then_writes_nothing_at_rest(world):
    kube, store, rec = world
    rec.reconcile(NS, NAME)
    assert kube.writes == [("create Job", next(iter(kube.jobs))), ("create Service", NAME), ("status", NAME)]
    assert conditions(kube)["Quantized"] == ("False", "JobPending")
    assert {r for _, r, _ in kube.events} >= {"QuantizationStarted"}
    kube.writes.clear()
    kube.events.clear()
    rec.reconcile(NS, NAME)
    assert kube.writes == [] and kube.events == []  # at rest: the Job exists (pending), nothing changed


def test_published_artifact_rolls_out_and_secret_values_never_reach_status_or_events(world):
    kube, store, rec = world
    rec.reconcile(NS, NAME)
    publish(store, kube)
    kube.jobs.clear()  # its TTL
    rec.reconcile(NS, NAME)
    assert ("create Deployment", f"{NAME}-h100-80gb-hbm3-x1") in kube.writes
    assert conditions(kube)["QualityGatePassed"] == ("True", "GatePassed")
    text = json.dumps([kube.model, kube.events, kube.deployments, kube.jobs])
    assert SECRET_VALUE not in text and "s3cr3t" not in text


def test_a_status_conflict_observes_again(world):
    kube, store, rec = world
    kube.conflict_next_status = True
    rec.reconcile(NS, NAME)
    assert conditions(kube)["Accepted"] == ("True", "Valid")
    assert [w for w in kube.writes if w[0] == "status"] == [("status", NAME)]


def test_pods_are_listed_only_for_variants_short_of_ready(world):
    kube, store, rec = world
    rec.reconcile(NS, NAME)
    publish(store, kube)
    rec.reconcile(NS, NAME)
    (dep,) = kube.deployments.values()
    dep["status"] = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "observedGeneration": 1}
    dep["metadata"]["generation"] = 1
    kube.reads.clear()
    rec.reconcile(NS, NAME)
    assert conditions(kube)["Ready"] == ("True", "AllVariantsReady")
    assert not [r for r in kube.reads if r.startswith("pods/")]
    dep["status"]["readyReplicas"] = 0
    rec.reconcile(NS, NAME)
    assert [r for r in kube.reads if r.startswith("pods/")]


def test_missing_secret_reads_nothing_further(world):
    kube, store, rec = world
    kube.secrets.clear()
    rec.reconcile(NS, NAME)
    assert conditions(kube)["Accepted"] == ("False", "MissingSecret")
    assert kube.writes == [("status", NAME)]


def test_unreadable_config_keeps_this_generations_plan(world):
    kube, store, rec = world
    rec.reconcile(NS, NAME)
    store.config_error = "AccessDenied reading config.json"
    rec.reconcile(NS, NAME)
    c = next(c for c in kube.model["status"]["conditions"] if c["type"] == "Planned")
    assert c["status"] == "True" and "kept from an earlier pass" in c["message"]


def test_conflicts_three_times_in_a_row_raise(world):
    kube, store, rec = world

    def always_conflict(*a, **k):
        return False
    kube.patch_model_status = always_conflict
    with pytest.raises(StatusConflict):
        rec.reconcile(NS, NAME)
