"""Join the zoo's rows (tools/vllm_check/zoo_quantize.py) with vLLM's load results
(tools/vllm_check/load_check.py) and, when given, vLLM's CPU build serving each artifact
(tools/vllm_check/serve_check.py): print the architecture × format table, write the JSON
``[{"architecture", "format", "result": "loads"|"refused"|"fails", "detail",
"served": {"result": "served"|"refused"|"fails"|"not run", "detail", ...}}]`` (``served`` only on rows
with an artifact, when served), exit 1 on a ``fails`` row or a ``fails`` served result.

    python -m tools.vllm_check.report ROWS.json LOADS.json [--served SERVED.json] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


SERVED_KEYS = ("result", "detail", "root_cause", "start_seconds", "vllm_cpu", "cpu_level")


def join(rows: list[dict], loads: list[dict], served: list[dict] | None = None) -> list[dict]:
    by_path = {(r["path"], r.get("capability")): r for r in loads}
    served_by_path = {r["path"]: r for r in served or []}
    out = []
    for row in rows:
        entry = {"architecture": row["architecture"], "format": row["format"]}
        if "result" in row:  # refused by the planner, or the quantization failed
            entry |= {"result": row["result"], "detail": row["detail"]}
        else:
            load = by_path.get((row["artifact"], row.get("capability")))
            if load is None:
                entry |= {"result": "fails", "detail": "the load check has no result for " + row["artifact"]}
            else:
                prefix = f"{row['detail']}: " if row.get("detail") else ""
                entry |= {"result": load["result"], "detail": prefix + load["detail"]}
                entry["capability"] = row.get("capability")
                for k in ("methods", "float_casts", "unfilled_unread", "patched", "vllm"):
                    if k in load:
                        entry[k] = load[k]
            if row.get("artifact_ignore") is not None:
                entry["artifact_ignore"] = row["artifact_ignore"]
            if served is not None:
                s = served_by_path.get(row["artifact"]) or {
                    "result": "fails", "detail": "the serve check has no result for " + row["artifact"]}
                entry["served"] = {k: s[k] for k in SERVED_KEYS if k in s}
        out.append(entry)
    return out


def cell_text(r: dict) -> str:
    """A row's cell: its load result, then what vLLM's CPU build did with it when served."""
    return r["result"] + (f"/{r['served']['result']}" if "served" in r else "")


def table(results: list[dict]) -> str:
    archs = list(dict.fromkeys(r["architecture"] for r in results))
    formats = list(dict.fromkeys(r["format"] for r in results))
    cell = {(r["architecture"], r["format"]): cell_text(r) for r in results}
    width = max(len(c) for c in [*formats, *cell.values(), "refused"])
    lines = [f"{'architecture':16} " + " ".join(f"{f:{width}}" for f in formats)]
    for a in archs:
        lines.append(f"{a:16} " + " ".join(f"{cell.get((a, f), '-'):{width}}" for f in formats))
    notes = [f"  {r['architecture']} × {r['format']}: {r['result']}: {r['detail']}"
             for r in results if r["result"] != "loads"]
    notes += [f"  {r['architecture']} × {r['format']}: {r['served']['result']} by vLLM's CPU build: "
              f"{r['served']['detail']}" for r in results if r.get("served", {}).get("result", "served") != "served"]
    return "\n".join(lines + ([""] + notes if notes else []))


def counts(results: list[dict]) -> str:
    """One line: how many rows load, are refused, fail; and what vLLM's CPU build did with them."""
    line = (f"{len(results)} rows: {sum(r['result'] == 'loads' for r in results)} load, "
            f"{sum(r['result'] == 'refused' for r in results)} refused by the planner, "
            f"{sum(r['result'] == 'fails' for r in results)} fail")
    served = [r["served"]["result"] for r in results if "served" in r]
    if served:
        levels = sorted({str(r["served"].get("cpu_level") or "CPU level not recorded") for r in results if "served" in r})
        line += (f"; served by vLLM's CPU build ({', '.join(levels)}): {served.count('served')} served, "
                 f"{served.count('refused')} refused at start, {served.count('fails')} fail")
        if served.count("not run"):
            line += f", {served.count('not run')} not run"
    return line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows")
    ap.add_argument("loads")
    ap.add_argument("--served", help="serve_check.py's results: adds the served column")
    ap.add_argument("--json", help="write the joined results here")
    args = ap.parse_args(argv)
    rows = json.loads(Path(args.rows).read_text())
    loads = json.loads(Path(args.loads).read_text()) if Path(args.loads).exists() else []
    served = json.loads(Path(args.served).read_text()) if args.served else None
    results = join(rows, loads, served)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print("\n" + counts(results))
    failed = [r for r in results if r["result"] == "fails" or r.get("served", {}).get("result") == "fails"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
