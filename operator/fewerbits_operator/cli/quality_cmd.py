"""``fewerbits quality NAME -n NS``: the quality table of a QuantizedModel's artifacts, one row
per metric (base, quantized, recovery, threshold, verdict, evaluation time), read from
``status.artifacts[].quality`` as the operator judged it with the model's own gate; then, per
variant, the served configuration's scores from its serving canary (``status.serving[].canary``,
docs/canary.md) beside the base model's and the Job's."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fewerbits_api.quantizedmodel import QuantizedModelStatus

from fewerbits_operator.cli.explain_cmd import KubeReader


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quality", help="per-metric quality of a QuantizedModel's artifacts (base, quantized, recovery)")
    p.add_argument("name", metavar="NAME", help="the QuantizedModel")
    p.add_argument("-n", "--namespace", default="default", help="its namespace (default: default)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    p.add_argument("--context", default=None, help="kubeconfig context (default: the current one)")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.set_defaults(func=run)


def rows(status: QuantizedModelStatus) -> list[dict[str, Any]]:
    out = []
    for a in status.artifacts:
        q = a.quality
        for m in (q.metrics if q else []):
            out.append({"format": a.format.value, "key": a.key[:12], "metric": m.name, "base": m.base,
                        "quantized": m.quantized, "recoveryPercent": m.recoveryPercent,
                        "minRecoveryPercent": m.minRecoveryPercent, "noisePercent": m.noisePercent,
                        "passed": m.passed, "samples": m.samples, "seconds": m.seconds})
        for name in (q.missing if q else []):
            out.append({"format": a.format.value, "key": a.key[:12], "metric": name, "passed": False,
                        "note": "not measured under the current gate"})
    return out


def served_rows(status: QuantizedModelStatus) -> list[dict[str, Any]]:
    """Per variant and metric: the base score, the Job's (transformers, 16-bit KV cache) and the
    served one (the canary: vLLM's kernels, the variant's KV-cache dtype)."""
    out = []
    for s in status.serving:
        c = s.canary
        if c is None:
            continue
        for m in c.metrics:
            out.append({"variant": s.variant, "configHash": c.configHash[:12], "kvCacheDtype": c.kvCacheDtype,
                        "phase": c.phase, "metric": m.name, "base": m.base, "job": m.jobQuantized,
                        "served": m.served, "recoveryPercent": m.recoveryPercent,
                        "minRecoveryPercent": m.minRecoveryPercent, "passed": m.passed, "samples": m.samples})
        if not c.metrics:
            out.append({"variant": s.variant, "configHash": c.configHash[:12], "kvCacheDtype": c.kvCacheDtype,
                        "phase": c.phase, "metric": "-", "note": c.reason})
        for sk in c.skipped:
            out.append({"variant": s.variant, "configHash": c.configHash[:12], "kvCacheDtype": c.kvCacheDtype,
                        "phase": c.phase, "metric": sk.name, "note": f"skipped: {sk.reason}"})
    return out


def served_table(status: QuantizedModelStatus) -> str:
    header = ("VARIANT", "CONFIG", "KV", "CANARY", "METRIC", "BASE", "JOB", "SERVED", "RECOVERY", "MIN", "PASSED", "N")
    lines = [header]
    for r in served_rows(status):
        if "note" in r:
            lines.append((r["variant"], r["configHash"], r["kvCacheDtype"], r["phase"], r["metric"], "-", "-", "-",
                          "-", "-", "-", r["note"][:100]))
            continue
        job = f"{r['job']:.4g}" if r["job"] is not None else "-"
        lines.append((r["variant"], r["configHash"], r["kvCacheDtype"], r["phase"], r["metric"], f"{r['base']:.4g}",
                      job, f"{r['served']:.4g}", f"{r['recoveryPercent']:.1f}%", f"{r['minRecoveryPercent']:.1f}%",
                      str(r["passed"]).lower(), str(r["samples"])))
    if len(lines) == 1:
        return ""
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(header))]
    return "\nServed (serving canary):\n" + "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines) + "\n"


def table(status: QuantizedModelStatus) -> str:
    header = ("FORMAT", "ARTIFACT", "METRIC", "BASE", "QUANTIZED", "RECOVERY", "MIN", "NOISE", "PASSED", "N", "SECONDS")
    lines = [header]
    for r in rows(status):
        if "note" in r:
            lines.append((r["format"], r["key"], r["metric"], "-", "-", "-", "-", "-", "false", "-", r["note"]))
            continue
        noise = f"±{r['noisePercent']:.1f}" if r["noisePercent"] is not None else "-"
        lines.append((r["format"], r["key"], r["metric"], f"{r['base']:.4g}", f"{r['quantized']:.4g}",
                      f"{r['recoveryPercent']:.1f}%", f"{r['minRecoveryPercent']:.1f}%", noise,
                      str(r["passed"]).lower(), str(r["samples"]), f"{r['seconds']:.1f}"))
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(header))]
    text = "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines)
    if len(lines) == 1:
        text += "\n(no quality figures yet: the artifacts are not published or not judged)"
    return text + "\n"


def run(args: argparse.Namespace, reader=None) -> int:
    reader = reader or KubeReader(context=args.context, kubeconfig=args.kubeconfig)
    obj = reader.get_model(args.namespace, args.name)
    if obj is None:
        print(f"QuantizedModel {args.namespace}/{args.name} not found", file=sys.stderr)
        return 1
    status = QuantizedModelStatus.model_validate(obj.get("status") or {})
    if args.output == "json":
        print(json.dumps([{"table": "job", **r} for r in rows(status)] + [{"table": "served", **r} for r in served_rows(status)], indent=2))
    else:
        sys.stdout.write(table(status) + served_table(status))
    return 0
