"""The streamed load's vLLM command line, judged by vLLM 0.33.0 itself.

    .venv/bin/python tools/vllm_check/stream_check.py render > argv.json      (project environment)
    $VENV/bin/python tools/vllm_check/stream_check.py check argv.json         (vLLM environment)

`render` prints what the operator renders after `vllm serve` for a model with
`spec.serving.loadFormat: stream`: a single-node Deployment's (``render_deployment``) and a
multi-node LeaderWorkerSet's leader and headless worker (``render_lws``; LeaderWorkerSet's
``$(LWS_*)`` variables replaced by a host and a rank as Kubernetes would). `check` parses each with
the parser `vllm serve` uses, builds the engine arguments and their load config, and asks vLLM's
loader registry for the loader: it must be ``RunaiModelStreamerLoader`` and the model the ``s3://``
URI. Exit 1 otherwise.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def render() -> int:
    for p in ("crds", "operator", "runtime", ""):
        sys.path.insert(0, str(REPO / p))
    from fewerbits_api.quantizedmodel import PlanVariant, QuantizedModelSpec
    from fewerbits_operator.serving.lws import render_lws
    from fewerbits_operator.serving.render import Owner, render_deployment
    from fewerbits_operator.base.settings import OperatorSettings

    spec = QuantizedModelSpec.model_validate({
        "source": {"uri": "hf://meta-llama/Llama-3.1-8B", "revision": "0" * 40},
        "storage": {"uri": "s3://bkt/q", "endpoint": "http://minio.storage:9000", "credentialsSecret": "s3"},
        "serving": {"loadFormat": "stream"},
    })
    variant = PlanVariant(pool="h100", gpuProduct="NVIDIA-H100-80GB-HBM3", format="fp8-dynamic", kvCacheDtype="fp8",
                          dtype="bfloat16", tensorParallelSize=1, maxModelLen=8192, weightsGiB=8.0,
                          kvCacheTokens=100000, decodeTokensPerSecond=100.0)
    owner = Owner("llama", "ml", "0" * 8)
    d = render_deployment(owner, spec, variant, {}, "9.0", "f" * 64, 8 << 30, 1, OperatorSettings())
    multi = variant.model_copy(update={"tensorParallelSize": 8, "nodesPerReplica": 2})
    lws = render_lws(owner, spec, multi, {}, "9.0", "f" * 64, 8 << 30, 1, OperatorSettings())
    group = lws["spec"]["leaderWorkerTemplate"]
    out = {}
    for name, tpl in (("deployment", d["spec"]["template"]), ("lws-leader", group["leaderTemplate"]),
                      ("lws-worker", group["workerTemplate"])):
        cmd = tpl["spec"]["containers"][0]["command"]
        out[name] = [a.replace("$(LWS_LEADER_ADDRESS)", "llama-h100-0.llama-h100").replace("$(LWS_WORKER_INDEX)", "1")
                     for a in cmd[cmd.index("serve") + 1:]]
    print(json.dumps(out))
    return 0


def check(path: str) -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    doc = json.loads(Path(path).read_text())
    rc = 0
    for name, argv in (doc.items() if isinstance(doc, dict) else [("deployment", doc)]):
        model, rest = argv[0], argv[1:]  # `vllm serve MODEL`: the subcommand moves the positional to --model
        parser = make_arg_parser(FlexibleArgumentParser())
        parser.exit_on_error = False
        ns = parser.parse_args(["--model", model, *rest])
        load_config = EngineArgs.from_cli_args(ns).create_load_config()
        loader = type(get_model_loader(load_config)).__name__
        ok = ns.model == model and model.startswith("s3://") and loader == "RunaiModelStreamerLoader"
        if name.startswith("lws-"):  # the group's rendezvous reached vLLM's parser as flags, not as stray values
            ok = ok and ns.nnodes == 2 and ns.node_rank == (0 if name == "lws-leader" else 1) \
                and ns.headless == (name == "lws-worker") and ns.master_addr == "llama-h100-0.llama-h100"
        print(f"{'ok' if ok else 'FAILS'}: {name}: model {ns.model} load_format {load_config.load_format} "
              f"loader {loader}")
        rc |= 0 if ok else 1
    return rc


if __name__ == "__main__":
    sys.exit(render() if sys.argv[1:2] == ["render"] else check(sys.argv[2]))
