"""The node cache's eviction order, on entries built on disk (no storage needed): unreferenced
entries first (least recently used first), referenced ones only while the cache is still over its
budget, entries in use never."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import fewerbits_runtime.nodecache as nc
from fewerbits_runtime.launch import hold_in_use
from fewerbits_runtime.layout import MARKER_NAME
from fewerbits_runtime.nodecache import NodeCache, read_referenced

SIZE = 64 * 1024


def _entry(root: Path, key: str, last_used: float, size: int = SIZE) -> None:
    cache = NodeCache(root)
    d = cache.entry(key)
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(os.urandom(size))
    (d / MARKER_NAME).write_text(json.dumps({"key": key, "files": 1, "totalBytes": size}))
    (root / "state" / f"{key}.json").write_text(json.dumps({"key": key, "lastUsed": last_used}))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "cache"
    now = time.time()
    # Last use: a oldest ... e newest.
    for i, k in enumerate("abcde"):
        _entry(r, k * 64, now - 100 + i)
    return r


def _held(root: Path) -> set[str]:
    return {p.name[0] for p in (root / "artifacts").iterdir()}


def _one(root: Path) -> int:
    return NodeCache(root).entries()[0].bytes


def test_order_is_unreferenced_lru_then_referenced_lru(root):
    cache = NodeCache(root, referenced=["a" * 64, "c" * 64])
    assert [e.key[0] for e in cache.eviction_order(keep="e" * 64)] == ["b", "d", "a", "c"]


def test_budget_evicts_unreferenced_first_and_referenced_only_while_still_over(root):
    one = _one(root)
    # Room for 4 entries plus the new one's bytes: evicting b (unreferenced, oldest of those) is enough.
    cache = NodeCache(root, budget_bytes=5 * one, referenced=["a" * 64, "c" * 64, "d" * 64])
    assert cache.make_room("n" * 64, one) == ["b" * 64]
    assert _held(root) == set("acde")
    # Room for 2 plus the new one: e (the only unreferenced one left) goes, then the oldest referenced.
    cache = NodeCache(root, budget_bytes=3 * one, referenced=["a" * 64, "c" * 64, "d" * 64])
    assert cache.make_room("n" * 64, one) == ["e" * 64, "a" * 64]
    assert _held(root) == set("cd")


def test_entries_in_use_are_never_evicted_whatever_the_budget(root):
    one = _one(root)
    fds = [hold_in_use(str(root / "artifacts" / (k * 64))) for k in "bc"]
    try:
        cache = NodeCache(root, budget_bytes=one, referenced=["a" * 64])
        # Everything not in use goes (d, e unreferenced; a referenced, over budget); b and c stay.
        assert cache.make_room("n" * 64, one) == ["d" * 64, "e" * 64, "a" * 64]
        assert _held(root) == set("bc")
    finally:
        for fd in fds:
            assert fd is not None
            os.close(fd)


def test_within_budget_and_disk_nothing_is_evicted(root, monkeypatch):
    monkeypatch.setattr(nc, "free_bytes", lambda _p: 10 * 2**40)
    assert NodeCache(root, budget_bytes=100 * _one(root)).make_room("n" * 64, SIZE) == []
    assert NodeCache(root).make_room("n" * 64, SIZE) == []  # no budget: only a short disk evicts
    assert _held(root) == set("abcde")


def test_a_short_disk_evicts_referenced_entries_too(root, monkeypatch):
    one = _one(root)
    free = {"bytes": 0}
    monkeypatch.setattr(nc, "free_bytes", lambda _p: free["bytes"])

    cache = NodeCache(root, referenced=[k * 64 for k in "abcde"])
    orig = cache._evict

    def evict(e):
        ok = orig(e)
        free["bytes"] += e.bytes if ok else 0
        return ok
    cache._evict = evict  # type: ignore[method-assign]
    assert cache.make_room("n" * 64, 2 * one) == ["a" * 64, "b" * 64]


def test_the_referenced_keys_file(tmp_path):
    assert read_referenced(tmp_path / "missing") is None  # no ConfigMap yet: every entry unreferenced
    f = tmp_path / "keys"
    f.write_text("# written by the operator\n" + "a" * 64 + "\n\n" + "b" * 64 + "\n")
    assert read_referenced(f) == ["a" * 64, "b" * 64]
