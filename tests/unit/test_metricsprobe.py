"""The routing loop's metrics probe: a pod without vLLM metrics behind an InferencePool is found
with autoscaling off (docs/routing.md, "Pods without metrics"); real /metrics servers on loopback,
the in-memory AutoscalerIO fake of the autoscaler's tests."""

from __future__ import annotations

from fewerbits_operator.autoscaler.loop import Autoscaler
from fewerbits_operator.autoscaler.metrics import DirectScrapeSource
from fewerbits_operator.runtime.metricsprobe import MetricsProbe, metrics_event, probed

from tests.unit.test_autoscaler_loop import FakeIO, servers  # noqa: F401 - the fixture

from prometheus_client import CollectorRegistry


OFF = {"enabled": False}


def routed(io: FakeIO, servers, model="m1", routing="inferencePool", autoscaling=OFF, n_pods=2):  # noqa: F811
    io.add_model(model, autoscaling)
    io.models[model]["spec"]["serving"] = {"routing": routing}
    io.add_deployment(model, "h100", n_pods)
    srvs = servers(n_pods)
    for i, s in enumerate(srvs):
        io.add_pod(model, "h100", f"{model}-h100-{i}", s.port)
    return srvs


def probe(io, autoscaler_running=True):
    return MetricsProbe(io, DirectScrapeSource(timeout=1.0), autoscaler_running=autoscaler_running)


def test_a_pod_without_metrics_is_found_with_autoscaling_off(servers):  # noqa: F811
    io = FakeIO()
    good, bare = routed(io, servers)
    good.set(0.3)
    bare.status = 404  # serves no /metrics (a wrong image, an old vLLM)
    p = probe(io)
    p.run_once()
    assert io.models["m1"]["status"]["serving"][0]["podsWithoutMetrics"] == 1  # what reconcile reads
    assert [r for _, r, _ in io.events] == ["MetricsUnavailable"]
    assert "1 of 2 ready pod(s)" in io.events[0][2]
    p.run_once()  # once per episode: no second event, no second write
    assert [r for _, r, _ in io.events] == ["MetricsUnavailable"]
    assert len(io.status_writes) == 1

    bare.status, _ = 200, bare.set(0.1)
    p.run_once()
    assert "podsWithoutMetrics" not in io.models["m1"]["status"]["serving"][0]
    assert [r for _, r, _ in io.events] == ["MetricsUnavailable", "MetricsRestored"]


def test_the_autoscaler_and_the_probe_do_not_both_scrape_a_model():
    auto = {"enabled": True, "minReplicas": 1, "maxReplicas": 3}
    io = FakeIO()
    io.add_model("scaled", auto)
    io.models["scaled"]["spec"]["serving"] = {"routing": "inferencePool"}
    io.add_model("fixed", OFF)
    io.models["fixed"]["spec"]["serving"] = {"routing": "inferencePool"}
    io.add_model("plain", OFF)  # the Service reads no metrics: nothing to route around
    assert [probed(m, autoscaler_running=True) for m in (io.models[n] for n in ("scaled", "fixed", "plain"))] \
        == [False, True, False]
    # The operator's autoscaler loop off: the autoscaled model's pods are probed too.
    assert probed(io.models["scaled"], autoscaler_running=False)


def test_with_autoscaling_on_the_autoscaler_alone_reports_and_the_probe_stays_quiet(servers):  # noqa: F811
    io = FakeIO()
    good, bare = routed(io, servers, autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 3})
    good.set(0.3)
    bare.status = 404
    p = probe(io)
    assert p.run_once() == []
    assert io.events == [] and io.status_writes == []
    Autoscaler(io, DirectScrapeSource(timeout=1.0), registry=CollectorRegistry()).run_once()
    assert [r for _, r, _ in io.events] == ["MetricsUnavailable"]
    assert io.models["m1"]["status"]["serving"][0]["podsWithoutMetrics"] == 1


def test_service_routed_models_are_not_scraped(servers):  # noqa: F811
    io = FakeIO()
    good, bare = routed(io, servers, routing="service")
    bare.status = 404
    assert probe(io).run_once() == []
    assert io.events == [] and io.status_writes == []


def test_a_failing_model_does_not_stop_the_others(servers):  # noqa: F811
    io = FakeIO()
    routed(io, servers, model="broken")
    good, bare = routed(io, servers, model="ok")
    good.set(0.3)
    bare.status = 404
    io.fail_pods_for.add("broken")
    found = probe(io).run_once()
    assert [(n, f.failures) for _, n, f in found] == [("ok", 1)]


def test_metrics_event_is_one_warning_then_one_restore():
    assert metrics_event("l4", 2, 1, unreported=False)[:2] == ("Warning", "MetricsUnavailable")
    assert metrics_event("l4", 2, 1, unreported=True) is None
    assert metrics_event("l4", 2, 0, unreported=True)[:2] == ("Normal", "MetricsRestored")
    assert metrics_event("l4", 2, 0, unreported=False) is None
    assert metrics_event("l4", 0, 0, unreported=True) is None  # no ready pod: nothing restored yet
