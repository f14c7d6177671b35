"""The hostile-input corpus (issue 10) on the real control plane: every malformed or hostile
QuantizedModel and QuantizationPolicy is either refused at admission with an error naming the
field, or stored and surfaced as a condition naming it. The operator never crashes, never
creates an object for a model it did not accept, and keeps serving a well-formed model applied
beside them.

Admission cases are one request each. Condition cases are applied together (one namespace for
the models, one per policy case, since one policy governs a namespace) and waited for together.
Every policy selects only this run's namespaces and is deleted afterwards.

Simulator: none starts. Every accepted model's Job is parked on a node label no node has, so no
model here is quantized or served; the default vLLM image of the well-formed model
(llm-d-inference-sim in this harness) never runs.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e import demo
from tests.integration.hostile_corpus import (
    CORPUS,
    PARKED_JOB_PLACEMENT,
    Case,
    Ctx,
    qm,
    qp,
)

pytestmark = [pytest.mark.cluster]

GROUP, VERSION = "fewerbits.io", "v1alpha1"
RUN_LABEL_KEY = "fewerbits.io/hostile-run"
CASE_LABEL_KEY = "fewerbits.io/hostile-case"
ADMISSION = [c for c in CORPUS if c.expect == "admission"]
CONDITION = [c for c in CORPUS if c.expect == "condition"]
CONTROL = "control"


@dataclass
class Run:
    ctx: Ctx
    """The model namespace's context (admission cases use it too)."""
    ctx_by_case: dict[str, Ctx]
    model_name: dict[str, str]
    """Case id -> the name of the model whose condition is judged (namespace in ctx_by_case)."""
    final: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Case id -> the judged model as last read."""
    control_before: dict[str, Any] = field(default_factory=dict)
    """The control model's conditions once it was planned, before the corpus was applied."""


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), None)


def _matches(case: Case, obj: dict[str, Any]) -> bool:
    type_, status, reason = case.expect_condition
    c = _condition(obj, type_)
    return bool(c and c["status"] == status and c["reason"] == reason)


def _namespace(core: client.CoreV1Api, run_id: str) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name, "labels": {RUN_LABEL_KEY: run_id, CASE_LABEL_KEY: name}}})
    return name


def _secrets(cluster, core: client.CoreV1Api, namespace: str) -> None:
    demo.create_s3_secret(cluster, namespace, "s3-credentials")
    core.create_namespaced_secret(namespace, {"metadata": {"name": "half-credentials"},
                                              "stringData": {"AWS_ACCESS_KEY_ID": "only-the-id"}})


@pytest.fixture(scope="module")
def run(cluster, operator, models, test_model_uri):
    api = cluster.api_client()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    run_id = uuid.uuid4().hex[:8]
    s3 = cluster.s3.client()
    policies: list[str] = []
    namespaces: list[str] = []
    pool = f"hostile-{run_id}"

    def ctx_for(namespace: str) -> Ctx:
        return Ctx(namespace=namespace, run_label=(RUN_LABEL_KEY, run_id), source_uri=test_model_uri,
                   s3_endpoint=cluster.s3.endpoint, secret="s3-credentials", half_secret="half-credentials",
                   artifact_bucket=demo.ARTIFACT_BUCKET,
                   hostile_config_uri=lambda case_id: f"s3://{demo.MODEL_BUCKET}/hostile-{run_id}/{case_id}")

    def create_policy(body: dict[str, Any]) -> None:
        custom.create_cluster_custom_object(GROUP, VERSION, "quantizationpolicies", body)
        policies.append(body["metadata"]["name"])

    try:
        main_ns = _namespace(core, run_id)
        namespaces.append(main_ns)
        ctx = ctx_for(main_ns)
        ctx_by_case = {c.id: ctx for c in CORPUS if c.kind == "QuantizedModel" or c.expect == "admission"}
        for case in CONDITION:
            if case.kind == "QuantizationPolicy":
                ns = _namespace(core, run_id)
                namespaces.append(ns)
                ctx_by_case[case.id] = ctx_for(ns)
        for ns in namespaces:
            _secrets(cluster, core, ns)
        for case in CORPUS:
            if case.config_json is not None:
                s3.put_object(Bucket=demo.MODEL_BUCKET, Key=f"hostile-{run_id}/{case.id}/config.json",
                              Body=case.config_json)
        cluster.add_gpu_pool(pool, "NVIDIA-H100-80GB-HBM3")

        # The model namespace's own policy only parks quantization Jobs on a label no node has, so
        # the control model is planned and its Job created, but nothing quantizes on this machine.
        create_policy(qp(f"park-{run_id}", {"namespaceSelector": {"matchLabels": {CASE_LABEL_KEY: main_ns}},
                                            "rules": {"quantizationJob": PARKED_JOB_PLACEMENT}}))
        for case in CONDITION:
            if case.kind == "QuantizationPolicy":
                create_policy(case.body(ctx_by_case[case.id]))
        time.sleep(1)  # the operator lists policies on each reconcile; let the API settle

        control_spec = ctx.spec(serving={"maxModelLen": 256, "targets": []})
        custom.create_namespaced_custom_object(GROUP, VERSION, main_ns, "quantizedmodels",
                                               qm(CONTROL, control_spec, ctx=ctx))
        models.wait_condition(main_ns, CONTROL, "Accepted", timeout=120)
        models.wait_condition(main_ns, CONTROL, "Planned", timeout=120)
        models.wait("the control model's Job (parked)", lambda: models.jobs(main_ns), timeout=60)
        r = Run(ctx, ctx_by_case, {})
        r.control_before = {c["type"]: c for c in models.get(main_ns, CONTROL)["status"]["conditions"]}

        for case in CONDITION:
            c = ctx_by_case[case.id]
            body = case.probe(c) if case.probe is not None else case.body(c)
            custom.create_namespaced_custom_object(GROUP, VERSION, c.namespace, "quantizedmodels", body)
            r.model_name[case.id] = body["metadata"]["name"]

        deadline = time.monotonic() + 150
        pending = list(CONDITION)
        while pending and time.monotonic() < deadline:
            for case in list(pending):
                obj = models.get(ctx_by_case[case.id].namespace, r.model_name[case.id])
                r.final[case.id] = obj
                if _matches(case, obj):
                    pending.remove(case)
            time.sleep(1)
        yield r
    finally:
        for name in policies:
            try:
                custom.delete_cluster_custom_object(GROUP, VERSION, "quantizationpolicies", name)
            except ApiException:
                pass
        try:
            s3_objects = s3.list_objects_v2(Bucket=demo.MODEL_BUCKET, Prefix=f"hostile-{run_id}/").get("Contents", [])
            for o in s3_objects:
                s3.delete_object(Bucket=demo.MODEL_BUCKET, Key=o["Key"])
        except Exception:  # noqa: BLE001 — cleanup is best effort
            pass
        cluster.remove_pool(pool)
        for ns in namespaces:
            core.delete_namespace(ns)


def _refusal(custom: client.CustomObjectsApi, case: Case, ctx: Ctx) -> str:
    """Submit a case as kubectl would (strict field validation); the API server's error text."""
    body = case.body(ctx)
    try:
        if case.kind == "QuantizationPolicy":
            custom.create_cluster_custom_object(GROUP, VERSION, "quantizationpolicies", body,
                                                field_validation="Strict")
            custom.delete_cluster_custom_object(GROUP, VERSION, "quantizationpolicies", body["metadata"]["name"])
        else:
            custom.create_namespaced_custom_object(GROUP, VERSION, ctx.namespace, "quantizedmodels", body,
                                                   field_validation="Strict")
    except ApiException as e:
        assert 400 <= e.status < 500, (e.status, e.body)
        return e.body if isinstance(e.body, str) else e.body.decode(errors="replace")
    pytest.fail(f"{case.id}: the API server accepted {json.dumps(body)[:400]}")


@pytest.mark.parametrize("case", ADMISSION, ids=lambda c: c.id)
def test_refused_at_admission_naming_the_field(cluster, run, case):
    text = _refusal(client.CustomObjectsApi(cluster.api_client()), case, run.ctx)
    try:
        message = json.loads(text).get("message", text)
    except ValueError:
        message = text
    for name in case.names:
        assert name in message, f"{case.id}: {name!r} not in the refusal: {message[:2000]}"


@pytest.mark.parametrize("case", CONDITION, ids=lambda c: c.id)
def test_surfaced_as_a_condition_naming_the_field(run, case):
    obj = run.final[case.id]
    type_, status, reason = case.expect_condition
    c = _condition(obj, type_)
    assert c is not None and (c["status"], c["reason"]) == (status, reason), \
        f"{case.id}: expected {type_}={status} ({reason}); status: {json.dumps(obj.get('status'))[:3000]}"
    for name in case.names:
        assert name in c["message"], f"{case.id}: {name!r} not in {type_} message: {c['message']}"
    assert c["observedGeneration"] == obj["metadata"]["generation"]
    if status == "False" and type_ == "Accepted":
        # Everything after a refusal waits on it, and says so.
        assert _condition(obj, "Ready")["reason"] == "Blocked"


def test_operator_survives_creates_nothing_and_keeps_the_control_model(cluster, run, operator, models):
    api = cluster.api_client()
    apps, core, batch = client.AppsV1Api(api), client.CoreV1Api(api), client.BatchV1Api(api)
    assert set(run.final) == {c.id for c in CONDITION}, "the condition run did not complete"
    # No object from input the operator refused (or could not plan).
    for case in CONDITION:
        if case.creates_objects:
            continue
        ns, name = run.ctx_by_case[case.id].namespace, run.model_name[case.id]
        uid = run.final[case.id]["metadata"]["uid"]
        selector = f"fewerbits.io/model={name}"
        assert apps.list_namespaced_deployment(ns, label_selector=selector).items == [], case.id
        assert core.list_namespaced_service(ns, label_selector=selector).items == [], case.id
        owned = [j.metadata.name for j in batch.list_namespaced_job(ns).items
                 if any(r.uid == uid for r in j.metadata.owner_references or [])]
        assert owned == [], f"{case.id}: Jobs {owned} owned by a model that was not accepted"
    # The only Jobs are the parked ones of the accepted models, and none runs.
    for ns in {c.namespace for c in run.ctx_by_case.values()}:
        for job in batch.list_namespaced_job(ns).items:
            assert job.spec.template.spec.node_selector == PARKED_JOB_PLACEMENT["nodeSelector"], job.metadata.name
            assert not job.status.succeeded and not job.status.failed
    # The control model, applied first, kept what it had.
    control = models.get(run.ctx.namespace, CONTROL)
    after = {c["type"]: c for c in control["status"]["conditions"]}
    for type_ in ("Accepted", "Planned"):
        before = run.control_before[type_]
        assert after[type_]["status"] == "True", after[type_]
        assert after[type_]["lastTransitionTime"] == before["lastTransitionTime"], (before, after[type_])
    assert after["Quantized"]["reason"] == "JobPending" and "pending" in after["Quantized"]["message"].lower(), after["Quantized"]
    # And the operator is alive, never raised, and still reconciles: a spec change is observed.
    models.patch_spec(run.ctx.namespace, CONTROL, {"serving": {"maxModelLen": 512}})
    models.wait("the control model's generation 2 to be observed",
                lambda: (models.get(run.ctx.namespace, CONTROL).get("status") or {}).get("observedGeneration") == 2,
                timeout=60)
    assert operator.proc.poll() is None, operator.log_tail()
    log = operator.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[log.index("Traceback") - 2000: log.index("Traceback") + 4000]


def test_corpus_covers_what_the_issue_lists():
    kinds = {(c.kind, c.expect) for c in CORPUS}
    assert len(CORPUS) >= 45 and sum(c.kind == "QuantizationPolicy" for c in CORPUS) >= 8
    assert kinds == {("QuantizedModel", "admission"), ("QuantizedModel", "condition"),
                     ("QuantizationPolicy", "admission"), ("QuantizationPolicy", "condition")}
    names = {c.id for c in CORPUS if c.kind == "QuantizedModel" and c.expect == "condition"}
    assert all(len(n) <= 40 for n in names)
