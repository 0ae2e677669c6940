"""``moeplace simulate``: replay a trace on a plan and report what it costs."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from moeplace.cli import MAX_REDUNDANT, MAX_TOKENS, input_file, int_in, output_file
from moeplace.cli.options import (
    add_deployment_options,
    add_engine_options,
    batch_config,
    cost_config,
    deployment_from_args,
    engine_from_args,
)

if TYPE_CHECKING:
    from moeplace.placement import Cluster


def _cluster(args: argparse.Namespace) -> Cluster | None:
    return None if args.cluster is None and not args.profile else deployment_from_args(args).cluster


def cmd_simulate(args: argparse.Namespace) -> int:
    from moeplace.deploy import Deployment
    from moeplace.placement import Plan
    from moeplace.simulate import simulate

    plan = Plan.load(args.plan) if args.plan else None
    cluster = _cluster(args)
    if plan is None and cluster is None:
        raise ValueError("give --plan PLAN.json or --cluster NxG (default linear placement)")
    if plan is not None and args.redundant:
        raise ValueError("--redundant applies to the default linear placement only, not to --plan")
    if plan is not None and plan.homes:  # homes are for the requests of the trace the plan was made on
        from moeplace.trace.reader import read_requests

        have = set(read_requests(args.trace).request_id.tolist())
        unknown = sorted(r for r in plan.homes if r not in have)
        if unknown:
            raise ValueError(f"{args.plan}: homes name {len(unknown)} request(s) that {args.trace} does not hold "
                             f"(e.g. request {unknown[0]}): a plan's homes are for the requests of the trace it was "
                             "made on; plan this trace, or give a plan without homes")
    if plan is not None and plan.foe_groups > 1:
        raise ValueError(f"{args.plan} is an FoE plan (foe_groups={plan.foe_groups}); simulate replays plain MoE "
                         "execution. run-ep reports an FoE run next to the simulator's FoE replay of the same "
                         "micro-batches (docs/FOE.md)")
    if args.profile:  # the profile's pool (--profile-phase), explicit flags overriding single fields
        dep = deployment_from_args(args)
    else:
        dep = Deployment(cluster or plan.cluster, args.cluster_preset, args.hidden_size, args.dispatch_bytes,
                         args.combine_bytes, args.mode, args.rule, args.overlap, args.decode_batch,
                         args.prefill_tokens, args.decode_running)
    cost, batching = cost_config(dep), batch_config(dep)
    rule = dep.rule
    if plan is not None and plan.dispatch_rule and "rule" not in (getattr(args, "deployment_given", None) or ()):
        rule = plan.dispatch_rule  # a plan chosen with its dispatch rule is replayed under it unless --rule says
    engine = engine_from_args(args)
    try:
        res = simulate(args.trace, plan, cluster, cost, batching, rule=rule, num_redundant=args.redundant,
                       chunk_tokens=args.chunk_tokens, progress=args.progress, engine=engine)
    finally:
        if engine is not None:
            engine.close()
    j = res.to_json()
    if args.json:
        res.save_json(args.json)
    from moeplace.simulate.config import AUTO_MODE, describe_mode

    tag = " [SYNTHETIC workload]" if j["synthetic"] else ""
    prof = f", profile {dep.profile}" if dep.profile else ""
    print(f"simulated {args.trace}{tag} on {res.cluster.spec()} ({j['plan_strategy']}, rule {res.rule}{prof})")
    print(f"  kernel: {describe_mode(res.cost.mode)}"
          + (", two-batch overlap of dispatch, expert compute and combine" if res.cost.overlap else "")
          + "; layer times are per layer per micro-batch (mean), in µs")
    us = j["layer_time_us_per_microbatch"]
    for ph in ("prefill", "decode"):
        p = j[ph]
        if not p["num_tokens"]:
            print(f"  {ph:8s} tokens {0:>10,}  (none in this trace: no {ph} metrics)")
            continue
        L = len(p["balancedness"]["per_layer"])
        link_us = p["layer_time_s"]["total"] / (p["num_microbatches"] * L) * 1e6 if L else 0.0
        print(f"  {ph:8s} tokens {p['num_tokens']:>10,}  micro-batches {p['num_microbatches']:>7,}  "
              f"inter-node {p['inter_node_bytes']['total'] / 1e9:10.4f} GB  "
              f"(two-hop {p['two_hop_inter_node_bytes']['total'] / 1e9:.4f})  "
              f"intra-node {p['intra_node_bytes']['total'] / 1e9:9.4f} GB  "
              f"local activation rate {p['local_activation_rate']['total']:.3f}  "
              f"balancedness {p['balancedness']['total']:.3f}  "
              f"layer time {us[ph]:,.1f} µs ({AUTO_MODE.get(ph) if res.cost.mode == 'auto' else res.cost.mode} "
              f"kernel model; alpha-beta link model {link_us:,.1f} µs)")
    if args.json:
        print(f"wrote {args.json}")
    elif args.print_json:
        json.dump(j, sys.stdout, indent=1)
        print()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate", help="replay a trace on a placement and grouping: bytes, balance, locality, time",
        description="Replay a per-token trace on a plan (placement + request homes) and report sends and bytes "
                    "(intra-GPU, intra-node, inter-node; per-GPU and two-hop dedup), load balance, local "
                    "activation rate and alpha-beta layer time, prefill and decode apart (docs/SIMULATOR.md).",
        epilog="examples:\n  moeplace simulate t.trace --cluster 4x8 --json sim.json\n"
               "  moeplace simulate t.trace --plan plan.json --json sim.json\n"
               "  moeplace simulate t.trace --cluster 4 --cluster-preset h200-8 --redundant 32",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", help="trace directory (per-token)")
    p.add_argument("--plan", type=input_file,
                   help="plan JSON from `moeplace plan` (default: linear placement, round-robin homes)")
    add_deployment_options(p)
    p.add_argument("--redundant", type=int_in(0, MAX_REDUNDANT), default=0,
                   help="redundant slots for the default linear placement")
    p.add_argument("--chunk-tokens", type=int_in(1, MAX_TOKENS), default=16384,
                   help="tokens read per chunk (memory bound)")
    p.add_argument("--json", type=output_file, help="write the full result JSON here")
    p.add_argument("--print-json", action="store_true", help="print the result JSON to stdout (without --json)")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    add_engine_options(p)
    p.set_defaults(func=cmd_simulate)
