"""LoRA adapters in the serving pods (issue 43, docs/adapters.md): which published files each pool
loads, how the pod fetches and mounts them in each load mode, that the node cache and retention
keep them, and that the launcher holds them in use while vLLM runs."""

from __future__ import annotations

import hashlib

from fewerbits_api.adapters import AdapterPoolStatus, AdapterQuality, AdapterStatus, LoraPlan
from fewerbits_api.artifact import QualityReport
from fewerbits_api.formats import QuantFormat
from fewerbits_api.quantizedmodel import PlanStatus, QuantizedModelStatus
from fewerbits_operator.core.adapters import AdapterInputs, adapters_step, served_on
from fewerbits_operator.core.retention import referenced_keys
from fewerbits_operator.planner.lora import AdapterFacts
from fewerbits_operator.serving.render import render_deployment
from fewerbits_operator.serving.serving_load import ServedAdapter
from fewerbits_runtime.launch import lora_paths
from tests.unit.test_render import OWNER, SETTINGS, SPEC, VARIANT

A, B, PLAYS_KEY = "a" * 64, "b" * 64, hashlib.sha256(b"plays").hexdigest()
LORA = LoraPlan(adapters=["plays"], maxLoras=1, maxLoraRank=8, maxCpuLoras=1, gpuMemoryGiB=0.1)


def _report(key: str | None, increase: float = 0.5) -> QualityReport:
    return QualityReport(baselinePerplexity=10, perplexity=10, increasePercent=0, maxIncreasePercent=5, passed=True,
                         evalDataset="general-en-heldout", evalWindows=8, evalTokens=800, evalIdentity="id", adapters=[
                             AdapterQuality(name="plays", baselinePerplexity=50, perplexity=50 * (1 + increase / 100),
                                            increasePercent=increase, maxIncreasePercent=3, passed=True, adapterKey=key)])


def _inputs(reports: dict[str, QualityReport | None], old=(), loaded=None) -> AdapterInputs:
    """Two pools: w4a16-gptq on the A100s (artifact A), 16-bit on the H100s (no Job, no report)."""
    sixteen = VARIANT.model_copy(update={"pool": "h100", "format": QuantFormat.NONE, "lora": LORA})
    plan = PlanStatus(variants=[VARIANT.model_copy(update={"lora": LORA}), sixteen])
    from fewerbits_api.adapters import AdapterEvaluation, AdapterSpec

    return AdapterInputs(
        adapters=[AdapterSpec.model_validate({"name": "plays", "source": {"uri": "s3://adapters/plays"}})], plan=plan,
        evaluations=(AdapterEvaluation(name="plays", uri="s3://adapters/plays", evalDataset="general-en-heldout",
                                       evalSamples=8, maxIncreasePercent=3.0),),
        facts=(AdapterFacts("plays", 8, ("q_proj",)),), problems={}, served_name="llama", identity="id",
        artifact_keys={VARIANT.pool: A, "h100": B}, reports=reports, old=list(old), loaded=loaded or {})


def test_a_16_bit_pool_loads_the_files_another_pools_job_published():
    out = adapters_step(_inputs({A: _report(PLAYS_KEY), B: None}))
    (plays,) = out.statuses
    assert [(p.state, p.served, p.adapterKey) for p in plays.pools] == [("Passed", True, PLAYS_KEY)] * 2
    assert out.condition[0] is True and "served: plays on a100-sxm4-80gb-x8 (+0.50%), plays on h100" in out.condition[2]
    assert served_on(out.statuses, "h100") == (ServedAdapter("plays", PLAYS_KEY),)


def test_an_adapter_judged_but_not_published_is_not_served_and_the_condition_says_so():
    out = adapters_step(_inputs({A: _report(None), B: None}))  # a report from a Job before publication
    assert [(p.state, p.served) for p in out.statuses[0].pools] == [("Passed", False)] * 2
    assert out.condition[0] is False and "passed, not served" in out.condition[2]
    assert "did not publish adapters (an older release): measured again" in out.statuses[0].pools[0].reason
    assert "no Job has published its files yet" in out.statuses[0].pools[1].reason
    assert served_on(out.statuses, VARIANT.pool) == ()
    # ... and such a report asks for the evaluation Job that publishes them (an upgrade is no dead end).
    from fewerbits_api.adapters import AdapterEvaluation
    from fewerbits_api.quality import eval_identity
    from fewerbits_api.quantizedmodel import QualityGateSpec
    from fewerbits_operator.artifacts.quality_gate import needs_evaluation

    gate = QualityGateSpec().with_adapters([AdapterEvaluation(name="plays", uri="s3://adapters/plays",
                                                              evalDataset="general-en-heldout", evalSamples=8,
                                                              maxIncreasePercent=3.0)])
    older = _report(None).model_copy(update={"evalIdentity": eval_identity(gate)})
    assert needs_evaluation(older, gate)
    assert not needs_evaluation(_report(PLAYS_KEY).model_copy(update={"evalIdentity": eval_identity(gate)}), gate)


def test_a_failed_adapter_is_never_loaded_even_with_its_files_published():
    out = adapters_step(_inputs({A: _report(PLAYS_KEY, increase=7.0), B: None}))
    a100, h100 = out.statuses[0].pools
    assert (a100.state, a100.served, h100.state, h100.served) == ("Failed", False, "Passed", True)
    assert served_on(out.statuses, VARIANT.pool) == () and out.failed
    assert a100.adapterKey == PLAYS_KEY  # named whatever the verdict: retention keeps the files a new threshold may pass


def test_while_the_adapters_are_measured_again_the_files_that_passed_keep_serving():
    """Adding an adapter (or changing one, or the evaluation set) changes the evaluation identity:
    until the new report, each pool keeps loading what passed there, so nothing rolls twice."""
    served = adapters_step(_inputs({A: _report(PLAYS_KEY), B: None})).statuses
    loads = {pool: frozenset({f"plays=/adapters/{PLAYS_KEY}"}) for pool in (VARIANT.pool, "h100")}
    remeasured = adapters_step(_inputs({A: _report(PLAYS_KEY).model_copy(update={"evalIdentity": "older"}), B: None},
                                       old=served, loaded=loads))
    assert [(p.state, p.served, p.adapterKey) for p in remeasured.statuses[0].pools] == \
        [("Pending", True, PLAYS_KEY), ("Passed", True, PLAYS_KEY)]
    assert "serve meanwhile" in remeasured.statuses[0].pools[0].reason
    assert remeasured.condition[1] == "AwaitingAdapterGate"
    # Never the files of another base: a pool whose artifact changed waits for its own verdict.
    moved = [s.model_copy(update={"pools": [p.model_copy(update={"artifactKey": "c" * 64}) for p in s.pools]})
             for s in served]
    fresh = adapters_step(_inputs({A: None, B: None}, old=moved, loaded=loads)).statuses[0].pools
    assert [p.served for p in fresh] == [False, False]


def test_served_is_what_the_rolled_out_pods_load():
    from fewerbits_operator.core.adapters import confirm_served

    statuses = adapters_step(_inputs({A: _report(PLAYS_KEY), B: None})).statuses
    loaded = {VARIANT.pool: frozenset({f"plays=/adapters/{PLAYS_KEY}"}), "h100": frozenset()}
    a100, h100 = confirm_served(statuses, loaded, frozenset({VARIANT.pool, "h100"}), [])[0].pools
    assert a100.served and not h100.served and "rolling out to load it" in h100.reason


def test_two_adapters_of_the_same_files_are_fetched_and_mounted_once():
    spec = SPEC.model_copy(update={"serving": SPEC.serving.model_copy(update={"artifactCache": "Node"})})
    pod = _pod(spec, (ServedAdapter("chat", PLAYS_KEY), ServedAdapter("plays", PLAYS_KEY)))
    args = pod["initContainers"][0]["args"]
    assert args.count("--adapter") == 1
    mounts = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"]]
    assert len(mounts) == len(set(mounts))
    command = pod["containers"][0]["command"]
    assert f"chat=/adapters/{PLAYS_KEY}" in command and f"plays=/adapters/{PLAYS_KEY}" in command


def test_an_adapters_manifest_must_list_the_files_its_key_names():
    import json

    import pytest

    from fewerbits_api.artifact import Manifest, ManifestError, ManifestFile, adapter_key_inputs
    from fewerbits_api.formats import QuantFormat as F

    inputs = adapter_key_inputs("s3://adapters/plays", None, {"adapter_model.safetensors": "1" * 64})
    files = [ManifestFile(path="adapter_model.safetensors", sizeBytes=9, sha256="2" * 64)]
    forged = Manifest(key=inputs.key(), keyInputs=inputs, format=F.NONE, files=files, totalBytes=9, createdAt="x")
    with pytest.raises(ManifestError, match="other than the ones its key names"):
        Manifest.parse(json.dumps(forged.to_wire()), inputs.key())
    good = forged.model_copy(update={"files": [files[0].model_copy(update={"sha256": "1" * 64})]})
    assert Manifest.parse(json.dumps(good.to_wire()), inputs.key()).key == inputs.key()


def _pod(spec, adapters):
    return render_deployment(OWNER, spec, VARIANT.model_copy(update={"lora": LORA}), {}, "8.0", A, 2**30, 1, SETTINGS,
                             adapters)["spec"]["template"]["spec"]


def test_node_cache_pods_fetch_adapters_into_the_cache_and_mount_each_read_only():
    spec = SPEC.model_copy(update={"serving": SPEC.serving.model_copy(update={"artifactCache": "Node"})})
    pod = _pod(spec, (ServedAdapter("plays", PLAYS_KEY),))
    args = pod["initContainers"][0]["args"]
    assert args[args.index("--adapter") + 1] == PLAYS_KEY and "--adapters-dir" not in args and "--node-cache" in args
    mount = {"name": "models", "mountPath": f"/adapters/{PLAYS_KEY}", "subPath": f"artifacts/{PLAYS_KEY}",
             "readOnly": True}
    assert mount in pod["containers"][0]["volumeMounts"] and not any(v["name"] == "adapters" for v in pod["volumes"])
    assert f"plays=/adapters/{PLAYS_KEY}" in pod["containers"][0]["command"]


def test_a_pool_without_lora_buffers_or_adapters_renders_no_lora_at_all():
    plain = render_deployment(OWNER, SPEC, VARIANT, {}, "8.0", A, 2**30, 1, SETTINGS)["spec"]["template"]["spec"]
    for pod in (plain, _pod(SPEC, ()),
                render_deployment(OWNER, SPEC, VARIANT, {}, "8.0", A, 2**30, 1, SETTINGS,  # no LoRA in this plan
                                  (ServedAdapter("plays", PLAYS_KEY),))["spec"]["template"]["spec"]):
        assert "--enable-lora" not in pod["containers"][0]["command"]
        assert "--adapter" not in pod["initContainers"][0]["args"]
        assert not any(v["name"] == "adapters" for v in pod["volumes"])


def test_retention_and_the_node_cache_keep_the_adapters_a_status_names():
    pool = AdapterPoolStatus(variant="h100", state="Passed", adapterKey=PLAYS_KEY, served=True)
    status = QuantizedModelStatus(adapters=[AdapterStatus(name="plays", pools=[pool])])
    assert PLAYS_KEY in referenced_keys([status])


def test_the_launcher_holds_every_adapter_vllm_loads():
    cmd = ["vllm", "serve", "/models/k", "--lora-modules", "a=/adapters/x", "b=/adapters/y", "--max-loras", "2",
           "--lora-modules=c=/adapters/z"]
    assert lora_paths(cmd) == ["/adapters/x", "/adapters/y", "/adapters/z"]
    assert lora_paths(["vllm", "serve", "/models/k"]) == []


def test_a_scale_change_or_a_pending_remeasure_never_drops_what_a_pool_loads():
    """Confirmation and keeping read what the pool's object loads, rolled out or not: a scale-up
    (the object briefly not rolled out) keeps a confirmed adapter served, and a re-measure keeps
    the files the object loads, so the pool never rolls to drop them and back."""
    from fewerbits_operator.core.adapters import confirm_served

    statuses = adapters_step(_inputs({A: _report(PLAYS_KEY), B: None})).statuses
    loads = {VARIANT.pool: frozenset({f"plays=/adapters/{PLAYS_KEY}"}), "h100": frozenset({f"plays=/adapters/{PLAYS_KEY}"})}
    confirmed = confirm_served(statuses, loads, frozenset({VARIANT.pool, "h100"}), [])
    scaling = confirm_served(statuses, loads, frozenset(), confirmed)  # neither object rolled out this instant
    assert [p.served for p in scaling[0].pools] == [True, True]
    first = confirm_served(statuses, loads, frozenset(), [])  # never confirmed: not yet
    assert [p.served for p in first[0].pools] == [False, False]
    unconfirmed = [s.model_copy(update={"pools": [p.model_copy(update={"served": False}) for p in s.pools]})
                   for s in confirmed]  # the last pass saw them rolling out
    stale = _report(PLAYS_KEY).model_copy(update={"evalIdentity": "older"})
    again = adapters_step(_inputs({A: stale, B: None}, old=unconfirmed, loaded=loads))
    assert served_on(again.statuses, VARIANT.pool) == (ServedAdapter("plays", PLAYS_KEY),)
