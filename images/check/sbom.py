"""Check one built image and write its SBOM (scripts/images.sh runs it on the host after inventory.py).

    python3 sbom.py --image REF --user UID:GID --inventory inventory.json --python-sbom python.cdx.json --out SBOM

The SBOM is cyclonedx-bom's CycloneDX document of the image's Python environment with the image's
Debian packages added as components (purl pkg:deb/debian/...), each with where its licence text
lies in the image. The checks a user would make, each failing with what is wrong:
- the image runs as a numeric, non-root user;
- no pip, setuptools, wheel, compiler or apt is left in it (unless an installed distribution
  requires it to run: then it is named, not failed);
- every Debian package has its copyright file.
Python distributions without a licence file in their metadata are listed (the SBOM still carries
their declared licence), not failed: that is how some upstream wheels are published.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def check(user: str, inventory: dict) -> list[str]:
    problems = []
    m = re.fullmatch(r"(\d+)(?::(\d+))?", user or "")
    if not m:
        problems.append(f"USER {user!r} is not numeric (runAsNonRoot cannot check it)")
    elif int(m.group(1)) == 0:
        problems.append("USER is root")
    bad = inventory["unwanted"]
    if bad["executables"]:
        problems.append(f"build tools in the final stage: {', '.join(bad['executables'])}")
    if bad["venv_modules"]:
        problems.append(f"installers in /opt/fewerbits: {', '.join(bad['venv_modules'])}")
    no_copyright = [p["name"] for p in inventory["debian"] if not p["copyright"]]
    if no_copyright:
        problems.append(f"Debian packages without /usr/share/doc/<package>/copyright: {', '.join(no_copyright)}")
    return problems


def sbom(image: str, python_sbom: dict, inventory: dict) -> dict:
    doc = dict(python_sbom)
    meta = dict(doc.get("metadata") or {})
    name, _, version = image.rpartition(":")
    meta["component"] = {"type": "container", "bom-ref": image, "name": name, "version": version}
    doc["metadata"] = meta
    files = {d["name"].lower(): d for d in inventory["python"]}
    components = []
    for c in doc.get("components") or []:
        d = files.get(c.get("name", "").lower())
        if d and d["licence_files"]:
            props = list(c.get("properties") or [])
            props += [{"name": "fewerbits:licence-file", "value": f} for f in d["licence_files"]]
            c = {**c, "properties": props}
        components.append(c)
    for p in inventory["debian"]:
        purl = f"pkg:deb/debian/{p['name']}@{p['version']}?arch={p['arch']}&distro=debian-12"
        c = {"type": "library", "bom-ref": purl, "name": p["name"], "version": p["version"], "purl": purl,
             "properties": [{"name": "fewerbits:debian-source", "value": p["source"]}]}
        if p["copyright"]:
            c["properties"].append({"name": "fewerbits:licence-file", "value": p["copyright"]})
        components.append(c)
    doc["components"] = components
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    for flag in ("--image", "--user", "--inventory", "--python-sbom", "--out"):
        ap.add_argument(flag, required=True)
    a = ap.parse_args(argv)
    inventory = json.loads(Path(a.inventory).read_text())
    problems = check(a.user, inventory)
    for p in problems:
        print(f"{a.image}: {p}", file=sys.stderr)
    doc = sbom(a.image, json.loads(Path(a.python_sbom).read_text()), inventory)
    Path(a.out).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    no_files = [d["name"] for d in inventory["python"] if not d["licence_files"]]
    for module, by in (inventory["unwanted"].get("required_installers") or {}).items():
        print(f"{a.image}: {module} is there as a run-time dependency of {', '.join(by)}")
    print(f"{a.image}: user {a.user}; {len(inventory['python'])} Python distributions "
          f"({len(no_files)} without a licence file: {', '.join(no_files) or 'none'}); "
          f"{len(inventory['debian'])} Debian packages; SBOM {a.out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
