"""Put the launch wrapper where the vLLM container can run it.

The vLLM container runs the vendor's image, not ours. The init container (our image) copies the
launch wrapper's modules, which need only the standard library, into a shared emptyDir; the vLLM
container then runs ``python3 -m fewerbits_runtime launch ...`` with that folder on PYTHONPATH.
Only the standard-library modules of the API package (``API_MODULES``) are taken: its models need
pydantic, and the pydantic inside the vLLM image is not ours to choose.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import fewerbits_api

from . import __file__ as _pkg_init

LAUNCHER_MODULES = ("__init__.py", "__main__.py", "cli.py", "errors.py", "launch.py", "layout.py", "vllmlog.py")
API_MODULES = ("formats.py", "names.py")
"""The modules of ``fewerbits_api`` the launcher imports (standard library only)."""


def install_launcher(target: Path) -> Path:
    """Copy the launcher into ``target`` (replacing an older copy); returns the PYTHONPATH entry."""
    target.mkdir(parents=True, exist_ok=True)
    src_rt = Path(_pkg_init).parent
    tmp = Path(tempfile.mkdtemp(prefix=".install-", dir=target))
    try:
        (tmp / "fewerbits_runtime").mkdir()
        for name in LAUNCHER_MODULES:
            shutil.copy2(src_rt / name, tmp / "fewerbits_runtime" / name)
        (tmp / "fewerbits_api").mkdir()
        (tmp / "fewerbits_api" / "__init__.py").write_text(
            '"""fewerbits_api: only its standard-library modules, for the launch wrapper."""\n')
        src_api = Path(fewerbits_api.__file__).parent
        for name in API_MODULES:
            shutil.copy2(src_api / name, tmp / "fewerbits_api" / name)
        for pkg in ("fewerbits_runtime", "fewerbits_api"):
            dst = target / pkg
            if dst.exists():
                shutil.rmtree(dst)
            (tmp / pkg).rename(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
