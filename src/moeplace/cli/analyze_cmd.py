"""``moeplace analyze``: activation-pattern statistics of a trace as JSON, an HTML report and a short table."""

from __future__ import annotations

import argparse
from pathlib import Path

from moeplace.analyse.config import DEFAULT_CHUNK_TOKENS, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_WINDOW_TOKENS
from moeplace.cli import MAX_TOKENS, float_in, int_in, output_file
from moeplace.cli.options import add_engine_options, engine_from_args

EXAMPLE = """example:
  moeplace analyze demo.trace --json out/analysis.json --html out/analysis.html --layer 12

The JSON keys are documented in docs/ANALYSIS.md (imbalance.max_over_mean, domain.js_divergence,
domain.classification_accuracy, prefill_decode.pearson, coactivation.top_pairs, ...); metrics a trace
cannot give are null and explained under "unavailable".
"""


def cmd_analyze(args: argparse.Namespace) -> int:
    from moeplace.analyse.summary import analyse_trace, format_summary
    from moeplace.io import atomic_write_json, check_output_path

    for flag, out in (("--json", args.json), ("--html", args.html)):
        if out:  # before the analysis, so a bad path fails in a second, not after the whole run
            check_output_path(out, flag)
    engine = engine_from_args(args)
    try:
        res = analyse_trace(
            args.trace, chunk_tokens=args.chunk_tokens, window_tokens=args.window_tokens,
            coactivation_layer=args.layer, top_n=args.top_n, seed=args.seed, test_fraction=args.test_fraction,
            max_request_bytes=args.max_request_bytes, progress=not args.no_progress, engine=engine,
        )
    finally:
        if engine is not None:
            engine.close()
    if args.json:
        atomic_write_json(res, Path(args.json), allow_nan=False)
    if args.html:
        from moeplace.analyse.report import write_report

        write_report(res, args.html)
    print(format_summary(res))
    for what, p in (("json", args.json), ("html", args.html)):
        if p:
            print(f"  wrote {what}: {p}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "analyze", help="expert activation patterns of a trace (JSON, HTML report, summary)",
        description="Analyse the expert activation patterns of a trace: load imbalance per layer (overall, by "
                    "phase, by domain), domain specificity (JS divergence, held-out domain classification), "
                    "prefill-decode correlation, co-activation and inter-layer affinity with lift, decode "
                    "temporal locality and drift. Per-token traces are streamed in chunks (bounded memory); "
                    "counts-only traces get what counts allow.",
        epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", help="trace directory (per-token or counts-only)")
    p.add_argument("--json", metavar="OUT.json", type=output_file,
                   help="write the statistics as JSON (docs/ANALYSIS.md)")
    p.add_argument("--html", metavar="OUT.html", type=output_file, help="write a self-contained HTML report")
    p.add_argument("--layer", type=int_in(0, 1 << 20), default=None,
                   help="MoE layer of the co-activation heatmap and matrix in the JSON (default: L // 2)")
    p.add_argument("--chunk-tokens", type=int_in(1, MAX_TOKENS), default=DEFAULT_CHUNK_TOKENS,
                   help=f"tokens read and analysed per chunk; bounds memory (default: {DEFAULT_CHUNK_TOKENS})")
    p.add_argument("--window-tokens", type=int_in(1, MAX_TOKENS), default=DEFAULT_WINDOW_TOKENS,
                   help=f"drift window in tokens, trace order (default: {DEFAULT_WINDOW_TOKENS})")
    p.add_argument("--top-n", type=int_in(1, 1 << 16), default=None,
                   help="n of the prefill-decode top-n overlap (default: k)")
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0,
                   help="seed of the domain classifier's split (default: 0)")
    p.add_argument("--test-fraction", type=float_in(0, 1, lo_open=True, hi_open=True), default=0.3,
                   help="held-out share per domain for the classifier (default: 0.3)")
    p.add_argument("--max-request-bytes", type=int_in(1, 1 << 40), default=DEFAULT_MAX_REQUEST_BYTES,
                   help="memory for per-request count vectors; beyond it a seeded subset of requests is tracked "
                        f"(default: {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_engine_options(p)
    p.set_defaults(func=cmd_analyze)
