"""The image checks that need no image: what each image's code imports, read from the sources
(images/check/imports.py, which the image-mode e2e runs inside each pulled image), the comparison
with an SBOM, and images/digests.json's entries (images/check/digests.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from e2e.images import load_check

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "crds", ROOT / "operator", ROOT / "quantjob", ROOT / "runtime"]


imports = load_check(ROOT / "images" / "check" / "imports.py")
digests = load_check(ROOT / "images" / "check" / "digests.py")


def _closure(root: str) -> dict:
    return imports.third_party_imports([root], SOURCES)


def test_the_quantjob_code_imports_lm_eval_and_torch():
    found = _closure("fewerbits_quantjob")
    assert {"lm_eval", "torch", "llmcompressor", "transformers", "boto3", "pydantic"} <= set(found)
    assert not found["lm_eval"].optional and "fewerbits_quantjob.lmeval" in found["lm_eval"].by


def test_the_operator_code_reaches_no_torch():
    """House rule 6, followed through every import the operator's entrypoint reaches, lazy ones too."""
    found = _closure("fewerbits_operator")
    assert {"kopf", "kubernetes", "pydantic"} <= set(found)
    assert not {"torch", "llmcompressor", "transformers", "lm_eval"} & set(found), sorted(found)


def test_the_runtime_imports_torch_only_where_it_may_be_missing():
    found = _closure("fewerbits_runtime")
    assert "boto3" in found
    assert all(f.optional for name, f in found.items() if name == "torch")


def test_imports_of_resolves_relative_imports_and_skips_type_checking_and_the_stdlib_is_left_to_the_caller():
    src = ("import os\nfrom . import sibling\nfrom ..api import models\nfrom typing import TYPE_CHECKING\n"
           "if TYPE_CHECKING:\n    import heavy\n"
           "try:\n    import optional_dep\nexcept ImportError:\n    optional_dep = None\n"
           "def f():\n    import lazy_dep\n")
    got = imports.imports_of(src, "pkg.sub.mod", is_package=False)
    assert ("pkg.sub", False) in got and ("pkg.sub.sibling", False) in got and ("pkg.api.models", False) in got
    assert ("optional_dep", True) in got and ("lazy_dep", False) in got
    assert not any(name == "heavy" for name, _ in got)


SBOM = {"components": [
    {"name": "lm_eval", "version": "0.4.13", "purl": "pkg:pypi/lm-eval@0.4.13"},
    {"name": "torch", "version": "2.13.0", "purl": "pkg:pypi/torch@2.13.0"},
    {"name": "libc6", "version": "2.36", "purl": "pkg:deb/debian/libc6@2.36"},
]}
SCAN = {"imports": {
    "lm_eval": {"distributions": ["lm_eval"], "by": ["fewerbits_quantjob.lmeval"], "optional": False},
    "torch": {"distributions": ["torch"], "by": ["fewerbits_quantjob.job"], "optional": False},
}}


def test_an_sbom_that_lists_every_import_and_pin_passes():
    assert imports.sbom_problems(SCAN, SBOM, ["lm-eval==0.4.13", "torch==2.13.0"]) == []


def test_an_sbom_without_lm_eval_is_named():
    without = {"components": [c for c in SBOM["components"] if c["name"] != "lm_eval"]}
    problems = imports.sbom_problems(SCAN, without, ["lm-eval==0.4.13"])
    assert problems == [
        "lm_eval (imported by fewerbits_quantjob.lmeval) comes from lm_eval, which the SBOM does not list",
        "declared lm-eval==0.4.13: the SBOM lists lm-eval not at all"]


def test_a_pin_at_another_version_and_a_missing_required_import_are_named():
    scan = {"imports": {**SCAN["imports"],
                        "ghost": {"distributions": [], "by": ["fewerbits_quantjob.x"], "optional": False},
                        "maybe": {"distributions": [], "by": ["fewerbits_runtime.launch"], "optional": True}}}
    problems = imports.sbom_problems(scan, SBOM, ["torch==2.14.0"])
    assert problems == ["ghost (imported by fewerbits_quantjob.x) is provided by no distribution in the image",
                        "declared torch==2.14.0: the SBOM lists torch at 2.13.0"]


def test_a_digest_entry_records_the_push_and_the_sbom(tmp_path):
    sbom = tmp_path / "images" / "sbom" / "fewerbits-runtime.cdx.json"
    sbom.parent.mkdir(parents=True)
    sbom.write_text(json.dumps(SBOM))
    report = [{"image": "fewerbits-runtime", "size_bytes": "144000000", "id": "86aa", "digest": "sha256:local",
               "build_s": "16"}]
    pushed = [{"name": "runtime", "reference": "reg:5000/fewerbits-runtime:0.1.0", "digest": "sha256:" + "a" * 64,
               "push_s": "7"}]
    (entry,) = digests.entries("0.1.0", "reg:5000", report, pushed, False, tmp_path).values()
    assert entry["by_digest"] == "reg:5000/fewerbits-runtime@sha256:" + "a" * 64
    assert entry["sbom_components"] == {"python": 2, "debian": 1} and entry["pushed_bytes"] is None
    assert (entry["size_bytes"], entry["build_s"], entry["push_s"]) == (144000000, 16, 7)


@pytest.mark.parametrize("name", ["operator", "quantjob", "runtime"])
def test_the_committed_sboms_list_every_pin_the_image_declares(name):
    """images/sbom/ is what scripts/images.sh last wrote: a pin changed in pyproject.toml without a
    rebuild (lm-eval once never reached the quantjob image) fails here, naming the pin."""
    import tomllib

    requirements = load_check(ROOT / "images" / "steps" / "requirements.py")
    declared = requirements.requirements(name, tomllib.loads((ROOT / "pyproject.toml").read_text()))
    sbom = json.loads((ROOT / "images" / "sbom" / f"fewerbits-{name}.cdx.json").read_text())
    assert imports.sbom_problems({"imports": {}}, sbom, declared) == []
