"""``moeplace profiles``: the deployment profiles (``--profile NAME`` on plan, compare, simulate and operate)."""

from __future__ import annotations

import argparse
import json


def cmd_profiles(args: argparse.Namespace) -> int:
    from moeplace.deploy.profiles import PROFILES, format_profile, format_profiles, get_profile

    if args.name:
        p = get_profile(args.name)
        print(json.dumps(p.to_json(), indent=2) if args.json else format_profile(p))
    else:
        print(json.dumps([p.to_json() for p in PROFILES.values()], indent=2) if args.json
              else format_profiles(list(PROFILES.values())))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profiles", help="list the deployment profiles (--profile NAME): clusters, batch sizes, kernels, sources",
        description="Deployment profiles: how real deployments run a model's MoE layers, per phase (cluster, tokens "
                    "per GPU per micro-batch, kernel, replica rule, model sizes), each with its public sources and "
                    "the date they were read (docs/DEPLOYMENT.md). plan, compare, simulate and operate take "
                    "--profile NAME; their deployment flags given explicitly override single fields.",
        epilog="examples:\n  moeplace profiles\n  moeplace profiles deepseek-v3-published\n"
               "  moeplace compare T --profile vllm-gpt-oss-ep8 --json c.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", nargs="?", help="one profile to show in full")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_profiles)
