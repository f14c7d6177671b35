"""Upgrades that do not re-quantize (issue 16, item 4): the tool versions are recorded in the
manifest, not hashed into the key; artifacts published under a legacy key (tool versions hashed
in) keep serving; `spec.quantization.requantize` is the only way to a new artifact made by newer
tools. Pure: keys, the legacy match, and ``decide`` on hand-built facts."""

from __future__ import annotations

from fewerbits_api.artifact import QUANTJOB_TOOL_VERSIONS, ArtifactKeyInputs, Manifest
from fewerbits_operator.artifacts.keys import legacy_candidates, outdated_tools, serves_planned
from fewerbits_operator.core.decide import CreateJob, ReplaceDeployment, decide
from fewerbits_operator.base.observed import ArtifactFacts
from fewerbits_operator.serving.render import Owner, render_deployment, render_service
from fewerbits_operator.base.settings import OperatorSettings
from fewerbits_api.quantizedmodel import QuantizedModelStatus

from tests.unit.test_decide import NAME, NS, SETTINGS, UID, World, base_spec, manifest

AWQ = dict(sourceUri="s3://models/llama", format="w4a16-awq", ignore=["lm_head"], calibrationDataset="general-en",
           calibrationDatasetHash="19e8bffa6d01312ed0d7485039835ab605d13d9ddcd2292dbdad44f034f40fac",
           calibrationSamples=512, calibrationMaxSeqLength=2048)
# Computed by the release that hashed the tool versions into every key (its artifact.py, unchanged
# inputs): a manifest it published must still verify, and its key must still be found.
LEGACY_AWQ_KEY = "27a4b8bdd497d1964f1f08f6e25be0c541ab4d4dc0493a9e8f21f5eb5f694698"


def test_a_new_key_names_no_tool_versions():
    ki = ArtifactKeyInputs(**AWQ)
    assert "tools" not in ki.canonical_json() and "rebuild" not in ki.canonical_json()
    assert ArtifactKeyInputs(**AWQ, tools={"llmcompressor": "9.9"}).key() != ki.key()


def test_a_legacy_key_hashes_as_the_release_that_made_it():
    legacy = ArtifactKeyInputs(**AWQ, tools=dict(QUANTJOB_TOOL_VERSIONS))
    assert legacy.key() == LEGACY_AWQ_KEY
    assert legacy.without_legacy_tools().key() == ArtifactKeyInputs(**AWQ).key()
    raw = Manifest(key=LEGACY_AWQ_KEY, keyInputs=legacy, format="w4a16-awq", files=[], totalBytes=0,
                   createdAt="2026-01-01T00:00:00Z").model_dump_json(by_alias=True)
    assert Manifest.parse(raw, LEGACY_AWQ_KEY).keyInputs.tools == QUANTJOB_TOOL_VERSIONS


def test_requantize_is_part_of_the_key_and_never_matches_a_legacy_artifact():
    w = World()
    (plain,) = w.planned()[2]
    w.spec = base_spec(quantization={"format": "auto", "requantize": "2026-11"})
    (again,) = w.planned()[2]
    assert again.inputs.rebuild == "2026-11" and again.key != plain.key
    legacy = legacy_manifest(plain)
    assert serves_planned(legacy, plain) and not serves_planned(legacy, again)
    # A current manifest under another key is never taken for the planned one.
    assert not serves_planned(manifest(again, 0.5), plain)


def legacy_manifest(planned) -> Manifest:
    inputs = planned.inputs.model_copy(update={"tools": dict(QUANTJOB_TOOL_VERSIONS)})
    m = manifest(planned, 0.5)
    return m.model_copy(update={"key": inputs.key(), "keyInputs": inputs})


def serving_legacy(w: World, key: str) -> None:
    """Deployments rolled out on the artifact under ``key`` (as the previous release left them)."""
    acc, the_plan, _ = w.planned()
    owner = Owner(NAME, NS, UID)
    for v in the_plan.variants:
        pool = next(p for p in w.pools if p.name == v.pool)
        d = render_deployment(owner, acc.spec, v, dict(pool.node_selector), pool.cc_str, key, 1000, 1, SETTINGS)
        d["metadata"].update(resourceVersion="5", generation=1)
        d["status"] = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}
        w.deployments[d["metadata"]["name"]] = d
    svc = render_service(owner)
    svc["metadata"]["ownerReferences"] = [{"uid": UID}]
    w.service = svc


def test_an_artifact_under_a_legacy_key_keeps_serving_after_the_upgrade():
    w = World()
    (planned,) = w.planned()[2]
    legacy = legacy_manifest(planned)
    w.status = {"observedGeneration": 1, "artifacts": [{"key": legacy.key, "uri": f"s3://artifacts/p/{legacy.key}/",
                                                        "format": planned.format.value, "job": "old-job"}]}
    assert legacy_candidates(QuantizedModelStatus.model_validate(w.status), planned) == [legacy.key]
    # observe found no manifest at the planned key and this one at the legacy key (serves_planned).
    w.artifacts[planned.key] = ArtifactFacts(manifest=legacy)
    serving_legacy(w, legacy.key)

    out = decide(w.observed(), SETTINGS)

    assert not [a for a in out.actions if isinstance(a, (CreateJob, ReplaceDeployment))]
    (art,) = out.status.artifacts
    assert art.key == legacy.key and art.job == "old-job" and art.tools == {"llmcompressor": "0.14.0.1"}
    conds = {c.type: c for c in out.status.conditions}
    assert conds["Quantized"].status == "True" and conds["Ready"].status == "True"


def test_other_tool_versions_in_the_image_are_said_not_acted_on():
    w = World()
    w.publish()
    w.settle()
    newer = OperatorSettings(_env_file=None, quantjob_tools={"llmcompressor": "0.15.0", "transformers": "5.17.0"})
    out = decide(w.observed(), newer)
    assert not [a for a in out.actions if isinstance(a, CreateJob)]
    msg = {c.type: c for c in out.status.conditions}["Quantized"].message
    assert "made with llmcompressor 0.14.0.1, the quantization image has llmcompressor 0.15.0" in msg
    assert "spec.quantization.requantize" in msg
    (planned,) = w.planned()[2]
    assert outdated_tools(manifest(planned, 0.5), dict(QUANTJOB_TOOL_VERSIONS)) == {}


def test_asking_for_requantization_starts_one_job_and_keeps_serving():
    w = World()
    w.publish()
    w.serve()
    w.settle()
    w.spec = base_spec(quantization={"format": "auto", "requantize": "tools-2026-11"})
    w.generation = 2
    w.no_job()
    out = decide(w.observed(), SETTINGS)
    (job,) = [a for a in out.actions if isinstance(a, CreateJob)]
    assert not [a for a in out.actions if isinstance(a, ReplaceDeployment)]  # the old artifact serves meanwhile
    (art,) = out.status.artifacts
    assert job.job["metadata"]["annotations"]["fewerbits.io/artifact-key"] == art.key
