"""When the demo's and the tests' waits for Ready give up early (e2e/failfast.py), pure."""

from __future__ import annotations

from e2e.failfast import HOLD_SECONDS, FailFast


def cond(type_: str, status: str, reason: str, message: str = "") -> dict:
    return {"type": type_, "status": status, "reason": reason, "message": message}


PODS_FAILING = cond("Ready", "False", "PodsFailing", "nothing is served; h100: pod p container vllm: exit 1, "
                                                     "VllmFailed: NotImplementedError: FP8 KV cache on CPU")


def test_a_failure_stops_the_wait_once_it_has_held_a_minute():
    f = FailFast()
    assert f.check([PODS_FAILING], now=100.0) is None
    assert f.check([PODS_FAILING], now=100.0 + HOLD_SECONDS - 1) is None
    why = f.check([PODS_FAILING], now=100.0 + HOLD_SECONDS)
    assert why.startswith("Ready=False PodsFailing for 60 s: nothing is served") and "FP8 KV cache" in why


def test_a_failure_that_passes_starts_its_clock_again():
    f = FailFast(hold=10)
    f.check([PODS_FAILING], now=0.0)
    assert f.check([cond("Ready", "False", "NoReplicasReady")], now=9.0) is None  # recovered: forgotten
    assert f.check([PODS_FAILING], now=12.0) is None
    assert f.check([PODS_FAILING], now=22.0) is not None


def test_progress_and_waiting_reasons_never_stop_the_wait():
    f = FailFast(hold=0)
    waiting = [cond("Quantized", "False", "JobRunning"), cond("Ready", "False", "NoReplicasReady"),
               cond("Deployed", "False", "RollingOut"), cond("ServingQualityPassed", "False", "CanaryEvaluating"),
               cond("Quantized", "False", "StorageUnavailable"), cond("Ready", "True", "AllVariantsReady")]
    assert f.check(waiting, now=1e6) is None


def test_each_lasting_failure_stops_it_naming_its_condition():
    for c in (cond("QualityGatePassed", "False", "GateFailed", "perplexity +80%"),
              cond("Quantized", "False", "JobFailed", "stage calibrate"),
              cond("Accepted", "False", "InvalidSpec", "spec.source.uri"),
              cond("ServingQualityPassed", "False", "CanaryFailed", "rougeL")):
        f = FailFast(hold=5)
        f.check([c], now=0.0)
        assert f.check([c], now=5.0).startswith(f"{c['type']}=False {c['reason']} for 5 s: {c['message']}")


def test_the_demo_stops_on_a_lasting_failure_and_keeps_the_pods_logs(tmp_path, monkeypatch):
    """e2e/demo.py's wait: a model whose serving pod keeps failing raises ModelFailed with the model's
    message (the demo then prints it with the kept logs' paths and exits 1), not a timeout."""
    import pytest
    from kubernetes import client

    from e2e import demo
    from e2e.failfast import ModelFailed

    obj = {"status": {"conditions": [PODS_FAILING]}}

    class Objects:
        def get_namespaced_custom_object(self, *args):
            return obj

    class Cluster:
        state_dir = tmp_path

        def api_client(self):
            return None

    monkeypatch.setattr(client, "CustomObjectsApi", lambda api: Objects())
    lines: list[str] = []
    with pytest.raises(ModelFailed, match="Ready=False PodsFailing for 0 s: nothing is served; h100: .*FP8 KV cache"):
        demo.wait_ready(Cluster(), "demo", "tiny-llama", timeout=60, out=lines.append, hold=0)
    assert any("PodsFailing" in ln for ln in lines)  # shown as it changed, before the stop
    pod = tmp_path / "pods" / "demo_tiny-llama-h100-abc_uid1"
    pod.mkdir(parents=True)
    (pod / "vllm.log").write_text("NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX.\n")
    (kept,) = demo.keep_pod_logs(Cluster(), "demo")
    assert kept.name == "demo_tiny-llama-h100-abc_vllm.log" and "AVX-512" in kept.read_text()
