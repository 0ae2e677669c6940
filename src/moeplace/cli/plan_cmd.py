"""``moeplace plan``, ``moeplace compare`` and ``moeplace export``: the planner on the command line."""

from __future__ import annotations

import argparse
import dataclasses

from moeplace.cli import (
    MAX_REDUNDANT,
    CliError,
    cluster_spec,
    float_in,
    fraction,
    fraction_list,
    input_file,
    int_in,
    output_file,
)
from moeplace.evaluate import DEFAULT_PREFIX_TOKENS, format_table, run_compare
from moeplace.io import atomic_write_json
from moeplace.placement import Cluster, Plan
from moeplace.plan import MOE_STRATEGIES, STRATEGIES, Workload, get_strategy, make_plan
from moeplace.plan.base import workload_from_trace
from moeplace.plan.export import MAX_DECODER_LAYERS, layers_of_trace
from moeplace.plan.joint import DEFAULT_BALANCE_FLOOR, DEFAULT_SEARCH_EVALS
from moeplace.plan.loadfile import read_load


def workload_from_path(trace: str | None, load: str | None, prefix_tokens: int) -> tuple[Workload, str, dict]:
    """(workload, planned_on, trace meta extras) from a trace directory or a load file."""
    if (trace is None) == (load is None):
        raise CliError("give either a TRACE or --load LOAD.json")
    if load is not None:
        return Workload(read_load(load)), str(load), {}
    work, info = workload_from_trace(trace, prefix_tokens)
    return work, str(trace), info


def _params(args: argparse.Namespace) -> dict:
    kw = {"seed": args.seed}
    if getattr(args, "groups", None):
        kw["num_groups"] = args.groups
    if getattr(args, "objective", None) is not None:
        kw["objective"] = args.objective
    if getattr(args, "search_evals", None) is not None:
        kw["search_evals"] = args.search_evals
    if getattr(args, "time_limit", None) is not None:
        kw["time_limit"] = args.time_limit
    return kw


def cmd_plan(args: argparse.Namespace) -> int:
    if args.list:
        for s in STRATEGIES.values():
            need = "per-token trace" if s.needs_tokens else "load matrix"
            print(f"{s.name:<20} {s.summary}  [{need}{', groups requests' if s.groups_requests else ''}]")
        return 0
    if not args.strategy or not args.cluster or not args.out:
        raise CliError("--strategy, --cluster and --out are required (or --list)")
    cluster = Cluster.parse(args.cluster)
    work, planned_on, _ = workload_from_path(args.trace, args.load, args.prefix_tokens)
    get_strategy(args.strategy)
    kw = _params(args)
    if args.strategy == "joint":
        kw["balance_floor"] = args.balance_floor
    plan = make_plan(args.strategy, work, cluster, args.redundant, planned_on=planned_on, **kw)
    if args.trace:  # the model's layer layout travels with the plan, so an SGLang export needs no --trace
        from moeplace.trace.store import read_meta

        plan = dataclasses.replace(plan, model_layers=layers_of_trace(read_meta(args.trace)))
    plan.save(args.out)
    print(f"{args.strategy}: {plan.placement.num_layers} layers x {plan.placement.num_slots} slots on "
          f"{cluster.spec()} ({plan.placement.slots_per_gpu} per GPU), {len(plan.homes)} request homes, "
          f"planned in {plan.plan_seconds:.2f} s -> {args.out}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from moeplace.trace import read_trace

    cluster = Cluster.parse(args.cluster)
    names = args.strategies.split(",") if args.strategies else list(MOE_STRATEGIES)
    for n in names:
        get_strategy(n)
    floors = list(args.sweep_floor) if args.sweep_floor else None
    if args.plot and not floors:
        raise CliError("--plot draws the floor sweep: give --sweep-floor too")

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"  {msg} ...", flush=True)

    res = run_compare(read_trace(args.trace), cluster, args.redundant, names, args.holdout, args.split, args.seed,
                      args.prefix_tokens, args.balance_floor, _params(args), progress=say, arrival=args.arrival,
                      floors=floors, plot=args.plot)
    print(f"{res['trace']} on {res['cluster']}, R={res['num_redundant']}: planned on {res['planning_requests']} "
          f"requests, scored on {res['held_out_requests']} held-out requests ({res['scored_tokens']} decode tokens, "
          f"arrival order: {res['arrival']})")
    print(format_table(res))
    if args.json:
        atomic_write_json(res, args.json)
        print(f"wrote {args.json}")
    if args.html:
        from moeplace.evaluate.html import write_compare_html

        write_compare_html(res, args.html)
        print(f"wrote {args.html}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from moeplace.plan.export import export_plan

    plan = Plan.load(args.plan)
    lm, D = None, args.num_decoder_layers
    if args.trace:
        from moeplace.trace.store import read_meta

        layers = layers_of_trace(read_meta(args.trace))
        if layers is not None:
            lm, D = list(layers.moe_layer_map), D if D is not None else layers.num_decoder_layers
    try:
        export_plan(plan, args.format, args.out, lm, D)
    except ValueError as e:
        raise CliError(str(e)) from None
    print(f"wrote {args.format} mapping of {args.plan} -> {args.out}")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", type=cluster_spec, help="NODESxGPUS, e.g. 4x2")
    p.add_argument("--redundant", type=int_in(0, MAX_REDUNDANT), default=0,
                   help="redundant slots per layer R (default 0; at most E * (W - 1))")
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0, help="random seed (default 0)")
    p.add_argument("--groups", type=int_in(1, 1 << 16), default=None,
                   help="eplb: the model's expert groups (DeepSeek-V3: 8); "
                   "default 1 (global policy)")
    p.add_argument("--balance-floor", type=fraction, default=DEFAULT_BALANCE_FLOOR,
                   help=f"joint: required balancedness on the planning window (default {DEFAULT_BALANCE_FLOOR})")
    p.add_argument("--objective", choices=("time", "bytes"), default=None,
                   help="joint: minimise predicted MoE layer time per micro-batch (default; never slower than eplb "
                        "on the planning window) or inter-node bytes under --balance-floor")
    p.add_argument("--search-evals", type=int_in(0, 10**9), default=None,
                   help=f"joint: moves its local searches evaluate per layer (default {DEFAULT_SEARCH_EVALS}); the "
                        "budget counts work, so the plan is the same on any machine")
    p.add_argument("--time-limit", type=float_in(0, 1e6, lo_open=True), default=None,
                   help="joint: optional wall-clock cap in seconds on its searches (off by default; a plan that hit "
                        "it records so and is no longer reproducible)")
    p.add_argument("--prefix-tokens", type=int_in(0, 1 << 20), default=DEFAULT_PREFIX_TOKENS,
                   help="requests without prefill use their first N decode tokens as the grouping signal "
                        f"(default {DEFAULT_PREFIX_TOKENS})")


def register(sub: argparse._SubParsersAction) -> None:
    names = ", ".join(STRATEGIES)
    p = sub.add_parser(
        "plan", help="plan expert placement, replication and request homes",
        description=f"Plan a placement with one strategy. Strategies: {names}.",
        epilog="examples:\n"
               "  moeplace plan --list\n"
               "  moeplace plan gpt-oss.trace --strategy joint --cluster 4x2 --redundant 8 --out plan.json\n"
               "  moeplace plan --load logical_count.json --strategy eplb --cluster 4x8 --redundant 32 "
               "--groups 8 --out plan.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", nargs="?", help="trace directory (per-token or counts-only)")
    p.add_argument("--load", type=input_file,
                   help="plan from a load matrix instead: JSON [L][E], JSON {logical_count: ...} or an "
                   "SGLang stat dump .pt")
    p.add_argument("--strategy", choices=list(STRATEGIES), metavar="NAME", help=f"one of: {names}")
    p.add_argument("--out", type=output_file, help="plan JSON to write")
    p.add_argument("--list", action="store_true", help="list the strategies and what each needs")
    _common(p)
    p.set_defaults(func=cmd_plan)

    c = sub.add_parser(
        "compare", help="plan every strategy on one window, score all on a held-out window",
        description="Plan each strategy on a planning window of requests and replay all of them with the "
                    "simulator on a disjoint held-out window (decode rows). Grouping strategies give held-out "
                    "requests homes online from their prefill (or first decode tokens); others use round-robin.",
        epilog="example:\n  moeplace compare gpt-oss.trace --cluster 4x2 --redundant 8 --sweep-floor 0.9,0.95,0.97 "
               "--plot frontier.png --json compare.json --html compare.html",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("trace", help="per-token trace directory")
    c.add_argument("--strategies", help=f"comma-separated subset of: {names} (default: all)")
    c.add_argument("--holdout", type=float_in(0, 1, lo_open=True, hi_open=True), default=0.25,
                   help="fraction of requests held out (default 0.25)")
    c.add_argument("--split", choices=("random", "ordered"), default="random",
                   help="held-out requests: a seeded random subset, or the last ones of the table (default random)")
    c.add_argument("--arrival", choices=("table", "mixed"), default="table",
                   help="arrival order of held-out requests, which decides micro-batches: the trace's table order, "
                        "or a seeded mix of all kinds (default table)")
    c.add_argument("--sweep-floor", type=fraction_list,
                   help="comma-separated balance floors for joint's frontier, e.g. 0.9,0.95,0.97")
    c.add_argument("--plot", type=output_file,
                   help="PNG of the frontier (inter-node bytes vs balancedness); needs --sweep-floor")
    c.add_argument("--json", type=output_file, help="write the results JSON here")
    c.add_argument("--html", type=output_file,
                   help="write a self-contained HTML report here: the frontier (time, bytes, balancedness), per-GPU "
                        "load bars and traffic heatmaps of every strategy")
    c.add_argument("--quiet", action="store_true", help="no progress lines")
    _common(c)
    c.set_defaults(func=cmd_compare, check=_check_compare)

    e = sub.add_parser(
        "export", help="write a plan as SGLang's or vLLM's expert mapping",
        description="Export a plan's placement: 'sglang' writes {physical_to_logical_map: [decoder layers][P]} for "
                    "--init-expert-location (dense layers get the trivial map); 'vllm' writes the EPLB state "
                    "(physical_to_logical_map, logical_to_physical_map, logical_replica_count) over MoE layers.",
        epilog="example:\n  moeplace export plan.json --format sglang --trace ds.trace --out init_location.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    e.add_argument("plan", type=input_file, help="plan JSON from 'moeplace plan'")
    e.add_argument("--format", required=True, choices=("sglang", "vllm"))
    e.add_argument("--out", required=True, type=output_file, help="JSON file to write")
    e.add_argument("--trace", help="sglang: trace whose moe_layer_map places MoE layers among decoder layers "
                   "(default: the layout the plan records)")
    e.add_argument("--num-decoder-layers", type=int_in(1, MAX_DECODER_LAYERS),
                   help="sglang: decoder layers of the model (default: the plan's or trace's record); equal to the "
                   "plan's MoE layers when every layer is MoE and nothing is recorded")
    e.set_defaults(func=cmd_export)


def _check_compare(args: argparse.Namespace) -> None:
    if not args.cluster:
        raise CliError("--cluster is required, e.g. --cluster 4x2")
    if args.plot and not args.sweep_floor:
        raise CliError("--plot draws the --sweep-floor frontier; give --sweep-floor too (e.g. 0.9,0.95)")
