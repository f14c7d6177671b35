"""The Argo CD health check of the LeaderWorkerSets fewerbits renders for multi-node variants
(charts/fewerbits/files/argocd-health-leaderworkerset.lua), run in Lua 5.1 and 5.4 through lupa,
against objects shaped like LeaderWorkerSet v0.7's status."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lupa import lua51, lua54

ROOT = Path(__file__).resolve().parents[2]
LUA = ROOT / "charts" / "fewerbits" / "files" / "argocd-health-leaderworkerset.lua"


def _to_lua(lua: Any, value: Any) -> Any:
    if isinstance(value, dict):
        return lua.table_from({k: _to_lua(lua, v) for k, v in value.items() if v is not None})
    if isinstance(value, list):
        return lua.table_from([_to_lua(lua, v) for v in value])
    return value


def health(obj: dict[str, Any], runtime: type) -> tuple[str, str]:
    lua = runtime()
    lua.globals().obj = _to_lua(lua, obj)
    hs = lua.execute(LUA.read_text())
    return hs["status"], hs["message"]


def lws(replicas=2, status=None):
    return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": {"name": "m-h100-x8", "generation": 1}, "spec": {"replicas": replicas,
                                                                         "leaderWorkerTemplate": {"size": 2}},
            "status": status}


def cond(type_, status, message=""):
    return {"type": type_, "status": status, "reason": type_, "message": message}


@pytest.mark.parametrize("runtime", [lua51.LuaRuntime, lua54.LuaRuntime], ids=["lua5.1", "lua5.4"])
@pytest.mark.parametrize("obj, expected, contains", [
    (lws(status=None), "Progressing", "controller"),
    (lws(status={"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2,
                 "conditions": [cond("Available", "True"), cond("Progressing", "True", "Replicas are progressing")]}),
     "Progressing", "1/2 groups ready"),
    (lws(status={"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                 "conditions": [cond("Available", "True"), cond("Progressing", "False")]}),
     "Healthy", "2/2 groups ready"),
    (lws(status={"replicas": 2, "readyReplicas": 2, "updatedReplicas": 1,
                 "conditions": [cond("Available", "True"), cond("UpdateInProgress", "True")]}),
     "Progressing", "1 updated"),
    (lws(status={"replicas": 2, "readyReplicas": 0, "updatedReplicas": 2,
                 "conditions": [cond("Available", "False", "All replicas are not ready"), cond("Progressing", "False")]}),
     "Degraded", "All replicas are not ready"),
    (lws(replicas=0, status={"replicas": 0, "conditions": [cond("Available", "True")]}), "Suspended", "0 groups"),
])
def test_health(obj, expected, contains, runtime):
    status, message = health(obj, runtime)
    assert status == expected, message
    assert contains in message
