#!/usr/bin/env bash
# The vLLM virtual environment the load check runs in: vllm==0.33.0 with the torch it pins,
# outside the repository and never the project's environment. Cached under
# ${FEWERBITS_CACHE:-~/.cache/fewerbits}/vllm-check/venv-<version>, keyed by the vLLM version;
# a finished environment carries a .complete stamp and is reused as it is. Prints its path.
#
# Measured on this 2-core machine with pip (uv now: scripts/lib/uv.sh): cold 171 s with an empty pip cache (496 s under heavy load),
# 9.4 GB on disk (torch 2.14 with its CUDA libraries); warm: 0 s.
set -euo pipefail
VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
ROOT="${FEWERBITS_CACHE:-$HOME/.cache/fewerbits}/vllm-check"
VENV="$ROOT/venv-$VLLM_VERSION"
if [[ -f "$VENV/.complete" ]]; then
  echo "$VENV"
  exit 0
fi
PY="${PYTHON:-python3.11}"
mkdir -p "$ROOT"
exec 9>"$ROOT/.setup.lock"
flock 9
if [[ -f "$VENV/.complete" ]]; then echo "$VENV"; exit 0; fi
rm -rf "$VENV"
started=$(date +%s)
"$PY" -m venv "$VENV" >&2
P="$VENV/bin/python -m pip --disable-pip-version-check -q"
source "$(dirname "$0")/../../scripts/lib/uv.sh"
WHL="$ROOT/whl"
mkdir -p "$WHL"
$P download "vllm==$VLLM_VERSION" --no-deps -d "$WHL" >&2
wheel=$(ls "$WHL"/vllm-"$VLLM_VERSION"-*.whl | head -1)
# vLLM 0.33.0 requires certifi>=2026.10.19, newer than any certifi the index had when this was
# written: its requirements are installed from the wheel's METADATA with that one pin relaxed
# (as tools/vllm_args/NOTES.md does).
unzip -p "$wheel" "vllm-$VLLM_VERSION.dist-info/METADATA" | grep '^Requires-Dist' | grep -v 'extra ==' \
  | sed 's/^Requires-Dist: //; s/^certifi>=[0-9.]*/certifi/' > "$ROOT/requirements-$VLLM_VERSION.txt"
uv_install "$VENV/bin/python" --no-deps "$wheel" >&2
uv_install "$VENV/bin/python" -r "$ROOT/requirements-$VLLM_VERSION.txt" >&2
touch "$VENV/.complete"
echo "vLLM $VLLM_VERSION environment built in $(( $(date +%s) - started )) s: $(du -sh "$VENV" | cut -f1)" >&2
echo "$VENV"
