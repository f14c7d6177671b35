"""Load checkpoints into vLLM's own model classes with vLLM's own weight loader, on a CPU.

Runs in the vLLM virtual environment (tools/vllm_check/setup.sh), never in the project's: it
imports only the standard library, torch and vllm. For each checkpoint directory it:

1. builds the engine configuration the way ``vllm serve <dir> --dtype bfloat16`` does
   (``EngineArgs.create_engine_config``: architecture resolution, ``quantization_config`` →
   vLLM's quantization method, with vLLM's own verification of both);
2. initialises vLLM's distributed state for one process (gloo) and instantiates the model class
   vLLM resolved, under that configuration (``initialize_model``: every layer's quantization
   method and scheme creates its parameters with the shapes and dtypes it expects);
3. runs ``DefaultModelLoader.load_weights`` (the model's own ``load_weights`` over the
   checkpoint's safetensors) with vLLM's strict tracking on (``enable_weights_track``: every
   parameter vLLM created must be filled from the checkpoint, or vLLM raises);
4. checks on top that every tensor of the checkpoint reached a parameter's weight loader (none
   silently dropped) and that integer and FP8 tensors arrived with exactly the dtype of the
   parameter vLLM created for them (floating scales may be cast, as vLLM's loaders do).

Not run: ``process_weights_after_loading`` (repacking for Marlin/CUTLASS/Machete kernels, FP8
scale handling for the GPU GEMMs, MLA weight absorption), the forward pass and KV-cache
allocation: those need vLLM's CUDA kernels (``vllm._C``), which a CPU machine cannot load. See
tools/vllm_check/NOTES.md.

    python load_check.py --json out.json DIR[@CC] [DIR[@CC] ...]    # CC: 9.0, 8.0...
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import time
import traceback

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

# Checkpoint tensors vLLM skips on purpose, each with where it does so.
EXPECTED_SKIPS = (
    ("rotary_emb.inv_freq", "recomputed by vLLM's rotary embedding"),
)


BACKENDS = {k: v for k, v in (("linear_backend", os.environ.get("VLLM_CHECK_LINEAR_BACKEND", "")),
                                ("moe_backend", os.environ.get("VLLM_CHECK_MOE_BACKEND", ""))) if v}
"""``--linear-backend`` / ``--moe-backend`` for the check (default: vLLM's auto choice)."""
CAPABILITY: list = [None]
"""The compute capability vLLM's platform reports while one checkpoint is checked (see main)."""


UNREAD_PARAMETERS = {
    # vLLM 0.33's CompressedTensorsW4A4Nvfp4MoEMethod registers activation global scales even for
    # weight-only NVFP4A16 checkpoints (use_a16), which carry none; with use_a16 the kernel
    # format conversion (convert_to_nvfp4_moe_kernel_format(..., use_a16=True)) does not use them.
    ("CompressedTensorsW4A4Nvfp4MoEMethod", "w13_input_global_scale"): "use_a16",
    ("CompressedTensorsW4A4Nvfp4MoEMethod", "w2_input_global_scale"): "use_a16",
}
"""(quantization method, parameter) -> the method attribute that must be true for vLLM to leave
the parameter unread; such a parameter may stay unfilled (each row lists them)."""


def _unread(module, param: str) -> bool:
    qm = getattr(module, "quant_method", None)
    attr = UNREAD_PARAMETERS.get((type(qm).__name__, param))
    return bool(attr and getattr(qm, attr, False))


def _storage_key(t) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 — a tensor without storage (meta) cannot be tracked
        return -1


def patch_cpu_only_kernel_gates() -> list[str]:
    """Let layer construction pick vLLM's CPU FP8 block GEMM kernel on a CPU without AMX.

    vLLM 0.33 chooses a GEMM kernel while it builds an FP8-block Linear (Fp8LinearMethod /
    CompressedTensorsW8A8Fp8.create_weights → init_fp8_linear_kernel); on the CPU platform the only
    candidates need Intel AMX tiles, so construction raises "Failed to find a kernel" on this
    machine. The kernel object is used only by process_weights_after_loading and the forward
    pass, neither of which this check runs; the parameters are created by the quantization method
    itself. So the hardware gate is lifted and the run says so (``patched`` in each result)."""
    import torch
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as cpu_kernels

    # The MoE oracles (CPUExpertsInt4 and friends) gate on the same hardware probe.
    torch.cpu._is_amx_tile_supported = lambda: True
    patched = ["torch.cpu._is_amx_tile_supported"]

    # NVFP4 Linear: the CPU platform lists no kernel at all; vLLM's own emulation kernel
    # (dequantize to BF16, `--linear-backend emulation` on CUDA) is offered to it.
    from vllm.model_executor.kernels import linear as linear_kernels
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.platforms.interface import PlatformEnum

    linear_kernels._POSSIBLE_NVFP4_KERNELS.setdefault(PlatformEnum.CPU, []).append(EmulationNvFp4LinearKernel)
    patched.append("_POSSIBLE_NVFP4_KERNELS[CPU] += EmulationNvFp4LinearKernel")
    # NVFP4A16 (weight-only) forces the FP4 Marlin kernel below compute capability 10.0/10.3 with
    # CuTe DSL; Marlin's availability probe needs CUDA ops.
    from vllm.model_executor.kernels.linear.nvfp4.marlin import MarlinNvFp4LinearKernel

    MarlinNvFp4LinearKernel.is_supported = classmethod(lambda cls, compute_capability=None: (True, None))
    patched.append("MarlinNvFp4LinearKernel.is_supported")

    # W4A16 MoE with zero points (AWQ): no CPU backend takes them; vLLM's emulation backend is
    # appended to the CPU's list and its device gate lifted.
    from vllm.model_executor.layers.fused_moe.experts import int4_emulation_moe
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16

    original_backends = int_wna16._get_priority_backends
    int_wna16._get_priority_backends = lambda: [*original_backends(), int_wna16.WNA16MoEBackend.EMULATION]
    int4_emulation_moe.Int4EmulationTritonExperts._supports_current_device = staticmethod(lambda: True)
    patched += ["int_wna16 CPU backends += EMULATION", "Int4EmulationTritonExperts._supports_current_device"]
    # Int8 MoE with grouped top-k routing (DeepSeek), NVFP4 and NVFP4A16 MoE: no CPU backend takes
    # them, and the experts a GPU would use (Triton, Humming, Marlin, NVFP4 emulation) are gated
    # on a CUDA device. Their gates are lifted; which one vLLM's oracle then picks is in `methods`.
    import importlib

    for module, name in (("triton_moe", "TritonExperts"),
                         ("nvfp4_emulation_moe", "Nvfp4QuantizationEmulationTritonExperts"),
                         ("marlin_moe", "MarlinExperts"),
                         ("fused_humming_moe", "HummingGroupedExperts"),
                         ("fused_humming_moe", "BatchedHummingGroupedExperts"),
                         ("fused_humming_moe", "HummingIndexedExperts")):
        mod = importlib.import_module(f"vllm.model_executor.layers.fused_moe.experts.{module}")
        getattr(mod, name)._supports_current_device = staticmethod(lambda: True)
        patched.append(f"{name}._supports_current_device")

    # The compute capability: None on a CPU, which vLLM's scheme selection treats as "any"
    # except for exact matches (W4AFP8 needs 9.0 exactly). Each checkpoint is checked with the
    # capability of the GPU family that runs its format natively (main: DIR@major.minor).
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import DeviceCapability

    def get_device_capability(device_id: int = 0):
        return DeviceCapability(*CAPABILITY[0]) if CAPABILITY[0] else None

    CpuPlatform.get_device_capability = classmethod(lambda cls, device_id=0: get_device_capability(device_id))
    patched.append("CpuPlatform.get_device_capability")
    for name in ("CPUFp8BlockScaledMMKernel", "CPUFp8W8A8BlockScaledMMKernel"):
        cls = getattr(cpu_kernels, name, None)
        if cls is not None:
            cls.is_supported = classmethod(lambda cls, compute_capability=None: (True, None))
            patched.append(f"{name}.is_supported")
    return patched


def check_one(path: str, distributed_ready: list[bool]) -> dict:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import destroy_model_parallel, init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    started = time.monotonic()
    engine_args = EngineArgs(model=path, dtype="bfloat16", enforce_eager=True, max_model_len=256,
                             load_format="safetensors", skip_tokenizer_init=True,
                             model_loader_extra_config={"enable_weights_track": True},
                             **BACKENDS)
    cfg = engine_args.create_engine_config()
    out: dict = {"path": path, "architecture": cfg.model_config.architectures[0] if cfg.model_config.architectures else None,
                 "quantization": cfg.model_config.quantization}
    with set_current_vllm_config(cfg):
        if not distributed_ready[0]:
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method="tcp://127.0.0.1:29561", backend="gloo")
            distributed_ready[0] = True
        # Model-parallel groups depend on the model (the expert-parallel group exists only for
        # a mixture of experts): rebuilt for each checkpoint, as one vLLM process per model would.
        destroy_model_parallel()
        initialize_model_parallel(1, 1)
        with set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=cfg, model_config=cfg.model_config)
        out["model_class"] = type(model).__name__

        # What vLLM built per layer: its quantization method (and compressed-tensors scheme).
        methods: dict[str, int] = {}
        for _, module in model.named_modules():
            qm = getattr(module, "quant_method", None)
            if qm is None:
                continue
            scheme = getattr(module, "scheme", None)
            label = type(qm).__name__ + (f"/{type(scheme).__name__}" if scheme is not None else "")
            methods[label] = methods.get(label, 0) + 1
        out["methods"] = dict(sorted(methods.items()))

        # Every parameter's weight loader records what reaches it.
        reached: set[int] = set()
        dtype_errors: list[str] = []
        casts: dict[str, int] = {}

        def wrap(pname, loader):
            @functools.wraps(loader)
            def recording_loader(*args, **kwargs):
                # Loaders differ in signature (param, loaded_weight, shard_id, expert_id...), and
                # some are called with keywords: the parameter is the first nn.Parameter, the
                # checkpoint tensor the first other tensor.
                values = [*args, *kwargs.values()]
                p = next((v for v in values if isinstance(v, torch.nn.Parameter)), None)
                loaded_weight = next((v for v in values if isinstance(v, torch.Tensor)
                                      and not isinstance(v, torch.nn.Parameter)), None)
                if p is not None and loaded_weight is not None:
                    reached.add(_storage_key(loaded_weight))
                    # Packed integers and FP8 must arrive exactly as vLLM created the parameter; a
                    # floating parameter takes a cast, as vLLM's loaders do (scales bf16 -> fp32,
                    # compressed-tensors' int64 weight_shape into the bf16 parameter vLLM makes).
                    exact = not p.dtype.is_floating_point or p.dtype.itemsize == 1
                    if loaded_weight.dtype != p.dtype:
                        if exact:
                            dtype_errors.append(f"{pname}: checkpoint {loaded_weight.dtype} into {p.dtype}")
                        else:
                            k = f"{loaded_weight.dtype}->{p.dtype}"
                            casts[k] = casts.get(k, 0) + 1
                return loader(*args, **kwargs)
            return recording_loader

        for pname, param in model.named_parameters():
            param.weight_loader = wrap(pname, getattr(param, "weight_loader", default_weight_loader))

        loader = get_model_loader(cfg.load_config)
        yielded: dict[str, int] = {}
        original = loader.get_all_weights

        def recording_weights(model_config, model_):
            for name, tensor in original(model_config, model_):
                yielded[name] = _storage_key(tensor)
                yield name, tensor

        loader.get_all_weights = recording_weights
        unfilled_ok: list[str] = []
        try:
            loader.load_weights(model, cfg.model_config)  # vLLM's strict check: every parameter filled
        except ValueError as e:
            # vLLM names the parameters nothing filled; some are ones its method creates but never
            # reads for this checkpoint (UNREAD_PARAMETERS). Any other one fails the row.
            if "were not initialized from checkpoint" not in str(e):
                raise
            names = re.findall(r"'([^']+)'", str(e))
            modules = dict(model.named_modules())
            bad = [n for n in names if not _unread(modules.get(n.rsplit(".", 1)[0]), n.rsplit(".", 1)[1])]
            if bad or not names:
                raise
            unfilled_ok = names

    dropped = sorted(n for n, k in yielded.items() if k not in reached)
    unexpected = [n for n in dropped if not any(n.endswith(s) for s, _ in EXPECTED_SKIPS)]
    out["tensors"] = len(yielded)
    out["parameters"] = sum(1 for _ in model.named_parameters())
    out["float_casts"] = casts
    if unfilled_ok:
        out["unfilled_unread"] = unfilled_ok
    out["seconds"] = round(time.monotonic() - started, 1)
    problems = []
    if unexpected:
        problems.append(f"{len(unexpected)} checkpoint tensors reached no parameter: {', '.join(unexpected[:6])}"
                        + (" ..." if len(unexpected) > 6 else ""))
    if dtype_errors:
        problems.append(f"{len(dtype_errors)} tensors with the wrong dtype: {'; '.join(dtype_errors[:4])}")
    out["result"] = "fails" if problems else "loads"
    out["detail"] = ("; ".join(problems) if problems else
                     f"{len(yielded)} tensors into {out['parameters']} parameters; "
                     + ", ".join(f"{k}×{v}" for k, v in out["methods"].items())
                     + (f"; {len(unfilled_ok)} parameters vLLM creates but does not read for this checkpoint "
                        "left unfilled (UNREAD_PARAMETERS)" if unfilled_ok else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    import vllm

    patched = patch_cpu_only_kernel_gates()
    results = []
    ready = [False]
    for spec in args.dirs:
        d, _, cc = spec.partition("@")
        CAPABILITY[0] = tuple(int(x) for x in cc.split(".")) if cc else None
        try:
            r = check_one(d, ready)
        except Exception as e:  # noqa: BLE001 — vLLM's error is the result
            tb = traceback.extract_tb(e.__traceback__)
            where = next((f"{os.path.relpath(f.filename, os.path.dirname(vllm.__file__))}:{f.lineno}"
                          for f in reversed(tb) if "/vllm/" in f.filename), "")
            r = {"path": d, "result": "fails", "detail": f"{type(e).__name__}: {str(e)[:600]}"
                 + (f" (vllm/{where})" if where else "")}
        r["vllm"] = vllm.__version__
        r["path"] = d
        r["capability"] = cc or None
        r["patched"] = patched
        results.append(r)
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if all(r["result"] == "loads" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
