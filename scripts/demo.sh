#!/usr/bin/env bash
# The local demo: fewerbits end to end on a real control plane built from Go modules.
# Sets up .venv and the control-plane binaries (cached), then runs `python -m e2e.demo`
# (see its docstring): a QuantizedModel from apply to Ready, with a real quantization Job.
#   scripts/demo.sh            # tears down at the end
#   scripts/demo.sh --keep     # leaves it running; stop with: .venv/bin/python -m e2e.cluster down
#   scripts/demo.sh --gitops   # the same model, installed and synced by Argo CD from a local git repository
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/uv.sh
VENV=${FEWERBITS_VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
# The build (Go compiles, the vLLM environment's install) does not need this venv: it runs in
# the background while uv installs the project (scripts/lib/uv.sh), so a cold demo pays the longer of the two.
echo "==> building what the demo uses in the background (cached; the first time takes a while)"
# Only these: the control plane, the S3 server, Helm and vLLM's CPU build that serves the model (not
# the simulator, Kueue, LeaderWorkerSet, Prometheus or the picker: the demo's cluster runs without them),
# and Argo CD with --gitops.
components=(kubernetes etcd kwok minio helm vllm)
[[ " $* " == *" --gitops "* ]] && components+=(argocd)
e2e/build.sh "${components[@]}" &
build_pid=$!
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
echo "==> installing fewerbits with [dev,quantjob] extras"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip==25.3
uv_install "$VENV/bin/python" -e '.[dev,quantjob]'
echo "==> waiting for the build"
wait "$build_pid" || { echo "demo: the build failed (see above)" >&2; exit 1; }
exec "$VENV/bin/python" -m e2e.demo "$@"
