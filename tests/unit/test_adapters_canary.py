"""Issue 43: the serving canary measures each adapter published for its pool through vLLM (pure parts).

The canary pod loads every adapter a Job published for its pool, and its verdict judges each
(its perplexity served through vLLM against the same adapter on the 16-bit base as the Job
measured it); an adapter refused there, or not measured there, is not loaded on that pool, and the
variant rolls out with the base and the adapters that passed. The published adapters are part of
the served configuration's hash, so new files are measured on a canary before they serve.
"""

from __future__ import annotations

import json

from fewerbits_api.adapters import AdapterEvaluation, AdapterQuality
from fewerbits_api.artifact import QualityReport
from fewerbits_api.canary import ServingMetric, ServingQualityResult, SkippedMetric
from fewerbits_api.quantizedmodel import QualityGateSpec
from fewerbits_operator.core.adapters import adapters_step, served_on
from fewerbits_operator.serving import canary as K
from fewerbits_operator.serving.render import lora_modules_in
from fewerbits_operator.serving.serving_load import ServedAdapter
from tests.unit.test_adapters_serving import A, B, PLAYS_KEY, VARIANT, _inputs, _report


def _metric(name: str, kind: str, base: float, served: float, max_increase: float) -> ServingMetric:
    return ServingMetric(name=name, kind=kind, base=base, served=served, recoveryPercent=base / served * 100,
                         minRecoveryPercent=100 / (1 + max_increase / 100), passed=served / base - 1 <= max_increase / 100,
                         higherIsBetter=False, samples=8, method="prompt_logprobs")


def _result(*metrics: ServingMetric, skipped=()) -> ServingQualityResult:
    return ServingQualityResult(key=A, configHash="c" * 32, variant="h100", kvCacheDtype="auto",
                                passed=all(m.passed for m in metrics), metrics=list(metrics), skipped=list(skipped))


BASE_OK = _metric("perplexity", "perplexity", 10.0, 10.1, 3.0)
SOUND_OK = _metric("adapter:sound", "adapter", 20.0, 20.02, 3.0)
DAMAGED = _metric("adapter:damaged", "adapter", 20.0, 20.4, 0.6)


def _with(inp, **changes):
    return inp.__class__(**{**inp.__dict__, **changes})


def test_each_adapter_is_judged_again_with_the_threshold_it_has_now():
    r = _result(BASE_OK, SOUND_OK, DAMAGED, skipped=[SkippedMetric(name="adapter:late", reason="its evaluation set: gone")])
    judged = K.adapter_verdicts(r, {"sound": 3.0, "damaged": 0.6})
    assert judged["sound"].passed and not judged["damaged"].passed and judged["damaged"].measured
    assert "+2.00%, max +0.6%" in judged["damaged"].why and "served through vLLM" in judged["damaged"].why
    assert not judged["late"].measured and judged["late"].why == "its evaluation set: gone"
    # A threshold raised since the verdict lifts the refusal without another canary.
    assert K.adapter_verdicts(r, {"damaged": 3.0})["damaged"].passed
    assert K.base_passed(r) and not r.passed
    # The adapters' figures never stand for the base's: no base metric, no pass.
    assert not K.base_passed(_result(SOUND_OK)) and not K.base_passed(_result(_metric("perplexity", "perplexity", 10, 12, 3)))
    assert K.adapter_verdicts(None, {}) == {}


def test_the_adapters_published_for_a_pool_are_its_own_reports_or_for_16_bit_the_one_key_all_agree_on():
    def report(**keys):
        return QualityReport(baselinePerplexity=10, perplexity=10, increasePercent=0, maxIncreasePercent=5, passed=True,
                             evalDataset="general-en-heldout", evalWindows=8, evalTokens=800, adapters=[
                                 AdapterQuality(name=n, maxIncreasePercent=3, passed=False, adapterKey=k)
                                 for n, k in keys.items()])
    own = report(sound=A, damaged=B)  # refused or not, published files are measured on the canary
    assert K.published_adapters(["sound", "damaged", "late"], False, own, []).keys == {"sound": A, "damaged": B}
    assert K.published_adapters(["sound"], False, None, [own]) == K.Published()  # a quantized pool waits for its Job
    assert K.published_adapters(["sound", "damaged"], True, None, [own, report(sound=A)]).keys == \
        {"sound": A, "damaged": B}
    assert K.published_adapters(["sound"], True, None, [own, report(sound=PLAYS_KEY)]).keys == {}  # two sets of files
    # New figures of the same files (another evaluation identity) are a new configuration to judge.
    remeasured = own.model_copy(update={"evalIdentity": "f" * 64})
    assert K.published_adapters(["sound"], False, remeasured, []).figures == ("f" * 64,)
    assert K.published_adapters(["sound"], False, remeasured, []) != K.published_adapters(["sound"], False, own, [])


def test_an_adapter_the_canary_refused_is_not_loaded_on_that_pool_and_an_event_names_it():
    inp = _inputs({A: _report(PLAYS_KEY), B: None})
    refused = {VARIANT.pool: K.adapter_verdicts(_result(BASE_OK, _metric("adapter:plays", "adapter", 50, 51, 0.6)),
                                                {"plays": 0.6})}
    out = adapters_step(_with(inp, canary=refused))
    a100, h100 = out.statuses[0].pools
    assert (a100.state, a100.served, a100.adapterKey) == ("Failed", False, PLAYS_KEY)
    assert "refused through vLLM on the canary: perplexity 51" in a100.reason
    assert (h100.state, h100.served) == ("Passed", True)  # the other pool has no verdict: the Job's stands
    assert served_on(out.statuses, VARIANT.pool) == () and any("on pool " + VARIANT.pool in f for f in out.failed)


def test_an_adapter_its_pools_canary_could_not_measure_is_not_served_there_with_the_reason():
    inp = _inputs({A: _report(PLAYS_KEY), B: None})
    skipped = {VARIANT.pool: K.adapter_verdicts(_result(BASE_OK, skipped=[SkippedMetric(
        name="adapter:plays", reason="limits.maxRequests (256) left no request for this part")]), {})}
    a100, _ = adapters_step(_with(inp, canary=skipped)).statuses[0].pools
    assert (a100.state, a100.served) == ("Passed", False) and "its canary did not measure it: limits.maxRequests" in a100.reason
    unloaded = {VARIANT.pool: K.adapter_verdicts(_result(BASE_OK), {})}
    a100, _ = adapters_step(_with(inp, canary=unloaded)).statuses[0].pools
    assert not a100.served and "not loaded on the canary pod" in a100.reason
    passed = {VARIANT.pool: K.adapter_verdicts(_result(BASE_OK, _metric("adapter:plays", "adapter", 50, 50.1, 3)), {})}
    a100, _ = adapters_step(_with(inp, canary=passed)).statuses[0].pools
    assert (a100.state, a100.served) == ("Passed", True)


def test_while_a_pools_verdict_cannot_be_read_no_adapter_is_added_there_and_what_it_loads_stays():
    inp = _inputs({A: _report(PLAYS_KEY), B: None})
    unread = adapters_step(_with(inp, canary_unread=frozenset({"h100"})))
    a100, h100 = unread.statuses[0].pools
    assert a100.served and not h100.served and "canary verdict cannot be read now" in h100.reason
    kept = adapters_step(_with(inp, canary_unread=frozenset({"h100"}),
                               loaded={"h100": frozenset({f"plays=/adapters/{PLAYS_KEY}"})}))
    assert served_on(kept.statuses, "h100") == (ServedAdapter("plays", PLAYS_KEY),)


def _canary(loads: list[str], template_loads: list[str] | None = None, result: ServingQualityResult | None = None):
    """decide_canary for the canary world's variant, its desired object loading ``loads``."""
    from tests.unit.test_canary import NAME, SETTINGS, canary_deployment, canary_world, target

    w = canary_world()
    pv, key, chash = target(w)
    spec = w.planned()[0].spec

    def obj(names):
        d = json.loads(json.dumps(canary_deployment(w)))
        d["metadata"].update(name=f"{NAME}-{pv.pool}", annotations={K.ANNOTATION_SPEC_HASH: "x"})
        c = d["spec"]["template"]["spec"]["containers"][0]
        c["args"] = [*(c.get("args") or []), *[a for n in names for a in ("--lora-modules", f"{n}=/adapters/{n}")]]
        return d
    gate = QualityGateSpec().with_adapters([AdapterEvaluation(name=n, uri=f"s3://adapters/{n}", evalDataset="general-en-heldout",
                                                              evalSamples=8, maxIncreasePercent=0.6 if n == "damaged" else 3)
                                            for n in ("sound", "damaged")])
    facts = K.CanaryFacts(chash, result=result.model_copy(update={"configHash": chash}) if result else None)
    return K.decide_canary(owner=K.Owner(NAME, "ns", "uid"), spec=spec, variant=pv, desired=obj(loads), current=None,
                           chash=chash, artifact_key=key, facts=facts, old=None, gate=gate, now="2026-11-29T12:00:00Z",
                           settings=SETTINGS, canary_template=obj(template_loads) if template_loads is not None else None)


def test_the_canary_pod_loads_every_published_adapter_and_the_variant_rolls_out_with_those_that_passed():
    started = _canary(["sound"], ["damaged", "sound"])
    (create,) = started.creates
    assert lora_modules_in(create.deployment) == {"damaged=/adapters/damaged", "sound=/adapters/sound"}
    verdict = _result(BASE_OK, SOUND_OK, DAMAGED)
    passed = _canary(["sound"], ["damaged", "sound"], verdict)
    assert passed.may_serve and passed.status.phase == "Passed"
    assert "the base passed; adapter(s) damaged not served on this pool" in passed.status.reason
    # Still loading the refused one (the pass that reads the verdict renders without it): no rollout.
    assert not _canary(["damaged", "sound"], None, verdict).may_serve
    # The base failing holds everything, whatever the adapters did.
    assert not _canary([], None, _result(_metric("perplexity", "perplexity", 10, 12, 3), SOUND_OK)).may_serve


def _world_with_adapters(canary: bool = True):
    from tests.unit.test_decide import PLAYS, AdapterFacts, World, _adapter_results, base_spec

    w = World(spec=base_spec(adapters=[PLAYS, {**PLAYS, "name": "chat"}],
                             serving={"maxModelLen": 4096, "canary": {"enabled": canary}}),
              adapters=(AdapterFacts("plays", 16, ("q_proj",)), AdapterFacts("chat", 8, ("q_proj",))))
    w.publish()
    _adapter_results({"plays": 0.4, "chat": 6.3}, published=True)(w)
    return w


def _as_observed(spec, the_plan, artifacts, keys):
    """What observe (canary_observe.read_canaries) hashes: the published adapters from its facts."""
    from fewerbits_operator.artifacts.keys import artifact_format

    return K.published_by_pool(spec.adapters, the_plan.variants,
                               lambda pv: artifacts.get(keys.get(artifact_format(pv)) or ""))


def test_observe_and_decide_hash_the_same_published_adapters_and_the_canary_pod_loads_them_all():
    """The served configuration's hash observe reads the canary's facts under is the one decide
    judges with: both take the published adapters from the same reports."""
    from dataclasses import replace

    from fewerbits_operator.artifacts.keys import artifact_format
    from fewerbits_operator.core.decide import CreateDeployment, decide
    from tests.unit.test_decide import NAME, SETTINGS, adapter_key

    w = _world_with_adapters()
    acc, the_plan, arts = w.planned()
    keys = {a.format: a.key for a in arts}
    seen = _as_observed(acc.spec, the_plan, w.observed().artifacts, keys)
    (pv,) = the_plan.variants
    assert seen[pv.pool].keys == {"chat": adapter_key("chat"), "plays": adapter_key("plays")}
    key = keys[artifact_format(pv)]
    chash = K.config_hash(acc.spec, pv, key, NAME, SETTINGS, seen[pv.pool])
    assert chash != K.config_hash(acc.spec, pv, key, NAME, SETTINGS)  # new files: a new configuration to judge
    o = decide(replace(w.observed(), canaries={pv.pool: K.CanaryFacts(chash)}), SETTINGS)  # as observe read it
    (canary,) = [a.deployment for a in o.actions if isinstance(a, CreateDeployment)]
    assert canary["metadata"]["annotations"][K.ANNOTATION_SERVING_CONFIG] == chash
    # The canary pod loads both, the refused one too: the verdict judges each through vLLM.
    assert lora_modules_in(canary) == {f"{n}=/adapters/{adapter_key(n)}" for n in ("plays", "chat")}
    assert [s.state for s in o.status.adapters for s in s.pools] == ["Passed", "Failed"]


def test_with_the_verdict_the_variant_rolls_out_loading_only_what_passed_the_job_and_the_canary():
    from dataclasses import replace

    from fewerbits_operator.core.decide import CreateDeployment, decide
    from tests.unit.test_decide import NAME, SETTINGS, _adapter_results, adapter_key

    w = _world_with_adapters()
    acc, the_plan, arts = w.planned()
    (pv,) = the_plan.variants
    key = next(a.key for a in arts)
    chash = K.config_hash(acc.spec, pv, key, NAME, SETTINGS, _as_observed(acc.spec, the_plan, w.observed().artifacts,
                                                                        {a.format: a.key for a in arts})[pv.pool])
    base = ServingMetric(name="perplexity", kind="perplexity", base=10, served=10.1, recoveryPercent=99,
                         minRecoveryPercent=95, passed=True, higherIsBetter=False, samples=8)
    verdict = ServingQualityResult(key=key, configHash=chash, variant=pv.pool, kvCacheDtype=pv.kvCacheDtype,
                                   passed=False, metrics=[base, _metric("adapter:plays", "adapter", 100, 100.1, 5),
                                                          _metric("adapter:chat", "adapter", 100, 107, 5)])
    o = decide(replace(w.observed(), canaries={pv.pool: K.CanaryFacts(chash, result=verdict)}), SETTINGS)
    (real,) = [a.deployment for a in o.actions if isinstance(a, CreateDeployment)]
    assert real["metadata"]["name"] == f"{NAME}-{pv.pool}"
    assert lora_modules_in(real) == {f"plays=/adapters/{adapter_key('plays')}"}
    assert any(e.reason == "CanaryPassed" for e in o.events)
    # A canary refusal of an adapter the Job passed fails it there, named, with the served figures.
    w2 = _world_with_adapters()
    _adapter_results({"plays": 0.4, "chat": 1.0}, published=True)(w2)
    o = decide(replace(w2.observed(), canaries={pv.pool: K.CanaryFacts(chash, result=verdict)}), SETTINGS)
    chat = next(s for s in o.status.adapters if s.name == "chat").pools[0]
    assert chat.state == "Failed" and "refused through vLLM on the canary" in chat.reason
    assert any(e.reason == "AdapterGateFailed" and "chat" in e.message for e in o.events)


def test_facts_read_for_another_configuration_are_never_taken_as_this_ones():
    from tests.unit.test_canary import NAME, SETTINGS, canary_world, target

    verdict = _result(BASE_OK, SOUND_OK)
    assert _canary(["sound"], None, verdict).may_serve  # stamped with this configuration's hash: it rolls out
    w = canary_world()
    pv, key, chash = target(w)
    other = K.decide_canary(owner=K.Owner(NAME, "ns", "uid"), spec=w.planned()[0].spec, variant=pv,
                            desired=json.loads(json.dumps(_desired(w, pv, ["sound"]))), current=None, chash=chash,
                            artifact_key=key, facts=K.CanaryFacts("0" * 32, result=verdict), old=None,
                            gate=QualityGateSpec(), now="2026-11-29T12:00:00Z", settings=SETTINGS)
    assert not other.may_serve and not other.creates and "another served configuration" in other.status.reason


def _desired(w, pv, names):
    from tests.unit.test_canary import NAME, canary_deployment

    d = json.loads(json.dumps(canary_deployment(w)))
    d["metadata"].update(name=f"{NAME}-{pv.pool}", annotations={K.ANNOTATION_SPEC_HASH: "x"})
    c = d["spec"]["template"]["spec"]["containers"][0]
    c["args"] = [*(c.get("args") or []), *[a for n in names for a in ("--lora-modules", f"{n}=/adapters/{n}")]]
    return d


def test_a_verdict_written_after_its_absence_was_remembered_is_read():
    from types import SimpleNamespace

    from fewerbits_operator.serving import canary_observe as CO

    stored: dict[str, ServingQualityResult] = {}
    store = SimpleNamespace(get_serving_result=lambda storage, key, chash, creds: stored.get(chash))
    observer = SimpleNamespace(store=store)
    spec = SimpleNamespace(storage=SimpleNamespace(uri="s3://models/later", endpoint=None))
    chash = "d" * 32
    assert CO._judged(observer, spec, A, chash, None).result is None  # rolled out before the canary: none
    verdict = _result(BASE_OK, SOUND_OK).model_copy(update={"configHash": chash})
    stored[chash] = verdict
    assert CO._judged(observer, spec, A, chash, None).result is None  # its absence is remembered a while ...
    CO._verdict(store, spec.storage, A, chash, None)  # ... until this process's canary reads the verdict
    assert CO._judged(observer, spec, A, chash, None).result == verdict
