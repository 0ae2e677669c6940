"""The time model of one MoE layer per micro-batch (docs/MODEL.md, "Layer time"): dispatch and combine on the
busiest link, with and without padding to the largest per-peer message, plus roofline expert compute.

Shape legend: B = micro-batches, L = MoE layers, W = GPUs, G = GPUs per node.

For one micro-batch and layer, per link class c (intra-node, inter-node) and direction (dispatch d, combine c):

    t_c = alpha_c + sends_c * bytes_per_send / B_c        (0 when nothing crosses class c)
    comm = max(t_intra_d, t_inter_d) + max(t_intra_c, t_inter_c)

where ``sends_c`` is the busiest GPU's max(sent, received) over class c (unpadded) or ``peers_c x max message``
(padded: all-to-all kernels pad every peer to the largest message; peers_intra = G - 1, peers_inter = W - G).
Compute = (max pairs on one GPU) x pair_seconds. Layer time = comm + compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeplace.placement import Cluster
from moeplace.simulate.routing import COUNT_NAMES, DEDUP_MODES

# --------------------------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class CostConfig:
    """What one send and one token-expert pair cost."""

    hidden_size: int | None = None  # elements per token vector; None -> the trace's metadata
    dispatch_bytes: float = 1.0  # bytes per element sent by dispatch (1 = fp8)
    combine_bytes: float = 2.0  # bytes per element returned by combine (2 = bf16)
    pair_flops: float | None = None  # FLOPs of one token-expert pair; None -> 6 * hidden * intermediate
    intermediate_size: int | None = None  # expert FFN width for default pair_flops; None -> model preset or hidden

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


def comm_seconds(busiest: np.ndarray, alpha: float, bandwidth: float, send_bytes: float) -> np.ndarray:
    """float [...]: ``alpha + busiest * send_bytes / bandwidth`` where anything is sent, else 0 (one link class,
    one direction). busiest: int [...] sends over the busiest link of that class."""
    busiest = np.asarray(busiest)
    return np.where(busiest > 0, alpha + busiest * send_bytes / bandwidth, 0.0)


def microbatch_metrics(counts: dict[str, np.ndarray], load: np.ndarray, cluster: Cluster,
                       dispatch_send_bytes: float, combine_send_bytes: float,
                       pair_seconds: float) -> dict[str, np.ndarray]:
    """Per-micro-batch, per-layer quantities of the time model.

    counts: mode ("per_gpu", "two_hop") -> int [B, L, 6] (:func:`moeplace.simulate.routing.link_counts`);
    load: int [B, L, W] pairs per GPU. Returns name -> [B, L]: ``{mode}.{count name}``,
    ``{mode}.comm_time`` and ``{mode}.comm_time_padded`` (seconds), ``compute_time``, ``pairs``, ``max_load``.
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
    return out
