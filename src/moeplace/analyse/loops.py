"""Compiled loops of the analysis (numba): scatter-adding expert pairs into E x E counters is a loop by nature
(every pair is one increment of a counter another pair may hit), so it is a loop here rather than ``np.bincount``
over concatenated pair arrays (which built K(K-1)/2 or K*K index arrays per layer first: 41% of ``analyze``'s time
under cProfile on the 1.4 GB DeepSeek-V3-shaped trace of bench/scale.py).

Shape legend: L = MoE layers, K = top-k, T = tokens, E = logical experts.

``cache=True`` keeps the compiled code in __pycache__ next to this file (the first run of a checkout compiles).
"""

from __future__ import annotations

import numpy as np
from numba import njit

SPAN = 1 << 24  # tokens per int32 pass: each adds at most K * K <= 64 to a counter, so no counter overflows


@njit(cache=True, nogil=True)
def in_range(ids, num_experts):  # pragma: no cover - compiled
    """Whether every id of ids int [L, K, T] lies in [0, E) (checked before any counter is written)."""
    for v in ids.ravel():
        if v < 0 or v >= num_experts:
            return False
    return True


@njit(cache=True, nogil=True)
def add_request_counts(token_request, expert_ids, out):  # pragma: no cover - compiled
    """Add every selection into ``out`` [Rq, L, E]: ``out[token_request[t], l, expert_ids[t, l, k]] += 1``.

    token_request: int [T]; expert_ids: int [T, L, K]. Returns -1, or the first row whose request or expert id is
    out of range (nothing after it is added). A float32 counter is exact up to 2^24 selections.
    """
    T, L, K = expert_ids.shape
    R, E = out.shape[0], out.shape[2]
    for t in range(T):
        r = token_request[t]
        if r < 0 or r >= R:
            return t
        for layer in range(L):
            for k in range(K):
                e = expert_ids[t, layer, k]
                if e < 0 or e >= E:
                    return t
                out[r, layer, e] += 1
    return -1


@njit(cache=True, nogil=True)
def add_pairs(ids, num_experts, out, step):  # pragma: no cover - compiled
    """Add expert pairs into ``out`` [L - step, E * E]: ``out[l, ids[l, a, t] * E + ids[l + step, b, t]] += 1``,
    over router slots a < b within a layer (step 0) or all a, b of consecutive layers (step 1).

    ids: int [L, K, T]. Each layer counts into an int32 [E * E] table first (half the cache of int64: 2x faster
    measured) and adds it to ``out`` after at most :data:`SPAN` tokens. Returns False (adding nothing) when an id
    lies outside [0, E), so a bad id can never write outside the counters.
    """
    L, K, T = ids.shape
    E = num_experts
    if not in_range(ids, E):
        return False
    tmp = np.zeros(E * E, np.int32)
    for lyr in range(L - step):
        for s in range(0, T, SPAN):
            tmp[:] = 0
            for t in range(s, min(T, s + SPAN)):
                for a in range(K):
                    x = ids[lyr, a, t] * E
                    for b in range(a + 1 if step == 0 else 0, K):
                        tmp[x + ids[lyr + step, b, t]] += 1
            out[lyr] += tmp
    return True


def pair_counts(ids_LKT: np.ndarray, num_experts: int, interlayer: bool,
                out: np.ndarray | None = None) -> np.ndarray:
    """Pair counts of ids_LKT int [L, K, T] added into ``out`` (int64 [L, E * E] within layers, [L - 1, E * E]
    between them; a new zero array when None) and returned; ValueError on an id outside [0, E)."""
    L = ids_LKT.shape[0]
    E = int(num_experts)
    shape = (max(L - 1, 0) if interlayer else L, E * E)
    if out is None:
        out = np.zeros(shape, np.int64)
    elif out.shape != shape or out.dtype != np.int64 or not out.flags.c_contiguous:
        raise ValueError(f"out: expected C-contiguous int64 {shape}, got {out.dtype} {out.shape}")
    if ids_LKT.shape[1] < (1 if interlayer else 2):
        return out
    ok = add_pairs(ids_LKT, E, out, 1 if interlayer else 0)
    if not ok:
        raise ValueError(f"expert_ids: ids must lie in [0, {E})")
    return out
