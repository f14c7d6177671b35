"""Pure tests of the image -> local command map (no cluster)."""

from __future__ import annotations

import sys

from e2e import workloads


def test_quantjob_image_runs_the_module_with_container_args():
    rule = workloads.rule_for("ghcr.io/fewerbits/fewerbits-quantjob:0.1.0", workloads.default_rules())
    assert rule.kind == "module"
    assert workloads.local_argv(rule, None, ["run"]) == [sys.executable, "-m", "fewerbits_quantjob", "run"]
    # A container command replaces the entrypoint, as in Docker; `python` means this interpreter.
    assert workloads.local_argv(rule, ["python", "-m", "x"], ["a"]) == [sys.executable, "-m", "x", "a"]


def test_unknown_images_are_left_to_kwok():
    assert workloads.rule_for("nginx:1.29", workloads.default_rules()) is None


def test_vllm_arguments_become_simulator_arguments():
    v = workloads.parse_vllm_args(["vllm", "serve", "/models/k", "--served-model-name", "a", "b",
                                   "--port=8001", "--max-num-seqs", "16", "--tensor-parallel-size", "2"])
    assert (v.served_model_names, v.port, v.max_num_seqs) == (["a", "b"], 8001, 16)
    argv = workloads.sim_argv("/bin/sim", v, 4242)
    assert argv[:5] == ["/bin/sim", "--port", "4242", "--model", "a"]
    assert "--fake-metrics" in argv  # so POST /admin/config can change them
    assert "--force-dummy-tokenizer" in argv and "--tensor-parallel-size" not in argv
    assert workloads.parse_vllm_args(["--model", "org/m"]).served_model_names == ["org/m"]


def test_kwok_exclusion_selects_only_unowned_pods():
    expr = workloads.kwok_exclusion(workloads.default_rules())
    assert expr["operator"] == "In" and expr["values"] == ["false"]
    assert "fewerbits-quantjob" in expr["key"] and "vllm/vllm-openai" in expr["key"]


def test_pod_runs_do_not_shadow_thread_internals():
    """PodRun is a threading.Thread; a method named like one of Thread's private ones (it once had
    `_stop(c, grace)`) breaks is_alive() on a finished run, and with it the runner's watch loop."""
    import threading

    from e2e.podrunner import PodRun

    shadowed = {n for n in vars(PodRun) if n.startswith("_") and not n.startswith("__") and hasattr(threading.Thread, n)}
    assert not shadowed


def test_the_cpu_vllm_image_runs_the_containers_own_command_with_the_images_python():
    rules = workloads.default_rules()
    assert workloads.rule_for("fewerbits-test/vllm-cpu:1", rules).kind == "vllm-cpu"
    assert workloads.rule_for("fewerbits-test/python:1", rules).kind == "command"
    # What the operator renders: the launch wrapper, then `vllm serve <model dir>` and its arguments.
    rendered = ["python3", "-m", "fewerbits_runtime", "launch", "--manifest", "/m/k/m.json", "--node-cc", "9.0",
                "--", "vllm", "serve", "/m/k", "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "q",
                "--kv-cache-dtype", "fp8", "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.9"]
    argv = workloads.vllm_cpu_argv(rendered[:2], rendered[2:], "/venv/bin/python")
    assert argv == ["/venv/bin/python", *rendered[1:]]  # the launcher gets the argv untouched
    v = workloads.parse_vllm_args(rendered)
    assert (v.model, v.served_model_names, v.port) == ("/m/k", ["q"], 8000)


def test_the_cpu_stand_in_changes_only_what_it_lists():
    from e2e import vllm_cpu

    vllm_argv = ["serve", "/m/k", "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "q",
                 "--kv-cache-dtype", "fp8", "--tensor-parallel-size", "2", "--gpu-memory-utilization=0.9",
                 "--max-model-len", "256", "--enforce-eager"]
    out = vllm_cpu.cpu_argv(vllm_argv, "10.244.0.7", {})
    assert out == ["serve", "/m/k", "--port", "8000", "--served-model-name", "q", "--kv-cache-dtype", "fp8",
                   "--max-model-len", "256", "--enforce-eager", "--host", "10.244.0.7",
                   "--kv-cache-memory-bytes", str(vllm_cpu.DEFAULT_KV_CACHE_BYTES)]
    # A size the command (extraArgs) or VLLM_CPU_KVCACHE_SPACE gives is kept, never replaced.
    sized = vllm_cpu.cpu_argv(["--model", "/m", "--kv-cache-memory-bytes", "1048576"], "10.0.0.1", {})
    assert sized == ["serve", "/m", "--kv-cache-memory-bytes", "1048576", "--host", "10.0.0.1", "--enforce-eager"]
    # Pipeline-parallel stages are traced, not eager: the CPU runner makes a later stage's buffers in
    # its compile warm-up.
    staged = vllm_cpu.cpu_argv(["serve", "/m", "--pipeline-parallel-size", "2", "--headless"], "10.0.0.2", {})
    assert "--enforce-eager" not in staged and staged[:2] == ["serve", "/m"]
    assert staged[staged.index("--compilation-config") + 1] == vllm_cpu.EAGER_TRACE
    assert "--kv-cache-memory-bytes" not in vllm_cpu.cpu_argv(["--model", "/m"], "10.0.0.1", {"VLLM_CPU_KVCACHE_SPACE": "1"})
    # Every change is listed in CPU_STAND_IN (the one place the harness's CPU translation is named).
    assert set(vllm_cpu.DROPPED_FLAGS) | {"--host", "--enforce-eager", "--compilation-config"} <= set(vllm_cpu.CPU_STAND_IN)
    env = vllm_cpu.cpu_env({"A": "1"}, "/pods/p")
    assert env == {"A": "1", "VLLM_TARGET_DEVICE": "cpu", "VLLM_CACHE_ROOT": "/pods/p/vllm-cache"}
    assert set(env) - {"A"} <= set(vllm_cpu.CPU_STAND_IN)


def test_the_operators_endpoint_picker_runs_the_built_binary_on_free_ports():
    from fewerbits_operator.base.settings import OperatorSettings

    rule = workloads.rule_for(OperatorSettings().epp_image, workloads.default_rules())
    assert rule is not None and rule.kind == "epp"
    free = iter(range(41000, 41010))
    argv, ports = workloads.epp_argv("/bin/epp", ["--pool-name", "m", "--grpc-port", "9002", "--metrics-port=9090"],
                                     lambda: next(free))
    # Each listening port moved (the picker binds every interface), the defaults too; the rest kept.
    assert argv == ["/bin/epp", "--pool-name", "m", "--grpc-port", "41000", "--metrics-port", "41001",
                    "--grpc-health-port", "41002"]
    assert ports == {9002: 41000, 9090: 41001, 9003: 41002}


def test_a_ready_container_goes_unready_only_after_failure_threshold_probes_in_a_row(tmp_path):
    """The pod runner keeps readiness as the kubelet does: a ready server that fails one probe (slow
    on a loaded machine) stays ready; `failureThreshold` failures in a row make it unready, one
    success ready again; between periods it is not probed."""
    import http.server
    import subprocess
    import threading

    from e2e.podrunner import Container, PodRun

    state = {"code": 200, "hits": 0}

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            state["hits"] += 1
            self.send_response(state["code"])
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proc = subprocess.Popen(["sleep", "60"])
    try:
        probe = {"httpGet": {"path": "/health", "port": server.server_address[1]}, "periodSeconds": 5,
                 "failureThreshold": 3}
        c = Container({"name": "srv", "readinessProbe": probe}, None, False)
        c.proc = proc
        run = PodRun.__new__(PodRun)
        threading.Thread.__init__(run)  # only what _readiness reads; no runner, no API server
        run.ip, run.ns, run.name = "127.0.0.1", "ns", "p"

        def probe_now() -> bool:
            c.next_probe = 0.0  # the period has passed
            c.ready = run._readiness(c)
            return c.ready

        assert probe_now() and state["hits"] == 1
        state["code"] = 500
        assert run._readiness(c) and state["hits"] == 1  # within the period: not probed
        assert [probe_now() for _ in range(3)] == [True, True, False] and state["hits"] == 4
        assert not probe_now()  # unready: probed every pass until it answers
        state["code"] = 200
        assert probe_now() and c.probe_failures == 0
    finally:
        proc.kill()
        proc.wait()
        server.shutdown()
