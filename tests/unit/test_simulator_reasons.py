"""Every integration test file that can start llm-d-inference-sim says why (issue 47).

In the harness the simulator plays vLLM for any pod of an image the pod runner maps to it
(e2e/workloads.py, rule kind `vllm`: `vllm/vllm-openai`, the image the operator serves a model with
unless `spec.serving.image` names another, base/settings.py `vllm_image`); vLLM's CPU build serves
for real only under `fewerbits-test/vllm-cpu` (rule kind `vllm-cpu`). Read from the code (ast), a
file under tests/integration can start the simulator when it

- names the simulator or its image: a string holding ``vllm/vllm-openai``, ``llm-d-inference-sim``
  or the simulator's ``/admin/config`` API; or
- creates what the operator serves with its default image: a QuantizedModel (``models.apply(...)``,
  ``create_namespaced_custom_object(..., "quantizedmodels", ...)``) or a serving workload from the
  operator's own renderers (``render_deployment``, ``render_lws``), unless every model spec the
  file builds (``model_spec``, ``test_model_spec``, ``model_manifest``) names vLLM's CPU image in
  ``serving.image``.

Each such file's module docstring holds a paragraph that begins ``Simulator:`` and says why the
simulator is enough there (the verdict does not depend on what vLLM answers), or that none of its
models reaches serving. The test fails naming every file without one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"

SIMULATOR_NAMES = ("vllm/vllm-openai", "llm-d-inference-sim", "/admin/config")
"""Strings that name the simulator, the image it plays, or its run-time configuration API."""
REAL_VLLM_IMAGE = "fewerbits-test/vllm-cpu"
"""The image the pod runner serves with vLLM's CPU build (e2e/workloads.py rule kind `vllm-cpu`)."""
SPEC_BUILDERS = {"model_spec", "test_model_spec", "model_manifest"}
"""The helpers that build a QuantizedModel spec (tests/integration/conftest.py, e2e/demo.py)."""
RENDERERS = {"render_deployment", "render_lws"}
"""The operator's renderers of a serving workload (their image: the operator's default)."""
REASON = re.compile(r"^Simulator: (?P<why>.+?)(?:\n[ \t]*\n|\Z)", re.MULTILINE | re.DOTALL)
MIN_REASON_WORDS = 12


def _called(node: ast.Call) -> str:
    """The name a call is made by (``f(...)``, ``x.f(...)``)."""
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _strings(tree: ast.Module) -> list[str]:
    """Every string constant of the code, the module docstring left out."""
    doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and not (doc is not None and n is doc.value)]


def _assignments(tree: ast.Module) -> dict[str, ast.expr]:
    """``name = value`` anywhere in the file (the last one wins)."""
    out: dict[str, ast.expr] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = n.value
    return out


def _resolved(value: ast.expr | None, names: dict[str, ast.expr], depth: int = 0) -> ast.expr | None:
    while isinstance(value, ast.Name) and value.id in names and depth < 8:
        value, depth = names[value.id], depth + 1
    return value


def _names_real_vllm(serving: ast.expr | None, names: dict[str, ast.expr], depth: int = 0) -> bool:
    """Whether a ``serving=`` value is a dict (literal, or ``**`` of one) whose ``image`` is vLLM's CPU image."""
    serving = _resolved(serving, names)
    if not isinstance(serving, ast.Dict) or depth > 8:
        return False
    for key, value in zip(serving.keys, serving.values):
        if key is None and _names_real_vllm(value, names, depth + 1):
            return True
        if isinstance(key, ast.Constant) and key.value == "image":
            image = _resolved(value, names)
            return isinstance(image, ast.Constant) and REAL_VLLM_IMAGE in str(image.value)
    return False


def _creates_served_models(tree: ast.Module) -> bool:
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        name = _called(n)
        if name in RENDERERS:
            return True
        if name == "apply" and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) \
                and n.func.value.id == "models":
            return True
        if name == "create_namespaced_custom_object" and any(
                isinstance(a, ast.Constant) and a.value == "quantizedmodels" for a in n.args):
            return True
    return False


def _every_spec_serves_real_vllm(tree: ast.Module) -> bool:
    names = _assignments(tree)
    builds = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _called(n) in SPEC_BUILDERS]
    return bool(builds) and all(
        any(k.arg == "serving" and _names_real_vllm(k.value, names) for k in call.keywords) for call in builds)


def starts_simulator(source: str) -> bool:
    """Whether a test file's code can start the simulator (the module docstring says how it is read)."""
    tree = ast.parse(source)
    if any(name in s for s in _strings(tree) for name in SIMULATOR_NAMES):
        return True
    return _creates_served_models(tree) and not _every_spec_serves_real_vllm(tree)


def simulator_reason(source: str) -> str | None:
    """The ``Simulator:`` paragraph of the module docstring, when it gives a reason."""
    doc = ast.get_docstring(ast.parse(source)) or ""
    m = REASON.search(doc)
    return m.group("why") if m and len(m.group("why").split()) >= MIN_REASON_WORDS else None


def simulator_files() -> list[Path]:
    return sorted(p for p in INTEGRATION.glob("test_*.py") if starts_simulator(p.read_text()))


def test_every_file_that_can_start_the_simulator_says_why():
    files = simulator_files()
    assert len(files) >= 10, [p.name for p in files]  # the detection finds the files it must
    missing = [p.name for p in files if simulator_reason(p.read_text()) is None]
    assert not missing, (
        f"these integration test files can start llm-d-inference-sim but their docstring has no paragraph "
        f"'Simulator: <why>' (at least {MIN_REASON_WORDS} words): {missing}; serve with vLLM's CPU build "
        f"(serving.image {REAL_VLLM_IMAGE}:1) where the verdict depends on what vLLM does, or say why not")


@pytest.mark.parametrize("source, starts", [
    # A model served with the operator's default image.
    ("def test(models, model_spec):\n    models.apply('ns', 'm', model_spec())\n", True),
    # Every spec names vLLM's CPU build: real vLLM, directly or through names and `**`.
    ("IMAGE = 'fewerbits-test/vllm-cpu:1'\n"
     "def test(models, model_spec):\n    models.apply('ns', 'm', model_spec(serving={'image': IMAGE}))\n", False),
    ("IMAGE = 'fewerbits-test/vllm-cpu:1'\ndef test(models, model_spec):\n    s = {'image': IMAGE}\n"
     "    models.apply('ns', 'm', model_spec(serving={**s, 'extraArgs': []}))\n", False),
    # One spec of two without it: the simulator serves that one.
    ("IMAGE = 'fewerbits-test/vllm-cpu:1'\ndef test(models, model_spec):\n"
     "    models.apply('ns', 'a', model_spec(serving={'image': IMAGE}))\n"
     "    models.apply('ns', 'b', model_spec(serving={'maxModelLen': 256}))\n", True),
    # Another image the runner runs as a command (or kwok fakes): not the simulator.
    ("def test(models, model_spec):\n    models.apply('ns', 'm', model_spec(serving={'image': 'x/other:1'}))\n", True),
    ("def test(c):\n    c.create_namespaced_custom_object('g', 'v', 'ns', 'quantizedmodels', {})\n", True),
    ("def test():\n    render_deployment(None)\n", True),
    ("def test(pods):\n    pods.post('/admin/config', {})\n", True),
    # Names in the docstring alone start nothing; a file without models starts nothing.
    ('"""llm-d-inference-sim, vllm/vllm-openai."""\ndef test(s3):\n    s3.put("x")\n', False),
])
def test_what_counts_as_starting_the_simulator(source, starts):
    assert starts_simulator(source) is starts


def test_a_reason_is_a_paragraph_of_its_own():
    why = "the phases assert exact metric values held for exact windows, which real load cannot hold"
    assert simulator_reason(f'"""Title.\n\nSimulator: {why}.\n\nMore."""') == f"{why}."
    assert simulator_reason('"""Title.\n\nSimulator: yes.\n"""') is None  # too short to be a reason
    assert simulator_reason(f'"""Title.\n\nThe simulator: {why}."""') is None  # not the marker
