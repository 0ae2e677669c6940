"""``moeplace train-reference``: rebuild the reference MoE model from installed packages."""

from __future__ import annotations

import argparse

from moeplace.cli import int_in, output_dir
from moeplace.models.reference import PRESETS, REFERENCE_DIR, preset


def cmd_train_reference(args: argparse.Namespace) -> int:
    overrides = {}
    if args.steps is not None:
        if args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        overrides["steps"] = args.steps
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        overrides["threads"] = args.threads
    if args.foe_groups is not None:
        overrides["foe_groups"] = args.foe_groups
    if args.kv_heads is not None:
        overrides["num_kv_heads"] = args.kv_heads
    cfg = preset(args.config, **overrides)
    from moeplace.models.train import train_reference

    print(f"== train-reference: config {args.config}, {cfg.steps} steps, seed {args.seed} -> {args.out}")
    train_reference(cfg, args.out, seed=args.seed, progress=not args.quiet)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-reference", help="train a reference MoE model (Qwen3-MoE or DeepSeek-V3, four domains) from installed "
                                 "packages",
        description="Build the four-domain corpus (code, chat, general prose, generated math; the fine-grained "
                    "configs add sub-domains: C, C++ and Cython code, Python documentation prose), split it by "
                    "document, train a byte-level BPE tokenizer and the model, and write the model folder with "
                    "held-out prompts, corpus manifest, metrics and loss curve. The default config reproduces the "
                    "shipped Qwen3-MoE (about 35-60 min on 2 CPU cores); fine-grained is the DeepSeek-V3-shaped "
                    "second model (64 experts in 8 groups, top-6, 2 shared; about 65 min on 2 cores; "
                    "docs/REFERENCE_MODEL.md).",
        epilog="examples:\n  moeplace train-reference --out out/reference\n"
               "  moeplace train-reference --config fine-grained --out out/reference-fg\n"
               "  moeplace train-reference --config tiny --out /tmp/ref-tiny   # seconds\n"
               "  moeplace train-reference --kv-heads 4 --foe-groups 4 --out out/foe4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=output_dir, default="out/reference",
                   help=f"folder to write the model to (default: out/reference; the shipped one is {REFERENCE_DIR})")
    p.add_argument("--config", default="default", choices=sorted(PRESETS), help="named config (default: default)")
    p.add_argument("--steps", type=int_in(1, 10_000_000), default=None, help="optimizer steps (default: the config's)")
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0, help="init / data order seed (default: 0)")
    p.add_argument("--threads", type=int_in(1, 1024), default=None, help="torch threads (default: the config's, 2)")
    p.add_argument("--foe-groups", type=int_in(1, 64), default=None,
                   help="train a Federation-of-Experts model with this many groups (docs/FOE.md; must divide the KV "
                        "heads, experts and top-k; default 1: the MoE)")
    p.add_argument("--kv-heads", type=int_in(1, 64), default=None,
                   help="key/value heads (default: the config's; FoE H = 4 needs 4)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train_reference)
