"""The operator's side of `auto` calibration's two keys (issue 47): it plans the Hub set's key; a
model whose own Job could not read the Hub (and so published under the fallback's key,
fewerbits_api.artifact.auto_fallback_inputs) serves the fallback's artifact, and keeps serving it
from its status once the Job is gone; a later model with the same inputs runs a Job of its own,
which asks the Hub again, instead of taking the offline artifact for the Hub set's; and once the
Hub set's artifact is published, the model moves to it; the serving canary judges the fallback's
artifact under the key it is served at. Whole reconciles over the in-memory fakes of
tests/unit/test_reconcile_fake.py."""

from __future__ import annotations

import json

from fewerbits_api.artifact import ArtifactKeyInputs, Manifest, QualityReport, auto_fallback_inputs
from fewerbits_operator.artifacts.keys import PlannedArtifact, fallback_key, serves_planned
from fewerbits_operator.base.settings import OperatorSettings
from fewerbits_operator.runtime.reconcile import Reconciler
from tests.unit.test_reconcile_fake import NAME, NS, FakeKube, FakeStore, conditions

GPTQ = {"format": "w4a16-gptq"}  # calibrates; `auto` calibration data by default


def _world(store: FakeStore | None = None):
    kube, store = FakeKube(), store or FakeStore()
    kube.model["spec"]["quantization"] = dict(GPTQ)
    return kube, store, Reconciler(kube, store, OperatorSettings(_env_file=None, resync_seconds=30))


def _job_inputs(kube) -> ArtifactKeyInputs:
    (job,) = kube.jobs.values()
    contract = next(e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]
                    if e["name"] == "FEWERBITS_JOB_CONTRACT")
    return ArtifactKeyInputs.model_validate(json.loads(contract)["keyInputs"])


def _publish(store, inputs: ArtifactKeyInputs) -> str:
    store.manifests[inputs.key()] = Manifest(
        key=inputs.key(), keyInputs=inputs, format=inputs.format, files=[], totalBytes=10,
        quality=QualityReport(baselinePerplexity=10, perplexity=10.1, increasePercent=1, maxIncreasePercent=3,
                              passed=True, evalDataset="x", evalWindows=2, evalTokens=100),
        createdAt="2026-11-23T00:00:00Z")
    return inputs.key()


def _succeeded(kube) -> None:
    for job in kube.jobs.values():
        job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}


def _artifact_keys(kube) -> list[str]:
    return [a["key"] for a in kube.model["status"]["artifacts"]]


def test_fallback_key_is_read_only_where_the_models_own_job_published_it():
    kube, store, rec = _world()
    rec.reconcile(NS, NAME)
    hub = _job_inputs(kube)
    assert hub.calibrationDataset == "auto" and fallback_key(PlannedArtifact(hub.format, hub, ("p",)))
    offline = _publish(store, auto_fallback_inputs(hub))  # what the Job did without the Hub
    rec.reconcile(NS, NAME)  # the Job still runs: nothing at the planned key, the fallback not read
    assert _artifact_keys(kube) == [hub.key()] and conditions(kube)["Quantized"][0] == "False"

    _succeeded(kube)
    rec.reconcile(NS, NAME)
    assert _artifact_keys(kube) == [offline] and conditions(kube)["Quantized"][0] == "True"
    assert [s["artifactKey"] for s in kube.model["status"]["serving"]] == [offline]
    kube.jobs.clear()  # its TTL: the status remembers the fallback's key
    rec.reconcile(NS, NAME)
    assert _artifact_keys(kube) == [offline] and not kube.jobs

    # A later model with the same inputs asks the Hub again: a Job of its own, not a cache hit.
    later, _, later_rec = _world(store)
    later_rec.reconcile(NS, NAME)
    assert len(later.jobs) == 1 and conditions(later)["Quantized"] == ("False", "JobPending")
    assert _job_inputs(later) == hub

    # The Hub set's artifact published (by any Job that reached the Hub): the first model moves to it.
    _publish(store, hub)
    for d in kube.deployments.values():
        d["metadata"]["resourceVersion"] = "7"  # as the API server returns it
    kube.writes.clear()
    rec.reconcile(NS, NAME)
    assert _artifact_keys(kube) == [hub.key()]
    assert ("replace Deployment", f"{NAME}-h100-80gb-hbm3-x1") in kube.writes


def test_serves_planned_takes_exactly_this_plans_fallback():
    kube, store, rec = _world()
    rec.reconcile(NS, NAME)
    hub = _job_inputs(kube)
    planned = PlannedArtifact(hub.format, hub, ("p",))
    fallback = auto_fallback_inputs(hub)

    def manifest(inputs):
        return Manifest(key=inputs.key(), keyInputs=inputs, format=inputs.format, files=[], totalBytes=0,
                        createdAt="2026-11-23T12:00:00Z")

    assert serves_planned(manifest(fallback), planned)
    assert not serves_planned(manifest(fallback.model_copy(update={"calibrationSamples": 16})), planned)
    assert not serves_planned(manifest(hub.model_copy(update={"calibrationDatasetHash": "0" * 64})), planned)


class RecordingStore(FakeStore):
    """FakeStore that also answers the serving canary's verdict reads (none stored) and records them."""

    def __init__(self):
        super().__init__()
        self.verdict_reads: list[str] = []

    def get_serving_result(self, storage, key, config_hash, creds):
        self.verdict_reads.append(key)
        return None


def test_the_canary_judges_the_fallback_artifact_under_the_key_it_is_served_at():
    """With the canary on (the default), the served configuration of a fallback artifact is hashed
    with its own key by decide; observe reads the verdict under that same key, else the canary would
    be wanted again on every pass."""
    store = RecordingStore()
    kube, store, rec = _world(store)
    kube.model["spec"]["serving"] = {"canary": {"enabled": True}}
    rec.reconcile(NS, NAME)
    offline = _publish(store, auto_fallback_inputs(_job_inputs(kube)))
    _succeeded(kube)
    rec.reconcile(NS, NAME)
    assert _artifact_keys(kube) == [offline]
    assert store.verdict_reads and set(store.verdict_reads) == {offline}
    canaries = [d for d in kube.deployments.values() if "canary" in d["metadata"]["name"]]
    assert len(canaries) == 1 and canaries[0]["metadata"]["annotations"]["fewerbits.io/artifact-key"] == offline
