"""The serving canary (canary.py), observe side: reads only.

Per planned variant whose served configuration still needs a verdict (``canary.canary_wanted``)
and whose artifact is published: the stored verdict (one GET until it exists, then remembered for
the life of the process: a stored verdict never changes), the canary Deployment (watched cache;
a multi-node variant's canary LeaderWorkerSet from the LeaderWorkerSet cache where that API is
served), its pods (one LIST, only while a canary exists; a group's leader is the pod evaluated)
and the evaluation Job (watched cache).
At rest (every variant serving its configuration) nothing is read.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Mapping, Sequence

from fewerbits_api.canary import ServingQualityResult

from fewerbits_operator.artifacts.keys import PlannedArtifact, artifact_format, planned_artifacts
from fewerbits_operator.base.actions import WorkloadKind
from fewerbits_operator.serving.canary import (
    LABEL_CANARY,
    LWS_WORKER_INDEX,
    WAITING_FAILURES,
    canary_deployment_name,
    canary_job_name,
    canary_wanted,
    config_hash,
    published_by_pool,
)
from fewerbits_operator.base.observed import ArtifactFacts, CanaryFacts, CanaryLeftovers
from fewerbits_operator.serving.render import LABEL_VARIANT, deployment_name
from fewerbits_operator.base.storage import StorageError
from fewerbits_operator.base.terminations import json_message, terminations

_VERDICTS: dict[tuple[Any, ...], ServingQualityResult] = {}
_LOCK = threading.Lock()


def _verdict(store: Any, storage: Any, key: str, chash: str, creds: Any) -> ServingQualityResult | None:
    cache_key = (storage.uri, storage.endpoint, key, chash, getattr(creds, "access_key", None))
    with _LOCK:
        if cache_key in _VERDICTS:
            return _VERDICTS[cache_key]
    result = store.get_serving_result(storage, key, chash, creds)
    if result is not None and result.configHash == chash and result.key == key:
        with _LOCK:
            _VERDICTS[cache_key] = result
        return result
    return None


def _pod_facts(pods: list[dict[str, Any]]) -> dict[str, Any]:
    newest = sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "", reverse=True)
    out: dict[str, Any] = {"terminations": terminations(newest)}
    waiting = []
    for pod in newest:
        st = pod.get("status") or {}
        if pod["metadata"].get("deletionTimestamp"):
            continue
        conds = {c.get("type"): c for c in st.get("conditions") or []}
        if (conds.get("Ready") or {}).get("status") == "True" and st.get("podIP"):
            out.update(pod_ready=True, pod_ip=st["podIP"])
        sched = conds.get("PodScheduled") or {}
        if sched.get("status") == "False" and sched.get("reason") == "Unschedulable":
            out["unschedulable"] = str(sched.get("message") or "Unschedulable")[:300]
        for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
            w = (cs.get("state") or {}).get("waiting") or {}
            if w.get("reason") in WAITING_FAILURES:
                waiting.append(f"pod {pod['metadata']['name']} container {cs.get('name')}: {w['reason']}"
                               + (f": {str(w.get('message'))[:300]}" if w.get("message") else ""))
        if st.get("reason") == "Evicted":
            waiting.append(f"pod {pod['metadata']['name']} evicted: {str(st.get('message') or '')[:300]}")
    out["waiting"] = tuple(waiting)
    return out


def _ready(pod: Mapping[str, Any]) -> bool:
    st = pod.get("status") or {}
    return not pod["metadata"].get("deletionTimestamp") and bool(st.get("podIP")) and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])


def _group_facts(pods: list[dict[str, Any]], size: int) -> dict[str, Any]:
    """A canary LeaderWorkerSet group's pods: the leader's IP (worker index 0: the pod that serves
    the OpenAI API), ready only when all ``size`` pods of the group are Ready (the leader answers
    only once its workers joined, and a worker lost takes the group down)."""
    out = _pod_facts(pods)
    out.pop("pod_ip", None)
    out.pop("pod_ready", None)
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    leader = next((p for p in sorted(live, key=lambda p: p["metadata"].get("creationTimestamp") or "", reverse=True)
                   if (p["metadata"].get("labels") or {}).get(LWS_WORKER_INDEX) == "0"), None)
    if leader is not None and (leader.get("status") or {}).get("podIP"):
        out["pod_ip"] = leader["status"]["podIP"]
        out["pod_ready"] = len(live) >= size and all(_ready(p) for p in live)
    return out


_NO_VERDICT: dict[tuple[Any, ...], float] = {}
NO_VERDICT_SECONDS = 600.0
"""How long the absence of a verdict is remembered for a configuration that serves (one rolled
out before the canary existed): a verdict written since (another process's canary, the same
configuration again after another) is read at most this much later."""


def _judged(observer: Any, spec: Any, key: str, chash: str, creds: Any) -> CanaryFacts:
    """The stored verdict of a configuration that serves, for what it says of the adapters: a
    verdict once read is remembered (``_verdict``), its absence for ``NO_VERDICT_SECONDS``."""
    cache_key = (spec.storage.uri, spec.storage.endpoint, key, chash, getattr(creds, "access_key", None))
    now = time.monotonic()
    with _LOCK:
        if cache_key in _VERDICTS:
            return CanaryFacts(chash, result=_VERDICTS[cache_key])
        if now - _NO_VERDICT.get(cache_key, -NO_VERDICT_SECONDS) < NO_VERDICT_SECONDS:
            return CanaryFacts(chash)
    try:
        result = _verdict(observer.store, spec.storage, key, chash, creds)
    except StorageError as e:
        return CanaryFacts(chash, result_error=str(e))
    with _LOCK:
        if result is None:
            if len(_NO_VERDICT) > 10000:
                _NO_VERDICT.clear()
            _NO_VERDICT[cache_key] = now
        else:
            _NO_VERDICT.pop(cache_key, None)
    return CanaryFacts(chash, result=result)


def _canary_facts(observer: Any, spec: Any, ns: str, name: str, pool: str, key: str, chash: str,
                  cdep: Mapping[str, Any] | None, creds: Any) -> CanaryFacts:
    """One pool's canary as read now: its stored verdict, its serving object's pods, its Job."""
    read: dict[str, Any] = {}
    try:
        read["result"] = _verdict(observer.store, spec.storage, key, chash, creds)
    except StorageError as e:
        read["result_error"] = str(e)
    if cdep is not None:
        read["deployment"] = cdep
        pods = observer.kube.list_pods(ns, f"{LABEL_CANARY}={name},{LABEL_VARIANT}={pool}")
        if WorkloadKind.of(cdep) is WorkloadKind.LEADER_WORKER_SET:
            size = int(((cdep.get("spec") or {}).get("leaderWorkerTemplate") or {}).get("size") or 1)
            read.update(_group_facts(pods, size))
        else:
            read.update(_pod_facts(pods))
    job = observer.kube.get_job(ns, canary_job_name(name, pool, chash))
    if job is not None:
        jf = observer._job(ns, job)
        read["job"] = jf
        if (message := json_message(jf.terminations)) is not None:
            read["job_message"] = message
    return CanaryFacts(chash, **read)


def read_canaries(observer: Any, spec: Any, ns: str, name: str, the_plan: Any, artifacts: Mapping[str, ArtifactFacts],
                  deployments: Mapping[str, Mapping[str, Any]], data_pin: Any, creds: Any,
                  planned: Sequence[PlannedArtifact] | None = None) -> tuple[dict[str, CanaryFacts], CanaryLeftovers]:
    """By pool, for the variants that still need a verdict for their served configuration; and
    the model's canaries no variant needs (a canary whose variant was planned away, or turned off
    mid-evaluation), so they are removed. ``planned``: the plan's artifacts as observe computed
    them (computed here from ``the_plan`` and ``data_pin`` when not given)."""
    canaries = {d["metadata"]["name"]: d for d in observer.kube.list_deployments(ns, f"{LABEL_CANARY}={name}")}
    canary_lws: dict[str, Any] = {}
    lws_served = hasattr(observer.kube, "lws_available") and observer.kube.lws_available()
    if lws_served:
        # Multi-node variants' canaries (from the LeaderWorkerSet cache; discovery is remembered 10 s).
        canary_lws = {d["metadata"]["name"]: {**d, "kind": WorkloadKind.LEADER_WORKER_SET.value}
                      for d in observer.kube.list_lws(ns, f"{LABEL_CANARY}={name}")}
    out: dict[str, CanaryFacts] = {}
    needed: set[tuple[WorkloadKind, str]] = set()
    if planned is None and spec.serving.canary.enabled:
        planned = planned_artifacts(spec, the_plan, data_pin)
    keys = {p.format: p.key for p in planned or ()} \
        if spec.serving.canary.enabled else {}
    published = published_by_pool(spec.adapters, the_plan.variants,
                                  lambda pv: artifacts.get(keys.get(artifact_format(pv)) or ""))
    for pv in the_plan.variants if spec.serving.canary.enabled else ():
        planned_key = keys.get(artifact_format(pv))
        facts = artifacts.get(planned_key) if planned_key else None
        if planned_key is None or facts is None or facts.manifest is None:
            continue
        # The key it is published at, which decide serves and hashes into the served configuration:
        # a legacy key's or an `auto` calibration's fallback key (artifacts.keys.published_at).
        key = facts.manifest.key
        dname = deployment_name(name, pv.pool)
        chash = config_hash(spec, pv, key, name, observer.settings, published.get(pv.pool))
        if not canary_wanted(spec, pv, deployments.get(dname), chash):
            if spec.adapters:  # the adapters its verdict refused stay refused (canary.refused_adapters)
                out[pv.pool] = _judged(observer, spec, key, chash, creds)
            continue
        kind = WorkloadKind.for_nodes(pv.nodesPerReplica)
        lws = kind is WorkloadKind.LEADER_WORKER_SET
        if lws and not lws_served:
            continue  # refused by decide (no LeaderWorkerSet API): nothing to judge
        needed.add((kind, canary_deployment_name(dname)))
        cname = canary_deployment_name(dname)
        # The canary of the variant's kind; else one of the other kind left by an older plan (of
        # another configuration: decide replaces it).
        cdep = (canary_lws if lws else canaries).get(cname) or (canaries if lws else canary_lws).get(cname)
        if cdep is not None:
            needed.add((WorkloadKind.of(cdep), cname))
        out[pv.pool] = _canary_facts(observer, spec, ns, name, pv.pool, key, chash, cdep, creds)
    return out, CanaryLeftovers(
        deployments=tuple(sorted(n for n in canaries if (WorkloadKind.DEPLOYMENT, n) not in needed)),
        leader_worker_sets=tuple(sorted(n for n in canary_lws if (WorkloadKind.LEADER_WORKER_SET, n) not in needed)))
