"""A cloud metadata endpoint in a spec is refused before the operator or any Job connects to it.

Simulator: none starts. The model is refused at Accepted, before any Job or Deployment, so the
default vLLM image of its spec (llm-d-inference-sim in this harness) never runs."""

from __future__ import annotations

import pytest

from tests.integration.test_operator import reconciled_again

pytestmark = [pytest.mark.cluster]


def test_a_metadata_storage_endpoint_is_refused_and_no_job_runs(namespace, models, model_spec):
    spec = model_spec()
    spec["storage"] = {**spec["storage"], "endpoint": "http://169.254.169.254"}
    models.apply(namespace, "metadata", spec)
    c = models.wait_condition(namespace, "metadata", "Accepted", status="False", reason="InvalidSpec")
    assert c["message"].startswith("spec.storage.endpoint: http://169.254.169.254 is refused: "
                                   "169.254.169.254 is a cloud metadata service address"), c["message"]
    # What it would do of this spec, it has done (a refused model resyncs every ~30 s).
    reconciled_again(models, namespace, "metadata", times=2, timeout=120)
    assert models.jobs(namespace) == []
    status = models.get(namespace, "metadata")["status"]
    assert not status.get("artifacts") and not models.deployments(namespace, "metadata")
