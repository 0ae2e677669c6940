"""Compiled check of routing ids (numba): the reader validates every expert id it decodes, and on a DeepSeek-V3-
shaped trace (464 ids per token) sorting each token's top-k to find a repeat was 15% of ``analyze``'s time; one
pass over the ids with K(K-1)/2 comparisons per token-layer gives the range and whether any top-k repeats.

The messages stay where they were (:func:`moeplace.trace.format.check_expert_ids`): this only says whether there
is something to report. ``cache=True`` keeps the compiled code in __pycache__ next to this file.
"""

from __future__ import annotations

from numba import njit


@njit(cache=True, nogil=True)
def id_range_and_repeat(ids):  # pragma: no cover - compiled
    """(min id, max id, whether a token repeats an expert within one layer's top-k) of ids int [T, L, K] (T > 0)."""
    T, L, K = ids.shape
    lo = ids[0, 0, 0]
    hi = ids[0, 0, 0]
    rep = False
    for t in range(T):
        for lyr in range(L):
            for a in range(K):
                v = ids[t, lyr, a]
                if v < lo:
                    lo = v
                if v > hi:
                    hi = v
                for b in range(a):
                    if ids[t, lyr, b] == v:
                        rep = True
    return lo, hi, rep
