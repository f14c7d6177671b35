"""Markdown tables from bench/bench_startup.py's JSON, written between markers into docs and README.

    python bench/startup_table.py [bench/results/startup.json bench/results/startup-e2e-4gib.json] [--write]

Without --write it prints the tables. With it, it replaces what stands between
``<!-- startup-bench:BEGIN NAME -->`` and ``<!-- startup-bench:END NAME -->`` in docs/startup.md
(NAME: loaders, e2e, knobs: from bench/results/startup-knob-*.json) and README.md (NAME: readme), so the tables always come from the JSON.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOADERS = ["fewerbits", "fewerbits-hit", "boto3", "boto3+fsync", "s5cmd", "runai"]
LABEL = {"fewerbits": "fetcher, cold node", "fewerbits-hit": "fetcher, node-cache hit", "boto3": "boto3 download_file",
         "boto3+fsync": "boto3 + fsync", "s5cmd": "s5cmd cp", "runai": "Run:ai streamer → memory"}


def _row(doc: dict, size: float, prof: str, loader: str) -> dict | None:
    return next((r for r in doc["results"] if r["sizeGiB"] == size and r["profile"] == prof and r["loader"] == loader),
                None)


def _failed(doc: dict, size: float, prof: str, loader: str) -> bool:
    return any(e.get("sizeGiB") == size and e.get("profile") == prof and e.get("loader") == loader
               for e in doc.get("errors", []))


def loaders_table(doc: dict) -> str:
    sizes = sorted({r["sizeGiB"] for r in doc["results"]})
    profiles = list(doc["network"]["profiles"])
    out = ["| size | profile | " + " | ".join(LABEL[x] for x in LOADERS) + " |",
           "|---|---|" + "---|" * len(LOADERS)]
    for s in sizes:
        for p in profiles:
            cells = []
            for x in LOADERS:
                r = _row(doc, s, p, x)
                if r is None:
                    cells.append("failed (JSON errors)" if _failed(doc, s, p, x) else "–")
                elif x == "fewerbits-hit":
                    cells.append(f"{r['seconds']:.2f} s ({r.get('inProcessSeconds', 0):.2f} s in process), "
                                 f"{r['cpuSeconds']:.2f} CPU s")
                else:
                    ratio = r.get("vsBoto3")
                    cells.append(f"{r['MBps']:.0f} MB/s, {r['cpuSeconds']:.1f} CPU s"
                                 + (f", **{ratio:.2f}x**" if ratio is not None and x != "boto3" else ""))
            out.append(f"| {s:g} GiB | {p} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def e2e_table(doc: dict) -> str:
    out = [("| size | profile | path | scheduling* | fetch | engine start | load | engine init | first token | "
            "**decision → first token** | fetch CPU s | vLLM CPU s |"),
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc.get("e2e", []):
        def f(k: str, r: dict = r) -> str:
            v = r.get(k)
            return "–" if v is None else f"{v:.2f}"
        out.append(f"| {r['sizeGiB']:g} GiB | {r['profile']} | {r['path']} | {f('schedulingS')} | {f('fetchS')} | "
                   f"{f('engineStartS')} | {f('loadS')} | {f('engineInitS')} | {f('firstTokenS')} | "
                   f"**{f('decisionToFirstTokenS')}** | {f('fetchCpuS')} | {f('vllmCpuS')} |")
    for e in doc.get("errors", []):
        if "e2e" in e:
            out.append(f"| {e['sizeGiB']:g} GiB | {e['profile']} | {e['e2e']} | failed: see the JSON's errors "
                       "| | | | | | | | |")
    return "\n".join(out)


def knobs_table(main: dict, knob_paths: list[Path]) -> str:
    """The fetcher's threads and part size against boto3 and s5cmd of the same run, 1 GiB at 20 ms."""
    out = ["| run | fetcher | boto3 | s5cmd | fetcher / boto3 | fetcher / s5cmd | fetcher CPU s | load average |",
           "|---|---|---|---|---|---|---|---|"]
    runs = [("16 threads, 32 MiB parts (default; the main run)", main)]
    for p in knob_paths:
        d = json.loads(p.read_text())
        runs.append((d["loaders"]["fewerbits"].split("ranged GETs on ", 1)[1].split(", sha256")[0]
                     .replace(" MiB parts", " MiB parts") + f" (`{p.name}`)", d))
    for label, d in runs:
        rows = {x: _row(d, 1.0, "cross-zone", x) for x in ("fewerbits", "boto3", "s5cmd")}
        if not all(rows.values()):
            continue
        fb, b3, s5 = (rows[x]["MBps"] for x in ("fewerbits", "boto3", "s5cmd"))
        out.append(f"| {label} | {fb:.0f} MB/s | {b3:.0f} MB/s | {s5:.0f} MB/s | {fb / b3:.2f}x | {fb / s5:.2f}x | "
                   f"{rows['fewerbits']['cpuSeconds']:.2f} | {rows['fewerbits']['loadAvg1mBefore']:.1f} |")
    return "\n".join(out)


def readme_table(doc: dict) -> str:
    goal = [p for p in doc["network"]["profiles"] if p == "cross-zone"] or list(doc["network"]["profiles"])[:1]
    out = ["| artifact, profile | fetcher (cold) | boto3 | boto3 + fsync | s5cmd | Run:ai → memory | node-cache hit |",
           "|---|---|---|---|---|---|---|"]
    for s in sorted({r["sizeGiB"] for r in doc["results"]}):
        for p in doc["network"]["profiles"]:
            def c(x: str, s: float = s, p: str = p) -> str:
                r = _row(doc, s, p, x)
                if r is None:
                    return "–"
                if x == "fewerbits-hit":
                    return f"{r['seconds']:.2f} s"
                ratio = "" if x == "boto3" or r.get("vsBoto3") is None else f" ({r['vsBoto3']:.2f}x)"
                return f"{r['MBps']:.0f} MB/s{ratio}"
            name = f"**{s:g} GiB, {p}**" if p in goal else f"{s:g} GiB, {p}"
            out.append(f"| {name} | " + " | ".join(c(x) for x in ("fewerbits", "boto3", "boto3+fsync", "s5cmd",
                                                                      "runai", "fewerbits-hit")) + " |")
    return "\n".join(out)


DEFAULT_FILES = [REPO / "bench" / "results" / "startup.json", REPO / "bench" / "results" / "startup-e2e-4gib.json"]


def merge(paths: list[Path]) -> dict:
    """The first file's settings and loader rows; the end-to-end rows of every file. A later file's
    end-to-end run of the same size, profile and path supersedes an earlier one's failure (kept in
    that file's JSON, with its message)."""
    docs = [json.loads(p.read_text()) for p in paths if p.exists()]
    doc = dict(docs[0])
    doc["results"] = [r for d in docs for r in d["results"]]
    doc["e2e"] = [r for d in docs for r in d.get("e2e", [])]
    done = {(r["sizeGiB"], r["profile"], r["path"]) for r in doc["e2e"]}
    doc["errors"] = [e for d in docs for e in d.get("errors", [])
                     if "e2e" not in e or (e["sizeGiB"], e["profile"], e["e2e"]) not in done]
    return doc


def replace(path: Path, name: str, text: str) -> None:
    src = path.read_text()
    pat = re.compile(rf"(<!-- startup-bench:BEGIN {name} -->)\n.*?(<!-- startup-bench:END {name} -->)", re.DOTALL)
    if not pat.search(src):
        raise SystemExit(f"{path}: no startup-bench markers for {name}")
    path.write_text(pat.sub(lambda m: m.group(1) + "\n" + text + "\n" + m.group(2), src))


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    doc = merge([Path(a) for a in args] or DEFAULT_FILES)
    main_doc = json.loads((args and Path(args[0]) or DEFAULT_FILES[0]).read_text())
    knobs = sorted((REPO / "bench" / "results").glob("startup-knob-*.json"))
    tables = {"loaders": loaders_table(doc), "e2e": e2e_table(doc), "readme": readme_table(doc),
              "knobs": knobs_table(main_doc, knobs)}
    if "--write" in sys.argv:
        replace(REPO / "docs" / "startup.md", "loaders", tables["loaders"])
        replace(REPO / "docs" / "startup.md", "e2e", tables["e2e"])
        replace(REPO / "docs" / "startup.md", "knobs", tables["knobs"])
        replace(REPO / "README.md", "readme", tables["readme"])
    else:
        for k, v in tables.items():
            print(f"## {k}\n\n{v}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
