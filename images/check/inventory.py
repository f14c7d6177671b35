"""What an image ships, read from inside it (scripts/images.sh runs it in each built image).

    python3.11 -I inventory.py OUT_DIR

Writes OUT_DIR/inventory.json: the Python distributions of /opt/fewerbits (the venv) and
/opt/fewerbits-app (the project) with their licence files, the Debian packages with their copyright
files, and what should not be there (pip, setuptools, compilers, apt). Then OUT_DIR/python.cdx.json,
the CycloneDX SBOM of the venv by cyclonedx-bom (mounted at /sbom-tool, not part of the image).
Standard library only.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

VENV = Path("/opt/fewerbits")
LICENCE_FILE = re.compile(r"(^|/)(licen[cs]es?/|(LICEN[CS]E|COPYING|NOTICE|AUTHORS)[^/]*$)", re.I)
BUILD_TOOLS = ("gcc", "cc", "c++", "g++", "clang", "make", "ld", "as", "pip", "pip3", "pip3.11",
               "apt", "apt-get", "uv")
INSTALLERS = ("pip", "setuptools", "wheel", "ensurepip")


def python_dists() -> list[dict]:
    out = []
    for dist in md.distributions():
        base = Path(str(dist.locate_file("")))
        if not str(base).startswith(("/opt/fewerbits", "/opt/fewerbits-app")):
            continue  # the base image's own site-packages, if it has any
        files = [str(f) for f in dist.files or [] if LICENCE_FILE.search(str(f))]
        meta = dist.metadata
        if not files and meta["Name"] == "fewerbits" and meta.get("License") == "Apache-2.0":
            # The project's wheel carries no licence file; its licence's text is in every Debian
            # image (base-files), and that is where the image has it.
            files = ["/usr/share/common-licenses/Apache-2.0"]
        out.append({
            "name": meta["Name"], "version": dist.version, "location": str(base),
            "license": meta.get("License-Expression") or ((meta.get("License") or "").strip().splitlines() or [""])[0][:120],
            "classifiers": [c for c in meta.get_all("Classifier") or [] if c.startswith("License ::")],
            "licence_files": sorted(str(base / f) for f in files if (base / f).is_file()),
        })
    return sorted(out, key=lambda d: d["name"].lower())


def debian_packages() -> list[dict]:
    status = Path("/var/lib/dpkg/status")
    if not status.is_file():
        return []
    out = []
    for block in status.read_text(errors="replace").split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+): ?(.*)$", block, re.M))
        if "Package" not in fields or "installed" not in fields.get("Status", ""):
            continue
        copyright_ = Path("/usr/share/doc") / fields["Package"] / "copyright"
        out.append({"name": fields["Package"], "version": fields["Version"],
                    "arch": fields.get("Architecture", ""), "source": fields.get("Source", fields["Package"]).split()[0],
                    "copyright": str(copyright_) if copyright_.is_file() else ""})
    return sorted(out, key=lambda p: p["name"])


def unwanted() -> dict:
    path = os.environ.get("PATH", "").split(":") + ["/usr/bin", "/usr/local/bin", "/bin"]
    tools = sorted({shutil.which(t, path=":".join(path)) for t in BUILD_TOOLS} - {None})
    site = VENV / "lib" / "python3.11" / "site-packages"
    modules = sorted(m for m in INSTALLERS if (site / m).exists() or (Path("/opt/fewerbits-app") / m).exists())
    # A dependency is no leftover: triton, for one, requires setuptools at run time.
    required = {m: sorted(_required_by(m)) for m in modules}
    return {"executables": tools, "venv_modules": [m for m in modules if not required[m]],
            "required_installers": {m: by for m, by in required.items() if by}}


def _required_by(module: str) -> set[str]:
    """Distributions whose unconditional requirements name `module` (extras are not installed)."""
    out = set()
    for dist in md.distributions():
        for req in dist.requires or []:
            name = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower()
            if name == module and "extra ==" not in req:
                out.add(dist.metadata["Name"])
    return out


def main(out: Path) -> int:
    inventory = {"python": python_dists(), "debian": debian_packages(), "unwanted": unwanted(),
                 "python_version": sys.version.split()[0]}
    (out / "inventory.json").write_text(json.dumps(inventory, indent=1))
    tool = ("import sys, runpy; sys.path.insert(0, '/sbom-tool'); sys.argv = ['cyclonedx-py', *sys.argv[1:]]; "
            "runpy.run_module('cyclonedx_py', run_name='__main__', alter_sys=True)")
    subprocess.run([sys.executable, "-I", "-c", tool, "environment", "--output-reproducible", "--of", "JSON",
                    "--mc-type", "application", "-o", str(out / "python.cdx.json"), str(VENV / "bin" / "python")],
                   check=True, env={**os.environ, "SOURCE_DATE_EPOCH": os.environ.get("SOURCE_DATE_EPOCH", "0")})
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
