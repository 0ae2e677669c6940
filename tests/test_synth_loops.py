"""The synthetic generator's compiled loops against numpy definitions, and its read-ahead thread."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from moeplace.simulate.loops import by_ranges
from moeplace.simulate.synth import read_ahead
from moeplace.simulate.synth_loops import guide_table, search_rows, switch_fill


def rows_like_the_generator(rng, n_rows, width, zeros=0.0):
    """flat [n_rows * width]: per-row cumulative probabilities plus the row index (ties where weights are 0)."""
    w = np.exp(rng.standard_normal((n_rows, width)) * 2.5)
    w[rng.random((n_rows, width)) < zeros] = 0.0
    w[:, -1] += 1e-300  # a row is never all zero
    cum = np.cumsum(w, -1)
    cum /= cum[:, -1:]
    return (cum + np.arange(n_rows)[:, None]).ravel()


@pytest.mark.parametrize("zeros", [0.0, 0.6])
def test_search_rows_is_searchsorted_inside_the_row(zeros):
    rng = np.random.default_rng(5)
    n_rows, width = 12, 64
    flat = rows_like_the_generator(rng, n_rows, width, zeros)
    row = rng.integers(0, n_rows, 20_000)
    v = rng.random(len(row)) + row
    # values exactly on the row's entries, on bucket edges, at the row's start and its end
    edge = np.concatenate([flat[row[:500] * width + rng.integers(0, width, 500)], row[500:550] + 0.0,
                           row[550:600] + 1.0, row[600:650] + rng.integers(0, width + 1, 50) / width])
    v = np.concatenate([edge, v[650:]])
    assert len(v) == len(row)
    got = search_rows(flat, guide_table(flat, n_rows, width), v, row, width)
    # below row + 1 the global search counts the earlier rows (all <= row) and nothing of the later ones
    inside = v < row + 1
    want = np.searchsorted(flat, v[inside], side="right") - row[inside] * width
    assert inside.sum() > 19_000 and np.array_equal(got[inside], want)
    assert (got[~inside] == width).all()  # at row + 1 every entry of the row is <= v


def reference_fill(switch, u, fu, affinity, prev, partner, flat, pl, slot_group, H, Eg):
    """The same layer with numpy: draws in np.nonzero order, partners where fu < affinity, forward fill."""
    R, T, K = switch.shape
    rr, tt, kk = np.nonzero(switch)
    dec = (tt >= pl[rr]).astype(np.int64)
    row = (rr * 2 + dec) * H + slot_group[kk]
    pos = np.clip(np.searchsorted(flat, u + row, side="right") - row * Eg, 0, Eg - 1)
    val = slot_group[kk] * Eg + pos
    if len(fu):
        f = fu < affinity
        val[f] = partner[prev[rr[f], tt[f], kk[f]]]
    out = np.empty((R, T, K), np.int64)
    vals = iter(val.tolist())
    for r in range(R):
        for t in range(T):
            for k in range(K):
                out[r, t, k] = next(vals) if switch[r, t, k] else out[r, t - 1, k]
    return out


@pytest.mark.parametrize("follow", [False, True])
def test_switch_fill_matches_numpy_in_any_request_split(follow):
    rng = np.random.default_rng(11)
    R, T, K, H, Eg = 7, 30, 4, 2, 16
    E = H * Eg
    flat = rows_like_the_generator(rng, R * 2 * H, Eg, 0.3)
    switch = rng.random((R, T, K)) < 0.4
    switch[:, 0] = True
    pl = rng.integers(1, T, R)
    n = int(switch.sum())
    u = rng.random(n)
    fu = rng.random(n) if follow else np.empty(0)
    prev = rng.integers(0, E, (R, T, K))
    partner = rng.permutation(E)
    slot_group = np.arange(K) // (K // H)
    offsets = np.concatenate([[0], np.cumsum(switch.reshape(R, -1).sum(1))[:-1]]).astype(np.int64)
    guide = guide_table(flat, R * 2 * H, Eg)
    want = reference_fill(switch, u, fu, 0.5, prev, partner, flat, pl, slot_group, H, Eg)
    one = np.empty((R, T, K), np.int64)
    switch_fill(switch, u, fu, 0.5, prev, partner, flat, guide, pl, slot_group, H, Eg, offsets, one, 0, R)
    threaded = np.empty((R, T, K), np.int64)
    by_ranges(switch_fill, R, switch, u, fu, 0.5, prev, partner, flat, guide, pl, slot_group, H, Eg, offsets,
              threaded)
    assert np.array_equal(one, want) and np.array_equal(threaded, want)


def test_read_ahead_keeps_order_raises_and_stops():
    assert list(read_ahead(iter(range(50)), depth=2)) == list(range(50))

    def failing():
        yield 1
        raise ValueError("bad batch")

    it = read_ahead(failing())
    assert next(it) == 1
    with pytest.raises(ValueError, match="bad batch"):
        next(it)

    made = []

    def endless():
        i = 0
        while True:
            made.append(i)
            yield i
            i += 1

    before = threading.active_count()
    it = read_ahead(endless(), depth=2)
    assert next(it) == 0
    it.close()  # the consumer stops (an abort of the writer): the thread stops too, at most depth + 2 made
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == before
    assert len(made) <= 4
