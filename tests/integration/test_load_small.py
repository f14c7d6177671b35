"""The load command (bench/load_models.py) at CI size: 24 models over 4 namespaces on their own
control plane, one real quantization, all Ready, then 40 s at rest with not one write by the
operator's identity (read from the API server's audit log) apart from its Lease renewals, a spec
change that writes only status, no list of pods or EndpointSlices at rest (the loops beside
reconcile read indexes), and a restart that reconciles every model once. The 300-model run is the documented
command `bench/load_models.py` (bench/README.md)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.integration.operator_harness import REPO

pytestmark = pytest.mark.cluster


def _load_module():
    spec = importlib.util.spec_from_file_location("load_models", REPO / "bench" / "load_models.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["load_models"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_models_get_ready_and_the_operator_writes_nothing_at_rest(tmp_path):
    load = _load_module()
    lines: list[str] = []
    # The activator Service set as the chart sets it: its path loop (atzero.py) runs every 2 s.
    env = {"FEWERBITS_ACTIVATOR_SERVICE": f"{load.OPERATOR_NS}/{load.RELEASE}-fewerbits-activator"}
    r = load.run_load(models=24, namespaces=4, window_seconds=40, ready_timeout=300, seed_timeout=600,
                      state_dir=tmp_path / "load", progress=lines.append, operator_env=env)
    report = load.table(r) + "\n" + "\n".join(lines[-20:])
    print(report)
    assert r.ready_all, report
    assert r.writes_in_window == {} and r.writes_per_minute == 0, report
    # A spec change writes the model's status and nothing else: no kopf annotation, no finalizer.
    assert set(r.spec_change_writes) == {"patch quantizedmodels/status"}, report
    # Elected on its Lease as the chart runs it: at rest the Lease is the only thing written.
    assert r.lease_requests_per_minute.get("update leases", 0) > 0, report
    assert r.start_seconds is not None, report
    # The operator was seen at all (the identity filter matches its requests), and at rest it
    # reads, but far less than once per model per second.
    assert r.requests_per_minute.get("total", 0) > 0, report
    assert r.requests_per_minute["total"] < 24 * 60, report
    # The loops beside reconcile (the activator path every 2 s, the metrics probe, the keep-awake)
    # read kopf's indexes and a watch: not one list of pods or EndpointSlices at rest.
    listed = {k: v for k, v in r.requests_per_minute_by_resource.items()
              if k in ("list pods", "list endpointslices")}
    assert listed == {}, report
    assert r.reconcile_seconds_run["count"] >= 24, report
    assert r.rss_mib["peak"] and r.rss_mib["peak"] > 10, report
