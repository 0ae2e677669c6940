"""``moeplace demo``: the main job, end to end, on the bundled default trace.

trace info -> analyse (JSON + HTML report) -> compare every placement strategy on a held-out window -> write the
best locality plan and export it for SGLang and vLLM. Each stage is the same library call its own command makes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moeplace.cli import MAX_REDUNDANT, float_in, int_in, output_dir
from moeplace.cli.options import add_deployment_options, deployment_from_args
from moeplace.data import default_trace_path
from moeplace.demo import DEFAULT_CLUSTER, DemoConfig, run_demo


def cmd_demo(args: argparse.Namespace) -> int:
    cfg = DemoConfig(Path(args.trace) if args.trace else default_trace_path(), Path(args.out),
                     deployment=deployment_from_args(args), redundant=args.redundant,
                     strategies=tuple(args.strategies.split(",")) if args.strategies else (),
                     export_strategy=args.export_strategy, holdout=args.holdout, seed=args.seed,
                     progress=not args.quiet)
    run_demo(cfg, say=lambda msg: print(msg, flush=True))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="run the main job on the bundled default trace",
        description="Run the whole pipeline on the bundled default trace (or --trace): trace info, analysis "
                    "(JSON + HTML report), every placement strategy planned on one window and scored by the "
                    "simulator on held-out requests, and the chosen plan exported for SGLang and vLLM.",
        epilog="examples:\n  moeplace demo --out out/demo --cluster 4x2 --redundant 8\n"
               "  moeplace demo --cluster 4 --cluster-preset h200-8 --redundant 32\n"
               "  moeplace demo --cluster 4 --cluster-preset h200-8 --hidden-size 2880 --decode-batch 64",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=output_dir, default="out/demo",
                   help="folder for the demo's reports (default: out/demo)")
    p.add_argument("--trace", default=None, help="trace to run on (default: the bundled default trace)")
    add_deployment_options(p, cluster_default=DEFAULT_CLUSTER, profiles=False)
    p.add_argument("--redundant", type=int_in(0, MAX_REDUNDANT), default=8,
                   help="redundant slots per layer (default: 8)")
    p.add_argument("--strategies", default=None, help="comma-separated strategies to compare (default: all)")
    p.add_argument("--export-strategy", default="joint", help="strategy whose plan is exported (default: joint)")
    p.add_argument("--holdout", type=float_in(0, 1, lo_open=True, hi_open=True), default=0.25,
                   help="fraction of requests held out for scoring")
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0, help="seed for the window split and the strategies")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_demo)
