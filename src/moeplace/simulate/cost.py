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

- sends per kernel (:data:`moeplace.simulate.kernels.KERNELS`): ``nccl`` one copy per destination GPU (per-GPU
  dedup); ``deepep-normal`` one copy per remote node, forwarded over NVLink (two-hop); ``deepep-ll`` one copy per
  (token, expert) pair, no dedup (intra-node pairs over NVLink, inter-node pairs over RDMA, as DeepEP does
  since its PR #173);
- bytes per send: dispatch ``hidden * dispatch_bytes + 4 * ceil(hidden / scale_block)`` (fp32 scales of a
  quantized dispatch; none when dispatch_bytes >= 2 or scale_block == 0) ``+ header_bytes`` of the kernel; combine
  ``hidden * combine_bytes``;
- one kernel (dispatch or combine): ``t = alpha_k + max_c(alpha_c + busiest_c * bytes / (eff_c * B_c))`` over the
  classes that carry sends (``alpha_k``: the kernel's fixed cost, paid when the micro-batch has pairs; ``eff_c``:
  the kernel's achieved fraction of the link rate; each kernel's module in :mod:`moeplace.simulate.kernels` says
  where its constants come from);
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

from dataclasses import dataclass

import numpy as np

from moeplace.placement import Cluster
from moeplace.simulate.config import CostConfig
from moeplace.simulate.kernels import AUTO_MODE, KERNELS, expert_seconds, kernel_seconds, overlapped_seconds
from moeplace.simulate.links import comm_seconds, dispatch_vector_bytes
from moeplace.simulate.routing import COUNT_NAMES, DEDUP_MODES

# last axis of the kernel's per-pair counts (no dedup, DeepEP low-latency)
PAIR_COUNT_NAMES = ("intra_node_sends", "inter_node_sends", "busiest_intra", "busiest_inter")

# --------------------------------------------------------------------------------------------------- configs


def default_intermediate(model: str) -> int | None:
    """Expert FFN width of a known model preset (for the default pair FLOPs), else None."""
    from moeplace.deploy import find_model

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


def time_terms(cost: CostConfig, hidden: int, model: str) -> TimeTerms:
    """The kernel time model's constants for a trace of ``model`` with ``hidden`` elements per vector."""
    from moeplace.deploy import find_model

    p = find_model(model)
    wb = cost.weight_bytes or (p.expert_weight_bytes if p is not None else 2.0)
    inter = cost.intermediate_size or (p.moe_intermediate_size if p is not None else hidden)
    vec = dispatch_vector_bytes(hidden, cost.dispatch_bytes, cost.scale_block)
    return TimeTerms(cost.mode, cost.overlap, {k: vec + m.header_bytes for k, m in KERNELS.items()},
                     hidden * cost.combine_bytes, 3.0 * hidden * inter * wb)


# --------------------------------------------------------------------------------------------------- formulas


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
    ``combine_time``, ``layer_time`` of the kernel ``terms`` chooses for ``phase``, with its ideal bounds
    ``bound_balanced_time`` and ``bound_local_time``, and that kernel's inter-node sends of the busiest GPU
    (``busiest_inter_sends``, the larger of sent and received) and per GPU on average (``mean_inter_sends``).
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
    for k, km in KERNELS.items():
        bi, be = busiest[km.sends]
        out[f"{k}.dispatch_time"] = kernel_seconds(km, bi, be, any_pairs, cluster, terms.dispatch_send_bytes[k])
        out[f"{k}.combine_time"] = kernel_seconds(km, bi, be, any_pairs, cluster, terms.combine_send_bytes)
    k = terms.kernel_mode(phase)
    km = KERNELS[k]
    d, c, m = out[f"{k}.dispatch_time"], out[f"{k}.combine_time"], out["expert_time"]
    out["dispatch_time"], out["combine_time"] = d, c
    bi, be = busiest[km.sends]
    out["busiest_inter_sends"] = np.asarray(be, np.int64)  # the busiest GPU's inter-node sends (sent or received)
    out["layer_time"] = _layer_seconds(km, terms, k, bi, be, out["max_active"], out["compute_time"], any_pairs,
                                       cluster, (d, m, c))
    # The ideal bound (docs/SIMULATOR.md, "Bounds"), same plan and traffic: *balanced* replaces every busiest-GPU
    # quantity (pairs, active experts, sends per link class) by its mean over GPUs (a class's total sends / W);
    # *local* additionally sends nothing between nodes. Both are <= layer_time, micro-batch by micro-batch.
    total = {"per_gpu": (counts["per_gpu"][..., 1], counts["per_gpu"][..., 2]),
             "two_hop": (counts["two_hop"][..., 1], counts["two_hop"][..., 2]),
             "per_pair": (pair_counts[..., 0], pair_counts[..., 1])}
    ti, te = (np.asarray(x, np.float64) / max(W, 1) for x in total[km.sends])
    out["mean_inter_sends"] = te  # inter-node sends per GPU, their mean (total / W): the balanced bound's figure
    mean_active = active.mean(-1) if W else np.zeros(load.shape[:-1])
    mean_flop = (load.mean(-1) if W else np.zeros(load.shape[:-1])) * pair_seconds
    out["bound_balanced_time"] = _layer_seconds(km, terms, k, ti, te, mean_active, mean_flop, any_pairs, cluster)
    out["bound_local_time"] = _layer_seconds(km, terms, k, ti, np.zeros_like(te), mean_active, mean_flop,
                                             any_pairs, cluster)
    return out


def _layer_seconds(km, terms: TimeTerms, k: str, bi: np.ndarray, be: np.ndarray, active: np.ndarray,
                   flop_time: np.ndarray, any_pairs: np.ndarray, cluster: Cluster,
                   whole: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """[B, L] layer time of kernel ``k`` (model ``km``) for busiest sends (bi intra, be inter), active experts and
    FLOP time of the busiest GPU: dispatch + expert + combine, or the two-batch overlap of two halves. ``whole``:
    the (dispatch, expert, combine) times already computed for these inputs."""
    if terms.overlap:
        d_h = kernel_seconds(km, bi / 2, be / 2, any_pairs, cluster, terms.dispatch_send_bytes[k])
        c_h = kernel_seconds(km, bi / 2, be / 2, any_pairs, cluster, terms.combine_send_bytes)
        m_h = expert_seconds(active, flop_time / 2, any_pairs, terms.expert_bytes, cluster)
        return overlapped_seconds(d_h, m_h, c_h)
    if whole is None:
        whole = (kernel_seconds(km, bi, be, any_pairs, cluster, terms.dispatch_send_bytes[k]),
                 expert_seconds(active, flop_time, any_pairs, terms.expert_bytes, cluster),
                 kernel_seconds(km, bi, be, any_pairs, cluster, terms.combine_send_bytes))
    return whole[0] + whole[1] + whole[2]
