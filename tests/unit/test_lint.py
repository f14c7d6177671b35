"""The repository passes ruff with the rules in pyproject.toml ([tool.ruff]); it runs in every
test run, CI's included (ruff is pinned in the [dev] extra, beside the interpreter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    ruff = Path(sys.executable).with_name("ruff")
    assert ruff.exists(), f"{ruff} missing: install the [dev] extra (pip install -e '.[dev]')"
    out = subprocess.run([str(ruff), "check", "--no-cache", "--output-format", "concise", str(REPO)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
