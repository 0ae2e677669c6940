"""EPLB rebalance speed at DeepSeek-V3 scale (58 MoE layers x 256 experts, 288 slots on 32 GPUs in 4 nodes),
``moeplace.plan.eplb.rebalance`` against the published algorithm in plain torch (bench/eplb_torch.py).

Both get the same skewed per-layer load (Pareto, seed 0), both policies: hierarchical (8 expert groups) and global
(1 group). Reported per policy: median and min time of each, the time ratio, and the balancedness of both outputs
(mean / max GPU load per layer, averaged, with each expert's load split evenly over its replicas). The torch
baseline is first checked against the example in EPLB's README (it must reproduce the published placement).

    python bench/eplb_speed.py [--repeats 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from common import BenchRun, median
from eplb_torch import rebalance as rebalance_torch

from moeplace.placement import Placement
from moeplace.plan.base import ideal_gpu_load
from moeplace.plan.eplb import rebalance
from moeplace.simulate.routing import mean_balancedness as balancedness

L, E, P, W, N = 58, 256, 288, 32, 4
# github.com/deepseek-ai/EPLB README example: 2 layers x 12 experts, 16 slots, 4 groups, 2 nodes, 8 GPUs
README_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                 [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def timed(fn, repeats: int) -> tuple[list[float], object]:
    fn()  # warm-up
    out, times = None, []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return times, out


def shared_gpu_replicas(p2l: np.ndarray) -> int:
    """Slots that hold an expert already held by another slot of the same GPU (wasted slots), over all layers."""
    g = p2l.reshape(p2l.shape[0], W, P // W)
    return int(sum(len(row) - len(set(row)) for layer in g for row in layer.tolist()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10, help="timed calls of moeplace per policy (median)")
    ap.add_argument("--torch-repeats", type=int, default=3, help="timed calls of the torch baseline per policy")
    ap.add_argument("--json", help="write here instead of bench/results/eplb_speed.json")
    args = ap.parse_args()
    run = BenchRun("eplb_speed", baseline="DeepSeek EPLB (published algorithm) in plain torch: bench/eplb_torch.py")
    ex = rebalance_torch(torch.tensor(README_WEIGHT), 16, 4, 2, 8).numpy()
    if not np.array_equal(ex, README_PHY2LOG):
        raise SystemExit(f"eplb_speed: the torch baseline does not reproduce EPLB's README example: {ex.tolist()}")
    load = np.random.default_rng(0).pareto(1.5, (L, E)) * 1000  # skewed per-layer expert load
    load_t = torch.from_numpy(load)
    policies = {}
    for policy, groups in (("hierarchical", 8), ("global", 1)):
        ours_t, p2l = timed(lambda g=groups: rebalance(load, P, g, N, W), args.repeats)
        base_t, p2l_t = timed(lambda g=groups: rebalance_torch(load_t, P, g, N, W).numpy(), args.torch_repeats)
        Placement(p2l, E, W)  # valid: every expert placed, no two replicas on one GPU
        if not all(np.isin(np.arange(E), row).all() for row in p2l_t):
            raise SystemExit(f"eplb_speed: torch baseline ({policy}) left an expert without a slot")
        bal, bal_t = (balancedness(ideal_gpu_load(x, load, W)) for x in (p2l, p2l_t))
        row = {"num_groups": groups, "moeplace_ms": [t * 1e3 for t in ours_t],
               "torch_ms": [t * 1e3 for t in base_t], "moeplace_median_ms": median(ours_t) * 1e3,
               "torch_median_ms": median(base_t) * 1e3, "speedup_vs_torch": median(base_t) / median(ours_t),
               "balancedness": bal, "torch_balancedness": bal_t, "balancedness_diff": bal - bal_t,
               "torch_shared_gpu_replicas": shared_gpu_replicas(p2l_t), "same_phy2log": bool(np.array_equal(p2l,
                                                                                                         p2l_t))}
        policies[policy] = row
        print(f"{policy:<13} moeplace median {row['moeplace_median_ms']:7.1f} ms   torch median "
              f"{row['torch_median_ms']:7.1f} ms   -> {row['speedup_vs_torch']:.1f}x   balancedness {bal:.4f} vs "
              f"{bal_t:.4f} (torch; {row['torch_shared_gpu_replicas']} slots repeat an expert on its GPU)",
              flush=True)
    run.write({"params": {"L": L, "E": E, "P": P, "W": W, "N": N, "load": "pareto(1.5) x 1000, seed 0",
                          "repeats": args.repeats, "torch_repeats": args.torch_repeats,
                          "torch_threads": torch.get_num_threads()},
               "excluded": "one untimed warm-up call per implementation and policy",
               "results": policies}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
