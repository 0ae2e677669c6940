"""``moeplace synth``: write a labelled synthetic workload for a model preset."""

from __future__ import annotations

import argparse
import math

from moeplace.cli import CliError, float_in, int_in, output_dir
from moeplace.deploy import MODEL_PRESETS
from moeplace.simulate.synth_config import DEFAULT_MAX_REQUESTS, SynthConfig


def share_list(text: str) -> tuple[float, ...]:
    """Comma-separated finite shares >= 0 with a positive sum, e.g. ``0.5,0.3,0.2``."""
    try:
        if not text.isascii():  # float() reads full-width digits
            raise ValueError(text)
        out = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers, e.g. 0.5,0.3,0.2") from None
    if not all(math.isfinite(x) and x >= 0 for x in out) or not 0 < sum(out) < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: expected finite shares >= 0 with a positive sum")
    return out


def estimate_line(cfg: SynthConfig, preset) -> str:
    """``T tokens, X GB on disk, S to write`` for ``cfg`` on a model preset (synth_estimate)."""
    from moeplace.simulate.synth_config import format_duration, synth_estimate

    tokens, nbytes, seconds = synth_estimate(cfg, preset.num_layers, preset.top_k)
    size = f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"
    return f"{tokens:,} tokens, {size} on disk, {format_duration(seconds)} to write"


def cmd_synth(args: argparse.Namespace) -> int:
    from moeplace.simulate.synth import synthesize
    from moeplace.simulate.synth_config import synth_budget_problem

    mix = args.domain_mix
    if mix is not None and len(mix) != args.domains:
        raise CliError(f"--domain-mix: {len(mix)} shares for {args.domains} domains (--domains)")
    cfg = SynthConfig(num_requests=args.requests, prompt_len=args.prompt_len, gen_len=args.gen_len,
                      length_jitter=args.length_jitter, load_skew=args.load_skew, num_domains=args.domains,
                      domain_mix=mix, domain_strength=args.domain_strength, request_spread=args.request_spread,
                      prefill_decode_corr=args.prefill_decode_corr, temporal_overlap=args.temporal_overlap,
                      layer_affinity=args.layer_affinity, foe_groups=args.foe_groups, seed=args.seed)
    preset = MODEL_PRESETS[args.preset]
    if args.requests > args.max_requests:
        raise CliError(f"synth --requests {args.requests:,}: more than --max-requests {args.max_requests:,} (about "
                       f"{estimate_line(cfg, preset)}); raise --max-requests to write it on purpose")
    problem = synth_budget_problem(cfg, preset.num_layers, preset.num_experts, preset.top_k, args.out)
    if problem:  # before calibration: an impossible size is one line, not an out-of-memory crash hours later
        raise CliError(problem)
    print(f"synth: {args.requests:,} requests, about {estimate_line(cfg, preset)} (estimated from the rates of a "
          "2-core machine)", flush=True)
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
    p.add_argument("--max-requests", type=int_in(1, 1 << 22), default=DEFAULT_MAX_REQUESTS,
                   help="refuse more --requests than this, with the size and time estimate (default: %(default)s)")
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
    p.add_argument("--domain-mix", type=share_list,
                   help="comma-separated request shares per domain, one per --domains (default: equal)")
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
