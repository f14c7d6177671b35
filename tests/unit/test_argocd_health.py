"""The Argo CD health check (charts/fewerbits/files/argocd-health.lua), run for real in Lua 5.1 (what
Argo CD's gopher-lua implements) and 5.4 through lupa, against QuantizedModel objects, with only the
globals Argo CD gives a script from argocd-cm without useOpenLibs (tests/unit/argo_lua.py: no
string, math, os or io library, no string methods).

Every file in tests/fixtures/status/ is one case: ``{"expected": {"status": ..., "messageContains":
...}, "object": {...}}``; objects captured from end-to-end runs go in the same folder. The ready-made
argocd-cm patch (docs/argocd/argocd-cm-patch.yaml) is generated from the Lua file; refresh it with

    .venv/bin/python tests/unit/test_argocd_health.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from lupa import lua51, lua54

if __name__ == "__main__":  # run as a script to regenerate the patch: make `tests.unit` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fewerbits_api.conditions import Reason
from fewerbits_api.quantizedmodel import QuantizedModel
from fewerbits_operator.core.decide import decide
from tests.unit.argo_lua import ARGO_GLOBALS, STRING_FUNCTIONS, argo_runtime, chunk_names, run_health
from tests.unit.test_decide import SETTINGS, World

ROOT = Path(__file__).resolve().parents[2]
LUA = ROOT / "charts" / "fewerbits" / "files" / "argocd-health.lua"
PATCH = ROOT / "docs" / "argocd" / "argocd-cm-patch.yaml"
FIXTURES = ROOT / "tests" / "fixtures" / "status"
HEALTH_KEY = "resource.customizations.health.fewerbits.io_QuantizedModel"
STATUSES = {"Healthy", "Progressing", "Degraded", "Suspended"}

PATCH_HEADER = """\
# Generated from charts/fewerbits/files/argocd-health.lua by
# `.venv/bin/python tests/unit/test_argocd_health.py`; do not edit (a test keeps them equal).
#
# Merge into Argo CD's argocd-cm, e.g.
#   kubectl -n argocd patch configmap argocd-cm --type merge --patch-file docs/argocd/argocd-cm-patch.yaml
"""


def render_patch() -> str:
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "argocd-cm", "namespace": "argocd",
                     "labels": {"app.kubernetes.io/name": "argocd-cm", "app.kubernetes.io/part-of": "argocd"}},
        "data": {HEALTH_KEY: LUA.read_text()},
    }

    class Literal(yaml.SafeDumper):
        pass

    def str_presenter(dumper: yaml.SafeDumper, s: str) -> yaml.Node:
        style = "|" if "\n" in s else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", s, style=style)

    Literal.add_representer(str, str_presenter)
    return PATCH_HEADER + yaml.dump(cm, Dumper=Literal, sort_keys=False, allow_unicode=True, width=1000)


def health(obj: dict[str, Any], lua: ModuleType = lua51) -> tuple[str, str]:
    return run_health(LUA.read_text(), obj, lua)


def _fixtures() -> list[Path]:
    return sorted(FIXTURES.glob("*.json"))


@pytest.mark.parametrize("path", _fixtures(), ids=lambda p: p.stem)
@pytest.mark.parametrize("lua", [lua51, lua54], ids=["argocd-lua5.1", "argocd-lua5.4"])
def test_fixture_health(path: Path, lua: ModuleType):
    """Every fixture, under Argo CD's globals: a script that calls a library Argo CD does not open
    fails there, and Argo CD shows the model as Unknown."""
    case = json.loads(path.read_text())
    expected = case["expected"]
    assert expected["status"] in STATUSES, f"{path.name}: expected.status must be one of {sorted(STATUSES)}"
    status, message = health(case["object"], lua)
    assert status == expected["status"], f"{path.name}: {status}: {message}"
    assert isinstance(message, str) and message
    if expected.get("messageContains"):
        assert expected["messageContains"] in message, f"{path.name}: {message!r}"


@pytest.mark.parametrize("path", _fixtures(), ids=lambda p: p.stem)
def test_fixture_is_a_valid_quantized_model(path: Path):
    """Fixtures are realistic: each object is what the API models accept (captured ones too)."""
    case = json.loads(path.read_text())
    assert set(case) >= {"expected", "object"}
    QuantizedModel.model_validate(case["object"])


def test_fixtures_cover_every_health_status():
    seen = {json.loads(p.read_text())["expected"]["status"] for p in _fixtures()}
    assert seen == STATUSES


# Each reason the operator writes, the condition it appears on, and the health it means when that
# condition is False (None: the reason only comes with status True). A new Reason fails
# test_every_reason_is_classified until it is placed here and, if it needs a person, in the Lua.
REASONS: dict[str, tuple[str, str | None]] = {
    Reason.VALID: ("Accepted", None),
    Reason.INVALID_SPEC: ("Accepted", "Degraded"),
    Reason.POLICY_VIOLATION: ("Accepted", "Degraded"),
    Reason.MISSING_SECRET: ("Accepted", "Degraded"),
    Reason.PLANNED: ("Planned", None),
    Reason.NO_GPU_POOLS: ("Planned", "Degraded"),
    Reason.NO_POOL_FITS: ("Planned", "Degraded"),
    Reason.MODEL_CONFIG_UNAVAILABLE: ("Planned", "Degraded"),
    Reason.POOL_GONE: ("Planned", "Degraded"),
    Reason.CACHE_HIT: ("Quantized", None),
    Reason.JOB_RUNNING: ("Quantized", "Progressing"),
    Reason.JOB_PENDING: ("Quantized", "Progressing"),
    Reason.JOB_SUCCEEDED: ("Quantized", None),
    Reason.CALIBRATION_REDUCED: ("Quantized", None),  # True: published, calibrated on less than asked
    Reason.JOB_FAILED: ("Quantized", "Degraded"),
    Reason.STORAGE_UNAVAILABLE: ("Quantized", "Degraded"),
    Reason.QUEUED: ("Quantized", "Progressing"),
    Reason.CALIBRATION_DATA_UNAVAILABLE: ("Quantized", "Degraded"),
    Reason.JOB_OOM_KILLED: ("Quantized", "Degraded"),
    Reason.JOB_EVICTED: ("Quantized", "Degraded"),
    Reason.JOB_OUT_OF_DISK: ("Quantized", "Degraded"),
    Reason.JOB_DEADLINE_EXCEEDED: ("Quantized", "Degraded"),
    Reason.JOB_EXCEEDS_POLICY: ("Quantized", "Degraded"),
    Reason.DATASET_UNREADABLE: ("Quantized", "Degraded"),
    Reason.GATE_PASSED: ("QualityGatePassed", None),
    Reason.GATE_FAILED: ("QualityGatePassed", "Degraded"),
    Reason.AWAITING_ARTIFACT: ("QualityGatePassed", "Progressing"),
    Reason.DEPLOYMENTS_CREATED: ("Deployed", None),
    Reason.ROLLING_OUT: ("Deployed", "Progressing"),
    Reason.ALL_VARIANTS_READY: ("Ready", None),
    Reason.SOME_VARIANTS_READY: ("Ready", "Progressing"),
    Reason.NO_REPLICAS_READY: ("Ready", "Progressing"),
    Reason.PODS_FAILING: ("Ready", "Degraded"),
    Reason.SERVICE_CONFLICT: ("Deployed", "Degraded"),
    Reason.BLOCKED: ("Ready", "Progressing"),
    Reason.LEADER_WORKER_SET_MISSING: ("Deployed", "Degraded"),
    Reason.ROUTING_UNAVAILABLE: ("Deployed", "Degraded"),
    Reason.INFERENCE_POOL_CONFLICT: ("Deployed", "Degraded"),
    Reason.HTTP_ROUTE_CONFLICT: ("Deployed", "Degraded"),
    Reason.METRICS_UNAVAILABLE: ("Deployed", None),  # True: served, with a warning
    Reason.CANARY_DISABLED: ("ServingQualityPassed", None),
    Reason.CANARY_PASSED: ("ServingQualityPassed", None),
    Reason.CANARY_PENDING: ("ServingQualityPassed", "Progressing"),
    Reason.CANARY_EVALUATING: ("ServingQualityPassed", "Progressing"),
    Reason.CANARY_FAILED: ("ServingQualityPassed", "Degraded"),
    Reason.CANARY_NOT_READY: ("ServingQualityPassed", "Degraded"),
    Reason.CANARY_ERROR: ("ServingQualityPassed", "Degraded"),
    # Beside the chain (not in ORDER): the base serves whatever its adapters' state.
    Reason.ADAPTER_INVALID: ("AdaptersServed", "Degraded"),
    Reason.ADAPTERS_NOT_PLANNED: ("AdaptersServed", "Degraded"),
    Reason.AWAITING_ADAPTER_GATE: ("AdaptersServed", "Healthy"),
    Reason.ADAPTERS_JUDGED: ("AdaptersServed", "Healthy"),
}
ORDER = ["Accepted", "Planned", "Quantized", "QualityGatePassed", "ServingQualityPassed", "Deployed", "Ready"]


def test_every_reason_is_classified():
    reasons = {v for k, v in vars(Reason).items() if not k.startswith("_") and isinstance(v, str)}
    assert reasons == set(REASONS)


def _model(conditions: list[dict[str, Any]], generation: int = 1, **status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizedModel",
        "metadata": {"name": "m", "namespace": "ns", "generation": generation},
        "spec": {"source": {"uri": "hf://org/model"}},
        "status": {"observedGeneration": generation, "conditions": conditions, **status},
    }


def _cond(type_: str, status: str, reason: str, message: str = "", generation: int = 1) -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-11-21T10:00:00Z", "observedGeneration": generation}


@pytest.mark.parametrize("reason", [r for r, (_, h) in REASONS.items() if h is not None])
def test_each_reason_when_false(reason: str):
    """Every earlier condition True, this one False with the reason, every later one Blocked (a
    condition beside the chain: the whole chain True, then this one)."""
    type_, expected = REASONS[reason]
    i = ORDER.index(type_) if type_ in ORDER else len(ORDER)
    conditions = [_cond(t, "True", "Ok") for t in ORDER[:i]] + [_cond(type_, "False", reason, f"because {reason}")]
    conditions += [_cond(t, "False", "Blocked", f"see {type_}") for t in ORDER[i + 1:]]
    status, message = health(_model(conditions))
    assert status == expected, message
    assert reason in message


def test_degraded_from_an_older_generation_is_not_current():
    """A failure computed for generation 1 says nothing about generation 2's spec."""
    conditions = [_cond("Accepted", "False", Reason.POLICY_VIOLATION, "old", generation=1)]
    obj = _model(conditions, generation=2)
    obj["status"]["observedGeneration"] = 2
    assert health(obj)[0] == "Progressing"


def test_ready_true_for_an_older_generation_is_not_healthy():
    obj = _model([_cond(t, "True", "Ok", generation=1) for t in ORDER], generation=2)
    assert health(obj)[0] == "Progressing"


def test_autoscaling_minimum_zero_but_replicas_running_is_not_suspended():
    obj = _model([_cond(t, "True", "Ok") for t in ORDER], serving=[{"variant": "a", "deployment": "d", "replicas": 1, "readyReplicas": 1}])
    obj["spec"]["autoscaling"] = {"minReplicas": 0}
    assert health(obj)[0] == "Healthy"


def test_zero_replicas_without_autoscaling_is_not_suspended():
    """serving.replicas 0 with autoscaling off is a mistake to see, not a scale-to-zero."""
    conditions = [_cond(t, "True", "Ok") for t in ORDER[:-1]] + [_cond("Ready", "False", Reason.NO_REPLICAS_READY)]
    obj = _model(conditions, serving=[{"variant": "a", "deployment": "d", "replicas": 0, "readyReplicas": 0}])
    obj["spec"]["autoscaling"] = {"enabled": False, "minReplicas": 0}
    assert health(obj)[0] == "Progressing"


@pytest.mark.parametrize("reason", [Reason.CANARY_PENDING, Reason.CANARY_EVALUATING])
def test_a_canary_being_judged_is_progressing_while_the_old_variant_serves(reason: str):
    """Ready=True (the previous artifact serves) but a new variant's canary is judged: Progressing."""
    conditions = [_cond(t, "True", "Ok") for t in ORDER if t != "ServingQualityPassed"]
    conditions.append(_cond("ServingQualityPassed", "False", reason, "pool-a: Job evaluates the canary pod"))
    obj = _model(conditions, serving=[{"variant": "a", "deployment": "d", "replicas": 1, "readyReplicas": 1}])
    status, message = health(obj)
    assert status == "Progressing" and reason in message


@pytest.mark.parametrize("pending", [
    [_cond("Quantized", "False", Reason.JOB_RUNNING, "w8a8-int8: Job running"),
     _cond("Deployed", "False", Reason.AWAITING_ARTIFACT, "waiting for the artifact")],
    [_cond("Deployed", "False", Reason.ROLLING_OUT, "h100: 0 of 1 new replicas ready")],
])
def test_serving_an_earlier_specs_artifact_is_progressing_until_this_one_rolls_out(pending):
    """A spec change re-quantizes while the previous artifact keeps serving (Ready=True, what the
    GitOps e2e saw): not done yet, like a Deployment mid-rollout, and says which step it waits on."""
    kinds = {c["type"] for c in pending}
    conditions = [_cond(t, "True", "Ok") for t in ORDER if t not in kinds and t != "Ready"] + pending
    conditions.append(_cond("Ready", "True", Reason.ALL_VARIANTS_READY, "1 variant(s) serving at http://m"))
    status, message = health(_model(conditions, endpoint="http://m"))
    assert status == "Progressing", message
    assert pending[0]["reason"] in message and "previous rollout keeps serving" in message


def test_a_failed_canary_is_degraded_while_the_old_variant_serves():
    conditions = [_cond(t, "True", "Ok") for t in ORDER if t != "ServingQualityPassed"]
    conditions.append(_cond("ServingQualityPassed", "False", Reason.CANARY_FAILED,
                            "pool-a: custom:exact_match served 0.1 vs base 0.9: 11.1% (min 95%), KV cache fp8"))
    status, message = health(_model(conditions))
    assert status == "Degraded" and "KV cache fp8" in message


ENDPOINT = "http://m.ns.svc:8000"


@pytest.mark.parametrize("reason, message, want", [
    (Reason.ALL_VARIANTS_READY, f"1 variant(s) serving at {ENDPOINT}", f"1 variant(s) serving at {ENDPOINT}"),
    (Reason.PODS_FAILING, "serving on h100; a100: exit 12", f"serving on h100; a100: exit 12 ({ENDPOINT})"),
])
def test_healthy_message_names_the_endpoint_once(reason: str, message: str, want: str):
    """Ready=True (PodsFailing: served everywhere, a pod failing) gets the endpoint appended unless
    its reason is AllVariantsReady, whose message names it already."""
    conditions = [_cond(t, "True", "Ok") for t in ORDER[:-1]] + [_cond("Ready", "True", reason, message)]
    assert health(_model(conditions, endpoint=ENDPOINT)) == ("Healthy", want)


def test_the_status_the_operator_decides_for_a_ready_model_names_the_endpoint_once():
    """What the script relies on instead of searching the message (Argo CD gives it no string
    library): decide()'s AllVariantsReady message names status.endpoint."""
    w = World()
    w.publish()
    w.serve()
    status = decide(w.observed(), SETTINGS).status.to_wire()
    obj = {"apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizedModel",
           "metadata": {"name": "m", "namespace": "ns", "generation": w.generation}, "spec": w.spec, "status": status}
    health_status, message = health(obj)
    assert health_status == "Healthy" and status["endpoint"]
    assert message.count(status["endpoint"]) == 1, message


def test_uses_only_what_argo_cd_provides():
    """Every global read, in every branch (not only those the fixtures reach), is one Argo CD sets
    or the script itself writes (hs), and no string method is called: the script needs no
    useOpenLibs."""
    names = chunk_names(LUA.read_text())
    assert names.reads <= ARGO_GLOBALS | names.writes, sorted(names.reads - ARGO_GLOBALS - names.writes)
    assert not names.methods & STRING_FUNCTIONS, sorted(names.methods & STRING_FUNCTIONS)


def test_chunk_names_see_library_calls_in_branches_never_run():
    names = chunk_names('if obj == nil then return string.find(x, "y"), ("x"):sub(1), math.max(1) end\n'
                        'hs = {}; hs.m = obj.m:upper(); return hs')
    assert names.reads == {"obj", "string", "x", "math", "hs"} and names.writes == {"hs"}
    assert names.methods == {"sub", "upper"}


@pytest.mark.parametrize("lua", [lua51, lua54], ids=["argocd-lua5.1", "argocd-lua5.4"])
@pytest.mark.parametrize("code", ['string.find("ab", "b", 1, true)', '("ab"):find("b", 1, true)', "math.floor(1)",
                                  "os.time()", "io.write('x')", "debug.traceback()", "table.time()",
                                  "python.eval('1')"])
def test_argo_runtime_lacks_what_argo_cd_does_not_open(code: str, lua: ModuleType):
    with pytest.raises(lua.LuaError):
        argo_runtime(lua).execute(code)


@pytest.mark.parametrize("lua", [lua51, lua54], ids=["argocd-lua5.1", "argocd-lua5.4"])
def test_argo_runtime_keeps_what_argo_cd_opens(lua: ModuleType):
    runtime = argo_runtime(lua)
    assert runtime.execute('local t = {"a"}; table.insert(t, "b"); return table.concat(t, ",") .. #"xyz"') == "a,b3"
    assert runtime.execute("return tostring(tonumber('2')) .. type(require('os').time())") == "2number"
    assert runtime.execute("return os") is None
    if lua is lua51:  # PUC Lua 5.1 has every other name gopher-lua's base, package and table libraries have
        gopher_only, set_per_run = {"_GOPHER_LUA_VERSION", "_printregs"}, {"obj"}
        assert set(runtime.globals()) == ARGO_GLOBALS - gopher_only - set_per_run


def test_argocd_cm_patch_is_generated_from_the_lua_file():
    assert PATCH.read_text() == render_patch(), "run `.venv/bin/python tests/unit/test_argocd_health.py`"
    cm = yaml.safe_load(PATCH.read_text())
    assert cm["data"][HEALTH_KEY] == LUA.read_text()


if __name__ == "__main__":
    PATCH.parent.mkdir(parents=True, exist_ok=True)
    PATCH.write_text(render_patch())
    print(f"wrote {PATCH.relative_to(ROOT)}", file=sys.stderr)
