"""Write images/digests.json after `scripts/images.sh --push` (it runs this on the host).

    python3 digests.py --version V --registry R --report report.tsv --pushed pushed.tsv --out digests.json [--plain-http]

One entry per image pushed: the reference it was pushed as (`R/fewerbits-<name>:<version>`), its
registry digest (the sha256 of the manifest the registry stores: what a pod names it by, `R/...@sha256:`),
its size as podman counts it (uncompressed) and as pushed (the manifest's layers and config, compressed;
read back from the registry when it is plain HTTP on loopback), the local image id, the build and push
times (seconds), and its SBOM with the count of its components. Entries of images not pushed this time
are kept. Standard library only.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import sys
import urllib.request
from pathlib import Path

MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")


def read_tsv(path: Path, header: list[str] | None = None) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f, fieldnames=header, delimiter="\t"))


def pushed_bytes(reference_by_digest: str) -> int | None:
    """The compressed size of an image in a plain-HTTP registry: its manifest's config and layers."""
    host, _, rest = reference_by_digest.partition("/")
    repo, _, digest = rest.partition("@")
    req = urllib.request.Request(f"http://{host}/v2/{repo}/manifests/{digest}", headers={"Accept": ", ".join(MANIFEST_TYPES)})
    with urllib.request.urlopen(req, timeout=30) as r:
        body = r.read()
    if "sha256:" + hashlib.sha256(body).hexdigest() != digest:
        raise SystemExit(f"digests.py: the registry's manifest of {reference_by_digest} does not hash to its digest")
    manifest = json.loads(body)
    return manifest["config"]["size"] + sum(layer["size"] for layer in manifest["layers"])


def sbom_counts(path: Path) -> dict[str, int]:
    components = json.loads(path.read_text()).get("components") or []
    purls = [str(c.get("purl", "")) for c in components]
    return {"python": sum(p.startswith("pkg:pypi/") for p in purls), "debian": sum(p.startswith("pkg:deb/") for p in purls)}


def entries(version: str, registry: str, report: list[dict], pushed: list[dict], plain_http: bool,
            repo_root: Path) -> dict[str, dict]:
    built = {r["image"]: r for r in report}
    out = {}
    for p in pushed:
        name = f"fewerbits-{p['name']}"
        b = built[name]
        by_digest = f"{registry}/{name}@{p['digest']}"
        sbom = Path("images") / "sbom" / f"{name}.cdx.json"
        out[name] = {
            "pushed_as": p["reference"], "digest": p["digest"], "by_digest": by_digest,
            "size_bytes": int(b["size_bytes"]), "pushed_bytes": pushed_bytes(by_digest) if plain_http else None,
            "image_id": b["id"], "build_s": int(b["build_s"]) if b["build_s"] else None, "push_s": int(p["push_s"]),
            "sbom": str(sbom), "sbom_sha256": hashlib.sha256((repo_root / sbom).read_bytes()).hexdigest(),
            "sbom_components": sbom_counts(repo_root / sbom),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    for flag in ("--version", "--registry", "--report", "--pushed", "--out"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--plain-http", action="store_true")
    a = ap.parse_args(argv)
    out = Path(a.out)
    old = json.loads(out.read_text()) if out.is_file() else {}
    images = old.get("images", {}) if old.get("version") == a.version and old.get("registry") == a.registry else {}
    images.update(entries(a.version, a.registry, read_tsv(Path(a.report)),
                          read_tsv(Path(a.pushed), ["name", "reference", "digest", "push_s"]), a.plain_http, Path.cwd()))
    doc = {"version": a.version, "registry": a.registry, "images": dict(sorted(images.items()))}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    for name, e in doc["images"].items():
        print(f"{e['by_digest']}  {e['size_bytes'] / 1e6:.0f} MB ({(e['pushed_bytes'] or 0) / 1e6:.0f} MB pushed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
