"""Reconcile one QuantizedModel: read the world, compute what should be, apply the difference,
write status. Level-triggered and idempotent: running it twice changes nothing the second time
(STYLE.md rule 2), and status is written only when it changed.

Accepted → Planned → Quantized → QualityGatePassed → Deployed → Ready. Each step that cannot go
on says why in its condition; the steps after it say what they wait for. What is already
serving keeps serving: a failed gate, a failed Job or an invalid new spec never removes a
Deployment that works.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from fewerbits_api import conditions as C
from fewerbits_api.artifact import Manifest
from fewerbits_api.conditions import Condition, Reason, set_condition
from fewerbits_api.formats import QuantFormat
from fewerbits_api.errors import format_validation_error
from fewerbits_api.policy import LabelSelector, QuantizationJobPlacement, QuantizationPolicy
from fewerbits_api.quantizedmodel import (
    ArtifactStatus,
    PlanStatus,
    QualityStatus,
    RejectedPool,
    QuantizedModelSpec,
    QuantizedModelStatus,
    StorageSpec,
    VariantServingStatus,
)
from fewerbits_api.validation import DNS1123_LABEL

from . import metrics
from .artifacts import PlannedArtifact, planned_artifacts
from .effective import Effective, effective_spec, select_policy
from .kube import Kube
from .planner import ModelConfigError as ShapeError
from .planner import PlanRequest, plan, pools_from_nodes, shape_from_config, unmatched_targets
from .render import (
    ANNOTATION_SPEC_HASH,
    LABEL_MODEL,
    LABEL_VARIANT,
    Owner,
    deployment_name,
    endpoint,
    render_deployment,
    render_job,
    render_service,
)
from .settings import OperatorSettings
from .storage import ModelConfigError, ObjectStore, S3Credentials, StorageError

log = logging.getLogger("fewerbits.reconcile")

# Autoscaler-owned fields of status.serving, kept as they are by reconcile.
AUTOSCALER_FIELDS = ("desiredReplicas", "kvCacheUsage", "waitingRequests", "lastScaleTime")
WARNING_REASONS = {
    Reason.INVALID_SPEC, Reason.POLICY_VIOLATION, Reason.MISSING_SECRET, Reason.NO_GPU_POOLS,
    Reason.NO_POOL_FITS, Reason.MODEL_CONFIG_UNAVAILABLE, Reason.JOB_FAILED, Reason.STORAGE_UNAVAILABLE,
    Reason.GATE_FAILED, Reason.PODS_FAILING, Reason.POOL_GONE, Reason.SERVICE_CONFLICT,
}


@dataclass
class ArtifactState:
    """What is known of one planned artifact after looking in storage and at its Job."""

    planned: PlannedArtifact
    manifest: Manifest | None = None
    job: dict[str, Any] | None = None
    job_created: bool = False
    cache_hit: bool = False
    failed: str | None = None
    """Why it cannot be produced (Job failed, storage error)."""
    failure_reason: str = Reason.JOB_FAILED
    recorded_job: str | None = None
    """The Job status already names for this artifact (kept after the Job's TTL removes it)."""
    running: str | None = None
    """What it waits for."""
    passed: bool | None = None
    quality: QualityStatus | None = None

    @property
    def ready(self) -> bool:
        return self.manifest is not None

    @property
    def deployable(self) -> bool:
        return self.ready and bool(self.passed)


@dataclass
class StatusBuilder:
    conditions: list[Condition]
    generation: int | None
    events: list[tuple[str, str, str]] = field(default_factory=list)

    def set(self, type_: str, ok: bool | str, reason: str, message: str) -> None:
        before = C.get_condition(self.conditions, type_)
        self.conditions = set_condition(self.conditions, type_, ok, reason, message, self.generation)
        after = C.get_condition(self.conditions, type_)
        if before is None or before.status != after.status or before.reason != after.reason:
            kind = "Warning" if reason in WARNING_REASONS else "Normal"
            self.events.append((kind, reason, f"{type_}={after.status}: {message}"[:1024]))

    def waiting(self, types: tuple[str, ...], reason: str, message: str) -> None:
        for t in types:
            self.set(t, False, reason, message)


class StatusConflict(RuntimeError):
    """The object changed between our read and our status write."""


class Reconciler:
    """Holds the collaborators; ``reconcile(namespace, name)`` is safe to call from any thread."""

    def __init__(self, kube: Kube, store: ObjectStore, settings: OperatorSettings):
        self.kube = kube
        self.store = store
        self.settings = settings
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def reconcile(self, namespace: str, name: str) -> None:
        started = time.monotonic()
        with self._lock(namespace, name):
            try:
                for attempt in range(3):
                    body = self.kube.get_model(namespace, name)
                    if body is None or body["metadata"].get("deletionTimestamp"):
                        metrics.forget_model(namespace, name)
                        return
                    try:
                        self._reconcile(body)
                        break
                    except StatusConflict:
                        if attempt == 2:
                            raise
            except Exception:
                metrics.RECONCILE_ERRORS.inc()
                metrics.RECONCILES.labels(result="error").inc()
                raise
            else:
                metrics.RECONCILES.labels(result="ok").inc()
            finally:
                metrics.RECONCILE_DURATION.observe(time.monotonic() - started)

    # ------------------------------------------------------------------ the steps

    def _reconcile(self, body: dict[str, Any]) -> None:
        md = body["metadata"]
        ns, name, gen = md["namespace"], md["name"], md.get("generation")
        owner = Owner(name, ns, md["uid"])
        old_status = body.get("status") or {}
        try:
            old = QuantizedModelStatus.model_validate(old_status)
        except ValidationError:
            old = QuantizedModelStatus()
        st = StatusBuilder(list(old.conditions), gen)
        status = QuantizedModelStatus(observedGeneration=gen, conditions=[], plan=old.plan,
                                      artifacts=old.artifacts, serving=old.serving, endpoint=old.endpoint,
                                      formats=old.formats, replicas=old.replicas)
        # An exception (API error, conflict) leaves status as it was: a half-computed pass must not
        # be recorded as observedGeneration; the next event or resync retries.
        self._steps(body, owner, st, status, old)
        status.conditions = st.conditions
        self._write_status(body, status, old_status, st.events)

    def _steps(self, body: dict[str, Any], owner: Owner, st: StatusBuilder, status: QuantizedModelStatus,
               old: QuantizedModelStatus) -> None:
        later = (C.PLANNED, C.QUANTIZED, C.QUALITY_GATE_PASSED, C.DEPLOYED, C.READY)
        # 1. Accepted: the effective spec, the policy's rules, the Secrets it names.
        eff = self._effective(body, owner)
        if not eff.accepted:
            reason = Reason.INVALID_SPEC if eff.errors else Reason.POLICY_VIOLATION
            st.set(C.ACCEPTED, False, reason, "; ".join(eff.errors + eff.violations))
            st.waiting(later, Reason.BLOCKED, "the spec is not accepted (see Accepted)")
            return
        spec = eff.spec
        assert spec is not None and spec.storage is not None
        secrets, missing = self._secrets(owner.namespace, spec)
        if missing:
            st.set(C.ACCEPTED, False, Reason.MISSING_SECRET, "; ".join(missing))
            st.waiting(later, Reason.BLOCKED, "a referenced Secret is missing (see Accepted)")
            return
        st.set(C.ACCEPTED, True, Reason.VALID,
               f"policy {eff.policy.metadata.name} applies" if eff.policy else "no QuantizationPolicy matches this namespace")

        # 2. Planned: model shape × GPU pools.
        pools = pools_from_nodes(self.kube.list_nodes())
        try:
            cfg = self.store.model_config(spec.source, secrets.get("source"), self.settings.hf_endpoint)
            shape = shape_from_config(cfg, where=f"{spec.source.uri} config.json")
        except (ModelConfigError, ShapeError) as e:
            if not (old.plan and old.plan.variants and old.observedGeneration == owner_generation(body)):
                st.set(C.PLANNED, False, Reason.MODEL_CONFIG_UNAVAILABLE, str(e))
                st.waiting(later[1:], Reason.BLOCKED, "no plan yet (see Planned)")
                return
            # The source is unreachable now (Hub outage, rotated token) but this generation was
            # planned before: keep that plan, so what serves keeps its status; say why it's stale.
            the_plan = old.plan
            st.set(C.PLANNED, True, Reason.PLANNED, _plan_summary(the_plan) +
                   f"; kept from an earlier pass: the source's config.json cannot be read now ({e})")
        else:
            request = PlanRequest.from_spec(spec, eff.policy.spec if eff.policy else None,
                                            default_served_model_name=owner.name)
            the_plan = plan(shape, pools, request)
            if not pools:
                st.set(C.PLANNED, False, Reason.NO_GPU_POOLS,
                       "no node carries GPU Feature Discovery labels (nvidia.com/gpu.product) with allocatable nvidia.com/gpu")
            elif not the_plan.variants:
                lost = unmatched_targets(pools, spec.serving.targets)
                unmatched = [f"spec.serving.targets[{i}] ({_target_text(t)}) matches no GPU pool"
                             for i, t in enumerate(spec.serving.targets) if any(t is x for x in lost)]
                st.set(C.PLANNED, False, Reason.NO_POOL_FITS, "no GPU pool can serve the model: " + "; ".join(
                    unmatched + [f"{r.pool}: {r.reason}" for r in the_plan.rejected]))
            else:
                st.set(C.PLANNED, True, Reason.PLANNED, _plan_summary(the_plan))
        status.plan = the_plan
        status.formats = ",".join(sorted({v.format.value for v in the_plan.variants})) or None

        # 3. Quantized: one artifact per format; manifest in storage or one Job per key.
        storage_creds = S3Credentials.from_secret(secrets.get("storage"))
        placement = eff.policy.spec.rules.quantizationJob if eff.policy else QuantizationJobPlacement()
        states = [self._artifact(owner, spec, eff, a, storage_creds, placement, old, st)
                  for a in planned_artifacts(spec, the_plan)]
        gate = eff.gate().maxPerplexityIncreasePercent
        for s in states:
            self._judge(s, gate)
        status.artifacts = [self._artifact_status(spec.storage, s) for s in states]
        if not states:
            st.waiting((C.QUANTIZED, C.QUALITY_GATE_PASSED), Reason.BLOCKED, "nothing planned (see Planned)")
        elif failed := [s for s in states if s.failed]:
            hint = ("; a failed Job is not re-run for the same generation: fix the cause, then edit the spec"
                    if failed[0].failure_reason == Reason.JOB_FAILED else "")
            st.set(C.QUANTIZED, False, failed[0].failure_reason,
                   "; ".join(f"{s.planned.format.value}: {s.failed}" for s in failed) + hint)
        elif all(s.ready for s in states):
            hits = [s for s in states if s.cache_hit]
            st.set(C.QUANTIZED, True, Reason.CACHE_HIT if len(hits) == len(states) else Reason.JOB_SUCCEEDED,
                   ", ".join(f"{s.planned.format.value}: {s.planned.key[:12]}{' (cache hit)' if s.cache_hit else ''}"
                             for s in states))
        else:
            waiting = [s for s in states if not s.ready]
            st.set(C.QUANTIZED, False, Reason.JOB_RUNNING,
                   "; ".join(f"{s.planned.format.value}: {s.running or 'waiting'}" for s in waiting))
        if states:
            if gate_failed := [s for s in states if s.ready and s.passed is False]:
                st.set(C.QUALITY_GATE_PASSED, False, Reason.GATE_FAILED, "; ".join(
                    f"{s.planned.format.value}: perplexity {s.quality.baselinePerplexity:.3f} → {s.quality.perplexity:.3f} "
                    f"(+{s.quality.increasePercent:.2f}%) exceeds the gate of {gate:g}%; not rolled out"
                    if s.quality else f"{s.planned.format.value}: no quality figures in the manifest; not rolled out"
                    for s in gate_failed))
            elif all(s.deployable for s in states):
                st.set(C.QUALITY_GATE_PASSED, True, Reason.GATE_PASSED, ", ".join(
                    f"{s.planned.format.value}: +{s.quality.increasePercent:.2f}% ≤ {gate:g}%" if s.quality
                    else f"{s.planned.format.value}: unquantized" for s in states))
            else:
                st.set(C.QUALITY_GATE_PASSED, False, Reason.AWAITING_ARTIFACT, "waiting for the quantized artifacts")

        # 4. Deployed / Ready: one Deployment per variant, one Service.
        self._serve(owner, spec, pools, the_plan, states, st, status, old)

    # ------------------------------------------------------------------ accepted

    def _effective(self, body: dict[str, Any], owner: Owner) -> Effective:
        import re

        if not re.fullmatch(DNS1123_LABEL.strip("^$"), owner.name) or len(owner.name) > 40:
            return Effective(None, None, errors=[
                f"metadata.name: {owner.name!r} must be a DNS label of at most 40 characters "
                "(it names the Service and prefixes Deployment names)"])
        policies = []
        labels = self.kube.namespace_labels(owner.namespace)
        broken: list[str] = []
        for raw in self.kube.list_policies():
            try:
                policies.append(QuantizationPolicy.model_validate(raw))
            except ValidationError as e:
                pname = (raw.get("metadata") or {}).get("name")
                if _may_select(raw, labels):
                    # Fail closed: a policy meant for this namespace that can't be read must not
                    # leave the namespace ungoverned (stored before a stricter CRD, or written
                    # by a client that skipped validation).
                    broken.append(f"QuantizationPolicy {pname} applies to namespace {owner.namespace} but is "
                                  f"invalid ({'; '.join(format_validation_error(e))[:600]}); fix the policy")
                log.warning("invalid QuantizationPolicy %s: %s", pname, str(e).splitlines()[0])
        if broken:
            return Effective(None, None, violations=broken)
        policy = select_policy(policies, labels)
        s = self.settings
        default_storage = None
        if s.default_storage_uri:
            default_storage = StorageSpec(uri=s.default_storage_uri, endpoint=s.default_storage_endpoint,
                                          region=s.default_storage_region,
                                          credentialsSecret=s.default_storage_credentials_secret)
        return effective_spec(body.get("spec") or {}, policy, default_storage)

    def _secrets(self, namespace: str, spec: QuantizedModelSpec) -> tuple[dict[str, dict[str, str]], list[str]]:
        found: dict[str, dict[str, str]] = {}
        missing: list[str] = []
        refs = {"source": ("spec.source.credentialsSecret", spec.source.credentialsSecret),
                "storage": ("spec.storage.credentialsSecret", spec.storage.credentialsSecret if spec.storage else None)}
        read: dict[str, dict[str, str] | None] = {}  # one GET when source and storage share a Secret
        for role, (field_name, secret) in refs.items():
            if not secret:
                continue
            if secret not in read:
                read[secret] = self.kube.secret_data(namespace, secret)
            data = read[secret]
            if data is None:
                missing.append(f"{field_name}: Secret {secret} not found in namespace {namespace}")
                continue
            need = {"source": {"hf": ["HF_TOKEN"], "s3": ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]}.get(
                spec.source.scheme, []), "storage": ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]}[role]
            lacking = [k for k in need if k not in data]
            if lacking:
                missing.append(f"{field_name}: Secret {secret} has no key {', '.join(lacking)}")
                continue
            found[role] = data
        return found, missing

    # ------------------------------------------------------------------ artifacts

    def _artifact(self, owner: Owner, spec: QuantizedModelSpec, eff: Effective, planned: PlannedArtifact,
                  creds: S3Credentials, placement: QuantizationJobPlacement, old: QuantizedModelStatus,
                  st: StatusBuilder) -> ArtifactState:
        s = ArtifactState(planned)
        assert spec.storage is not None
        try:
            s.manifest = self.store.get_manifest(spec.storage, planned.key, creds)
        except StorageError as e:
            s.failed, s.failure_reason = str(e), Reason.STORAGE_UNAVAILABLE
            return s
        s.job = self.kube.get_job(owner.namespace, planned.job_name)
        previous = next((a for a in old.artifacts if a.key == planned.key), None)
        s.recorded_job = previous.job if previous else None
        if s.manifest is not None:
            # A cache hit: published before this model asked for it, by no Job it owns (another
            # model's Job for the same key may still be there until its TTL).
            owns_job = s.job is not None and any(
                r.get("uid") == owner.uid for r in s.job["metadata"].get("ownerReferences") or [])
            s.cache_hit = not owns_job and (previous is None or previous.job is None)
            if s.cache_hit and (previous is None or not previous.cacheHit):
                metrics.CACHE_HITS.inc()
                st.events.append(("Normal", "CacheHit", f"artifact {planned.key[:12]} ({planned.format.value}) "
                                                        "already published: no quantization Job needed"))
            return s
        if s.job is None and (failure := self._recorded_failure(old, planned, st.generation)):
            # The Job failed for this generation and its TTL has since removed it: a new Job would
            # fail the same way. A new generation of the spec (any edit) tries again.
            s.failed = failure
            return s
        if s.job is None:
            job = render_job(owner, spec, planned, placement, eff.gate(), self.settings)
            created = self.kube.create(job)
            s.job, s.job_created = created or job, True
            s.running = f"Job {planned.job_name} created"
            st.events.append(("Normal", "QuantizationStarted",
                              f"Job {planned.job_name} quantizes {spec.source.uri} to {planned.format.value}"))
            metrics.JOBS_CREATED.inc()
            return s
        self._ensure_job_owner(owner, s.job)
        jstatus = s.job.get("status") or {}
        conds = {c["type"]: c for c in jstatus.get("conditions") or [] if c.get("status") == "True"}
        if "Failed" in conds:
            s.failed = self._job_failure(owner.namespace, planned.job_name, conds["Failed"])
        elif "Complete" in conds or "SuccessCriteriaMet" in conds:
            s.failed = (f"Job {planned.job_name} succeeded but no manifest is at the artifact key; "
                        "the storage location may differ from the Job's")
        elif jstatus.get("active"):
            s.running = f"Job {planned.job_name} running ({self._job_progress(owner.namespace, planned.job_name)})"
        else:
            s.running = f"Job {planned.job_name} pending (waiting for a node with room)"
        return s

    @staticmethod
    def _recorded_failure(old: QuantizedModelStatus, planned: PlannedArtifact, generation: int | None) -> str | None:
        """This artifact's Job failure as status recorded it for this generation, if it did."""
        c = C.get_condition(old.conditions, C.QUANTIZED)
        if c is None or c.reason != Reason.JOB_FAILED or c.observedGeneration != generation:
            return None
        prefix = f"{planned.format.value}: "
        for part in c.message.split("; "):
            if part.startswith(prefix + f"Job {planned.job_name} failed"):
                return part[len(prefix):]
        return None

    def _ensure_job_owner(self, owner: Owner, job: dict[str, Any]) -> None:
        """Several models asking for the same artifact share its Job; each becomes an owner, so the
        Job goes only when the last of them does."""
        refs = job["metadata"].get("ownerReferences") or []
        if any(r.get("uid") == owner.uid for r in refs):
            return
        self.kube.add_owner("Job", owner.namespace, job["metadata"]["name"],
                            refs + [owner.reference(controller=False)])

    def _job_failure(self, namespace: str, job_name: str, condition: dict[str, Any]) -> str:
        """The failed pod's termination message (the quantjob's JSON summary), else the Job's."""
        pods = sorted(self.kube.job_pods(namespace, job_name),
                      key=lambda p: p["metadata"].get("creationTimestamp") or "", reverse=True)
        for pod in pods:
            for cs in (pod.get("status") or {}).get("containerStatuses") or []:
                term = (cs.get("state") or {}).get("terminated") or {}
                msg = (term.get("message") or "").strip()
                if not msg:
                    continue
                try:
                    summary = json.loads(msg)
                except ValueError:
                    return f"Job {job_name} failed: {msg.splitlines()[-1][:500]}"
                if isinstance(summary, dict):
                    parts = [summary.get("stage") and f"stage {summary['stage']}", summary.get("reason"),
                             summary.get("message")]
                    return f"Job {job_name} failed: " + ": ".join(str(p) for p in parts if p)[:800]
        return f"Job {job_name} failed: {condition.get('reason', '')}: {condition.get('message', '')}".strip()

    def _job_progress(self, namespace: str, job_name: str) -> str:
        pods = self.kube.job_pods(namespace, job_name)
        phases = sorted({(p.get("status") or {}).get("phase", "Unknown") for p in pods})
        return f"pod {', '.join(phases)}" if phases else "no pod yet"

    @staticmethod
    def _judge(s: ArtifactState, gate: float) -> None:
        """The operator enforces the gate, with this model's threshold: an artifact shared by two
        models may pass one's gate and fail the other's."""
        if s.manifest is None:
            return
        q = s.manifest.quality
        if q is None:
            s.passed = s.manifest.format is QuantFormat.NONE
            return
        s.quality = QualityStatus(baselinePerplexity=q.baselinePerplexity, perplexity=q.perplexity,
                                  increasePercent=q.increasePercent, maxIncreasePercent=gate,
                                  passed=q.increasePercent <= gate)
        s.passed = s.quality.passed

    @staticmethod
    def _artifact_status(storage: StorageSpec, s: ArtifactState) -> ArtifactStatus:
        m = s.manifest
        job = None if s.cache_hit else (s.job["metadata"]["name"] if s.job is not None else s.recorded_job)
        return ArtifactStatus(
            key=s.planned.key,
            uri=f"{storage.uri.rstrip('/')}/{s.planned.key}/",
            format=s.planned.format,
            variants=list(s.planned.variants),
            sizeBytes=m.totalBytes if m else None,
            job=job,
            cacheHit=s.cache_hit if m else None,
            quality=s.quality,
            tools=dict(m.tools) if m else {},
        )

    # ------------------------------------------------------------------ serving

    def _serve(self, owner: Owner, spec: QuantizedModelSpec, pools: list, the_plan: PlanStatus,
               states: list[ArtifactState], st: StatusBuilder, status: QuantizedModelStatus,
               old: QuantizedModelStatus) -> None:
        by_format = {s.planned.format: s for s in states}
        pool_by_name = {p.name: p for p in pools}
        existing = {d["metadata"]["name"]: d for d in
                    self.kube.list_deployments(owner.namespace, f"{LABEL_MODEL}={owner.name}")}
        wanted = {deployment_name(owner.name, v.pool) for v in the_plan.variants}
        current: dict[str, dict[str, Any]] = {}
        up_to_date: dict[str, bool] = {}
        for v in the_plan.variants:
            dname = deployment_name(owner.name, v.pool)
            cur = existing.get(dname)
            art = by_format[v.format]
            if not art.deployable:
                # Keep what serves (an older artifact) until a new one passes its gate.
                if cur is not None:
                    current[dname] = cur
                up_to_date[dname] = False
                continue
            pool = pool_by_name[v.pool]
            auto = spec.autoscaling.enabled
            if cur is not None and auto:
                replicas = int((cur.get("spec") or {}).get("replicas") or 0)  # the autoscaler owns it
            elif auto:
                replicas = max(1, spec.autoscaling.minReplicas)
            else:
                replicas = spec.serving.replicas
            desired = render_deployment(owner, spec, v, dict(pool.node_selector), pool.cc_str, art.planned.key,
                                        art.manifest.totalBytes if art.manifest else None, replicas, self.settings)
            if cur is None:
                created = self.kube.create(desired)
                current[dname] = created or desired
                st.events.append(("Normal", "DeploymentCreated",
                                  f"Deployment {dname} serves {v.format.value} on pool {v.pool}"))
            elif (cur["metadata"].get("annotations") or {}).get(ANNOTATION_SPEC_HASH) != \
                    desired["metadata"]["annotations"][ANNOTATION_SPEC_HASH] or \
                    (not auto and (cur.get("spec") or {}).get("replicas") != replicas):
                desired["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"]
                if not self.kube.replace_deployment(desired):
                    raise StatusConflict(f"Deployment {dname} changed while reconciling; retrying")
                current[dname] = {**desired, "status": cur.get("status") or {}}
                st.events.append(("Normal", "RollingOut", f"Deployment {dname} updated (artifact "
                                                          f"{art.planned.key[:12]}, {v.format.value})"))
                up_to_date[dname] = False  # just replaced: rolled out only once its status says so
                continue
            else:
                current[dname] = cur
            up_to_date[dname] = True
        gone: list[str] = []
        for dname in sorted(set(existing) - wanted):
            pool = (existing[dname]["metadata"].get("labels") or {}).get(LABEL_VARIANT)
            if pool not in pool_by_name:
                # The pool is missing from the inventory (cordoned for an upgrade, device plugin
                # restarting, scaled to zero): keep what serves; the plan says the pool is gone.
                gone.append(f"{pool} (Deployment {dname} kept)")
                if not any(r.pool == pool for r in the_plan.rejected):
                    the_plan.rejected.append(RejectedPool(
                        pool=str(pool), reason=f"no node of this pool is in the cluster any more (no Ready node with "
                                               f"allocatable nvidia.com/gpu); Deployment {dname} is kept until the "
                                               "pool returns or the model no longer wants it"))
                continue
            self.kube.delete_deployment(owner.namespace, dname)
            st.events.append(("Normal", "DeploymentRemoved",
                              f"Deployment {dname}: pool {pool} is no longer planned for this model"))
        conflict = None
        if the_plan.variants:
            conflict = self._ensure_service(owner)
            status.endpoint = None if conflict else endpoint(owner)

        old_serving = {s.variant: s for s in old.serving}
        serving: list[VariantServingStatus] = []
        rolled_out = True
        for v in the_plan.variants:
            dname = deployment_name(owner.name, v.pool)
            d = current.get(dname)
            if d is None:
                rolled_out = False
                continue
            ds = d.get("status") or {}
            replicas = int((d.get("spec") or {}).get("replicas") or 0)
            ready = int(ds.get("readyReplicas") or 0)
            updated = int(ds.get("updatedReplicas") or 0)
            observed = int(ds.get("observedGeneration") or 0) >= int(d["metadata"].get("generation") or 0)
            if not (up_to_date[dname] and observed and updated >= replicas and int(ds.get("replicas") or 0) == replicas):
                rolled_out = False
            prev = old_serving.get(v.pool)
            entry = VariantServingStatus(
                variant=v.pool, deployment=dname, replicas=replicas, readyReplicas=ready,
                artifactKey=(d["metadata"].get("annotations") or {}).get("fewerbits.io/artifact-key"))
            if prev is not None:
                entry = entry.model_copy(update={k: getattr(prev, k) for k in AUTOSCALER_FIELDS})
            serving.append(entry)
        status.serving = serving
        total_ready = sum(s.readyReplicas for s in serving)
        total = sum(s.replicas for s in serving)
        status.replicas = f"{total_ready}/{total}" if serving else None

        if gone:
            planned_msg = _plan_summary(the_plan) if the_plan.variants else "no variant"
            st.set(C.PLANNED, bool(the_plan.variants), Reason.POOL_GONE,
                   f"pool(s) gone from the cluster: {', '.join(gone)}; planned: {planned_msg}")
        if not the_plan.variants:
            st.waiting((C.DEPLOYED, C.READY), Reason.BLOCKED, "no variant is planned (see Planned)")
            return
        blocked = [v.pool for v in the_plan.variants if not by_format[v.format].deployable]
        if conflict:
            st.waiting((C.DEPLOYED, C.READY), Reason.SERVICE_CONFLICT, conflict)
            return
        if blocked:
            why = ("its artifact failed the quality gate" if any(by_format[v.format].passed is False
                                                                 for v in the_plan.variants) else
                   "its artifact is not published yet")
            st.set(C.DEPLOYED, False, Reason.BLOCKED if "gate" in why else Reason.AWAITING_ARTIFACT,
                   f"not rolled out on {', '.join(blocked)}: {why}")
        elif rolled_out:
            st.set(C.DEPLOYED, True, Reason.DEPLOYMENTS_CREATED,
                   f"{len(serving)} Deployment(s) rolled out behind Service {owner.name}")
        else:
            st.set(C.DEPLOYED, False, Reason.ROLLING_OUT, "; ".join(
                f"{s.deployment}: {s.readyReplicas}/{s.replicas} ready" for s in serving) or "creating Deployments")
        ready_variants = [s for s in serving if s.readyReplicas > 0]
        # Only when something is short of ready: a pod listing per such variant, never at rest.
        failing = [f"{s.variant}: {why}" for s in serving if s.readyReplicas < s.replicas
                   for why in [self._pod_failure(owner, s.variant)] if why]
        if serving and len(ready_variants) == len(the_plan.variants) and not failing:
            st.set(C.READY, True, Reason.ALL_VARIANTS_READY,
                   f"{len(ready_variants)} variant(s) serving at {status.endpoint}")
        elif failing:
            st.set(C.READY, len(ready_variants) == len(the_plan.variants) and bool(serving), Reason.PODS_FAILING,
                   (f"serving on {', '.join(s.variant for s in ready_variants)}; " if ready_variants else
                    "nothing is served; ") + "; ".join(failing))
        elif ready_variants:
            st.set(C.READY, False, Reason.SOME_VARIANTS_READY,
                   f"serving on {', '.join(s.variant for s in ready_variants)}; waiting for "
                   f"{', '.join(v.pool for v in the_plan.variants if v.pool not in {s.variant for s in ready_variants})}")
        else:
            st.set(C.READY, False, Reason.NO_REPLICAS_READY, "no replica is ready yet")

    def _pod_failure(self, owner: Owner, variant: str) -> str | None:
        """Why a variant's pods fail, from their containers' last termination (the runtime's JSON
        termination message: fetch integrity, access denied, GPU mismatch), or None."""
        pods = self.kube.list_pods(owner.namespace, f"{LABEL_MODEL}={owner.name},{LABEL_VARIANT}={variant}")
        for pod in sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "", reverse=True):
            ps = pod.get("status") or {}
            for cs in (ps.get("initContainerStatuses") or []) + (ps.get("containerStatuses") or []):
                state = cs.get("state") or {}
                term = state.get("terminated") or (cs.get("lastState") or {}).get("terminated") or {}
                if not term or int(term.get("exitCode") or 0) == 0:
                    continue
                if "running" in state and cs.get("ready"):
                    continue  # restarted and healthy again
                return f"pod {pod['metadata']['name']} container {cs.get('name')}: {_termination_text(term)}"
        return None

    def _ensure_service(self, owner: Owner) -> str | None:
        """Create or repair the model's Service; a Service of that name the model does not own is
        someone else's and is never touched (returns why)."""
        desired = render_service(owner)
        cur = self.kube.get_service(owner.namespace, owner.name)
        if cur is None:
            self.kube.create(desired)
            return None
        if not any(r.get("uid") == owner.uid for r in cur["metadata"].get("ownerReferences") or []):
            return (f"Service {owner.namespace}/{owner.name} exists and is not owned by this QuantizedModel; "
                    "it is left untouched and nothing is exposed: rename the model or remove that Service")
        spec = cur.get("spec") or {}
        if spec.get("selector") != desired["spec"]["selector"] or \
                [(p.get("port"), p.get("targetPort")) for p in spec.get("ports") or []] != \
                [(p["port"], p["targetPort"]) for p in desired["spec"]["ports"]]:
            self.kube.patch_service(owner.namespace, owner.name,
                                    {"spec": {"selector": desired["spec"]["selector"], "ports": desired["spec"]["ports"]}})
        return None

    # ------------------------------------------------------------------ status

    def _write_status(self, body: dict[str, Any], status: QuantizedModelStatus, old_raw: dict[str, Any],
                      events: list[tuple[str, str, str]]) -> None:
        md = body["metadata"]
        new_raw = status.to_wire()
        metrics.observe_model(md["namespace"], md["name"], status)
        if _normalized(new_raw) == _normalized(old_raw):
            return
        patch: dict[str, Any] = dict(new_raw)
        for k in old_raw:
            if k not in new_raw:
                patch[k] = None  # merge patch: null removes the field
        if not self.kube.patch_model_status(md["namespace"], md["name"], patch, md.get("resourceVersion")):
            # Written meanwhile (the autoscaler's fields, a spec change): recompute from a fresh read.
            raise StatusConflict(f"{md['namespace']}/{md['name']} changed while reconciling; retrying")
        for type_, reason, message in events:
            self.kube.post_event(body, type_, reason, message)
        log.info("%s/%s: %s", md["namespace"], md["name"], ", ".join(
            f"{c.type}={c.status}({c.reason})" for c in status.conditions))


def _may_select(raw_policy: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether an invalid policy selects the namespace: its selector read alone, and True when even
    that can't be read (it might have been meant for any namespace)."""
    selector = ((raw_policy.get("spec") or {}) if isinstance(raw_policy.get("spec"), dict) else {}).get(
        "namespaceSelector") or {}
    try:
        return LabelSelector.model_validate(selector).matches(labels)
    except ValidationError:
        return True


def _target_text(target: Any) -> str:
    if target.family:
        return f"family {getattr(target.family, 'value', target.family)}"
    if target.product:
        return f"product {target.product}"
    return "nodeSelector " + ",".join(f"{k}={v}" for k, v in (target.nodeSelector or {}).items())


def owner_generation(body: dict[str, Any]) -> int | None:
    return body["metadata"].get("generation")


def _plan_summary(the_plan: PlanStatus) -> str:
    rejected = f"; {len(the_plan.rejected)} pool(s) rejected (see status.plan.rejected)" if the_plan.rejected else ""
    return ", ".join(f"{v.pool}: {v.format.value} tp={v.tensorParallelSize} kv={v.kvCacheDtype}"
                     for v in the_plan.variants) + rejected


def _termination_text(term: dict[str, Any]) -> str:
    """A container's termination as one line: the runtime's JSON message when it wrote one."""
    code = term.get("exitCode")
    msg = (term.get("message") or "").strip()
    try:
        doc = json.loads(msg) if msg.startswith("{") else None
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        parts = [str(doc.get("reason") or term.get("reason") or "Error"), str(doc.get("message") or "")]
        return f"exit {code}, " + ": ".join(p for p in parts if p)[:600]
    last = msg.splitlines()[-1][:600] if msg else ""
    return f"exit {code}, {term.get('reason') or 'Error'}" + (f": {last}" if last else "")


def _normalized(raw: dict[str, Any]) -> str:
    try:
        return json.dumps(QuantizedModelStatus.model_validate(raw).to_wire(), sort_keys=True)
    except ValidationError:
        return json.dumps(raw, sort_keys=True)
