"""The reachable bound: a certified lower bound on the layer time of *any* placement the replica memory allows, any
replica dispatch and any grouping of requests to nodes in balanced rounds (docs/SIMULATOR.md, "Bounds").

Shape legend: B = micro-batches, L = MoE layers, E = logical experts, U = units (nodes or GPUs).

The two ideal bounds of :mod:`moeplace.simulate.cost` keep the plan's own traffic (*balanced*) or drop the
inter-node part of it (*balanced and local*); the second ignores that a node holds only ``(E + R) / N`` expert
slots per layer, so it cannot tell how much of the inter-node room a placement could ever take. This bound can.

**Local pairs any placement can reach.** In one micro-batch and layer let ``D_e`` be the pairs choosing expert e
and ``cap`` the most tokens one unit (node, or GPU) holds in a balanced round (``ceil(T / U)``). A pair is local to
a unit only if the unit holds a replica of its expert, and a token chooses an expert at most once per layer, so if
e has replicas on ``r_e`` units at most ``min(D_e, r_e * cap)`` of its pairs are local. Every expert has at least
one replica and all replicas fit the ``E + R`` slots of the layer: ``1 <= r_e <= U``, ``sum_e r_e <= E + R``. The
largest ``sum_e min(D_e, r_e * cap)`` under these constraints is a separable concave knapsack; greedy on the
marginal gains ``min(cap, max(0, D_e - j * cap))`` (j = 1 .. U-1, non-increasing in j) is exact, so the bound is
``sum_e min(D_e, cap) + (the R largest gains)`` (:func:`local_pairs_upper`). It relaxes the one grouping shared by
every layer (each layer may group anew) and the equal slots per node, so it is a bound, not a plan.

**Locality costs memory time.** A replica only makes pairs local where it serves them, and then its GPU reads
that expert's weights: with experts active on ``j`` units beyond one each, at most the ``j`` largest gains are
taken (:func:`local_pairs_curve`) and at least ``A + j`` (expert, GPU) pairs are active (A: experts with pairs).
The bound is the least over ``j = 0 .. R`` of the layer time below.

**From pairs to time.** With ``P`` pairs, at least ``P - node_local`` are served on another node and at least
``P - gpu_local`` off their token's GPU. A kernel without dedup (``per_pair``) sends one copy per such pair; one
with dedup (per GPU, two-hop) at least one per ``K`` of them (a copy carries at most a token's K pairs). The
busiest GPU sends at least the mean over GPUs; its distinct active experts at least ``(A + j) / W``; its FLOP
time at least ``P / W`` pairs. Dispatch and combine are each minimised
over how the off-GPU sends split between NVLink and the inter-node links (:func:`min_kernel_seconds`, exact for
the kernel formula), and the layer formula is non-decreasing in each term, so the result is below the layer
time of every placement, dispatch and grouping, micro-batch by micro-batch; ``compare`` reports it as
``bound_reachable_s`` and ``gap_closed_reachable``.
"""

from __future__ import annotations

import numpy as np

from moeplace.placement import Cluster
from moeplace.simulate.kernels import KERNELS, KernelModel, expert_seconds, kernel_seconds, overlapped_seconds


def local_pairs_curve(demand: np.ndarray, cap: int, units: int, extra_slots: int) -> np.ndarray:
    """float [..., X + 1]: for j = 0 .. X (X = ``extra_slots``), the most pairs any placement serves on their
    token's own unit when experts are active on j units beyond one each (module docstring).

    demand: int [..., E] pairs per expert (one micro-batch and layer per row); cap: the most tokens one unit holds;
    units: U (nodes, or GPUs); extra_slots: replica slots beyond one per expert (R).
    """
    d = np.asarray(demand, np.int64)
    cap = max(int(cap), 0)
    X = max(int(extra_slots), 0)
    base = np.minimum(d, cap).sum(-1).astype(np.float64)
    out = np.repeat(base[..., None], X + 1, axis=-1)
    n = min(X, d.shape[-1] * max(units - 1, 0))
    if n == 0:
        return out
    j = np.arange(1, units, dtype=np.int64) * cap
    gains = np.clip(d[..., None] - j, 0, cap).reshape(*d.shape[:-1], -1)  # [..., E * (U - 1)]
    top = -np.sort(np.partition(-gains, n - 1, axis=-1)[..., :n], axis=-1)  # the n largest, largest first
    out[..., 1:n + 1] += np.cumsum(top, axis=-1)
    out[..., n + 1:] = out[..., n:n + 1]
    return out


def local_pairs_upper(demand: np.ndarray, cap: int, units: int, extra_slots: int) -> np.ndarray:
    """float [...]: the most pairs any placement serves on their token's own unit, every spare slot used
    (:func:`local_pairs_curve` at j = ``extra_slots``)."""
    return local_pairs_curve(demand, cap, units, extra_slots)[..., -1]


def min_kernel_seconds(km: KernelModel, off_gpu: np.ndarray, inter_lo: np.ndarray, any_pairs: np.ndarray,
                       cluster: Cluster, send_bytes: float) -> np.ndarray:
    """float [...]: the least :func:`kernel_seconds` over busiest sends (intra ``off_gpu - te``, inter ``te``) with
    ``inter_lo <= te <= off_gpu``. The kernel time is the max of a rising and a falling line in te (plus each
    class's latency where it sends), so its least value is at an end or where the lines cross: all three are
    evaluated and the least taken."""
    s = np.asarray(off_gpu, np.float64)
    lo = np.minimum(np.asarray(inter_lo, np.float64), s)
    a_i = send_bytes / (km.intra_eff * cluster.intra_bw)
    a_e = send_bytes / (km.inter_eff * cluster.inter_bw)
    cross = np.clip((cluster.intra_latency - cluster.inter_latency + s * a_i) / (a_i + a_e), lo, s)
    best = None
    for te in (lo, s, cross):
        t = kernel_seconds(km, np.maximum(s - te, 0.0), te, any_pairs, cluster, send_bytes)
        best = t if best is None else np.minimum(best, t)
    return best


def reachable_seconds(demand: np.ndarray, tokens: np.ndarray, top_k: int, num_slots: int, cluster: Cluster,
                      terms, phase: str, pair_seconds: float) -> np.ndarray:
    """float [B, L]: the reachable bound of each micro-batch and layer (module docstring).

    demand: int [B, L, E] pairs per expert; tokens: int [B] tokens of each micro-batch; num_slots: E + R physical
    slots per layer; terms: the :class:`moeplace.simulate.cost.TimeTerms` of the trace; phase: picks the kernel.
    """
    d = np.asarray(demand, np.int64)
    B, L, E = d.shape
    W, N = cluster.world_size, cluster.num_nodes
    t = np.asarray(tokens, np.int64)
    X = max(int(num_slots) - E, 0)
    P = d.sum(-1).astype(np.float64)[..., None]  # [B, L, 1]
    node_local = np.empty((B, L, X + 1))
    gpu_local = np.empty((B, L, X + 1))
    for b in range(B):  # the cap differs per micro-batch
        node_local[b] = local_pairs_curve(d[b], -(-int(t[b]) // N), N, X)
        gpu_local[b] = local_pairs_curve(d[b], -(-int(t[b]) // W), W, X)
    k = terms.kernel_mode(phase)
    km = KERNELS[k]
    per_send = 1.0 if km.sends == "per_pair" else 1.0 / max(int(top_k), 1)
    off = np.maximum(P - gpu_local, 0.0) * per_send / W
    inter = np.maximum(P - node_local, 0.0) * per_send / W if N > 1 else np.zeros_like(off)
    any_pairs = P > 0
    active = ((d > 0).sum(-1)[..., None] + np.arange(X + 1)) / W  # an extra unit an expert serves is active there
    flop = P / W * pair_seconds
    half = 0.5 if terms.overlap else 1.0
    dt = min_kernel_seconds(km, off * half, inter * half, any_pairs, cluster, terms.dispatch_send_bytes[k])
    ct = min_kernel_seconds(km, off * half, inter * half, any_pairs, cluster, terms.combine_send_bytes)
    mt = expert_seconds(active, flop * half, any_pairs, terms.expert_bytes, cluster)
    layer = overlapped_seconds(dt, mt, ct) if terms.overlap else dt + mt + ct
    return layer.min(-1)  # the least over how many extra units the experts are active on


def expert_demand(ids: np.ndarray, rows: np.ndarray, starts: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 [B, L, E]: pairs per expert of each micro-batch. ids: int [T, L, K]; rows: int [n] rows of ids, whole
    micro-batches one after the other; starts: int [B + 1] where each micro-batch's rows begin in ``rows``."""
    L = ids.shape[1]
    B = len(starts) - 1
    mbi = np.repeat(np.arange(B, dtype=np.int64), np.diff(starts))
    sel = np.asarray(ids)[rows].astype(np.int64)  # [n, L, K]
    key = (mbi[:, None, None] * L + np.arange(L)[None, :, None]) * num_experts + sel
    return np.bincount(key.ravel(), minlength=B * L * num_experts).reshape(B, L, num_experts)


__all__ = ["expert_demand", "local_pairs_curve", "local_pairs_upper", "min_kernel_seconds", "reachable_seconds"]
