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
