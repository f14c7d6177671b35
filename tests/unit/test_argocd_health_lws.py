"""The Argo CD health check of the LeaderWorkerSets fewerbits renders for multi-node variants
(charts/fewerbits/files/argocd-health-leaderworkerset.lua), run in Lua 5.1 and 5.4 through lupa with
only the globals Argo CD gives a script without useOpenLibs (tests/unit/argo_lua.py), against objects
shaped like LeaderWorkerSet v0.7's status."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from lupa import lua51, lua54

from tests.unit.argo_lua import ARGO_GLOBALS, STRING_FUNCTIONS, chunk_names, run_health

ROOT = Path(__file__).resolve().parents[2]
LUA = ROOT / "charts" / "fewerbits" / "files" / "argocd-health-leaderworkerset.lua"


def health(obj: dict[str, Any], lua: ModuleType) -> tuple[str, str]:
    return run_health(LUA.read_text(), obj, lua)


def lws(replicas=2, status=None):
    return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": {"name": "m-h100-x8", "generation": 1}, "spec": {"replicas": replicas,
                                                                         "leaderWorkerTemplate": {"size": 2}},
            "status": status}


def cond(type_, status, message=""):
    return {"type": type_, "status": status, "reason": type_, "message": message}


@pytest.mark.parametrize("lua", [lua51, lua54], ids=["argocd-lua5.1", "argocd-lua5.4"])
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
def test_health(obj, expected, contains, lua):
    status, message = health(obj, lua)
    assert status == expected, message
    assert contains in message


def test_uses_only_what_argo_cd_provides():
    """Every global read, in every branch, is one Argo CD sets or the script itself writes (hs),
    and no string method is called."""
    names = chunk_names(LUA.read_text())
    assert names.reads <= ARGO_GLOBALS | names.writes, sorted(names.reads - ARGO_GLOBALS - names.writes)
    assert not names.methods & STRING_FUNCTIONS
