"""``moeplace plan``, ``moeplace compare`` and ``moeplace export``: the planner on the command line."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from moeplace.cli import (
    MAX_REDUNDANT,
    CliError,
    float_in,
    fraction_list,
    input_file,
    int_in,
    output_file,
    param_type,
)
from moeplace.cli.options import (
    add_deployment_options,
    add_engine_options,
    batch_config,
    cost_config,
    deployment_from_args,
    engine_from_args,
)
from moeplace.deploy import TIME_PARAMS
from moeplace.io import atomic_write_json
from moeplace.params import Param
from moeplace.plan.export import EXPORTERS, MAX_DECODER_LAYERS
from moeplace.plan.registry import DEFAULT_PREFIX_TOKENS, MOE_STRATEGIES, STRATEGIES, get_strategy

if TYPE_CHECKING:
    from moeplace.placement import Plan
    from moeplace.plan.base import Workload

# Building the parser imports no planner, simulator or numpy (tests/test_start_time.py): the registries above are
# light, and each command imports what it runs.

FLAG_ALIASES = {"num_groups": "--groups"}  # the flag a parameter had before the registry declared it


def workload_from_path(trace: str | None, load: str | None, prefix_tokens: int) -> tuple[Workload, str, dict]:
    """(workload, planned_on, trace meta extras) from a trace directory or a load file."""
    if (trace is None) == (load is None):
        raise CliError("give either a TRACE or --load LOAD.json")
    from moeplace.plan.base import Workload, workload_from_trace

    if load is not None:
        from moeplace.plan.loadfile import read_load

        return Workload(read_load(load)), str(load), {}
    work, info = workload_from_trace(trace, prefix_tokens)
    return work, str(trace), info


def strategy_flags() -> dict[str, Param]:
    """Every strategy parameter a flag sets (one per name; the time model's come from the deployment group)."""
    out: dict[str, Param] = {}
    for st in STRATEGIES.values():
        for q in st.params:
            if q.name != "seed" and q.name not in TIME_PARAMS:
                out.setdefault(q.name, q)
    return out


def flag_of(name: str) -> str:
    return FLAG_ALIASES.get(name, "--" + name.replace("_", "-"))


def _params(args: argparse.Namespace, strategies: list[str]) -> dict:
    """The strategy flags given on the command line; CliError (one line) for one no chosen strategy declares."""
    kw = {}
    for name in strategy_flags():
        v = getattr(args, f"sp_{name}", None)
        if v is None:
            continue
        if not any(get_strategy(n).param(name) for n in strategies):
            takes = sorted({flag_of(q.name) for n in strategies for q in get_strategy(n).params
                            if q.name in strategy_flags()})
            raise CliError(f"{flag_of(name)} does not apply to strategy {', '.join(strategies)} (its parameters: "
                           f"{', '.join(takes) or 'none'})")
        kw[name] = v
    return kw


def describe_strategy(name: str) -> str:
    """``plan --list``: one strategy, its needs and its declared parameters."""
    s = get_strategy(name)
    need = "per-token trace" if s.needs_tokens else "load matrix"
    lines = [f"{s.name:<20} {s.summary}  [{need}{', groups requests' if s.groups_requests else ''}]"]
    flags = strategy_flags()
    for q in s.params:
        if q.name == "seed":
            lines.append(f"    {'--seed':<22} {q.describe()}")
        elif q.name in flags:
            lines.append(f"    {flag_of(q.name):<22} {q.describe()}")
    if s.prices_time:
        lines.append(f"    {'(deployment group)':<22} prices layer time with --cluster/--cluster-preset, "
                     "--hidden-size, --dispatch-bytes, --combine-bytes, --mode, --rule, --overlap, --decode-batch, "
                     "--prefill-tokens")
    return "\n".join(lines)


def format_cost_model(plan: Plan) -> str:
    """What the plan was optimised for, on one line (``moeplace plan`` prints it)."""
    c = plan.cluster
    links = (f"{c.spec()} (intra {c.intra_bw / 1e9:g} GB/s, inter {c.inter_bw / 1e9:g} GB/s, {c.expert_flops / 1e12:g} "
             f"TFLOP/s, HBM {c.hbm_bw / 1e12:g} TB/s)")
    if plan.cost_model is None:
        return f"cost model: none ({plan.strategy} does not price time or bytes); cluster {links}"
    cm = plan.cost_model.to_json()
    cm.update({k: getattr(plan.cost_model, k) for k in ("overlap", "decode_batch", "prefill_tokens")})
    return "cost model: " + ", ".join(f"{k}={v}" for k, v in cm.items() if v is not None) + f"; cluster {links}"


def cmd_plan(args: argparse.Namespace) -> int:
    if args.list:
        print("\n".join(describe_strategy(n) for n in STRATEGIES))
        return 0
    if not args.strategy or not (args.cluster or args.profile) or not args.out:
        raise CliError("--strategy, --cluster (or --profile) and --out are required (or --list)")
    from moeplace.plan import make_plan

    dep = deployment_from_args(args)
    kw = _params(args, [args.strategy])
    work, planned_on, _ = workload_from_path(args.trace, args.load, args.prefix_tokens)
    R = args.redundant
    if R is None:  # a profile's default: one redundant slot per GPU, rounded up to fill every GPU evenly
        from moeplace.deploy.profiles import default_redundant

        R = default_redundant(work.num_experts, dep.cluster.world_size) if args.profile else 0
    plan = make_plan(args.strategy, work, dep.cluster, R, planned_on=planned_on, deployment=dep,
                     seed=args.seed, **kw)
    if args.trace:  # the model's layer layout travels with the plan, so an SGLang export needs no --trace
        from moeplace.plan.export import layers_of_trace
        from moeplace.trace.reader import read_meta

        plan = dataclasses.replace(plan, model_layers=layers_of_trace(read_meta(args.trace)))
    plan.save(args.out)
    print(f"{args.strategy}: {plan.placement.num_layers} layers x {plan.placement.num_slots} slots on "
          f"{dep.cluster.spec()} ({plan.placement.slots_per_gpu} per GPU), {len(plan.homes)} request homes, "
          f"planned in {plan.plan_seconds:.2f} s -> {args.out}")
    print(f"  {format_cost_model(plan)}")
    decision = plan.extra.get("decision")
    if isinstance(decision, dict) and "reason" in decision:
        print(f"  decision: {decision['reason']}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from moeplace.cli.options import phase_deployments_from_args
    from moeplace.evaluate import format_table, run_compare
    from moeplace.evaluate.measure import format_phases
    from moeplace.trace import TraceError, read_trace, read_trace_sample

    deps = phase_deployments_from_args(args)  # a profile: one deployment per phase (its own pool)
    dep = deployment_from_args(args) if deps is None else None
    names = args.strategies.split(",") if args.strategies else list(MOE_STRATEGIES)
    for n in names:
        get_strategy(n)
    params = _params(args, names)
    floors = list(args.sweep_floor) if args.sweep_floor else None
    if args.plot and not floors:
        raise CliError("--plot draws the floor sweep: give --sweep-floor too")
    if floors and not any(get_strategy(n).param("balance_floor") for n in names):
        raise CliError(f"--sweep-floor re-plans the strategies with a balance floor (joint); none of "
                       f"{', '.join(names)} has one")

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"  {msg} ...", flush=True)

    seeds = [args.split_seed + i for i in range(args.split_seeds)]
    measure = {"phase_deployments": deps, "split_seeds": seeds, "arrival_seed": args.arrival_seed,
               "allow_few": args.allow_few}
    if args.min_microbatches is not None:
        measure["min_microbatches"] = args.min_microbatches
    scoring = ({} if dep is None else
               {"cost": cost_config(dep), "batching": batch_config(dep), "rule": dep.rule, "deployment": dep})
    R = 0 if args.redundant is None and deps is None else args.redundant  # None + a profile: per-phase default
    engine = engine_from_args(args)  # an unreachable --address fails before the trace is read
    if engine is not None:
        measure["engine"] = engine
    try:
        if args.sample_requests is None:
            trace = read_trace(args.trace)
        else:  # streamed: only the sample's rows are held
            trace = read_trace_sample(args.trace, args.sample_requests, args.sample_seed)
    except TraceError as e:
        if "over the memory budget" in str(e) and args.sample_requests is None:
            raise CliError(f"{e}; or compare a seeded sample of the requests, streamed: --sample-requests N") from None
        raise
    try:
        res = run_compare(trace, None if dep is None else dep.cluster, R, names, args.holdout,
                          args.split, args.seed, args.prefix_tokens, params.pop("balance_floor", None), params,
                          progress=say, arrival=args.arrival, floors=floors, plot=args.plot, **scoring, **measure)
    finally:
        if engine is not None:
            engine.close()
    if args.sample_requests is not None:
        res["sample"] = {"requests": len(trace.requests), "seed": args.sample_seed}
    where = ", ".join(f"{ph} {d['cluster']} R={d['num_redundant']}" for ph, d in res["phase_deployments"].items())
    prof = f" (profile {res['profile']})" if res.get("profile") else ""
    print(f"{res['trace']} on {where}{prof}: planned on {res['planning_requests']} requests, scored on "
          f"{res['held_out_requests']} held-out requests (split seed {seeds[0]}: {res['scored_tokens']} decode "
          f"tokens; arrival order: {res['arrival']})")
    print(format_table(res))
    print()
    print(format_phases(res))
    if args.plot:
        print(f"wrote {args.plot} (frontier plot)")
    if args.json:
        atomic_write_json(res, args.json)
        print(f"wrote {args.json}")
    if args.html:
        from moeplace.evaluate.html import write_compare_html

        write_compare_html(res, args.html)
        print(f"wrote {args.html}")
    return 0


EXPORT_FLAGS = (("trace", "--trace", "moe_layer_map"), ("num_decoder_layers", "--num-decoder-layers",
                                                          "num_decoder_layers"))  # dest, flag, exporter parameter


def cmd_export(args: argparse.Namespace) -> int:
    from moeplace.placement import Plan
    from moeplace.plan.export import export_plan, get_exporter, layers_of_trace

    takes = {p.name for p in get_exporter(args.format).params}
    for dest, flag, param in EXPORT_FLAGS:
        if getattr(args, dest) is not None and param not in takes:
            raise CliError(f"{flag} does not apply to --format {args.format} (its parameters: "
                           f"{', '.join(sorted(takes)) or 'none'})")
    plan = Plan.load(args.plan)
    lm, D = None, args.num_decoder_layers
    if args.trace:
        from moeplace.trace.reader import read_meta

        layers = layers_of_trace(read_meta(args.trace))
        if layers is not None:
            lm, D = list(layers.moe_layer_map), D if D is not None else layers.num_decoder_layers
    try:
        export_plan(plan, args.format, args.out, moe_layer_map=lm, num_decoder_layers=D)
    except ValueError as e:  # what the plan (or the trace, or a flag) says that cannot be exported: name the plan
        raise CliError(f"{args.plan}: {e}") from None
    print(f"wrote {args.format} mapping of {args.plan} -> {args.out}")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    add_deployment_options(p)
    p.add_argument("--redundant", type=int_in(0, MAX_REDUNDANT), default=None,
                   help="redundant slots per layer R (default 0, with --profile one per GPU rounded up so that "
                        "E + R slots fill every GPU evenly; at most E * (W - 1))")
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0,
                   help="random seed of the strategies that take one (default 0)")
    p.add_argument("--prefix-tokens", type=int_in(0, 1 << 20), default=DEFAULT_PREFIX_TOKENS,
                   help="requests without prefill use their first N decode tokens as the grouping signal "
                        f"(default {DEFAULT_PREFIX_TOKENS})")
    g = p.add_argument_group("strategy parameters", "declared by the strategies (plan --list); a flag the chosen "
                             "strategy does not declare is refused")
    for name, q in strategy_flags().items():
        owners = ", ".join(s.name for s in STRATEGIES.values() if s.param(name))
        g.add_argument(flag_of(name), dest=f"sp_{name}", type=param_type(q), default=None,
                       choices=list(q.choices) or None, metavar=None if q.choices else q.type.__name__.upper(),
                       help=f"{owners}: {q.describe()}")


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
    m = c.add_argument_group("measurement", "seeds, intervals and how many micro-batches a phase needs "
                             "(docs/EVALUATION.md)")
    m.add_argument("--split-seed", type=int_in(0, 2**32 - 1), default=0,
                   help="seed of the first planning/held-out split (default 0)")
    m.add_argument("--split-seeds", type=int_in(1, 1000), default=5,
                   help="random splits measured, seeds --split-seed, +1, ...: the ratios' 95%% intervals resample "
                        "them and their micro-batches (default 5; the table rows show the first)")
    m.add_argument("--arrival-seed", type=int_in(0, 2**32 - 1), default=None,
                   help="seed of the mixed arrival order (default: each split's seed)")
    m.add_argument("--min-microbatches", type=int_in(1, 1 << 20), default=None,
                   help="with --profile: full micro-batches a phase must form to be scored (default 20)")
    m.add_argument("--allow-few", action="store_true",
                   help="with --profile: score a phase that forms fewer full micro-batches, every micro-batch of it")
    m.add_argument("--sample-requests", type=int_in(1, 1 << 40), default=None, metavar="N",
                   help="plan and score a seeded sample of N requests (in table order), streamed shard by shard "
                        "so that only their rows are held: for traces larger than the memory budget (docs/SCALE.md)")
    m.add_argument("--sample-seed", type=int_in(0, 2**32 - 1), default=0, help="seed of --sample-requests (default 0)")
    _common(c)
    add_engine_options(c)
    c.set_defaults(func=cmd_compare, check=_check_compare)

    e = sub.add_parser(
        "export", help="write a plan as SGLang's or vLLM's expert mapping, or its grouper for a request router",
        description="Export a plan's placement: 'sglang' writes {physical_to_logical_map: [decoder layers][P]} for "
                    "--init-expert-location (dense layers get the trivial map); 'vllm' writes the EPLB state "
                    "(physical_to_logical_map, logical_to_physical_map, logical_replica_count) over MoE layers; "
                    "'grouper' writes a grouped plan's request router for 'moeplace route serve' (docs/ROUTE.md).",
        epilog="examples:\n  moeplace export plan.json --format sglang --trace ds.trace --out init_location.json\n"
               "  moeplace export plan.json --format grouper --trace ds.trace --out grouper.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    e.add_argument("plan", type=input_file, help="plan JSON from 'moeplace plan'")
    e.add_argument("--format", required=True, choices=list(EXPORTERS),
                   help="; ".join(f"{x.name}: {x.summary}" for x in EXPORTERS.values()))
    e.add_argument("--out", required=True, type=output_file, help="JSON file to write")
    e.add_argument("--trace", help="sglang, grouper: trace whose moe_layer_map places MoE layers among decoder "
                   "layers (default: the layout the plan records)")
    e.add_argument("--num-decoder-layers", type=int_in(1, MAX_DECODER_LAYERS),
                   help="sglang, grouper: decoder layers of the model (default: the plan's or trace's record); equal "
                   "to the plan's MoE layers when every layer is MoE and nothing is recorded")
    e.set_defaults(func=cmd_export)


def _check_compare(args: argparse.Namespace) -> None:
    if not args.cluster and not args.profile:
        raise CliError("--cluster (e.g. --cluster 4x2) or --profile NAME is required")
    if args.profile_phase:
        raise CliError("--profile-phase does not apply to compare: it measures every phase on its own pool")
    if (args.allow_few or args.min_microbatches is not None) and not args.profile:
        raise CliError("--allow-few and --min-microbatches apply with --profile (its batch sizes decide what is "
                       "full); without one every micro-batch is scored")
    if args.plot and not args.sweep_floor:
        raise CliError("--plot draws the --sweep-floor frontier; give --sweep-floor too (e.g. 0.9,0.95)")
    if args.sample_seed and args.sample_requests is None:
        raise CliError("--sample-seed seeds --sample-requests; give --sample-requests N too")
