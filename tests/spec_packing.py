"""What every within-node repacking keeps, written out in loops (shared by the packing tests)."""

from __future__ import annotations

import numpy as np


def assert_node_slots_kept_no_twin(got: np.ndarray, phy2log: np.ndarray, N: int, G: int) -> None:
    """``got`` [L, P] holds the same slots per node as ``phy2log`` (node-major), and no GPU two replicas of one
    expert."""
    L, P = phy2log.shape
    per_node, S = P // N, P // (N * G)
    for layer in range(L):
        for n in range(N):
            assert sorted(got[layer, n * per_node:(n + 1) * per_node]) == sorted(
                phy2log[layer, n * per_node:(n + 1) * per_node])
        for g in range(N * G):
            assert len(set(got[layer, g * S:(g + 1) * S].tolist())) == S  # no twin on a GPU
