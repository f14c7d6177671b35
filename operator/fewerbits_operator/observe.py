"""Observe: gather everything one reconcile decides from into one immutable value, ``Observed``.

This module only reads (the API server, object storage); it decides nothing. What to read next
sometimes depends on what was read (the effective spec names the Secrets, the plan names the
artifact keys): those steps call the same pure functions ``decide`` calls (``effective_for``,
``current_plan``, ``planned_artifacts``), so the two always agree on what the facts are about.

Secret *values* never leave this module: ``Observed`` records which keys each Secret has, and the
values are used here only as credentials for the storage reads.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any, Mapping

from pydantic import ValidationError

from fewerbits_api.errors import format_validation_error
from fewerbits_api.policy import LabelSelector, QuantizationPolicy
from fewerbits_api.quantizedmodel import QuantizedModelStatus

from .artifacts import planned_artifacts
from .decide import current_plan, effective_for, missing_secrets, secret_refs
from .kube import Kube
from .observed import ArtifactFacts, BrokenPolicy, ContainerTermination, JobFacts, JobState, Observed
from .planner import pools_from_nodes, shape_from_config
from . import routing
from .planner import ModelConfigError as ShapeError
from .render import LABEL_VARIANT, LABEL_MODEL
from .settings import OperatorSettings
from .storage import ModelConfigError, ObjectStore, S3Credentials, StorageError

log = logging.getLogger("fewerbits.observe")


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _freeze(d: dict[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(d)


def may_select(raw_policy: dict[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether an invalid policy selects the namespace: its selector read alone, and True when even
    that can't be read (it might have been meant for any namespace)."""
    spec = raw_policy.get("spec") if isinstance(raw_policy.get("spec"), dict) else {}
    try:
        return LabelSelector.model_validate(spec.get("namespaceSelector") or {}).matches(dict(labels))
    except ValidationError:
        return True


def read_policies(raws: list[dict[str, Any]], labels: Mapping[str, str]
                  ) -> tuple[tuple[QuantizationPolicy, ...], tuple[BrokenPolicy, ...]]:
    valid: list[QuantizationPolicy] = []
    broken: list[BrokenPolicy] = []
    for raw in raws:
        try:
            valid.append(QuantizationPolicy.model_validate(raw))
        except ValidationError as e:
            pname = str((raw.get("metadata") or {}).get("name"))
            broken.append(BrokenPolicy(pname, "; ".join(format_validation_error(e))[:600], may_select(raw, labels)))
            log.warning("invalid QuantizationPolicy %s: %s", pname, str(e).splitlines()[0])
    return tuple(valid), tuple(broken)


def terminations(pods: list[dict[str, Any]], *, init: bool = True) -> tuple[ContainerTermination, ...]:
    """Failed container terminations of ``pods``, newest pod first."""
    out: list[ContainerTermination] = []
    for pod in sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "", reverse=True):
        ps = pod.get("status") or {}
        statuses = ((ps.get("initContainerStatuses") or []) if init else []) + (ps.get("containerStatuses") or [])
        for cs in statuses:
            state = cs.get("state") or {}
            term = state.get("terminated") or (cs.get("lastState") or {}).get("terminated") or {}
            if not term:
                continue
            out.append(ContainerTermination(
                pod=pod["metadata"]["name"], container=str(cs.get("name")),
                exit_code=int(term.get("exitCode") or 0), reason=str(term.get("reason") or ""),
                message=str(term.get("message") or ""),
                running_ready="running" in state and bool(cs.get("ready"))))
    return tuple(out)


class Observer:
    """Reads the world for one model. Holds the collaborators; no state between calls."""

    def __init__(self, kube: Kube, store: ObjectStore, settings: OperatorSettings):
        self.kube = kube
        self.store = store
        self.settings = settings

    def observe(self, body: dict[str, Any]) -> Observed:
        md = body["metadata"]
        ns, name = md["namespace"], md["name"]
        old_raw = body.get("status") or {}
        try:
            old = QuantizedModelStatus.model_validate(old_raw)
        except ValidationError:
            old = QuantizedModelStatus()
        labels = self.kube.namespace_labels(ns)
        policies, broken = read_policies(self.kube.list_policies(), labels)
        facts: dict[str, Any] = dict(
            now=now_rfc3339(), namespace=ns, name=name, uid=md["uid"], generation=md.get("generation"),
            resource_version=md.get("resourceVersion"), raw=_freeze(body), spec=_freeze(body.get("spec") or {}),
            old_status_raw=_freeze(old_raw), old_status=old, policies=policies, broken_policies=broken,
            namespace_labels=_freeze(dict(labels)))
        eff = effective_for(Observed(**facts), self.settings)
        if not eff.accepted:
            return Observed(**facts)
        assert eff.spec is not None and eff.spec.storage is not None
        spec = eff.spec
        values: dict[str, dict[str, str] | None] = {}
        for _, secret in secret_refs(spec):
            if secret not in values:  # one GET when source and storage share a Secret
                values[secret] = self.kube.secret_data(ns, secret)
        facts["secrets"] = _freeze({s: (frozenset(v) if v is not None else None) for s, v in values.items()})
        if missing_secrets(spec, ns, facts["secrets"]):
            return Observed(**facts)  # decide says which; nothing further is read
        source_secret = values.get(spec.source.credentialsSecret or "")
        storage_creds = S3Credentials.from_secret(values.get(spec.storage.credentialsSecret or ""))

        facts["pools"] = tuple(pools_from_nodes(self.kube.list_nodes()))
        try:
            cfg = self.store.model_config(spec.source, source_secret, self.settings.hf_endpoint)
            facts["shape"] = shape_from_config(cfg, where=f"{spec.source.uri} config.json")
        except (ModelConfigError, ShapeError) as e:
            facts["config_error"] = str(e)
        the_plan, _ = current_plan(Observed(**facts), eff)

        artifacts: dict[str, ArtifactFacts] = {}
        for planned in planned_artifacts(spec, the_plan):
            try:
                manifest = self.store.get_manifest(spec.storage, planned.key, storage_creds)
            except StorageError as e:
                artifacts[planned.key] = ArtifactFacts(storage_error=str(e))
                continue
            if manifest is not None:
                job = self.kube.get_job(ns, planned.job_name)
                artifacts[planned.key] = ArtifactFacts(manifest=manifest,
                                                       job=self._job(ns, job, pods=False) if job else None)
                continue
            job = self.kube.get_job(ns, planned.job_name)
            artifacts[planned.key] = ArtifactFacts(job=self._job(ns, job) if job else None)
        facts["artifacts"] = _freeze(artifacts)

        deployments = {d["metadata"]["name"]: d for d in self.kube.list_deployments(ns, f"{LABEL_MODEL}={name}")}
        facts["deployments"] = _freeze(deployments)
        if the_plan.variants:
            facts["service"] = self.kube.get_service(ns, name)
            facts["service_read"] = True
            if routing.routing_of(spec.serving) == routing.INFERENCE_POOL:
                served = self.kube.serves(routing.GROUP, routing.VERSION, routing.PLURAL)
                facts["routing"] = routing.RoutingFacts(served, self.kube.get_inference_pool(ns, name) if served else None)
        # Only when something is short of ready: a pod listing per such variant, never at rest.
        short: dict[str, tuple[ContainerTermination, ...]] = {}
        for d in deployments.values():
            variant = (d["metadata"].get("labels") or {}).get(LABEL_VARIANT)
            want = int((d.get("spec") or {}).get("replicas") or 0)
            ready = int((d.get("status") or {}).get("readyReplicas") or 0)
            if variant and ready < want:
                short[variant] = terminations(self.kube.list_pods(ns, f"{LABEL_MODEL}={name},{LABEL_VARIANT}={variant}"))
        facts["pod_terminations"] = _freeze(short)
        return Observed(**facts)

    def _job(self, namespace: str, job: dict[str, Any], pods: bool = True) -> JobFacts:
        name = job["metadata"]["name"]
        refs = tuple(job["metadata"].get("ownerReferences") or [])
        jstatus = job.get("status") or {}
        conds = {c["type"]: c for c in jstatus.get("conditions") or [] if c.get("status") == "True"}
        if "Failed" in conds:
            return JobFacts(name, refs, JobState.FAILED, failed_condition=_freeze(dict(conds["Failed"])),
                            terminations=terminations(self.kube.job_pods(namespace, name), init=False) if pods else ())
        if "Complete" in conds or "SuccessCriteriaMet" in conds:
            return JobFacts(name, refs, JobState.SUCCEEDED)
        state = JobState.ACTIVE if jstatus.get("active") else JobState.PENDING
        phases = ()
        if pods and state is JobState.ACTIVE:
            phases = tuple(sorted({(p.get("status") or {}).get("phase", "Unknown")
                                   for p in self.kube.job_pods(namespace, name)}))
        return JobFacts(name, refs, state, pod_phases=phases)
