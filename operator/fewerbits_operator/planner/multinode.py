"""Replicas that span nodes: the layout and sizing the planner uses when no single node of a pool
holds the model.

vLLM's own guidance for a model too large for one node (docs "Distributed inference and
serving"): tensor parallel inside a node (the node's GPUs, over NVLink) and pipeline parallel
across nodes (one stage per node, over the slower network). That is the layout here:
``tensorParallelSize`` = the largest usable power of two up to the node's GPUs,
``nodesPerReplica`` = ``--pipeline-parallel-size`` = the fewest nodes (2 up to the pool's node
count) on which the weights and ``minConcurrentSequences`` × the length fit.

The processes are started with vLLM's multiprocessing executor across nodes (``--nnodes``,
``--node-rank``, ``--master-addr``, and ``--headless`` on the non-leader nodes; vLLM 0.33 picks
the ``mp`` backend by itself when ``--nnodes`` > 1), not Ray: no Ray head or cluster to start,
health-check and version-match in the serving image, one ``vllm serve`` per pod whose exit is the
pod's exit (so LeaderWorkerSet's group restart sees a failure directly), and the same argument
parser the single-node pods use (checked against vLLM 0.33's dump).

Sizing (an estimate, like the single-node one):

* Weights: pipeline stages split the decoder layers; the biggest stage holds ⌈layers/nodes⌉ of
  them, plus the embedding (first stage) or the LM head (last stage) — the larger of the two is
  charged to every stage. Each stage's share is split over its node's ``tensorParallelSize`` GPUs.
* KV cache: each stage holds the KV of its own layers, so a sequence's KV per GPU is the
  single-node figure × ⌈layers/nodes⌉/layers; vLLM sizes every stage to the same block count, so
  the biggest stage bounds the replica's tokens.
* Decode at batch 1 passes through the stages one after the other, each reading its share: the
  per-token time is that of the whole model read over ``tensorParallelSize`` GPUs (the
  single-node formula at the same TP), before network hops.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from fewerbits_api.formats import QuantFormat
from fewerbits_operator.planner import estimates as est
from fewerbits_operator.planner.lora import lora_bytes_per_gpu

if TYPE_CHECKING:  # pragma: no cover
    from fewerbits_operator.planner.catalog import GPUPool
    from fewerbits_operator.planner.estimates import Fit
    from fewerbits_operator.planner.rules import PlanRequest
    from fewerbits_operator.planner.shape import ModelShape

MAX_NODES_PER_REPLICA = 64
"""The CRD's bound on ``nodesPerReplica`` (a LeaderWorkerSet group of more pods is not planned)."""


def _stage_share(shape: ModelShape, nodes: int) -> float:
    """The share of the decoder layers the biggest of ``nodes`` pipeline stages holds."""
    return math.ceil(shape.num_layers / nodes) / shape.num_layers


def _edge_bytes(shape: ModelShape, weights_total: float) -> float:
    """Bytes of the larger of the embedding and the LM head (16-bit; never more than the model)."""
    return min(weights_total, 2.0 * max(shape.embed_params, shape.lm_head_params))


def stage_weight_bytes_per_gpu(shape: ModelShape, weights_total: float, tp: int, nodes: int) -> float:
    """Weight bytes on each GPU of the biggest pipeline stage (see the module docstring)."""
    edge = _edge_bytes(shape, weights_total)
    return ((weights_total - edge) * _stage_share(shape, nodes) + edge) / tp


def fit_across_nodes(shape: ModelShape, pool: GPUPool, fmt: QuantFormat, kv_dtype: str,
                     target_len: int | None, request: PlanRequest) -> Fit:
    """The fewest nodes (2 up to the pool's) on which ``fmt`` fits with tensor parallelism inside
    each node, or a Fit with ``tp=None`` whose reason carries the numbers across the pool."""
    weights = est.estimate_weights(shape, fmt, request.ignore)
    fmt_name = "16 bits (format none)" if fmt is QuantFormat.NONE else fmt.value
    mem = pool.memory_mib * 1024**2
    util = request.gpu_memory_utilization
    conc = request.min_concurrent_sequences
    limit = shape.max_model_len
    need_len = target_len if target_len is not None else min(limit, est.DEFAULT_MIN_MODEL_LEN)
    max_nodes = min(pool.node_count, MAX_NODES_PER_REPLICA, shape.num_layers)
    if max_nodes < 2:
        return est.Fit(fmt, None, weights, reason=(
            f"needs {est._gib(weights.total_bytes)} for weights at {fmt_name}, more than one node holds, and the pool "
            f"has {pool.node_count} node{'s' if pool.node_count != 1 else ''}: add nodes to span a replica across "
            "several (LeaderWorkerSet), use a format with fewer bits, or a pool with more GPU memory per node"),
            summary=f"{est._gib(weights.total_bytes)} of weights")
    tps = [tp for tp in reversed(est.tp_candidates(pool, None)) if not est._tp_blocker(shape, fmt, tp)]
    if not tps:
        return est.Fit(fmt, None, weights, reason=f"at {fmt_name} no tensor-parallel size up to {pool.gpus_per_node} "
                     "splits this model", summary="no tensor-parallel size")
    tp = tps[0]
    cap = request.max_gpus_per_replica
    kvb, in_flight = est._kv_bytes(kv_dtype), est.in_flight_tokens(pool)
    usable = mem * util - est.runtime_reserve_bytes(mem, tp)
    last_free = -math.inf
    for nodes in range(2, max_nodes + 1):
        if cap is not None and tp * nodes > cap:
            break
        free = (usable - stage_weight_bytes_per_gpu(shape, weights.total_bytes, tp, nodes)
                - lora_bytes_per_gpu(shape, request.lora, tp, nodes))
        last_free = free
        if free <= 0:
            continue
        share = _stage_share(shape, nodes)

        def seq_bytes(length: int) -> float:
            return shape.kv_bytes_per_sequence_per_gpu(tp, kvb, length, in_flight) * share

        if conc * seq_bytes(need_len) > free:
            continue
        if target_len is not None:
            return est.Fit(fmt, tp, weights, est._tokens_held(free, target_len, seq_bytes(target_len)), target_len,
                         nodes=nodes)
        length, lowered = est.longest_length(conc, seq_bytes, free, need_len, limit)
        return est.Fit(fmt, tp, weights, est._tokens_held(free, length, seq_bytes(length)), length,
                     lowered_len_from=lowered, nodes=nodes)
    return _no_fit_across(shape, pool, fmt, kv_dtype, request, weights, tp, usable, last_free, need_len, max_nodes)


def _no_fit_across(shape: ModelShape, pool: GPUPool, fmt: QuantFormat, kv_dtype: str, request: PlanRequest,
                   weights: est.WeightEstimate, tp: int, usable: float, last_free: float, need_len: int,
                   max_nodes: int) -> Fit:
    """Nothing fits across nodes: what the whole pool (or the policy's cap) offers against what is needed."""
    fmt_name = "16 bits (format none)" if fmt is QuantFormat.NONE else fmt.value
    cap = request.max_gpus_per_replica
    conc = request.min_concurrent_sequences
    kvb, in_flight = est._kv_bytes(kv_dtype), est.in_flight_tokens(pool)
    nodes = max_nodes if cap is None else max(1, min(max_nodes, cap // tp))
    per_gpu = usable
    total_usable = per_gpu * tp * nodes
    capped = f", capped at {cap} GPUs per replica by the policy's maxGPUsPerReplica" if cap is not None and cap // tp < max_nodes else ""
    if last_free <= 0:
        reason = (
            f"needs {est._gib(weights.total_bytes)} for weights at {fmt_name}; even across {nodes} nodes of the pool "
            f"({nodes} × {tp} × {pool.memory_gib:.1f} GiB GPUs{capped}) the biggest pipeline stage needs "
            f"{est._gib(stage_weight_bytes_per_gpu(shape, weights.total_bytes, tp, nodes))} per GPU of "
            f"{est._gib(per_gpu)} usable ({est._gib(total_usable)} usable in all); add nodes, use a format with fewer "
            "bits, or a smaller model")
        return est.Fit(fmt, None, weights, reason=reason, summary=f"{est._gib(weights.total_bytes)} of weights")
    seq = shape.kv_bytes_per_sequence_per_gpu(tp, kvb, need_len, in_flight) * _stage_share(shape, nodes)
    held = est._tokens_held(last_free, need_len, seq)
    reason = (
        f"at {fmt_name} across {nodes} nodes ({tp} GPUs each{capped}) the weights fit but the "
        f"{'FP8' if kv_dtype == 'fp8' else '16-bit'} KV cache holds only {est._tokens(held)} tokens, fewer than "
        f"{conc} sequences × {est._tokens(need_len)} tokens; lower serving.maxModelLen or minConcurrentSequences, "
        "or add nodes")
    return est.Fit(fmt, None, weights, reason=reason,
                 summary=f"its KV cache would hold {est._tokens(held)} tokens across {nodes} nodes")
