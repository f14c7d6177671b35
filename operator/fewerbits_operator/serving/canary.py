"""The serving canary (docs/canary.md), decide side: pure, typed inputs in, actions and status out.

A new variant (a new pool, or a new served configuration on a pool: artifact, image, vLLM
arguments with the KV-cache dtype, GPU product) takes traffic only after a verdict on what it
really serves. Per variant and served configuration (``serving_config_hash``):

1. one canary pod: a Deployment ``<deployment>-canary`` of one replica with the variant's pod
   template, whose pods carry ``fewerbits.io/canary-of`` instead of ``fewerbits.io/model``.
   Everything that sends traffic selects ``fewerbits.io/model`` (the model's Service, the
   InferencePool, the activator, the autoscaler, the PodMonitor), so no request reaches it; the
   Deployment itself is not listed as a variant either (observe lists ``fewerbits.io/model``).
   What served before keeps serving, untouched;
2. once that pod is Ready, a Job (``python -m fewerbits_quantjob canary``) evaluates it through its
   OpenAI-compatible API with the model's quality gate and writes ``<key>/serving/<hash>.json``;
   a multi-node variant (a LeaderWorkerSet, lws.py) gets one group instead: a LeaderWorkerSet
   ``<name>-canary`` of one replica whose leader and worker pods carry ``fewerbits.io/canary-of``
   (LeaderWorkerSet adds only its own ``leaderworkerset.sigs.k8s.io/*`` labels to pods, never the
   object's); the Job evaluates the leader (worker index 0, the pod that serves the API) once
   every pod of the group is Ready;
3. the stored verdict decides: passed, the real Deployment is created or replaced (events
   CanaryStarted → CanaryEvaluating → CanaryPassed → DeploymentCreated/RollingOut); failed, it is
   not, and the condition names the metric and the KV-cache dtype. The canary and its Job go.

A stored verdict never changes, so it is read once per operator process and reused after a restart
or a scale-up (no second canary). No verdict (the pod never became ready, the Job could not reach
it) is an error that fails closed; it is tried again after ``canary_retry_seconds`` or at once on
a spec change (a new configuration hash).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Mapping

from fewerbits_api.canary import CANARY_CONTRACT_ENV, CanaryContract, ServingQualityResult, serving_config_hash
from fewerbits_api.conditions import Reason
from fewerbits_api.formats import QuantFormat
from fewerbits_api.names import TERMINATION_LOG_DEFAULT
from fewerbits_api.quantizedmodel import CanaryStatus, PlanVariant, QualityGateSpec, QuantizedModelSpec

from fewerbits_operator.base.actions import Action, CreateDeployment, CreateJob, DeleteDeployment, DeleteJob, Event, WorkloadKind
from fewerbits_operator.base.observed import CanaryFacts, CanaryLeftovers, JobState
from fewerbits_operator.planner.vllm_args import plan_args, served_model_name
from fewerbits_operator.serving.render import (
    ANNOTATION_SPEC_HASH,
    CONTAINER_SECURITY,
    DOMAIN,
    LABEL_COMPONENT,
    LABEL_MODEL,
    LABEL_VARIANT,
    MANAGED_BY,
    POD_SECURITY,
    VLLM_PORT,
    Owner,
    _fresh,
    endpoint_rule_env,
    lora_modules_in,
    storage_credential_env,
)
from fewerbits_operator.base.settings import OperatorSettings
from fewerbits_operator.base.terminations import canary_job_error, pod_failure

__all__ = ["CanaryFacts", "CanaryLeftovers", "DeleteJob"]  # re-exported: facts in observed.py, actions in actions.py

LABEL_CANARY = f"{DOMAIN}/canary-of"
"""On a canary Deployment and its pods, instead of ``fewerbits.io/model``: the model judged."""
ANNOTATION_SERVING_CONFIG = f"{DOMAIN}/serving-config"
"""On a variant's Deployment: the served configuration hash it was rolled out with (after a
passed verdict)."""
COMPONENT = "canary"
EVAL_COMPONENT = "canary-eval"
JOB_PREFIX = "fewerbits-canary-"
WAITING_FAILURES = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CrashLoopBackOff",
                              "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
                              "ErrImageNeverPull"})
"""A canary container waiting for one of these will not become ready by itself."""

LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
"""Set by LeaderWorkerSet on each pod of a group: ``0`` on the leader."""


# ------------------------------------------------------------------ names and the configuration


def canary_deployment_name(deployment: str) -> str:
    return f"{deployment}-canary"


def canary_job_name(model: str, pool: str, config_hash: str) -> str:
    """``fewerbits-canary-<24 hex>``: one Job per model, pool and served configuration."""
    return JOB_PREFIX + hashlib.sha256(f"{model}/{pool}/{config_hash}".encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Published:
    """The adapters a Job published for one pool (name → content key) and the evaluation
    identities of the reports that name them: both part of the pool's served configuration, so new
    files, or new figures of the same files, are judged on a canary (the Job's figures it compares
    with are of one identity)."""

    keys: Mapping[str, str] = field(default_factory=dict)
    figures: tuple[str, ...] = ()

    def doc(self) -> dict[str, Any]:
        return {"adapters": dict(sorted(self.keys.items())), "adapterFigures": list(self.figures)}


def serving_config(spec: QuantizedModelSpec, variant: PlanVariant, artifact_key: str, model: str,
                   settings: OperatorSettings, adapters: Published | None = None) -> dict[str, Any]:
    """What decides the served model's output: the artifact, the image, the vLLM arguments the
    plan sets (KV-cache dtype included) and the model's extra arguments, the GPU product; with
    LoRA adapters, the files published for the pool (``Published``), which its canary pod loads
    and measures. Not the replicas, the load format or the pod's resources."""
    doc = {
        "artifact": artifact_key,
        "image": spec.serving.image or settings.vllm_image,
        "args": [*plan_args(variant, served_model_name(spec, model)), *spec.serving.extraArgs],
        "gpuProduct": variant.gpuProduct,
    }
    if adapters is not None and adapters.keys:
        doc.update(adapters.doc())
    return doc


def config_hash(spec: QuantizedModelSpec, variant: PlanVariant, artifact_key: str, model: str,
                settings: OperatorSettings, adapters: Published | None = None) -> str:
    return serving_config_hash(serving_config(spec, variant, artifact_key, model, settings, adapters))


def published_by_pool(adapters: list[Any], variants: list[PlanVariant], artifact_of: Callable[[PlanVariant], Any]
                      ) -> dict[str, Published]:
    """By pool: ``published_adapters`` for each variant that plans LoRA buffers for them (a pool
    served as-is from a quantized source loads none), from its base's quality report: the one
    that answers the gate, else the manifest's, of ``artifact_of(variant)`` (observe's
    ``ArtifactFacts`` or decide's ``ArtifactVerdict``: both carry ``quality_result`` and
    ``manifest``). observe and decide both call this, so both reach the same hash."""
    if not adapters:
        return {}
    reports = {}
    for pv in variants:
        if (a := artifact_of(pv)) is not None:
            reports[pv.pool] = a.quality_result or (a.manifest.quality if a.manifest else None)
    out: dict[str, Published] = {}
    for pv in variants:
        names = [a.name for a in adapters if pv.lora is not None and a.name in pv.lora.adapters and not pv.servedAsIs]
        out[pv.pool] = published_adapters(names, pv.format is QuantFormat.NONE, reports.get(pv.pool),
                                          [r for p, r in reports.items() if p != pv.pool]) if names else Published()
    return out


def published_adapters(names: list[str], sixteen_bit: bool, own: Any, others: list[Any]) -> Published:
    """The adapters whose files a Job published for a pool, by name: those its own base's quality
    report names (measured there, passed or not); a 16-bit pool (no Job of its own) takes the one
    key the other pools' reports agree on. Observe and decide compute it from the same reports, so
    both reach the same served-configuration hash; the canary pod loads all of them."""
    def keys(report: Any) -> dict[str, str]:
        return {q.name: q.adapterKey for q in getattr(report, "adapters", None) or () if q.adapterKey}

    if not sixteen_bit:
        mine = keys(own)
        return Published({n: mine[n] for n in names if n in mine},
                         (getattr(own, "evalIdentity", None) or "",) if any(n in mine for n in names) else ())
    out = {}
    for n in names:
        found = {k[n] for k in map(keys, others) if n in k}
        if len(found) == 1:
            out[n] = found.pop()
    figures = sorted({getattr(r, "evalIdentity", None) or "" for r in others if any(n in keys(r) for n in out)})
    return Published(out, tuple(figures))


@dataclass(frozen=True)
class AdapterVerdict:
    """One adapter as a canary verdict judged it on its pool, under the current threshold."""

    measured: bool
    passed: bool = False
    why: str = ""
    """The figures (measured), or why the canary could not measure it."""


def adapter_verdicts(result: ServingQualityResult | None, thresholds: Mapping[str, float]) -> dict[str, AdapterVerdict]:
    """By adapter, what the verdict says of it: its served perplexity judged again with the
    threshold it has now (``thresholds``, the model's gate resolved per adapter), or why it was not
    measured. An adapter the verdict does not name was not loaded on the canary pod."""
    if result is None:
        return {}
    out = {s.name.split(":", 1)[1]: AdapterVerdict(False, why=s.reason) for s in result.skipped
           if s.name.startswith("adapter:")}
    for m in result.metrics:
        if m.kind != "adapter":
            continue
        name = m.name.split(":", 1)[1]
        limit = thresholds.get(name, (100.0 / m.minRecoveryPercent - 1.0) * 100.0)
        increase = (m.served / m.base - 1.0) * 100.0 if m.base else float("inf")
        out[name] = AdapterVerdict(True, increase <= limit, f"perplexity {m.served:.4g} served through vLLM vs "
                                   f"{m.base:.4g} with it on the 16-bit base ({increase:+.2f}%, max +{limit:.3g}%)")
    return out


def base_passed(result: ServingQualityResult) -> bool:
    """The base's own metrics: at least one measured, every one passed (the adapters apart)."""
    base = [m for m in result.metrics if m.kind != "adapter"]
    return bool(base) and all(m.passed for m in base)


def canary_wanted(spec: QuantizedModelSpec, variant: PlanVariant, current: Mapping[str, Any] | None,
                  chash: str, desired_spec_hash: str | None = None) -> bool:
    """Whether the variant's served configuration still needs a verdict before it serves: the
    canary is on and what serves (if anything: a Deployment, or a multi-node variant's
    LeaderWorkerSet) does not serve this configuration yet. One rolled out before the canary
    existed carries no hash; it is judged only when its spec changes."""
    if not spec.serving.canary.enabled:
        return False
    if current is None:
        return True
    annotations = current.get("metadata", {}).get("annotations") or {}
    if ANNOTATION_SERVING_CONFIG not in annotations and desired_spec_hash is not None \
            and annotations.get(ANNOTATION_SPEC_HASH) == desired_spec_hash:
        return False  # serving this very pod spec since before the canary existed
    return annotations.get(ANNOTATION_SERVING_CONFIG) != chash


# ------------------------------------------------------------------ facts (observe reads them)


# ------------------------------------------------------------------ renderers


def _canary_object(desired: Mapping[str, Any], model: str, chash: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A copy of the variant's object named ``<name>-canary``, one replica, with its labels (returned
    too, for its pod templates): ``fewerbits.io/model`` swapped for ``fewerbits.io/canary-of`` and
    the component ``canary``."""
    d = _fresh(dict(desired))
    labels = {**{k: v for k, v in d["metadata"]["labels"].items() if k != LABEL_MODEL},
              LABEL_CANARY: model, LABEL_COMPONENT: COMPONENT}
    d["metadata"]["name"] = canary_deployment_name(d["metadata"]["name"])
    d["metadata"]["labels"] = labels
    d["metadata"]["annotations"] = {**d["metadata"].get("annotations", {}), ANNOTATION_SERVING_CONFIG: chash}
    d["metadata"].pop("resourceVersion", None)
    d["spec"]["replicas"] = 1
    return d, labels


def render_canary_deployment(desired: Mapping[str, Any], model: str, pool: str, chash: str) -> dict[str, Any]:
    """The variant's Deployment as one unexposed replica: same pod template, ``fewerbits.io/model``
    swapped for ``fewerbits.io/canary-of`` and the component ``canary``."""
    d, labels = _canary_object(desired, model, chash)
    d["spec"]["selector"] = {"matchLabels": {LABEL_CANARY: model, LABEL_VARIANT: pool}}
    d["spec"]["template"]["metadata"]["labels"] = dict(labels)
    d["spec"]["strategy"] = {"type": "Recreate"}
    return d


def render_canary_lws(desired: Mapping[str, Any], model: str, pool: str, chash: str) -> dict[str, Any]:
    """A multi-node variant's LeaderWorkerSet (lws.py) as one unexposed group: the same leader and
    worker templates, ``fewerbits.io/model`` swapped for ``fewerbits.io/canary-of`` and the
    component ``canary`` on the object and on both templates (the pods' labels come only from the
    templates plus LeaderWorkerSet's own), so nothing that selects serving pods sees them."""
    d, labels = _canary_object(desired, model, chash)
    lwt = d["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        lwt[role].setdefault("metadata", {})["labels"] = dict(labels)
    return d


def render_canary(desired: Mapping[str, Any], model: str, pool: str, chash: str) -> dict[str, Any]:
    """The canary of the variant's desired object: a Deployment's, or a LeaderWorkerSet's."""
    render = render_canary_lws if WorkloadKind.of(desired) is WorkloadKind.LEADER_WORKER_SET \
        else render_canary_deployment
    return render(desired, model, pool, chash)


def render_canary_job(owner: Owner, spec: QuantizedModelSpec, variant: PlanVariant, artifact_key: str, chash: str,
                      pod_ip: str, gate: QualityGateSpec, settings: OperatorSettings,
                      scores_key: str | None = None) -> dict[str, Any]:
    """The evaluation Job against the canary pod: the quantization Job's image and pod security,
    no GPU, no retries (a failure is a fail-closed error), a bounded deadline; its TTL after it
    ends is the back-off before an error is tried again."""
    assert spec.storage is not None
    contract = CanaryContract(
        key=artifact_key, configHash=chash, scoresKey=scores_key, variant=variant.pool, kvCacheDtype=variant.kvCacheDtype,
        endpoint=f"http://{pod_ip}:{VLLM_PORT}", servedModelName=served_model_name(spec, owner.name),
        storage=spec.storage, qualityGate=gate, evalDatasetEtag=gate.eval_dataset_etag, adapters=list(gate.adapters) or None,
        evalMaxSeqLength=spec.quantization.calibration.maxSeqLength,
        limits=spec.serving.canary.limits)
    labels = {**MANAGED_BY, LABEL_COMPONENT: EVAL_COMPONENT, LABEL_CANARY: owner.name, LABEL_VARIANT: variant.pool}
    name = canary_job_name(owner.name, variant.pool, chash)
    return _fresh({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name, "namespace": owner.namespace, "labels": labels,
            "annotations": {ANNOTATION_SERVING_CONFIG: chash},
            "ownerReferences": [owner.reference()],
        },
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": settings.canary_eval_deadline_seconds,
            "ttlSecondsAfterFinished": settings.canary_retry_seconds,
            "template": {"metadata": {"labels": dict(labels)}, "spec": {
                "restartPolicy": "Never",
                "automountServiceAccountToken": False,
                "enableServiceLinks": False,
                "securityContext": dict(POD_SECURITY),
                "containers": [{
                    "name": "canary",
                    "image": settings.quantjob_image,
                    "args": ["canary"],
                    "env": [
                        {"name": CANARY_CONTRACT_ENV, "value": contract.to_json()},
                        {"name": "HOME", "value": "/work"},
                        {"name": "HF_HOME", "value": "/work/hf"},
                        {"name": "PYTHONUNBUFFERED", "value": "1"},
                        *storage_credential_env(spec.storage),
                        *endpoint_rule_env(settings),
                    ],
                    "resources": {"requests": {"cpu": settings.canary_cpu_request,
                                               "memory": settings.canary_memory_request}},
                    "securityContext": dict(CONTAINER_SECURITY),
                    "volumeMounts": [{"name": "work", "mountPath": "/work"}, {"name": "tmp", "mountPath": "/tmp"}],
                    "terminationMessagePath": TERMINATION_LOG_DEFAULT,
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                }],
                "volumes": [{"name": "work", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}],
            }},
        },
    })


# ------------------------------------------------------------------ the decision


@dataclass
class CanaryDecision:
    """What one variant's canary decided this pass."""

    may_serve: bool
    """The variant may be rolled out with this configuration (passed, or no canary is wanted)."""
    status: CanaryStatus | None = None
    creates: list[Action] = field(default_factory=list)
    """The canary's Deployment (or LeaderWorkerSet) and its evaluation Job."""
    deletes: list[Action] = field(default_factory=list)
    """The canary and its Job once judged, or a canary of an earlier configuration."""
    events: list[Event] = field(default_factory=list)
    condition_reason: str = Reason.CANARY_PASSED


def _seconds_between(earlier: str | None, later: str) -> float | None:
    if not earlier:
        return None
    try:
        a = datetime.fromisoformat(earlier.replace("Z", "+00:00"))
        b = datetime.fromisoformat(later.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (b - a).total_seconds()


def pod_problem(f: CanaryFacts) -> str | None:
    """Why the canary pod will not become ready by itself, or None."""
    if why := pod_failure(f.terminations):
        return why
    if f.waiting:
        return f.waiting[0]
    return None


def result_text(r: ServingQualityResult) -> str:
    if r.reason:
        return r.reason
    worst = min(r.metrics, key=lambda m: m.recoveryPercent - m.minRecoveryPercent, default=None)
    if worst is None:
        return f"no metric measured (KV cache {r.kvCacheDtype})"
    return (f"{worst.name} served {worst.served:.4g} vs base {worst.base:.4g}: {worst.recoveryPercent:.1f}% "
            f"(min {worst.minRecoveryPercent:g}%), KV cache {r.kvCacheDtype}")


@dataclass(frozen=True)
class CanaryPass:
    """What one variant's canary step reads: the variant, its desired object and configuration
    hash, the canary's facts, and the status kept from the last pass for this configuration."""

    owner: Owner
    spec: QuantizedModelSpec
    variant: PlanVariant
    desired: Mapping[str, Any]
    chash: str
    artifact_key: str
    facts: CanaryFacts
    kept: CanaryStatus | None
    now: str
    settings: OperatorSettings
    gate: QualityGateSpec
    canary_template: Mapping[str, Any] | None = None
    """What the canary pod runs when it differs from ``desired``: the variant loading every adapter
    published for its pool (``published_adapters``), so the verdict measures each of them."""
    scores_key: str | None = None
    """A 16-bit variant's: the quantized artifact whose report holds the 16-bit base's figures."""

    @property
    def loaded_adapters(self) -> frozenset[str]:
        """The adapters the desired object loads (its ``--lora-modules`` names)."""
        return frozenset(e.split("=", 1)[0] for e in lora_modules_in(self.desired))

    @property
    def canary_name(self) -> str:
        return canary_deployment_name(self.desired["metadata"]["name"])

    @property
    def job_name(self) -> str:
        return canary_job_name(self.owner.name, self.variant.pool, self.chash)

    def status(self, phase: str, reason: str, **more: Any) -> CanaryStatus:
        """The status of this phase: ``since`` kept while the phase is the same."""
        since = self.kept.since if self.kept is not None and self.kept.phase == phase else self.now
        return CanaryStatus(configHash=self.chash, artifactKey=self.artifact_key, kvCacheDtype=self.variant.kvCacheDtype,
                            phase=phase, reason=reason[:1024], since=since, **more)

    def decision(self, status: CanaryStatus, reason: str, *, may_serve: bool = False,
                 event: tuple[str, str, str] | None = None, creates: tuple[Action, ...] = (),
                 deletes: tuple[Action, ...] = ()) -> CanaryDecision:
        """The step's decision; its event only on a change of phase (one per transition)."""
        events = []
        if event is not None and (self.kept is None or self.kept.phase != status.phase):
            kind, why, message = event
            events.append(Event(kind, why, f"variant {self.variant.pool}: {message}"))
        return CanaryDecision(may_serve, status, list(creates), list(deletes), events, reason)

    def remove_canary(self) -> tuple[Action, ...]:
        f = self.facts
        if f.deployment is None:
            return ()
        return (DeleteDeployment(self.owner.namespace, self.canary_name, WorkloadKind.of(f.deployment)),)


def verdict_step(c: CanaryPass) -> CanaryDecision | None:
    """A stored verdict: passed, the variant takes traffic; failed, it does not. The canary and
    its Job go."""
    r = c.facts.result
    if r is None:
        return None
    deletes = c.remove_canary() + ((DeleteJob(c.owner.namespace, c.job_name),) if c.facts.job is not None else ())
    text = result_text(r)
    extra = dict(job=c.job_name, metrics=list(r.metrics), skipped=list(r.skipped), requests=r.requests,
                 seconds=r.seconds)
    ok = r.passed
    if c.gate.adapters:  # the base, and only the adapters the variant loads (core/adapters.py leaves out the others)
        judged = adapter_verdicts(r, {a.name: a.maxIncreasePercent for a in c.gate.adapters})
        ok = base_passed(r) and all(judged.get(n, AdapterVerdict(False)).passed for n in c.loaded_adapters)
        if ok and (refused := sorted(n for n, v in judged.items() if not v.passed)):
            text = f"the base passed; adapter(s) {', '.join(refused)} not served on this pool: {text}"
    if ok:
        return c.decision(c.status("Passed", text, **extra), Reason.CANARY_PASSED, may_serve=True, deletes=deletes,
                          event=("Normal", "CanaryPassed",
                                 f"served configuration {c.chash[:12]} passed ({text}); taking traffic"))
    return c.decision(c.status("Failed", text, **extra), Reason.CANARY_FAILED, deletes=deletes,
                      event=("Warning", "CanaryFailed",
                             f"served configuration {c.chash[:12]} failed: {text}; not rolled out"))


KEPT_PHASE_REASONS = {"Evaluating": Reason.CANARY_EVALUATING, "Error": Reason.CANARY_ERROR}


def unreadable_step(c: CanaryPass) -> CanaryDecision | None:
    """The verdict cannot be read now: what was said stands."""
    if c.facts.result_error is None:
        return None
    status = c.kept or c.status("Pending", f"the verdict cannot be read now: {c.facts.result_error}")
    return c.decision(status, KEPT_PHASE_REASONS.get(status.phase, Reason.CANARY_PENDING))


def evaluation_job_step(c: CanaryPass) -> CanaryDecision | None:
    """The evaluation Job exists: it evaluates, or it ended without a verdict (fail closed)."""
    f = c.facts
    if f.job is None:
        return None
    if f.job.state in (JobState.FAILED, JobState.SUCCEEDED):
        why = canary_job_error(f.job, f.job_message)
        if died := pod_failure(f.terminations, restarted_too=True):
            why += f"; the canary's server failed while evaluated: {died}"
        status = c.status("Error", f"the evaluation gave no verdict ({why}); no traffic (fail closed), tried "
                                   f"again when Job {c.job_name} expires ({c.settings.canary_retry_seconds} s)",
                          job=c.job_name)
        return c.decision(status, Reason.CANARY_ERROR, deletes=c.remove_canary(),
                          event=("Warning", "CanaryError", status.reason))
    return c.decision(c.status("Evaluating", f"Job {c.job_name} evaluates the canary pod ({f.pod_ip or 'pod'})",
                               job=c.job_name), Reason.CANARY_EVALUATING)


def backoff_step(c: CanaryPass) -> CanaryDecision | None:
    """An error is tried again only after ``canary_retry_seconds``."""
    kept = c.kept
    if kept is None or kept.phase != "Error":
        return None
    waited = _seconds_between(kept.since, c.now)
    if waited is None or waited >= c.settings.canary_retry_seconds:
        return None
    return c.decision(kept, Reason.CANARY_NOT_READY if kept.job is None else Reason.CANARY_ERROR,
                      deletes=c.remove_canary())


def start_step(c: CanaryPass) -> CanaryDecision | None:
    """No canary of this configuration: one of an earlier configuration goes (the next pass starts
    this one's), or this one's starts."""
    f = c.facts
    if f.deployment is not None and \
            (f.deployment.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_SERVING_CONFIG) != c.chash:
        return c.decision(c.status("Pending", "replacing the canary of an earlier configuration"),
                          Reason.CANARY_PENDING, deletes=c.remove_canary())
    if f.deployment is not None:
        return None
    cname = c.canary_name
    starting = (f"canary Deployment {cname} starting (1 pod, no traffic)"
                if WorkloadKind.of(c.desired) is WorkloadKind.DEPLOYMENT else
                f"canary LeaderWorkerSet {cname} starting (1 group of {c.variant.nodesPerReplica} pods, no traffic)")
    return c.decision(
        c.status("Pending", starting), Reason.CANARY_PENDING,
        creates=(CreateDeployment(render_canary(c.canary_template or c.desired, c.owner.name, c.variant.pool, c.chash)),),
        event=("Normal", "CanaryStarted", f"canary {cname} started for served configuration {c.chash[:12]} "
                                          f"(artifact {c.artifact_key[:12]}, KV cache {c.variant.kvCacheDtype}); the "
                                          "variant takes traffic only after its verdict"))


def pod_step(c: CanaryPass) -> CanaryDecision | None:
    """The canary's pod(s): never ready (an error, tried again later), or not ready yet."""
    f = c.facts
    assert f.deployment is not None
    age = _seconds_between(f.deployment.get("metadata", {}).get("creationTimestamp"), c.now)
    problem = pod_problem(f)
    if problem is None and not f.pod_ready and age is not None and age > c.settings.canary_ready_seconds:
        problem = (f"not ready after {int(age)} s (canary_ready_seconds {c.settings.canary_ready_seconds})" +
                   (f": {f.unschedulable}" if f.unschedulable else ""))
    if problem is not None and not f.pod_ready:
        status = c.status("Error", f"the canary pod never became ready: {problem}; what served keeps serving, "
                                   f"tried again in {c.settings.canary_retry_seconds} s or on a spec change")
        return c.decision(status, Reason.CANARY_NOT_READY, deletes=c.remove_canary(),
                          event=("Warning", "CanaryNotReady", status.reason))
    if not f.pod_ready or not f.pod_ip:
        return c.decision(c.status("Pending", f"waiting for canary pod{'s' if c.variant.nodesPerReplica > 1 else ''} "
                                              f"of {c.canary_name} to be ready" +
                                   (f" ({f.unschedulable})" if f.unschedulable else "")), Reason.CANARY_PENDING)
    return None


def evaluate_step(c: CanaryPass) -> CanaryDecision:
    """The canary is ready: the evaluation Job starts."""
    assert c.facts.pod_ip is not None
    limits = c.spec.serving.canary.limits
    return c.decision(
        c.status("Evaluating", f"Job {c.job_name} evaluates the canary pod ({c.facts.pod_ip})", job=c.job_name),
        Reason.CANARY_EVALUATING,
        creates=(CreateJob(render_canary_job(c.owner, c.spec, c.variant, c.artifact_key, c.chash, c.facts.pod_ip,
                                             c.gate, c.settings, c.scores_key)),),
        event=("Normal", "CanaryEvaluating", f"canary pod ready; Job {c.job_name} evaluates it through its serving "
                                             f"API (at most {limits.maxRequests} requests, {limits.concurrency} at once)"))


CANARY_STEPS = (verdict_step, unreadable_step, evaluation_job_step, backoff_step, start_step, pod_step)
"""In order: the first that decides, decides; else ``evaluate_step``."""


def decide_canary(*, owner: Owner, spec: QuantizedModelSpec, variant: PlanVariant, desired: Mapping[str, Any],
                  current: Mapping[str, Any] | None, chash: str, artifact_key: str, facts: CanaryFacts | None,
                  old: CanaryStatus | None, gate: QualityGateSpec, now: str, settings: OperatorSettings,
                  canary_template: Mapping[str, Any] | None = None, scores_key: str | None = None) -> CanaryDecision:
    """One variant's canary step. ``desired`` is the variant's Deployment as it would be rolled
    out; ``current`` what serves now; ``canary_template`` what the canary pod runs instead, when the
    pool has adapters published that ``desired`` does not load; ``scores_key`` (a 16-bit variant)
    the quantized artifact whose report holds its base's figures."""
    kept = old if old is not None and old.configHash == chash else None
    if facts is not None and facts.config_hash != chash:  # never a verdict or Job of another configuration
        facts = CanaryFacts(chash, result_error="observed for another served configuration; read again next pass")
    if not canary_wanted(spec, variant, current, chash, desired["metadata"]["annotations"][ANNOTATION_SPEC_HASH]):
        return CanaryDecision(True, kept if spec.serving.canary.enabled else None)
    c = CanaryPass(owner, spec, variant, desired, chash, artifact_key,
                   facts or CanaryFacts(chash, result_error="the canary was not read"), kept, now, settings, gate,
                   canary_template, scores_key)
    for step in CANARY_STEPS:
        if (decided := step(c)) is not None:
            return decided
    return evaluate_step(c)


# ------------------------------------------------------------------ the condition


PRIORITY = (Reason.CANARY_FAILED, Reason.CANARY_NOT_READY, Reason.CANARY_ERROR, Reason.CANARY_EVALUATING,
            Reason.CANARY_PENDING)


def condition(decisions: Mapping[str, CanaryDecision], enabled: bool) -> tuple[bool, str, str]:
    """ServingQualityPassed over the variants: (status, reason, message), the worst variant's
    reason first, each variant with its figures."""
    if not enabled:
        return True, Reason.CANARY_DISABLED, ("spec.serving.canary.enabled is false: variants serve on the "
                                              "quantization Job's verdict alone (16-bit KV cache, transformers "
                                              "kernels), not on what vLLM serves")
    judged = {pool: d for pool, d in decisions.items() if d.status is not None}
    for reason in PRIORITY:
        bad = [f"{pool}: {d.status.reason}" for pool, d in judged.items()  # type: ignore[union-attr]
               if d.condition_reason == reason and not d.may_serve]
        if bad:
            return False, reason, "; ".join(bad)
    if not judged:
        return True, Reason.CANARY_PASSED, "every variant serves a configuration judged before (or before the canary existed)"
    return True, Reason.CANARY_PASSED, "; ".join(f"{pool}: {d.status.reason}" for pool, d in judged.items()  # type: ignore[union-attr]
                                                 if d.status is not None)
