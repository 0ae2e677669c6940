"""Replica rules per micro-batch: how much balance and layer time the balanced rules recover, per strategy.

Usage:
  python bench/replica_rules.py [--cluster 4x2] [--redundant 8] [--no-gpt-oss] [--json PATH]

For each workload (the bundled reference trace, and gpt-oss-20b decode routing when ../shared/data has it),
strategies linear, eplb and activation-clusters are planned on 75% of the requests (random split, seed 0) and
scored by the simulator on the other 25%, held-out decode micro-batches in a seeded mixed arrival order
(``moeplace.evaluate``, ``arrival="mixed"``), once per replica rule: nearest-least-loaded (the default),
balanced (least max load; SGLang's LP balancer ignores locality likewise) and balanced-local (max load +
locality cost, :class:`moeplace.simulate.ReplicaCosts` defaults). The bundled trace is scored with
DeepSeek-V3-sized vectors (hidden 7168, expert width 2048), gpt-oss-20b with its own metadata. Reported per
strategy and rule: median per-micro-batch balancedness, mean predicted layer time per micro-batch and layer, the
ratio of that time to the default rule's, and inter-node bytes. Writes bench/results/replica_rules.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common import BenchRun

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "src" / "moeplace" / "data" / "reference-default.trace"
STRATEGIES = ("linear", "eplb", "activation-clusters")
RULES = ("nearest-least-loaded", "balanced", "balanced-local")


def bench_workload(trace_path: Path, cluster, redundant: int, cost) -> dict:
    from moeplace.evaluate import score_plan, split_windows
    from moeplace.plan import make_plan
    from moeplace.trace.reader import read_trace

    tr = read_trace(trace_path)
    win = split_windows(tr, 0.25, "random", 0, arrival="mixed")
    out: dict = {"trace": tr.meta.model, "held_out_requests": int(len(win.held.requests)), "strategies": {}}
    for name in STRATEGIES:
        plan = make_plan(name, win.plan_work, cluster, redundant, seed=0)
        rows: dict = {}
        for rule in RULES:
            t0 = time.perf_counter()
            j = score_plan(plan, win, cost=cost, rule=rule)
            L = len(j["balancedness"]["per_layer"])
            B = max(j["num_microbatches"], 1)
            rows[rule] = {
                "balancedness_median_microbatch": j["balancedness"]["median_microbatch"],
                "balancedness_total": j["balancedness"]["total"],
                "layer_time_us": j["layer_time_s"]["total"] / (B * L) * 1e6,
                "inter_node_bytes": j["inter_node_bytes"]["total"],
                "node_local_rate": j["node_local_rate"]["total"],
                "score_seconds": time.perf_counter() - t0,
            }
        base = rows[RULES[0]]
        for rule in RULES:
            r = rows[rule]
            r["time_vs_nearest"] = r["layer_time_us"] / base["layer_time_us"]
            r["inter_node_bytes_vs_nearest"] = r["inter_node_bytes"] / base["inter_node_bytes"] \
                if base["inter_node_bytes"] else float("nan")
        out["strategies"][name] = rows
        print(f"{tr.meta.model} {name}: " + ", ".join(
            f"{rule} bal {rows[rule]['balancedness_median_microbatch']:.3f} time {rows[rule]['layer_time_us']:.2f} us "
            f"({rows[rule]['time_vs_nearest']:.3f}x)" for rule in RULES), flush=True)
    out["num_microbatches"] = int(j["num_microbatches"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default="4x2")
    ap.add_argument("--redundant", type=int, default=8)
    ap.add_argument("--no-gpt-oss", action="store_true", help="skip the shared gpt-oss-20b data")
    ap.add_argument("--json", default=None, help="write here instead of bench/results/replica_rules.json")
    args = ap.parse_args()
    run = BenchRun("replica_rules", baseline="the default replica rule (nearest-least-loaded) on the same plans and "
                                             "held-out micro-batches")
    from moeplace.placement import Cluster
    from moeplace.simulate import CostConfig, ReplicaCosts

    n, g = (int(x) for x in args.cluster.split("x"))
    cluster = Cluster(n, g)
    results = {"reference-default": bench_workload(BUNDLED, cluster, args.redundant,
                                                   CostConfig(hidden_size=7168, intermediate_size=2048))}
    if not args.no_gpt_oss:
        sys.path.insert(0, str(Path(__file__).parent))
        from plan_compare import SHARED, ensure_trace

        if SHARED.exists():
            results["gpt-oss-20b"] = bench_workload(ensure_trace(None), cluster, args.redundant, CostConfig())
    c = ReplicaCosts()
    run.write({"params": {"cluster": args.cluster, "redundant": args.redundant, "holdout": 0.25, "split": "random",
                          "seed": 0, "arrival": "mixed", "phase": "decode", "rules": list(RULES),
                          "strategies": list(STRATEGIES), "intra_cost": c.intra_cost, "inter_cost": c.inter_cost},
               "excluded": "planning time; numba compilation (first call of each rule)",
               "results": results}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
