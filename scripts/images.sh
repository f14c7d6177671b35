#!/usr/bin/env bash
# Build the three images (operator, runtime, quantjob) with buildah, from Debian packages and PyPI
# wheels only: no registry image is pulled. docs/images.md has the figures and the reasons.
#
#   scripts/images.sh                     # all three, then the size/digest table and the SBOMs
#   scripts/images.sh operator runtime    # only these
#   scripts/images.sh --relock            # resolve images/base.packages again from the mirror
#   scripts/images.sh --no-cache runtime  # rebuild without the layer cache (reproducibility check:
#                                         #   the same inputs give the same image id and digest)
#   scripts/images.sh --push HOST[:PORT][/PATH]
#                                         # then push each to HOST/PATH/fewerbits-<name>:<version> and
#                                         #   write images/digests.json (each image's registry digest,
#                                         #   sizes, times, SBOM); a loopback registry is plain HTTP
#   eval "$(scripts/images.sh --env)"     # podman settings for using podman by hand:
#                                         #   podman $FEWERBITS_PODMAN_ARGS images
#
# Steps, each cached under $FEWERBITS_CACHE/images (default ~/.cache/fewerbits/images), keyed by
# what it is made from:
#   1. base: mmdebstrap of exactly the packages in images/base.packages (Python 3.11 and the
#      Essential set) -> base/<key>/rootfs.tar -> image localhost/fewerbits-base:<key>;
#   2. wheelhouse: `pip download` of the images' pins under images/constraints.txt -> wheels/<key>/,
#      mounted read-only at /wheels into the builds (they install with --no-index);
#   3. `buildah bud` of each Dockerfile FROM that base (chroot isolation, layer cache), tagged
#      $FEWERBITS_IMAGE_REGISTRY/fewerbits-<name>:<project version> (default ghcr.io/fewerbits,
#      what the chart names);
#   4. a check of each image (non-root user, no pip or compiler, licence files) and its SBOM
#      (CycloneDX, by cyclonedx-bom from PyPI plus the image's Debian packages) -> images/sbom/;
#   5. with --push: `podman push` of each to the registry, its digest (the manifest's sha256, what
#      a pod references it by) -> images/digests.json.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
CACHE=${FEWERBITS_CACHE:-$HOME/.cache/fewerbits}/images
REGISTRY=${FEWERBITS_IMAGE_REGISTRY:-ghcr.io/fewerbits}
VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
PIP_VERSION=25.3
SETUPTOOLS_VERSION=80.9.0
CYCLONEDX_VERSION=7.5.0
export CONTAINERS_CONF=$REPO/images/containers.conf
# One runroot (locks, mount state, on tmpfs) per storage: two caches must not share one.
STORE=(--root "$CACHE/storage" --runroot "/run/fewerbits-images-$(id -u)-$(printf %s "$CACHE" | sha256sum | cut -c1-8)"
       --storage-driver overlay)
# shellcheck disable=SC1091
. images/base.env

step() { printf '==> %s (%ds)\n' "$*" "$SECONDS"; }
die() { printf 'images.sh: %s\n' "$*" >&2; exit 1; }
# A cache key: the content of files, comments left out (a reworded comment rebuilds nothing).
key() { grep -hv '^[[:space:]]*#' "$@" | sha256sum | cut -c1-16; }

if [ "${1:-}" = --env ]; then
  printf 'export CONTAINERS_CONF=%q\nexport FEWERBITS_PODMAN_ARGS=%q\n' "$CONTAINERS_CONF" "${STORE[*]}"
  exit 0
fi
RELOCK=0
NO_CACHE=()
PUSH=""
while [ $# -gt 0 ]; do
  case $1 in
    --relock) RELOCK=1; shift ;;
    --no-cache) NO_CACHE=(--no-cache); shift ;;
    --push) [ -n "${2:-}" ] || die "--push needs a registry (HOST[:PORT][/PATH])"; PUSH=${2%/}; shift 2 ;;
    *) break ;;
  esac
done
NAMES=("$@")
[ ${#NAMES[@]} -gt 0 ] || NAMES=(operator runtime quantjob)
for n in "${NAMES[@]}"; do
  case $n in operator|runtime|quantjob) ;; *) die "unknown image '$n' (operator, runtime, quantjob)" ;; esac
done

# ------------------------------------------------------------------------------------------ tools
missing=()
for t in podman buildah runc mmdebstrap; do command -v "$t" >/dev/null || missing+=("$t"); done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || die "missing ${missing[*]}: apt-get install podman buildah runc mmdebstrap"
  step "installing ${missing[*]} from Debian"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman buildah runc mmdebstrap >/dev/null \
    || die "apt-get install of ${missing[*]} failed"
fi
mkdir -p "$CACHE/logs"
podman() { command podman "${STORE[@]}" "$@"; }
buildah() { command buildah "${STORE[@]}" "$@"; }

# ------------------------------------------------------------------------------------------ base
# The rootfs is a function of the package list (name=version, every package), the suite and the
# mirrors, and SOURCE_DATE_EPOCH (file times): the same list gives the same tarball.
debian_sources() { local s; for s in "${DEBIAN_SOURCES[@]}"; do printf '%s\n' "$s"; done; }
# merged-usr: /usr is merged before the packages are unpacked (usr-is-merged then installs, without
# usrmerge and the perl it needs).
mmdebstrap_common=(--mode=root --format=tar --aptopt='Acquire::Retries "3"' --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
  --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/doc/*'
  --dpkgopt='path-include=/usr/share/doc/*/copyright'
  --customize-hook='rm -f "$1/etc/machine-id" "$1/var/cache/ldconfig/aux-cache"; rm -rf "$1"/var/log/* "$1"/var/lib/apt/lists/*')

if [ "$RELOCK" = 1 ]; then
  step "resolving the base's packages from the mirror (${BASE_INCLUDE})"
  tmp=$(mktemp -d)
  debian_sources | SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH mmdebstrap "${mmdebstrap_common[@]}" --variant=essential \
    --include="$BASE_INCLUDE" "$DEBIAN_SUITE" "$tmp/rootfs.tar" - >"$CACHE/logs/relock.log" 2>&1 \
    || { tail -n 20 "$CACHE/logs/relock.log"; die "mmdebstrap failed (log: $CACHE/logs/relock.log)"; }
  mkdir "$tmp/r" && tar -xf "$tmp/rootfs.tar" -C "$tmp/r" ./var/lib/dpkg/status
  { echo "# Every package of the base image, name=version: written by scripts/images.sh --relock, read by its builds."
    dpkg-query --admindir="$tmp/r/var/lib/dpkg" -W -f '${db:Status-Abbrev} ${Package}=${Version}\n' \
      | awk '$1 == "ii" {print $2}' | sort; } > images/base.packages
  rm -rf "$tmp"
  step "images/base.packages: $(grep -vc '^#' images/base.packages) packages"
fi

BASE_KEY=$(key images/base.env images/base.packages)
BASE_DIR=$CACHE/base/$BASE_KEY
BASE_IMAGE=localhost/fewerbits-base:$DEBIAN_SUITE-$BASE_KEY
if [ ! -f "$BASE_DIR/rootfs.tar" ]; then
  step "base: mmdebstrap of images/base.packages (cache: $BASE_DIR)"
  mkdir -p "$CACHE/base" && tmp=$(mktemp -d "$CACHE/base/.tmp.XXXXXX")
  pkgs=$(grep -v '^#' images/base.packages | paste -sd, -)
  if ! debian_sources | SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH mmdebstrap "${mmdebstrap_common[@]}" --variant=custom \
      --include="$pkgs" "$DEBIAN_SUITE" "$tmp/rootfs.tar" - >"$CACHE/logs/base.log" 2>&1; then
    grep -E '^(E|W): ' "$CACHE/logs/base.log" | cut -c1-240 | tail -n 5 >&2
    # apt names what it cannot fetch: "Version 'V' for 'P' was not found", "Unable to locate package P".
    what=$(grep -oE "Version '[^']+' for '[^']+' was not found|Unable to locate package [^ ]+|Failed to fetch [^ ]+" \
      "$CACHE/logs/base.log" | sort -u | paste -sd';' - || true)
    rm -rf "$tmp"
    [ -n "$what" ] || die "base image: mmdebstrap of images/base.packages failed (log: $CACHE/logs/base.log)"
    die "base image: cannot fetch $what (images/base.packages pins it; scripts/images.sh --relock takes what the mirror has now; log: $CACHE/logs/base.log)"
  fi
  sha256sum "$tmp/rootfs.tar" | cut -d' ' -f1 > "$tmp/rootfs.tar.sha256"
  rm -rf "$BASE_DIR" && mv "$tmp" "$BASE_DIR"
fi
if ! podman image exists "$BASE_IMAGE"; then
  step "base: importing $BASE_IMAGE (rootfs sha256 $(cat "$BASE_DIR/rootfs.tar.sha256"))"
  podman import --quiet --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3.11"]' "$BASE_DIR/rootfs.tar" "$BASE_IMAGE" >/dev/null
fi

# ------------------------------------------------------------------------------------------ wheels
REQS=$(for n in operator quantjob runtime; do python3 images/steps/requirements.py "$n"; done | sort -u)
# Pure-Python pins published only as source (lm-eval's rouge-score, sqlitedict, word2number): pip
# builds their wheels here on the host (py3-none-any), so the images still install wheels only,
# with --no-index, and never run a build backend.
SDIST_ONLY=rouge-score,sqlitedict,word2number
WHEELS_KEY=$( { printf '%s\n' "$REQS" "pip==$PIP_VERSION" "setuptools==$SETUPTOOLS_VERSION" "sdist-only=$SDIST_ONLY"; cat images/constraints.txt; } | sha256sum | cut -c1-16)
WHEELS=$CACHE/wheels/$WHEELS_KEY
# The sdists pip downloaded (only SDIST_ONLY's) become wheels beside the others, and go.
build_sdists() {
  local sd
  for sd in "$1"/*.tar.gz "$1"/*.zip; do
    [ -e "$sd" ] || continue
    python3 -m pip wheel --disable-pip-version-check --no-input --progress-bar off --no-deps -w "$1" "$sd" && rm -f "$sd" || return 1
  done
}
if [ ! -d "$WHEELS" ]; then
  step "wheelhouse: pip download of the pins (cache: $WHEELS)"
  mkdir -p "$CACHE/wheels" && tmp=$(mktemp -d "$CACHE/wheels/.tmp.XXXXXX")
  # The host is the images' platform (x86_64, glibc 2.36, CPython 3.11): its pip picks their wheels.
  # shellcheck disable=SC2086
  if ! { python3 -m pip download --disable-pip-version-check --no-input --progress-bar off --only-binary=:all: \
      --no-binary="$SDIST_ONLY" -c images/constraints.txt -d "$tmp" "pip==$PIP_VERSION" "setuptools==$SETUPTOOLS_VERSION" $REQS \
      && build_sdists "$tmp"; } >"$CACHE/logs/wheels.log" 2>&1; then
    tail -n 15 "$CACHE/logs/wheels.log" >&2
    what=$(grep -oE "No matching distribution found for [^ ]+|Could not find a version that satisfies the requirement [^ ]+|Cannot install [^ ]+" \
      "$CACHE/logs/wheels.log" | sort -u | paste -sd';' - || true)
    rm -rf "$tmp"
    die "wheelhouse: cannot fetch ${what:-the pinned wheels} (log: $CACHE/logs/wheels.log)"
  fi
  mv "$tmp" "$WHEELS"
fi

# ------------------------------------------------------------------------------------------ images
declare -A BUILD_S
for n in "${NAMES[@]}"; do
  tag=$REGISTRY/fewerbits-$n:$VERSION
  step "building $tag FROM $BASE_IMAGE (log: $CACHE/logs/build-$n.log)"
  t0=$SECONDS
  if ! buildah bud --layers "${NO_CACHE[@]}" --force-rm --isolation chroot --network host --pull=never \
      --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH" \
      --timestamp "$SOURCE_DATE_EPOCH" --volume "$WHEELS:/wheels:ro" \
      --ignorefile "$n/Dockerfile.dockerignore" -f "$n/Dockerfile" -t "$tag" . >"$CACHE/logs/build-$n.log" 2>&1; then
    tail -n 25 "$CACHE/logs/build-$n.log" >&2
    die "build of $tag failed (log: $CACHE/logs/build-$n.log)"
  fi
  BUILD_S[$n]=$((SECONDS - t0))
done

# ------------------------------------------------------------------------------------------ checks, SBOMs
TOOL=$CACHE/tools/cyclonedx-bom-$CYCLONEDX_VERSION
if [ ! -d "$TOOL" ]; then
  step "installing cyclonedx-bom $CYCLONEDX_VERSION (PyPI) into $TOOL"
  mkdir -p "$CACHE/tools" && tmp=$(mktemp -d "$CACHE/tools/.tmp.XXXXXX")
  python3 -m pip install -q --disable-pip-version-check --no-input --target "$tmp" "cyclonedx-bom==$CYCLONEDX_VERSION" \
    >"$CACHE/logs/cyclonedx.log" 2>&1 || { rm -rf "$tmp"; die "cannot install cyclonedx-bom==$CYCLONEDX_VERSION (log: $CACHE/logs/cyclonedx.log)"; }
  mv "$tmp" "$TOOL"
fi
mkdir -p images/sbom
report=$CACHE/report-$VERSION.tsv
printf 'image\tsize_bytes\tid\tdigest\tbuild_s\n' > "$report.new"
[ -f "$report" ] && tail -n +2 "$report" >> "$report.new"
for n in "${NAMES[@]}"; do
  tag=$REGISTRY/fewerbits-$n:$VERSION
  step "checking $tag and writing images/sbom/fewerbits-$n.cdx.json"
  out=$(mktemp -d)
  # Run as the image's own user, read-only, no network: the inventory reads the image from inside.
  if ! podman run --rm --network none --read-only --cap-drop ALL -v "$REPO/images/check:/check:ro" \
      -v "$TOOL:/sbom-tool:ro" -v "$out:/out" -e "SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH" --user 0 --entrypoint python3.11 "$tag" -I /check/inventory.py /out \
      >"$CACHE/logs/inventory-$n.log" 2>&1; then
    cat "$CACHE/logs/inventory-$n.log" >&2
    die "inventory of $tag failed"
  fi
  user=$(podman image inspect --format '{{.Config.User}}' "$tag")
  python3 images/check/sbom.py --image "$tag" --user "$user" --inventory "$out/inventory.json" \
    --python-sbom "$out/python.cdx.json" --out "images/sbom/fewerbits-$n.cdx.json" || die "image check of $tag failed"
  rm -rf "$out"
  read -r size id digest < <(podman image inspect --format '{{.Size}} {{.Id}} {{.Digest}}' "$tag")
  grep -v "^fewerbits-$n	" "$report.new" > "$report.tmp" || true
  mv "$report.tmp" "$report.new"
  printf 'fewerbits-%s\t%s\t%s\t%s\t%s\n' "$n" "$size" "$id" "$digest" "${BUILD_S[$n]}" >> "$report.new"
done
mv "$report.new" "$report"

# ------------------------------------------------------------------------------------------ push
if [ -n "$PUSH" ]; then
  tls=()
  case ${PUSH%%/*} in 127.0.0.1|127.0.0.1:*|localhost|localhost:*) tls=(--tls-verify=false) ;; esac
  pushed=$CACHE/pushed-$VERSION.tsv
  : > "$pushed"
  for n in "${NAMES[@]}"; do
    tag=$REGISTRY/fewerbits-$n:$VERSION ref=$PUSH/fewerbits-$n:$VERSION
    step "pushing $tag to $ref (log: $CACHE/logs/push-$n.log)"
    t0=$SECONDS
    podman push "${tls[@]}" --digestfile "$CACHE/push-$n.digest" "$tag" "docker://$ref" >"$CACHE/logs/push-$n.log" 2>&1 \
      || { tail -n 20 "$CACHE/logs/push-$n.log" >&2; die "push of $tag to $ref failed (log: $CACHE/logs/push-$n.log)"; }
    printf '%s\t%s\t%s\t%s\n' "$n" "$ref" "$(cat "$CACHE/push-$n.digest")" "$((SECONDS - t0))" >> "$pushed"
  done
  python3 images/check/digests.py --version "$VERSION" --registry "$PUSH" --report "$report" --pushed "$pushed" \
    --out images/digests.json ${tls:+--plain-http} || die "could not write images/digests.json"
fi

step "done: base $BASE_IMAGE (rootfs sha256 $(cat "$BASE_DIR/rootfs.tar.sha256")), wheelhouse $WHEELS"
awk -F'\t' 'NR == 1 {printf "%-20s %10s  %-19s  %-71s  %s\n", "image", "size", "id", "digest", "build"; next}
  {printf "%-20s %7.0f MB  %-19s  %-71s  %ss\n", $1, $2 / 1e6, substr($3, 1, 19), $4, $5}' "$report"
echo "tags: $REGISTRY/fewerbits-{operator,runtime,quantjob}:$VERSION; use them with: eval \"\$(scripts/images.sh --env)\"; podman \$FEWERBITS_PODMAN_ARGS images"
