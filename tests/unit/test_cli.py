"""The `fewerbits` command: subcommands wired, `validate` names the field of each error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from fewerbits_operator.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def test_console_script_is_installed():
    out = subprocess.run([Path(sys.executable).parent / "fewerbits", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "validate" in out.stdout


def test_validate_samples_pass(capsys):
    assert main(["validate", *map(str, sorted((REPO / "crds/samples").glob("*.yaml")))]) == 0
    assert "QuantizationPolicy/platform-default: valid" in capsys.readouterr().out


def test_validate_reports_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({
        "apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizedModel",
        "metadata": {"name": "m"}, "spec": {"source": {"uri": "hf://a/b"}, "autoscaling": {"maxReplicas": 0}},
    }))
    assert main(["validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "spec.autoscaling.maxReplicas: Input should be greater than or equal to 1" in err


def test_crds_subcommand_prints_both(capsys):
    assert main(["crds"]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert {d["spec"]["names"]["kind"] for d in docs} == {"QuantizedModel", "QuantizationPolicy"}
