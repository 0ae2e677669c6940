"""The kernel check: DeepEP's benchmark settings priced by the simulator (docs/SIMULATOR.md, "Kernel validation";

``moeplace predict-kernel``, bench/kernel_validation.py)."""

from __future__ import annotations

import numpy as np

from moeplace.budget import check_memory
from moeplace.placement import Placement, Plan
from moeplace.simulate.batching import BatchConfig
from moeplace.simulate.cost import CostConfig, time_terms
from moeplace.simulate.kernels import KERNELS
from moeplace.simulate.simulator import simulate
from moeplace.trace.types import Requests, TokenChunk, Trace, TraceMeta

ROUTING_BYTES_PER_SCORE = 24  # peak bytes per (token, expert) score while benchmark_routing draws and sorts them


def benchmark_routing(rng: np.random.Generator, tokens: int, num_experts: int, top_k: int, num_nodes: int,
                      node_groups: int | None = None) -> np.ndarray:
    """int16 [tokens, top_k] expert ids as DeepEP's kernel benchmarks draw them: scores ``|N(0, 1)| + 1`` per
    expert, top-k of them (uniform: every k-subset equally likely). With ``node_groups``, first keep the
    ``node_groups`` nodes whose best expert scores highest (experts split evenly over ``num_nodes``), as
    DeepEP's test_internode.py does with ``min(num_nodes, 4)`` groups."""
    scores = np.abs(rng.standard_normal((tokens, num_experts), dtype=np.float32)) + 1
    if node_groups is not None and node_groups < num_nodes:
        by_node = scores.reshape(tokens, num_nodes, -1)
        keep = np.argsort(-by_node.max(-1), axis=1)[:, :node_groups]
        mask = np.zeros((tokens, num_nodes), bool)
        np.put_along_axis(mask, keep, True, axis=1)
        scores = np.where(np.repeat(mask, num_experts // num_nodes, axis=1), scores, 0.0)
    return np.argsort(-scores, axis=1, kind="stable")[:, :top_k].astype(np.int16)


def benchmark_bytes(ids: np.ndarray, mode: str, num_experts: int, world: int, gpus_per_node: int,
                    dispatch_send_bytes: float, combine_send_bytes: float) -> tuple[float, float]:
    """(dispatch, combine) bytes per rank, mean over ranks, as DeepEP's benchmarks count them (the numerator of
    their published bandwidths): low-latency: every (token, expert) selection, the local ones too; normal with
    several nodes: one per (token, node it selects), its own node included; one node (and nccl): one per
    (destination GPU, token it receives), itself included. ids: int [T, K] experts (linear placement)."""
    gpu = ids.astype(np.int64) // (num_experts // world)
    if mode == "deepep-ll":
        n = ids.shape[0] * ids.shape[1]
    else:
        unit = gpus_per_node if mode == "deepep-normal" and world > gpus_per_node else 1
        tgt = np.sort(gpu // unit, axis=1)
        n = int((np.diff(tgt, axis=1) != 0).sum() + len(tgt))
    return n * dispatch_send_bytes / world, n * combine_send_bytes / world


def predict_kernel(model: str, cluster_preset: str, ep_sizes: list[int], mode: str, tokens_per_rank: int,
                   seed: int = 0, node_groups: int | None = -1) -> list[dict]:
    """Predicted dispatch and combine time of one EP kernel call under benchmark routing, per EP size.

    Each of the ``ep`` ranks (``ep / G`` nodes of the preset, linear placement: expert e on rank
    ``e // (E / ep)``) holds ``tokens_per_rank`` tokens in one micro-batch, routed by
    :func:`benchmark_routing`; :func:`moeplace.simulate.simulate` prices it with ``CostConfig(mode=mode)``.
    node_groups: nodes a token may use; -1 -> DeepEP's benchmark default (``min(nodes, 4)`` for
    deepep-normal, none otherwise); None -> no limit. Returns one dict per EP size: ``ep``, ``dispatch_us``,
    ``combine_us``, ``dispatch_bytes`` and ``combine_bytes`` (per rank, counted as DeepEP's benchmarks count them:
    :func:`benchmark_bytes`), and ``dispatch_gbps`` / ``combine_gbps`` (those bytes / time: the published
    "bandwidth" columns; None where the call takes no time: EP 1 with deepep-normal or nccl sends nothing, so the
    model prices it at 0 s, as a kernel with no peer costs), ``nodes``.
    """
    from moeplace.deploy import get_cluster_preset, get_model

    if mode not in KERNELS:
        raise ValueError(f"predict-kernel: mode {mode!r}: expected one of {tuple(KERNELS)}")
    if tokens_per_rank < 1:
        raise ValueError(f"predict-kernel: tokens_per_rank must be >= 1, got {tokens_per_rank}")
    mp, cp = get_model(model), get_cluster_preset(cluster_preset)
    E, K, G = mp.num_experts, mp.top_k, cp.gpus_per_node
    for ep in ep_sizes:  # every size is checked before the first is priced
        if ep < 1 or E % ep or (ep > G and ep % G):
            raise ValueError(f"predict-kernel: EP size {ep}: expected a divisor of {E} experts that fills whole "
                             f"nodes of {G} GPUs (or one node of at most {G})")
        T = ep * tokens_per_rank  # scores [T, E] float32, their argsort int64, the node mask; the trace [T, K]
        check_memory(T * E * ROUTING_BYTES_PER_SCORE + T * K * 64, f"the benchmark routing of {T} tokens x {E} "
                     "experts", f"predict-kernel --ep {ep} --tokens-per-rank {tokens_per_rank}")
    rows = []
    for ep in ep_sizes:
        nodes = max(1, ep // G)
        cluster = cp.cluster(nodes) if ep >= G else cp.hardware.cluster(1, ep)
        groups = (min(nodes, 4) if mode == "deepep-normal" else None) if node_groups == -1 else node_groups
        rng = np.random.default_rng([seed, ep])
        T = ep * tokens_per_rank
        ids = benchmark_routing(rng, T, E, K, nodes, groups)
        meta = TraceMeta(model=mp.name, num_layers=1, num_experts=E, top_k=K, hidden_size=mp.hidden_size,
                         synthetic=True, source="synthetic:kernel-benchmark")
        rid = np.arange(ep, dtype=np.int64)
        req = Requests(rid, np.array(["bench"] * ep, object), np.array([""] * ep, object),
                       np.full(ep, tokens_per_rank, np.int32), np.zeros(ep, np.int32))
        tk = TokenChunk(np.repeat(rid, tokens_per_rank), np.tile(np.arange(tokens_per_rank, dtype=np.int32), ep),
                        np.zeros(T, np.int8), ids.reshape(T, 1, K))
        plan = Plan(Placement.linear(1, E, ep), cluster, homes={int(r): int(r) for r in rid})
        res = simulate(Trace(meta, req, tk), plan, cost=CostConfig(mode=mode), batching=BatchConfig(prefill_tokens=T))
        pm = res.prefill.per_microbatch
        terms = time_terms(CostConfig(mode=mode), mp.hidden_size, mp.name)
        d, c = float(pm[f"{mode}.dispatch_time"][0, 0]), float(pm[f"{mode}.combine_time"][0, 0])
        db, cb = benchmark_bytes(ids, mode, E, ep, G, terms.dispatch_send_bytes[mode], terms.combine_send_bytes)
        rows.append({"ep": ep, "nodes": nodes, "dispatch_us": d * 1e6, "combine_us": c * 1e6,
                     "dispatch_bytes": db, "combine_bytes": cb,
                     "dispatch_gbps": _gbps(db, d), "combine_gbps": _gbps(cb, c)})
    return rows


def _gbps(nbytes: float, seconds: float) -> float | None:
    """GB/s of a kernel call, None when it takes no time (nothing sent: no bandwidth to speak of)."""
    return nbytes / seconds / 1e9 if seconds > 0 else None
