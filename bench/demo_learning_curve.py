"""The demo's prefill win against the requests it is planned on: activation-clusters (the only strategy the demo
decides faster in prefill) planned on the demo's whole planning window and on half of it, scored on held-out
requests against the strongest EPLB, the demo's protocol (``compare``: 4x2 generic links, R = 8, mixed arrival,
split seeds 0..4, paired 95% intervals over seeds and micro-batches).

Why: joint's evidence builds every candidate on one of two folds, half the planning window, so what a grouping
gains when built on half the requests bounds what its evidence can see (docs/PLANNER.md, "Tried and not kept").

Usage:
  python bench/demo_learning_curve.py [--json PATH]

Holdouts: 0.25 (the demo's: 750 planning requests of the bundled trace's 1,000) and 0.625 (375 planning requests,
a fold's worth). Writes bench/results/demo_learning_curve.json.
"""

from __future__ import annotations

import argparse

from common import BenchRun

from moeplace.data import default_trace_path
from moeplace.demo import DEFAULT_CLUSTER, DemoConfig
from moeplace.evaluate import compare
from moeplace.placement import Cluster
from moeplace.trace import read_trace

DEMO = DemoConfig(trace=default_trace_path(), out=None)  # the demo's defaults: its protocol, not a copy of it
HOLDOUTS = (DEMO.holdout, 0.625)  # the demo's, and a planning window of a fold's size (375 of 1,000 requests)
SEEDS = list(range(DEMO.seed, DEMO.seed + DEMO.split_seeds))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write here instead of bench/results/demo_learning_curve.json")
    args = ap.parse_args()
    run = BenchRun("demo_learning_curve", baseline="the strongest EPLB per phase (compare's baseline), same run")
    trace = read_trace(DEMO.trace)
    rows = {}
    for h in HOLDOUTS:
        r = compare(trace, Cluster.parse(DEFAULT_CLUSTER), DEMO.redundant, ["eplb", "activation-clusters"],
                    holdout=h, arrival="mixed", split_seeds=SEEDS, phases=("prefill",))
        ph = r["strategies"]["activation-clusters"]["phases"]["prefill"]
        rows[str(h)] = {"planning_requests": int(r["planning_requests"]), "held_out_requests":
                        int(r["held_out_requests"]), "ratio_to_baseline": ph["ratio_to_baseline"],
                        "ci95": ph["ci95"], "microbatches": ph["microbatches"], "decided": ph["decided"],
                        "baseline": r["baseline"]}
        print(f"holdout {h}: planned on {r['planning_requests']} requests, activation-clusters prefill "
              f"{ph['ratio_to_baseline']:.3f} [{ph['ci95'][0]:.3f}, {ph['ci95'][1]:.3f}]", flush=True)
    run.write({"params": {"trace": "bundled default trace", "cluster": DEFAULT_CLUSTER, "redundant": DEMO.redundant,
                          "arrival": "mixed",
                          "split_seeds": SEEDS, "holdouts": list(HOLDOUTS), "phase": "prefill"},
               "results": rows}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
