"""Decode instances (ELDR's setting): the grouper's route against least-loaded routing, on held-out requests.

Usage:
  python bench/decode_instances.py [--instances 4,8] [--running 16,64] [--seeds 5] [--no-gpt-oss] [--json PATH]

Shape (``moeplace.simulate.instances``): I decode instances of one GPU each holding every expert, continuous
batching of ``running`` requests per instance; a decode step's MoE time is the expert roofline of the distinct
experts its batch activates (memory) and its pairs (FLOPs), summed over layers, default GPU (3.35 TB/s, 400
TFLOP/s). Workloads: the bundled DeepSeek-V3-shaped (E = 256, k = 8), fine-grained (E = 64, k = 6) and default
(E = 32, k = 4) reference traces, scored with DeepSeek-V3-sized experts (hidden 7168, width 2048), and
gpt-oss-20b decode routing (../shared/data, E = 32, k = 4, its own sizes). For each of ``--seeds`` random
splits (75% planning, 25% held out in a mixed arrival order), activation-clusters is planned for I x 1 (one
grouper column per instance, no redundant slots; only its grouper is used) on the planning requests and the
held-out requests are routed through the evaluation (``moeplace.evaluate.windows.held_out_homes``) with online
admission (what ``POST /route`` answers) and batch admission (``POST /route_batch``), once with the published
grouper (``cluster_by="signal"``: K-means on the planning requests' signatures; routers ``online``, ``batch``) and
once with ``cluster_by="usage"`` (the planning requests clustered by their decode usage, each cluster's mean
signature as its grouper row; routers ``usage-online``, ``usage-batch``); the baselines are
least-loaded (each request to the instance that frees a slot first, ``moeplace.simulate.instances.least_loaded``)
and round-robin. ``hindsight`` is a bound, not a router: the held-out requests clustered by their own decode routing
(``moeplace.evaluate.windows.hindsight_groups``, which no router knows on arrival), so how far routing by
signature could go on this data and shape. Reported per workload, I and running: each router's total MoE time over
all instances (equal work: every router decodes the same rows) and mean MoE time per decode step, as ratios to
least-loaded with a paired bootstrap interval over split seeds (one unit per seed: its total), the busiest
instance's MoE time, and distinct active experts per step and layer. Writes bench/results/decode_instances.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from common import BenchRun, paired_ci, seed_spread

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "src" / "moeplace" / "data"
ROUTERS = ("online", "batch", "usage-online", "usage-batch", "least-loaded", "round-robin", "hindsight")


def bench_workload(path: Path, cost, instances: list[int], runnings: list[int], seeds: list[int]) -> dict:
    from moeplace.evaluate.windows import held_out_homes, hindsight_groups, scoring_trace, split_windows
    from moeplace.placement import Cluster
    from moeplace.plan import make_plan
    from moeplace.simulate.instances import decode_lengths, least_loaded, simulate_instances
    from moeplace.trace.reader import read_trace

    tr = read_trace(path)
    out: dict = {"trace": tr.meta.model, "synthetic": bool(tr.meta.synthetic), "num_experts": tr.meta.num_experts,
                 "top_k": tr.meta.top_k, "shapes": {}}
    for n_inst in instances:
        runs: dict = {B: {r: [] for r in ROUTERS} for B in runnings}
        for s in seeds:
            win = split_windows(tr, 0.25, "random", s, arrival="mixed")
            sc = scoring_trace(win.held, win.held_signal)
            rid = win.held.requests.request_id
            routed = {}
            for by, prefix in (("signal", ""), ("usage", "usage-")):
                plan = make_plan("activation-clusters", win.plan_work, Cluster(n_inst, 1), 0, seed=0, cluster_by=by)
                for adm in ("online", "batch"):
                    routed[prefix + adm] = held_out_homes(plan, win.held, win.held_signal, adm)
            hindsight = hindsight_groups(sc, n_inst)
            for B in runnings:
                assign = {adm: np.array([routed[adm][int(r)] for r in rid]) for adm in routed}
                assign["least-loaded"] = least_loaded(decode_lengths(sc), n_inst, B)
                assign["round-robin"] = np.arange(len(rid)) % n_inst
                assign["hindsight"] = hindsight
                for name, a in assign.items():
                    runs[B][name].append(simulate_instances(sc, a, n_inst, 1, B, cost))
        for B in runnings:
            row: dict = {"held_out_requests": len(rid)}
            base = runs[B]["least-loaded"]
            for name in ROUTERS:
                rs = runs[B][name]
                row[name] = {
                    "total_vs_least_loaded": paired_ci([np.array([x.step_seconds.sum()]) for x in rs],
                                                       [np.array([x.step_seconds.sum()]) for x in base]),
                    "per_step_vs_least_loaded": paired_ci([np.array([x.step_seconds.mean()]) for x in rs],
                                                          [np.array([x.step_seconds.mean()]) for x in base]),
                    "mean_step_ms": seed_spread([x.step_seconds.mean() * 1e3 for x in rs]),
                    "busiest_instance_s": seed_spread([float(x.busy_seconds().max()) for x in rs]),
                    "active_experts_per_layer": seed_spread([float(x.active.mean()) for x in rs]),
                    "tokens_per_step": seed_spread([float(x.tokens.mean()) for x in rs]),
                }
            out["shapes"][f"{n_inst}x1-running{B}"] = row  # no "/": a figure path splits on it
            o = row["online"]
            u = row["usage-online"]
            print(f"{tr.meta.model} {n_inst}x1 running {B}: online / least-loaded total "
                  f"{o['total_vs_least_loaded']['ratio']:.4f} {o['total_vs_least_loaded']['ci95']}, per step "
                  f"{o['per_step_vs_least_loaded']['ratio']:.4f}; usage-online "
                  f"{u['total_vs_least_loaded']['ratio']:.4f} {u['total_vs_least_loaded']['ci95']}; batch "
                  f"{row['batch']['total_vs_least_loaded']['ratio']:.4f}; round-robin "
                  f"{row['round-robin']['total_vs_least_loaded']['ratio']:.4f}; hindsight bound "
                  f"{row['hindsight']['total_vs_least_loaded']['ratio']:.4f}; active "
                  f"{o['active_experts_per_layer']['median']:.1f} vs "
                  f"{row['least-loaded']['active_experts_per_layer']['median']:.1f}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", default="4,8")
    ap.add_argument("--running", default="16,64")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--no-gpt-oss", action="store_true")
    ap.add_argument("--json", default=None, help="write here instead of bench/results/decode_instances.json")
    args = ap.parse_args()
    run = BenchRun("decode_instances", baseline="least-loaded routing (to the instance that frees a slot first) "
                                                "on the same held-out requests, instances and batch size")
    from moeplace.simulate import CostConfig

    inst = [int(x) for x in args.instances.split(",")]
    runnings = [int(x) for x in args.running.split(",")]
    seeds = list(range(args.seeds))
    ds = CostConfig(hidden_size=7168, intermediate_size=2048)
    workloads = [("reference-ds", DATA / "reference-ds.trace", ds), ("reference-fg", DATA / "reference-fg.trace", ds),
                 ("reference-default", DATA / "reference-default.trace", ds)]
    if not args.no_gpt_oss:
        sys.path.insert(0, str(Path(__file__).parent))
        from plan_compare import SHARED, ensure_trace

        if SHARED.exists():
            workloads.append(("gpt-oss-20b", ensure_trace(None), CostConfig()))
    results = {name: bench_workload(p, c, inst, runnings, seeds) for name, p, c in workloads}
    run.write({"params": {"instances": inst, "gpus_per_instance": 1, "running": runnings, "holdout": 0.25,
                          "split": "random", "split_seeds": seeds, "arrival": "mixed (seeded by the split)",
                          "grouper": "activation-clusters planned for I x 1, redundant 0, seed 0: online and batch "
                                     "with cluster_by=signal (published), usage-online and usage-batch with "
                                     "cluster_by=usage",
                          "hindsight": "bound, not deployable: held-out requests clustered by their own decode "
                                       "routing (moeplace.evaluate.windows.hindsight_groups, 4 restarts)",
                          "interval": "paired bootstrap over split seeds (one unit per seed), 95%"},
               "excluded": "attention, the all-reduce inside an instance, KV transfer, queueing for a free slot",
               "results": results}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
