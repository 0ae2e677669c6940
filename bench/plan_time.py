"""Predicted MoE layer time per micro-batch on held-out requests: joint (time objective) vs EPLB and vs
activation-clusters, in the setting issue 12 names (mixed arrival order, prefill and decode apart, H200 preset).

Usage:
  python bench/plan_time.py [--clusters 4x2,8x1,2x4,4x8] [--redundant 8] [--no-gpt-oss] [--no-fg] [--json PATH]

Workloads: the bundled reference trace (prefill + decode; scored with DeepSeek-V3-sized token vectors, hidden 7168,
because its own 128-element vectors make every kernel latency-bound), the fine-grained reference model's trace
(``reference-fg.trace``: 64 experts in 8 groups, top-6, 2 shared, prefill + 32 decode tokens of 4,136 held-out
requests; scored with the token vectors of Instella-MoE-16B-A3B, the released model with its expert counts,
hidden 2048) and the shared gpt-oss-20b decode routing (its own hidden size 2880) when ../shared/data has it.
Each: plan on 75% of the requests (random split, seed 0),
score on the other 25% in a seeded mixed arrival order with ``moeplace.evaluate.compare``. Clusters are nodes of
the ``h200-8`` preset's links with the given GPUs per node. Kernel modes: ``auto`` (DeepEP normal for prefill,
low-latency for decode) and ``deepep-normal`` for both phases (the communication-bound setting of the issue's
first target). Baseline: EPLB's placement with round-robin homes, measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common import BenchRun

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "src" / "moeplace" / "data" / "reference-default.trace"
FINE_GRAINED = REPO / "src" / "moeplace" / "data" / "reference-fg.trace"
FG_HIDDEN = 2048  # Instella-MoE-16B-A3B (64 routed experts, top-6, 2 shared): moeplace.deploy
STRATEGIES = ["eplb", "activation-clusters", "joint"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clusters", default="4x2,8x1,2x4,4x8")
    ap.add_argument("--redundant", type=int, default=8, help="per layer; rounded up per cluster to fit the GPUs")
    ap.add_argument("--no-gpt-oss", action="store_true")
    ap.add_argument("--no-fg", action="store_true", help="leave out the fine-grained reference model's trace")
    ap.add_argument("--json")
    args = ap.parse_args()
    run = BenchRun("plan_time", baseline="eplb (its placement, round-robin homes), scored in the same run")

    from moeplace.deploy import get_cluster_preset, parse_cluster
    from moeplace.evaluate import compare
    from moeplace.simulate import CostConfig
    from moeplace.trace import read_trace

    sys.path.insert(0, str(Path(__file__).parent))
    workloads = [("reference", read_trace(BUNDLED), 7168)]
    if not args.no_fg:
        workloads.append(("reference-fg", read_trace(FINE_GRAINED), FG_HIDDEN))
    if not args.no_gpt_oss and (REPO.parent / "shared" / "data" / "gpt-oss-20b").exists():
        from plan_compare import ensure_trace

        workloads.append(("gpt-oss-20b", read_trace(ensure_trace(None)), None))
    h200 = get_cluster_preset("h200-8")
    results: dict = {}
    for wname, trace, hidden in workloads:
        for spec in args.clusters.split(","):
            c = parse_cluster(spec)
            cluster = h200.hardware.cluster(c.num_nodes, c.gpus_per_node)
            for mode in ("auto", "deepep-normal"):
                t0 = time.perf_counter()
                cost = CostConfig(hidden_size=hidden or trace.meta.hidden_size, mode=mode)
                E, W = trace.meta.num_experts, cluster.world_size
                R = args.redundant + (-(E + args.redundant)) % W  # rounded up so that E + R slots split over W
                r = compare(trace, cluster, R, STRATEGIES, seed=0, arrival="mixed", cost=cost)
                rows = {}
                for n, row in r["strategies"].items():
                    rows[n] = {k: row.get(k) for k in (
                        "prefill_layer_time_s", "decode_layer_time_s", "prefill_layer_time_vs_eplb",
                        "decode_layer_time_vs_eplb", "inter_node_bytes_vs_linear", "balancedness", "plan_seconds")}
                    rows[n]["fallback"] = None if not row.get("fallback") else row["fallback"]["used"]
                ac = rows["activation-clusters"]
                for ph in ("prefill", "decode"):
                    a, b = rows["joint"][f"{ph}_layer_time_s"], ac[f"{ph}_layer_time_s"]
                    rows["joint"][f"{ph}_layer_time_vs_activation_clusters"] = a / b if a is not None and b else None
                key = f"{wname}-{spec}-{mode}"  # no "/": result paths in figure markers split on it
                results[key] = {"workload": wname, "synthetic": bool(trace.meta.synthetic), "cluster": spec,
                                "redundant": R,
                                "mode": mode, "hidden_size": cost.hidden_size,
                                "held_out_requests": r["held_out_requests"], "strategies": rows,
                                "seconds": time.perf_counter() - t0}
                j = rows["joint"]
                print(f"{key}: joint/eplb prefill {j['prefill_layer_time_vs_eplb']} decode "
                      f"{j['decode_layer_time_vs_eplb']}, joint plan {j['plan_seconds']:.1f} s", flush=True)
    worse = [k for k, v in results.items() for ph in ("prefill", "decode")
             if (v["strategies"]["joint"].get(f"{ph}_layer_time_vs_eplb") or 1.0) > 1.0 + 1e-9]
    run.write({"params": {"clusters": args.clusters, "redundant": args.redundant, "preset": "h200-8",
                          "arrival": "mixed", "holdout": 0.25, "seed": 0},
               "results": results,
               "summary": {"settings": len(results), "joint_slower_than_eplb": worse}}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
