"""Security properties asked of the real API server: the pods the operator renders pass the
`restricted` Pod Security Standard (admission, not a hand-written check), and what the operator
and its workloads wrote over this test session carries no secret value.

The operator's RBAC is proven with SubjectAccessReviews in e2e/tests/test_chart_install.py (it needs
the chart installed); real pods in an enforcing namespace are in test_faults.py (the operator kill
test runs there)."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.integration.faults import enforce_pod_security, secret_forms

pytestmark = pytest.mark.cluster

GOLDEN = Path(__file__).resolve().parents[1] / "unit" / "golden"


def rendered_pods() -> dict[str, dict]:
    """The pod templates of the golden renders: exactly what the operator creates (the golden test
    in tests/unit/test_render.py keeps them equal to the renderers' output)."""
    job = yaml.safe_load((GOLDEN / "job.yaml").read_text())
    deployment = yaml.safe_load((GOLDEN / "deployment.yaml").read_text())
    from fewerbits_operator.serving.picker import SCORING_CONFIG, render_picker
    from fewerbits_operator.serving.render import Owner
    from fewerbits_operator.base.settings import OperatorSettings

    settings = OperatorSettings()
    picker = render_picker(Owner("m", "ns", "uid"), settings.epp_image, settings.epp_cluster_role, SCORING_CONFIG)
    template = picker["Deployment"]["spec"]["template"]
    del template["spec"]["serviceAccountName"]  # its own, created beside it; admission here needs it to exist
    return {"quantjob": job["spec"]["template"], "fetch + vLLM": deployment["spec"]["template"],
            "endpoint picker": template}


def dry_run_pod(api: client.CoreV1Api, namespace: str, name: str, template: dict) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": template["metadata"].get("labels")},
           "spec": template["spec"]}
    api.create_namespaced_pod(namespace, pod, dry_run="All")


@pytest.mark.parametrize("level", ["restricted", "baseline"])
def test_rendered_pods_pass_pod_security_admission(cluster, namespace, level):
    enforce_pod_security(cluster, namespace, level)
    api = client.CoreV1Api(cluster.api_client())
    for what, template in rendered_pods().items():
        dry_run_pod(api, namespace, what.replace(" + ", "-").lower().replace(" ", "-"), template)
    # The check can fail: the same pod with one restricted rule broken is refused, naming the rule.
    broken = copy.deepcopy(rendered_pods()["quantjob"])
    broken["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    broken["spec"]["containers"][0]["securityContext"]["privileged"] = True
    with pytest.raises(ApiException) as refused:
        dry_run_pod(api, namespace, "broken", broken)
    assert refused.value.status == 403 and "violates PodSecurity" in refused.value.body
    assert "privileged" in refused.value.body


def test_no_secret_value_in_the_operator_log_or_any_workload_output(cluster, operator):
    """Whole-session scan (in a full run this file comes after the operator, fault and hostile-input
    tests, so it sees all their output; alone, it sees the operator's log only): the
    S3 secret key every test model used appears in no operator log line and no container's output
    or termination message, plain or base64."""
    outputs = [operator.log_path] + sorted((cluster.state_dir / "pods").glob("*/*.log")) + \
        sorted((cluster.state_dir / "pods").glob("*/*.termination-log"))
    deadline = time.monotonic() + 60  # alone, the session's operator may have just started
    while "fewerbits operator started" not in operator.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"the operator never logged its start:\n{operator.log_tail()}"
        time.sleep(0.5)
    leaks = [str(f) for f in outputs for form in secret_forms(cluster.s3.secret_key)
             if f.exists() and form in f.read_text(errors="replace")]
    assert leaks == []
