"""The chart, installed with the real Helm into the real control plane, takes a sample to Ready.

The operator's pod is run by the pod runner as `python -m fewerbits_operator` with a token of the
chart's ServiceAccount (TokenRequest, bound to the pod): it has exactly the chart's RBAC, so a
missing rule shows up here as a model that never gets Ready. Along the way the Argo CD health check
(Lua) runs against the live status objects, and the objects are saved for the Lua fixtures when
FEWERBITS_CAPTURE_STATUS names a folder.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from kubernetes import client

from e2e import demo

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]


def lua_health(obj: dict) -> tuple[str, str]:
    from tests.unit.test_argocd_health import health

    return health(obj)


def test_chart_install_takes_a_sample_to_ready_under_the_charts_rbac(cluster, gpu_pool):
    gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    cluster.add_cpu_node("cpu-chart")
    suffix = uuid.uuid4().hex[:6]
    release_ns, model_ns = f"fb-system-{suffix}", f"fb-demo-{suffix}"
    demo.create_namespace_with_secret(cluster, model_ns, "s3-credentials")  # its Role lands there
    demo.install_chart(cluster, release_ns, [model_ns])
    api = cluster.api_client()
    core = client.CoreV1Api(api)
    try:
        [op_pod] = core.list_namespaced_pod(release_ns, label_selector="app.kubernetes.io/name=fewerbits").items
        assert op_pod.spec.service_account_name == "fewerbits"
        assert op_pod.status.phase == "Running"  # admitted under the `restricted` Pod Security Standard

        # What the chart's ServiceAccount may and may not do, asked of the API server itself.
        sa = f"system:serviceaccount:{release_ns}:fewerbits"
        authz = client.AuthorizationV1Api(api)

        def allowed(verb, resource, group="", ns=model_ns, sub=None):
            review = authz.create_subject_access_review({"spec": {"user": sa, "resourceAttributes": {
                "verb": verb, "resource": resource, "group": group, "namespace": ns, "subresource": sub}}})
            return review.status.allowed

        assert allowed("create", "jobs", "batch") and allowed("patch", "deployments", "apps", sub="scale")
        assert allowed("patch", "quantizedmodels", "fewerbits.io", sub="status")
        assert not allowed("list", "secrets") and not allowed("create", "jobs", "batch", ns="default")
        assert not allowed("delete", "nodes", ns=None) and not allowed("update", "quantizedmodels", "fewerbits.io")

        source = demo.upload_test_model(cluster)
        cluster.apply(demo.model_manifest(cluster, model_ns, "chart-sample", source, "s3-credentials"))
        seen: list[dict] = []

        def capture(line: str) -> None:
            obj = client.CustomObjectsApi(api).get_namespaced_custom_object(
                "fewerbits.io", "v1alpha1", model_ns, "quantizedmodels", "chart-sample")
            seen.append(obj)
            print(line)

        ready = demo.wait_ready(cluster, model_ns, "chart-sample", timeout=900, out=capture)
        status, message = lua_health(ready)
        assert status == "Healthy", message
        # Earlier live states were Progressing (quantizing, rolling out), never Degraded.
        assert {lua_health(o)[0] for o in seen[:-1]} <= {"Progressing", "Healthy"}
        assert any(lua_health(o)[0] == "Progressing" for o in seen)

        # kubectl: printer columns filled, explain text present, wait works.
        out = cluster.kubectl("get", "qm", "-n", model_ns).stdout
        assert "fp8-dynamic" in out and "True" in out
        cluster.kubectl("wait", "--for=condition=Ready", "qm/chart-sample", "-n", model_ns, "--timeout=30s")
        assert "maxPerplexityIncreasePercent" in cluster.kubectl("explain", "qm.spec.quantization.qualityGate").stdout

        url, answer = demo.completion(cluster, model_ns, "chart-sample")
        assert answer["choices"] and answer["model"] == "chart-sample"

        capture_dir = os.environ.get("FEWERBITS_CAPTURE_STATUS")
        if capture_dir:
            for label, obj in (("captured-progressing", next(o for o in seen if lua_health(o)[0] == "Progressing")),
                               ("captured-ready", ready)):
                h = lua_health(obj)
                Path(capture_dir, f"{label}.json").write_text(json.dumps({
                    "description": f"captured from the e2e chart install ({label})",
                    "expected": {"status": h[0], "messageContains": h[1][:40]},
                    "object": obj}, indent=1))
    finally:
        cluster.helm("uninstall", "fewerbits", "-n", release_ns, "--wait", check=False)
        for ns in (model_ns, release_ns):
            try:
                core.delete_namespace(ns)
            except client.exceptions.ApiException:
                pass
