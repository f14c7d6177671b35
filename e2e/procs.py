"""Process plumbing shared by the cluster and the pod runner: start in its own process group, die
with the parent unless detached, stop the whole group, and find free loopback ports."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # The child gets SIGKILL when the thread that started it exits — even if pytest is SIGKILLed.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(argv: list[str], log: Path, *, env: dict | None = None, cwd: Path | None = None,
          detach: bool = False) -> subprocess.Popen:
    """Start argv in a new session (so its whole process group can be signalled), output to log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    out = open(log, "ab", buffering=0)
    try:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
            start_new_session=True, preexec_fn=None if detach else _die_with_parent,
        )
    finally:
        out.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); treat it as gone.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_group(pgid: int, grace: float = 10.0, proc: subprocess.Popen | None = None) -> None:
    """SIGTERM the process group, wait up to `grace` seconds, then SIGKILL what is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if proc is not None:
            proc.poll()
        # Zombies count as gone: after `up` exits, init adopts the components and may not reap them.
        if not group_alive(pgid) or not _group_has_others(pgid):
            break
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    if proc is not None:
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)


def _group_has_others(pgid: int) -> bool:
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (p / "stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


_GIVEN: set[int] = set()
_RNG = random.Random()


def _port_slice() -> range:
    """The ports this process draws from: below the kernel's ephemeral range, so no outgoing
    connection (which takes its local port from that range) can take a port between free_port and
    the server's bind; each pytest-xdist worker gets a slice of its own."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first, last = 10000, max(low, 12000)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1), 1)
    index = int(worker) % count if worker.isdigit() else 0
    width = (last - first) // count
    return range(first + index * width, first + (index + 1) * width)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing holds now, never the same one twice in this process (asking the kernel for
    port 0 can hand back a port it gave a moment ago, once the probing socket is closed)."""
    ports = _port_slice()
    for _ in range(4 * len(ports)):
        port = _RNG.choice(ports)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port left in {ports.start}-{ports.stop - 1}")


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Something listens on (or holds) the port. Connections of a killed server lingering in
    TIME_WAIT do not count: a restarted server (Go and MinIO set SO_REUSEADDR) can bind over them."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
