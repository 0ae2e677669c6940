"""Compiled loops of the synthetic generator (:mod:`moeplace.simulate.synth`): drawing experts from per-row
cumulative distributions, filling a layer's slots, and finding duplicate experts in a token.

The draw is ``searchsorted(flat, x, "right")`` inside one row of ``flat`` (rows of ``width`` cumulative
probabilities, each plus its row index). :func:`count_le` answers it exactly from a bucket table
(:func:`guide_table`): it starts at the bucket of ``x`` and walks to the boundary, a few steps instead of a binary
search's eight dependent loads. The kernels release the GIL; :func:`switch_fill` fills a range of requests, so
disjoint ranges run in threads (:func:`moeplace.simulate.loops.by_ranges`) and give the same array.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def later_duplicates(ids: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """bool [R, T, K]: slot j of a token holds an expert one of its slots 0..j-1 holds. ids: int64 [R, T, K]."""
    R, T, K = ids.shape
    out = np.zeros((R, T, K), np.bool_)
    for r in range(R):
        for t in range(T):
            for j in range(1, K):
                v = ids[r, t, j]
                for i in range(j):
                    if ids[r, t, i] == v:
                        out[r, t, j] = True
                        break
    return out


@njit(cache=True, nogil=True)
def switch_fill(switch: np.ndarray, u: np.ndarray, fu: np.ndarray, affinity: float, prev: np.ndarray,
                partner: np.ndarray, flat: np.ndarray, guide: np.ndarray, pl: np.ndarray, slot_group: np.ndarray,
                H: int, Eg: int, offsets: np.ndarray, out: np.ndarray, r0: int, r1: int
                ) -> None:  # pragma: no cover - compiled
    """Rows ``r0..r1`` of one layer's expert ids, written into ``out`` (int64 [R, T, K]).

    A slot that switches (bool ``switch`` [R, T, K], every slot switching at t = 0) takes the next draw, in
    ``np.nonzero(switch)`` order (request ``r``'s first switch is draw ``offsets[r]``); elsewhere it keeps its
    expert of t - 1. Draw ``c`` of row ``(r * 2 + decode) * H + slot_group[k]`` is ``searchsorted(flat, u[c] +
    row, "right") - row * Eg`` clipped to [0, Eg), shifted into the slot's group (``flat``: rows of Eg cumulative
    probabilities, each plus its row index; ``guide``: its :func:`guide_table`); when ``fu`` is given (float64 [n],
    else empty) and ``fu[c] < affinity``, the draw is the partner (int64 [E]) of the slot's expert at the layer
    before (``prev`` [R, T, K]) instead.
    """
    T, K = switch.shape[1], switch.shape[2]
    follow = len(fu) > 0
    for r in range(r0, r1):
        c = offsets[r]
        for t in range(T):
            dec = 1 if t >= pl[r] else 0
            for k in range(K):
                if switch[r, t, k]:
                    row = (r * 2 + dec) * H + slot_group[k]
                    pos = min(count_le(flat, guide, u[c] + row, row, Eg), Eg - 1)
                    v = slot_group[k] * Eg + pos
                    if follow and fu[c] < affinity:
                        v = partner[prev[r, t, k]]
                    out[r, t, k] = v
                    c += 1
                else:
                    out[r, t, k] = out[r, t - 1, k]


@njit(cache=True, nogil=True)
def guide_table(flat: np.ndarray, n_rows: int, width: int) -> np.ndarray:  # pragma: no cover - compiled
    """int32 [n_rows, width + 1]: entry (r, j) is how many values of row r of ``flat`` (rows of ``width`` sorted
    values in [r, r + 1]) are <= r + j / width: where a search for a value in bucket j of the row may start."""
    g = np.empty((n_rows, width + 1), np.int32)
    for r in range(n_rows):
        lo = r * width
        i = 0
        for j in range(width + 1):
            x = r + j / width
            while i < width and flat[lo + i] <= x:
                i += 1
            g[r, j] = i
    return g


@njit(cache=True, nogil=True)
def count_le(flat: np.ndarray, guide: np.ndarray, x: float, r: int, width: int) -> int:  # pragma: no cover
    """How many values of row r of ``flat`` are <= x: ``searchsorted(flat, x, "right") - r * width`` inside the
    row. Starts at the guide's bucket and walks to the boundary, so it is exact whatever the guide's rounding."""
    lo = r * width
    j = int((x - r) * width)
    j = min(max(j, 0), width)
    a = guide[r, j]
    while a > 0 and flat[lo + a - 1] > x:
        a -= 1
    while a < width and flat[lo + a] <= x:
        a += 1
    return a


@njit(cache=True, nogil=True)
def search_rows(flat: np.ndarray, guide: np.ndarray, v: np.ndarray, row: np.ndarray, width: int
                 ) -> np.ndarray:  # pragma: no cover - compiled
    """int64 [n]: ``searchsorted(flat, v, side="right") - row * width`` searched inside row ``row`` only (rows of
    ``width`` sorted values, each at least its row index and at most one more, as the draw builds them; a value past
    its row gives ``width``, which the caller clips as it clipped the global search's answer)."""
    out = np.empty(len(v), np.int64)
    for i in range(len(v)):
        out[i] = count_le(flat, guide, v[i], row[i], width)
    return out
