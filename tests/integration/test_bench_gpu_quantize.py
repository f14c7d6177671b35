"""bench/gpu_quantize.py on the CPU at the tiny size: every format quantized with the Job's code,
timed, its peak memory recorded and the checkpoint reloaded (on a GPU the same script runs at
hidden 4096; no GPU is lent to CI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fewerbits_api.formats import CONCRETE_FORMATS, QuantFormat

pytestmark = pytest.mark.quantize
REPO = Path(__file__).resolve().parents[2]


def test_every_format_quantizes_reloads_and_is_measured(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_quantize.py"), "--device", "cpu",
                           "--samples", "4", "--seq-len", "32", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["shape"]["hidden_size"] == 256
    rows = {r["format"]: r for r in result["rows"]}
    assert set(rows) == {f.value for f in CONCRETE_FORMATS if f is not QuantFormat.NONE}
    for fmt, row in rows.items():
        assert row["ok"] and row["reloads"], row
        assert row["seconds"] > 0 and row["peak_memory_bytes"] > 0 and row["checkpoint_bytes"] > 0
        assert row["awq_cpu_guard"] is (fmt == "w4a16-awq")  # no accelerator here: the Job's guard ran
    # 4-bit formats write smaller checkpoints than 8-bit ones.
    assert rows["w4a16-gptq"]["checkpoint_bytes"] < rows["fp8-dynamic"]["checkpoint_bytes"]
