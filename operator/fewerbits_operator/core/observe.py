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
from fewerbits_api.quality import eval_identity
from fewerbits_api.quantizedmodel import QuantizedModelStatus

from fewerbits_operator.base.actions import WorkloadKind
from fewerbits_operator.artifacts.keys import (
    fallback_key,
    legacy_candidates,
    planned_artifacts,
    published_at,
    serves_planned,
)
from fewerbits_operator.base.claims import Claim
from fewerbits_operator.serving.canary_observe import read_canaries
from fewerbits_operator.base.datapins import DataPin, s3_calibration_uri, s3_eval_uri
from fewerbits_operator.artifacts.datasetcheck import check as check_dataset
from fewerbits_operator.artifacts.datasetcheck import datasets_to_check
from fewerbits_operator.artifacts.evaljob import eval_job_name
from fewerbits_operator.artifacts.quality_gate import needs_evaluation
from fewerbits_operator.core.acceptance import current_plan, effective_for, missing_secrets, secret_refs
from fewerbits_operator.base.kube import Kube, namespace_watched
from fewerbits_operator.base.apis import HTTP_ROUTE_GROUP, HTTP_ROUTE_PLURAL, HTTP_ROUTE_VERSION
from fewerbits_operator.base.observed import ArtifactFacts, GatewayFacts, BrokenPolicy, ContainerTermination, JobFacts, JobState, Observed, Planning
from fewerbits_operator.base.terminations import evictions, terminations  # noqa: F401  (evictions: re-exported for tests)
from fewerbits_operator.artifacts.pincache import REUSE, PinCache, PinKey, settled_etag
from fewerbits_operator.planner import pools_from_nodes, shape_from_config
from fewerbits_operator.base.queueing import KUEUE_QUEUE_LABEL, job_suspended
from fewerbits_operator.serving import picker
from fewerbits_operator.serving import routing
from fewerbits_operator.planner import ModelConfigError as ShapeError
from fewerbits_operator.planner.lora import AdapterConfigError, AdapterFacts, adapter_facts
from fewerbits_operator.serving.render import LABEL_VARIANT, LABEL_MODEL
from fewerbits_operator.base.settings import OperatorSettings
from fewerbits_operator.base.storage import ModelConfigError, ObjectStore, S3Credentials, StorageError

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


def job_limits(job: dict[str, Any]) -> dict[str, Any]:
    """The Job's own resource limits and deadline, for messages that name what to raise."""
    spec = job.get("spec") or {}
    containers = (((spec.get("template") or {}).get("spec") or {}).get("containers") or [{}])
    limits = ((containers[0].get("resources") or {}).get("limits") or {})
    return {"limits": _freeze({k: str(v) for k, v in limits.items()}),
            "active_deadline_seconds": spec.get("activeDeadlineSeconds")}


class Observer:
    """Reads the world for one model. Holds the collaborators; the one state kept between calls is
    the S3 calibration ETags read (pincache.py)."""

    def __init__(self, kube: Kube, store: ObjectStore, settings: OperatorSettings):
        self.kube = kube
        self.store = store
        self.settings = settings
        self.pins = PinCache(settings.calibration_etag_seconds)

    def observe(self, body: dict[str, Any]) -> Observed:
        """Everything one pass decides from, read in the order decide's steps need it: the model
        and its policies, its Secrets, the plan's inputs, the artifacts, what serves."""
        md = body["metadata"]
        ns, name = md["namespace"], md["name"]
        facts = self._model_facts(body)
        old: QuantizedModelStatus = facts["old_status"]
        eff = effective_for(Observed(**facts), self.settings)
        if not eff.accepted:
            return Observed(**facts)
        assert eff.spec is not None and eff.spec.storage is not None
        spec = eff.spec
        values: dict[str, dict[str, str] | None] = {}
        for _, secret, _ in secret_refs(spec):
            if secret not in values:  # one GET when source and storage share a Secret
                values[secret] = self.kube.secret_data(ns, secret)
        facts["secrets"] = _freeze({s: (frozenset(v) if v is not None else None) for s, v in values.items()})
        if missing_secrets(spec, ns, facts["secrets"]):
            return Observed(**facts)  # decide says which; nothing further is read
        storage_creds = S3Credentials.from_secret(values.get(spec.storage.credentialsSecret or ""))

        facts.update(self._plan_inputs(spec, values.get(spec.source.credentialsSecret or "")))
        if facts.get("shape") is not None and spec.adapters:
            facts.update(self._adapter_inputs(spec, facts["shape"], values))
        the_plan, verdict = current_plan(Observed(**facts), eff)
        facts["planning"] = Planning(the_plan, verdict)  # decide reuses it: the planner runs once a pass
        facts.update(self._data_pin(md, spec, old, the_plan, storage_creds))
        facts.update(self._eval_pin(md, spec, storage_creds))
        facts.update(self._adapter_eval_pins(md, spec, storage_creds))
        if "eval_pin" in facts or facts.get("adapter_eval_pins"):  # the pin enters the evaluation identity: effective_for applies it
            eff = effective_for(Observed(**facts), self.settings)
        wanted = planned_artifacts(spec, the_plan, facts.get("data_pin"))  # once per pass: reused below
        artifacts = {p.key: self._artifact_facts(ns, spec, p, old, eff, storage_creds) for p in wanted}
        facts["artifacts"] = _freeze(artifacts)
        facts["dataset_errors"] = _freeze(self._dataset_errors(spec, wanted, artifacts, storage_creds))

        deployments, facts["lws_available"] = self._workloads(ns, name)
        facts["deployments"] = _freeze(deployments)
        if the_plan.variants:
            facts.update(self._exposure(ns, name, spec))
        facts["pod_terminations"] = _freeze(self._short_of_ready(ns, name, deployments))
        # The serving canary (canary.py): only for variants whose served configuration has no verdict yet.
        canaries, facts["canary_leftovers"] = read_canaries(self, spec, ns, name, the_plan, artifacts, deployments,
                                                            facts.get("data_pin"), storage_creds, wanted)
        facts["canaries"] = _freeze(canaries)
        return Observed(**facts)

    def _model_facts(self, body: dict[str, Any]) -> dict[str, Any]:
        """The model as read, its last status, the policies and the namespace's labels."""
        md = body["metadata"]
        ns = md["namespace"]
        old_raw = body.get("status") or {}
        try:
            old = QuantizedModelStatus.model_validate(old_raw)
        except ValidationError:
            old = QuantizedModelStatus()
        labels = self.kube.namespace_labels(ns)
        policies, broken = read_policies(self.kube.list_policies(), labels)
        return dict(
            now=now_rfc3339(), namespace=ns, name=md["name"], uid=md["uid"], generation=md.get("generation"),
            resource_version=md.get("resourceVersion"), raw=_freeze(body), spec=_freeze(body.get("spec") or {}),
            old_status_raw=_freeze(old_raw), old_status=old, policies=policies, broken_policies=broken,
            namespace_labels=_freeze(dict(labels)))

    def _plan_inputs(self, spec, source_secret: dict[str, str] | None) -> dict[str, Any]:
        """The GPU pools (the Node cache) and the model's shape (its config.json), or why not."""
        out: dict[str, Any] = {"pools": tuple(pools_from_nodes(self.kube.list_nodes()))}
        try:
            cfg = self.store.model_config(spec.source, source_secret, self.settings.hf_endpoint)
            out["shape"] = shape_from_config(cfg, where=f"{spec.source.uri} config.json")
        except (ModelConfigError, ShapeError) as e:
            out["config_error"] = str(e)
        return out

    def _adapter_inputs(self, spec, shape, secrets: Mapping[str, dict[str, str] | None]) -> dict[str, Any]:
        """Each adapter's rank and modules from its adapter_config.json, or why it cannot be served."""
        facts: list[AdapterFacts] = []
        problems: dict[str, str] = {}
        for i, a in enumerate(spec.adapters):
            field_name = f"spec.adapters[{i}].source"
            try:
                cfg = self.store.adapter_config(a.source, field_name, secrets.get(a.source.credentialsSecret or ""),
                                                self.settings.hf_endpoint)
                facts.append(adapter_facts(a.name, cfg, shape, field_name))
            except (ModelConfigError, AdapterConfigError) as e:
                problems[a.name] = str(e)
            except Exception as e:  # noqa: BLE001 — a config no check foresaw is the adapter's problem, not a crash
                problems[a.name] = f"{field_name}: adapter_config.json cannot be understood ({type(e).__name__})"
        return {"adapters": tuple(facts), "adapter_problems": _freeze(problems)}

    def _data_pin(self, md: Mapping[str, Any], spec, old: QuantizedModelStatus, the_plan, creds) -> dict[str, Any]:
        """The S3 calibration object's ETag when the plan uses one (pincache.py), or why not."""
        data_uri = s3_calibration_uri(spec, the_plan)
        if not data_uri:
            return {}
        try:
            return {"data_pin": self.pins.pin(
                PinKey.of(md["uid"], md.get("generation"), spec.storage, data_uri), settled_etag(old),
                lambda: DataPin(data_uri, *self.store.head_object(spec.storage, data_uri, creds)))}
        except StorageError as e:
            return {"data_error": str(e)}

    def _eval_pin(self, md: Mapping[str, Any], spec, creds) -> dict[str, Any]:
        """The S3 evaluation set's ETag (it enters the evaluation identity), reused for the same time
        as the calibration ETag; unreadable: unpinned (the identity names the URI only, and the Job
        reads what is there)."""
        eval_uri = s3_eval_uri(spec)
        if not eval_uri:
            return {}
        try:
            pin = self.pins.pin(PinKey.of(md["uid"], md.get("generation"), spec.storage, eval_uri), REUSE,
                                lambda: DataPin(eval_uri, *self.store.head_object(spec.storage, eval_uri, creds)))
        except StorageError:
            return {}
        return {"eval_pin": pin}

    def _adapter_eval_pins(self, md: Mapping[str, Any], spec, creds) -> dict[str, Any]:
        """The adapters' own S3 evaluation sets' ETags, as ``_eval_pin`` reads the model's (read with
        the storage's credentials, as the Job reads them); one unreadable stays unpinned."""
        uris = sorted({a.gate.evalDataset for a in spec.adapters if (a.gate.evalDataset or "").startswith("s3://")})
        pins = []
        for uri in uris:
            try:
                pins.append(self.pins.pin(PinKey.of(md["uid"], md.get("generation"), spec.storage, uri), REUSE,
                                          lambda uri=uri: DataPin(uri, *self.store.head_object(spec.storage, uri, creds))))
            except StorageError:
                continue
        return {"adapter_eval_pins": tuple(pins)} if pins else {}

    def _artifact_facts(self, ns: str, spec, planned, old: QuantizedModelStatus, eff, creds) -> ArtifactFacts:
        """One planned artifact: its manifest (or a legacy key's, or the fallback key's its own Job
        made), else its Job, else its claim."""
        try:
            manifest = self.store.get_manifest(spec.storage, planned.key, creds)
        except StorageError as e:
            return ArtifactFacts(storage_error=str(e))
        if manifest is None:
            manifest = self._legacy_manifest(spec.storage, planned, old, creds)
        job = self.kube.get_job(ns, planned.job_name)
        if manifest is None and job is not None:
            manifest = self._fallback_manifest(ns, spec.storage, planned, job, creds)
        if manifest is not None:
            return ArtifactFacts(manifest=manifest, job=self._job(ns, job, pods=False) if job else None,
                                 **self._reevaluation(ns, spec, published_at(planned, manifest), manifest, eff,
                                                      creds))
        if job is None:
            return self._claim_facts(spec.storage, planned, creds)
        return ArtifactFacts(job=self._job(ns, job))

    def _dataset_errors(self, spec, wanted, artifacts: Mapping[str, ArtifactFacts], creds) -> dict[str, str]:
        """Only when a Job is about to be created: a custom S3 dataset it could not read is named now."""
        needing_job = [p.format for p in wanted
                       if (f := artifacts.get(p.key)) is not None and f.storage_error is None
                       and f.manifest is None and f.job is None]
        return {field_name: why for field_name, uri in datasets_to_check(spec, needing_job)
                if (why := check_dataset(self.store, spec.storage, creds, field_name, uri))}

    def _workloads(self, ns: str, name: str) -> tuple[dict[str, Any], bool | None]:
        """The model's Deployments and, where the API is served, its LeaderWorkerSets (lws.py:
        listed so one left by a plan that no longer spans nodes is removed); whether it is served
        (API discovery, remembered 10 s; None: this client cannot tell)."""
        deployments = {d["metadata"]["name"]: d for d in self.kube.list_deployments(ns, f"{LABEL_MODEL}={name}")}
        if not hasattr(self.kube, "lws_available"):
            return deployments, None
        available = self.kube.lws_available()
        if available:
            for lws in self.kube.list_lws(ns, f"{LABEL_MODEL}={name}"):
                # A list's items carry no kind: say it, so every reader tells the two apart.
                deployments[lws["metadata"]["name"]] = {**lws, "kind": WorkloadKind.LEADER_WORKER_SET.value}
        return deployments, available

    def _exposure(self, ns: str, name: str, spec) -> dict[str, Any]:
        """The Service, and the InferencePool with its picker when the model routes through one
        (or the picker's Deployment left from when it did)."""
        out: dict[str, Any] = {"service": self.kube.get_service(ns, name), "service_read": True}
        if routing.routing_of(spec.serving) == routing.INFERENCE_POOL:
            served = self.kube.serves(routing.GROUP, routing.VERSION, routing.PLURAL)
            out["routing"] = routing.RoutingFacts(served, self.kube.get_inference_pool(ns, name) if served else None,
                                                  self._picker_facts(ns, name) if served else None)
        elif stale := [d for d in self.kube.list_deployments(ns, f"{picker.LABEL_PICKER}={name}")
                       if d["metadata"]["name"] == picker.name_of(name)]:
            # Routed through the Service again: the picker's Deployment left from before goes.
            out["routing"] = routing.RoutingFacts(False, None, picker.PickerFacts(_freeze({"Deployment": stale[0]})))
        if spec.serving.gateway is not None:
            served = self.kube.serves(HTTP_ROUTE_GROUP, HTTP_ROUTE_VERSION, HTTP_ROUTE_PLURAL)
            out["gateway"] = GatewayFacts(served, self.kube.get_http_route(ns, name) if served else None)
        return out

    def _short_of_ready(self, ns: str, name: str, deployments: Mapping[str, Any]
                        ) -> dict[str, tuple[ContainerTermination, ...]]:
        """Only when something is short of ready: a pod listing per such variant, never at rest."""
        short: dict[str, tuple[ContainerTermination, ...]] = {}
        for d in deployments.values():
            variant = (d["metadata"].get("labels") or {}).get(LABEL_VARIANT)
            want = int((d.get("spec") or {}).get("replicas") or 0)
            ready = int((d.get("status") or {}).get("readyReplicas") or 0)
            if variant and ready < want:
                short[variant] = terminations(self.kube.list_pods(ns, f"{LABEL_MODEL}={name},{LABEL_VARIANT}={variant}"))
        return short

    def _picker_facts(self, ns: str, name: str) -> picker.PickerFacts:
        objs: dict[str, Any] = {k: self.kube.get_picker_object(k, ns, picker.name_of(name))
                                for k in picker.KINDS if k != "Deployment"}
        deps = self.kube.list_deployments(ns, f"{picker.LABEL_PICKER}={name}")
        objs["Deployment"] = next((d for d in deps if d["metadata"]["name"] == picker.name_of(name)), None)
        return picker.PickerFacts(_freeze(objs))

    def _claim_facts(self, storage, planned, creds) -> ArtifactFacts:
        """The claim on the planned key (claims.py) and whether its holder Job failed or is gone
        (looked up only in namespaces this operator watches)."""
        try:
            present, raw = self.store.get_claim(storage, planned.key, creds)
        except StorageError as e:
            return ArtifactFacts(storage_error=str(e))
        if not present:
            return ArtifactFacts()
        claim = Claim.parse(raw or b"")
        gone = None
        if claim is not None and namespace_watched(claim.namespace, self.settings.namespaces):
            holder = self.kube.get_job(claim.namespace, claim.job)
            gone = holder is None or self._job(claim.namespace, holder, pods=False).state is JobState.FAILED
        return ArtifactFacts(claim_present=True, claim=claim, claim_holder_gone=gone)

    def _legacy_manifest(self, storage, planned, old: QuantizedModelStatus, creds):
        """The manifest of an artifact this model used under a legacy key that holds the planned
        bytes (docs/artifacts.md, "Upgrades"); None when there is none (one read per candidate,
        only while the planned key has no manifest)."""
        for key in legacy_candidates(old, planned):
            try:
                manifest = self.store.get_manifest(storage, key, creds)
            except StorageError:
                continue
            if manifest is not None and serves_planned(manifest, planned):
                return manifest
        return None

    def _fallback_manifest(self, ns: str, storage, planned, job: dict[str, Any], creds):
        """The artifact the planned key's Job published under the fallback key (an `auto`
        calibration that could not read the Hub set, fewerbits_api.artifact.auto_fallback_inputs),
        read once that Job succeeded with nothing at the planned key; None otherwise. Only this
        model's Job counts: a later model with the same inputs runs its own, which asks the Hub
        again (docs/artifacts.md). The status then names the fallback key (legacy_candidates)."""
        key = fallback_key(planned)
        if key is None or self._job(ns, job, pods=False).state is not JobState.SUCCEEDED:
            return None
        try:
            manifest = self.store.get_manifest(storage, key, creds)
        except StorageError:
            return None
        return manifest if manifest is not None and serves_planned(manifest, planned) else None

    def _reevaluation(self, ns: str, spec, planned, manifest, eff, creds) -> dict[str, Any]:
        """The facts an evaluation-only Job decision needs, read only when the manifest's figures
        do not answer the current gate (quality_gate.needs_evaluation)."""
        gate = eff.effective.gate()
        if not needs_evaluation(manifest.quality, gate):
            return {}
        identity = eval_identity(gate)
        try:
            result = self.store.get_quality_result(spec.storage, planned.key, identity, creds)
        except StorageError:
            result = None
        if result is not None:
            return {"quality_result": result}
        job = self.kube.get_job(ns, eval_job_name(planned.job_name, identity))
        return {"eval_job": self._job(ns, job) if job else None}

    def _job(self, namespace: str, job: dict[str, Any], pods: bool = True) -> JobFacts:
        name = job["metadata"]["name"]
        refs = tuple(job["metadata"].get("ownerReferences") or [])
        jstatus = job.get("status") or {}
        conds = {c["type"]: c for c in jstatus.get("conditions") or [] if c.get("status") == "True"}
        if "Failed" in conds:
            job_pods = self.kube.job_pods(namespace, name) if pods else []
            return JobFacts(name, refs, JobState.FAILED, failed_condition=_freeze(dict(conds["Failed"])),
                            terminations=terminations(job_pods, init=False), evictions=evictions(job_pods),
                            **job_limits(job))
        if "Complete" in conds or "SuccessCriteriaMet" in conds:
            return JobFacts(name, refs, JobState.SUCCEEDED)
        state = JobState.ACTIVE if jstatus.get("active") else JobState.PENDING
        phases = ()
        if pods and state is JobState.ACTIVE:
            phases = tuple(sorted({(p.get("status") or {}).get("phase", "Unknown")
                                   for p in self.kube.job_pods(namespace, name)}))
        return JobFacts(name, refs, state, pod_phases=phases, suspended=job_suspended(job),
                        queue_name=(job["metadata"].get("labels") or {}).get(KUEUE_QUEUE_LABEL))
