"""The distribution carries every package and data file: an editable install hides omissions that
a wheel (the images) would ship."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed():
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for top, folder in tool["package-dir"].items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            found.add(".".join([top, *rel.parts]) if rel.parts else top)
    assert found == listed, f"listed but missing: {listed - found}; missing from pyproject: {found - listed}"


def test_data_files_are_declared():
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    data = tool.get("package-data", {})
    for top, folder in tool["package-dir"].items():
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and path.suffix in (".json", ".txt") and "__pycache__" not in path.parts:
                pkg_dir = path.parent
                while not (pkg_dir / "__init__.py").exists():
                    pkg_dir = pkg_dir.parent
                rel = pkg_dir.relative_to(REPO / folder)
                pkg = ".".join([top, *rel.parts]) if rel.parts else top
                patterns = data.get(pkg, [])
                relfile = path.relative_to(pkg_dir)
                assert any(relfile.match(p) for p in patterns), f"{path} is not in package-data of {pkg}"


def test_operator_install_pulls_no_torch():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if d.split("==")[0] in ("torch", "llmcompressor", "transformers")]
