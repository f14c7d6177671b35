"""The local demo: fewerbits end to end on a real control plane built from Go modules.

    python -m e2e.demo [--keep] [--timeout 1200]

1. starts the control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok, the pod
   runner, MinIO) with one GPU pool (H100 ×8) and a CPU node;
2. installs fewerbits with the real Helm from `charts/fewerbits`; the operator's pod is run by the
   pod runner as `python -m fewerbits_operator` under its own ServiceAccount token, so the chart's
   RBAC is what it has;
3. uploads the small test model (trained briefly on a fixed text) to MinIO and applies a
   QuantizedModel for it;
4. shows each condition as it changes until `Ready` (the quantization Job is the real
   llm-compressor run, on this CPU; the serving pod runs the real launcher and real vLLM, its CPU
   build standing in for the H100: image `fewerbits-test/vllm-cpu`, e2e/vllm_cpu.py). A failure
   that holds a minute (a serving pod failing over and over, e2e/failfast.py) stops the demo with
   the model's message and the pods' logs kept, exit 1;
5. prints `kubectl get qm`, the endpoint, what the stand-in translated for this CPU (an FP8 KV cache
   is served as the 16-bit cache on a CPU without AVX-512; FEWERBITS_CPU_CAPABILITY=AVX2 forces
   that path), a completion vLLM generated from the artifact the Job just produced, and one line of
   the pod's /metrics;
6. tears everything down (unless --keep: then `python -m e2e.cluster down` stops it).

With --gitops, step 2 and 3 go through Argo CD instead (e2e/gitops.py, e2e/addons/argocd.py): it
builds a local git repository with the chart, a QuantizationPolicy and the model, applies one root
Application, and shows each Application's sync and health as Argo CD computes them (the model's
with the health check fewerbits ships) beside the model's conditions, until the models'
Application is Synced and Healthy.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from e2e import cluster as cluster_mod
from e2e import failfast

REPO = Path(__file__).resolve().parents[1]
GROUP, VERSION, PLURAL = "fewerbits.io", "v1alpha1", "quantizedmodels"
MODEL_BUCKET, ARTIFACT_BUCKET = "base-models", "artifacts"
MODEL_PREFIX = "fewerbits-test/tiny-llama"


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def upload_test_model(c: cluster_mod.Cluster) -> str:
    """Build (cached) the tiny test model and put it in MinIO; returns its s3:// URI."""
    from tests.testmodel import build_test_model

    local = Path(build_test_model())
    s3 = c.s3.client()
    for bucket in (MODEL_BUCKET, ARTIFACT_BUCKET):
        try:
            s3.create_bucket(Bucket=bucket)
        except (s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists):
            pass
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        s3.upload_file(str(path), MODEL_BUCKET, f"{MODEL_PREFIX}/{path.relative_to(local)}")
    return f"s3://{MODEL_BUCKET}/{MODEL_PREFIX}"


def chart_values(watch_namespaces: list[str], crds_enabled: bool) -> dict[str, Any]:
    """The chart's values on this harness: namespaced RBAC for the given namespaces, small requests,
    short resyncs, one replica of each Deployment on free ports. Shared by ``helm install`` here and
    by the GitOps flow (e2e/gitops.py), where Argo CD renders the chart with them."""
    free = cluster_mod.procs.free_port
    return {
        "crds": {"enabled": crds_enabled}, "rbac": {"scope": "namespaced"}, "watchNamespaces": watch_namespaces,
        "config": {"resyncSeconds": 3,
                   "quantizationJob": {"cpuRequest": "1", "memoryRequest": "1Gi"},
                   "vllm": {"cpuRequest": "1", "memoryRequest": "1Gi"}},
        # The operator process shares this host's network: take free ports.
        "metrics": {"port": free()}, "health": {"port": free()},
        # One replica (the chart's default is 2): the pod runner runs pods on this host's network,
        # where two would take the same port. It still elects itself on the Lease, under
        # the chart's RBAC; tests/integration/test_failover.py runs two.
        "replicas": 1,
        # Likewise one activator replica (the chart's default is 2), on free ports.
        "activator": {"replicas": 1, "port": free(), "metricsPort": free()},
    }


def install_chart(c: cluster_mod.Cluster, release_ns: str, watch_namespaces: list[str],
                  extra: list[str] | None = None) -> None:
    """`helm install` of the chart, namespaced RBAC for the given namespaces, restricted PSS enforced
    on the operator's namespace."""
    from kubernetes import client

    core = client.CoreV1Api(c.api_client())
    core.create_namespace({"metadata": {"name": release_ns, "labels": {
        "pod-security.kubernetes.io/enforce": "restricted"}}})
    # CRDs applied earlier by other means (a test session's kubectl apply) are not Helm's to adopt.
    crds = {x.metadata.name for x in client.ApiextensionsV1Api(c.api_client()).list_custom_resource_definition().items}
    values = chart_values(watch_namespaces, crds_enabled="quantizedmodels.fewerbits.io" not in crds)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="fewerbits-values-") as f:
        json.dump(values, f)  # JSON is YAML
        f.flush()
        c.helm("install", "fewerbits", str(REPO / "charts" / "fewerbits"), "-n", release_ns, "--wait",
               "--timeout", "180s", "-f", f.name, *(extra or []))


def test_model_spec(s3_endpoint: str, source_uri: str, secret: str, storage_prefix: str,
                    **overrides: Any) -> dict[str, Any]:
    """A QuantizedModel spec for the tiny test model in the harness's MinIO: quick calibration, a
    loose gate, short context, no autoscaling, and the serving canary off: these models are served
    by the vLLM simulator, whose text is random, so a canary verdict on it would mean nothing
    (tests/integration/test_canary.py serves the model for real to judge it; docs/canary.md).
    ``overrides`` replace top-level parts; a dict is merged one level deep
    (``quantization={"format": "fp8-dynamic"}`` keeps the calibration)."""
    spec: dict[str, Any] = {
        "source": {"uri": source_uri, "endpoint": s3_endpoint, "credentialsSecret": secret},
        "quantization": {"format": "auto", "calibration": {"samples": 16, "maxSeqLength": 64},
                         "qualityGate": {"maxPerplexityIncreasePercent": 50, "evalSamples": 8}},
        "storage": {"uri": f"s3://{ARTIFACT_BUCKET}/{storage_prefix}", "endpoint": s3_endpoint,
                    "credentialsSecret": secret},
        "serving": {"maxModelLen": 256, "canary": {"enabled": False}},
        "autoscaling": {"enabled": False},
    }
    return merge_spec(spec, **overrides)


def merge_spec(spec: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """``spec`` with top-level parts replaced; a dict is merged one level deep."""
    out = dict(spec)
    for key, value in overrides.items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


DEMO_VLLM_IMAGE = "fewerbits-test/vllm-cpu:1"
"""Served by real vLLM (its CPU build) through the real launcher: e2e/workloads.py rule `vllm-cpu`."""


def model_manifest(c: cluster_mod.Cluster, namespace: str, name: str, source_uri: str, secret: str,
                   real_vllm: bool = False) -> dict[str, Any]:
    """The demo's QuantizedModel. ``real_vllm``: served by vLLM's CPU build, one replica (a real
    server is 3.4 GB here, so no autoscaling); otherwise by the simulator, autoscaled 1-3."""
    serving = {"serving": {"image": DEMO_VLLM_IMAGE}} if real_vllm else {
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3}}
    spec = test_model_spec(c.s3.endpoint, source_uri, secret, "quantized",
                           quantization={"qualityGate": {"maxPerplexityIncreasePercent": 5, "evalSamples": 8}},
                           **serving)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "QuantizedModel",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def create_namespace_with_secret(c: cluster_mod.Cluster, namespace: str, secret: str) -> None:
    from kubernetes import client

    client.CoreV1Api(c.api_client()).create_namespace({"metadata": {"name": namespace}})
    create_s3_secret(c, namespace, secret)


def create_s3_secret(c: cluster_mod.Cluster, namespace: str, secret: str) -> None:
    """A Secret with the S3 server's credentials, in the keys QuantizedModel Secrets use."""
    from kubernetes import client

    client.CoreV1Api(c.api_client()).create_namespaced_secret(namespace, {
        "metadata": {"name": secret},
        "data": {"AWS_ACCESS_KEY_ID": base64.b64encode(c.s3.access_key.encode()).decode(),
                 "AWS_SECRET_ACCESS_KEY": base64.b64encode(c.s3.secret_key.encode()).decode()},
    })


@dataclass
class Progress:
    """Prints each condition when its status or reason changes."""

    seen: dict[str, tuple[str, str]]
    out: Callable[[str], None] = say

    def show(self, obj: dict[str, Any]) -> None:
        for cond in (obj.get("status") or {}).get("conditions") or []:
            key = (cond["status"], cond["reason"])
            if self.seen.get(cond["type"]) != key:
                self.seen[cond["type"]] = key
                self.out(f"  {cond['type']:<18} {cond['status']:<6} {cond['reason']:<18} {cond.get('message', '')[:110]}")


def wait_ready(c: cluster_mod.Cluster, namespace: str, name: str, timeout: float,
               out: Callable[[str], None] = say, hold: float = failfast.HOLD_SECONDS) -> dict[str, Any]:
    """The model once Ready, its conditions shown as they change. Raises ModelFailed as soon as it
    has shown a failure that does not pass by itself for ``hold`` seconds (e2e/failfast.py)."""
    from kubernetes import client

    custom = client.CustomObjectsApi(c.api_client())
    progress = Progress({}, out)
    stop = failfast.FailFast(hold)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        progress.show(obj)
        conditions = (obj.get("status") or {}).get("conditions") or []
        if any(x["type"] == "Ready" and x["status"] == "True" for x in conditions):
            return obj
        if why := stop.check(conditions, time.monotonic()):
            raise failfast.ModelFailed(f"{namespace}/{name}: {why}")
        time.sleep(1)
    raise TimeoutError(f"{namespace}/{name} not Ready after {timeout:.0f}s")


def keep_pod_logs(c: cluster_mod.Cluster, namespace: str) -> list[Path]:
    """Copies of the logs of ``namespace``'s pods in a folder that outlives the cluster's teardown."""
    import shutil

    kept = Path(tempfile.mkdtemp(prefix="fewerbits-demo-logs-"))
    out = []
    for log in sorted((c.state_dir / "pods").glob(f"{namespace}_*/*.log")):
        dest = kept / f"{log.parent.name.rsplit('_', 1)[0]}_{log.name}"
        shutil.copyfile(log, dest)
        out.append(dest)
    return out


def stand_in_lines(log: str) -> list[str]:
    """What the vLLM stand-in said about this CPU (its level, each translation), from a pod's log."""
    from e2e import vllm_cpu

    return [ln.strip() for ln in log.splitlines() if ln.startswith(vllm_cpu.MARK) and "vLLM's CPU build for" not in ln]


def serving_pod_ip(c: cluster_mod.Cluster, namespace: str, model: str) -> str:
    """A ready serving pod's IP (no kube-proxy here: pods are reached at their IPs)."""
    from kubernetes import client

    pods = client.CoreV1Api(c.api_client()).list_namespaced_pod(
        namespace, label_selector=f"fewerbits.io/model={model},app.kubernetes.io/component=server").items
    pod = next(p for p in pods if p.status.pod_ip and any(
        x.type == "Ready" and x.status == "True" for x in p.status.conditions or []))
    return pod.status.pod_ip


def pod_name_at(c: cluster_mod.Cluster, namespace: str, ip: str) -> str:
    """The name of the pod at ``ip``."""
    from kubernetes import client

    pods = client.CoreV1Api(c.api_client()).list_namespaced_pod(namespace).items
    return next(p.metadata.name for p in pods if p.status.pod_ip == ip)


def completion(c: cluster_mod.Cluster, namespace: str, model: str) -> tuple[str, dict[str, Any]]:
    """Send a completion to one ready serving pod of the model."""
    return completion_at(serving_pod_ip(c, namespace, model), model)


def completion_at(ip: str, model: str) -> tuple[str, dict[str, Any]]:
    """A greedy completion from the serving pod at ``ip``."""
    url = f"http://{ip}:8000/v1/completions"
    body = {"model": model, "prompt": "The river ran", "max_tokens": 8, "temperature": 0}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return url, json.load(r)


def metrics_line(ip: str, name: str = "vllm:generation_tokens_total") -> str:
    """The first sample of one metric from the serving pod's /metrics."""
    with urllib.request.urlopen(f"http://{ip}:8000/metrics", timeout=30) as r:
        text = r.read().decode()
    return next((ln for ln in text.splitlines() if ln.startswith(name)), f"{name}: not in /metrics")


def deploy_with_helm(c: cluster_mod.Cluster, timeout: float, started: list[Callable[[], None]]) -> None:
    """Helm installs the chart; kubectl applies the model; its conditions shown until Ready."""
    say("installing fewerbits with Helm (operator runs under its own ServiceAccount)")
    install_chart(c, "fewerbits-system", ["demo"])
    say("uploading the test model to the S3 server")
    source = upload_test_model(c)
    c.apply(model_manifest(c, "demo", "tiny-llama", source, "s3-credentials", real_vllm=True))
    say("applied QuantizedModel demo/tiny-llama; waiting for Ready:")
    wait_ready(c, "demo", "tiny-llama", timeout)


def deploy_with_argocd(c: cluster_mod.Cluster, timeout: float, started: list[Callable[[], None]]) -> None:
    """Argo CD syncs the chart, a policy and the model from a local git repository (e2e/gitops.py);
    the Applications' sync and health and the model's conditions shown as they change. Argo CD's
    stop goes to ``started``."""
    from e2e import gitops
    from e2e.addons import argocd

    say("starting Argo CD (repo server, application controller, Redis)")
    argo = argocd.start(c)
    started.append(lambda: argocd.stop(argo))
    say(f"Argo CD up in {argo.startup_seconds:.1f}s; uploading the test model to the S3 server")
    source = upload_test_model(c)
    repo = gitops.GitRepo(c.state_dir / "platform-repo")
    model = gitops.model(c, "tiny-llama", source, "s3-credentials",
                         quantization={"qualityGate": {"maxPerplexityIncreasePercent": 5, "evalSamples": 8}},
                         serving={"image": DEMO_VLLM_IMAGE})
    first = gitops.write_layout(c, repo, "demo", "fewerbits-system", [model], "s3-credentials")
    say(f"git repository {repo.url}: {first[:8]} {repo.git('log', '-1', '--format=%s')}")
    for line in repo.git("ls-files", "apps", "models").splitlines():
        say(f"  {line}")
    c.apply(gitops.root_app(repo))
    say("applied the root Application (app of apps); Argo CD syncs the rest from git:")
    watch, progress, stop = gitops.Watch(c), Progress({}), failfast.FailFast(failfast.HOLD_SECONDS)
    from kubernetes import client

    custom = client.CustomObjectsApi(c.api_client())
    deadline = time.monotonic() + timeout
    while True:
        for name in (gitops.ROOT_APP, gitops.CHART_APP, gitops.MODELS_APP):
            st = watch.state(name)
        try:
            obj = custom.get_namespaced_custom_object(GROUP, VERSION, "demo", PLURAL, "tiny-llama")
        except client.exceptions.ApiException as e:
            if e.status != 404:  # not synced yet
                raise
            obj = {}
        progress.show(obj)
        if gitops.synced_at(first)(st) and st.health == "Healthy":
            break
        if why := stop.check((obj.get("status") or {}).get("conditions") or [], time.monotonic()):
            raise failfast.ModelFailed(f"demo/tiny-llama: {why}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"Application {gitops.MODELS_APP} not Synced and Healthy after {timeout:.0f}s")
        time.sleep(1)
    print()
    print(c.kubectl("get", f"applications.{argocd.GROUP}", "-n", argocd.NAMESPACE).stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m e2e.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--keep", action="store_true", help="leave the cluster running (stop: python -m e2e.cluster down)")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds to wait for Ready")
    ap.add_argument("--gitops", action="store_true",
                    help="drive it with Argo CD from a local git repository (e2e/gitops.py) instead of Helm and kubectl")
    a = ap.parse_args(argv)

    state = cluster_mod.default_state_dir() if a.keep else Path(tempfile.mkdtemp(prefix="fewerbits-demo-"))
    from e2e import vllm_cpu

    try:
        say(f"vLLM's CPU build serves as this CPU: {vllm_cpu.this_cpu(dict(os.environ)).describe()}")
    except vllm_cpu.CapabilityError as e:
        say(f"stopped: {e}")
        return 2
    say(f"starting the control plane (state {state})")
    c = cluster_mod.Cluster(state, with_s3=True, with_sim=False, detach=a.keep)
    c.start()
    ok = False
    stoppers: list[Callable[[], None]] = []
    try:
        say(f"control plane up in {c.timings['total']:.1f}s; adding a GPU pool H100x8 and a CPU node")
        c.add_gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
        c.add_cpu_node("cpu-0")
        create_namespace_with_secret(c, "demo", "s3-credentials")
        deploy = deploy_with_argocd if a.gitops else deploy_with_helm
        try:
            deploy(c, a.timeout, stoppers)
        except failfast.ModelFailed as e:
            say(f"stopped: {e}")
            for log in keep_pod_logs(c, "demo"):
                say(f"  pod log: {log}")
            return 1
        print()
        print(c.kubectl("get", "qm", "-n", "demo", "-o", "wide").stdout)
        obj = json.loads(c.kubectl("get", "qm", "tiny-llama", "-n", "demo", "-o", "json").stdout)
        for v in obj["status"]["plan"]["variants"]:
            print(f"  {v['pool']:<22} {v['format']:<12} dtype={v['dtype']} kv={v['kvCacheDtype']} "
                  f"tp={v['tensorParallelSize']} ~{v['decodeTokensPerSecond']:.0f} tok/s (batch-1 estimate)")
        q = obj["status"]["artifacts"][0]["quality"]
        print(f"  quality: perplexity {q['baselinePerplexity']:.2f} -> {q['perplexity']:.2f} "
              f"({q['increasePercent']:+.3f}%, gate {q['maxIncreasePercent']:g}%)")
        print(f"  endpoint (in-cluster): {obj['status']['endpoint']}")
        ip = serving_pod_ip(c, "demo", "tiny-llama")
        for line in stand_in_lines(c.pod_logs("demo", pod_name_at(c, "demo", ip), "vllm")):
            print(f"  {line}")
        url, answer = completion_at(ip, "tiny-llama")
        print(f"  POST {url} (vLLM, serving the artifact the Job just produced) ->")
        print(f"  {answer['model']}: {answer['choices'][0]['text']!r} ({answer['usage']['completion_tokens']} tokens)")
        print(f"  GET http://{ip}:8000/metrics -> {metrics_line(ip)}")
        print()
        if a.keep:
            print(f"left running: export KUBECONFIG={c.kubeconfig}; stop with: python -m e2e.cluster down"
                  + (" (Argo CD stops with the demo; what it synced stays)" if a.gitops else ""))
        ok = True
        return 0
    finally:
        for stop in stoppers:
            stop()
        if not (a.keep and ok):
            say("tearing down")
            c.stop()


if __name__ == "__main__":
    sys.exit(main())
