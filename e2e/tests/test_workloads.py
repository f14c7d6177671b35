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


def test_the_cpu_vllm_image_runs_transformers_serve_on_the_directory_vllm_would_load():
    rules = workloads.default_rules()
    assert workloads.rule_for("fewerbits-test/vllm-cpu:1", rules).kind == "transformers"
    assert workloads.rule_for("fewerbits-test/python:1", rules).kind == "command"
    # What the operator renders: the launch wrapper, then `vllm serve <model dir>` and its arguments.
    v = workloads.parse_vllm_args(["python3", "-m", "fewerbits_runtime", "launch", "--manifest", "/models/k/m.json",
                                   "--", "vllm", "serve", "/models/k", "--host", "0.0.0.0", "--port", "8000",
                                   "--served-model-name", "q", "--kv-cache-dtype", "fp8"])
    assert (v.model, v.served_model_names, v.port) == ("/models/k", ["q"], 8000)
    argv = workloads.transformers_argv(v, "10.244.0.7")
    assert argv[0].endswith("/transformers") and argv[1:] == ["serve", "--host", "10.244.0.7", "--port", "8000",
                                                             "--device", "cpu", "q"]
