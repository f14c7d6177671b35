"""Join the zoo's rows (tools/vllm_check/zoo_quantize.py) with vLLM's load results
(tools/vllm_check/load_check.py): print the architecture × format table, write the JSON
``[{"architecture", "format", "result": "loads"|"refused"|"fails", "detail"}]``, exit 1 on a
``fails`` row.

    python -m tools.vllm_check.report ROWS.json LOADS.json [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def join(rows: list[dict], loads: list[dict]) -> list[dict]:
    by_path = {(r["path"], r.get("capability")): r for r in loads}
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
        out.append(entry)
    return out


def table(results: list[dict]) -> str:
    archs = list(dict.fromkeys(r["architecture"] for r in results))
    formats = list(dict.fromkeys(r["format"] for r in results))
    cell = {(r["architecture"], r["format"]): r["result"] for r in results}
    width = max(len(f) for f in formats + ["refused"])
    lines = [f"{'architecture':16} " + " ".join(f"{f:{width}}" for f in formats)]
    for a in archs:
        lines.append(f"{a:16} " + " ".join(f"{cell.get((a, f), '-'):{width}}" for f in formats))
    notes = [f"  {r['architecture']} × {r['format']}: {r['result']}: {r['detail']}"
             for r in results if r["result"] != "loads"]
    return "\n".join(lines + ([""] + notes if notes else []))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows")
    ap.add_argument("loads")
    ap.add_argument("--json", help="write the joined results here")
    args = ap.parse_args(argv)
    rows = json.loads(Path(args.rows).read_text())
    loads = json.loads(Path(args.loads).read_text()) if Path(args.loads).exists() else []
    results = join(rows, loads)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    failed = [r for r in results if r["result"] == "fails"]
    print(f"\n{len(results)} rows: {sum(r['result'] == 'loads' for r in results)} load, "
          f"{sum(r['result'] == 'refused' for r in results)} refused by the planner, {len(failed)} fail")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
