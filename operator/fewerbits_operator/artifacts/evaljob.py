"""The evaluation-only Job: an existing artifact measured under the current quality gate.

A changed evaluation identity (fewerbits_api.quality.eval_identity: the evaluation set, window
count, benchmarks, custom set) re-evaluates; it never re-quantizes. The Job is the quantization
Job's image and pod (render_job) with the contract's ``mode: evaluate``: it fetches the base model
and the artifact, measures both, and writes ``<key>/quality/<identity>.json``; the artifact's
files and manifest are never written. Pure: typed inputs, a Job object out.
"""

from __future__ import annotations

from typing import Any

from fewerbits_api.quality import eval_identity

from fewerbits_operator.serving.render import LABEL_COMPONENT, render_job

JOB_PREFIX = "fewerbits-quantize-"
EVAL_PREFIX = "fewerbits-evaluate-"
IDENTITY_CHARS = 8


def eval_job_name(quantize_job_name: str, identity: str) -> str:
    """``fewerbits-evaluate-<key[:24]>-<destination[:10]>-<identity[:8]>`` (63 characters at
    most): one evaluation Job per artifact, destination and evaluation identity."""
    return f"{EVAL_PREFIX}{quantize_job_name.removeprefix(JOB_PREFIX)}-{identity[:IDENTITY_CHARS]}"[:63]


def render_eval_job(owner, spec, artifact, placement, gate, settings) -> dict[str, Any]:
    job = render_job(owner, spec, artifact, placement, gate, settings, mode="evaluate")
    identity = eval_identity(gate)
    name = eval_job_name(job["metadata"]["name"], identity)
    job["metadata"]["name"] = name
    for labels in (job["metadata"]["labels"], job["spec"]["template"]["metadata"]["labels"]):
        labels[LABEL_COMPONENT] = "evaluate"
    return job
