"""moeplace.plan.activation_clusters.pack_by_dispatch: a node's slots onto its GPUs balancing the pairs the balanced
dispatch puts on each slot and the pairs it receives from other nodes. The per-slot counts and the objective are
written out here in loops over the dispatch's picks."""

from __future__ import annotations

import numpy as np
from spec_packing import assert_node_slots_kept_no_twin

from moeplace.plan.activation_clusters import pack_by_dispatch
from moeplace.simulate.routing import balanced_gpus, build_route_tables


def instance(seed: int, L: int = 2, E: int = 12, N: int = 2, G: int = 3, S: int = 3, T: int = 240, K: int = 2):
    """Routing skewed per node of the token's home, and a node-major placement where every expert sits at most
    once on each node (so a (node, expert) pair names one slot). Returns ids, home, mb, phy2log, N, G, E."""
    rng = np.random.default_rng(seed)
    W = N * G
    per_node = G * S
    p2l = np.zeros((L, N * per_node), np.int64)
    for layer in range(L):
        order = rng.permutation(E)
        half = E // N
        rows = []
        for n in range(N):
            own = order[n * half:(n + 1) * half]
            other = np.setdiff1d(order, own)
            rows.append(np.r_[own, rng.choice(other, per_node - half, replace=False)])
        p2l[layer] = np.concatenate(rows)
    home = rng.integers(0, W, T)
    pref = rng.gamma(0.5, 1.0, (N, L, E))
    ids = np.zeros((T, L, K), np.int16)
    for t in range(T):
        for layer in range(L):
            p = pref[home[t] // G, layer] / pref[home[t] // G, layer].sum()
            ids[t, layer] = rng.choice(E, K, replace=False, p=p)
    mb = np.arange(T) // 60
    return ids, home, mb, p2l, N, G, E


def slot_counts(p2l, ids, home, mb, N, G, E):
    """(load, recv) dict (layer, node, expert) -> pairs served / received from other nodes, from the balanced
    dispatch's picks on ``p2l``, counted in loops."""
    L, P = p2l.shape
    W = N * G
    S = P // W
    rows = np.argsort(mb, kind="stable")
    _, cnt = np.unique(mb, return_counts=True)
    starts = np.r_[0, np.cumsum(cnt)]
    tab = build_route_tables(p2l, np.arange(P) // S, np.arange(W) // G, E)
    pick = balanced_gpus(ids, rows, home[rows], starts, tab, "balanced")
    load, recv = {}, {}
    for i, r in enumerate(rows):
        for layer in range(L):
            for k in range(ids.shape[2]):
                g = int(pick[i, layer, k])
                key = (layer, g // G, int(ids[r, layer, k]))
                load[key] = load.get(key, 0) + 1
                recv[key] = recv.get(key, 0) + int(g // G != home[r] // G)
    return load, recv


def objective(p2l, load, recv, N, G):
    """float [L, N]: max / mean of the per-GPU sums of each slot's served pairs, plus the same of received pairs,
    over each node's GPUs (slots priced by the counts of the original arrangement)."""
    L, P = p2l.shape
    S = P // (N * G)
    out = np.zeros((L, N))
    for layer in range(L):
        for n in range(N):
            a, b = np.zeros(G), np.zeros(G)
            for j in range(G):
                for s in range(S):
                    e = int(p2l[layer, (n * G + j) * S + s])
                    a[j] += load.get((layer, n, e), 0)
                    b[j] += recv.get((layer, n, e), 0)
            out[layer, n] = (a.max() / a.mean() if a.sum() else 0) + (b.max() / b.mean() if b.sum() else 0)
    return out


def test_same_slots_per_node_no_twin_on_a_gpu_and_the_dispatch_objective_never_rises():
    fell = False
    for seed in range(5):
        ids, home, mb, p2l, N, G, E = instance(seed)
        got = pack_by_dispatch(p2l, ids, home, mb, N, G, E)
        assert_node_slots_kept_no_twin(got, p2l, N, G)
        load, recv = slot_counts(p2l, ids, home, mb, N, G, E)
        before, after = objective(p2l, load, recv, N, G), objective(got, load, recv, N, G)
        assert (after <= before + 1e-9).all(), (seed, before, after)
        fell |= bool(after.sum() < before.sum() - 1e-6)
    assert fell


def test_unrouted_rows_are_ignored_and_a_row_budget_routes_whole_micro_batches():
    ids, home, mb, p2l, N, G, E = instance(0)
    assert (pack_by_dispatch(p2l, ids, home, np.full_like(mb, -1), N, G, E) == p2l).all()
    # a budget of 130 rows routes every second of the four 60-row micro-batches: the same as routing those alone
    half = np.where(np.isin(mb, [0, 2]), mb, -1)
    a = pack_by_dispatch(p2l, ids, home, mb, N, G, E, max_rows=130)
    b = pack_by_dispatch(p2l, ids, home, half, N, G, E)
    assert (a == b).all()
    assert (a == pack_by_dispatch(p2l, ids, home, mb, N, G, E, max_rows=130)).all()  # deterministic
