"""Write the index of lm-evaluation-harness's built-in tasks that admission checks benchmarks
against (``fewerbits_api.lmeval_tasks``): every task, group and tag name of the pinned lm-eval
release, with each task's output type and the metrics it reports.

The operator cannot import lm-eval (it is the quantization Job's dependency, with torch), yet an
unknown task or a metric the task does not report must be refused before a GPU Job is scheduled.
The index is data generated from lm-eval's own task registry, so it says exactly what the Job's
lm-eval will accept; ``tests/unit/test_lmeval_index.py`` regenerates it and compares.

    python tools/lmeval_index/build.py          # rewrite crds/fewerbits_api/lmeval_tasks.json.gz
    python tools/lmeval_index/build.py --check  # exit 1 when the stored index differs
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "crds" / "fewerbits_api" / "lmeval_tasks.json.gz"


def _metric_name(metric: str) -> str:
    """A `!function utils.f1` metric arrives as `<install path>/utils.f1`; lm-eval reports it under
    the function's name (`f1`), which is also what keeps the index the same on every machine."""
    return metric.rsplit("/", 1)[-1].rsplit(".", 1)[-1] if "/" in metric else metric


def build() -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks: dict[str, list] = {}
    groups: list[str] = []
    for name, entry in sorted(TaskManager().task_index.items()):
        kind = getattr(entry.kind, "name", str(entry.kind))
        cfg = entry.cfg or {}
        if kind in ("TASK", "PY_TASK"):
            metrics = sorted({_metric_name(m["metric"]) for m in cfg.get("metric_list") or []
                              if isinstance(m, dict) and isinstance(m.get("metric"), str)})
            output = cfg.get("output_type") if isinstance(cfg.get("output_type"), str) else None
            tasks[name] = [output, metrics]
        else:  # a group or a tag: lm-eval runs its tasks; their metrics are checked by the Job
            groups.append(name)
    return {"lm_eval": lm_eval.__version__, "tasks": tasks, "groups": groups}


def encode(index: dict) -> bytes:
    # mtime=0: the same index is the same bytes.
    return gzip.compress(json.dumps(index, sort_keys=True, separators=(",", ":")).encode(), mtime=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    data = encode(build())
    if a.check:
        same = OUT.exists() and OUT.read_bytes() == data
        print(f"{OUT}: {'up to date' if same else 'differs: run tools/lmeval_index/build.py'}")
        return 0 if same else 1
    OUT.write_bytes(data)
    print(f"wrote {OUT} ({len(data)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
