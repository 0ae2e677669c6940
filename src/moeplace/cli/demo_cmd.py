"""``moeplace demo``: the main job on the bundled default trace."""

from __future__ import annotations

import argparse

from moeplace.cli.trace_cmd import cmd_info
from moeplace.data import default_trace_path


def cmd_demo(args: argparse.Namespace) -> int:
    path = default_trace_path()
    print(f"== moeplace demo on the bundled default trace: {path}")
    cmd_info(argparse.Namespace(trace=str(path), json=False))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="run the main job on the bundled default trace",
        description="Run the whole pipeline (trace info, analysis, planning, simulation) on the bundled "
                    "default trace and print what each stage finds.",
        epilog="example:\n  moeplace demo --out out/demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="out/demo", help="folder for the demo's reports (default: out/demo)")
    p.set_defaults(func=cmd_demo)
