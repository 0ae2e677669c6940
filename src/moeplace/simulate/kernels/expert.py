"""Expert compute of one micro-batch: a roofline per GPU, and the two-batch-overlap layer time."""

from __future__ import annotations

import numpy as np

from moeplace.placement import Cluster


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
