"""EPLB packing: greedy, greedy + swap refinement, and the exhaustive twin-free optimum.

Usage:
  python bench/eplb_gap.py [--instances 300] [--json PATH]

1. Random small instances: n items (Pareto weights, a few keys repeated as replicas of one expert) into packs of
   equal size; max pack weight of ``balanced_packing`` (greedy), of ``refine_packing`` after it, and the exhaustive
   twin-free optimum (every assignment, no two items of one key in a pack). Gap = max / optimum - 1.
2. DeepSeek EPLB's README example (2 layers x 12 experts, 16 slots, 2 nodes x 4 GPUs, global policy): EPLB's
   balancedness (ideal split of each expert's load over its replicas) with and without the refinement, the twin-free
   optimum for EPLB's own replication (exhaustive packing), and over every replication (replica counts <= 8 with
   sum 16; with 2 slots per GPU the best pairing of sorted items is largest with smallest, checked twin-free).
Writes bench/results/eplb_gap.json.
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np
from common import BenchRun

README_WEIGHT = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                          [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]], np.float64)


def exhaustive(weight: np.ndarray, key: np.ndarray, packs: int) -> float:
    """Least max pack weight over every twin-free assignment of the items to ``packs`` equal packs."""
    n = len(weight)
    per = n // packs
    best = np.inf
    for a in itertools.product(range(packs), repeat=n):
        if a[0] != 0:
            break  # pack labels are symmetric
        cnt = np.bincount(a, minlength=packs)
        if (cnt != per).any():
            continue
        if len({(p, k) for p, k in zip(a, key.tolist(), strict=True)}) < n:
            continue
        best = min(best, np.bincount(a, weights=weight, minlength=packs).max())
    return float(best)


def pair_optimum(items: np.ndarray, per: np.ndarray) -> float:
    """Least max GPU load packing ``items`` (expert ids) two per GPU, twin-free (never an expert with itself).

    Without the twin rule, largest with smallest is optimal (exchange argument); that pairing is the bound, and
    when it pairs twins a branch and bound over partners of the heaviest unpaired item finds the optimum.
    """
    w = per[items]
    o = np.argsort(-w, kind="stable")
    n = len(items)
    pairs = [(o[i], o[n - 1 - i]) for i in range(n // 2)]
    if all(items[a] != items[b] for a, b in pairs):
        return float(max(w[a] + w[b] for a, b in pairs))
    best = [np.inf]

    def rec(left: list[int], cur: float) -> None:
        if not left:
            best[0] = min(best[0], cur)
            return
        a, rest = left[0], left[1:]
        for b in reversed(rest):  # lightest partners first
            v = max(cur, w[a] + w[b])
            if items[a] != items[b] and v < best[0]:
                rec([x for x in rest if x != b], v)

    rec(list(o), 0.0)
    return best[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    run = BenchRun("eplb_gap", baseline="EPLB's greedy balanced packing on the same items (and the exhaustive "
                                        "twin-free optimum)")
    from moeplace.plan.base import ideal_gpu_load
    from moeplace.plan.eplb import balanced_packing, rebalance, refine_packing
    from moeplace.simulate.routing import mean_balancedness

    rng = np.random.default_rng(0)
    gaps_g, gaps_r, improved = [], [], 0
    for _ in range(args.instances):
        packs, n = [(2, 4), (2, 6), (2, 8), (3, 6), (3, 9), (4, 8)][int(rng.integers(0, 6))]
        key = rng.integers(0, n, n)  # repeated keys: replicas of one expert
        key = np.minimum(key, np.arange(n))
        while any((key == k).sum() > packs for k in set(key.tolist())):
            key = np.arange(n)
        w = rng.uniform(1.0, 3.0, n)  # comparable weights: the hard case for a greedy
        w = np.array([w[key[i]] for i in range(n)])  # replicas of one expert weigh the same
        pack, rank = balanced_packing(w[None], packs, key=key[None])
        rp, _ = refine_packing(w[None], pack, rank, packs, key=key[None])
        g = np.bincount(pack[0], weights=w, minlength=packs).max()
        r = np.bincount(rp[0], weights=w, minlength=packs).max()
        opt = exhaustive(w, key, packs)
        assert r <= g + 1e-12 and opt <= r + 1e-12
        gaps_g.append(g / opt - 1)
        gaps_r.append(r / opt - 1)
        improved += r < g - 1e-12
    gg, gr = np.array(gaps_g), np.array(gaps_r)
    random_res = {"instances": args.instances, "greedy_mean_gap": float(gg.mean()), "greedy_max_gap": float(gg.max()),
                  "greedy_optimal_share": float((gg < 1e-12).mean()), "refined_mean_gap": float(gr.mean()),
                  "refined_max_gap": float(gr.max()), "refined_optimal_share": float((gr < 1e-12).mean()),
                  "refinement_improved_share": float(improved / args.instances)}

    W = README_WEIGHT
    readme: dict = {}
    for ref in (False, True):
        p2l = rebalance(W, 16, 1, 2, 8, refine=ref)
        readme["refined" if ref else "greedy"] = mean_balancedness(ideal_gpu_load(p2l, W, 8))
    p2l = rebalance(W, 16, 1, 2, 8, refine=False)
    same, best = [], []
    for layer in range(2):
        cnt = np.bincount(p2l[layer], minlength=12)
        per = W[layer] / cnt
        same.append(W[layer].sum() / 8 / pair_optimum(p2l[layer], per))
        top = np.inf
        for combo in itertools.combinations_with_replacement(range(12), 4):
            c = np.ones(12, np.int64)
            np.add.at(c, list(combo), 1)
            items = np.repeat(np.arange(12), c)
            top = min(top, pair_optimum(items, W[layer] / c))
        best.append(W[layer].sum() / 8 / top)
    readme["optimum_same_replication"] = float(np.mean(same))
    readme["optimum_any_replication"] = float(np.mean(best))
    print("random:", random_res)
    print("readme:", readme)
    run.write({"params": {"instances": args.instances, "seed": 0, "readme": "2 layers x 12 experts, 16 slots, 2x4, "
                          "global policy (num_groups 1)"},
               "excluded": "nothing is timed",
               "results": {"random": random_res, "readme": readme}}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
