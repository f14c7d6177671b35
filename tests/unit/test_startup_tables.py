"""The startup bench's tables in README.md and docs/startup.md are the committed JSON's
(``bench/startup_table.py --write``), and the JSON holds every loader on every profile."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.benchmod import load_bench

REPO = Path(__file__).resolve().parents[2]
tables = load_bench("startup_table")


def _block(path: Path, name: str) -> str:
    m = re.search(rf"<!-- startup-bench:BEGIN {name} -->\n(.*?)\n<!-- startup-bench:END {name} -->",
                  path.read_text(), re.DOTALL)
    assert m, f"{path}: no startup-bench block {name}"
    return m.group(1)


@pytest.mark.parametrize("doc, name", [("README.md", "readme"), ("docs/startup.md", "loaders"),
                                       ("docs/startup.md", "e2e"), ("docs/startup.md", "knobs")])
def test_each_table_is_the_committed_json(doc, name):
    merged = tables.merge(tables.DEFAULT_FILES)
    main = json.loads(tables.DEFAULT_FILES[0].read_text())
    knobs = sorted((REPO / "bench" / "results").glob("startup-knob-*.json"))
    render = {"readme": tables.readme_table, "loaders": tables.loaders_table, "e2e": tables.e2e_table}
    want = tables.knobs_table(main, knobs) if name == "knobs" else render[name](merged)
    assert _block(REPO / doc, name) == want


def test_every_loader_ran_on_every_profile_and_size():
    doc = tables.merge(tables.DEFAULT_FILES)
    seen = {(r["sizeGiB"], r["profile"], r["loader"]) for r in doc["results"]}
    sizes = {s for s, _, _ in seen}
    profiles = {p for _, p, _ in seen}
    loaders = {ldr for _, _, ldr in seen}
    assert sizes == {1, 4} and {"loopback", "same-zone", "cross-zone"} <= profiles
    assert {"fewerbits", "boto3", "s5cmd"} <= loaders, loaders
    assert {(s, p, ldr) for s in sizes for p in profiles for ldr in loaders} == seen
