"""The vLLM launch wrapper: check that this GPU can run the artifact's format, then run vLLM as its
child (``supervise``: its log passes through; its root cause becomes the termination message).

The planner already placed the variant on a pool whose compute capability fits its format
(the same ``cc_verdict``); this is the last line of defence against a mislabelled node or a
hand-edited Deployment. It fails in a second with a message naming both sides instead of letting
vLLM spend minutes loading weights and then die in a kernel check.

The compute capability comes from the device when one is visible (``nvidia-smi``, or torch if it
is importable: the runtime image carries neither requirement), else from what the operator planned
for (``--node-cc`` or ``FEWERBITS_NODE_GPU_CC``; the Downward API cannot read node labels, so the
operator passes the pool's ``nvidia.com/gpu.compute.major``/``.minor`` as an environment variable).
Compute capabilities are compared as numbers (10.0 > 9.0), never as strings.
"""

from __future__ import annotations

import collections
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from fewerbits_api.formats import CC, FORMAT_FACTS, QuantFormat, cc_verdict, fmt_cc

from .errors import (EXIT_ENGINE_DIED, ExecFailed, GPUIncompatible, StorageError, UsageError, termination_message,
                     write_termination_message)
from .vllmlog import root_cause
from .layout import DEST_MANIFEST_NAME, MARKER_NAME

log = logging.getLogger("fewerbits.launch")

_CC_RE = re.compile(r"^\s*(\d+)(?:\.(\d+))?\s*$")


def parse_cc(text: str) -> CC:
    """'9.0' -> (9, 0); '10.0' -> (10, 0); '12.1' -> (12, 1); '9' -> (9, 0)."""
    m = _CC_RE.match(text or "")
    if not m:
        raise ValueError(f"not a compute capability: {text!r} (expected MAJOR.MINOR, e.g. 9.0)")
    return int(m.group(1)), int(m.group(2) or 0)


@dataclass(frozen=True)
class GPUInfo:
    cc: CC
    name: str | None
    source: str
    """Where the figure came from: nvidia-smi, torch, --node-cc, FEWERBITS_NODE_GPU_CC."""

    def describe(self) -> str:
        return f"{fmt_cc(self.cc)} ({self.name})" if self.name else fmt_cc(self.cc)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    fallback: bool
    message: str


def check(fmt: QuantFormat, gpu: GPUInfo) -> Verdict:
    """Whether an artifact of ``fmt`` can run on ``gpu``, natively or through a fallback kernel
    (``fewerbits_api.formats.cc_verdict``, the planner's verdict too)."""
    verdict = cc_verdict(fmt, gpu.cc)
    native_min = FORMAT_FACTS[fmt].native_min_cc
    if verdict.kind == "refused":
        return Verdict(False, False, f"artifact format {verdict.why}; this GPU is {gpu.describe()}")
    if verdict.kind == "fallback":
        return Verdict(True, True, f"artifact format {fmt.value} has no native kernel on compute capability "
                                   f"{gpu.describe()} (native from {fmt_cc(native_min)}): it {verdict.why}")
    return Verdict(True, False, f"artifact format {fmt.value} runs natively on compute capability "
                                f"{gpu.describe()} (native from {fmt_cc(native_min)})")


def _from_nvidia_smi() -> GPUInfo | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=compute_cap,name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("nvidia-smi failed (%s); falling back to the planned compute capability", e)
        return None
    gpus = []
    for line in out.splitlines():
        cap, _, name = line.partition(",")
        try:
            gpus.append((parse_cc(cap), name.strip() or None))
        except ValueError:
            continue
    if not gpus:
        return None
    cc, name = min(gpus)  # every visible GPU must run the model: the weakest one decides
    return GPUInfo(cc, name, "nvidia-smi")


def _from_torch() -> GPUInfo | None:
    try:
        import torch  # noqa: PLC0415 - optional: the runtime image has no torch, vLLM's does
    except Exception:  # noqa: BLE001 - not installed or broken: not our source of truth then
        return None
    try:
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return None
        gpus = [(torch.cuda.get_device_capability(i), torch.cuda.get_device_name(i))
                for i in range(torch.cuda.device_count())]
    except Exception as e:  # noqa: BLE001
        log.warning("torch could not query the GPU (%s)", e)
        return None
    cc, name = min(gpus)
    return GPUInfo((int(cc[0]), int(cc[1])), name, "torch")


def detect_gpu(node_cc: str | None, env: dict[str, str] | None = None, probe: bool = True) -> GPUInfo | None:
    """The device's own figure first; the planned one otherwise. A disagreement is logged: the
    device is what the kernels will see."""
    env = os.environ if env is None else env
    planned: GPUInfo | None = None
    planned_text, source = (node_cc, "--node-cc") if node_cc else (env.get("FEWERBITS_NODE_GPU_CC"),
                                                                    "FEWERBITS_NODE_GPU_CC")
    if planned_text:
        try:
            planned = GPUInfo(parse_cc(planned_text), env.get("FEWERBITS_NODE_GPU_PRODUCT") or None, source)
        except ValueError as e:
            raise UsageError(f"{source}: {e}") from None
    device = (_from_nvidia_smi() or _from_torch()) if probe else None
    if device and planned and device.cc != planned.cc:
        log.warning("the GPU reports compute capability %s but the variant was planned for %s (%s): "
                    "trusting the device; check the node's GPU labels", device.describe(),
                    planned.describe(), planned.source)
    return device or planned


def model_dir_from_args(cmd: list[str]) -> str | None:
    """The model path of a ``vllm serve MODEL ...`` or ``... --model MODEL`` command line."""
    for i, a in enumerate(cmd):
        if a == "--model" and i + 1 < len(cmd):
            return cmd[i + 1]
        if a.startswith("--model="):
            return a.split("=", 1)[1]
    if "serve" in cmd:
        i = cmd.index("serve")
        if i + 1 < len(cmd) and not cmd[i + 1].startswith("-"):
            return cmd[i + 1]
    return None


def lora_paths(cmd: list[str]) -> list[str]:
    """The adapter directories of ``--lora-modules NAME=PATH ...`` (the values up to the next flag)."""
    paths: list[str] = []
    taking = False
    for a in cmd:
        if a.startswith("--"):
            taking = a == "--lora-modules"
            if a.startswith("--lora-modules="):
                paths.append(a.split("=", 1)[1].partition("=")[2])
            continue
        if taking and "=" in a:
            paths.append(a.partition("=")[2])
    return [p for p in paths if p]


def format_from_manifest(path: Path) -> QuantFormat:
    try:
        doc = json.loads(path.read_text())
        return QuantFormat(doc["format"])
    except FileNotFoundError:
        raise UsageError(f"no manifest at {path}: run the fetcher first, or pass --format") from None
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"cannot read the format from {path}: {e}") from None


def resolve_format(fmt: str | None, manifest: str | None, cmd: list[str]) -> QuantFormat:
    if fmt:
        try:
            return QuantFormat(fmt)
        except ValueError:
            raise UsageError(f"unknown format {fmt!r} (known: "
                             f"{', '.join(f.value for f in QuantFormat if f is not QuantFormat.AUTO)})") from None
    if manifest:
        return format_from_manifest(Path(manifest))
    model = model_dir_from_args(cmd)
    if model and Path(model).is_dir():
        return format_from_manifest(Path(model) / DEST_MANIFEST_NAME)
    raise UsageError("cannot tell the artifact's format: pass --format (or FEWERBITS_FORMAT), --manifest, "
                     "or a vLLM command whose model is a directory the fetcher filled")


def prepare(fmt: QuantFormat, gpu: GPUInfo | None, allow_unknown_gpu: bool = True) -> Verdict:
    """Decide; raise GPUIncompatible when the artifact cannot run here."""
    if fmt is QuantFormat.AUTO:
        raise UsageError("format 'auto' is a request, not an artifact format")
    if gpu is None:
        msg = (f"no compute capability known (no nvidia-smi, no torch GPU, no --node-cc or "
               f"FEWERBITS_NODE_GPU_CC): cannot check that format {fmt.value} fits this GPU")
        if not allow_unknown_gpu:
            raise GPUIncompatible(msg)
        log.warning("%s; starting anyway", msg)
        return Verdict(True, False, msg)
    verdict = check(fmt, gpu)
    if not verdict.ok:
        raise GPUIncompatible(verdict.message, format=fmt.value, computeCapability=fmt_cc(gpu.cc),
                              gpu=gpu.name, ccSource=gpu.source)
    if verdict.fallback:
        log.warning("%s", verdict.message)
    else:
        log.info("%s", verdict.message)
    return verdict


FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
KEPT_LINES = 2000
"""How much of the end of vLLM's output is kept to find its root cause (a start's traceback is a
few hundred lines; the kubelet itself keeps only 2,048 bytes)."""


def supervise(cmd: list[str], out: BinaryIO | None = None) -> int:
    """Run vLLM as this process's child and return its exit status (128 + N for signal N, as a shell
    does). Its output passes through line by line to ``out`` (the container's log, unchanged), and
    the end of it is kept: when vLLM fails with an exception, its root cause (vllmlog.root_cause:
    the engine core's own error, not the API server's "see root cause above") becomes the
    container's termination message, which the operator shows in ``Ready=False PodsFailing``. An
    argument error has no exception: the termination message stays empty and the kubelet's
    FallbackToLogsOnError tail ("vllm: error: unrecognized arguments: ...") says it, as before.

    Why not exec: after an exec nothing is left to read vLLM's log when it dies. SIGTERM, SIGINT,
    SIGHUP, SIGQUIT and SIGUSR1/2 are forwarded to vLLM, so a pod's deletion still drains it."""
    if not cmd:
        raise UsageError("nothing to launch: give the command after '--'")
    out = out if out is not None else sys.stdout.buffer
    log.info("starting %s", " ".join(cmd[:2]) + (" ..." if len(cmd) > 2 else ""))
    for h in logging.getLogger().handlers:
        h.flush()
    forwarded: list[int] = []
    pending: list[int] = []
    children: list[subprocess.Popen] = []

    def forward(signum: int, _frame: object) -> None:  # before the start too: delivered once it runs
        forwarded.append(signum)
        if children:
            children[0].send_signal(signum)
        else:
            pending.append(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        try:
            children.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, close_fds=False))
        except OSError as e:
            raise ExecFailed(f"cannot start {cmd[0]!r}: {e.strerror}") from None
        for signum in pending:
            children[0].send_signal(signum)
        kept = _pass_through(children[0].stdout, out)
        rc = children[0].wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return _verdict(rc, bool(forwarded), root_cause("\n".join(kept)), cmd[0])


def _verdict(rc: int, asked_to_stop: bool, cause: str | None, command: str) -> int:
    """The container's exit status for vLLM's, writing the termination message when it failed with
    a cause. vLLM that ends by itself with status 0 after an exception (its engine died while
    serving: the API server answers 500, /health 503, then shuts down cleanly) failed: the container
    exits EXIT_ENGINE_DIED, so it is not taken for a clean stop and its cause reaches the condition."""
    if asked_to_stop or cause is None:
        return 128 - rc if rc < 0 else rc
    if rc == 0:
        write_termination_message(termination_message("launch", "VllmEngineDied", cause, EXIT_ENGINE_DIED,
                                                      command=command))
        return EXIT_ENGINE_DIED
    if rc > 0:
        write_termination_message(termination_message("launch", "VllmFailed", cause, rc, command=command))
    return 128 - rc if rc < 0 else rc


def _pass_through(pipe: BinaryIO | None, out: BinaryIO) -> collections.deque[str]:
    """Copy the child's output to ``out`` as it comes (line by line, flushed: a log reader sees each
    line at once) until it closes; returns its last KEPT_LINES lines."""
    kept: collections.deque[str] = collections.deque(maxlen=KEPT_LINES)
    if pipe is None:
        return kept
    for line in iter(pipe.readline, b""):
        out.write(line)
        out.flush()
        kept.append(line.decode("utf-8", errors="replace").rstrip("\n"))
    return kept


def hold_in_use(model_dir: str | None) -> int | None:
    """Take a shared lock on a node-cache entry's marker and keep it while vLLM runs (``supervise``): the
    node cache never evicts an entry whose marker someone holds (``fewerbits_runtime.nodecache``).
    Returns the descriptor, or None when ``model_dir`` holds no verified copy (a pod-local copy,
    or a streamed load)."""
    if not model_dir or "://" in model_dir:
        return None
    try:
        fd = os.open(os.path.join(model_dir, MARKER_NAME), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # an eviction holds it this instant: the entry is going away
        os.close(fd)
        raise UsageError(f"{model_dir} is being evicted from the node cache: restart the pod") from None
    os.set_inheritable(fd, True)
    return fd


def check_stream_source(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 10.0) -> None:
    """For ``--load-format runai_streamer`` from ``s3://``: make sure the storage endpoint answers
    before vLLM starts, so an unreachable store fails the pod in seconds with the storage error in
    its termination message (after vLLM starts, its own failure would be all there is). Standard
    library only: one TCP connection to the endpoint (``AWS_ENDPOINT_URL``, else the bucket's
    regional AWS host); credentials and the artifact itself were checked by the init container."""
    model = model_dir_from_args(cmd)
    if not model or not model.startswith("s3://"):
        return
    env = os.environ if env is None else env
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        u = urllib.parse.urlsplit(endpoint)
        host, port = u.hostname or "", u.port or (443 if u.scheme == "https" else 80)
    else:
        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
        host, port = f"s3.{region}.amazonaws.com", 443
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        raise StorageError(f"cannot reach storage at {host}:{port} to stream {model}: "
                           f"{e.strerror or type(e).__name__}", endpoint=f"{host}:{port}") from None
