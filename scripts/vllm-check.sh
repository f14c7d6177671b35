#!/usr/bin/env bash
# vLLM's own loader as the judge: build the zoo of tiny real architectures (cached), quantize each
# in every format the planner could choose for it with the Job's own code (cached), load every
# artifact into vLLM 0.33.0's model classes with vLLM's weight loader on this CPU, and print the
# architecture × format table (loads / refused by the planner / fails with vLLM's error).
# --serve adds the served column: vLLM's own CPU build (the harness's, e2e/vllm_cpu.py) starts on
# every artifact and answers a completion and a prompt-logprobs request, or refuses with its message
# (tools/vllm_check/serve_check.py; 1-2 minutes per artifact under load, results cached per artifact;
# --serve-budget SECONDS starts no server after that long, the rest read `not run`, a rerun continues).
#
#   scripts/vllm-check.sh [--json PATH] [--serve [--serve-budget S]] [--only llama,mixtral] [--formats fp8-dynamic]
#
# Exit status 1 when any row fails. The vLLM environment is built once by
# tools/vllm_check/setup.sh (cold ~8 min, 9.4 GB; see docs/vllm-check.md).
set -euo pipefail
cd "$(dirname "$0")/.."
JSON="" ONLY="" FORMATS="" SERVE="" BUDGET=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --json) JSON="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    --formats) FORMATS="$2"; shift 2 ;;
    --serve) SERVE=1; shift ;;
    --serve-budget) BUDGET="$2"; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
if [[ ! -x .venv/bin/python ]]; then
  source scripts/lib/uv.sh
  python3 -m venv .venv && uv_install .venv/bin/python -e '.[dev,quantjob]'
fi
VENV=$(tools/vllm_check/setup.sh)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
started=$(date +%s)
.venv/bin/python -m tools.vllm_check.zoo_quantize --out "$WORK/rows.json" --only "$ONLY" --formats "$FORMATS" \
  > "$WORK/quantize.log" 2>&1 || { tail -40 "$WORK/quantize.log" >&2; exit 1; }
quantized=$(date +%s)
mapfile -t DIRS < <(.venv/bin/python -c "
import json, sys
rows = json.load(open(sys.argv[1]))
print('\n'.join(dict.fromkeys(r['artifact'] + ('@' + r['capability'] if r.get('capability') else '')
                               for r in rows if 'artifact' in r)))" "$WORK/rows.json")
if [[ ${#DIRS[@]} -gt 0 ]]; then
  "$VENV/bin/python" tools/vllm_check/load_check.py --json "$WORK/loads.json" "${DIRS[@]}" \
    > "$WORK/load.log" 2>&1 || true
fi
loaded=$(date +%s)
# The streamed load's argv (spec.serving.loadFormat: stream) through vLLM's parser and loader registry.
.venv/bin/python tools/vllm_check/stream_check.py render > "$WORK/stream-argv.json"
"$VENV/bin/python" tools/vllm_check/stream_check.py check "$WORK/stream-argv.json" 2>"$WORK/stream.log" \
  || { tail -20 "$WORK/stream.log" >&2; exit 1; }
checked=$(date +%s)
if [[ -n "$SERVE" ]]; then
  # One vLLM server at a time, each stopped before the next starts; progress on stderr.
  .venv/bin/python -m tools.vllm_check.serve_check "$WORK/rows.json" --out "$WORK/served.json" ${BUDGET:+--budget "$BUDGET"} >&2
fi
served=$(date +%s)
rc=0
.venv/bin/python -m tools.vllm_check.report "$WORK/rows.json" "$WORK/loads.json" \
  ${SERVE:+--served "$WORK/served.json"} ${JSON:+--json "$JSON"} || rc=$?
echo "quantize $(( quantized - started )) s, vLLM load check $(( loaded - quantized )) s (${#DIRS[@]} checkpoints)${SERVE:+, serve check $(( served - checked )) s}"
exit $rc
