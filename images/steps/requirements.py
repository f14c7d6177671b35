"""Print the pinned requirements one image installs, from pyproject.toml (the one place pins live).

    python3.11 requirements.py IMAGE [PYPROJECT]     IMAGE: operator | quantjob | runtime

operator: the base `dependencies` (no torch, no llm-compressor); quantjob: those plus the
`quantjob` extra; runtime: only what the fetcher and launch wrapper import (boto3, pydantic).
Standard library only: it runs in the image's build stage before anything is installed.
"""

from __future__ import annotations

import re
import sys
import tomllib

RUNTIME_ONLY = ("boto3", "pydantic")


def name(requirement: str) -> str:
    return re.split(r"[=<>~!;\s\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def requirements(image: str, pyproject: dict) -> list[str]:
    project = pyproject["project"]
    base = list(project["dependencies"])
    if image == "operator":
        return base
    if image == "quantjob":
        return base + list(project["optional-dependencies"]["quantjob"])
    if image == "runtime":
        wanted = [d for d in base if name(d) in RUNTIME_ONLY]
        missing = set(RUNTIME_ONLY) - {name(d) for d in wanted}
        if missing:
            raise SystemExit(f"requirements.py: pyproject.toml dependencies lack {sorted(missing)}")
        return wanted
    raise SystemExit(f"requirements.py: unknown image {image!r} (operator, quantjob, runtime)")


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        raise SystemExit(__doc__)
    with open(argv[2] if len(argv) == 3 else "pyproject.toml", "rb") as f:
        print("\n".join(requirements(argv[1], tomllib.load(f))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
