"""The runtime's dependency diet: the fetcher needs only the base dependencies (no torch), and
the launch wrapper only the standard library, because it runs inside the vLLM image."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from fewerbits_api import jobcontract
from fewerbits_runtime import errors
from fewerbits_runtime.install import API_MODULES, LAUNCHER_MODULES, install_launcher

RUNTIME = Path(__file__).resolve().parents[2] / "runtime" / "fewerbits_runtime"
ALLOWED_THIRD_PARTY = {"boto3", "botocore", "pydantic", "fewerbits_api"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_runtime_imports_only_base_dependencies():
    for path in RUNTIME.glob("*.py"):
        third_party = _imports(path) - set(sys.stdlib_module_names) - {"torch"}
        assert third_party <= ALLOWED_THIRD_PARTY, (path.name, third_party)
    # torch appears only as the optional, guarded probe in launch.py
    assert [p.name for p in RUNTIME.glob("*.py") if "torch" in _imports(p)] == ["launch.py"]


def test_launcher_modules_need_only_the_standard_library():
    for name in LAUNCHER_MODULES:
        third_party = _imports(RUNTIME / name) - set(sys.stdlib_module_names) - {"torch"}
        assert third_party <= {"fewerbits_api"}, (name, third_party)


def _api_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fewerbits_api."):
            names.add(node.module.split(".")[1] + ".py")
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[1] + ".py" for a in node.names if a.name.startswith("fewerbits_api."))
    return names


def test_the_launcher_copies_every_api_module_it_imports_and_they_need_only_the_standard_library():
    imported = set().union(*(_api_modules(RUNTIME / name) for name in LAUNCHER_MODULES))
    assert imported <= set(API_MODULES), imported - set(API_MODULES)
    api = Path(jobcontract.__file__).parent
    for name in API_MODULES:
        third_party = _imports(api / name) - set(sys.stdlib_module_names)
        assert third_party == set(), (name, third_party)


def test_termination_constants_are_the_job_contracts():
    assert errors.TERMINATION_LOG_ENV is jobcontract.TERMINATION_LOG_ENV
    assert errors.TERMINATION_MESSAGE_MAX_BYTES == jobcontract.TERMINATION_MESSAGE_MAX_BYTES


def test_installed_launcher_runs_without_site_packages(tmp_path):
    lib = install_launcher(tmp_path / "lib")
    install_launcher(lib)  # idempotent: a restarted init container replaces its copy
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(lib), "FEWERBITS_TERMINATION_LOG": str(tmp_path / "t")}
    # -S: no site-packages, so no pydantic and no boto3 (as in a vLLM image we do not control)
    ok = subprocess.run([sys.executable, "-S", "-m", "fewerbits_runtime", "launch", "--format", "fp8-dynamic",
                         "--node-cc", "9.0", "--", "echo", "vllm-started"], env=env, capture_output=True, text=True,
                        timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "vllm-started"
    refused = subprocess.run([sys.executable, "-S", "-m", "fewerbits_runtime", "launch", "--format", "fp8-block",
                              "--node-cc", "8.9", "--", "echo", "x"], env=env, capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == errors.EXIT_GPU_INCOMPATIBLE, refused.stderr
    assert json.loads((tmp_path / "t").read_text())["reason"] == "GPUIncompatible"
    assert sorted(os.listdir(lib)) == ["fewerbits_api", "fewerbits_runtime"]
