"""The activator under a burst: requests/s and API calls per request at 1 and 100 held requests, its
per-request reads (the baseline, before issue 44) against its watch-fed caches, in the same run.

    .venv/bin/python bench/activator_burst.py --json bench/results/activator-burst.json   # ~1-2 min
    .venv/bin/python bench/activator_burst.py --quick                                     # ~10 s, 1 and 10

What is real: the activator as its process builds it (``activator_main.build``: the Kube it runs,
the kubernetes client, every API request counted in ``fewerbits_activator_api_calls_total``, its
caches and their list and watch threads, its HTTP server on a tenant port, ``forward_http``), in
a process of its own; HTTP into it (one connection per client, ``Host: <model>.<ns>.svc``, as a
Service at zero delivers it); its wake (the scale read and replaced at its resourceVersion) and
event; the objects, as the operator renders them (``render_deployment``; the pod is the Deployment's
template, Running and Ready, as the kubelet reports it).

What stands in:

* the API server: an HTTP server in this process answering the paths the activator calls (GET of a
  model, LIST and WATCH of models, pods and Deployments with label selectors and resourceVersions,
  the scale subresource replaced only at its resourceVersion, events), counting each request by verb
  and resource (the ground truth; the activator's own counter is scraped and compared). It keeps no
  ``managedFields``, so a LIST costs less here than on a real API server: the baseline is favoured;
* the pod's start: ``--start-seconds`` (1 s) after the wake, a Ready pod is created (its IP the
  stand-in backend's, its port the backend's: the activator's ``VLLM_PORT`` is set to it);
* the serving backend: a small HTTP server answering every completion at once.

Per mode (``per-request reads``: ``cached=False``, the behaviour before and the fallback path;
``cached``) and concurrency N (1 and 100):

* held: ``--rounds`` rounds of: the model at zero (its Deployment at 0, no pod), N requests at once,
  held; the first wakes the model; the pod becomes Ready; all are forwarded. Reported: API calls per
  request over the round (reads, and the wake's writes apart), requests/s of the release (N / from
  the pod Ready to the last answer), the mean hold;
* steady: the pod Ready (a model on one pod keeps the activator in its path, atzero.py): N clients
  back to back for ``--steady-seconds``: requests/s and API calls per request.

Two cores are shared by this process (clients, stand-ins) and the activator's: compare the modes
within one run. Prints a table and JSON (``--json`` writes it).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "crds", REPO / "runtime", REPO / "operator"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from e2e.procs import free_port  # noqa: E402

NS, MODEL, POOL = "bench", "m", "h100"
HOST = f"{MODEL}.{NS}.svc.cluster.local:8000"
MODES = ("per-request reads", "cached")
COMPLETION = json.dumps({"id": "cmpl-bench", "object": "text_completion", "model": MODEL,
                         "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}).encode()
WAKE = {("get", "deployments/scale"), ("update", "deployments/scale"), ("create", "events")}
"""The wake's calls (the scale read and replaced from 0, the event): once per burst, shared by its
requests, the same in both modes (a write is never made from a cache)."""


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512  # a burst connects at once: the stand-ins never drop a SYN


# ------------------------------------------------------------------ the objects, as the operator renders them


def objects() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(model, Deployment, pod): the Deployment by ``render_deployment``, the pod its template."""
    from fewerbits_api.quantizedmodel import PlanVariant, QuantizedModelSpec

    from fewerbits_operator.base.settings import OperatorSettings
    from fewerbits_operator.serving.render import Owner, render_deployment

    spec = QuantizedModelSpec.model_validate({
        "source": {"uri": "hf://fewerbits-test/bench", "revision": "0" * 40},
        "storage": {"uri": "s3://bench/artifacts", "endpoint": "http://minio.bench:9000", "credentialsSecret": "s3"},
        "autoscaling": {"minReplicas": 0, "maxReplicas": 4},
    })
    variant = PlanVariant(pool=POOL, gpuProduct="NVIDIA-H100-80GB-HBM3", family="hopper", format="fp8-dynamic",
                          kvCacheDtype="fp8", dtype="bfloat16", tensorParallelSize=1, maxModelLen=4096,
                          weightsGiB=8.0, kvCacheTokens=100000, decodeTokensPerSecond=100.0,
                          vllmArgs=["--max-model-len", "4096"])
    uid = "00000000-0000-4000-8000-000000000001"
    dep = render_deployment(Owner(MODEL, NS, uid), spec, variant, {"nvidia.com/gpu.product": variant.gpuProduct},
                            "9.0", "k" * 16, 8 * 2**30, 0, OperatorSettings())
    now = "2025-01-01T00:00:00Z"
    dep["metadata"].update(uid="00000000-0000-4000-8000-000000000002", creationTimestamp=now, generation=1)
    dep["status"] = {"observedGeneration": 1, "replicas": 0}
    conditions = [{"type": t, "status": "True", "reason": "Bench", "message": f"{t} in the bench",
                   "lastTransitionTime": now, "observedGeneration": 1}
                  for t in ("Planned", "Quantized", "Serving", "Ready")]
    model = {"apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizedModel",
             "metadata": {"name": MODEL, "namespace": NS, "uid": uid, "generation": 1, "creationTimestamp": now},
             "spec": spec.model_dump(mode="json", by_alias=True, exclude_none=True),
             "status": {"observedGeneration": 1, "conditions": conditions,
                        "plan": {"variants": [variant.model_dump(mode="json", by_alias=True, exclude_none=True)]},
                        "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 4}}}
    tpl = dep["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": f"{dep['metadata']['name']}-7d9f8c6b5-x2x9z", "namespace": NS,
                        "uid": "00000000-0000-4000-8000-000000000003", "creationTimestamp": now,
                        "labels": {**tpl["metadata"]["labels"], "pod-template-hash": "7d9f8c6b5"},
                        "annotations": dict(tpl["metadata"].get("annotations") or {}),
                        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "controller": True,
                                             "name": f"{dep['metadata']['name']}-7d9f8c6b5",
                                             "uid": "00000000-0000-4000-8000-000000000004"}]},
           "spec": {**copy.deepcopy(tpl["spec"]), "nodeName": "gpu-node-1"},
           "status": {"phase": "Running", "podIP": "127.0.0.1", "hostIP": "10.0.0.1", "startTime": now,
                      "conditions": [{"type": t, "status": "True", "lastTransitionTime": now}
                                     for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
                      "containerStatuses": [{"name": c["name"], "ready": True, "restartCount": 0, "started": True,
                                             "image": c.get("image", "vllm"), "imageID": "sha256:" + "0" * 64,
                                             "containerID": "containerd://" + "1" * 64,
                                             "state": {"running": {"startedAt": now}}}
                                            for c in tpl["spec"]["containers"]]}}
    return model, dep, pod


# ------------------------------------------------------------------ the stand-in API server


def selects(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class StandInApi:
    """The API server's answers to the paths the activator calls (see the module)."""

    def __init__(self, start_seconds: float):
        self.start_seconds = start_seconds
        self.cond = threading.Condition()
        self.rv = 100
        self.store: dict[tuple[str, str], dict[str, Any]] = {}
        self.log: list[tuple[int, str, str, dict[str, Any]]] = []
        self.calls: Counter[tuple[str, str]] = Counter()
        self.watchers: dict[int, list[Any]] = {}  # id -> [resource, position sent]
        self.ready_at: float | None = None
        self.woken_at: float | None = None
        self.closed = False
        self.model, self.deployment, self.pod = objects()
        self.put("quantizedmodels", self.model)
        self.put("deployments", self.deployment)
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall

            def do_GET(self) -> None:  # noqa: N802
                outer.get(self)

            def do_PUT(self) -> None:  # noqa: N802
                outer.put_scale(self)

            def do_POST(self) -> None:  # noqa: N802
                outer.post_event(self)

            def log_message(self, *a: Any) -> None:
                pass

        self.server = Server(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def count(self, verb: str, resource: str) -> None:
        with self.cond:
            self.calls[(verb, resource)] += 1

    def counts(self) -> Counter[tuple[str, str]]:
        with self.cond:
            return Counter(self.calls)

    # ---- the store

    def put(self, resource: str, obj: dict[str, Any], kind: str | None = None) -> None:
        with self.cond:
            self.rv += 1
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = str(self.rv)
            key = (resource, obj["metadata"]["name"])
            kind = kind or ("MODIFIED" if key in self.store else "ADDED")
            if kind == "DELETED":
                self.store.pop(key, None)
            else:
                self.store[key] = obj
            self.log.append((self.rv, resource, kind, obj))
            self.cond.notify_all()

    def at_zero(self) -> None:
        """The model back at zero: its Deployment at 0 replicas, its pod gone."""
        with self.cond:
            dep, pod = self.store[("deployments", self.deployment["metadata"]["name"])], \
                self.store.get(("pods", self.pod["metadata"]["name"]))
            self.ready_at = self.woken_at = None
        self.put("deployments", {**dep, "spec": {**dep["spec"], "replicas": 0}, "status": {"replicas": 0}})
        if pod is not None:
            self.put("pods", pod, "DELETED")

    def pod_ready(self) -> None:
        self.put("pods", self.pod)
        with self.cond:
            self.ready_at = time.monotonic()

    def flushed(self, timeout: float = 10.0) -> None:
        """Every open watch has been sent every event so far (the activator then applies it: ms)."""
        with self.cond:
            ok = self.cond.wait_for(lambda: all(pos >= self.rv for _, pos in self.watchers.values()), timeout)
        assert ok, "a watch did not get the events"

    def watching(self) -> set[str]:
        with self.cond:
            return {r for r, _ in self.watchers.values()}

    # ---- HTTP

    def _send(self, h: BaseHTTPRequestHandler, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _status(self, h: BaseHTTPRequestHandler, code: int, reason: str) -> None:
        self._send(h, code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                             "code": code, "message": reason})

    def _route(self, h: BaseHTTPRequestHandler) -> tuple[str, str | None, str | None, dict[str, str]]:
        """(resource, name, subresource, query) of a namespaced path of namespace NS."""
        u = urlsplit(h.path)
        parts = [p for p in u.path.split("/") if p]
        rest = parts[2:] if parts[:1] == ["api"] else parts[3:]
        assert rest[:2] == ["namespaces", NS], h.path
        rest = rest[2:]
        q = {k: v[0] for k, v in parse_qs(u.query).items()}
        return rest[0], (rest[1] if len(rest) > 1 else None), (rest[2] if len(rest) > 2 else None), q

    def get(self, h: BaseHTTPRequestHandler) -> None:
        resource, name, sub, q = self._route(h)
        if name is not None:
            self.count("get", f"{resource}/{sub}" if sub else resource)
            with self.cond:
                obj = copy.deepcopy(self.store.get((resource, name)))
            if obj is None:
                return self._status(h, 404, "NotFound")
            if sub == "scale":
                n = int(obj["spec"].get("replicas") or 0)
                obj = {"apiVersion": "autoscaling/v1", "kind": "Scale",
                       "metadata": {"name": name, "namespace": NS, "resourceVersion": obj["metadata"]["resourceVersion"]},
                       "spec": {"replicas": n}, "status": {"replicas": n}}
            return self._send(h, 200, obj)
        selector = q.get("labelSelector", "")
        if q.get("watch") in ("true", "True", "1"):
            self.count("watch", resource)
            return self.watch(h, resource, selector, int(q.get("resourceVersion") or 0),
                              float(q.get("timeoutSeconds") or 300))
        self.count("list", resource)
        with self.cond:
            items = [copy.deepcopy(o) for (r, _), o in self.store.items()
                     if r == resource and selects(selector, o["metadata"].get("labels") or {})]
            rv = str(self.rv)
        kind = {"pods": "PodList", "deployments": "DeploymentList"}.get(resource, "QuantizedModelList")
        api_version = {"pods": "v1", "deployments": "apps/v1"}.get(resource, "fewerbits.io/v1alpha1")
        self._send(h, 200, {"kind": kind, "apiVersion": api_version, "metadata": {"resourceVersion": rv},
                            "items": items})

    def watch(self, h: BaseHTTPRequestHandler, resource: str, selector: str, pos: int, timeout: float) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        me = id(h)
        deadline = time.monotonic() + timeout
        with self.cond:
            self.watchers[me] = [resource, pos]
        try:
            while not self.closed and (left := deadline - time.monotonic()) > 0:
                with self.cond:
                    self.cond.wait_for(lambda: self.closed or self.rv > pos, left)
                    new = [(kind, o) for rv, r, kind, o in self.log if rv > pos and r == resource
                           and selects(selector, o["metadata"].get("labels") or {})]
                    pos = self.rv
                for kind, o in new:
                    line = json.dumps({"type": kind, "object": o}).encode() + b"\n"
                    h.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                h.wfile.flush()
                with self.cond:
                    self.watchers[me][1] = pos
                    self.cond.notify_all()
            h.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass
        finally:
            with self.cond:
                self.watchers.pop(me, None)
                self.cond.notify_all()

    def put_scale(self, h: BaseHTTPRequestHandler) -> None:
        resource, name, sub, _ = self._route(h)
        self.count("update", f"{resource}/{sub}")
        body = json.loads(h.rfile.read(int(h.headers.get("Content-Length") or 0)))
        with self.cond:
            dep = copy.deepcopy(self.store.get((resource, name or "")))
        if dep is None or sub != "scale":
            return self._status(h, 404, "NotFound")
        if body["metadata"].get("resourceVersion") != dep["metadata"]["resourceVersion"]:
            return self._status(h, 409, "Conflict")
        was, n = int(dep["spec"].get("replicas") or 0), int(body["spec"]["replicas"])
        dep["spec"]["replicas"] = n
        self.put(resource, dep)
        with self.cond:
            rv = self.store[(resource, name or "")]["metadata"]["resourceVersion"]
        if was == 0 and n > 0:
            with self.cond:
                self.woken_at = time.monotonic()
            threading.Timer(self.start_seconds, self.pod_ready).start()  # the pod's start
        self._send(h, 200, {"apiVersion": "autoscaling/v1", "kind": "Scale",
                            "metadata": {"name": name, "namespace": NS, "resourceVersion": rv},
                            "spec": {"replicas": n}, "status": {"replicas": was}})

    def post_event(self, h: BaseHTTPRequestHandler) -> None:
        resource, _, _, _ = self._route(h)
        self.count("create", resource)
        body = json.loads(h.rfile.read(int(h.headers.get("Content-Length") or 0)))
        body["metadata"]["name"] = body["metadata"].pop("generateName", "e.") + "x"
        self._send(h, 201, body)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.server.shutdown()


# ------------------------------------------------------------------ the serving backend


def backend() -> ThreadingHTTPServer:
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(COMPLETION)))
            self.end_headers()
            self.wfile.write(COMPLETION)

        def log_message(self, *a: Any) -> None:
            pass

    srv = Server(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


# ------------------------------------------------------------------ the activator, in its own process


def child(args: argparse.Namespace) -> int:
    """The activator as activator_main builds it, on the stand-in API, pods on the backend's port."""
    import logging

    from kubernetes import client
    from prometheus_client import start_http_server

    from fewerbits_operator.base.settings import OperatorSettings
    from fewerbits_operator.runtime import activator as activator_mod
    from fewerbits_operator.runtime.activator_main import build

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    activator_mod.VLLM_PORT = args.backend_port  # the stand-in pods' port (vLLM's 8000 in a cluster)
    cfg = client.Configuration()
    cfg.host = args.api
    s = OperatorSettings(activator_port=args.port, metrics_port=args.metrics_port,
                         activator_tenant_ports={NS: args.tenant_port})
    act = build(s, client.ApiClient(cfg), cached=not args.no_cache)
    start_http_server(args.metrics_port, addr="127.0.0.1")
    activator_mod.serve(act, args.tenant_port, host="127.0.0.1", tenant=NS)
    print("ready", flush=True)
    sys.stdin.read()  # until the bench closes it
    return 0


class Activator:
    def __init__(self, api: StandInApi, backend_port: int, cached: bool, log: Path):
        self.port, self.tenant_port, self.metrics_port = (free_port() for _ in range(3))
        cmd = [sys.executable, __file__, "--child", "--api", api.url, "--port", str(self.port),
               "--tenant-port", str(self.tenant_port), "--metrics-port", str(self.metrics_port),
               "--backend-port", str(backend_port)] + ([] if cached else ["--no-cache"])
        self.log = log
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"),
                                     text=True, cwd=REPO)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the activator did not start: {log.read_text()[-2000:]}")

    def counted(self) -> Counter[tuple[str, str]]:
        """Its own ``fewerbits_activator_api_calls_total``, scraped."""
        from prometheus_client.parser import text_string_to_metric_families
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        out: Counter[tuple[str, str]] = Counter()
        for fam in text_string_to_metric_families(text):
            if fam.name == "fewerbits_activator_api_calls":
                for smp in fam.samples:
                    if smp.name.endswith("_total"):
                        out[(smp.labels["verb"], smp.labels["resource"])] += int(smp.value)
        return out

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.terminate()
        self.proc.wait(10)


# ------------------------------------------------------------------ the clients


def request(port: int, conn: Any = None) -> tuple[int, Any]:
    import http.client
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = b'{"model": "m", "prompt": "hello", "max_tokens": 1}'
    conn.request("POST", "/v1/completions", body=body, headers={"Host": HOST, "Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    return resp.status, conn


def delta(after: Counter, before: Counter) -> Counter:
    return Counter({k: after[k] - before[k] for k in after if after[k] - before[k]})


def held_round(api: StandInApi, act: Activator, n: int) -> dict[str, Any]:
    api.at_zero()
    api.flushed()
    time.sleep(0.1)  # the activator applies what its watches were sent (ms); checked: "notHeld" below
    go = threading.Event()
    done: list[tuple[int, float, float]] = []
    lock = threading.Lock()

    def one() -> None:
        go.wait()
        t = time.monotonic()
        code, conn = request(act.tenant_port)
        conn.close()
        with lock:
            done.append((code, t, time.monotonic()))

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    before, counted_before = api.counts(), act.counted()
    go.set()
    for t in threads:
        t.join(120)
    calls, counted = delta(api.counts(), before), delta(act.counted(), counted_before)
    ready_at = api.ready_at
    assert ready_at is not None and len(done) == n, "the burst was not answered"
    last = max(d[2] for d in done)
    return {"codes": Counter(str(c) for c, _, _ in done), "calls": calls, "counted": counted,
            "release": last - ready_at, "hold": statistics.mean(d[2] - d[1] for d in done),
            "notHeld": sum(1 for _, _, end in done if end < ready_at)}


def steady(api: StandInApi, act: Activator, n: int, seconds: float) -> dict[str, Any]:
    stop_at: list[float] = []
    go = threading.Event()
    codes: Counter[str] = Counter()
    lock = threading.Lock()

    def loop() -> None:
        conn = None
        go.wait()
        while time.monotonic() < stop_at[0]:
            code, conn = request(act.tenant_port, conn)
            with lock:
                codes[str(code)] += 1
        if conn is not None:
            conn.close()

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    before, counted_before = api.counts(), act.counted()
    t0 = time.monotonic()
    stop_at.append(t0 + seconds)
    go.set()
    for t in threads:
        t.join(seconds + 120)
    elapsed = time.monotonic() - t0
    return {"codes": codes, "calls": delta(api.counts(), before), "counted": delta(act.counted(), counted_before),
            "seconds": elapsed}


def row(mode: str, phase: str, n: int, requests: int, seconds: float, calls: Counter, counted: Counter,
        **extra: Any) -> dict[str, Any]:
    reads = sum(v for k, v in calls.items() if k not in WAKE)
    total = sum(calls.values())
    return {"mode": mode, "phase": phase, "concurrency": n, "requests": requests, "seconds": round(seconds, 3),
            "requestsPerSecond": round(requests / seconds, 1) if seconds > 0 else None,
            "apiCallsPerRequest": round(total / requests, 3), "apiReadsPerRequest": round(reads / requests, 3),
            "apiCalls": {f"{v} {r}": c for (v, r), c in sorted(calls.items())},
            "activatorCounterAgrees": counted == calls, **extra}


def run_mode(api: StandInApi, backend_port: int, mode: str, args: argparse.Namespace, logdir: Path) -> list[dict]:
    cached = mode == "cached"
    at_start = api.counts()
    act = Activator(api, backend_port, cached, logdir / f"activator-{'cached' if cached else 'reads'}.log")
    rows = []
    try:
        if cached:  # its tenant namespace's watches listed and open
            deadline = time.monotonic() + 30
            while api.watching() != {"quantizedmodels", "pods", "deployments"}:
                assert time.monotonic() < deadline, "the activator's watches did not open"
                time.sleep(0.02)
        startup = delta(api.counts(), at_start)
        for n in args.concurrency:
            rounds = [held_round(api, act, n) for _ in range(args.rounds)]
            calls: Counter = sum((r["calls"] for r in rounds), Counter())
            counted: Counter = sum((r["counted"] for r in rounds), Counter())
            release = sum(r["release"] for r in rounds)
            codes: Counter = sum((r["codes"] for r in rounds), Counter())
            rows.append(row(mode, "held", n, n * args.rounds, release, calls, counted,
                            meanHoldSeconds=round(statistics.mean(r["hold"] for r in rounds), 3),
                            notHeld=sum(r["notHeld"] for r in rounds), codes=dict(codes),
                            note="requests/s: N / (pod Ready -> last answer), over the rounds"))
            print(json.dumps(rows[-1]), flush=True)
        api.pod_ready()  # one pod, Ready: the activator forwards at once
        dep = api.store[("deployments", api.deployment["metadata"]["name"])]
        api.put("deployments", {**dep, "spec": {**dep["spec"], "replicas": 1}})
        api.flushed()
        time.sleep(0.1)
        for n in args.concurrency:
            steady(api, act, n, min(0.2, args.steady_seconds))  # warm: connections, pools
            s = steady(api, act, n, args.steady_seconds)
            rows.append(row(mode, "steady", n, sum(s["codes"].values()), s["seconds"], s["calls"], s["counted"],
                            codes=dict(s["codes"])))
            print(json.dumps(rows[-1]), flush=True)
        for r in rows:
            r["startupApiCalls"] = {f"{v} {res}": c for (v, res), c in sorted(startup.items())}
    except BaseException:
        print(f"the activator's log ({mode}), its end:\n{act.log.read_text()[-3000:]}", file=sys.stderr)
        raise
    finally:
        act.stop()
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    out = []
    for phase in ("held", "steady"):
        for n in sorted({r["concurrency"] for r in rows}):
            base = next(r for r in rows if (r["mode"], r["phase"], r["concurrency"]) == (MODES[0], phase, n))
            new = next(r for r in rows if (r["mode"], r["phase"], r["concurrency"]) == (MODES[1], phase, n))
            out.append({"phase": phase, "concurrency": n,
                        "requestsPerSecondCachedOverReads": round(new["requestsPerSecond"] / base["requestsPerSecond"], 2),
                        "apiCallsPerRequest": [base["apiCallsPerRequest"], new["apiCallsPerRequest"]],
                        "apiReadsPerRequest": [base["apiReadsPerRequest"], new["apiReadsPerRequest"]]})
    return out


def table(rows: list[dict], rat: list[dict]) -> str:
    lines = ["| phase | N | mode | requests | requests/s | API calls / request (reads) | counter agrees | mean hold s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['concurrency']} | {r['mode']} | {r['requests']} | {r['requestsPerSecond']} | "
                     f"{r['apiCallsPerRequest']} ({r['apiReadsPerRequest']}) | {r['activatorCounterAgrees']} | "
                     f"{r.get('meanHoldSeconds', '')} |")
    lines += ["", "| phase | N | requests/s cached / per-request reads | API calls / request: reads -> cached |",
              "|---|---|---|---|"]
    for x in rat:
        lines.append(f"| {x['phase']} | {x['concurrency']} | {x['requestsPerSecondCachedOverReads']} | "
                     f"{x['apiCallsPerRequest'][0]} -> {x['apiCallsPerRequest'][1]} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,100", help="held (and steady) requests at once, comma-separated")
    ap.add_argument("--rounds", type=int, default=5, help="held bursts per concurrency and mode")
    ap.add_argument("--start-seconds", type=float, default=1.0, help="the stand-in pod's start, from the wake")
    ap.add_argument("--steady-seconds", type=float, default=5.0)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 and 10, one round, 0.5 s steady")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for a in ("--api", "--port", "--tenant-port", "--metrics-port", "--backend-port"):
        ap.add_argument(a, help=argparse.SUPPRESS, type=str if a == "--api" else int)
    ap.add_argument("--no-cache", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.quick:
        args.concurrency, args.rounds, args.start_seconds, args.steady_seconds = "1,10", 1, 0.3, 0.5
    args.concurrency = [int(x) for x in str(args.concurrency).split(",")]
    t0 = time.monotonic()
    api = StandInApi(args.start_seconds)
    be = backend()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="activator-burst-") as tmp:
        try:
            for mode in MODES:
                rows += run_mode(api, be.server_address[1], mode, args, Path(tmp))
        finally:
            api.close()
            be.shutdown()
    rat = ratios(rows)
    print(table(rows, rat))
    out = {"command": " ".join([Path(sys.executable).name, "bench/activator_burst.py", *sys.argv[1:]]),
           "settings": {"concurrency": args.concurrency, "rounds": args.rounds, "startSeconds": args.start_seconds,
                        "steadySeconds": args.steady_seconds},
           "machine": {"cpus": os.cpu_count(), "loadAverageAtEnd": [round(x, 2) for x in os.getloadavg()]},
           "seconds": round(time.monotonic() - t0, 1), "rows": rows, "ratios": rat}
    print(f"{out['seconds']} s; load average at the end {out['machine']['loadAverageAtEnd']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    bad = [r for r in rows if not r["activatorCounterAgrees"] or set(r["codes"]) != {"200"} or r.get("notHeld")]
    if bad:
        print(f"check: {len(bad)} row(s) with a counter that disagrees, a non-200 answer or a request not held",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
