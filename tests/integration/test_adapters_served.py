"""LoRA adapters end to end on REAL vLLM (issue 43): each adapter is judged on the base each pool
serves, published by the Job, fetched and verified by the serving pod's init container like an
artifact, loaded by vLLM at start (`--lora-modules`), and answers completions under its own name
where it passed; where it failed, vLLM does not know the name (404) and the base still serves.

The pods run `fewerbits-test/vllm-cpu`: vLLM's CPU build behind the real launcher, the stand-in for
a GPU node (e2e/vllm_cpu.py). The two test adapters (tests/testmodel/adapters.py, trained here with
peft) are `sound` and `damaged`: the damaged one scores as the sound one on the 16-bit base, and
loses about 1.2% on an fp8-dynamic base and about 6% on a w4a16-gptq one (docs/adapters.md).

Three pools: fp8-dynamic (H100), 16-bit (L4, through a policy's formatByGPUFamily) and, where this
CPU's vLLM has the kernel, w4a16-gptq (A100, the same policy). vLLM's CPU build has no w4a16
kernel below AVX-512 and cannot serve LoRA over w8a8-int8 at all (docs/adapters.md), so on an
AVX2 CPU (or FEWERBITS_CPU_CAPABILITY=AVX2) fp8-dynamic is the one quantized format served with
adapters. The damaged adapter's own gate is 0.6% (the model's default 3% would pass its +1.2% on
fp8-dynamic; with this test's small calibration its w4a16-gptq loss is about 2%): the Job refuses
it on each quantized pool and passes it on the 16-bit one, where it has nothing to judge; the sound
one passes everywhere. The 16-bit pool's Job measures no adapter: it loads the files a quantized pool's Job
published (one content key for each adapter, whichever Job read it), so it first serves the base
alone and then rolls to load them: its nodes have two GPUs, room for the surge pod.

The serving canary is on: each pool's canary pod loads every adapter published for it and the
canary Job measures each through vLLM under its name against the Job's 16-bit figure. Where the
stand-in serves an FP8 KV cache (AVX-512), the damaged adapter loses about 1.8% through vLLM on the
16-bit pool, which the Job (transformers, 16-bit KV cache) cannot see: the canary refuses it there
too. The test asserts each pool's outcome from the figures measured through vLLM.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest
from kubernetes import client

from e2e import vllm_cpu
from fewerbits_api.base import GROUP, VERSION

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]

IMAGE = "fewerbits-test/vllm-cpu:1"
H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-80GB"
L4 = "NVIDIA-L4"
HARNESS_CPU = vllm_cpu.this_cpu(dict(os.environ))
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
GATES = {"sound": 50.0, "damaged": 0.6}
"""Each adapter's maxPerplexityIncreasePercent: the model's (50%) and the damaged one's own."""


def _upload_adapters(s3, bucket: str) -> str:
    """Both adapters and their evaluation text (the play they were not trained on) in MinIO."""
    from tests.testmodel import paragraphs
    from tests.testmodel.adapters import adapter_eval_text, build_adapter

    c = s3.client()
    c.create_bucket(Bucket=bucket)
    for kind in ("sound", "damaged"):
        for name in ADAPTER_FILES:
            c.upload_file(str(build_adapter(kind) / name), bucket, f"{kind}/{name}")
    body = "".join(json.dumps({"text": t}) + "\n" for t in paragraphs(adapter_eval_text())).encode()
    c.put_object(Bucket=bucket, Key="plays-eval.jsonl", Body=body)
    return f"s3://{bucket}/plays-eval.jsonl"


def _complete(ip: str, model: str) -> tuple[int, dict]:
    body = json.dumps({"model": model, "prompt": "ROSALIND. Now tell me", "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://{ip}:8000/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _ready(pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def _serving_pod(core, namespace: str, model: str, pool: str, loads: list[str]):
    """The pool's ready pod whose vLLM was started with exactly ``loads`` (adapter names), or None."""
    for p in core.list_namespaced_pod(namespace, label_selector=f"fewerbits.io/model={model},"
                                                                f"fewerbits.io/variant={pool}").items:
        if not _ready(p) or p.metadata.deletion_timestamp:
            continue
        command = p.spec.containers[0].command
        names = sorted(m.split("=")[0] for m in command[command.index("--lora-modules") + 1:]
                       if "=" in m and not m.startswith("-")) if "--lora-modules" in command else []
        if names == sorted(loads):
            return p
    return None


def test_adapters_are_served_on_real_vllm_where_they_passed_on_that_pools_base(
        cluster, gpu_pool, namespace, models, model_spec, s3_secret):
    custom = client.CustomObjectsApi(cluster.api_client())
    core = client.CoreV1Api(cluster.api_client())
    gptq = HARNESS_CPU.wna16
    nodes = [*gpu_pool("h100", H100), *gpu_pool("l4", L4, gpus_per_node=2), *(gpu_pool("a100", A100) if gptq else [])]
    targets = [{"nodeSelector": {"kubernetes.io/hostname": n}} for n in nodes]
    policy = f"adapters-{namespace}"
    custom.create_cluster_custom_object(GROUP, VERSION, "quantizationpolicies", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "QuantizationPolicy", "metadata": {"name": policy},
        "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                 "formatByGPUFamily": {"ada-lovelace": "none", **({"ampere": "w4a16-gptq"} if gptq else {})}}})
    try:
        _run(cluster, core, namespace, models, model_spec, s3_secret, targets, gptq)
    finally:
        custom.delete_cluster_custom_object(GROUP, VERSION, "quantizationpolicies", policy)


def _run(cluster, core, namespace, models, model_spec, s3_secret, targets, gptq):
    bucket = f"{namespace}-adapters"
    eval_set = _upload_adapters(cluster.s3, bucket)
    source = {"endpoint": cluster.s3.endpoint, "credentialsSecret": s3_secret}
    gate = {"evalDataset": eval_set, "evalSamples": 16}
    adapters = [{"name": "sound", "source": {"uri": f"s3://{bucket}/sound", **source}, "gate": gate},
                {"name": "damaged", "source": {"uri": f"s3://{bucket}/damaged", **source},
                 "gate": {**gate, "maxPerplexityIncreasePercent": GATES["damaged"]}}]
    # 128-token windows (the Job's evaluation length is the calibration's), as docs/adapters.md measured.
    spec = model_spec(quantization={"calibration": {"samples": 16, "maxSeqLength": 128},
                                    "qualityGate": {"maxPerplexityIncreasePercent": GATES["sound"], "evalSamples": 8}},
                      serving={"maxModelLen": 256, "image": IMAGE, "targets": targets,
                               # One request at a time: vLLM's CPU LoRA kernel (punica_cpu) dies on a batch of
                               # several prefills asking for prompt logprobs (docs/adapters.md), a GPU does not.
                               "canary": {"enabled": True, "limits": {"maxRequests": 128, "concurrency": 1}}},
                      adapters=adapters)
    models.apply(namespace, "tales", spec)
    models.wait_condition(namespace, "tales", "AdaptersServed", timeout=1200)

    status = models.get(namespace, "tales")["status"]
    pools = {v["pool"]: v["format"] for v in status["plan"]["variants"]}
    quantized = ["fp8-dynamic", *(["w4a16-gptq"] if gptq else [])]
    assert sorted(pools.values()) == sorted([*quantized, "none"]), pools
    verdicts = {(a["name"], pools[p["variant"]]): p for a in status["adapters"] for p in a["pools"]}
    served_through = {(m["name"].split(":", 1)[1], pools[s["variant"]]): m for s in status["serving"]
                      for m in (s.get("canary") or {}).get("metrics") or [] if m["kind"] == "adapter"}
    print("\n" + "\n".join(f"{n} on {f}: {p['state']} {p.get('increasePercent')} served={p['served']} {p['reason']}"
                            for (n, f), p in sorted(verdicts.items())))
    # Every adapter published for a pool was measured through vLLM on that pool's canary.
    assert set(served_through) == set(verdicts), (sorted(served_through), sorted(verdicts))
    for (name, fmt), p in verdicts.items():
        m = served_through[(name, fmt)]
        through_vllm = (m["served"] / m["base"] - 1) * 100
        job_refused = name == "damaged" and fmt != "none"
        canary_refused = not job_refused and through_vllm > GATES[name]
        assert p["state"] == ("Failed" if job_refused or canary_refused else "Passed"), (name, fmt, through_vllm, p)
        assert p["served"] is not (job_refused or canary_refused), (name, fmt, p)
        assert canary_refused is ("refused through vLLM on the canary" in p["reason"]), p
    for fmt in quantized:
        sound, damaged = verdicts[("sound", fmt)], verdicts[("damaged", fmt)]
        assert damaged["increasePercent"] > 0.6 and damaged["baselinePerplexity"] < 1.05 * sound["baselinePerplexity"]
        assert abs(sound["increasePercent"]) < 0.6 and sound["perplexity"] > 1
    keys = {name: {p["adapterKey"] for (n, _), p in verdicts.items() if n == name} for name in ("sound", "damaged")}
    assert all(len(k) == 1 and None not in k for k in keys.values()), keys  # one content key, whichever Job
    pool_of = {fmt: pool for pool, fmt in pools.items()}
    models.wait_events(namespace, "tales", {"AdapterGateFailed"})
    failed = [e.message for e in models.events(namespace, "tales") if e.reason == "AdapterGateFailed"]
    assert all(any("damaged" in m and pool_of[f] in m for m in failed) for f in quantized), failed

    for fmt, pool in pool_of.items():
        loads = sorted(n for (n, f), p in verdicts.items() if f == fmt and p["served"])
        pod = models.wait(f"pool {pool}'s pod serving {loads}",
                          lambda pool=pool, loads=loads: _serving_pod(core, namespace, "tales", pool, loads),
                          timeout=600, namespace=namespace, name="tales")
        fetch = pod.spec.init_containers[0].args
        assert sorted(fetch[i + 1] for i, a in enumerate(fetch) if a == "--adapter") == \
            sorted(next(iter(keys[n])) for n in loads)
        command = pod.spec.containers[0].command
        assert "--enable-lora" in command and command[command.index("--max-lora-rank") + 1] == "8"
        ip = pod.status.pod_ip
        for name in loads:  # each adapter answers under its own name, and the base under its own
            code, answer = _complete(ip, name)
            if not (code == 200 and answer["model"] == name and answer["choices"][0]["text"]):
                errors = [line for line in cluster.pod_logs(namespace, pod.metadata.name, "vllm").splitlines()
                          if "Error" in line][-5:]
                raise AssertionError(f"pool {pool}, adapter {name}: HTTP {code} {answer} from pod {pod.metadata.name} "
                                     f"at {ip}; its vLLM's errors: {errors}")
        code, answer = _complete(ip, "tales")
        assert code == 200 and answer["choices"][0]["text"], answer
        if "damaged" not in loads:  # not loaded where a gate refused it: vLLM does not know the name
            code, answer = _complete(ip, "damaged")
            assert code == 404, (code, answer)
        print(f"\npool {pool} ({fmt}): serves {', '.join(loads)}; " + "; ".join(
            f"{n} Job {p['increasePercent']:+.2f}%, through vLLM on the canary "
            f"{(served_through[(n, f)]['served'] / served_through[(n, f)]['base'] - 1) * 100:+.2f}% ({p['state']})"
            for (n, f), p in sorted(verdicts.items()) if f == fmt))
    served = models.condition(namespace, "tales", "AdaptersServed")
    assert served["status"] == "True" and "refused by its gate: damaged" in served["message"], served
