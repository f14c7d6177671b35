"""The serving canary (canary.py), observe side: reads only.

Per planned variant whose served configuration still needs a verdict (``canary.canary_wanted``)
and whose artifact is published: the stored verdict (one GET until it exists, then remembered for
the life of the process: a stored verdict never changes), the canary Deployment (watched cache),
its pods (one LIST, only while a canary Deployment exists) and the evaluation Job (watched cache).
At rest (every variant serving its configuration) nothing is read.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping

from fewerbits_api.canary import ServingQualityResult

from .artifacts import artifact_format, planned_artifacts
from .canary import (
    LABEL_CANARY,
    LEFTOVERS,
    WAITING_FAILURES,
    CanaryFacts,
    canary_deployment_name,
    canary_job_name,
    canary_wanted,
    config_hash,
)
from .observed import ArtifactFacts
from .render import LABEL_VARIANT, deployment_name
from .storage import StorageError

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


def _pod_facts(pods: list[dict[str, Any]], terminations: Any) -> dict[str, Any]:
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


def read_canaries(observer: Any, spec: Any, ns: str, name: str, the_plan: Any, artifacts: Mapping[str, ArtifactFacts],
                  deployments: Mapping[str, Mapping[str, Any]], data_pin: Any, creds: Any,
                  terminations: Any) -> dict[str, CanaryFacts]:
    """By pool, for the variants that still need a verdict for their served configuration; under
    ``LEFTOVERS``, the names of the model's canary Deployments no variant needs (a canary whose
    variant was planned away, or turned off mid-evaluation), so they are removed."""
    canaries = {d["metadata"]["name"]: d for d in observer.kube.list_deployments(ns, f"{LABEL_CANARY}={name}")}
    out: dict[str, Any] = {}
    needed: set[str] = set()
    out[LEFTOVERS] = needed  # filled below; replaced by the leftovers at the end
    keys = {p.format: p.key for p in planned_artifacts(spec, the_plan, data_pin)} \
        if spec.serving.canary.enabled else {}
    for pv in the_plan.variants if spec.serving.canary.enabled else ():
        key = keys.get(artifact_format(pv))
        facts = artifacts.get(key) if key else None
        if key is None or facts is None or facts.manifest is None:
            continue
        dname = deployment_name(name, pv.pool)
        chash = config_hash(spec, pv, key, name, observer.settings)
        if not canary_wanted(spec, pv, deployments.get(dname), chash):
            continue
        needed.add(canary_deployment_name(dname))
        read: dict[str, Any] = {}
        try:
            read["result"] = _verdict(observer.store, spec.storage, key, chash, creds)
        except StorageError as e:
            read["result_error"] = str(e)
        cdep = canaries.get(canary_deployment_name(dname))
        if cdep is not None:
            read["deployment"] = cdep
            pods = observer.kube.list_pods(ns, f"{LABEL_CANARY}={name},{LABEL_VARIANT}={pv.pool}")
            read.update(_pod_facts(pods, terminations))
        job = observer.kube.get_job(ns, canary_job_name(name, pv.pool, chash))
        if job is not None:
            jf = observer._job(ns, job)
            read["job"] = jf
            msgs = [t.message for t in jf.terminations if t.message.strip().startswith("{")]
            if msgs:
                read["job_message"] = msgs[0]
        out[pv.pool] = CanaryFacts(chash, **read)
    out[LEFTOVERS] = tuple(sorted(set(canaries) - needed))
    return out
