#!/usr/bin/env bash
# The local demo. The full demo (control plane, operator, a model to Ready) arrives with the
# operator; until then this sets up the environment and runs what exists: it validates the
# sample resources with the API models and prints the CRDs generated from them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FEWERBITS_VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e .
echo "==> validating the sample resources"
"$VENV/bin/fewerbits" validate crds/samples/*.yaml
echo "==> the QuantizedModel CRD (first 40 lines)"
"$VENV/bin/fewerbits" crds | head -40
