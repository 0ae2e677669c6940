"""``moeplace demo``: the main job, end to end, on the bundled default trace.

trace info -> analyse (JSON + HTML report) -> compare every placement strategy on a held-out window -> write the
best locality plan and export it for SGLang and vLLM. Each stage is the same library call its own command makes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from moeplace.cli import MAX_REDUNDANT, cluster_spec, float_in, int_in, output_dir
from moeplace.cli.trace_cmd import cmd_info
from moeplace.data import default_trace_path
from moeplace.io import atomic_write_json


def _stage(n: int, title: str) -> float:
    print(f"\n== [{n}/4] {title}", flush=True)
    return time.perf_counter()


def cmd_demo(args: argparse.Namespace) -> int:
    from moeplace.analyse import analyse_trace
    from moeplace.cli.analyze_cmd import print_summary
    from moeplace.cli.plan_cmd import format_table, workload_from_path
    from moeplace.placement import Cluster
    from moeplace.plan import STRATEGIES, make_plan
    from moeplace.plan.compare import compare
    from moeplace.plan.export import export_plan
    from moeplace.report import write_report
    from moeplace.trace import read_meta, read_trace

    trace = Path(args.trace) if args.trace else default_trace_path()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cluster = Cluster.parse(args.cluster)
    names = args.strategies.split(",") if args.strategies else list(STRATEGIES)
    meta = read_meta(trace)
    tag = " [SYNTHETIC]" if meta.synthetic else ""
    print(f"moeplace demo on {trace}{tag}\nreports go to {out}/")

    _stage(1, "trace")
    cmd_info(argparse.Namespace(trace=str(trace), json=False))

    t0 = _stage(2, "analyse: load imbalance, domains, prefill->decode, co-activation")
    res = analyse_trace(trace, progress=not args.quiet)
    atomic_write_json(res, out / "analysis.json", allow_nan=False)
    write_report(res, out / "report.html")
    print_summary(res)
    print(f"  ({time.perf_counter() - t0:.1f} s) wrote {out / 'analysis.json'} and {out / 'report.html'}")

    t0 = _stage(3, f"plan every strategy on a window, score on held-out requests ({cluster.spec()}, "
                   f"{args.redundant} redundant slots per layer)")
    tr = read_trace(trace)

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"  {msg} ...", flush=True)

    cmp = compare(tr, cluster, args.redundant, names, holdout=args.holdout, seed=args.seed, progress=say)
    atomic_write_json(cmp, out / "compare.json")
    print(f"  planned on {cmp['planning_requests']} requests, scored on {cmp['held_out_requests']} held-out "
          f"requests ({cmp['scored_tokens']} decode tokens)")
    print(format_table(cmp))
    print(f"  ({time.perf_counter() - t0:.1f} s) wrote {out / 'compare.json'}")

    best = args.export_strategy
    t0 = _stage(4, f"plan '{best}' on the whole trace and export it")
    work, planned_on, info = workload_from_path(str(trace), None, 32)
    plan = make_plan(best, work, cluster, args.redundant, planned_on=planned_on, seed=args.seed)
    plan.save(out / f"{best}.plan.json")
    export_plan(plan, "sglang", out / f"{best}.sglang.json", info.get("moe_layer_map"))
    export_plan(plan, "vllm", out / f"{best}.vllm.json")
    for f in (f"{best}.plan.json", f"{best}.sglang.json", f"{best}.vllm.json"):
        print(f"  wrote {out / f}")
    row = cmp["strategies"].get(best)
    if row:
        print(f"\n'{best}' on held-out requests: inter-node bytes {row['inter_node_bytes_vs_linear']:.2f}x linear, "
              f"balancedness {row['balancedness']:.3f}  ({time.perf_counter() - t0:.1f} s)")
    print(f"open {out / 'report.html'} in a browser for the figures")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="run the main job on the bundled default trace",
        description="Run the whole pipeline on the bundled default trace (or --trace): trace info, analysis "
                    "(JSON + HTML report), every placement strategy planned on one window and scored by the "
                    "simulator on held-out requests, and the chosen plan exported for SGLang and vLLM.",
        epilog="example:\n  moeplace demo --out out/demo --cluster 4x2 --redundant 8",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=output_dir, default="out/demo",
                   help="folder for the demo's reports (default: out/demo)")
    p.add_argument("--trace", default=None, help="trace to run on (default: the bundled default trace)")
    p.add_argument("--cluster", type=cluster_spec, default="4x2", help="NODESxGPUS (default: 4x2)")
    p.add_argument("--redundant", type=int_in(0, MAX_REDUNDANT), default=8,
                   help="redundant slots per layer (default: 8)")
    p.add_argument("--strategies", default=None, help="comma-separated strategies to compare (default: all)")
    p.add_argument("--export-strategy", default="joint", help="strategy whose plan is exported (default: joint)")
    p.add_argument("--holdout", type=float_in(0, 1, lo_open=True, hi_open=True), default=0.25,
                   help="fraction of requests held out for scoring")
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0, help="seed for the window split and the strategies")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_demo)
