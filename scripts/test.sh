#!/usr/bin/env bash
# Set up everything the tests need and run them: a virtual environment with the project and its
# [dev,quantjob] extras, the control-plane binaries built from Go modules (cached outside the
# repo, keyed by version), then pytest. Extra arguments go to pytest.
#
#   scripts/test.sh                 # everything
#   scripts/test.sh tests/unit      # unit tests only (no Go build needed)
#
# Tests run in FEWERBITS_TEST_WORKERS pytest-xdist workers (default 2; 0 runs them in this process),
# one test file per worker at a time: each worker starts its own control plane on disjoint loopback
# pod ranges. Most of a cluster test's time is waiting on controllers, so two workers on two cores
# finish sooner than one.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/uv.sh

VENV=${FEWERBITS_VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3

step() { printf '\n==> %s (%ds)\n' "$*" "$SECONDS"; }

# The build (Go compiles, the vLLM environment's install) does not need this venv: it runs in
# the background while uv installs the project (scripts/lib/uv.sh), so a cold run pays the longer of the two.
build_pid="" check_pid=""
if [ -x e2e/build.sh ] && [ "${FEWERBITS_SKIP_BUILD:-}" != 1 ]; then
  step "building the control plane from Go modules in the background (cached)"
  e2e/build.sh &
  build_pid=$!
  if [ $# -eq 0 ]; then
    # The whole suite runs tests/vllm, whose vLLM 0.33 environment (cold: 2-3 min of downloads and
    # unpacking, 9.4 GB) was built in that test's setup, after the build; beside the Go compiles it
    # costs little wall time. tools/vllm_check/setup.sh is idempotent under its own lock.
    ${FEWERBITS_BUILD_NICE:-nice -n 10} tools/vllm_check/setup.sh >/dev/null &
    check_pid=$!
  fi
fi
if [ ! -x "$VENV/bin/python" ]; then
  step "creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
step "installing fewerbits with [dev,quantjob] extras (uv cache: ${UV_CACHE_DIR:-~/.cache/uv})"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip==25.3
uv_install "$VENV/bin/python" -e '.[dev,quantjob]'
if [ -n "$build_pid" ]; then
  step "waiting for the build"
  wait "$build_pid" || { echo "test.sh: the build failed (see above)" >&2; exit 1; }
fi
if [ -n "$check_pid" ]; then
  # A failure here is the vLLM check test's to report (it runs setup.sh again and shows why).
  wait "$check_pid" || echo "test.sh: the vLLM check's environment did not build; tests/vllm will retry it" >&2
fi

step "running tests"
set +e
"$VENV/bin/python" -m pytest -ra --durations=15 -n "${FEWERBITS_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as failure" >&2
  exit 1
fi
step "done (pytest exit $rc)"
exit "$rc"
