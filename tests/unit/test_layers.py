"""The operator's import layers, read from the source (no import is run): no import cycle, counting
the imports made inside functions (a function-local import that dodges a cycle is a cycle), and no
module importing a layer above its own.

``LAYERS`` is the plan of the subpackages (docs/architecture.md, "Layers"): when the modules move
into ``cli/``, ``runtime/``, ``core/``, ``serving/``, ``artifacts/`` and ``base/``, each layer's rule
is restated per subpackage by editing only the module names here. A new module must be placed in a
layer (the test says which modules are not).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fewerbits_operator

ROOT = Path(fewerbits_operator.__file__).parent
PKG = "fewerbits_operator"

LAYER_PACKAGES: tuple[tuple[str, frozenset[str]], ...] = (
    # top: the commands a person runs
    ("cli", frozenset({"cli", "__main__"})),
    # the long-running process: kopf's registrations, the Lease, queues, loops, HTTP endpoints
    ("runtime", frozenset({"runtime"})),
    # one reconcile: observe -> decide -> execute; and the lifecycles that reuse its steps
    ("core", frozenset({"core"})),
    # the features decide composes: serving (canary, multi-node, routing, rendering), artifacts, the autoscaler
    ("features", frozenset({"serving", "artifacts", "autoscaler"})),
    # values and clients every layer may use: the writes, the facts, the foreign APIs' coordinates,
    # the API and storage clients, settings, metrics, the planner
    ("base", frozenset({"", "base", "planner"})),
)
"""The operator's layers by subpackage (each subpackage's ``__init__`` docstring says what it owns
and may import): a module is in the layer of the subpackage it sits in."""

FORBIDDEN: tuple[tuple[str, str, str], ...] = (
    # (importer, imported prefix, why)
    ("base.kube", "autoscaler", "the autoscaler's status merge lives in its adapter (autoscaler/kube_io.py)"),
    ("base.kube", "serving.lws", "foreign API coordinates live beside the client (apis.py)"),
    ("base.kube", "serving.routing", "foreign API coordinates live beside the client (apis.py)"),
    ("serving.render", "core.nodecache", "render places serving_load's parts; nodecache is the references loop"),
    ("core.decide", "core.observe", "decide is pure: it reads Observed only"),
    ("core.decide", "core.execute", "decide asks for writes; execute makes them"),
    ("core.decide", "base.kube", "decide is pure"),
    ("core.outcome", "core.observe", "decide is pure: it reads Observed only"),
    ("core.outcome", "core.execute", "decide asks for writes; execute makes them"),
    ("core.outcome", "base.kube", "decide is pure"),
    ("core.acceptance", "core.observe", "decide is pure: it reads Observed only"),
    ("core.acceptance", "core.execute", "decide asks for writes; execute makes them"),
    ("core.acceptance", "base.kube", "decide is pure"),
    ("core.artifact_steps", "core.observe", "decide is pure: it reads Observed only"),
    ("core.artifact_steps", "core.execute", "decide asks for writes; execute makes them"),
    ("core.artifact_steps", "base.kube", "decide is pure"),
    ("core.serving_steps", "core.observe", "decide is pure: it reads Observed only"),
    ("core.serving_steps", "core.execute", "decide asks for writes; execute makes them"),
    ("core.serving_steps", "base.kube", "decide is pure"),
    ("serving.canary", "core.decide", "the canary sits below decide; decide composes it"),
    ("serving.canary", "core.serving_steps", "the canary sits below decide's steps; they compose it"),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}
LAYERS: tuple[tuple[str, frozenset[str]], ...] = tuple(
    (layer, frozenset(m for m in MODULES if m.split(".")[0] in packages)) for layer, packages in LAYER_PACKAGES)


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The operator modules an import statement loads, parent packages' ``__init__`` included."""
    is_pkg = MODULES[module].name == "__init__.py"
    here = module.split(".") if module else []
    base = here if is_pkg else here[:-1]
    names: list[str] = []
    if isinstance(node, ast.ImportFrom):
        if node.level:
            prefix = ".".join(base[:len(base) - (node.level - 1)] + ([node.module] if node.module else []))
        elif (node.module or "").startswith(PKG):
            prefix = (node.module or "")[len(PKG) + 1:]
        else:
            return set()
        for alias in node.names:
            sub = f"{prefix}.{alias.name}" if prefix else alias.name
            names.append(sub if sub in MODULES else prefix)
    else:
        names = [a.name[len(PKG) + 1:] for a in node.names if a.name.startswith(PKG + ".")]
    out = set()
    for name in names:
        parts = name.split(".") if name else []
        # Parent packages' __init__ run first, except the importer's own (already running).
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    own = {".".join(here[:i]) for i in range(len(here) + 1)}
    return {m for m in out if m in MODULES and m not in own}


def _type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING" or \
        isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"


def imports(module: str) -> tuple[set[str], set[str]]:
    """(module-level imports, imports inside functions), TYPE_CHECKING blocks left out."""
    tree = ast.parse(MODULES[module].read_text())
    top: set[str] = set()
    local: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            (local if in_function else top).update(_targets(module, node))
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return top, local


GRAPH = {m: imports(m) for m in MODULES}


def strongly_connected(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Tarjan's algorithm: the cycles of the graph (components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return out


def test_every_module_is_in_a_layer():
    placed = set().union(*(mods for _, mods in LAYERS))
    assert sorted(set(MODULES) - placed) == [], "put each new module in a subpackage of LAYER_PACKAGES"
    tops = {m.split(".")[0] for m in MODULES}
    assert sorted(set().union(*(p for _, p in LAYER_PACKAGES)) - tops) == [], "LAYER_PACKAGES names a missing package"


def test_no_import_cycle_even_through_function_local_imports():
    edges = {m: top | local for m, (top, local) in GRAPH.items()}
    assert strongly_connected(edges) == [], "an import cycle (a function-local import counts)"


def test_no_module_imports_a_layer_above_its_own():
    rank = {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}
    up = [f"{m} ({LAYERS[rank[m]][0]}) imports {t} ({LAYERS[rank[t]][0]})"
          for m, (top, local) in GRAPH.items() for t in top | local
          if m in rank and t in rank and rank[t] < rank[m]]  # a function-local import included
    assert up == []


@pytest.mark.parametrize("importer, imported, why", FORBIDDEN)
def test_forbidden_imports(importer, imported, why):
    top, local = GRAPH[importer]
    assert not [t for t in top | local if t == imported or t.startswith(imported + ".")], why


def test_the_checker_sees_cycles_and_local_imports():
    """The graph reader itself: a function-local import is an edge, and a cycle is found."""
    assert "runtime.handlers" in GRAPH["runtime.runner"][1]  # runner's local import is seen
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset({"a", "b", "c"})]


SCREEN = 60
"""Lines any function of the operator may span, its docstring included (one screen)."""


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_function_fits_on_a_screen(module):
    tree = ast.parse(MODULES[module].read_text())
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > SCREEN]
    assert long == []
