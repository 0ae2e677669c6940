"""``moeplace trace ...``: inspect, record and import traces."""

from __future__ import annotations

import argparse
import json


def cmd_info(args: argparse.Namespace) -> int:
    from moeplace.trace.describe import format_trace_info
    from moeplace.trace.reader import trace_info

    info = trace_info(args.trace)
    print(json.dumps(info, indent=2) if args.json else format_trace_info(info))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="inspect, record and import routing traces",
                       description="Inspect, record and import routing traces (see docs/TRACE_FORMAT.md).",
                       epilog="examples:\n  moeplace trace info demo.trace --json\n"
                              "  moeplace trace record --model reference --prompts builtin --max-new-tokens 32 "
                              "ref.trace\n"
                              "  moeplace trace import --format gpt-oss-npz ../shared/data/gpt-oss-20b gptoss.trace",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    tsub = p.add_subparsers(dest="trace_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])

    pi = tsub.add_parser(
        "info", help="print what a trace holds",
        description="Print model, L, E, k, requests, tokens by phase and by domain, and size on disk.",
        epilog="example:\n  moeplace trace info demo.trace --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pi.add_argument("trace", help="trace directory")
    pi.add_argument("--json", action="store_true", help="print JSON (keys: num_layers, num_experts, top_k, "
                    "num_requests, num_tokens{prefill,decode}, domains, ...)")
    pi.set_defaults(func=cmd_info)

    from moeplace.cli import trace_compact, trace_import, trace_record

    trace_record.register(tsub)
    trace_import.register(tsub)
    trace_compact.register(tsub)
