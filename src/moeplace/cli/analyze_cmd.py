"""``moeplace analyze``: activation-pattern statistics of a trace as JSON, an HTML report and a short table."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moeplace.analyse.summary import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_WINDOW_TOKENS,
    analyse_trace,
)
from moeplace.io import atomic_write_json, check_output_path

EXAMPLE = """example:
  moeplace analyze demo.trace --json out/analysis.json --html out/analysis.html --layer 12

The JSON keys are documented in docs/ANALYSIS.md (imbalance.max_over_mean, domain.js_divergence,
domain.classification_accuracy, prefill_decode.pearson, coactivation.top_pairs, ...); metrics a trace
cannot give are null and explained under "unavailable".
"""


def _f(v, fmt: str = "{:.3f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def print_summary(res: dict, out=None) -> None:
    """The short summary table printed by ``moeplace analyze``."""
    out = sys.stdout if out is None else out  # resolved per call: sys.stdout may be swapped
    m = res["meta"]
    tag = "  [SYNTHETIC]" if m["synthetic"] else ""
    nt = m["num_tokens"]
    print(f"{m['model']}{tag}: {m['kind']} trace, L={m['num_layers']} E={m['num_experts']} k={m['top_k']}, "
          f"{nt['total']:,.0f} tokens (prefill {nt['prefill']:,.0f}, decode {nt['decode']:,.0f}), "
          f"{m['num_requests']:,} requests", file=out)
    imb, dom, pd, tm, dr = res["imbalance"], res["domain"], res["prefill_decode"], res["temporal"], res["drift"]
    mom = [v for v in imb["max_over_mean"] if v is not None]
    rows = [
        ("max/mean expert load", _f(imb["layer_mean"]["max_over_mean"], "{:.2f}"),
         f"layers {min(mom):.2f} .. {max(mom):.2f}" if mom else ""),
        ("Gini of expert load", _f(imb["layer_mean"]["gini"]), ""),
        ("top-10% experts' share", _f(imb["layer_mean"]["top10_share"], "{:.1%}"), ""),
        ("domain JS divergence (bits)", _f(dom["js_divergence_mean"], "{:.4f}"), ", ".join(dom["order"])),
        ("domain classification", _f(dom["classification_accuracy"], "{:.1%}"),
         "" if dom["classification"]["chance"] is None else f"majority baseline {dom['classification']['chance']:.1%}"),
        ("prefill-decode Pearson", _f(pd["pearson_mean"]), f"{pd['num_requests']} requests"),
        ("decode overlap with prev token", _f(tm["decode_overlap_mean"], "{:.1%}"),
         f"random {tm['random_overlap']:.1%}"),
        ("drift JS between windows", _f(dr["js_mean"], "{:.4f}"),
         "" if dr["split_half_js_mean"] is None else f"split-half reference {dr['split_half_js_mean']:.4f}"),
    ]
    top = res["coactivation"]["top_lift_pairs"]
    if top:
        p = top[0]
        rows.append(("strongest co-activation", f"lift {p['lift']:.1f}",
                     f"layer {p['layer']}, experts {p['experts'][0]}+{p['experts'][1]} ({p['count']:,.0f} tokens)"))
    w = max(len(r[0]) for r in rows)
    for name, val, note in rows:
        print(f"  {name:<{w}}  {val:>8}  {note}", file=out)
    if res["unavailable"]:
        print("  unavailable: " + "; ".join(f"{k} ({v})" for k, v in res["unavailable"].items()), file=out)


def cmd_analyze(args: argparse.Namespace) -> int:
    for flag, out in (("--json", args.json), ("--html", args.html)):
        if out:  # before the analysis, so a bad path fails in a second, not after the whole run
            check_output_path(out, flag)
    res = analyse_trace(
        args.trace, chunk_tokens=args.chunk_tokens, window_tokens=args.window_tokens,
        coactivation_layer=args.layer, top_n=args.top_n, seed=args.seed, test_fraction=args.test_fraction,
        max_request_bytes=args.max_request_bytes, progress=not args.no_progress,
    )
    if args.json:
        atomic_write_json(res, Path(args.json), allow_nan=False)
    if args.html:
        from moeplace.report import write_report

        write_report(res, args.html)
    print_summary(res)
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
    p.add_argument("--json", metavar="OUT.json", help="write the statistics as JSON (docs/ANALYSIS.md)")
    p.add_argument("--html", metavar="OUT.html", help="write a self-contained HTML report")
    p.add_argument("--layer", type=int, default=None,
                   help="MoE layer of the co-activation heatmap and matrix in the JSON (default: L // 2)")
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                   help=f"tokens read and analysed per chunk; bounds memory (default: {DEFAULT_CHUNK_TOKENS})")
    p.add_argument("--window-tokens", type=int, default=DEFAULT_WINDOW_TOKENS,
                   help=f"drift window in tokens, trace order (default: {DEFAULT_WINDOW_TOKENS})")
    p.add_argument("--top-n", type=int, default=None, help="n of the prefill-decode top-n overlap (default: k)")
    p.add_argument("--seed", type=int, default=0, help="seed of the domain classifier's split (default: 0)")
    p.add_argument("--test-fraction", type=float, default=0.3,
                   help="held-out share per domain for the classifier (default: 0.3)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="memory for per-request count vectors; beyond it a seeded subset of requests is tracked "
                        f"(default: {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_analyze)
