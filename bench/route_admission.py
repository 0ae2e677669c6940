"""Online vs batch admission of the deployable route: what a router that must answer each request at once
(``POST /route``, :meth:`moeplace.plan.route.Router.route`) keeps of the gain the evaluation measures with batch
admission (``POST /route_batch``, :meth:`~moeplace.plan.route.Router.route_batch`, a round's requests by regret).

Usage:
  python bench/route_admission.py [--cluster 4x2] [--redundant 8] [--seeds 5] [--no-gpt-oss] [--json PATH]

For each workload (the bundled reference trace, and gpt-oss-20b decode routing when ../shared/data has it) and each
held-out arrival order (``mixed``: a seeded shuffle, as a serving engine mixes requests; ``table``: the trace's
order, grouped by domain or dataset, a drifting stream), activation-clusters is planned on 75% of the requests
and its held-out 25% scored by the simulator (``moeplace.evaluate.measure.score_on``, default time model, every
micro-batch) three ways on the same plan and micro-batch contents: requests homed by batch admission, by online
admission (a fresh router, requests one by one in arrival order), and round-robin (the same placement without
its grouper). Reported, pooled over ``--seeds`` random splits: online / batch and batch / round-robin and online /
round-robin for the layer time and the inter-node bytes of prefill and decode, each with its paired two-level
bootstrap interval (``moeplace.evaluate.intervals.paired_ratio_ci``), and the share of requests whose node is the
same under both admissions. Writes bench/results/route_admission.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np
from common import BenchRun, paired_ci, seed_spread

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "src" / "moeplace" / "data" / "reference-default.trace"
WAYS = ("batch", "online", "round-robin")


def bench_workload(trace_path: Path, cluster, redundant: int, cost, seeds: list[int], arrival: str) -> dict:
    from moeplace.evaluate.measure import PhaseSetup, samples, score_on
    from moeplace.evaluate.windows import held_out_homes, split_windows
    from moeplace.plan import make_plan
    from moeplace.simulate import BatchConfig
    from moeplace.trace.reader import read_trace

    tr = read_trace(trace_path)
    setup = PhaseSetup(cluster, cost, BatchConfig(), "nearest-least-loaded")
    per: dict = {w: {"prefill": [], "decode": []} for w in WAYS}
    same_node = []
    for s in seeds:
        win = split_windows(tr, 0.25, "random", s, arrival=arrival)
        plan = make_plan("activation-clusters", win.plan_work, cluster, redundant, seed=0)
        assert plan.grouper is not None
        G = cluster.gpus_per_node
        hb = held_out_homes(plan, win.held, win.held_signal, "batch")
        ho = held_out_homes(plan, win.held, win.held_signal, "online")
        same_node.append(float(np.mean([hb[r] // G == ho[r] // G for r in hb])))
        for way, p, adm in (("batch", plan, "batch"), ("online", plan, "online"),
                            ("round-robin", dataclasses.replace(plan, grouper=None), "batch")):
            res = score_on(p, win, setup, admission=adm)
            for ph in ("prefill", "decode"):
                pr = getattr(res, ph)
                if pr.num_microbatches:
                    per[way][ph].append(samples(pr, np.ones(pr.num_microbatches, bool)))
    out: dict = {"trace": tr.meta.model, "synthetic": bool(tr.meta.synthetic), "arrival": arrival,
                 "held_out_requests": len(win.held.requests), "same_node_share": seed_spread(same_node),
                 "phases": {}}
    for ph in ("prefill", "decode"):
        if not per["batch"][ph]:
            continue
        row: dict = {"microbatches_per_seed": [len(x.layer) for x in per["batch"][ph]]}
        for num, den in (("online", "batch"), ("batch", "round-robin"), ("online", "round-robin")):
            a, b = per[num][ph], per[den][ph]
            row[f"{num}_vs_{den}"] = {"layer_time": paired_ci([x.layer for x in a], [x.layer for x in b]),
                                      "inter_node_bytes": paired_ci([x.inter_node_bytes for x in a],
                                                                    [x.inter_node_bytes for x in b])}
        gb = 1 - row["batch_vs_round-robin"]["layer_time"]["ratio"]
        go = 1 - row["online_vs_round-robin"]["layer_time"]["ratio"]
        row["online_keeps_of_time_gain"] = go / gb if gb > 0 else None
        out["phases"][ph] = row
        print(f"{tr.meta.model} {arrival} {ph}: online/batch time "
              f"{row['online_vs_batch']['layer_time']['ratio']:.4f} {row['online_vs_batch']['layer_time']['ci95']}, "
              f"batch/rr {row['batch_vs_round-robin']['layer_time']['ratio']:.4f}, online/rr "
              f"{row['online_vs_round-robin']['layer_time']['ratio']:.4f}; same node "
              f"{out['same_node_share']['median']:.3f}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default="4x2")
    ap.add_argument("--redundant", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=5, help="random split seeds (default: 5)")
    ap.add_argument("--no-gpt-oss", action="store_true", help="skip the shared gpt-oss-20b data")
    ap.add_argument("--json", default=None, help="write here instead of bench/results/route_admission.json")
    args = ap.parse_args()
    run = BenchRun("route_admission", baseline="batch admission (what the evaluation scores) and round-robin "
                                               "homes, same plan and held-out micro-batches")
    from moeplace.placement import Cluster
    from moeplace.simulate import CostConfig

    cluster = Cluster.parse(args.cluster)
    seeds = list(range(args.seeds))
    workloads = [("reference-default", BUNDLED, CostConfig(hidden_size=7168, intermediate_size=2048))]
    if not args.no_gpt_oss:
        sys.path.insert(0, str(Path(__file__).parent))
        from plan_compare import SHARED, ensure_trace

        if SHARED.exists():
            workloads.append(("gpt-oss-20b", ensure_trace(None), CostConfig()))
    results = {f"{name}/{arr}": bench_workload(path, cluster, args.redundant, cost, seeds, arr)
               for name, path, cost in workloads for arr in ("mixed", "table")}
    run.write({"params": {"cluster": args.cluster, "redundant": args.redundant, "holdout": 0.25, "split": "random",
                          "split_seeds": seeds, "planner_seed": 0, "strategy": "activation-clusters",
                          "rule": "nearest-least-loaded", "batching": "BatchConfig() defaults, every micro-batch",
                          "interval": "paired two-level bootstrap over split seeds and micro-batches, 95% "
                                      "(moeplace.evaluate.intervals)"},
               "excluded": "planning time", "results": results}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
