"""mallocarenas.limit: glibc's own account of its arenas (``malloc_info``) in a fresh process
whose threads each allocate, with and without the limit."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys
from pathlib import Path

import pytest

OPERATOR = Path(__file__).resolve().parents[2] / "operator"
PROGRAM = """
import ctypes, sys, threading
sys.path.insert(0, {operator!r})
from fewerbits_operator.base import mallocarenas
if {limit}:
    assert mallocarenas.limit()
libc = ctypes.CDLL(None)
held, ready = [], threading.Barrier(9)
def work():
    held.append(ctypes.create_string_buffer(1 << 16))  # malloc'd by this thread, in its arena
    ready.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
ready.wait()  # every thread has allocated and is still alive
libc.fopen.restype = ctypes.c_void_p
fp = libc.fopen({out!r}.encode(), b"w")
libc.malloc_info(0, ctypes.c_void_p(fp)); libc.fclose(ctypes.c_void_p(fp))
for t in threads: t.join()
"""


def heaps(tmp_path: Path, limit: bool) -> int:
    out = tmp_path / f"malloc-{limit}.xml"
    subprocess.run([sys.executable, "-c", PROGRAM.format(operator=str(OPERATOR), limit=limit, out=str(out))],
                   check=True, timeout=60)
    return out.read_text().count("<heap nr=")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="M_ARENA_MAX is glibc's; this C library is not glibc")
def test_threads_share_two_arenas_with_the_limit(tmp_path: Path):
    assert heaps(tmp_path, limit=False) > 2  # glibc's default: a new arena for each new thread
    assert heaps(tmp_path, limit=True) == 2


def test_another_c_library_is_left_alone(monkeypatch: pytest.MonkeyPatch):
    from fewerbits_operator.base import mallocarenas

    def no_mallopt(_):
        raise AttributeError("mallopt")
    monkeypatch.setattr(ctypes, "CDLL", no_mallopt)
    assert mallocarenas.limit() is False
