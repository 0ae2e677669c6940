"""joint internals: the robust balance term (fold loads) stays exact under moves; homes for large windows."""

from __future__ import annotations

import numpy as np

from moeplace.placement import Cluster
from moeplace.placement.grouper import Grouper, assign_rounds
from moeplace.plan import workload_from_tokens
from moeplace.plan.joint import LayerSearch, fold_use, request_folds, serve_table
from moeplace.plan.joint_common import assign_all, signal_features, use_by_gpu


def test_request_folds_partition_evenly():
    f = request_folds(103, 8, np.random.default_rng(0))
    counts = np.bincount(f, minlength=8)
    assert counts.sum() == 103 and counts.max() - counts.min() <= 1


def test_fold_use_sums_to_window_use():
    rng = np.random.default_rng(1)
    Rq, T, L, K, W, E = 30, 400, 3, 2, 4, 8
    tok_req = rng.integers(0, Rq, T)
    ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(T)])
    homes = rng.integers(0, W, Rq)
    fold = request_folds(Rq, 5, rng)
    fu, use = fold_use(tok_req, ids, homes, fold, W, E)
    assert fu.shape == (L, 5, W, E)
    np.testing.assert_allclose(use, use_by_gpu(tok_req, ids, homes, W, E))
    sel = np.isin(tok_req, np.flatnonzero(fold == 2))
    np.testing.assert_allclose(fu[:, 2], use_by_gpu(tok_req[sel], ids[sel], homes, W, E))


def test_robust_fold_loads_stay_exact_under_moves():
    rng = np.random.default_rng(2)
    S, G, W, E, F = 3, 2, 4, 10, 6
    p2l = np.concatenate([rng.permutation(E), rng.choice(E, W * S - E, replace=False)])
    fu = rng.gamma(1.0, 5.0, (F, W, E))
    use = fu.sum(axis=0)
    cap = use.sum() / W / 0.95
    cluster = Cluster(W // G, G)
    home = rng.integers(0, W, 300)
    ids = np.stack([rng.choice(E, 2, replace=False) for _ in range(300)])
    s = LayerSearch(p2l, cluster, use, cap, 4.0, home, ids, fold_use=fu, robust=0.5)
    plain = LayerSearch(p2l, cluster, use, cap, 4.0, home, ids)
    assert s.overflow(s.load, s.fold_load) >= plain.overflow(plain.load)  # the spread only adds load
    moves, hit = s.run(rng, max_evals=10_000, max_passes=3)
    assert moves > 0 and not hit
    serve = serve_table(s.p2l, cluster, E)
    want = np.stack([np.bincount(serve.ravel(), weights=fu[f].ravel(), minlength=W) for f in range(F)])
    np.testing.assert_allclose(s.fold_load, want, atol=1e-9)
    np.testing.assert_allclose(s.load, want.sum(axis=0), atol=1e-9)


def test_assign_all_matches_per_request_features():
    rng = np.random.default_rng(3)
    n = 3000
    rid = np.sort(rng.integers(0, 500, n))
    phase = (rng.random(n) < 0.4).astype(np.int8)
    ids = rng.integers(0, 16, (n, 6, 2)).astype(np.int16)
    w = workload_from_tokens(rid, phase, ids, 16)
    for layers in (None, [0, 3, 5]):
        d = 16 * (6 if layers is None else 3)
        g = Grouper(np.abs(rng.normal(size=(4, d))).astype(np.float32), 2, 64, kind="centroids", layers=layers)
        scores = signal_features(w, np.arange(w.num_requests), layers) @ g.weights.T
        np.testing.assert_array_equal(assign_all(g, w, chunk=128), assign_rounds(scores, 2, 64))
