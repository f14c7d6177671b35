"""`fewerbits plan`: JSON and table output, exit codes, inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fewerbits_operator.cli.main import main

HERE = Path(__file__).parent
CONFIGS = HERE / "fixtures" / "model_configs"
LLAMA8 = str(CONFIGS / "llama-3.1-8b.json")
REPO = HERE.parents[1]

VARIANT_KEYS = {"pool", "gpuProduct", "family", "format", "kvCacheDtype", "dtype", "tensorParallelSize",
                "maxModelLen", "gpuMemoryUtilization", "weightsGiB", "kvCacheTokens", "decodeTokensPerSecond", "warnings", "vllmArgs", "servedAsIs", "nodesPerReplica",
                "lora", "adaptersRefused"}


def run(capsys, *argv):
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def gfd_node(name, product, count, family, major, minor, memory, unschedulable=False):
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {
            "nvidia.com/gpu.product": product, "nvidia.com/gpu.count": str(count),
            "nvidia.com/gpu.family": family, "nvidia.com/gpu.compute.major": str(major),
            "nvidia.com/gpu.compute.minor": str(minor), "nvidia.com/gpu.memory": str(memory)}},
        "spec": {"unschedulable": True} if unschedulable else {},
        "status": {"allocatable": {"nvidia.com/gpu": str(count)}},
    }


def test_json_output_has_exactly_the_documented_shape(capsys):
    code, out, err = run(capsys, "--model-config", LLAMA8, "--gpu", "NVIDIA-H100-80GB-HBM3:8",
                         "--gpu", "Tesla-T4:1", "--max-model-len", "8192", "-o", "json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert set(doc) == {"variants", "rejected", "ignore", "quantizationJobs"}
    by_pool = {v["pool"]: v for v in doc["variants"]}
    assert set(by_pool) == {"h100-80gb-hbm3-x8", "t4-x1"}
    for v in doc["variants"]:
        assert set(v) == VARIANT_KEYS
    h100 = by_pool["h100-80gb-hbm3-x8"]
    assert (h100["format"], h100["dtype"], h100["kvCacheDtype"], h100["maxModelLen"]) == ("fp8-dynamic", "bfloat16", "fp8", 8192)
    assert h100["vllmArgs"][:2] == ["--dtype", "bfloat16"]
    assert by_pool["t4-x1"]["dtype"] == "float16"


def test_json_rejections_have_pool_and_reason(capsys):
    code, out, _ = run(capsys, "--model-config", str(CONFIGS / "gemma-2-9b.json"), "--gpu", "Tesla-T4:1", "-o", "json")
    doc = json.loads(out)
    assert code == 1  # nothing can serve it
    assert doc["variants"] == []
    (r,) = doc["rejected"]
    assert set(r) == {"pool", "reason"} and "float16" in r["reason"]


def test_table_output_is_aligned_with_warnings_and_rejections_below(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # the table wraps to the terminal; a test worker may have none
    code, out, _ = run(capsys, "--model-config", str(CONFIGS / "qwen3-30b-a3b.json"),
                       "--gpu", "NVIDIA-L4:1", "--gpu", "NVIDIA-H100-80GB-HBM3:8", "--gpu", "Tesla-T4:1")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("Model qwen3-30b-a3b.json (qwen3_moe): 30.53B parameters, 3.35B active (128 experts, 8 per token)")
    header = next(i for i, ln in enumerate(lines) if ln.startswith("POOL"))
    rows = lines[header + 2: header + 4]
    assert rows[0].startswith("l4-x1") and "w4a16-awq" in rows[0]
    assert rows[1].startswith("h100-80gb-hbm3-x8") and "fp8-dynamic" in rows[1]
    # Columns line up: FORMAT starts at the same offset in the header and every row.
    col = lines[header].index("FORMAT")
    assert all(r[col:].split()[0] in ("w4a16-awq", "fp8-dynamic") for r in rows)
    warnings_at = lines.index("Warnings:")
    rejected_at = lines.index("Rejected pools:")
    assert header < warnings_at < rejected_at
    assert "stepped down to w4a16-awq" in out
    assert any(ln.startswith("  t4-x1:") for ln in lines[rejected_at:])
    assert "--tensor-parallel-size 1" in out


def test_nodes_file_as_kubectl_list_and_multi_doc(tmp_path, capsys):
    nodes = [
        gfd_node("h1", "NVIDIA-H100-80GB-HBM3", 8, "hopper", 9, 0, 81559),
        gfd_node("h2", "NVIDIA-H100-80GB-HBM3", 8, "hopper", 9, 0, 81559),
        gfd_node("b1", "NVIDIA-B200", 8, "blackwell", 10, 0, 183359, unschedulable=True),
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "cpu", "labels": {}}, "status": {}},
    ]
    as_list = tmp_path / "list.yaml"
    as_list.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": nodes}))
    code, out, _ = run(capsys, "--model-config", LLAMA8, "--nodes", str(as_list), "-o", "json")
    assert code == 0 and [v["pool"] for v in json.loads(out)["variants"]] == ["h100-80gb-hbm3-x8"]
    multi = tmp_path / "multi.yaml"
    multi.write_text(yaml.safe_dump_all(nodes[:3]))
    code, out, _ = run(capsys, "--model-config", LLAMA8, "--nodes", str(multi), "-o", "json")
    assert [v["pool"] for v in json.loads(out)["variants"]] == ["h100-80gb-hbm3-x8"]


def test_policy_applies(tmp_path, capsys):
    policy = yaml.safe_load((REPO / "crds/samples/platform-policy.yaml").read_text())
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    # The sample policy: ampere → w4a16-gptq, maxGPUsPerReplica 4.
    code, out, _ = run(capsys, "--model-config", LLAMA8, "--gpu", "NVIDIA-A100-SXM4-80GB:8", "--policy", str(path), "-o", "json")
    (v,) = json.loads(out)["variants"]
    assert v["format"] == "w4a16-gptq"
    code, out, _ = run(capsys, "--model-config", str(CONFIGS / "llama-3.1-70b.json"), "--gpu", "NVIDIA-L40S:8",
                       "--format", "none", "--max-model-len", "8192", "--policy", str(path), "-o", "json")
    (r,) = json.loads(out)["rejected"]
    assert "none is not allowed by the policy" in r["reason"]


def test_flags_override_defaults(capsys):
    code, out, _ = run(capsys, "--model-config", LLAMA8, "--gpu", "NVIDIA-H100-80GB-HBM3:8", "--format", "w4a16-awq",
                       "--kv-cache", "none", "--gpu-memory-utilization", "0.8", "--served-model-name", "llama", "-o", "json")
    (v,) = json.loads(out)["variants"]
    assert (v["format"], v["kvCacheDtype"]) == ("w4a16-awq", "auto")
    assert v["vllmArgs"][:2] == ["--served-model-name", "llama"] and "0.8" in v["vllmArgs"]


def test_without_pools_plans_for_the_catalog(capsys):
    code, out, _ = run(capsys, "--model-config", str(CONFIGS / "llama-3.2-1b.json"))
    assert code == 0 and "planning for every catalog GPU" in out
    assert "b200-x8" in out and "t4-x1" in out


def test_a_grace_hopper_and_a_product_given_by_its_facts_plan(capsys):
    code, out, _ = run(capsys, "--model-config", LLAMA8, "--gpu", "NVIDIA-GH200-480GB:1",
                       "--gpu", "NVIDIA-RTX-PRO-6000:2:96:12.0", "-o", "json")
    assert code == 0
    variants = {v["gpuProduct"]: v for v in json.loads(out)["variants"]}
    assert variants["NVIDIA-GH200-480GB"]["family"] == "hopper"
    custom = variants["NVIDIA-RTX-PRO-6000"]
    assert custom["family"] == "blackwell" and custom["pool"] == "rtx-pro-6000-x2"
    assert any("not in the catalog" in w for w in custom["warnings"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model-config", "/nonexistent/config.json", "--gpu", "NVIDIA-L4:1"], "no such file"),
        (["--model-config", LLAMA8, "--gpu", "NVIDIA-X999:1"], "unknown GPU product 'NVIDIA-X999'"),
        (["--model-config", LLAMA8, "--gpu", "NVIDIA-L4:many"], "expected PRODUCT:GPUS"),
        (["--model-config", LLAMA8, "--gpu", "NVIDIA-L4:0"], "expected PRODUCT:GPUS"),
        (["--model-config", LLAMA8, "--gpu", "NVIDIA-RTX-PRO-6000:4:96"], "then :MEMORY_GIB:CC for a product the catalog lacks"),
        (["--model-config", LLAMA8, "--gpu", "NVIDIA-RTX-PRO-6000:4:lots:12.0"], "MEMORY_GIB must be a number above 0"),
        (["--model-config", LLAMA8, "--gpu", "NVIDIA-RTX-PRO-6000:4:96:twelve"], "CC a compute capability MAJOR.MINOR"),
        (["--model-config", LLAMA8, "--gpu", "NVIDIA-RTX-PRO-6000:4:0:12.0"], "MEMORY_GIB must be a number above 0"),
        (["--model-config", LLAMA8, "--format", "int3"], "invalid choice: 'int3'"),
        (["--model-config", LLAMA8, "--max-model-len", "0"], "must be at least 1"),
        (["--model-config", LLAMA8, "--nodes", "/nonexistent/nodes.yaml"], "no such file"),
        (["--model-config", LLAMA8, "--policy", "/nonexistent/policy.yaml"], "no such file"),
    ],
)
def test_bad_input_exits_2_without_traceback(argv, message, capsys):
    try:
        code = main(["plan", *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err


def test_bad_files_exit_2(tmp_path, capsys):
    bad_config = tmp_path / "config.json"
    bad_config.write_text('{"model_type": "llama"}')
    code, _, err = run(capsys, "--model-config", str(bad_config), "--gpu", "NVIDIA-L4:1")
    assert code == 2 and "missing 'hidden_size'" in err
    empty_nodes = tmp_path / "nodes.yaml"
    empty_nodes.write_text(yaml.safe_dump({"kind": "List", "items": []}))
    code, _, err = run(capsys, "--model-config", LLAMA8, "--nodes", str(empty_nodes))
    assert code == 2 and "no GPU pools" in err
    bad_policy = tmp_path / "policy.yaml"
    bad_policy.write_text(yaml.safe_dump({"apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizationPolicy",
                                          "metadata": {"name": "p"}, "spec": {"rules": {"maxGPUsPerReplica": 0}}}))
    code, _, err = run(capsys, "--model-config", LLAMA8, "--policy", str(bad_policy))
    assert code == 2 and "spec.rules.maxGPUsPerReplica" in err
    not_policy = tmp_path / "other.yaml"
    not_policy.write_text("kind: ConfigMap\n")
    code, _, err = run(capsys, "--model-config", LLAMA8, "--policy", str(not_policy))
    assert code == 2 and "no QuantizationPolicy" in err


def _adapter(tmp_path, name: str, **config) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 16, "lora_alpha": 32, **config}))
    return f"{name}={folder}"


def test_adapters_are_checked_and_planned_per_pool(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    plays = _adapter(tmp_path, "plays", target_modules=["q_proj", "v_proj"])
    code, out, _ = run(capsys, "--model-config", LLAMA8, "--gpu", "NVIDIA-L4:1", "--adapter", plays)
    assert code == 0
    assert "LoRA adapters:\n  l4-x1: plays: --enable-lora --max-loras 1 --max-lora-rank 16 --max-cpu-loras 1;" in out
    code, out, _ = run(capsys, "--model-config", LLAMA8, "--gpu", "NVIDIA-L4:1", "--adapter", plays, "-o", "json")
    (v,) = json.loads(out)["variants"]
    assert v["lora"] == {"adapters": ["plays"], "maxLoras": 1, "maxLoraRank": 16, "maxCpuLoras": 1,
                         "gpuMemoryGiB": v["lora"]["gpuMemoryGiB"]} and v["adaptersRefused"] is None


def test_an_adapter_for_another_architecture_is_bad_input_naming_it(capsys, tmp_path):
    gpt2 = _adapter(tmp_path, "chat", target_modules=["c_attn"])
    code, out, err = run(capsys, "--model-config", LLAMA8, "--gpu", "NVIDIA-L4:1", "--adapter", gpt2)
    assert code == 2 and out == ""
    assert "--adapter chat: adapter_config.json: target_modules c_attn name no linear layer of this llama base" in err
    code, _, err = run(capsys, "--model-config", LLAMA8, "--gpu", "NVIDIA-L4:1", "--adapter", "no-path")
    assert code == 2 and "expected NAME=PATH" in err
