"""The GPU-architecture-aware planner: which format, dtype, KV-cache dtype, tensor-parallel size
and length each GPU pool serves a model with — pure functions, no cluster access.

The operator calls::

    pools = pools_from_nodes(node_dicts)                 # Node objects from the API server
    shape = shape_from_config(config_json_dict)          # or load_model_shape(path)
    request = PlanRequest.from_spec(effective_spec, policy.spec, default_served_model_name=name)
    status.plan = plan(shape, pools, request)            # a fewerbits_api PlanStatus
    errors = check_vllm_args(spec.serving.extraArgs)     # [] when vLLM would accept them
"""

from fewerbits_operator.planner.catalog import CATALOG, GPUPool, GPUSpec, lookup_product, pool_from_product, pool_name, pools_from_nodes
from fewerbits_operator.planner.rules import (
    PlanRequest,
    compute_dtype,
    estimate_weights,
    kernel_support,
    kv_cache_dtype,
    plan,
    plan_pool,
    pool_targeted,
    unmatched_targets,
)
from fewerbits_operator.planner.shape import ModelConfigError, ModelShape, load_model_shape, shape_from_config
from fewerbits_operator.planner.vllm_args import VLLM_VERSION, check_vllm_args, vllm_arg_spec

__all__ = [
    "CATALOG",
    "VLLM_VERSION",
    "check_vllm_args",
    "vllm_arg_spec",
    "GPUPool",
    "GPUSpec",
    "ModelConfigError",
    "ModelShape",
    "PlanRequest",
    "compute_dtype",
    "estimate_weights",
    "kernel_support",
    "kv_cache_dtype",
    "load_model_shape",
    "lookup_product",
    "plan",
    "plan_pool",
    "pool_from_product",
    "pool_name",
    "pool_targeted",
    "pools_from_nodes",
    "shape_from_config",
    "unmatched_targets",
]
