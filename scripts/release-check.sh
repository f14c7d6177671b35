#!/usr/bin/env bash
# The release check, one command: the images as a user gets them, from a registry, by digest.
#
#   scripts/release-check.sh
#
#   1. builds what the check needs from Go modules (cached, keyed by version): the control plane of
#      the image-mode e2e and the OCI registry (CNCF Distribution, `e2e/build.sh registry`);
#   2. starts the registry on loopback, plain HTTP (e2e/registry.py; blobs under
#      ${FEWERBITS_CACHE:-~/.cache/fewerbits}/registry/data);
#   3. `scripts/images.sh --push 127.0.0.1:PORT`: builds the three images, checks them, writes their
#      SBOMs (images/sbom/), pushes them tagged with the version and writes their registry digests
#      to images/digests.json;
#   4. the image-mode e2e (e2e/tests/test_images_e2e.py): the chart installed with each image's
#      repository and digest, every container run from an image pulled by digest into an empty
#      podman storage, the demo flow to Ready and a completion, and each image's SBOM checked
#      against what its code imports;
#   5. prints sizes, digests and times, and writes the times to images/release-check.json.
#
# Needs root, podman/buildah/runc/mmdebstrap (scripts/images.sh installs them), network to Debian,
# PyPI and the Go module proxy, and about 25 GB of free disk on a cold cache (docs/images.md).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FEWERBITS_VENV:-.venv}
LOGS=${FEWERBITS_CACHE:-$HOME/.cache/fewerbits}/logs
mkdir -p "$LOGS"
step() { printf '\n==> %s (%ds)\n' "$*" "$SECONDS"; }
die() { printf 'release-check.sh: %s\n' "$*" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || die "no $VENV: scripts/test.sh makes it (or FEWERBITS_VENV=...)"

step "control plane and registry from Go modules (cached)"
t0=$SECONDS
e2e/build.sh kubernetes etcd kwok minio sim helm registry
components_s=$((SECONDS - t0))

step "registry on loopback"
addr_file=$(mktemp)
"$VENV/bin/python" -m e2e.registry serve --address-file "$addr_file" >"$LOGS/release-check-registry.log" 2>&1 &
reg_pid=$!
trap 'kill "$reg_pid" 2>/dev/null; wait "$reg_pid" 2>/dev/null; rm -f "$addr_file"' EXIT
deadline=$((SECONDS + 120))
until [ -s "$addr_file" ]; do
  kill -0 "$reg_pid" 2>/dev/null || { cat "$LOGS/release-check-registry.log" >&2; die "the registry did not start"; }
  [ "$SECONDS" -lt "$deadline" ] || die "the registry did not answer in 120 s (log: $LOGS/release-check-registry.log)"
  sleep 0.2
done
REGISTRY=$(cat "$addr_file")
echo "registry at $REGISTRY"

step "images: build, check, SBOMs, push to $REGISTRY"
t0=$SECONDS
scripts/images.sh --push "$REGISTRY"
images_s=$((SECONDS - t0))

# The e2e pulls into an empty storage of its own (a second copy of the images) when the disk holds
# it with 8 GB to spare; else into scripts/images.sh's storage with the local tags removed first.
need=$(python3 -c 'import json; print(sum(e["size_bytes"] for e in json.load(open("images/digests.json"))["images"].values()) // 10**9 + 8)')
free=$(df -P --block-size=1G "${FEWERBITS_CACHE:-$HOME/.cache/fewerbits}" | awk 'NR == 2 {print $4}')
store=own
[ "$free" -ge "$need" ] || store=shared
step "image-mode e2e, every image pulled from $REGISTRY by digest (node storage: $store; $free GB free, $need GB for its own)"
t0=$SECONDS
set +o pipefail
FEWERBITS_E2E_NODE_STORE=$store FEWERBITS_E2E_REGISTRY=$REGISTRY FEWERBITS_SKIP_BUILD=1 FEWERBITS_TEST_WORKERS=0 \
  scripts/test.sh -m images e2e/tests/test_images_e2e.py 2>&1 | tee "$LOGS/release-check-e2e.log"
e2e_rc=${PIPESTATUS[0]}
set -o pipefail
e2e_s=$((SECONDS - t0))
[ "$e2e_rc" = 0 ] || die "the image-mode e2e failed (log: $LOGS/release-check-e2e.log)"

step "done"
"$VENV/bin/python" - "$components_s" "$images_s" "$e2e_s" "$SECONDS" "$store" "$(grep -Eo '[0-9]+ passed[^=]*' "$LOGS/release-check-e2e.log" | tail -n 1)" <<'EOF'
import json, os, sys, time
components_s, images_s, e2e_s, total_s = map(int, sys.argv[1:5])
doc = json.load(open("images/digests.json"))
print(f"{'image':20} {'size':>8} {'pushed':>8} {'build':>6} {'push':>5}  digest")
for name, e in doc["images"].items():
    pushed = f"{e['pushed_bytes'] / 1e6:.0f} MB" if e["pushed_bytes"] else "-"
    print(f"{name:20} {e['size_bytes'] / 1e6:5.0f} MB {pushed:>8} {e['build_s']:>5}s {e['push_s']:>4}s  {e['digest']}")
times = {"components_s": components_s, "images_build_check_push_s": images_s, "e2e_s": e2e_s, "total_s": total_s}
print("times (s):", ", ".join(f"{k} {v}" for k, v in times.items()), "| e2e:", sys.argv[6], "| node storage:", sys.argv[5])
result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(), "times": times,
          "e2e": sys.argv[6], "node_storage": sys.argv[5], "images": {n: e["digest"] for n, e in doc["images"].items()}}
with open("images/release-check.json", "w") as f:
    f.write(json.dumps(result, indent=1) + "\n")
EOF
