"""MoE vs Federation of Experts (FoE) as real runs on emulated nodes: bytes and layer time, next to the predictions.

For each emulated cluster (2x2 and 4x1 by default: one network namespace per node, each node's link shaped with tc
to G x --inter-gbit-per-gpu) this script

1. calibrates the links as ``bench/ep_layer.py`` does (``calibrate_rank`` / ``fit_links``: alpha and bytes/s per
   link class from the same ``all_to_all_single`` calls the runtime makes; r = intra / inter rate);
2. splits every trace into a planning and a held-out window (``moeplace.evaluate``: holdout 0.5, seed 0), plans
   MoE linear and eplb (no redundant slots) on the reference MoE trace and ``foe`` on each FoE trace, and takes the
   same number of held-out decode micro-batches of the same size from each (homes round-robin: no plan here has a
   grouper);
3. runs them through the real layer in W processes (gloo): MoE plans with ``replay_cases`` (repeats interleaved),
   each FoE model with ``foe_replay`` (all-to-all inside each group's block, ring all-reduce across groups), expert
   compute emulated on the same virtual device for all (``compute_seconds``: each rank waits its own pairs'
   roofline time) unless --real-compute;
4. records a2a and all-reduce bytes per link class (FoE's checked against the simulator's ``replay_foe``, MoE's
   against ``predict``), the median layer time (FoE: also all-to-all and all-reduce time), and puts the measured
   T_moe / T_foe next to three predictions: (a) docs/MODEL.md's closed form ``moe_foe_time_ratio(k, H, r, W, n)``,
   (b) the per-GPU bandwidth model ``moe_foe_time_ratio_per_gpu`` (a GPU of FoE's placement holds H*T/W rows, so its
   ring sends 2(p-1) vectors per T/W tokens), (c) the measured bytes over the calibrated rates
   (``bandwidth_seconds``: busiest GPU per layer; per GPU, per node link, and with a fixed cost per call and the
   emulated compute added).

4x1 runs FoE H = 4 only: with H = 2 a group spans 2 GPUs, which would lie on 2 single-GPU nodes
(``FoeLayout`` refuses); the result says so under ``skipped``.

FoE traces: --foe2 / --foe4 (defaults src/moeplace/data/reference-foe.trace and reference-foe-h4.trace, routing of
trained FoE models); --synthetic builds FoE-structured traces with ``moeplace.simulate.synth`` instead (gpt-oss-20b
preset: E = 32, k = 4, first 8 layers; labelled synthetic in the result).

Usage: python bench/foe_ep.py [--synthetic] [--json PATH]   (default: bench/results/foe_ep.json)
Needs root and iproute2 for the namespaces (falls back to plain loopback, which it says, where not permitted).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import numpy as np
from common import BenchRun
from ep_layer import fit_links

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = str(Path(__file__).resolve().parent)
DATA = REPO / "src" / "moeplace" / "data"
TOP_K = 4


# ------------------------------------------------------------------------------------------------ traces


def synthetic_foe_trace(H: int, like, seed: int = 0):
    """An FoE-structured synthetic trace (``moeplace.simulate.synth``, gpt-oss-20b preset: E = 32, k = 4) cut to the
    reference trace's L layers, with its request count and mean prompt / generation lengths; meta.foe_groups = H,
    meta.synthetic True."""
    from moeplace.simulate.synth import SynthConfig, generate_batches
    from moeplace.trace.types import Requests, TokenChunk, Trace

    r = like.requests
    cfg = SynthConfig(num_requests=len(r), prompt_len=max(int(r.prompt_len.mean()), 1),
                      gen_len=max(int(r.gen_len.mean()), 1), foe_groups=H, seed=seed, calibrate=False)
    meta, it = generate_batches("gpt-oss-20b", cfg)
    batches = list(it)
    rid, pos, ph, ids = (np.concatenate([b[1][i] for b in batches]) for i in range(4))
    pl, gl = (np.concatenate([b[0][k] for b in batches]).astype(np.int32) for k in ("prompt_len", "gen_len"))
    dom = np.concatenate([b[0]["domain"] for b in batches]) if "domain" in batches[0][0] else \
        np.array(["unknown"] * len(pl), object)
    L = like.meta.num_layers
    n = len(pl)
    req = Requests(np.arange(n), np.asarray(dom, object), np.array(["synthetic"] * n, object), pl, gl)
    meta = dataclasses.replace(meta, foe_groups=H, num_layers=L, moe_layer_map=None, synthetic=True,
                               source=f"{meta.source} | foe_ep --synthetic (first {L} layers)")
    return Trace(meta, req, TokenChunk(rid, pos, ph, np.ascontiguousarray(ids[:, :L])))


def load_traces(args) -> dict:
    """{"moe": trace, 2: FoE H=2 trace, 4: FoE H=4 trace} and a description of each."""
    from moeplace.trace import read_trace

    moe = read_trace(args.moe)
    out, desc = {"moe": moe}, {"moe": {"path": str(args.moe), "synthetic": bool(moe.meta.synthetic)}}
    for H, path in ((2, args.foe2), (4, args.foe4)):
        if H not in args.groups:
            continue
        if args.synthetic:
            out[H] = synthetic_foe_trace(H, moe, seed=H)
            desc[f"foe_h{H}"] = {"path": None, "synthetic": True, "source": out[H].meta.source}
            continue
        if not Path(path).exists():
            raise SystemExit(f"FoE H={H} trace {path} does not exist: record it (docs/FOE.md) or pass --synthetic")
        out[H] = read_trace(path)
        if int(out[H].meta.foe_groups) != H:
            raise SystemExit(f"{path}: meta.foe_groups is {out[H].meta.foe_groups}, expected {H}")
        desc[f"foe_h{H}"] = {"path": str(path), "synthetic": bool(out[H].meta.synthetic)}
    for key, tr in out.items():
        m = tr.meta
        if (m.num_experts, m.top_k) != (moe.meta.num_experts, moe.meta.top_k) or m.num_layers != moe.meta.num_layers:
            raise SystemExit(f"trace {key}: L={m.num_layers} E={m.num_experts} k={m.top_k}, the MoE trace has "
                             f"L={moe.meta.num_layers} E={moe.meta.num_experts} k={moe.meta.top_k}")
    return out, desc


# ------------------------------------------------------------------------------------------------ windows, plans


def held_out(trace, args):
    from moeplace.evaluate import scoring_trace, split_windows

    win = split_windows(trace, holdout=args.holdout, seed=0)
    return win, scoring_trace(win.held, win.held_signal)


def moe_cases(trace, cluster, batching, args):
    from moeplace.evaluate import held_out_homes
    from moeplace.plan import make_plan
    from moeplace.run.replay import batches_from_window, select_window

    win, scoring = held_out(trace, args)
    out = {}
    for name in ("linear", "eplb"):
        p = make_plan(name, win.plan_work, cluster, 0)
        plan = dataclasses.replace(p, homes=held_out_homes(p, win.held, win.held_signal))
        sub, rows = select_window(scoring, plan, batching, "decode", args.microbatches, args.skip)
        out[f"moe_{name}"] = (plan, sub, rows, batches_from_window(sub, rows, plan))
    return out


def foe_case(trace, cluster, batching, args):
    from moeplace.plan import make_plan
    from moeplace.run.foe_replay import foe_batches
    from moeplace.run.replay import select_window

    win, scoring = held_out(trace, args)
    # the planning window's workload does not carry foe_groups (moeplace.evaluate builds it for plain MoE)
    work = dataclasses.replace(win.plan_work, foe_groups=int(trace.meta.foe_groups))
    p = make_plan("foe", work, cluster, 0)
    plan = dataclasses.replace(p, homes={})  # held-out requests: round-robin, ring index = home % block size
    sub, rows = select_window(scoring, plan, batching, "decode", args.microbatches, args.skip)
    return plan, sub, rows, foe_batches(sub, rows, plan)


# ------------------------------------------------------------------------------------------------ predictions


def link_rates(fit: dict) -> tuple[float, float, float]:
    """(intra bytes/s, inter bytes/s, seconds per call) from ``fit_links``. The per-call cost is the cheapest
    class's measured time of a 1-row call (the fitted intercepts are dominated by the large sizes and come out
    at the 1e-6 floor or above the 1-row time on a busy machine)."""
    intra = fit.get("intra", fit.get("inter"))
    inter = fit.get("inter", intra)
    one_row = min(c["samples"][min(c["samples"])] for c in (intra, inter))
    return intra["bytes_per_s"], inter["bytes_per_s"], float(one_row)


def bytes_prediction(sent: np.ndarray, G: int, fit: dict, calls_per_layer: int, compute_s: float) -> dict:
    """(c): seconds of the measured bytes over the calibrated rates. sent: int [M, L, W, W] every byte handed to
    all_to_all_single (payload, metadata, all-reduce)."""
    from moeplace.placement.foe import bandwidth_seconds

    bi, bo, alpha = link_rates(fit)
    M, L = sent.shape[:2]
    bw = bandwidth_seconds(sent, G, bi, bo)
    node = bandwidth_seconds(sent, G, bi, bo, node_link=True)
    fixed = M * L * calls_per_layer * alpha
    return {"bandwidth_s": bw, "bandwidth_node_link_s": node, "calls_per_layer": calls_per_layer,
            "fixed_s": fixed, "emulated_compute_s": compute_s, "layer_s": bw + fixed + compute_s,
            "layer_node_link_s": node + fixed + compute_s}


def ratio_entry(moe: dict, foe: dict, H: int, W: int, G: int, r: float | None) -> dict:
    """T_moe / T_foe measured (layer; layer minus emulated compute; per repeat range) and predicted (a, b, c)."""
    from moeplace.placement.foe import moe_foe_time_ratio, moe_foe_time_ratio_per_gpu

    r_used = r if r is not None else 1.0  # 4x1: no intra-node link; with H = W = 4 and n = 1, r cancels in (a), (b)
    per_rep = np.array(moe["layer_time_per_repeat_s"]) / np.array(foe["layer_time_per_repeat_s"])
    c_m, c_f = moe["prediction_from_bytes"], foe["prediction_from_bytes"]
    comm_m = moe["layer_time_s"] - (moe["emulated_compute_s"] or 0.0)
    comm_f = foe["layer_time_s"] - (foe["emulated_compute_s"] or 0.0)
    return {
        "tokens_moe": moe["tokens"], "tokens_foe": foe["tokens"],
        "measured_layer": moe["layer_time_s"] / foe["layer_time_s"],
        "measured_layer_per_repeat_min": float(per_rep.min()), "measured_layer_per_repeat_max": float(per_rep.max()),
        "measured_without_compute": comm_m / comm_f if comm_f > 0 else float("nan"),
        "predicted_a_closed_form": moe_foe_time_ratio(TOP_K, H, r_used, W=W, n=G),
        "predicted_b_per_gpu": moe_foe_time_ratio_per_gpu(TOP_K, H, r_used, W, G),
        "predicted_c_bytes": c_m["bandwidth_s"] / c_f["bandwidth_s"],
        "predicted_c_bytes_node_link": c_m["bandwidth_node_link_s"] / c_f["bandwidth_node_link_s"],
        "predicted_c_layer": c_m["layer_s"] / c_f["layer_s"],
        "predicted_c_layer_node_link": c_m["layer_node_link_s"] / c_f["layer_node_link_s"],
        "r_used": r,
    }


def per_token(row: dict, L: int, row_bytes: int) -> dict:
    """Measured vectors per token per layer, cluster-wide (bytes / (tokens x L x row bytes))."""
    d = row["tokens"] * L * row_bytes
    return {k: row[f"{k}_bytes"] / d for k in ("a2a_inter_node", "a2a_intra_node", "allreduce_inter_node",
                                                "allreduce_intra_node")}


def closed_form_per_token(H: int, W: int, G: int) -> dict:
    """docs/MODEL.md's vectors per token per layer (H = 1: plain MoE), pair level; for FoE also the ring's
    cluster-wide count 2(p-1) (each token's vector is held by the p ranks of its ring)."""
    from moeplace.placement.foe import foe_all_reduce_vectors, foe_all_to_all_vectors, moe_all_to_all_vectors

    if H == 1:
        total, inter = moe_all_to_all_vectors(TOP_K, W, G)
        return {"a2a_inter_node": inter, "a2a_intra_node": total - inter}
    p = min(W, H)
    return {"a2a": foe_all_to_all_vectors(TOP_K, H, W), "allreduce_model_md": foe_all_reduce_vectors(H, W),
            "allreduce_ring_total": float(2 * (p - 1))}


# ------------------------------------------------------------------------------------------------ main


def run(args) -> dict:
    from moeplace.placement import Cluster
    from moeplace.placement.foe import FoeLayout, foe_per_gpu_vectors
    from moeplace.run.foe_replay import foe_replay, summarize_foe
    from moeplace.run.launch import launch
    from moeplace.run.netns import emulated_cluster
    from moeplace.run.replay import ReplayConfig, compute_seconds, predict, replay_cases, replay_cost, summarize
    from moeplace.run.report import FOE_BYTE_KEYS
    from moeplace.simulate import BatchConfig
    from moeplace.simulate.foe import replay_foe

    env = {"PYTHONPATH": os.pathsep.join([BENCH_DIR, os.environ.get("PYTHONPATH", "")])}
    cfg = ReplayConfig(hidden=args.hidden, ffn=args.ffn, dtype=args.dtype, repeats=args.repeats, timeout=900,
                       emulate_compute=not args.real_compute)
    batching = BatchConfig(decode_batch=args.batch, prefill_tokens=8192)
    traces, desc = load_traces(args)
    report: dict = {"traces": desc, "clusters": {}}
    for spec in args.clusters:
        N, G = (int(v) for v in spec.split("x"))
        W = N * G
        node_gbit = args.inter_gbit_per_gpu * G  # a node's link carries its G ranks
        groups, skipped = [], {}
        for H in args.groups:
            try:
                FoeLayout(H, W, G)
                groups.append(H)
            except ValueError as e:
                skipped[f"foe_h{H}"] = str(e)
        with emulated_cluster(N, G, inter_gbit=node_gbit if N > 1 else None) as emu:
            if emu.note:
                print(f"{spec}: {emu.note}", file=sys.stderr)
            cal = launch("ep_layer:calibrate_rank", W,
                         dict(hidden=args.hidden, ffn=args.ffn or args.hidden, gpus_per_node=G,
                              sizes=(1, 64, 256, 1024), reps=7), env=env, timeout=300, **emu.launch_kwargs())
            fit = fit_links(cal, args.hidden * cfg.bytes_per_element)
            bi, bo, alpha = link_rates(fit)
            flops = fit["flops_per_rank"] if args.real_compute else args.emu_gflops * 1e9
            intra_alpha = fit.get("intra", fit.get("inter"))["alpha_s"]
            inter_alpha = fit.get("inter", fit.get("intra"))["alpha_s"]
            calib = Cluster(N, G, intra_bw=bi, inter_bw=bo, intra_latency=2 * intra_alpha,
                            inter_latency=2 * inter_alpha, expert_flops=flops, hbm_bw=args.emu_hbm_gbps * 1e9)
            r = fit["intra"]["bytes_per_s"] / fit["inter"]["bytes_per_s"] if "intra" in fit and "inter" in fit \
                else None
            print(f"{spec}: calibrated intra {bi / 1e6:.0f} MB/s, inter {bo / 1e6:.0f} MB/s, per call "
                  f"{alpha * 1e3:.2f} ms, r = {r if r is not None else float('nan'):.1f}", file=sys.stderr)
            cres: dict = {"emulation": {"mode": emu.mode, "node_link_gbit": emu.inter_gbit, "note": emu.note},
                          "calibration": fit, "r_measured": r, "alpha_per_call_s": alpha, "skipped": skipped,
                          "runs": {}, "ratios": {}}
            # MoE: linear and eplb in one launch, repeats interleaved
            mc = moe_cases(traces["moe"], calib, batching, args)
            t0 = time.perf_counter()
            res = replay_cases([(p, b) for p, _, _, b in mc.values()], cfg, env=env, compute_cluster=calib,
                               **emu.launch_kwargs())
            wall = time.perf_counter() - t0
            for (name, (plan, sub, _rows, batches)), rr in zip(mc.items(), res, strict=True):
                m = summarize(rr)
                sim = predict(sub, plan, cfg, batching, cluster=calib).all.to_json()
                sent = rr.dispatch_bytes + rr.combine_bytes + rr.meta_bytes
                comp = float(rr.compute_seconds.max(-1).sum()) if rr.compute_seconds is not None else 0.0
                cres["runs"][name] = {
                    "model": "MoE", "strategy": plan.strategy, "tokens": int(sum(len(b) for b in batches)),
                    "microbatches": len(batches),
                    "a2a_inter_node_bytes": m["inter_node_bytes"]["total"],
                    "a2a_intra_node_bytes": m["intra_node_bytes"]["total"],
                    "meta_inter_node_bytes": m["meta_inter_node_bytes"]["total"],
                    "meta_intra_node_bytes": m["meta_intra_node_bytes"]["total"],
                    "allreduce_inter_node_bytes": 0, "allreduce_intra_node_bytes": 0,
                    "layer_time_s": m["layer_time_s"]["total"],
                    "layer_time_per_repeat_s": rr.layer_seconds.sum((1, 2)).tolist(),
                    "emulated_compute_s": comp if rr.compute_seconds is not None else None,
                    "bytes_match_simulator": all(m[k]["total"] == sim[k]["total"]
                                                 for k in ("inter_node_bytes", "intra_node_bytes")),
                    "prediction_from_bytes": bytes_prediction(sent, G, fit, 4, comp),
                    "run_wall_s": wall,
                }
            # FoE: one launch per model
            for H in groups:
                plan, sub, rows, batches = foe_case(traces[H], calib, batching, args)
                waits = compute_seconds(plan, batches, cfg, calib) if cfg.emulate_compute else None
                t0 = time.perf_counter()
                fr = foe_replay(plan, batches, cfg, waits=waits, env=env, **emu.launch_kwargs())
                wall = time.perf_counter() - t0
                m = summarize_foe(fr)
                sim = replay_foe(sub, rows, plan, replay_cost(cfg), batching)
                keys = FOE_BYTE_KEYS
                lay = fr.layout
                sent = fr.dispatch_bytes + fr.combine_bytes + fr.meta_bytes + fr.allreduce_bytes
                comp = float(waits.max(-1).sum()) if waits is not None else 0.0
                calls = (4 if lay.block_size > 1 else 0) + 2 * (lay.ring_size - 1)
                cres["runs"][f"foe_h{H}"] = {
                    "model": f"FoE H={H}", "strategy": plan.strategy, "tokens": int(sum(len(b) for b in batches)),
                    "microbatches": len(batches), "layout": m["foe"],
                    "a2a_inter_node_bytes": m["inter_node_bytes"]["total"],
                    "a2a_intra_node_bytes": m["intra_node_bytes"]["total"],
                    "meta_inter_node_bytes": m["meta_inter_node_bytes"]["total"],
                    "meta_intra_node_bytes": m["meta_intra_node_bytes"]["total"],
                    "allreduce_inter_node_bytes": m["allreduce_inter_node_bytes"]["total"],
                    "allreduce_intra_node_bytes": m["allreduce_intra_node_bytes"]["total"],
                    "layer_time_s": m["layer_time_s"]["total"],
                    "layer_time_per_repeat_s": fr.layer_seconds.sum((1, 2)).tolist(),
                    "alltoall_time_s": m["alltoall_time_s"]["total"],
                    "allreduce_time_s": m["allreduce_time_s"]["total"],
                    "emulated_compute_s": comp if waits is not None else None,
                    "bytes_match_simulator": all(m[k]["total"] == sim[k]["total"] for k in keys),
                    "allreduce_matches_closed_form": (m["allreduce_inter_node_bytes"]["total"]
                                                      + m["allreduce_intra_node_bytes"]["total"]
                                                      == sim["closed_form"]["allreduce_bytes"]),
                    "per_gpu_vectors": foe_per_gpu_vectors(TOP_K, H, W, G),
                    "prediction_from_bytes": bytes_prediction(sent, G, fit, calls, comp),
                    "run_wall_s": wall,
                }
                for moe_name in ("moe_linear", "moe_eplb"):
                    cres["ratios"][f"{moe_name}_over_foe_h{H}"] = ratio_entry(
                        cres["runs"][moe_name], cres["runs"][f"foe_h{H}"], H, W, G, r)
            row_bytes = args.hidden * cfg.bytes_per_element
            L = traces["moe"].meta.num_layers
            for name, row in cres["runs"].items():
                row["vectors_per_token"] = per_token(row, L, row_bytes)
                row["closed_form_vectors_per_token"] = closed_form_per_token(
                    1 if name.startswith("moe") else int(name.removeprefix("foe_h")), W, G)
            for name, row in cres["runs"].items():
                print(f"  {spec} {name}: layer {row['layer_time_s'] * 1e3:.0f} ms, a2a inter "
                      f"{row['a2a_inter_node_bytes'] / 1e6:.2f} MB intra {row['a2a_intra_node_bytes'] / 1e6:.2f} MB, "
                      f"all-reduce inter {row['allreduce_inter_node_bytes'] / 1e6:.2f} MB intra "
                      f"{row['allreduce_intra_node_bytes'] / 1e6:.2f} MB, simulator "
                      f"{'same' if row['bytes_match_simulator'] else 'DIFFERENT'}", file=sys.stderr)
        report["clusters"][spec] = cres
    runs = [r for c in report["clusters"].values() for r in c["runs"].values()]
    foe = [r for r in runs if "allreduce_matches_closed_form" in r]
    report["checks"] = {"runs": len(runs), "bytes_match_simulator": sum(r["bytes_match_simulator"] for r in runs),
                        "foe_runs": len(foe),
                        "allreduce_matches_closed_form": sum(r["allreduce_matches_closed_form"] for r in foe)}
    return report


def print_table(report: dict) -> None:
    print("| cluster | MoE / FoE | measured layer | measured minus compute | (a) closed form | (b) per GPU | "
          "(c) bytes | (c) bytes, node link | (c) layer |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec, c in report["clusters"].items():
        for key, v in c["ratios"].items():
            print(f"| {spec} | {key} | {v['measured_layer']:.2f} | {v['measured_without_compute']:.2f} | "
                  f"{v['predicted_a_closed_form']:.2f} | {v['predicted_b_per_gpu']:.2f} | {v['predicted_c_bytes']:.2f} "
                  f"| {v['predicted_c_bytes_node_link']:.2f} | {v['predicted_c_layer']:.2f} |")
        for key, why in c["skipped"].items():
            print(f"| {spec} | {key} skipped: {why} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe", type=Path, default=DATA / "reference-default.trace", help="the plain MoE trace")
    ap.add_argument("--foe2", type=Path, default=DATA / "reference-foe.trace", help="FoE H = 2 trace")
    ap.add_argument("--foe4", type=Path, default=DATA / "reference-foe-h4.trace", help="FoE H = 4 trace")
    ap.add_argument("--synthetic", action="store_true",
                    help="build synthetic FoE-structured traces (moeplace.simulate.synth) instead of reading "
                         "--foe2/--foe4")
    ap.add_argument("--clusters", nargs="+", default=["2x2", "4x1"])
    ap.add_argument("--groups", nargs="+", type=int, default=[2, 4], choices=[2, 4], help="FoE H values")
    ap.add_argument("--inter-gbit-per-gpu", type=float, default=0.5,
                    help="shaped inter-node rate per GPU in Gbit/s (a node's link gets G times this)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ffn", type=int, default=128, help="expert intermediate size")
    ap.add_argument("--batch", type=int, default=64, help="requests per decode window (micro-batch size)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--skip", type=int, default=2,
                    help="decode micro-batches skipped first (window 0's first steps: every request of the window "
                         "still decodes, so MoE and FoE micro-batches hold the same number of tokens)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--holdout", type=float, default=0.5)
    ap.add_argument("--real-compute", action="store_true",
                    help="run the experts instead of waiting their predicted time (ranks then share the cores)")
    ap.add_argument("--emu-gflops", type=float, default=20.0, help="emulated compute: GFLOP/s per rank")
    ap.add_argument("--emu-hbm-gbps", type=float, default=50.0, help="emulated compute: weight-memory GB/s per rank")
    ap.add_argument("--json", default=None, help="write here instead of bench/results/foe_ep.json")
    args = ap.parse_args(argv)
    bench = BenchRun("foe_ep", baseline="MoE (reference trace; linear and eplb plans, no redundant slots) on the "
                                        "same emulated cluster, window size, hidden size and virtual device")
    report = run(args)
    print_table(report)
    bench.write({"params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                            if k != "json"},
                 "synthetic_foe_traces": bool(args.synthetic),
                 "excluded": "planning, link calibration and process start-up (timed: the layer calls only)",
                 "results": report}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
