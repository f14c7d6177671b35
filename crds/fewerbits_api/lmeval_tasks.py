"""lm-evaluation-harness's built-in tasks, as data: what admission checks a benchmark against.

The quantization Job runs lm-eval (pinned in the `quantjob` extra); the operator does not import
it. ``lmeval_tasks.json.gz`` is generated from the pinned release's own task registry by
``tools/lmeval_index/build.py`` (a unit test regenerates and compares it): every task with its
output type and the metrics its YAML lists, and every group and tag name. With it an unknown task
or a metric the task does not report is refused in the Accepted condition, naming the field,
before any GPU Job is scheduled. A benchmark with ``taskSource`` (the user's own task YAML) is
checked by the Job only, before it loads a model; so are the metrics of groups and tags.
"""

from __future__ import annotations

import gzip
import json
from functools import lru_cache
from importlib import resources

# lm-eval's metrics for a task whose YAML lists none (lm_eval.api.registry.DEFAULT_METRIC_REGISTRY).
DEFAULT_METRICS: dict[str, tuple[str, ...]] = {
    "loglikelihood": ("perplexity", "acc"),
    "loglikelihood_rolling": ("word_perplexity", "byte_perplexity", "bits_per_byte"),
    "multiple_choice": ("acc", "acc_norm"),
    "generate_until": ("exact_match",),
}


@lru_cache(maxsize=1)
def index() -> dict:
    """{"lm_eval": version, "tasks": {name: [output_type, [metrics]]}, "groups": [names]}."""
    data = resources.files("fewerbits_api").joinpath("lmeval_tasks.json.gz").read_bytes()
    return json.loads(gzip.decompress(data))


def benchmark_problems(gate) -> list[str]:
    """Each benchmark of a quality gate whose built-in task is unknown, or whose metric that task
    does not report; each message names its field."""
    if gate is None:
        return []
    idx = index()
    tasks, groups = idx["tasks"], set(idx["groups"])
    out = []
    for i, b in enumerate(gate.benchmarks):
        if b.taskSource is not None:
            continue
        where = f"spec.quantization.qualityGate.benchmarks[{i}]"
        if b.task in groups:
            continue
        if b.task not in tasks:
            out.append(f"{where}.task: {b.task!r} is not a task of lm-eval {idx['lm_eval']} "
                       "(bring your own task YAML with taskSource)")
            continue
        output_type, metrics = tasks[b.task]
        reported = tuple(metrics) or DEFAULT_METRICS.get(output_type or "", ())
        if reported and b.metric not in reported:
            out.append(f"{where}.metric: {b.metric!r} does not fit task {b.task!r} ({output_type}); "
                       f"it reports {', '.join(reported)}")
    return out
