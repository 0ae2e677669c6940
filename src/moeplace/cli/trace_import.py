"""``moeplace trace import``: convert engine dumps and published routing data into a moeplace trace."""

from __future__ import annotations

import argparse
import sys

from moeplace.cli import int_in, output_dir
from moeplace.trace.importers import IMPORTERS, not_imported


def cmd_import(args: argparse.Namespace) -> int:
    from moeplace.trace.describe import format_trace_info
    from moeplace.trace.importers import import_trace
    from moeplace.trace.reader import trace_info

    options = {k: getattr(args, k) for k in ("limit", "model", "num_experts", "top_k", "hidden_size",
                                             "num_shared_experts")}
    options["weights"] = False if args.no_weights else None
    out = import_trace(args.format, args.src, args.out, overwrite=args.overwrite, **options)
    print(f"imported {args.src} ({args.format}) -> {out}")
    print(f"not imported (docs/PRIVACY.md): {not_imported(args.format)}", file=sys.stderr)
    print(format_trace_info(trace_info(out)))
    return 0


def register(tsub: argparse._SubParsersAction) -> None:
    """Add the ``import`` subcommand to ``moeplace trace``."""
    lines = "\n".join(f"  {f.name:<18} {f.summary}" for f in IMPORTERS.values())
    p = tsub.add_parser(
        "import", help="import engine dumps or published routing data as a trace",
        description="Convert routing recorded elsewhere into a moeplace trace (layouts: docs/IMPORTERS.md).",
        epilog=f"formats:\n{lines}\n\nexamples:\n"
               "  moeplace trace import --format gpt-oss-npz ../shared/data/gpt-oss-20b gpt-oss.trace --limit 48\n"
               "  moeplace trace import --format olmoe-npz ../shared/data/olmoe-mixtral/olmoe.npz olmoe.trace\n"
               "  moeplace trace import --format sglang-per-token dump_0.pt sgl.trace --model deepseek-ai/DeepSeek-V3",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--format", required=True, metavar="FORMAT",
                   help=f"input format: {', '.join(IMPORTERS)}")
    p.add_argument("src", help="input file or directory")
    p.add_argument("out", type=output_dir, help="trace directory to write")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it is a moeplace trace that holds no input (swapped in when complete)")
    p.add_argument("--limit", type=int_in(1, 1 << 40), help="gpt-oss-npz: import only the first N generations")
    p.add_argument("--no-weights", action="store_true", help="gpt-oss-npz: drop routing weights (3x smaller)")
    p.add_argument("--model", help="vllm-routed, sglang-*: model name for the metadata (default: unknown)")
    p.add_argument("--num-experts", type=int_in(1, 32768),
                   help="vllm-routed, sglang-per-token: E (default: largest id + 1)")
    p.add_argument("--top-k", type=int_in(1, 1024), help="sglang-stat: K, which the stat dump does not record")
    p.add_argument("--hidden-size", type=int_in(1, 1 << 20), help="vllm-routed, sglang-*: model hidden size")
    p.add_argument("--num-shared-experts", type=int_in(0, 1024),
                   help="vllm-routed, sglang-*: shared experts (default 0)")
    p.set_defaults(func=cmd_import)
