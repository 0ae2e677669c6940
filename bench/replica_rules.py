"""Replica rules per micro-batch: how much balance and layer time the balanced rules recover, per strategy, with
paired 95% intervals over split seeds and micro-batches (the protocol of docs/EVALUATION.md).

Usage:
  python bench/replica_rules.py [--cluster 4x2] [--redundant 8] [--seeds 5] [--no-gpt-oss] [--json PATH]

For each workload (the bundled reference trace, and gpt-oss-20b decode routing when ../shared/data has it),
strategies linear, eplb and activation-clusters are planned on 75% of the requests and scored by the simulator on
the other 25%, held-out decode micro-batches in a mixed arrival order, for each of ``--seeds`` random splits
(``moeplace.evaluate.compare``, split seeds 0..N-1, arrival order seeded by the split, planners seed 0), once per
replica rule: nearest-least-loaded (the default), balanced (least max load; SGLang's LP balancer ignores locality
likewise) and balanced-local (max load + locality cost, :class:`moeplace.simulate.ReplicaCosts` defaults). The
bundled trace is scored with DeepSeek-V3-sized vectors (hidden 7168, expert width 2048), gpt-oss-20b with its own
metadata; no deployment profile (neither trace fills one), so every held-out micro-batch is scored.

Reported per strategy and rule, pooled over seeds:
- ``time_vs_nearest``: layer time under the rule / under the default rule, same plan and micro-batches, with its
  paired two-level bootstrap interval (``moeplace.evaluate.intervals.paired_ratio_ci``);
- ``ratio_to_baseline``: layer time / the strongest EPLB's (global or hierarchical x static / least-loaded /
  balanced dispatch, chosen on the held-out window, ``moeplace.evaluate.measure``), with its interval;
- ``inter_node_bytes_vs_nearest`` with its interval; mean predicted layer time per micro-batch and layer, and the
  ideal bounds of the same plan and traffic (balanced; balanced and local);
- balancedness (median per-micro-batch, and of the whole window) as the median over split seeds, with the range
  over seeds (not a ratio of sums over micro-batches, so no bootstrap interval).
Writes bench/results/replica_rules.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common import BenchRun, paired_ci, seed_spread

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "src" / "moeplace" / "data" / "reference-default.trace"
STRATEGIES = ("linear", "eplb", "activation-clusters")
RULES = ("nearest-least-loaded", "balanced", "balanced-local")


def bench_workload(trace_path: Path, cluster, redundant: int, cost, seeds: list[int]) -> dict:
    from moeplace.evaluate import compare
    from moeplace.trace.reader import read_trace

    tr = read_trace(trace_path)
    smp: dict[str, list] = {r: [] for r in RULES}  # rule -> per seed {name: PhaseSamples} (decode)
    sim: dict[str, list] = {r: [] for r in RULES}  # rule -> per seed {strategy: decode PhaseResult JSON}
    measured: dict[str, dict] = {}
    secs: dict[str, float] = {}
    for rule in RULES:
        t0 = time.perf_counter()
        measured[rule] = compare(
            tr, cluster, redundant, list(STRATEGIES), holdout=0.25, split="random", arrival="mixed", cost=cost,
            rule=rule, split_seeds=seeds, phases=("decode",),
            on_seed=lambda s, win, sm, res, plans, rule=rule: (
                smp[rule].append(sm["decode"]),
                sim[rule].append({n: res["decode"][n].decode.to_json() for n in STRATEGIES})))
        secs[rule] = time.perf_counter() - t0
    first = measured[RULES[0]]
    out: dict = {"trace": tr.meta.model, "synthetic": bool(tr.meta.synthetic),
                 "held_out_requests": first["held_out_requests"], "expert_groups": first["expert_groups"],
                 "baseline": first["baseline"]["decode"],
                 "baseline_layer_time_us": first["baseline_candidates"]["decode"][first["baseline"]["decode"]] * 1e6,
                 "baseline_candidates_us": {k: v * 1e6 for k, v in first["baseline_candidates"]["decode"].items()},
                 "microbatches_per_seed": first["microbatch_counts"]["decode"]["microbatches"],
                 "score_seconds": secs, "strategies": {}}
    for rule in RULES[1:]:  # the candidates do not depend on the strategies' rule: the same baseline every time
        assert measured[rule]["baseline"] == first["baseline"]
    near = RULES[0]
    for name in STRATEGIES:
        rows: dict = {}
        for rule in RULES:
            ph = measured[rule]["strategies"][name]["phases"]["decode"]
            L = len(sim[rule][0][name]["balancedness"]["per_layer"])
            rows[rule] = {
                "layer_time_us": ph["layer_time_s"] * 1e6, "bound_balanced_us": ph["bound_balanced_s"] * 1e6,
                "bound_local_us": ph["bound_local_s"] * 1e6,
                "ratio_to_baseline": ph["ratio_to_baseline"], "ci95": ph["ci95"], "decided": ph["decided"],
                "time_vs_nearest": paired_ci([s[name].layer for s in smp[rule]], [s[name].layer for s in smp[near]]),
                "inter_node_bytes_vs_nearest": paired_ci([s[name].inter_node_bytes for s in smp[rule]],
                                                        [s[name].inter_node_bytes for s in smp[near]]),
                "inter_node_bytes_per_microbatch_layer": float(
                    sum(s[name].inter_node_bytes.sum() for s in smp[rule])
                    / sum(len(s[name].inter_node_bytes) for s in smp[rule]) / L),
                "balancedness_median_microbatch": seed_spread([j[name]["balancedness"]["median_microbatch"]
                                                          for j in sim[rule]]),
                "balancedness_total": seed_spread([j[name]["balancedness"]["total"] for j in sim[rule]]),
                "node_local_rate": seed_spread([j[name]["node_local_rate"]["total"] for j in sim[rule]]),
            }
        out["strategies"][name] = rows

        def txt(c: dict) -> str:
            return f"{c['ratio']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}]"

        print(f"{tr.meta.model} {name}: " + "; ".join(
            f"{rule} bal {rows[rule]['balancedness_median_microbatch']['median']:.3f} "
            f"{rows[rule]['layer_time_us']:.2f} us, vs nearest {txt(rows[rule]['time_vs_nearest'])}, vs "
            f"{out['baseline']} {rows[rule]['ratio_to_baseline']:.3f}" for rule in RULES), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default="4x2")
    ap.add_argument("--redundant", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=5, help="random split seeds (default: 5)")
    ap.add_argument("--no-gpt-oss", action="store_true", help="skip the shared gpt-oss-20b data")
    ap.add_argument("--json", default=None, help="write here instead of bench/results/replica_rules.json")
    args = ap.parse_args()
    run = BenchRun("replica_rules", baseline="the default replica rule (nearest-least-loaded) on the same plans and "
                                             "held-out micro-batches; and the strongest EPLB (global/hierarchical x "
                                             "static/least-loaded/balanced dispatch) chosen on the held-out window")
    from moeplace.placement import Cluster
    from moeplace.simulate import CostConfig, ReplicaCosts

    cluster = Cluster.parse(args.cluster)
    seeds = list(range(args.seeds))
    results = {"reference-default": bench_workload(BUNDLED, cluster, args.redundant,
                                                   CostConfig(hidden_size=7168, intermediate_size=2048), seeds)}
    if not args.no_gpt_oss:
        sys.path.insert(0, str(Path(__file__).parent))
        from plan_compare import SHARED, ensure_trace

        if SHARED.exists():
            results["gpt-oss-20b"] = bench_workload(ensure_trace(None), cluster, args.redundant, CostConfig(), seeds)
    c = ReplicaCosts()
    run.write({"params": {"cluster": args.cluster, "redundant": args.redundant, "holdout": 0.25, "split": "random",
                          "split_seeds": seeds, "planner_seed": 0, "arrival": "mixed (seeded by the split)",
                          "phase": "decode", "rules": list(RULES), "strategies": list(STRATEGIES),
                          "intra_cost": c.intra_cost, "inter_cost": c.inter_cost,
                          "interval": "paired two-level bootstrap over split seeds and micro-batches, 95%, 2,000 "
                                      "replicates (moeplace.evaluate.intervals)"},
               "excluded": "planning time; numba compilation (first call of each rule)",
               "results": results}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
