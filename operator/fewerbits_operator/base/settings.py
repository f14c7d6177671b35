"""Operator settings, from environment variables with the ``FEWERBITS_`` prefix."""

from __future__ import annotations

import math
import os
import re
from functools import lru_cache
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fewerbits_api.artifact import QUANTJOB_TOOL_VERSIONS

from fewerbits_operator import __version__


def parse_cost_weights(text: str) -> dict[str, float]:
    """``"NVIDIA-H100-80GB-HBM3=1.0,NVIDIA-L4=0.25"`` -> weights; a bad entry raises ValueError
    naming it (the operator refuses to start with a setting it cannot read)."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = float("nan")
        if not sep or not key.strip() or not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"GPU cost weight {part!r}: expected PRODUCT=positive number")
        out[key.strip()] = weight
    return out


class OperatorSettings(BaseSettings):
    """Everything the operator can be told at start-up. Every field has a default."""

    model_config = SettingsConfigDict(env_prefix="FEWERBITS_", extra="ignore")

    namespaces: list[str] = Field(default_factory=list)
    """Namespaces to watch (JSON list in the environment): names, or glob patterns (`team-*`,
    `!team-test`; watched cluster-wide and filtered, so they need cluster-wide RBAC). Empty: the
    whole cluster."""
    quantjob_image: str = f"ghcr.io/fewerbits/fewerbits-quantjob:{__version__}"
    """Image of the quantization Job."""
    quantjob_tools: dict[str, str] = Field(default_factory=lambda: dict(QUANTJOB_TOOL_VERSIONS))
    """The versions of llm-compressor, compressed-tensors and transformers in `quantjob_image`
    (JSON in the environment; default: this release's pins). Not part of any artifact key: an
    artifact made by other versions keeps serving, and its Quantized condition says so, until a
    model asks for `spec.quantization.requantize`."""
    runtime_image: str = f"ghcr.io/fewerbits/fewerbits-runtime:{__version__}"
    """Image of the serving pod's fetch init container (it also carries the launch wrapper)."""
    vllm_image: str = "vllm/vllm-openai:v0.33.0"
    """Default vLLM image (a model's `serving.image` wins)."""
    default_storage_uri: str | None = None
    """Artifact storage when neither the model nor a policy names one."""
    default_storage_endpoint: str | None = None
    """Endpoint of the default storage."""
    default_storage_region: str | None = None
    """Region of the default storage."""
    default_storage_credentials_secret: str | None = None
    """Secret (in each model's namespace) with credentials for the default storage."""
    allow_private_endpoints: bool = False
    """Whether a model's `source.endpoint` and `storage.endpoint` may resolve to private addresses
    (RFC 1918, carrier-grade NAT, IPv6 unique-local), e.g. an in-cluster MinIO behind a Service.
    Link-local and cloud metadata addresses are refused always, loopback allowed always
    (fewerbits_api.endpoints). Handed to the Job and the fetcher as FEWERBITS_ALLOW_PRIVATE_ENDPOINTS."""
    hf_endpoint: str = "https://huggingface.co"
    """Hugging Face Hub endpoint, for reading a model's config.json."""
    resync_seconds: float = 30.0
    """A model that is not Ready yet (or failed) is reconciled at least this often: the
    level-triggered safety net for what no watch reports (a Secret created later, storage back)."""
    retention_sweep_seconds: float = 600.0
    """How often published artifacts are swept for `rules.artifactRetention: Delete` (retention.py):
    one listing per swept storage location."""
    steady_resync_seconds: float = 300.0
    """A Ready model whose status is current is reconciled this often on average (spread evenly
    over the period), or every 10 × `resync_seconds` when that is shorter (lowering the resync
    lowers both): watches on its Jobs, Deployments, Nodes and policies report every change that
    matters, so this only repairs what no watch sees (a Service edited by hand, a rotated Secret)."""
    workers: int = Field(default=4, ge=1, le=64)
    """Reconciles that run at once (threads draining the coalescing work queue)."""
    job_ttl_seconds: int = 86400
    """Finished quantization Jobs are removed after this many seconds."""
    max_running_quantization_jobs: int = Field(default=4, ge=0, le=10000)
    """Quantization Jobs (GPU Jobs) that may run at once across the watched namespaces; a model
    whose Job would exceed it waits, its place in `status.artifacts[].queue` (first wanted, first
    started). Jobs that Kueue admitted count; Jobs handed to Kueue (a policy's
    `quantizationJob.kueue`) are not held back by it. 0: no cap."""
    job_cpu_request: str = "2"
    """CPU request of the quantization Job."""
    job_memory_request: str = "8Gi"
    """Least memory request of the quantization Job: the Job asks for this or what its sizing
    computes from the model (docs/jobs.md), whichever is larger."""
    job_ephemeral_storage_request: str | None = None
    """Least ephemeral-storage of the quantization Job's work directory (like the memory floor:
    the Job asks for this or its sized figure, whichever is larger). Unset: the sized figure."""
    job_storage_class: str | None = None
    """StorageClass of the Job's work volume above `job_volume_threshold_gib` (a policy's
    `quantizationJob.storageClassName` wins). Unset: the cluster's default StorageClass."""
    job_volume_threshold_gib: int = Field(default=100, ge=1)
    """A Job whose work directory (source download, output, headroom) needs more than this many GiB
    gets a generic ephemeral volume (a PVC made for the pod and deleted with it) instead of the
    node's `emptyDir`."""
    vllm_cpu_request: str = "2"
    """CPU request of each vLLM pod."""
    vllm_memory_request: str = "8Gi"
    """Memory request of each vLLM pod."""
    leader_election: bool = False
    """Elect one active replica on a `coordination.k8s.io` Lease (leader.py); every thread that
    writes runs on it only, the others keep kopf's indexes (and the activator Service's slices)
    warm and write nothing. The chart turns it on (it runs 2 replicas)."""
    leader_election_namespace: str = Field(default_factory=lambda: os.environ.get("POD_NAMESPACE") or "default")
    """Namespace of the Lease (default: the pod's own, `POD_NAMESPACE`)."""
    leader_election_lease: str = "fewerbits-operator"
    """Name of the Lease."""
    leader_lease_seconds: float = Field(default=15.0, ge=2)
    """A leader not renewed for this long (as a standby observed it) is replaced."""
    leader_renew_deadline_seconds: float = Field(default=10.0, gt=0)
    """A leader that has not renewed the Lease for this long (its own clock, from the start of its
    last successful renewal) stops acting and exits, also while a renewal call still hangs:
    client-go's `renewDeadline`. Between `leader_renew_seconds` and `leader_lease_seconds`, so the
    old leader has stopped before a standby may take over."""
    leader_renew_seconds: float = Field(default=5.0, gt=0)
    """How often the leader renews the Lease (one GET and one PUT)."""
    leader_retry_seconds: float = Field(default=2.0, gt=0)
    """How often a standby reads the Lease, and a leader tries again after a failed renewal."""
    watch_timeout_seconds: int = Field(default=300, ge=10, le=3600)
    """kopf's watch requests end after this (`settings.watching.server_timeout`) and resume from
    the last resourceVersion."""
    metrics_port: int = 8080
    """Port of the Prometheus metrics endpoint (0: off)."""
    health_port: int = 8081
    """Port of the liveness endpoint (/healthz: kopf's, with the runtime's probe)."""
    autoscaler_enabled: bool = True
    """Run the autoscaler loop (models opt in with `spec.autoscaling.enabled`)."""
    autoscaler_period_seconds: float = 15.0
    """How often each variant's load is read and its replicas decided."""
    autoscaler_metrics_source: Literal["pods", "prometheus"] = "pods"
    """`pods`: scrape each ready vLLM pod's /metrics directly; `prometheus`: query a Prometheus."""
    autoscaler_prometheus_url: str | None = None
    """Prometheus HTTP API base URL, for `autoscaler_metrics_source: prometheus`."""
    autoscaler_scrape_timeout_seconds: float = 2.0
    """Timeout of one pod scrape or Prometheus query."""
    autoscaler_status_interval_seconds: float = 60.0
    """Least time between status writes that only refresh load figures (decisions are written at once)."""
    node_cache_root: str = "/var/lib/fewerbits/cache"
    """Host directory of the node-local artifact cache (models with `serving.artifactCache: Node`)."""
    node_cache_budget: str | None = Field(default=None, pattern=r"^[0-9]+(Ki|Mi|Gi)?$")
    """Size above which the node cache evicts least recently used artifacts, e.g. `500Gi`
    (unset: only a full disk evicts)."""
    node_cache_references_seconds: float = Field(default=30.0, gt=0)
    """How often the referenced-keys ConfigMap of each namespace with node-cache models is synced
    (one GET per namespace with models; a write only when the keys or owners changed)."""
    activator_port: int = 8082
    """Port of the scale-from-zero activator (activator.py), read by its own process
    (`python -m fewerbits_operator.runtime.activator_main`, the chart's activator Deployment): a
    request for a model at zero replicas waits there while one replica starts. The operator does
    not serve it."""
    activator_queue: int = Field(default=100, ge=1, le=10_000)
    """Requests that may wait per model at zero replicas; past it they get 503 with Retry-After."""
    activator_timeout_seconds: float = Field(default=300.0, gt=0, le=3600)
    """How long a request waits for a replica to become ready before a 503 with Retry-After."""
    activator_tenant_ports: dict[str, int] | None = None
    """Namespace -> port (JSON in the environment): the activator also listens on each, and serves
    there, to a request that names a model by its Service's Host, only the models of that namespace;
    on its main port it then serves only requests that carry their model's route token
    (activator.py ``admission``; docs/routing.md, "Tenants kept apart"). The operator finds the
    ports on the activator's Service (named ``atzero.tenant_port_name(<namespace>)``) and points
    each namespace's Services at zero there; the chart's NetworkPolicy lets only that namespace
    (and the gateway) reach its port. ``{}``: tenants kept apart, no namespace reached through its
    Service at zero (its HTTPRoute still is). Unset: no tenant is kept apart on the Service path
    (a Host is taken as it comes, on every port). Read by the activator's process only; the chart
    sets it from `activator.tenantPorts`."""
    activator_service: str = Field(default="", pattern=r"^([a-z0-9][-a-z0-9]*/[a-z0-9][-a-z0-9]*)?$")
    """`<namespace>/<name>` of the activator's own Service (the chart's `<release>-activator`): its
    ready endpoints are added to the Service of every model that may reach zero (atzero.py).
    Empty: models' Services are left alone (the activator answers only direct calls)."""
    activator_sync_seconds: float = Field(default=2.0, gt=0, le=60)
    """How often the leader brings the activator's EndpointSlices (and HTTPRoutes) of the models up
    to date (from its indexes and a watch: no API read per pass)."""
    gpu_cost_weights: str = ""
    """Relative cost of one GPU per pool name or GPU product, `PRODUCT=WEIGHT,...` (e.g.
    `NVIDIA-H100-80GB-HBM3=1.0,NVIDIA-L4=0.27`): where a model routed through an InferencePool adds
    replicas first (a policy's `rules.poolCostWeights` wins per key). Unlisted: 1, so the pool with
    the most throughput per GPU is preferred."""
    epp_image: str = "registry.k8s.io/gateway-api-inference-extension/epp:v1.1.0"
    """Image of the endpoint picker the operator deploys per model with `serving.routing: inferencePool`."""
    epp_cluster_role: str = "fewerbits-epp"
    """The ClusterRole (shipped by the chart) each picker's RoleBinding refers to: read pods and
    InferencePools. The operator may bind only this role."""
    canary_ready_seconds: int = Field(default=1800, ge=10, le=86400)
    """How long a serving canary's pod may take to become ready (docs/canary.md) before the canary is
    reported `CanaryNotReady` and removed; a pod that crashes or cannot pull its image is reported at
    once."""
    canary_eval_deadline_seconds: int = Field(default=1800, ge=30, le=86400)
    """The canary evaluation Job's `activeDeadlineSeconds`."""
    canary_retry_seconds: int = Field(default=900, ge=10, le=604800)
    """After a canary error (pod never ready, evaluation without a verdict) the canary is tried again
    after this long, or at once on a spec change; the evaluation Job's TTL after it ends."""
    canary_cpu_request: str = "1"
    """CPU request of the canary evaluation Job (it sends requests; it runs no model)."""
    canary_memory_request: str = "2Gi"
    """Memory request of the canary evaluation Job (tokenizer, evaluation sets, lm-eval)."""
    storage_timeout_seconds: float = 20.0
    """Timeout for manifest look-ups in object storage and for reading a model's config.json
    from its source (one ObjectStore serves both)."""
    calibration_etag_seconds: float = Field(default=300.0, ge=0, le=86400)
    """How long the ETag read of a model's S3 calibration object is reused while the model is
    settled on it (pincache.py; 0: read on every pass). A spec edit reads it at once; an object
    replaced in place is noticed at the first pass this long after the last read."""

    @property
    def steady_period_seconds(self) -> float:
        return min(self.steady_resync_seconds, 10 * self.resync_seconds)

    @property
    def cost_weights(self) -> dict[str, float]:
        return parse_cost_weights(self.gpu_cost_weights)

    @model_validator(mode="after")
    def _cost_weights_readable(self) -> "OperatorSettings":
        try:
            self.cost_weights
        except ValueError as e:
            raise ValueError(f"FEWERBITS_GPU_COST_WEIGHTS: {e}") from None
        return self

    @model_validator(mode="after")
    def _leader_timings_ordered(self) -> "OperatorSettings":
        check_leader_timings(self.leader_lease_seconds, self.leader_renew_deadline_seconds, self.leader_renew_seconds,
                             names=LEADER_TIMING_NAMES)
        return self

    @model_validator(mode="after")
    def _tenant_ports_distinct(self) -> "OperatorSettings":
        ports = self.activator_tenant_ports or {}
        taken = {p for p in (self.activator_port, self.metrics_port) if p}
        bad = sorted(ns for ns, p in ports.items() if not (0 < p < 65536) or p in taken
                     or list(ports.values()).count(p) > 1 or not NAMESPACE_NAME.match(ns))
        if bad:
            raise ValueError(f"FEWERBITS_ACTIVATOR_TENANT_PORTS (chart: activator.tenantPorts): the port of {bad} is "
                             "not a free port of its own (1-65535, one per namespace, not the activator's nor "
                             "its metrics port), or the name is no namespace's")
        return self

    @model_validator(mode="after")
    def _prometheus_needs_url(self) -> "OperatorSettings":
        if self.autoscaler_metrics_source == "prometheus" and not self.autoscaler_prometheus_url:
            raise ValueError("FEWERBITS_AUTOSCALER_PROMETHEUS_URL is required when "
                             "FEWERBITS_AUTOSCALER_METRICS_SOURCE=prometheus")
        return self


NAMESPACE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")

LEADER_TIMING_NAMES = ("FEWERBITS_LEADER_LEASE_SECONDS (chart: leaderElection.leaseSeconds)",
                       "FEWERBITS_LEADER_RENEW_DEADLINE_SECONDS (chart: leaderElection.renewDeadlineSeconds)",
                       "FEWERBITS_LEADER_RENEW_SECONDS (chart: leaderElection.renewSeconds)")


def check_leader_timings(lease_seconds: float, renew_deadline_seconds: float, renew_seconds: float,
                         names: tuple[str, str, str] = ("lease_seconds", "renew_deadline_seconds", "renew_seconds"),
                         ) -> None:
    """client-go's order, ``0 < renew < renew deadline < lease``, or a ValueError naming the setting
    to change (``names``: how the caller spells the three). The Lease records the duration in whole
    seconds, and a standby waits that long: the deadline must be below it."""
    lease, deadline, renew = names
    if not 0 < renew_seconds < renew_deadline_seconds:
        raise ValueError(f"{renew} = {renew_seconds:g} must be above 0 and below {deadline} = "
                         f"{renew_deadline_seconds:g}: the leader tries to renew before it gives up")
    if not renew_deadline_seconds < int(lease_seconds):
        raise ValueError(f"{deadline} = {renew_deadline_seconds:g} must be below {lease} = {int(lease_seconds)} "
                         "(whole seconds): the leader stops acting at its renew deadline, before a standby may "
                         "take over at the lease duration")


@lru_cache(maxsize=1)
def get_settings() -> OperatorSettings:
    return OperatorSettings()
