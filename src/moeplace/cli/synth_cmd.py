"""``moeplace synth``: write a labelled synthetic workload for a model preset."""

from __future__ import annotations

import argparse

from moeplace.cli import float_in, int_in, output_dir
from moeplace.deploy import MODEL_PRESETS
from moeplace.simulate.synth_config import SynthConfig


def cmd_synth(args: argparse.Namespace) -> int:
    from moeplace.simulate.synth import synthesize

    mix = tuple(float(x) for x in args.domain_mix.split(",")) if args.domain_mix else None
    cfg = SynthConfig(num_requests=args.requests, prompt_len=args.prompt_len, gen_len=args.gen_len,
                      length_jitter=args.length_jitter, load_skew=args.load_skew, num_domains=args.domains,
                      domain_mix=mix, domain_strength=args.domain_strength, request_spread=args.request_spread,
                      prefill_decode_corr=args.prefill_decode_corr, temporal_overlap=args.temporal_overlap,
                      layer_affinity=args.layer_affinity, foe_groups=args.foe_groups, seed=args.seed)
    path = synthesize(args.out, args.preset, cfg, overwrite=args.overwrite, progress=not args.quiet)
    print(f"wrote SYNTHETIC workload {path} (preset {args.preset}, {args.requests} requests, seed {args.seed}); "
          "metadata says synthetic=True")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    d = SynthConfig()
    p = sub.add_parser(
        "synth", help="generate a synthetic (labelled) workload for a model preset",
        description="Generate a synthetic routing trace for a model preset with calibrated load skew, "
                    "prefill-decode correlation and temporal locality (docs/PRESETS.md). The trace metadata says "
                    "synthetic=True and its source says synthetic.",
        epilog="example:\n  moeplace synth --preset deepseek-v3 --requests 1000 --prompt-len 512 --gen-len 256 "
               "out.trace",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("out", type=output_dir, help="trace directory to write")
    p.add_argument("--preset", required=True, choices=sorted(MODEL_PRESETS), help="model preset")
    p.add_argument("--requests", type=int_in(1, 1 << 22), default=d.num_requests,
                   help="requests (default: %(default)s)")
    p.add_argument("--prompt-len", type=int_in(1, 1 << 20), default=d.prompt_len,
                   help="mean prompt tokens (default: %(default)s)")
    p.add_argument("--gen-len", type=int_in(0, 1 << 20), default=d.gen_len,
                   help="mean generated tokens (default: %(default)s)")
    p.add_argument("--length-jitter", type=float_in(0, 1, hi_open=True), default=d.length_jitter,
                   help="lengths uniform in [1-j, 1+j] x mean (default: %(default)s)")
    p.add_argument("--load-skew", type=float_in(1, 1e6), default=d.load_skew,
                   help="per-layer max/mean expert load (default: %(default)s)")
    p.add_argument("--domains", type=int_in(1, 1024), default=d.num_domains,
                   help="number of domains (default: %(default)s)")
    p.add_argument("--domain-mix", help="comma-separated request shares per domain (default: equal)")
    p.add_argument("--domain-strength", type=float_in(0, 1), default=d.domain_strength,
                   help="share of a request's preference shared with its domain, 0..1 (default: %(default)s)")
    p.add_argument("--request-spread", type=float_in(0, 1e3), default=d.request_spread,
                   help="std of request-level logit offsets (default: %(default)s)")
    p.add_argument("--prefill-decode-corr", type=float_in(-1, 1), default=d.prefill_decode_corr,
                   help="mean Pearson of prefill vs decode expert counts (default: %(default)s)")
    p.add_argument("--temporal-overlap", type=float_in(0, 1), default=d.temporal_overlap,
                   help="share of top-k kept by consecutive decode tokens (default: %(default)s)")
    p.add_argument("--layer-affinity", type=float_in(0, 1), default=d.layer_affinity,
                   help="probability a new expert follows its previous-layer partner (default: %(default)s)")
    p.add_argument("--foe-groups", type=int_in(0, 1024), default=d.foe_groups,
                   help="FoE structure: k/H experts in each of H groups (default: off)")
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=d.seed, help="random seed (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it is a moeplace trace")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_synth)
