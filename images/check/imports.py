"""What an image's code imports, mapped to the distributions that provide it, and whether its SBOM
lists them (the image-mode e2e runs the first half in each image pulled from the registry).

    python3.11 -I imports.py MODULE...       # in the image: JSON on stdout

From the image's entrypoint packages (`fewerbits_quantjob` for the quantjob image) it follows the
project's own imports through the project's sources (every `import` and `from ... import` in a
module, the lazy ones inside functions too, not those under `if TYPE_CHECKING:`), and collects the
top-level name of every other module that is not the standard library. Each is mapped to the
distributions that provide it in the environment it runs in (importlib.metadata), so the answer is
about the image, not the host. An import inside `try: ... except ImportError` is optional: it may be
missing. Standard library only: it runs in the images, which have nothing else.

`sbom_problems` (run on the host) compares that answer and the image's declared pins with the SBOM.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

PROJECT = ("fewerbits_api", "fewerbits_operator", "fewerbits_quantjob", "fewerbits_runtime")
OPTIONAL_CATCHES = {"ImportError", "ModuleNotFoundError", "Exception"}


@dataclass
class Found:
    """A third-party top-level module: who imports it, and whether every import of it is optional."""

    by: set[str] = field(default_factory=set)
    optional: bool = True


def _caught(handler: ast.ExceptHandler) -> set[str]:
    t = handler.type
    elts = t.elts if isinstance(t, ast.Tuple) else [t] if t is not None else []
    return {e.id for e in elts if isinstance(e, ast.Name)} or ({"Exception"} if t is None else set())


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[str, bool]]:
    """[(absolute module name, optional)] that `source` (module `module`) imports at run time."""
    out: list[tuple[str, bool]] = []
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST, optional: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, optional)
            return
        if isinstance(node, ast.Try):
            guarded = optional or any(_caught(h) & OPTIONAL_CATCHES for h in node.handlers)
            for child in node.body:
                visit(child, guarded)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, optional)
            return
        if isinstance(node, ast.Import):
            out.extend((a.name, optional) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            out.append((base, optional))
            out.extend((f"{base}.{a.name}", optional) for a in node.names if a.name != "*")
        for child in ast.iter_child_nodes(node):
            visit(child, optional)

    visit(ast.parse(source), False)
    return out


def _source(module: str, paths: list[Path]) -> tuple[Path, bool] | None:
    rel = Path(*module.split("."))
    for p in paths:
        if (p / rel / "__init__.py").is_file():
            return p / rel / "__init__.py", True
        if (p / rel).with_suffix(".py").is_file():
            return (p / rel).with_suffix(".py"), False
    return None


def third_party_imports(roots: list[str], paths: list[Path]) -> dict[str, Found]:
    """{top-level module: Found} of everything outside the project and the standard library that the
    project modules reachable from `roots` (and their `__main__`) import."""
    todo = [m for r in roots for m in (r, f"{r}.__main__")]
    seen: set[str] = set()
    found: dict[str, Found] = {}
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        src = _source(module, paths)
        if src is None:
            continue  # `from pkg import name` where name is not a module
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # parents run their __init__ first
        for name, optional in imports_of(src[0].read_text(), module, src[1]):
            top = name.split(".")[0]
            if not top or top in sys.stdlib_module_names or top == "__future__":
                continue
            if top in PROJECT:
                todo.append(name)
                continue
            f = found.setdefault(top, Found())
            f.by.add(module)
            f.optional = f.optional and optional
    return found


def scan(roots: list[str], paths: list[Path]) -> dict:
    """The JSON the image prints: each import with the distributions that provide it here."""
    provides = md.packages_distributions()
    return {"roots": roots, "imports": {
        top: {"distributions": sorted(set(provides.get(top, []))), "by": sorted(f.by), "optional": f.optional}
        for top, f in sorted(third_party_imports(roots, paths).items())}}


# ------------------------------------------------------------------------------------------ host side

def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sbom_python_components(sbom: dict) -> dict[str, str]:
    """{normalized name: version} of the SBOM's Python (pkg:pypi) components."""
    return {normalize(c["name"]): c.get("version", "") for c in sbom.get("components") or []
            if str(c.get("purl", "")).startswith("pkg:pypi/")}


def sbom_problems(scanned: dict, sbom: dict, declared: list[str]) -> list[str]:
    """What the SBOM fails to list: a distribution the code imports, or a declared pin (`name==version`,
    the image's requirements) at its version. A required import nothing in the image provides is a
    problem too (the image would fail at that import)."""
    listed = sbom_python_components(sbom)
    problems = []
    for top, info in scanned["imports"].items():
        if not info["distributions"]:
            if not info["optional"]:
                problems.append(f"{top} (imported by {info['by'][0]}) is provided by no distribution in the image")
            continue
        for dist in info["distributions"]:
            if normalize(dist) not in listed:
                problems.append(f"{top} (imported by {info['by'][0]}) comes from {dist}, which the SBOM does not list")
    for req in declared:
        name, _, version = req.partition("==")
        have = listed.get(normalize(name.strip()))
        if have != version.strip():
            problems.append(f"declared {req}: the SBOM lists {name.strip()} "
                            + (f"at {have}" if have is not None else "not at all"))
    return problems


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    paths = [Path(p) for p in sys.path if p and Path(p).is_dir()]
    print(json.dumps(scan(argv[1:], paths), indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
