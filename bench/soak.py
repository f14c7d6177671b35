"""A fault soak on the real control plane: many models, two operator replicas, faults at random
times, and the invariants a platform team would check, throughout and at the end.

    .venv/bin/python bench/soak.py --json-out bench/results/soak.json          # 40 models, 30 min of faults
    .venv/bin/python bench/soak.py --models 16 --namespaces 2 --minutes 5     # a short try
    .venv/bin/python bench/soak.py --markdown-from bench/results/soak.json    # docs/reliability.md's tables

What runs for real: etcd, kube-apiserver (audit log on), controller-manager, scheduler, kwok, MinIO
(the harness, ``e2e.cluster.Cluster``); two operator replicas (``python -m fewerbits_operator``) on
one Lease with the chart's timings (15 s lease, 10 s renew deadline), each under a ServiceAccount
of its own bound to the chart's RBAC, restarted by a supervisor here as the kubelet restarts a
container (after 2 s); the activator, its own process, published as the chart publishes it (a
Service the operator puts in a model's path at zero), run under the admin identity; every
quantization Job's pod (llm-compressor on the CPU) and every serving pod's fetch init container
(the node cache, parallel ranged GETs from MinIO) run by the pod runner.

What stands in, and why:

* the serving containers of most models are ``example.invalid/vllm:soak``, an image no rule of the
  pod runner matches: the container "runs" without a process (Ready once its fetch init container
  succeeded). Forty vLLM processes, real or simulated, do not fit two cores beside the Jobs, and no
  verdict here depends on what they answer;
* the models that may reach zero (one per namespace) run the operator's vLLM image, played by
  llm-d-inference-sim, because the verdict on them is the activator's (held, woken, answered or
  refused with Retry-After), judged on status codes; a real vLLM start takes a minute here;
* the kubelet's container restarts (of the operators and the activator) are this program's
  supervisor; "killed" for the activator is SIGTERM as a pod deletion sends it (a SIGKILL can only
  lose what it holds), once the soak's own traffic is paused (as the EndpointSlice controller
  takes a terminating pod out of a Service; the harness's host Service keeps its slice).

The models, per namespace ``soak-<i>`` (8 each): 5 steady (one replica, no change), 1 churn (its
requantize token or max-model-len changes during the soak: new artifact keys, Jobs and
rollouts), 1 that may reach zero (autoscaling 0..1, bursts of requests through the activator),
and in the first two namespaces 1 whose gate fails (nvfp4 under a 0.001% gate), else a steady one.

The faults, in a shuffled deck dealt again when empty, each after a random pause of 10-40 s
(``--seed`` replays the order and the pauses; the moments the faults wait for are not replayed):
the leader SIGKILLed while a Job runs and while a rollout runs, kube-apiserver restarted, etcd
restarted, MinIO down while a Job uploads (the pod runner's upload pause hook holds the pod after
its first file) and while a new pod fetches a key no node has, a Job's pod evicted (the Eviction
API), a serving pod killed, a node deleted (its pods garbage-collected by the controller-manager,
the node added back once they are gone), the activator killed while it holds requests.

Invariants, checked every 2 s and at the end:

* no artifact key has two unfinished Jobs at once;
* every manifest in storage lists only files that are there, with their size and sha256;
* no Deployment scaled up, and no pod Ready, with an artifact whose gate failed;
* no request the activator accepted is lost: each is answered, or refused with 503 and Retry-After
  (a connection refused while no activator listens was never accepted, and is counted apart);
* no traceback in the operators' or the activator's logs, and no crash loop (an exit nobody
  caused, other than the leader's designed exit 1 after its renew deadline);
* after the last fault, every model Ready (or, for the gate's failures, refused at its generation)
  within ``--converge-timeout``, at rest at zero where it may be;
* at rest after that (once ``--settle-seconds`` passed: the autoscaler publishes what a scale to
  zero changed at its next status interval, 60 s), the operators write nothing but their Lease
  (``--rest-seconds``, from the audit log).

A fault is counted survived when the run converged in time and no invariant was broken between it
and the next fault. Exit status 0 when every invariant held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "operator", REPO / "crds", REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import load_models as load  # noqa: E402
from e2e import cluster as cluster_mod  # noqa: E402
from e2e import demo  # noqa: E402

GROUP, VERSION, PLURAL = "fewerbits.io", "v1alpha1", "quantizedmodels"
MANAGED = "app.kubernetes.io/managed-by=fewerbits"
ARTIFACT_KEY = "fewerbits.io/artifact-key"
FAKE_VLLM_IMAGE = "example.invalid/vllm:soak"
ACTIVATOR_NS, ACTIVATOR_SVC = "fewerbits-activator", "fewerbits-activator"
POOL, PRODUCT = "h100", "NVIDIA-H100-80GB-HBM3"
SCALE_DOWN_DELAY = 20
FAULTS = ("leader_killed_mid_job", "leader_killed_mid_rollout", "apiserver_restarted", "etcd_restarted",
          "minio_down_during_upload", "minio_down_during_fetch", "job_pod_evicted", "serving_pod_killed",
          "node_deleted", "activator_killed_holding_requests")
say = load.say


# ------------------------------------------------------------------ the record


@dataclass
class Fault:
    kind: str
    at: float
    """Seconds since the run began (as the monitor's, the traffic's and the exits' times)."""
    detail: dict[str, Any] = field(default_factory=dict)
    confirmed: bool = False
    """Whether the moment it waited for was met (a Job running, a rollout in progress, a fetch
    against the stopped storage, requests held): the detail says what was seen."""
    survived: bool | None = None


@dataclass
class SoakResult:
    config: dict[str, Any] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    violations: dict[str, list[str]] = field(default_factory=dict)
    violation_times: list[float] = field(default_factory=list)
    """When each breach was seen (seconds since the run began), every time, repeats included."""
    untimed_violations: int = 0
    """Breaches found by the end's checks, with no time: they count against every fault."""
    requests: dict[str, int] = field(default_factory=dict)
    jobs: dict[str, Any] = field(default_factory=dict)
    replica_exits: list[dict[str, Any]] = field(default_factory=list)
    manifests_checked: int = 0
    converged_after_last_fault_seconds: float | None = None
    rest_writes: dict[str, int] = field(default_factory=dict)
    rest_lease_requests: int = 0
    logs_checked: int = 0
    api_unavailable_polls: int = 0
    wall_seconds: float = 0.0

    def violate(self, invariant: str, what: str) -> None:
        """Record ``what`` (``t=<s>s: ...`` when it has a time) once: the same breach seen by later
        polls is the same breach."""
        if m := re.match(r"t=(\d+(?:\.\d+)?)s", what):
            self.violation_times.append(float(m.group(1)))
        else:
            self.untimed_violations += 1
        seen = {re.sub(r"^t=\d+s: ", "", v) for v in self.violations.get(invariant, [])}
        if re.sub(r"^t=\d+s: ", "", what) not in seen:
            self.violations.setdefault(invariant, []).append(what)
            say(f"VIOLATION {invariant}: {what}")


INVARIANTS = ("one_job_per_key", "manifest_complete", "nothing_served_that_failed_its_gate", "no_request_lost",
              "no_traceback", "no_crash_loop", "converged_in_time", "no_writes_at_rest", "run_completed")


# ------------------------------------------------------------------ supervised processes


class Supervised:
    """A process restarted when it exits, as the kubelet restarts a container (after ``backoff``);
    each exit recorded with whether this program caused it."""

    def __init__(self, name: str, op: Any, result: SoakResult, t0: float, backoff: float = 2.0):
        self.name, self.op, self.result, self.t0, self.backoff = name, op, result, t0, backoff
        self._expected = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"supervise-{name}")

    def start(self) -> "Supervised":
        self.op.start()
        self._thread.start()
        return self

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to the running process; False when none runs (nothing was sent)."""
        with self._lock:
            if self.op.proc is None or self.op.proc.poll() is not None:
                return False
            self._expected = True
            self.op.proc.send_signal(sig) if sig != signal.SIGKILL else self.op.kill()
            return True

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            with self._lock:
                if self.op.proc is None or self.op.proc.poll() is None:
                    continue
                code, expected, self._expected = self.op.proc.returncode, self._expected, False
            self.result.replica_exits.append({"process": self.name, "at": round(time.monotonic() - self.t0, 1),
                                              "code": code, "caused_by_the_soak": expected})
            say(f"{self.name} exited with {code} ({'a fault' if expected else 'by itself'}); restarting")
            if self._stop.wait(self.backoff):
                return
            with self._lock:
                self.op.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.op.stop()


# ------------------------------------------------------------------ the models


@dataclass(frozen=True)
class ModelRef:
    ns: str
    name: str
    role: str  # steady | churn | atzero | gatefail


def model_refs(models: int, namespaces: int) -> list[ModelRef]:
    roles = ["steady"] * 5 + ["churn", "atzero", "gatefail"]
    out = []
    for i in range(models):
        ns, j = i % namespaces, i // namespaces
        role = roles[j] if j < len(roles) else "steady"
        if role == "gatefail" and ns >= 2:
            role = "steady"
        out.append(ModelRef(f"soak-{ns}", f"{role}-{j}", role))
    return out


def model_spec(c: cluster_mod.Cluster, m: ModelRef, source: str, secret: str) -> dict[str, Any]:
    overrides: dict[str, Any] = {"quantization": {"format": "fp8-dynamic"},
                                 "serving": {"maxModelLen": 256, "canary": {"enabled": False}, "image": FAKE_VLLM_IMAGE}}
    if m.role == "atzero":
        overrides["serving"] = {"maxModelLen": 256, "canary": {"enabled": False}}  # the simulator
        overrides["autoscaling"] = {"enabled": True, "minReplicas": 0, "maxReplicas": 1,
                                    "scaleDownDelaySeconds": SCALE_DOWN_DELAY}
    if m.role == "gatefail":
        overrides["quantization"] = {"format": "nvfp4", "ignore": [],
                                     "qualityGate": {"maxPerplexityIncreasePercent": 0.001, "evalSamples": 8}}
    return demo.test_model_spec(c.s3.endpoint, source, secret, f"soak/{m.ns}", **overrides)


def is_true(obj: dict[str, Any], type_: str) -> bool:
    return load.conditions(obj).get(type_, {}).get("status") == "True"


def converged(obj: dict[str, Any], role: str, replicas: int | None) -> bool:
    """At its generation: Ready; scaled to zero with its artifact made, where it may be; or refused
    by its gate."""
    status = obj.get("status") or {}
    if status.get("observedGeneration") != obj["metadata"]["generation"]:
        return False
    if role == "gatefail":
        return load.conditions(obj).get("QualityGatePassed", {}).get("status") == "False"
    if role == "atzero":  # at rest at zero (Ready is False there: no pod), its artifact made
        return replicas == 0 and is_true(obj, "Quantized")
    return is_true(obj, "Ready")


# ------------------------------------------------------------------ the invariants, watched


class Monitor:
    """Every 2 s: the quantization Jobs, the serving Deployments and pods, and the models; what
    breaks an invariant is recorded with the time."""

    def __init__(self, c: cluster_mod.Cluster, result: SoakResult, refs: list[ModelRef], t0: float):
        self.c, self.result, self.refs, self.t0 = c, result, refs, t0
        self.job_uids: set[str] = set()
        self.doubled: set[tuple[str, str]] = set()
        self.max_unfinished = 0
        self.failed_keys: set[str] = set()
        self.models: dict[tuple[str, str], dict[str, Any]] = {}
        self.replicas: dict[tuple[str, str], int] = {}
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="monitor")

    def start(self) -> "Monitor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(2):
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 — the API server may be down: a fault, not a verdict
                self.result.api_unavailable_polls += 1
                if "Connection refused" not in str(e) and "Max retries" not in str(e):
                    say(f"monitor: {type(e).__name__}: {str(e)[:200]}")

    def poll(self) -> None:
        from kubernetes import client

        api = self.c.api_client()
        at = f"t={time.monotonic() - self.t0:.0f}s"
        items = client.CustomObjectsApi(api).list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]
        for o in items:
            self.models[(o["metadata"]["namespace"], o["metadata"]["name"])] = o
            for a in (o.get("status") or {}).get("artifacts") or []:
                if (a.get("quality") or {}).get("passed") is False:
                    self.failed_keys.add(a["key"])
        jobs = client.BatchV1Api(api).list_job_for_all_namespaces(
            label_selector=f"{MANAGED},app.kubernetes.io/component=quantize").items
        unfinished: dict[str, set[str]] = {}
        for j in jobs:
            self.job_uids.add(j.metadata.uid)
            done = any(x.type in ("Complete", "Failed") and x.status == "True" for x in j.status.conditions or [])
            if not done:
                key = (j.metadata.annotations or {}).get(ARTIFACT_KEY, "?")
                # Each namespace has a storage prefix of its own: a key names one artifact there.
                unfinished.setdefault((j.metadata.namespace, key), set()).add(j.metadata.name)
        self.max_unfinished = max(self.max_unfinished, sum(len(v) for v in unfinished.values()))
        for (ns, key), names in unfinished.items():
            if len(names) > 1 and (ns, key) not in self.doubled:
                self.doubled.add((ns, key))
                self.result.violate("one_job_per_key", f"{at}: {ns}: {key[:16]} has {sorted(names)} unfinished at once")
        apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
        for d in apps.list_deployment_for_all_namespaces(label_selector=f"{MANAGED},app.kubernetes.io/component=server").items:
            model = (d.metadata.labels or {}).get("fewerbits.io/model", "")
            self.replicas[(d.metadata.namespace, model)] = d.spec.replicas or 0
            key = (d.spec.template.metadata.annotations or {}).get(ARTIFACT_KEY)
            if key in self.failed_keys and (d.spec.replicas or 0) > 0:
                self.result.violate("nothing_served_that_failed_its_gate",
                                    f"{at}: Deployment {d.metadata.namespace}/{d.metadata.name} at "
                                    f"{d.spec.replicas} replicas serves {key[:16]}, which failed its gate")
        for p in core.list_pod_for_all_namespaces(label_selector=f"{MANAGED},app.kubernetes.io/component=server").items:
            key = (p.metadata.annotations or {}).get(ARTIFACT_KEY)
            ready = any(x.type == "Ready" and x.status == "True" for x in p.status.conditions or [])
            if key in self.failed_keys and ready:
                self.result.violate("nothing_served_that_failed_its_gate",
                                    f"{at}: pod {p.metadata.namespace}/{p.metadata.name} Ready with {key[:16]}")
        self.polls += 1

    def unconverged(self) -> list[str]:
        out = []
        for m in self.refs:
            o = self.models.get((m.ns, m.name))
            if o is None or not converged(o, m.role, self.replicas.get((m.ns, m.name))):
                first = next((x for x in ((o or {}).get("status") or {}).get("conditions") or []
                              if x["status"] != "True"), None)
                out.append(f"{m.ns}/{m.name}" + (f" {first['type']}={first['status']}({first['reason']})" if first else ""))
        return out


# ------------------------------------------------------------------ traffic through the activator


class Traffic:
    """Bursts of chat completions to the models that may reach zero, through the activator's port
    with the Host a model's Service delivers (``<model>.<ns>.svc:8000``). Each request's fate is
    counted: answered (200), shed (503 with Retry-After), refused (no listener: never accepted),
    lost (anything else once the connection was accepted)."""

    def __init__(self, port: int, refs: list[ModelRef], result: SoakResult, rng: random.Random, t0: float):
        self.port, self.refs, self.result, self.rng, self.t0 = port, refs, result, rng, t0
        self.counts: Counter = Counter()
        self.lost: list[str] = []
        self.paused = threading.Event()
        """Set by a fault that counts held requests or stops the activator: no burst is sent."""
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self) -> "Traffic":
        t = threading.Thread(target=self._run, daemon=True, name="traffic")
        t.start()
        self._threads.append(t)
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.rng.uniform(20, 45)):
            for m in self.refs:
                if not self.paused.is_set():
                    self.burst(m, 3)

    def burst(self, m: ModelRef, n: int, forced: bool = False) -> list[threading.Thread]:
        """``n`` requests at once (``forced``: sent while the traffic is paused, by a fault)."""
        threads = [threading.Thread(target=self.one, args=(m,), daemon=True) for _ in range(n)]
        for t in threads:
            t.start()
        with self._lock:
            self._threads += threads
        return threads

    def one(self, m: ModelRef) -> None:
        body = json.dumps({"model": m.name, "messages": [{"role": "user", "content": "soak"}], "max_tokens": 4})
        # Longer than the activator's own bound on a held request (300 s), which answers 503 then.
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=400)
        try:
            conn.connect()
        except OSError:
            self._count("refused_not_accepted")
            return
        try:
            conn.request("POST", "/v1/chat/completions", body=body,
                         headers={"Host": f"{m.name}.{m.ns}.svc:8000", "Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            if r.status == 200:
                self._count("answered")
            elif r.status == 503 and r.getheader("Retry-After"):
                self._count("shed_503_retry_after")
            else:
                self._count("lost", f"{self._at()}: {m.ns}/{m.name}: HTTP {r.status} without Retry-After")
        except (OSError, http.client.HTTPException) as e:
            self._count("lost", f"{self._at()}: {m.ns}/{m.name}: {type(e).__name__}: {e}")
        finally:
            conn.close()

    def _at(self) -> str:
        return f"t={time.monotonic() - self.t0:.0f}s"

    def _count(self, what: str, detail: str = "") -> None:
        with self._lock:
            self.counts[what] += 1
            if detail:
                self.lost.append(detail)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(330)


# ------------------------------------------------------------------ the soak's context and faults


@dataclass
class Soak:
    c: cluster_mod.Cluster
    result: SoakResult
    refs: list[ModelRef]
    replicas: dict[str, Supervised]
    activator: Supervised
    traffic: Traffic
    monitor: Monitor
    rng: random.Random
    lease: str
    lease_ns: str
    kinds: tuple[str, ...] = FAULTS
    requantized: Counter = field(default_factory=Counter)
    """Per churn model, how many new artifacts it was asked for (its `requantize` token)."""

    def api(self):
        return self.c.api_client()

    def wait(self, what: str, check: Callable[[], Any], timeout: float, every: float = 0.3) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if value := check():
                    return value
            except Exception:  # noqa: BLE001 — an API server restarting under another fault
                pass
            time.sleep(every)
        say(f"  (gave up waiting for {what} after {timeout:.0f}s)")
        return None

    def leader(self) -> Supervised | None:
        """The replica holding the Lease, renewed within the last renew period (5 s) and once more:
        a holder that stopped renewing (killed, exited) is not taken for the leader."""
        from datetime import datetime, timezone

        from kubernetes import client

        spec = client.CoordinationV1Api(self.api()).read_namespaced_lease(self.lease, self.lease_ns).spec
        fresh = spec.renew_time is not None and (datetime.now(timezone.utc) - spec.renew_time).total_seconds() < 7
        return self.replicas.get(spec.holder_identity or "") if fresh else None

    def churn(self) -> ModelRef:
        return self.rng.choice([m for m in self.refs if m.role == "churn"])

    def new_job(self) -> tuple[ModelRef, Any]:
        """A churn model asked for a new artifact (``spec.quantization.requantize``: a new key);
        returns its Job once running with a pod on a node."""
        from kubernetes import client

        m = self.churn()
        self.requantized[m] += 1
        obj = client.CustomObjectsApi(self.api()).patch_namespaced_custom_object(
            GROUP, VERSION, m.ns, PLURAL, m.name,
            {"spec": {"quantization": {"requantize": f"soak-{self.requantized[m]}"}}})
        gen = obj["metadata"]["generation"]
        batch, core = client.BatchV1Api(self.api()), client.CoreV1Api(self.api())

        def running():
            status = client.CustomObjectsApi(self.api()).get_namespaced_custom_object(
                GROUP, VERSION, m.ns, PLURAL, m.name).get("status") or {}
            if status.get("observedGeneration") != gen:
                return None
            names = {a.get("job") for a in status.get("artifacts") or [] if a.get("job")}
            for j in batch.list_namespaced_job(m.ns, label_selector=MANAGED).items:
                if j.metadata.name in names and not j.status.succeeded:
                    pods = core.list_namespaced_pod(m.ns, label_selector=f"job-name={j.metadata.name}").items
                    if any(p.status.phase == "Running" for p in pods):
                        return j
            return None
        return m, self.wait(f"a Job of {m.ns}/{m.name} running", running, 240)

    def job_pods(self, job: Any) -> list[Any]:
        from kubernetes import client

        return client.CoreV1Api(self.api()).list_namespaced_pod(
            job.metadata.namespace, label_selector=f"job-name={job.metadata.name}").items


def leader_killed_mid_job(s: Soak, f: Fault) -> None:
    m, job = s.new_job()
    leader = s.leader()
    f.detail.update(model=f"{m.ns}/{m.name}", job=job.metadata.name if job else None,
                    leader=leader.name if leader else None)
    if job is not None and leader is not None:
        f.confirmed = leader.signal(signal.SIGKILL)


def leader_killed_mid_rollout(s: Soak, f: Fault) -> None:
    from kubernetes import client

    m = s.churn()
    apps = client.AppsV1Api(s.api())
    (dep,) = apps.list_namespaced_deployment(m.ns, label_selector=f"fewerbits.io/model={m.name}").items or [None]
    if dep is None:
        f.detail["skipped"] = "no Deployment yet"
        return
    gen0 = dep.metadata.generation
    custom = client.CustomObjectsApi(s.api())
    current = custom.get_namespaced_custom_object(GROUP, VERSION, m.ns, PLURAL, m.name)["spec"]["serving"]["maxModelLen"]
    length = 384 if current == 256 else 256
    custom.patch_namespaced_custom_object(
        GROUP, VERSION, m.ns, PLURAL, m.name, {"spec": {"serving": {"maxModelLen": length}}})
    bumped = s.wait("the Deployment's new template", lambda: (
        d := apps.read_namespaced_deployment(dep.metadata.name, m.ns)).metadata.generation > gen0 and d, 60, 0.1)
    leader = s.leader()
    f.detail.update(model=f"{m.ns}/{m.name}", max_model_len=length, leader=leader.name if leader else None)
    if bumped and leader is not None:
        sent = leader.signal(signal.SIGKILL)
        st = apps.read_namespaced_deployment_status(dep.metadata.name, m.ns).status
        f.detail["rollout_at_kill"] = {"generation": bumped.metadata.generation,
                                       "observedGeneration": st.observed_generation,
                                       "updatedReplicas": st.updated_replicas, "replicas": st.replicas}
        # Mid-rollout: the Deployment's controller has not caught up, or old pods still run.
        f.confirmed = sent and ((st.observed_generation or 0) < bumped.metadata.generation
                                or (st.updated_replicas or 0) < (st.replicas or 0))


def apiserver_restarted(s: Soak, f: Fault) -> None:
    sig = s.rng.choice([signal.SIGTERM, signal.SIGKILL])
    f.detail["signal"] = signal.Signals(sig).name
    t = time.monotonic()
    s.c.restart_component("kube-apiserver", sig)
    f.detail["down_seconds"] = round(time.monotonic() - t, 1)
    f.confirmed = True


def etcd_restarted(s: Soak, f: Fault) -> None:
    t = time.monotonic()
    s.c.restart_component("etcd", signal.SIGKILL)
    f.detail["restart_seconds"] = round(time.monotonic() - t, 1)
    f.confirmed = True


def minio_down_during_upload(s: Soak, f: Fault) -> None:
    s.c.set_container_env("fewerbits-quantjob", {"FEWERBITS_DEBUG_PAUSE_AFTER_FILES": "1",
                                                  "FEWERBITS_DEBUG_PAUSE_SECONDS": "15"})
    try:
        m, job = s.new_job()
        f.detail.update(model=f"{m.ns}/{m.name}", job=job.metadata.name if job else None)
        paused = job is not None and s.wait("the Job's pod mid-upload", lambda: any(
            "debug pause after 1 uploaded files" in s.c.pod_logs(p.metadata.namespace, p.metadata.name)
            for p in s.job_pods(job)), 300, 0.5)
        if not paused:
            return
        down = s.rng.uniform(20, 40)
        s.c.stop_component("minio", signal.SIGKILL)
        f.confirmed = True
        f.detail["down_seconds"] = round(down, 1)
        time.sleep(down)
    finally:
        if f.confirmed:
            s.c.start_component("minio")
        s.c.set_container_env("fewerbits-quantjob", None)


def minio_down_during_fetch(s: Soak, f: Fault) -> None:
    """A new artifact for a churn model; MinIO stopped as soon as its Deployment carries the new key,
    so the new pod's fetch (a key no node has) runs against stopped storage."""
    from kubernetes import client

    m, job = s.new_job()
    f.detail["model"] = f"{m.ns}/{m.name}"
    if job is None:
        return
    apps = client.AppsV1Api(s.api())
    key = (job.metadata.annotations or {}).get(ARTIFACT_KEY)

    def rolled() -> bool:
        deps = apps.list_namespaced_deployment(m.ns, label_selector=f"fewerbits.io/model={m.name}").items
        return any((d.spec.template.metadata.annotations or {}).get(ARTIFACT_KEY) == key for d in deps)
    if not s.wait("the Deployment on the new key", rolled, 300, 0.1):
        return
    s.c.stop_component("minio", signal.SIGKILL)
    try:
        seen, down = stopped_storage_fetch(s, m, key)
    finally:
        s.c.start_component("minio")
    f.detail.update(key=key[:16] if key else None, down_seconds=round(down, 1), failed_fetch_attempts=seen)
    f.confirmed = seen > 0


def stopped_storage_fetch(s: Soak, m: ModelRef, key: str | None) -> tuple[int, float]:
    """While storage is stopped (20-40 s): the failed fetch attempts of the model's pods on ``key``."""
    from kubernetes import client

    core = client.CoreV1Api(s.api())
    down = s.rng.uniform(20, 40)
    t = time.monotonic()

    def failed_fetches() -> int:
        n = 0
        for p in core.list_namespaced_pod(m.ns, label_selector=f"fewerbits.io/model={m.name}").items:
            if (p.metadata.annotations or {}).get(ARTIFACT_KEY) == key:
                n += sum(x.restart_count or 0 for x in p.status.init_container_statuses or [])
        return n
    seen = s.wait("the new pod's fetch to fail against stopped storage", failed_fetches, down, 0.5) or 0
    time.sleep(max(0.0, down - (time.monotonic() - t)))
    return seen, down


def job_pod_evicted(s: Soak, f: Fault) -> None:
    from kubernetes import client

    m, job = s.new_job()
    f.detail["model"] = f"{m.ns}/{m.name}"
    pods = [p for p in (s.job_pods(job) if job else []) if p.status.phase == "Running"]
    if not pods:
        return
    p = pods[0]
    client.CoreV1Api(s.api()).create_namespaced_pod_eviction(p.metadata.name, p.metadata.namespace, {
        "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": p.metadata.name, "namespace": p.metadata.namespace}})
    f.detail["pod"] = p.metadata.name
    f.confirmed = True


def ready_serving_pods(s: Soak, role: str = "steady") -> list[Any]:
    from kubernetes import client

    names = {(m.ns, m.name) for m in s.refs if m.role == role}
    pods = client.CoreV1Api(s.api()).list_pod_for_all_namespaces(
        label_selector=f"{MANAGED},app.kubernetes.io/component=server").items
    return [p for p in pods if (p.metadata.namespace, (p.metadata.labels or {}).get("fewerbits.io/model")) in names
            and not p.metadata.deletion_timestamp
            and any(x.type == "Ready" and x.status == "True" for x in p.status.conditions or [])]


def serving_pod_killed(s: Soak, f: Fault) -> None:
    from kubernetes import client

    pods = ready_serving_pods(s)
    if not pods:
        return
    p = s.rng.choice(pods)
    client.CoreV1Api(s.api()).delete_namespaced_pod(p.metadata.name, p.metadata.namespace, grace_period_seconds=0)
    f.detail["pod"] = f"{p.metadata.namespace}/{p.metadata.name}"
    f.confirmed = True


def node_deleted(s: Soak, f: Fault) -> None:
    from kubernetes import client

    from e2e import gpu

    core = client.CoreV1Api(s.api())
    by_node = Counter(p.spec.node_name for p in ready_serving_pods(s) if p.spec.node_name)
    if not by_node:
        return
    node = s.rng.choice(sorted(by_node))
    core.delete_node(node)
    f.detail.update(node=node, serving_pods_on_it=by_node[node])
    gone = s.wait("the deleted node's pods garbage-collected", lambda: not [
        p for p in core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}").items], 300, 2)
    f.detail["pods_collected"] = bool(gone)
    f.confirmed = bool(gone)
    core.create_node(gpu.node_manifest(node, gpu.lookup(POOL)))


def activator_killed_holding_requests(s: Soak, f: Fault) -> None:
    from kubernetes import client

    apps = client.AppsV1Api(s.api())
    m = s.rng.choice([r for r in s.refs if r.role == "atzero"])
    s.traffic.paused.set()  # no other burst: the held count below is this fault's
    try:
        def at_zero() -> bool:
            deps = apps.list_namespaced_deployment(m.ns, label_selector=f"fewerbits.io/model={m.name}").items
            return bool(deps) and all((d.spec.replicas or 0) == 0 and not d.status.ready_replicas for d in deps)
        f.detail["model"] = f"{m.ns}/{m.name}"
        if not s.wait(f"{m.ns}/{m.name} at zero", at_zero, 180, 1):
            return
        if not s.wait("nothing held", lambda: waiting(s.activator) == 0, 120, 0.2):
            return
        s.traffic.burst(m, 3, forced=True)
        held = s.wait("the requests held", lambda: waiting(s.activator) >= 1, 30, 0.05)
        # No new request is sent from here (the traffic is paused, as a terminating pod's endpoint
        # leaves the Service); the Service's slice is the soak's, and stays.
        f.detail["held_at_signal"] = held
        f.confirmed = bool(held) and s.activator.signal(signal.SIGTERM)
        s.wait("the activator back", lambda: serving(s.activator.op), 300, 0.5)
    finally:
        s.traffic.paused.clear()


def waiting(activator: Supervised) -> float:
    try:
        return load.gauge(activator.op.metrics(), "fewerbits_activator_waiting") or 0.0
    except OSError:
        return 0.0


def serving(op: Any) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{op.activator_port}/healthz", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


INJECT: dict[str, Callable[[Soak, Fault], None]] = {
    "leader_killed_mid_job": leader_killed_mid_job, "leader_killed_mid_rollout": leader_killed_mid_rollout,
    "apiserver_restarted": apiserver_restarted, "etcd_restarted": etcd_restarted,
    "minio_down_during_upload": minio_down_during_upload, "minio_down_during_fetch": minio_down_during_fetch,
    "job_pod_evicted": job_pod_evicted, "serving_pod_killed": serving_pod_killed, "node_deleted": node_deleted,
    "activator_killed_holding_requests": activator_killed_holding_requests,
}


# ------------------------------------------------------------------ the run


def start_activator(c: cluster_mod.Cluster, workdir: Path, result: SoakResult, t0: float) -> Supervised:
    from e2e.serviceproxy import publish_host_process
    from tests.integration.operator_harness import OperatorProcess, free_port

    port = free_port()
    publish_host_process(c.api_client(), ACTIVATOR_NS, ACTIVATOR_SVC, port)
    op = OperatorProcess.activator(c.kubeconfig, workdir / "activator.log", port, {"FEWERBITS_NAMESPACES": '["soak-*"]'})
    sup = Supervised("activator", op, result, t0).start()
    op.wait_serving()
    return sup


def start_replicas(c: cluster_mod.Cluster, workdir: Path, result: SoakResult, t0: float) -> tuple[dict[str, Supervised], list[str]]:
    from tests.integration.operator_harness import OperatorProcess

    kube_a, user_a = load.operator_identity(c, workdir)
    kube_b, user_b = load.second_identity(c, workdir, "replica-b")
    env = {"FEWERBITS_NAMESPACES": '["soak-*"]', "FEWERBITS_LEADER_ELECTION": "true",
           "FEWERBITS_LEADER_ELECTION_NAMESPACE": load.OPERATOR_NS,
           "FEWERBITS_LEADER_ELECTION_LEASE": f"{load.RELEASE}-fewerbits",
           "FEWERBITS_ACTIVATOR_SERVICE": f"{ACTIVATOR_NS}/{ACTIVATOR_SVC}",
           # The chart's periods, not the harness's test-speed ones.
           "FEWERBITS_RESYNC_SECONDS": "30", "FEWERBITS_RETENTION_SWEEP_SECONDS": "600",
           "FEWERBITS_AUTOSCALER_PERIOD_SECONDS": "15", "FEWERBITS_AUTOSCALER_STATUS_INTERVAL_SECONDS": "60",
           "FEWERBITS_VLLM_CPU_REQUEST": "100m", "FEWERBITS_VLLM_MEMORY_REQUEST": "128Mi"}
    replicas = {}
    for name, kube in (("replica-a", kube_a), ("replica-b", kube_b)):
        op = OperatorProcess(kube, workdir / f"{name}.log", env_extra={**env, "POD_NAME": name})
        replicas[name] = Supervised(name, op, result, t0).start()
    return replicas, [user_a, user_b]


def deal(rng: random.Random, kinds: tuple[str, ...]) -> Callable[[], str]:
    deck: list[str] = []

    def next_kind() -> str:
        if not deck:
            deck.extend(rng.sample(kinds, len(kinds)))
        return deck.pop()
    return next_kind


def inject_faults(s: Soak, minutes: float, t_start: float) -> float:
    """Faults until ``minutes`` have passed; returns the monotonic time the last one ended. Each
    fault's time is counted from the run's start, as the monitor's are."""
    end = time.monotonic() + minutes * 60
    last = time.monotonic()
    next_kind = deal(s.rng, s.kinds)
    while time.monotonic() + 10 < end:
        time.sleep(min(s.rng.uniform(10, 40), max(0.0, end - time.monotonic())))
        if time.monotonic() >= end:
            break
        f = Fault(next_kind(), round(time.monotonic() - t_start, 1))
        say(f"fault {len(s.result.faults) + 1}: {f.kind}")
        s.result.faults.append(f)
        try:
            INJECT[f.kind](s, f)
        except Exception as e:  # noqa: BLE001 — an injection that failed is reported, not fatal
            f.detail["injection_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        last = time.monotonic()
        say(f"  {'confirmed' if f.confirmed else 'NOT confirmed'}: {json.dumps(f.detail)[:400]}")
    return last


def check_manifests(c: cluster_mod.Cluster, result: SoakResult) -> None:
    s3 = c.s3.client()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=demo.ARTIFACT_BUCKET, Prefix="soak/"):
        for o in page.get("Contents", []):
            if not o["Key"].endswith("/manifest.json"):
                continue
            prefix = o["Key"][: -len("manifest.json")]
            manifest = json.loads(s3.get_object(Bucket=demo.ARTIFACT_BUCKET, Key=o["Key"])["Body"].read())
            stored = {}
            for p in s3.get_paginator("list_objects_v2").paginate(Bucket=demo.ARTIFACT_BUCKET, Prefix=f"{prefix}files/"):
                stored.update({x["Key"]: x["Size"] for x in p.get("Contents", [])})
            for f in manifest["files"]:
                key = f"{prefix}files/{f['path']}"
                if stored.get(key) != f["sizeBytes"]:
                    result.violate("manifest_complete", f"{key}: listed {f['sizeBytes']} bytes, stored {stored.get(key)}")
                elif s3.head_object(Bucket=demo.ARTIFACT_BUCKET, Key=key)["Metadata"].get("sha256") != f["sha256"]:
                    result.violate("manifest_complete", f"{key}: sha256 metadata differs from the manifest")
            result.manifests_checked += 1


LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")


def log_times(lines: list[str], wall0: float) -> list[float | None]:
    """Per line, the time of the last timestamped line at or before it, in seconds since the run
    began (``wall0``: its wall clock; the logs' clock is this machine's, local time)."""
    out: list[float | None] = []
    last = None
    for line in lines:
        if m := LOG_TIME.match(line):
            last = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000 - wall0
        out.append(last)
    return out


def check_logs(workdir: Path, result: SoakResult, wall0: float) -> None:
    for log in sorted(workdir.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        result.logs_checked += 1
        times = log_times(lines, wall0)
        for i, line in enumerate(lines):
            if line.startswith("Traceback (most recent call last)"):
                tail = next((x for x in lines[i + 1:i + 60] if x and not x.startswith(" ")), "")
                at = f"t={times[i]:.0f}s: " if times[i] is not None else ""
                result.violate("no_traceback", f"{at}{log.name}:{i + 1}: {tail[:200]}")


def check_exits(result: SoakResult, workdir: Path, wall0: float) -> None:
    """An exit nobody caused: the leader's exit 1 within 30 s of its log's "lost the lease" is by
    design (client-go's rule; the pod restarts as a standby); any other exit is a crash, and three
    crashes of one process in ten minutes a crash loop."""
    for proc in sorted({e["process"] for e in result.replica_exits}):
        log = workdir / f"{proc}.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        lost = [t for line, t in zip(lines, log_times(lines, wall0)) if "lost the lease" in line and t is not None]
        crashes = []
        for e in result.replica_exits:
            if e["process"] != proc or e["caused_by_the_soak"]:
                continue
            e["lost_the_lease"] = e["code"] == 1 and any(e["at"] - 30 <= t <= e["at"] + 1 for t in lost)
            if not e["lost_the_lease"]:
                crashes.append(e["at"])
                result.violate("no_crash_loop", f"t={e['at']:.0f}s: {proc} exited by itself with {e['code']}")
        for i in range(len(crashes) - 2):
            if crashes[i + 2] - crashes[i] < 600:
                result.violate("no_crash_loop", f"t={crashes[i + 2]:.0f}s: {proc}: 3 crashes within 10 min")


def rest_writes(audit_log: Path, offset: int, users: list[str]) -> tuple[dict[str, int], int]:
    writes: Counter = Counter()
    lease = 0
    for user in users:
        _, by_resource, _ = load.audit_requests(audit_log, offset, user)
        for k, n in by_resource.items():
            if k.endswith(" leases"):
                lease += n
            elif k.split()[0] in load.WRITE_VERBS:
                writes[f"{user.rsplit(':', 1)[-1]}: {k}"] += n
    return dict(writes), lease


def run_soak(*, models: int, namespaces: int, minutes: float, seed: int, converge_timeout: float,
             settle_seconds: float, rest_seconds: float, kinds: tuple[str, ...] = FAULTS,
             keep: bool = False) -> SoakResult:
    from kubernetes import client

    from e2e import gpu

    t_start, wall0 = time.monotonic(), time.time()
    rng = random.Random(seed)
    refs = model_refs(models, namespaces)
    result = SoakResult(config={"models": models, "namespaces": namespaces, "minutes": minutes, "seed": seed,
                                "roles": dict(Counter(m.role for m in refs)), "converge_timeout_seconds": converge_timeout,
                                "settle_seconds": settle_seconds, "rest_seconds": rest_seconds,
                                "fault_kinds": list(kinds),
                                "lease": {"duration": 15, "renew_deadline": 10, "renew": 5, "retry": 2}})
    workdir = Path(tempfile.mkdtemp(prefix="fewerbits-soak-"))
    c = cluster_mod.Cluster(workdir / "cluster", audit=True)
    procs: list[Any] = []
    try:
        say(f"starting the control plane in {workdir} (audit log on)")
        c.start()
        load.install_crds(c)
        nodes = -(-(models + 16) // gpu.lookup(POOL).count)
        c.add_gpu_pool(POOL, POOL, nodes=nodes)
        source = demo.upload_test_model(c)
        load.create_namespaces(c, sorted({m.ns for m in refs}), "s3-credentials")
        activator = start_activator(c, workdir, result, t_start)
        procs.append(activator)
        replicas, users = start_replicas(c, workdir, result, t_start)
        procs += replicas.values()
        monitor = Monitor(c, result, refs, t_start).start()
        procs.append(monitor)
        custom = client.CustomObjectsApi(c.api_client())
        for m in refs:
            custom.create_namespaced_custom_object(GROUP, VERSION, m.ns, PLURAL, {
                "apiVersion": f"{GROUP}/{VERSION}", "kind": "QuantizedModel",
                "metadata": {"name": m.name, "namespace": m.ns}, "spec": model_spec(c, m, source, "s3-credentials")})
        say(f"{models} models applied in {namespaces} namespaces ({result.config['roles']}); {nodes} nodes")
        if wait_converged(monitor, 1500, "the first convergence") is None:
            result.violate("converged_in_time", f"the first convergence: not in 1500 s: {monitor.unconverged()}")
            return result
        result.config["first_convergence_seconds"] = round(time.monotonic() - t_start, 1)
        # Its own generator: the requests' moments do not shift the faults' order and pauses.
        traffic = Traffic(activator.op.activator_port, [m for m in refs if m.role == "atzero"], result,
                          random.Random(seed + 1), t_start).start()
        procs.append(traffic)
        soak = Soak(c, result, refs, replicas, activator, traffic, monitor, rng,
                    f"{load.RELEASE}-fewerbits", load.OPERATOR_NS, kinds)
        say(f"faults for {minutes:g} min")
        last = inject_faults(soak, minutes, t_start)
        traffic.stop()
        procs.remove(traffic)
        took = wait_converged(monitor, converge_timeout, "convergence after the last fault", since=last)
        result.converged_after_last_fault_seconds = took
        if took is None:
            result.violate("converged_in_time", f"not converged {converge_timeout:.0f}s after the last fault: "
                                                f"{monitor.unconverged()}")
        # The autoscaler publishes what changed at a scale (its pods gone) at its next status
        # interval (60 s): the window begins after that, as a platform team's "at rest" would.
        say(f"converged; settling {settle_seconds:.0f}s")
        time.sleep(settle_seconds)
        offset = c.audit_log.stat().st_size
        say(f"at rest for {rest_seconds:.0f}s")
        time.sleep(rest_seconds)
        result.rest_writes, result.rest_lease_requests = rest_writes(c.audit_log, offset, users)
        if result.rest_writes:
            result.violate("no_writes_at_rest", json.dumps(result.rest_writes))
        result.requests = dict(traffic.counts)
        for lost in traffic.lost:
            result.violate("no_request_lost", lost)
        result.jobs = {"created": len(monitor.job_uids), "max_unfinished_at_once": monitor.max_unfinished,
                       "gate_failed_keys": len(monitor.failed_keys), "monitor_polls": monitor.polls}
        guarded(result, "manifest_complete", lambda: check_manifests(c, result))
        for p in reversed(procs):
            p.stop()
        procs.clear()
        guarded(result, "no_traceback", lambda: check_logs(workdir, result, wall0))
        guarded(result, "no_crash_loop", lambda: check_exits(result, workdir, wall0))
        return result
    except Exception as e:  # noqa: BLE001 — reported with what was measured until then
        import traceback

        traceback.print_exc()
        result.violate("run_completed", f"{type(e).__name__}: {str(e)[:300]}")
        return result
    finally:
        settle(result)
        for p in reversed(procs):
            p.stop()
        result.wall_seconds = round(time.monotonic() - t_start, 1)
        c.stop()
        if keep:
            say(f"kept {workdir} (logs, audit log)")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def guarded(result: SoakResult, invariant: str, check: Callable[[], None]) -> None:
    """A check at the end that fails to run (storage unreachable, a log unreadable) is a breach of
    what it checks, not a lost run."""
    try:
        check()
    except Exception as e:  # noqa: BLE001
        result.violate(invariant, f"the check itself failed: {type(e).__name__}: {str(e)[:200]}")


def wait_converged(monitor: Monitor, timeout: float, what: str, since: float | None = None,
                   polls: int = 3) -> float | None:
    """Seconds from ``since`` (default now) until every model converged, or None after ``timeout``:
    converged in ``polls`` polls in a row, each begun after this call (a poll from before it may
    predate a wake the last requests caused)."""
    since = since or time.monotonic()
    deadline, report = since + timeout, 0.0
    first, streak, seen = monitor.polls + 1, 0, monitor.polls
    while time.monotonic() < deadline:
        if monitor.polls > seen:
            seen = monitor.polls
            left = monitor.unconverged()
            streak = streak + 1 if not left and seen > first else 0
            if streak >= polls:
                return round(time.monotonic() - since, 1)
        else:
            left = monitor.unconverged()
        if time.monotonic() - report > 30:
            report = time.monotonic()
            say(f"  {what}: {len(monitor.refs) - len(left)}/{len(monitor.refs)} converged; waiting on {left[:4]}")
        time.sleep(0.5)
    return None


def settle(result: SoakResult) -> None:
    """Each confirmed fault survived unless the run did not converge in time, a check at the end
    found a breach (it has no time: it counts against every fault), or a breach was seen between it
    and the next fault. A fault not confirmed (its moment not met) is neither."""
    ok = "converged_in_time" not in result.violations and not result.untimed_violations
    for i, f in enumerate(result.faults):
        nxt = result.faults[i + 1].at if i + 1 < len(result.faults) else float("inf")
        f.survived = (ok and not any(f.at <= t < nxt for t in result.violation_times)) if f.confirmed else None


def evidence(r: SoakResult) -> dict[str, bool]:
    """Whether each invariant was put to the test at all (a check of nothing holds vacuously)."""
    gate_models = r.config.get("roles", {}).get("gatefail", 0)
    return {
        "one_job_per_key": r.jobs.get("created", 0) > 0 and r.jobs.get("monitor_polls", 0) > 0,
        "manifest_complete": r.manifests_checked > 0,
        "nothing_served_that_failed_its_gate": not gate_models or r.jobs.get("gate_failed_keys", 0) > 0,
        "no_request_lost": r.requests.get("answered", 0) > 0,
        "no_traceback": r.logs_checked > 0,
        "no_crash_loop": True,
        "converged_in_time": r.converged_after_last_fault_seconds is not None,
        "no_writes_at_rest": r.rest_lease_requests > 0,
        "run_completed": True,
    }


# ------------------------------------------------------------------ output


def summary(r: SoakResult) -> dict[str, Any]:
    by_kind: dict[str, dict[str, int]] = {}
    for f in r.faults:
        k = by_kind.setdefault(f.kind, {"injected": 0, "confirmed": 0, "survived": 0})
        k["injected"] += 1
        k["confirmed"] += f.confirmed
        k["survived"] += f.survived is True
    return {
        "faults_injected": len(r.faults), "faults_confirmed": sum(f.confirmed for f in r.faults),
        "faults_survived": sum(f.survived is True for f in r.faults), "by_kind": by_kind,
        "invariants": {name: not r.violations.get(name) and tested for name, tested in evidence(r).items()},
        "invariants_tested": evidence(r),
        "data_lost": {"requests_lost": r.requests.get("lost", 0),
                      "incomplete_manifests": len(r.violations.get("manifest_complete", []))},
    }


def markdown(d: dict[str, Any]) -> str:
    s, cfg = d["summary"], d["config"]
    lines = [f"| fault ({cfg['models']} models, {cfg['namespaces']} namespaces, {cfg['minutes']:g} min, seed "
             f"{cfg['seed']}) | injected | at the moment aimed for | survived |", "|---|---|---|---|"]
    for kind in FAULTS:
        k = s["by_kind"].get(kind, {"injected": 0, "confirmed": 0, "survived": 0})
        lines.append(f"| {kind.replace('_', ' ')} | {k['injected']} | {k['confirmed']} | {k['survived']} |")
    lines.append(f"| **all** | **{s['faults_injected']}** | **{s['faults_confirmed']}** | **{s['faults_survived']}** |")
    req = d["requests"]
    lines += ["", "| invariant | held |", "|---|---|"]
    lines += [f"| {name.replace('_', ' ')} | "
              f"{'yes' if ok else ('**breached**' if d['violations'].get(name) else '**not tested**')} |"
              for name, ok in s["invariants"].items()]
    lines += ["", f"Requests through the activator: {req.get('answered', 0)} answered, "
                  f"{req.get('shed_503_retry_after', 0)} refused with 503 and Retry-After, "
                  f"{req.get('refused_not_accepted', 0)} not accepted (no listener), **{req.get('lost', 0)} lost**. "
                  f"Quantization Jobs: {d['jobs'].get('created', 0)}. Every model converged "
                  f"{d['converged_after_last_fault_seconds']} s after the last fault (bound "
                  f"{cfg['converge_timeout_seconds']:g} s); operator writes at rest over {cfg['rest_seconds']:g} s, "
                  f"the Lease apart: {sum(d['rest_writes'].values())}. Manifests checked: {d['manifests_checked']}, "
                  f"incomplete: {s['data_lost']['incomplete_manifests']}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/soak.py", description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=40)
    ap.add_argument("--namespaces", type=int, default=5)
    ap.add_argument("--minutes", type=float, default=30, help="how long faults are injected")
    ap.add_argument("--seed", type=int, default=None, help="the faults' order and pauses (default: random, printed)")
    ap.add_argument("--converge-timeout", type=float, default=600,
                    help="seconds after the last fault by which every model must have converged")
    ap.add_argument("--settle-seconds", type=float, default=90,
                    help="after convergence, before the window at rest (the autoscaler's status interval)")
    ap.add_argument("--rest-seconds", type=float, default=120, help="the window at rest, after settling")
    ap.add_argument("--faults", default=",".join(FAULTS), help="the kinds to deal, comma-separated (default: all)")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--markdown-from", type=Path, metavar="JSON", help="print a run's tables and exit")
    ap.add_argument("--keep", action="store_true", help="keep the state dir (logs, audit log)")
    args = ap.parse_args(argv)
    if args.markdown_from:
        print(markdown(json.loads(args.markdown_from.read_text())))
        return 0
    if args.models < 8 or args.namespaces < 1:
        ap.error("--models must be at least 8 (every role) and --namespaces at least 1")
    kinds = tuple(k for k in args.faults.split(",") if k)
    if unknown := set(kinds) - set(FAULTS):
        ap.error(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(FAULTS)}")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    say(f"seed {seed}")
    result = run_soak(models=args.models, namespaces=args.namespaces, minutes=args.minutes, seed=seed,
                      converge_timeout=args.converge_timeout, settle_seconds=args.settle_seconds,
                      rest_seconds=args.rest_seconds, kinds=kinds, keep=args.keep)
    out = {**asdict(result), "summary": summary(result)}
    print(json.dumps(out["summary"], indent=1))
    print(markdown(out))
    if args.json_out:
        args.json_out.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json_out}")
    if result.violations or not all(out["summary"]["invariants"].values()):
        print(f"FAILED: breached {sorted(result.violations)}; untested "
              f"{sorted(k for k, v in out['summary']['invariants_tested'].items() if not v)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
