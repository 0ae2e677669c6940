"""Plain for-loop references for the vectorised statistics: slow, obvious, used by the tests and the benchmark.

Shape legend: T = tokens, L = MoE layers, K = top-k, E = logical experts.
"""

from __future__ import annotations

import numpy as np


def load_coactivation_loop(expert_ids: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Load [L, E] and symmetric co-activation counts [L, E, E] of expert_ids [T, L, K], one token at a time."""
    T, L, K = np.shape(expert_ids)
    load = np.zeros((L, num_experts), np.int64)
    coact = np.zeros((L, num_experts, num_experts), np.int64)
    for t in range(T):
        for lyr in range(L):
            sel = [int(e) for e in expert_ids[t][lyr]]
            for j, e in enumerate(sel):
                load[lyr, e] += 1
                for f in sel[j + 1:]:
                    coact[lyr, e, f] += 1
                    coact[lyr, f, e] += 1
    return load, coact


def interlayer_loop(expert_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Inter-layer counts [L-1, E, E] of expert_ids [T, L, K], one token at a time."""
    T, L, K = np.shape(expert_ids)
    out = np.zeros((max(L - 1, 0), num_experts, num_experts), np.int64)
    for t in range(T):
        for lyr in range(L - 1):
            for e in expert_ids[t][lyr]:
                for f in expert_ids[t][lyr + 1]:
                    out[lyr, int(e), int(f)] += 1
    return out


def decode_overlap_loop(expert_ids, request_id, position, phase) -> tuple[np.ndarray, int]:
    """Mean share of experts shared by consecutive decode tokens of one request, per layer [L], and the pair count.

    Tokens are matched by (request_id, position + 1), both in decode (phase 1), whatever their order in the trace.
    """
    T, L, K = np.shape(expert_ids)
    where = {(int(r), int(p)): t for t, (r, p, ph) in enumerate(zip(request_id, position, phase, strict=True))
             if ph == 1}
    total = np.zeros(L)
    pairs = 0
    for (r, p), t in where.items():
        u = where.get((r, p + 1))
        if u is None:
            continue
        pairs += 1
        for lyr in range(L):
            total[lyr] += len(set(expert_ids[t][lyr].tolist()) & set(expert_ids[u][lyr].tolist())) / K
    return (total / pairs if pairs else total * np.nan), pairs


def gini_loop(x) -> float:
    """Gini coefficient by its definition: sum_ij |x_i - x_j| / (2 n^2 mean)."""
    x = [float(v) for v in x]
    n, s = len(x), sum(x)
    return sum(abs(a - b) for a in x for b in x) / (2 * n * s)
