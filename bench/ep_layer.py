"""Measured expert-parallel layer time of linear, eplb, activation-clusters and joint plans on emulated nodes,
next to the simulator.

For each emulated cluster (2x2, 4x1 and 2x4 by default; one namespace per node, inter-node links shaped with tc so
they are about r times slower than the unshaped intra-node path) and each trace (the gpt-oss-20b data in
../shared/data when present, and the reference trace), this script

1. calibrates the emulated links with the same all_to_all_single calls the dispatcher makes (alpha, bytes/s per
   link class; and the ranks' GEMM rate, all ranks busy at once, reported);
2. splits the trace into a planning and a held-out window (moeplace.evaluate protocol), plans every strategy on
   the planning window with the calibrated cluster as time model (joint's objective is predicted layer time, with
   the replay's hidden size and the nccl kernel), gives held-out requests homes with each plan's grouper;
3. replays the same held-out decode micro-batches through the real layer for every plan (W processes, gloo, one
   launch, repeats interleaved) and runs the simulator's kernel time model (nccl: one copy per GPU) with the
   calibrated links on those micro-batches;
4. prints measured and predicted layer time of every plan, as ratios to linear and joint vs eplb.

Expert compute is emulated by default (``run-ep --emulate-compute``): each rank waits the time model's roofline
compute of its own pairs on a stated virtual device (--emu-gflops, --emu-hbm-gbps) instead of computing, so ranks
sharing the machine's cores do not compete for them (2x4 puts 8 ranks on 2 cores) while the all-to-all stays real.
--real-compute runs the experts instead, timed with the calibrated GEMM rate.

Usage: python bench/ep_layer.py [--quick] [--json PATH]   (default: bench/results/ep_layer.json)
Needs root and iproute2 for the namespaces (falls back to plain loopback, which it says, where not permitted).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from common import BenchRun

REPO = Path(__file__).resolve().parents[1]
GPT_OSS = REPO.parent / "shared" / "data" / "gpt-oss-20b"
BENCH_DIR = str(Path(__file__).resolve().parent)


# ------------------------------------------------------------------------------------------------ calibration


def calibrate_rank(ctx, hidden: int, ffn: int, gpus_per_node: int, sizes: tuple[int, ...], reps: int) -> dict:
    """Rank side: time all_to_all_single with one peer loaded (intra-node peer, then inter-node peer) at several
    row counts, and a grouped GEMM while every rank computes. Returns medians in seconds."""
    rank, W = ctx.rank, ctx.world_size
    G = gpus_per_node
    out: dict = {"intra": {}, "inter": {}}
    pairs = {}
    if G > 1 and G % 2 == 0:
        pairs["intra"] = [(g, g ^ 1) for g in range(W)]  # partner on the same node (symmetric)
    if W > G and (W // G) % 2 == 0:
        pairs["inter"] = [(g, g ^ G) for g in range(W)]  # same local index on the paired node (symmetric)
    for cls, partner in pairs.items():
        peer = dict(partner)[rank]
        for n in sizes:
            split = [n if d == peer else 0 for d in range(W)]
            x = torch.randn(n, hidden)
            y = torch.empty(n, hidden)
            ts = []
            for _ in range(reps):
                dist.barrier()  # host waits: every rank starts together
                t0 = time.perf_counter()
                dist.all_to_all_single(y, x, split, split)
                ts.append(time.perf_counter() - t0)
            out[cls][n] = float(np.median(ts))
    a = torch.randn(64, hidden)
    w1, w2 = torch.randn(hidden, ffn), torch.randn(ffn, hidden)
    dist.barrier()
    t0 = time.perf_counter()
    it = 0
    while time.perf_counter() - t0 < 1.0:
        torch.nn.functional.silu(a @ w1) @ w2
        it += 1
    out["flops"] = it * 64 * 4.0 * hidden * ffn / (time.perf_counter() - t0)
    return out


def fit_links(res: list[dict], row_bytes: int) -> dict:
    """alpha (s) and bandwidth (bytes/s) per link class from the slowest rank's time at each size."""
    fit = {}
    for cls in ("intra", "inter"):
        if not res[0][cls]:
            continue
        sizes = sorted(res[0][cls])
        t = np.array([max(r[cls][n] for r in res) for n in sizes])
        b = np.array(sizes, float) * row_bytes
        slope, alpha = np.polyfit(b, t, 1)
        fit[cls] = {"alpha_s": max(float(alpha), 1e-6), "bytes_per_s": float(1.0 / max(slope, 1e-12)),
                    "samples": {int(n): float(v) for n, v in zip(sizes, t, strict=True)}}
    fit["flops_per_rank"] = float(np.median([r["flops"] for r in res]))
    return fit


# ------------------------------------------------------------------------------------------------ data and plans


def load_traces(tmp: Path, quick: bool) -> dict:
    from moeplace.data import DATA_DIR
    from moeplace.trace import read_trace
    from moeplace.trace.importers import import_gpt_oss_npz

    out = {}
    if (GPT_OSS / "decode_routing.npz").exists():
        t0 = time.perf_counter()
        path = import_gpt_oss_npz(GPT_OSS, tmp / "gpt-oss.trace", limit=96 if quick else 128)
        print(f"imported gpt-oss-20b data ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        out["gpt-oss-20b (shared data)"] = read_trace(path)
    else:
        print(f"skipping the gpt-oss data: {GPT_OSS} not present", file=sys.stderr)
    ref = DATA_DIR / "reference-default.trace"
    if not ref.exists():
        ref = DATA_DIR / "gpt-oss-20b-sample.trace"
    out[f"reference ({ref.name})"] = read_trace(ref)
    return out


def redundant_for(num_experts: int, world_size: int, at_least: int) -> int:
    """The fewest redundant slots >= at_least that fill every GPU alike ((E + R) % W == 0)."""
    return at_least + (-(num_experts + at_least)) % world_size


def plans_for(trace, cluster, args) -> tuple[dict, object]:
    """Plan every strategy on the planning window (``cluster``: the calibrated time model); returns
    ({name: plan with held-out homes}, scoring)."""
    from moeplace.evaluate import held_out_homes, scoring_trace, split_windows
    from moeplace.placement import Plan
    from moeplace.plan import make_plan

    win = split_windows(trace, holdout=args.holdout, seed=0)
    scoring = scoring_trace(win.held, win.held_signal)
    plans = {}
    for name in args.strategies:
        kw = {"hidden_size": args.hidden, "mode": "deepep-normal" if args.two_hop else "nccl"} \
            if name == "joint" else {}
        p = make_plan(name, win.plan_work, cluster, redundant_for(trace.meta.num_experts, cluster.world_size,
                                                                  args.redundant), **kw)
        homes = held_out_homes(p, win.held, win.held_signal)
        plans[name] = Plan(p.placement, cluster, homes, name, p.plan_seconds)
    return plans, scoring


# ------------------------------------------------------------------------------------------------ main


def run(args) -> dict:
    from moeplace.placement import Cluster
    from moeplace.run.launch import launch
    from moeplace.run.netns import emulated_cluster
    from moeplace.run.replay import ReplayConfig, batches_from_window, predict, replay_cases, select_window, summarize
    from moeplace.simulate import BatchConfig

    env = {"PYTHONPATH": os.pathsep.join([BENCH_DIR, os.environ.get("PYTHONPATH", "")])}
    cfg = ReplayConfig(hidden=args.hidden, ffn=args.ffn, repeats=args.repeats, two_hop=args.two_hop, timeout=900,
                       emulate_compute=not args.real_compute)
    batching = BatchConfig(decode_batch=args.batch, prefill_tokens=8192)
    report: dict = {"clusters": {}}
    with tempfile.TemporaryDirectory() as tmp:
        traces = load_traces(Path(tmp), args.quick)
        for spec in args.clusters:
            N, G = (int(v) for v in spec.split("x"))
            node_gbit = args.inter_gbit_per_gpu * G  # a node's link carries its G ranks
            with emulated_cluster(N, G, inter_gbit=node_gbit if N > 1 else None) as emu:
                if emu.note:
                    print(f"{spec}: {emu.note}", file=sys.stderr)
                cal = launch("ep_layer:calibrate_rank", N * G,
                             dict(hidden=args.hidden, ffn=args.ffn or args.hidden, gpus_per_node=G,
                                  sizes=(1, 64, 256, 1024), reps=7), env=env, timeout=300, **emu.launch_kwargs())
                fit = fit_links(cal, args.hidden * cfg.bytes_per_element)
                intra = fit.get("intra", fit.get("inter"))
                inter = fit.get("inter", intra)
                # the runtime makes 4 all_to_all_single calls per layer one-hop (counts, rows and metadata for
                # dispatch; rows for combine) where the alpha-beta model charges 2 message rounds: alpha doubled
                # expert compute: the emulated device's rates, or the calibrated GEMM rate when it really runs
                flops = fit["flops_per_rank"] if args.real_compute else args.emu_gflops * 1e9
                calib = Cluster(N, G, intra_bw=intra["bytes_per_s"], inter_bw=inter["bytes_per_s"],
                                intra_latency=2 * intra["alpha_s"], inter_latency=2 * inter["alpha_s"],
                                expert_flops=flops, hbm_bw=args.emu_hbm_gbps * 1e9)
                cres = {"emulation": {"mode": emu.mode, "node_link_gbit": emu.inter_gbit, "note": emu.note},
                        "calibration": fit,
                        "time_model": {"intra_bw": calib.intra_bw, "inter_bw": calib.inter_bw,
                                       "intra_latency": calib.intra_latency, "inter_latency": calib.inter_latency,
                                       "expert_flops": calib.expert_flops, "hbm_bw": calib.hbm_bw,
                                       "emulated_compute": cfg.emulate_compute},
                        "r_measured": (fit["intra"]["bytes_per_s"] / fit["inter"]["bytes_per_s"]
                                       if "intra" in fit and "inter" in fit else None),
                        "traces": {}}
                print(f"{spec}: calibrated intra {intra['bytes_per_s'] / 1e6:.0f} MB/s alpha "
                      f"{intra['alpha_s'] * 1e3:.2f} ms, inter {inter['bytes_per_s'] / 1e6:.0f} MB/s alpha "
                      f"{inter['alpha_s'] * 1e3:.2f} ms, r = {cres['r_measured'] or float('nan'):.1f}, "
                      f"{fit['flops_per_rank'] / 1e9:.1f} GFLOP/s per rank", file=sys.stderr)
                for tname, trace in traces.items():
                    t0 = time.perf_counter()
                    plans, scoring = plans_for(trace, calib, args)
                    plan_wall = time.perf_counter() - t0
                    rows_out = {}
                    cases, subs = [], []
                    for plan in plans.values():
                        sub, rows = select_window(scoring, plan, batching, "decode", args.microbatches, args.skip)
                        cases.append((plan, batches_from_window(sub, rows, plan)))
                        subs.append(sub)
                    t0 = time.perf_counter()
                    results = replay_cases(cases, cfg, env=env, compute_cluster=calib,
                                           **emu.launch_kwargs())  # all plans in one run
                    wall = time.perf_counter() - t0
                    for (pname, plan), (_, batches), sub, res in zip(plans.items(), cases, subs, results, strict=True):
                        m = summarize(res)
                        sim = predict(sub, plan, cfg, batching, cluster=calib).all.to_json()
                        pre = "two_hop_" if cfg.two_hop else ""
                        kt = sim["kernel_time"]
                        rows_out[pname] = {
                            "tokens": int(sum(len(b) for b in batches)), "microbatches": len(batches),
                            "measured_layer_time_s": m["layer_time_s"]["total"],
                            "measured_layer_time_per_repeat_s": res.layer_seconds.sum((1, 2)).tolist(),
                            "predicted_layer_time_s": kt["layer_time_s"]["total"],
                            "predicted_dispatch_time_s": kt["dispatch_time_s"]["total"],
                            "predicted_combine_time_s": kt["combine_time_s"]["total"],
                            "predicted_expert_time_s": kt["expert_time_s"]["total"],
                            "emulated_compute_s": (m["emulated_compute_s"] or {}).get("total"),
                            "balancedness_predicted": sim["balancedness"]["median_microbatch"],
                            "measured_inter_node_bytes": m["inter_node_bytes"]["total"],
                            "predicted_inter_node_bytes": sim[pre + "inter_node_bytes"]["total"],
                            "measured_intra_node_bytes": m["intra_node_bytes"]["total"],
                            "run_wall_s": wall, "plan_wall_s": plan_wall,
                            "plan_seconds": plan.plan_seconds,
                        }
                        print(f"  {spec} {tname} {pname}: measured {m['layer_time_s']['total'] * 1e3:.0f} ms, "
                              f"predicted {kt['layer_time_s']['total'] * 1e3:.0f} ms, inter "
                              f"{m['inter_node_bytes']['total'] / 1e6:.2f} MB", file=sys.stderr)
                    base = rows_out.get("linear")
                    for r in rows_out.values():
                        for k in ("layer_time_s", "inter_node_bytes"):
                            for side in ("measured", "predicted"):
                                v, b = r[f"{side}_{k}"], base[f"{side}_{k}"] if base else None
                                r[f"{side}_{k}_vs_linear"] = (v / b) if b else float("nan")
                    cres["traces"][tname] = rows_out
                    if "joint" in rows_out and "eplb" in rows_out:
                        cres.setdefault("joint_vs_eplb", {})[tname] = joint_vs_eplb(rows_out)
            report["clusters"][spec] = cres
    return report


def joint_vs_eplb(rows: dict) -> dict:
    """joint's layer time as a ratio to eplb's, measured and predicted, and whether the measurement meets the
    target (same sign of the difference, ratio within 5 points of the prediction). The measured ratio's spread
    is the min and max over repeats of the per-repeat ratio (repeats interleave the plans, so they pair up)."""
    j, e = rows["joint"], rows["eplb"]
    meas = j["measured_layer_time_s"] / e["measured_layer_time_s"]
    pred = j["predicted_layer_time_s"] / e["predicted_layer_time_s"]
    per_rep = np.array(j["measured_layer_time_per_repeat_s"]) / np.array(e["measured_layer_time_per_repeat_s"])
    same_sign = bool(np.sign(round(meas - 1, 3)) == np.sign(round(pred - 1, 3)))
    return {"measured": meas, "predicted": pred, "measured_per_repeat_min": float(per_rep.min()),
            "measured_per_repeat_max": float(per_rep.max()), "difference_points": 100 * (meas - pred),
            "same_sign": same_sign, "meets_target": same_sign and abs(meas - pred) <= 0.05}


def print_table(report: dict) -> None:
    print("| cluster | trace | plan | tokens | layer time measured (ms) | predicted (ms) | vs linear measured | "
          "vs linear predicted | inter-node bytes vs linear (measured = predicted) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec, c in report["clusters"].items():
        for tname, rows in c["traces"].items():
            for pname, r in rows.items():
                same = "" if r["measured_inter_node_bytes"] == r["predicted_inter_node_bytes"] else " (DIFFERENT)"
                r_txt = f"r={c['r_measured']:.1f}" if c["r_measured"] else "no intra-node link"
                print(f"| {spec} ({r_txt}) | {tname} | {pname} | {r['tokens']} | "
                      f"{r['measured_layer_time_s'] * 1e3:.0f} | {r['predicted_layer_time_s'] * 1e3:.0f} | "
                      f"{r['measured_layer_time_s_vs_linear']:.3f} | "
                      f"{r['predicted_layer_time_s_vs_linear']:.3f} | "
                      f"{r['measured_inter_node_bytes_vs_linear']:.3f}{same} |")
    print("\n| cluster | trace | joint / eplb measured | predicted | difference (points) | meets target |")
    print("|---|---|---|---|---|---|")
    for spec, c in report["clusters"].items():
        for tname, v in c.get("joint_vs_eplb", {}).items():
            print(f"| {spec} | {tname} | {v['measured']:.3f} ({v['measured_per_repeat_min']:.3f}-"
                  f"{v['measured_per_repeat_max']:.3f}) | {v['predicted']:.3f} | {v['difference_points']:+.1f} | "
                  f"{'yes' if v['meets_target'] else 'no'} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clusters", nargs="+", default=["2x2", "4x1", "2x4"])
    ap.add_argument("--strategies", nargs="+", default=["linear", "eplb", "activation-clusters", "joint"])
    ap.add_argument("--inter-gbit-per-gpu", type=float, default=0.5,
                    help="shaped inter-node rate per GPU in Gbit/s (a node's link gets G times this)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=128,
                    help="expert intermediate size (small: keeps compute below comm on CPUs)")
    ap.add_argument("--batch", type=int, default=128, help="requests per decode window (micro-batch size)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--skip", type=int, default=40, help="decode micro-batches skipped first (steady state)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--redundant", type=int, default=4,
                    help="redundant slots per layer (at least: rounded up to fill every GPU alike)")
    ap.add_argument("--holdout", type=float, default=0.5)
    ap.add_argument("--real-compute", action="store_true",
                    help="run the experts instead of waiting their predicted time (ranks then share the cores)")
    ap.add_argument("--emu-gflops", type=float, default=20.0,
                    help="emulated compute: the virtual device's GFLOP/s per rank")
    ap.add_argument("--emu-hbm-gbps", type=float, default=50.0,
                    help="emulated compute: the virtual device's weight-memory GB/s per rank")
    ap.add_argument("--two-hop", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer gpt-oss generations")
    ap.add_argument("--json", default=None, help="write here instead of bench/results/ep_layer.json")
    args = ap.parse_args(argv)
    bench = BenchRun("ep_layer", baseline="the linear plan on the same emulated cluster, and the simulator's "
                                          "prediction for the same micro-batches")
    report = run(args)
    print_table(report)
    bench.write({"params": {k: v for k, v in vars(args).items() if k != "json"},
                 "excluded": "planning, link calibration and process start-up (timed: the layer calls only)",
                 "results": report}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
