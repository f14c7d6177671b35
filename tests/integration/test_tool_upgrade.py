"""Upgrades that do not re-quantize (issue 16, item 4), on the real control plane: the operator
starts with one tool-version pin, is restarted as an upgrade (another quantization image with
another llm-compressor), and nothing re-runs: the artifact keeps serving and its Quantized condition
says which tools made it. Then the model asks for re-quantization (`spec.quantization.requantize`):
exactly one new Job runs, and the model is Ready on the new artifact.

Simulator: the verdict is which Jobs run across an upgrade and what the Quantized condition says;
the model serves with the operator's default vLLM image, played by llm-d-inference-sim, and its
roll-out to the new artifact is judged by the Deployment and conditions, not by vLLM's answers."""

from __future__ import annotations

import json

import pytest

from fewerbits_api.artifact import QUANTJOB_TOOL_VERSIONS
from tests.integration.test_operator import model_reconciles
from tests.integration.test_storage_identity import FP8, ready_at

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]

UPGRADED = {"FEWERBITS_QUANTJOB_IMAGE": "ghcr.io/fewerbits/fewerbits-quantjob:0.2.0",
            "FEWERBITS_QUANTJOB_TOOLS": json.dumps({**QUANTJOB_TOOL_VERSIONS, "llmcompressor": "0.15.0"})}


@pytest.fixture
def pinned_operator(operator):
    """The session's operator, restarted with an explicit tool pin; restored afterwards."""
    saved = dict(operator.env_extra)
    operator.env_extra.update({"FEWERBITS_QUANTJOB_TOOLS": json.dumps(QUANTJOB_TOOL_VERSIONS)})
    operator.restart()
    try:
        yield operator
    finally:
        operator.env_extra.clear()
        operator.env_extra.update(saved)
        operator.restart()


def test_an_operator_upgrade_requantizes_only_when_asked(gpu_pool, namespace, models, model_spec, pinned_operator):
    gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    models.apply(namespace, "up", model_spec(quantization=FP8))
    before = ready_at(models, namespace, "up", 1)
    (art,) = before["artifacts"]
    assert art["tools"]["llmcompressor"] == QUANTJOB_TOOL_VERSIONS["llmcompressor"]
    (job,) = models.jobs(namespace)
    (dep,) = models.deployments(namespace, "up")

    # The upgrade: another quantization image, other tool versions. Nothing re-runs.
    pinned_operator.env_extra.update(UPGRADED)
    pinned_operator.restart()
    models.wait("two reconciles by the upgraded operator", lambda: model_reconciles(models, namespace, "up") >= 2,
                timeout=120, namespace=namespace, name="up")
    assert [j.metadata.name for j in models.jobs(namespace)] == [job.metadata.name]
    (same,) = models.deployments(namespace, "up")
    assert same.metadata.generation == dep.metadata.generation
    q = models.condition(namespace, "up", "Quantized")
    assert q["status"] == "True" and "the quantization image has llmcompressor 0.15.0" in q["message"]
    assert models.condition(namespace, "up", "Ready")["status"] == "True"
    assert models.get(namespace, "up")["status"]["artifacts"][0]["key"] == art["key"]

    # Asked for: exactly one new Job, a new key, Ready on it.
    models.patch_spec(namespace, "up", {"quantization": {"requantize": "llmcompressor-0.15"}})
    after = ready_at(models, namespace, "up", 2)
    (new,) = after["artifacts"]
    assert new["key"] != art["key"] and new["job"] != job.metadata.name
    assert sorted(j.metadata.name for j in models.jobs(namespace)) == sorted([job.metadata.name, new["job"]])
    (rolled,) = models.deployments(namespace, "up")
    assert rolled.metadata.annotations["fewerbits.io/artifact-key"] == new["key"]
