"""What every dispatch/combine kernel model declares, and the one formula that prices a kernel call."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeplace.placement import Cluster
from moeplace.simulate.links import comm_seconds


@dataclass(frozen=True)
class KernelModel:
    """How one dispatch/combine kernel moves token vectors and what it achieves on the links."""

    name: str  # the registry key (moeplace.simulate.kernels.KERNELS) and the CostConfig.mode value
    summary: str  # one line for --help and listings
    sends: str  # "per_gpu", "two_hop" (counts of moeplace.simulate.routing) or "per_pair" (no dedup)
    alpha: float  # seconds per kernel call (dispatch or combine), paid when the micro-batch has pairs
    intra_eff: float  # achieved fraction of cluster.intra_bw
    inter_eff: float  # achieved fraction of cluster.inter_bw
    header_bytes: float  # bytes per dispatch message besides the vector and its scales
    source: str  # where the constants come from


def kernel_seconds(kernel: KernelModel, busiest_intra: np.ndarray, busiest_inter: np.ndarray, any_pairs: np.ndarray,
                   cluster: Cluster, send_bytes: float) -> np.ndarray:
    """float [...]: one dispatch or combine of ``kernel``: ``alpha_k + max over link classes of (alpha_c + busiest_c
    * send_bytes / (eff_c * B_c))`` (a class without sends costs 0; alpha_k only where any_pairs, bool [...])."""
    t = np.maximum(comm_seconds(busiest_intra, cluster.intra_latency, kernel.intra_eff * cluster.intra_bw,
                                send_bytes),
                   comm_seconds(busiest_inter, cluster.inter_latency, kernel.inter_eff * cluster.inter_bw,
                                send_bytes))
    return t + np.where(any_pairs, kernel.alpha, 0.0)
