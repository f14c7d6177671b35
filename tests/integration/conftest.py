"""Fixtures for the operator's integration tests on the real control plane."""

from __future__ import annotations

import time

import pytest
from kubernetes import client

from e2e import demo
from e2e.serviceproxy import publish_host_process
from tests.integration.operator_harness import REPO, Models, OperatorProcess, free_port

ACTIVATOR_NAMESPACE = "fewerbits-harness"
ACTIVATOR_SERVICE = "fewerbits-activator"
ACTIVATOR_QUEUE = 4
ACTIVATOR_UNPUBLISHED: list[str] = []



@pytest.fixture(scope="session")
def crds_installed(cluster):
    cluster.kubectl("apply", "-f", str(REPO / "crds" / "bases"))
    ext = client.ApiextensionsV1Api(cluster.api_client())
    deadline = time.monotonic() + 60
    for crd in ("quantizedmodels.fewerbits.io", "quantizationpolicies.fewerbits.io"):
        # `kubectl wait` errors while the CRD has no conditions yet; poll the API instead.
        while not any(c.type == "Established" and c.status == "True"
                      for c in ext.read_custom_resource_definition(crd).status.conditions or []):
            assert time.monotonic() < deadline, f"CRD {crd} not established after 60s"
            time.sleep(0.2)
    return True


@pytest.fixture(scope="session")
def test_model_uri(cluster) -> str:
    """The tiny trained test model, uploaded to the cluster's S3 server as an s3:// source."""
    return demo.upload_test_model(cluster)


@pytest.fixture(scope="session")
def activator(cluster, crds_installed, tmp_path_factory):
    """The scale-from-zero activator, its own process as in the chart (its own Deployment)."""
    log = tmp_path_factory.mktemp("activator") / "activator.log"
    # Small, so a burst past it is cheap to test (test_scale_from_zero.py).
    act = OperatorProcess.activator(cluster.kubeconfig, log, free_port(),
                                    {"FEWERBITS_ACTIVATOR_QUEUE": str(ACTIVATOR_QUEUE)}).start()
    try:
        act.wait_serving()
        yield act
    finally:
        act.stop()


@pytest.fixture(scope="session")
def operator(cluster, crds_installed, tmp_path_factory, activator):
    # The activator is published as the chart publishes it (its own Service), so the operator puts
    # it in the Service path of models at zero (atzero.py); see e2e/serviceproxy.py.
    env = {"FEWERBITS_ACTIVATOR_SYNC_SECONDS": "1"}
    try:
        publish_host_process(cluster.api_client(), ACTIVATOR_NAMESPACE, ACTIVATOR_SERVICE, activator.activator_port)
        env["FEWERBITS_ACTIVATOR_SERVICE"] = f"{ACTIVATOR_NAMESPACE}/{ACTIVATOR_SERVICE}"
    except RuntimeError as e:  # no global address here: only the scale-from-zero test needs it, and fails saying so
        ACTIVATOR_UNPUBLISHED.append(str(e))
    op = OperatorProcess(cluster.kubeconfig, tmp_path_factory.mktemp("operator") / "operator.log",
                         env_extra=env).start()
    try:
        yield op
    finally:
        op.stop()


@pytest.fixture(scope="session")
def models(cluster, operator) -> Models:
    return Models(cluster.api_client(), operator)


@pytest.fixture
def s3_secret(cluster, namespace) -> str:
    """A Secret with the S3 server's credentials in the test namespace."""
    demo.create_s3_secret(cluster, namespace, "s3-credentials")
    return "s3-credentials"


@pytest.fixture
def model_spec(cluster, test_model_uri, s3_secret, namespace):
    """A spec factory: the test model from S3, artifacts to S3 under a prefix of this test's own (so
    one test's artifacts are never another's cache hits), both with the test Secret."""
    def make(**overrides) -> dict:
        return demo.test_model_spec(cluster.s3.endpoint, test_model_uri, s3_secret, namespace, **overrides)
    return make
