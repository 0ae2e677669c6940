"""EPLB rebalance speed at DeepSeek-V3 scale: 58 MoE layers x 256 experts, 288 slots on 32 GPUs in 4 nodes.

Usage: python bench/eplb_speed.py [--repeats 10] [--json OUT.json]
Target: under 100 ms per full rebalance (all layers at once, vectorised across layers).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from moeplace.placement import Placement
from moeplace.plan.base import ideal_gpu_load
from moeplace.plan.eplb import rebalance
from moeplace.simulate.routing import mean_balancedness as balancedness


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", help="write the timings here")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    load = rng.pareto(1.5, (58, 256)) * 1000  # skewed per-layer expert load
    out = {"shape": "L=58 E=256 P=288 W=32 N=4", "repeats": args.repeats, "policies": {}}
    for policy, groups in (("hierarchical (8 groups)", 8), ("global", 1)):
        rebalance(load, 288, groups, 4, 32)  # warm-up
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            p2l = rebalance(load, 288, groups, 4, 32)
            times.append(time.perf_counter() - t)
        Placement(p2l, 256, 32)  # valid: every expert placed, no two replicas on one GPU
        bal = balancedness(ideal_gpu_load(p2l, load, 32))
        ms = np.array(times) * 1e3
        out["policies"][policy] = {"median_ms": float(np.median(ms)), "min_ms": float(ms.min()),
                                   "balancedness": bal}
        print(f"{policy:<24} median {np.median(ms):7.1f} ms   min {ms.min():7.1f} ms   balancedness {bal:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
