"""The time model of one MoE layer per micro-batch (docs/MODEL.md, "Layer time"; docs/SIMULATOR.md, "Time model").

Shape legend: B = micro-batches, L = MoE layers, W = GPUs, G = GPUs per node.

Two models live here, side by side (both are reported; the second is what planners optimise):

**Link model** (the original keys ``{per_gpu,two_hop}.comm_time[_padded]``, ``compute_time``): per link class c
(intra-node, inter-node) and direction, ``t_c = alpha_c + sends_c * bytes_per_send / B_c`` (0 when nothing
crosses class c), ``comm = max(t_intra_d, t_inter_d) + max(t_intra_c, t_inter_c)``; ``sends_c`` is the busiest
GPU's max(sent, received) over class c, or ``peers_c x max message`` padded. ``compute_time`` = max pairs on one
GPU x pair_seconds.

**Kernel time model** (keys ``{kernel}.dispatch_time``, ``{kernel}.combine_time``, ``expert_time``,
``dispatch_time``, ``combine_time``, ``layer_time``), for the kernel that moves the data:

- sends per kernel (:data:`KERNELS`): ``nccl`` one copy per destination GPU (per-GPU dedup); ``deepep-normal``
  one copy per remote node, forwarded over NVLink (two-hop); ``deepep-ll`` one copy per (token, expert) pair, no
  dedup (intra-node pairs over NVLink, inter-node pairs over RDMA, as DeepEP does since its PR #173);
- bytes per send: dispatch ``hidden * dispatch_bytes + 4 * ceil(hidden / scale_block)`` (fp32 scales of a
  quantized dispatch; none when dispatch_bytes >= 2 or scale_block == 0) ``+ header_bytes`` of the kernel; combine
  ``hidden * combine_bytes``;
- one kernel (dispatch or combine): ``t = alpha_k + max_c(alpha_c + busiest_c * bytes / (eff_c * B_c))`` over the
  classes that carry sends (``alpha_k``: the kernel's fixed cost, paid when the micro-batch has pairs; ``eff_c``:
  the kernel's achieved fraction of the link rate, see :data:`KERNELS` for where each constant comes from);
- expert compute, a roofline per GPU: ``max(active_g * expert_bytes / hbm_bw, pairs_g * pair_seconds) +
  compute_overhead``; its max over GPUs is ``max(max_g active_g * expert_bytes / hbm_bw, compute_time) +
  overhead`` (0 for a micro-batch without pairs). ``expert_bytes = 3 * hidden * intermediate * weight_bytes``;
- ``layer_time = dispatch + expert + combine``, or with two-batch overlap (two half micro-batches, the comm stream
  and the compute stream in parallel: dispatch(A); compute(A) || dispatch(B); combine(A) || compute(B);
  combine(B)):  ``d_h + max(m_h, d_h) + max(c_h, m_h) + c_h`` where a half sends half of every link's messages
  (``d_h``, ``c_h``: the kernel time of busiest / 2) and reads every active expert's weights again
  (``m_h = overhead + max(memory, flop / 2)``).

Mode ``auto`` uses ``deepep-normal`` for prefill micro-batches and ``deepep-ll`` for decode ones (SGLang's
``--deepep-mode auto``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moeplace.placement import Cluster
from moeplace.simulate.routing import COUNT_NAMES, DEDUP_MODES

KERNEL_MODES = ("nccl", "deepep-normal", "deepep-ll")
MODES = (*KERNEL_MODES, "auto")
AUTO_MODE = {"prefill": "deepep-normal", "decode": "deepep-ll"}  # mode "auto" per phase
# last axis of the kernel's per-pair counts (no dedup, DeepEP low-latency)
PAIR_COUNT_NAMES = ("intra_node_sends", "inter_node_sends", "busiest_intra", "busiest_inter")


@dataclass(frozen=True)
class KernelModel:
    """How one dispatch/combine kernel moves token vectors and what it achieves on the links."""

    name: str  # a KERNEL_MODES entry
    sends: str  # "per_gpu", "two_hop" (counts of moeplace.simulate.routing) or "per_pair" (no dedup)
    alpha: float  # seconds per kernel call (dispatch or combine), paid when the micro-batch has pairs
    intra_eff: float  # achieved fraction of cluster.intra_bw
    inter_eff: float  # achieved fraction of cluster.inter_bw
    header_bytes: float  # bytes per dispatch message besides the vector and its scales
    source: str  # where the constants come from


# Calibrated on DeepEP's published H800 numbers (bench/results/deepep_published.json; docs/SIMULATOR.md, "Kernel
# validation" lists which rows fitted which constant and the error on every row).
# Three constants, each fitted on one published row and checked on the others:
DEEPEP_NVLINK_EFF = 0.68  # achieved fraction of the NVLink rate (fitted: normal kernel, intranode EP8 dispatch)
DEEPEP_RDMA_EFF = 0.88  # achieved fraction of the NIC rate (fitted: normal kernel, internode EP32 dispatch)
DEEPEP_LL_ALPHA = 5e-6  # fixed cost of one low-latency kernel call beyond the link latency (fitted: LL EP32 dispatch)

KERNELS: dict[str, KernelModel] = {k.name: k for k in (
    KernelModel("nccl", "per_gpu", 0.0, 1.0, 1.0, 0.0,
                "not validated: all-to-allv at the link rate, the cluster's per-message latencies only"),
    KernelModel("deepep-normal", "two_hop", 0.0, DEEPEP_NVLINK_EFF, DEEPEP_RDMA_EFF, 0.0,
                "link efficiencies fitted on DeepEP's H800 normal-kernel table (docs/SIMULATOR.md)"),
    KernelModel("deepep-ll", "per_pair", DEEPEP_LL_ALPHA, DEEPEP_NVLINK_EFF, DEEPEP_RDMA_EFF, 16.0,
                "kernel alpha fitted on DeepEP's H800 low-latency table; 16 B per message as in DeepEP's "
                "test_low_latency.py byte count"),
)}

# --------------------------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class CostConfig:
    """What one send and one token-expert pair cost, and which kernel time model a layer time uses."""

    hidden_size: int | None = None  # elements per token vector; None -> the trace's metadata
    dispatch_bytes: float = 1.0  # bytes per element sent by dispatch (1 = fp8)
    combine_bytes: float = 2.0  # bytes per element returned by combine (2 = bf16)
    pair_flops: float | None = None  # FLOPs of one token-expert pair; None -> 6 * hidden * intermediate
    intermediate_size: int | None = None  # expert FFN width for default pair_flops; None -> model preset or hidden
    mode: str = "auto"  # dispatch/combine kernel: nccl, deepep-normal, deepep-ll, auto (normal prefill, ll decode)
    overlap: bool = False  # two-batch overlap of dispatch, expert compute and combine (module docstring)
    scale_block: int = 128  # a quantized dispatch (dispatch_bytes < 2) carries one fp32 scale per block; 0: none
    weight_bytes: float | None = None  # bytes per expert weight element; None -> model preset, else 2 (bf16)

    def __post_init__(self) -> None:
        hs = self.hidden_size
        if hs is not None and (not isinstance(hs, (int, np.integer)) or hs < 1):
            raise ValueError(f"cost: hidden_size must be a positive integer, got {self.hidden_size!r}")
        for name in ("dispatch_bytes", "combine_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cost: {name} must be > 0, got {getattr(self, name)!r}")
        if self.pair_flops is not None and not self.pair_flops >= 0:
            raise ValueError(f"cost: pair_flops must be >= 0, got {self.pair_flops!r}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ValueError(f"cost: intermediate_size must be >= 1, got {self.intermediate_size!r}")
        if self.mode not in MODES:
            raise ValueError(f"cost: mode {self.mode!r}: expected one of {MODES}")
        if not isinstance(self.scale_block, (int, np.integer)) or self.scale_block < 0:
            raise ValueError(f"cost: scale_block must be an integer >= 0, got {self.scale_block!r}")
        if self.weight_bytes is not None and not self.weight_bytes > 0:
            raise ValueError(f"cost: weight_bytes must be > 0, got {self.weight_bytes!r}")


def default_intermediate(model: str) -> int | None:
    """Expert FFN width of a known model preset (for the default pair FLOPs), else None."""
    from moeplace.presets import find_model

    p = find_model(model)
    return None if p is None else p.moe_intermediate_size


def pair_flops_of(cost: CostConfig, hidden: int, model: str) -> float:
    """FLOPs of one token-expert pair: ``cost.pair_flops``, else 6 * hidden * intermediate (the expert width from
    the config, the model preset, else ``hidden``)."""
    if cost.pair_flops is not None:
        return float(cost.pair_flops)
    inter = cost.intermediate_size or default_intermediate(model) or hidden
    return 6.0 * hidden * inter


@dataclass(frozen=True)
class TimeTerms:
    """The per-send and per-expert constants of the kernel time model for one trace (from a CostConfig)."""

    mode: str  # a MODES entry
    overlap: bool
    dispatch_send_bytes: dict  # kernel mode -> bytes of one dispatch send (vector + scales + header)
    combine_send_bytes: float  # bytes of one combine send
    expert_bytes: float  # weight bytes of one expert (read from HBM once per micro-batch when active)

    def kernel_mode(self, phase: str) -> str:
        """The kernel of ``phase`` ("prefill", "decode"; anything else counts as prefill) under this mode."""
        return AUTO_MODE.get(phase, AUTO_MODE["prefill"]) if self.mode == "auto" else self.mode


def dispatch_vector_bytes(hidden: int, dispatch_bytes: float, scale_block: int) -> float:
    """Bytes of one dispatched token vector: elements, plus one fp32 scale per ``scale_block`` elements when the
    dispatch is quantized (dispatch_bytes < 2). DeepSeek-V3: 7168 + 4 * 56 = 7392."""
    scales = 4.0 * math.ceil(hidden / scale_block) if scale_block and dispatch_bytes < 2 else 0.0
    return hidden * dispatch_bytes + scales


def time_terms(cost: CostConfig, hidden: int, model: str) -> TimeTerms:
    """The kernel time model's constants for a trace of ``model`` with ``hidden`` elements per vector."""
    from moeplace.presets import find_model

    p = find_model(model)
    wb = cost.weight_bytes or (p.expert_weight_bytes if p is not None else 2.0)
    inter = cost.intermediate_size or (p.moe_intermediate_size if p is not None else hidden)
    vec = dispatch_vector_bytes(hidden, cost.dispatch_bytes, cost.scale_block)
    return TimeTerms(cost.mode, cost.overlap, {k: vec + KERNELS[k].header_bytes for k in KERNEL_MODES},
                     hidden * cost.combine_bytes, 3.0 * hidden * inter * wb)


# --------------------------------------------------------------------------------------------------- formulas


def comm_seconds(busiest: np.ndarray, alpha: float, bandwidth: float, send_bytes: float) -> np.ndarray:
    """float [...]: ``alpha + busiest * send_bytes / bandwidth`` where anything is sent, else 0 (one link class,
    one direction). busiest: [...] sends over the busiest link of that class."""
    busiest = np.asarray(busiest)
    return np.where(busiest > 0, alpha + busiest * send_bytes / bandwidth, 0.0)


def kernel_seconds(kernel: KernelModel, busiest_intra: np.ndarray, busiest_inter: np.ndarray, any_pairs: np.ndarray,
                   cluster: Cluster, send_bytes: float) -> np.ndarray:
    """float [...]: one dispatch or combine of ``kernel``: ``alpha_k + max over link classes of (alpha_c + busiest_c
    * send_bytes / (eff_c * B_c))`` (a class without sends costs 0; alpha_k only where any_pairs, bool [...])."""
    t = np.maximum(comm_seconds(busiest_intra, cluster.intra_latency, kernel.intra_eff * cluster.intra_bw,
                                send_bytes),
                   comm_seconds(busiest_inter, cluster.inter_latency, kernel.inter_eff * cluster.inter_bw,
                                send_bytes))
    return t + np.where(any_pairs, kernel.alpha, 0.0)


def expert_seconds(max_active: np.ndarray, flop_time: np.ndarray, any_pairs: np.ndarray, expert_bytes: float,
                   cluster: Cluster) -> np.ndarray:
    """float [...]: roofline expert compute of the busiest GPU, ``max(max_active * expert_bytes / hbm_bw,
    flop_time) + compute_overhead`` where any_pairs, else 0. max_active: busiest GPU's distinct active experts;
    flop_time: busiest GPU's pairs x pair seconds."""
    mem = np.asarray(max_active) * expert_bytes / cluster.hbm_bw
    return np.where(any_pairs, np.maximum(mem, flop_time) + cluster.compute_overhead, 0.0)


def overlapped_seconds(d_half: np.ndarray, m_half: np.ndarray, c_half: np.ndarray) -> np.ndarray:
    """float [...]: layer time of two half micro-batches with the comm and compute streams in parallel:
    ``d + max(m, d) + max(c, m) + c`` (dispatch A; compute A || dispatch B; combine A || compute B; combine B)."""
    return d_half + np.maximum(m_half, d_half) + np.maximum(c_half, m_half) + c_half


def microbatch_metrics(counts: dict[str, np.ndarray], load: np.ndarray, cluster: Cluster,
                       dispatch_send_bytes: float, combine_send_bytes: float,
                       pair_seconds: float, active: np.ndarray | None = None, pair_counts: np.ndarray | None = None,
                       terms: TimeTerms | None = None, phase: str = "prefill") -> dict[str, np.ndarray]:
    """Per-micro-batch, per-layer quantities of both time models.

    counts: mode ("per_gpu", "two_hop") -> int [B, L, 6] (:func:`moeplace.simulate.routing.link_counts`);
    load: int [B, L, W] pairs per GPU. Returns name -> [B, L]: ``{mode}.{count name}``,
    ``{mode}.comm_time`` and ``{mode}.comm_time_padded`` (seconds), ``compute_time``, ``pairs``, ``max_load``.
    With active int [B, L, W] (distinct experts with pairs per GPU), pair_counts int [B, L, 4] (PAIR_COUNT_NAMES)
    and terms, also the kernel time model: ``max_active``, ``per_pair.{name}``, ``memory_time``, ``expert_time``,
    ``{kernel}.dispatch_time`` / ``{kernel}.combine_time`` for every kernel, and ``dispatch_time``,
    ``combine_time``, ``layer_time`` of the kernel ``terms`` chooses for ``phase``.
    """
    W, G = cluster.world_size, cluster.gpus_per_node
    out: dict[str, np.ndarray] = {}
    for mode in DEDUP_MODES:
        c = counts[mode]
        for j, name in enumerate(COUNT_NAMES[:4]):
            out[f"{mode}.{name}"] = c[..., j]
        maxmsg = c[..., 3]
        t = {}
        for name, busiest, alpha, bw, peers in (
                ("intra", c[..., 4], cluster.intra_latency, cluster.intra_bw, G - 1),
                ("inter", c[..., 5], cluster.inter_latency, cluster.inter_bw, W - G)):
            for key, sends in (("", busiest), ("_padded", peers * maxmsg)):
                for part, nbytes in (("d", dispatch_send_bytes), ("c", combine_send_bytes)):
                    t[name, key, part] = comm_seconds(sends, alpha, bw, nbytes)
        for key in ("", "_padded"):
            out[f"{mode}.comm_time{key}"] = (np.maximum(t["intra", key, "d"], t["inter", key, "d"])
                                             + np.maximum(t["intra", key, "c"], t["inter", key, "c"]))
    mx = load.max(-1) if W else np.zeros(load.shape[:-1], np.int64)
    out["compute_time"] = mx * pair_seconds
    out["pairs"] = load.sum(-1).astype(np.int64)
    out["max_load"] = mx.astype(np.int64)
    if active is None or pair_counts is None or terms is None:
        return out
    any_pairs = out["pairs"] > 0
    out["max_active"] = (active.max(-1) if W else np.zeros(load.shape[:-1])).astype(np.int64)
    for j, name in enumerate(PAIR_COUNT_NAMES):
        out[f"per_pair.{name}"] = pair_counts[..., j].astype(np.int64)
    out["memory_time"] = out["max_active"] * terms.expert_bytes / cluster.hbm_bw
    out["expert_time"] = expert_seconds(out["max_active"], out["compute_time"], any_pairs, terms.expert_bytes,
                                        cluster)
    busiest = {"per_gpu": (counts["per_gpu"][..., 4], counts["per_gpu"][..., 5]),
               "two_hop": (counts["two_hop"][..., 4], counts["two_hop"][..., 5]),
               "per_pair": (pair_counts[..., 2], pair_counts[..., 3])}
    for k in KERNEL_MODES:
        km = KERNELS[k]
        bi, be = busiest[km.sends]
        out[f"{k}.dispatch_time"] = kernel_seconds(km, bi, be, any_pairs, cluster, terms.dispatch_send_bytes[k])
        out[f"{k}.combine_time"] = kernel_seconds(km, bi, be, any_pairs, cluster, terms.combine_send_bytes)
    k = terms.kernel_mode(phase)
    km = KERNELS[k]
    d, c, m = out[f"{k}.dispatch_time"], out[f"{k}.combine_time"], out["expert_time"]
    out["dispatch_time"], out["combine_time"] = d, c
    if terms.overlap:
        bi, be = busiest[km.sends]
        d_h = kernel_seconds(km, bi / 2, be / 2, any_pairs, cluster, terms.dispatch_send_bytes[k])
        c_h = kernel_seconds(km, bi / 2, be / 2, any_pairs, cluster, terms.combine_send_bytes)
        m_h = expert_seconds(out["max_active"], out["compute_time"] / 2, any_pairs, terms.expert_bytes, cluster)
        out["layer_time"] = overlapped_seconds(d_h, m_h, c_h)
    else:
        out["layer_time"] = d + m + c
    return out


# --------------------------------------------------------------------------------------------------- kernel check


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
    "bandwidth" columns), ``nodes``.
    """
    from moeplace.placement import Placement, Plan
    from moeplace.presets import get_cluster_preset, get_model
    from moeplace.simulate.batching import BatchConfig
    from moeplace.simulate.simulator import simulate
    from moeplace.trace.store import Requests, TokenChunk, Trace, TraceMeta

    if mode not in KERNEL_MODES:
        raise ValueError(f"predict-kernel: mode {mode!r}: expected one of {KERNEL_MODES}")
    if tokens_per_rank < 1:
        raise ValueError(f"predict-kernel: tokens_per_rank must be >= 1, got {tokens_per_rank}")
    mp, cp = get_model(model), get_cluster_preset(cluster_preset)
    E, K, G = mp.num_experts, mp.top_k, cp.gpus_per_node
    rows = []
    for ep in ep_sizes:
        if ep < 1 or E % ep or (ep > G and ep % G):
            raise ValueError(f"predict-kernel: EP size {ep}: expected a divisor of {E} experts that fills whole "
                             f"nodes of {G} GPUs (or one node of at most {G})")
        nodes = max(1, ep // G)
        cluster = cp.cluster(nodes) if ep >= G else Cluster(1, ep, cp.intra_bw, cp.inter_bw, cp.intra_latency,
                                                            cp.inter_latency, cp.expert_flops, cp.hbm_bw,
                                                            cp.compute_overhead)
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
                     "dispatch_gbps": db / d / 1e9, "combine_gbps": cb / c / 1e9})
    return rows
