"""EPLB in numpy: the README example, no co-located replicas, loop reference, speed at DeepSeek-V3 scale."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from moeplace.placement import Placement
from moeplace.plan.base import ideal_gpu_load
from moeplace.plan.eplb import balanced_packing, rebalance, refine_packing, replicate_experts
from moeplace.simulate.routing import mean_balancedness as balancedness

# github.com/deepseek-ai/EPLB README: 2 layers x 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs
README_WEIGHT = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                          [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
README_PHY2LOG = np.array([[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                           [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])


def test_readme_example_reaches_published_balance():
    greedy = rebalance(README_WEIGHT, 16, 4, 2, 8, refine=False)
    np.testing.assert_array_equal(greedy, README_PHY2LOG)  # same semantics, same answer
    p2l = rebalance(README_WEIGHT, 16, 4, 2, 8)
    ours = balancedness(ideal_gpu_load(p2l, README_WEIGHT, 8))
    published = balancedness(ideal_gpu_load(README_PHY2LOG, README_WEIGHT, 8))
    assert ours >= published - 1e-12
    Placement(p2l, 12, 8)  # valid, no two replicas of one expert on one GPU
    # global policy at 2x4, R=4: 0.885; the twin-free optimum over every replication is 0.895 (bench/eplb_gap.py),
    # but EPLB's own replication already packs optimally, so no packing refinement can close that gap
    glob = balancedness(ideal_gpu_load(rebalance(README_WEIGHT, 16, 1, 2, 8), README_WEIGHT, 8))
    assert round(glob, 3) == 0.885


def exhaustive_max(weight: np.ndarray, key: np.ndarray, packs: int) -> float:
    """Least max pack weight over every twin-free assignment into equal packs (brute force)."""
    n = len(weight)
    best = np.inf
    for a in itertools.product(range(packs), repeat=n):
        if np.bincount(a, minlength=packs).tolist() != [n // packs] * packs:
            continue
        if len(set(zip(a, key.tolist(), strict=True))) < n:
            continue
        best = min(best, np.bincount(a, weights=weight, minlength=packs).max())
    return float(best)


def test_refinement_never_worse_and_gap_to_exhaustive():
    rng = np.random.default_rng(3)
    gaps = []
    for i in range(40):
        packs, n = [(2, 6), (3, 6), (2, 8), (4, 8)][i % 4]
        key = np.arange(n)
        key[n - 2:] = [0, 1]  # experts 0 and 1 have two replicas each
        w = rng.uniform(1, 3, n)
        w[n - 2:] = w[:2]
        pack, rank = balanced_packing(w[None], packs, key=key[None])
        rp, rr = refine_packing(w[None], pack, rank, packs, key=key[None])
        g = np.bincount(pack[0], weights=w, minlength=packs).max()
        r = np.bincount(rp[0], weights=w, minlength=packs).max()
        opt = exhaustive_max(w, key, packs)
        assert opt - 1e-12 <= r <= g + 1e-12
        assert (np.bincount(rp[0], minlength=packs) == n // packs).all()
        assert len(set(zip(rp[0].tolist(), key.tolist(), strict=True))) == n  # twin-free
        assert sorted(zip(rp[0].tolist(), rr[0].tolist(), strict=True)) == sorted((p, k) for p in range(packs)
                                                                     for k in range(n // packs))
        gaps.append(r / opt - 1)
    print(f"refined vs exhaustive: mean gap {np.mean(gaps):.4f}, max {np.max(gaps):.4f}")
    assert np.mean(gaps) < 0.02


def test_refinement_lowers_a_bad_greedy():
    # greedy (heaviest first into the lightest pack): 5 -> A, 4 -> B, 3 -> B, 3 -> A, 3 -> ... sizes 3 per pack
    w = np.array([[5.0, 4, 3, 3, 3, 2]])
    pack, rank = balanced_packing(w, 2)
    g = np.bincount(pack[0], weights=w[0]).max()
    rp, _ = refine_packing(w, pack, rank, 2)
    r = np.bincount(rp[0], weights=w[0]).max()
    assert r <= g and r == exhaustive_max(w[0], np.arange(6), 2)


def _packing_loop(weight: np.ndarray, num_packs: int, key: np.ndarray) -> np.ndarray:
    """Plain per-row reference of balanced_packing with the no-shared-key rule (no stuck rows expected)."""
    X, n = weight.shape
    per = n // num_packs
    out = np.full((X, n), -1)
    for x in range(X):
        w = [0.0] * num_packs
        cnt = [0] * num_packs
        keys: list[set] = [set() for _ in range(num_packs)]
        for i in np.argsort(-weight[x], kind="stable"):
            ok = [p for p in range(num_packs) if cnt[p] < per and key[x, i] not in keys[p]]
            p = min(ok, key=lambda p: (w[p], p))
            out[x, i] = p
            w[p] += weight[x, i]
            cnt[p] += 1
            keys[p].add(key[x, i])
    return out


def test_packing_matches_loop_reference():
    rng = np.random.default_rng(1)
    w = rng.pareto(1.2, (20, 24)) + 0.01
    key = np.tile(np.arange(24), (20, 1))
    pack, rank = balanced_packing(w, 6, key=key)
    np.testing.assert_array_equal(pack, _packing_loop(w, 6, key))
    assert (np.bincount(pack.ravel(), minlength=6) == 20 * 4).all()


@pytest.mark.parametrize("groups,nodes,gpus,slots", [(1, 4, 8, 48), (8, 4, 8, 64), (4, 2, 8, 48), (1, 1, 4, 40)])
def test_never_two_replicas_on_one_gpu(groups, nodes, gpus, slots):
    rng = np.random.default_rng(groups * 100 + gpus)
    E = 32
    load = rng.pareto(0.8, (16, E)) * 100
    load[:, 0] *= 1000  # one extremely hot expert wants more replicas than GPUs
    p2l = rebalance(load, slots, groups, nodes, gpus)
    pl = Placement(p2l, E, gpus)  # raises on co-located replicas
    assert pl.replica_count.min() >= 1
    assert balancedness(ideal_gpu_load(p2l, load, gpus)) > 0.3


def test_replicate_caps_replicas():
    w = np.array([[1000.0, 1, 1, 1]])
    phy2log, _, cnt = replicate_experts(w, 8, max_replicas=3)
    assert cnt.max() == 3 and cnt.sum() == 8


def test_deepseek_v3_scale_under_100ms():
    rng = np.random.default_rng(0)
    load = rng.pareto(1.5, (58, 256)) * 100
    rebalance(load, 288, 8, 4, 32)
    best = min(_timed(lambda: rebalance(load, 288, 8, 4, 32)) for _ in range(3))
    assert best < 0.1, f"hierarchical EPLB took {best * 1000:.1f} ms"
    p2l = rebalance(load, 288, 1, 4, 32)
    Placement(p2l, 256, 32)


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t
