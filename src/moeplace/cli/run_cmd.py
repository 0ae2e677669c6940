"""``moeplace run-ep`` (a trace through the real expert-parallel layer) and ``moeplace cluster up/down``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from moeplace.cli import cluster_spec, float_in, input_file, int_in, output_file
from moeplace.io import atomic_write_json

FAIL_RANK_ENV = "MOEPLACE_RUN_FAIL_RANK"  # test hook: that rank exits right after joining the group


def _emit(obj: dict, out: str | None) -> None:
    if out:
        atomic_write_json(obj, out)
    else:
        print(json.dumps(obj, indent=1))


def prepare_run(args: argparse.Namespace):
    """Everything checked before a process starts: plan, cluster, trace, window. Returns
    (plan, sub_trace, batches, cfg, batching); raises ValueError naming what does not fit."""
    from moeplace.placement import Cluster, Plan
    from moeplace.run.replay import ReplayConfig, batches_from_window, check_batches, select_window
    from moeplace.simulate import BatchConfig
    from moeplace.trace.store import read_trace

    plan = Plan.load(args.plan)
    cluster = Cluster.parse(args.cluster)
    if cluster.spec() != plan.cluster.spec():
        raise ValueError(f"--cluster {cluster.spec()} does not match the plan's cluster {plan.cluster.spec()} "
                         f"({args.plan})")
    trace = read_trace(args.trace)
    meta, pl = trace.meta, plan.placement
    if (pl.num_layers, pl.num_experts) != (meta.num_layers, meta.num_experts):
        raise ValueError(f"plan {args.plan} does not fit trace {args.trace}: the plan places L={pl.num_layers} "
                         f"layers x E={pl.num_experts} experts, the trace has L={meta.num_layers} x "
                         f"E={meta.num_experts}")
    cfg = ReplayConfig(hidden=args.hidden, ffn=args.ffn, dtype=args.dtype, two_hop=args.two_hop,
                       repeats=args.repeats, timeout=args.timeout)
    batching = BatchConfig(decode_batch=args.batch_tokens, prefill_tokens=args.batch_tokens)
    sub, rows = select_window(trace, plan, batching, args.phase, args.microbatches, args.skip)
    batches = batches_from_window(sub, rows, plan, args.rule)
    check_batches(plan, batches)
    return plan, sub, batches, cfg, batching


def cmd_run_ep(args: argparse.Namespace) -> int:
    from moeplace.run.launch import RankFailed
    from moeplace.run.netns import NetnsError, emulated_cluster, load_cluster
    from moeplace.run.replay import predict, replay, summarize

    plan, sub, batches, cfg, batching = prepare_run(args)  # all user errors surface here, before any spawn
    fail = os.environ.get(FAIL_RANK_ENV)
    fail_rank = int(fail) if fail not in (None, "") else None
    N, G = plan.cluster.num_nodes, plan.cluster.gpus_per_node
    try:
        if args.netns:
            emu = load_cluster(args.netns)
            if emu is None:
                raise ValueError(f"--netns {args.netns}: no such emulated cluster is up "
                                 f"(moeplace cluster up --name {args.netns} ...)")
            if (emu.num_nodes, emu.gpus_per_node) != (N, G):
                raise ValueError(f"--netns {args.netns} is {emu.num_nodes}x{emu.gpus_per_node}, the plan needs "
                                 f"{N}x{G}")
            res = replay(plan, batches, cfg, fail_rank=fail_rank, **emu.launch_kwargs())
        elif args.emulate:
            with emulated_cluster(N, G, args.inter_gbit, args.inter_delay_ms) as emu:
                if emu.note:
                    print(f"moeplace run-ep: {emu.note}", file=sys.stderr)
                res = replay(plan, batches, cfg, fail_rank=fail_rank, **emu.launch_kwargs())
        else:
            emu = None
            res = replay(plan, batches, cfg, fail_rank=fail_rank)
    except (RankFailed, TimeoutError, NetnsError) as e:
        print(f"moeplace run-ep: error: {e}", file=sys.stderr)
        return 1
    measured = summarize(res)
    sim = predict(sub, plan, cfg, batching, args.rule).all.to_json()
    pre = "two_hop_" if cfg.two_hop else ""
    predicted = {k: sim[pre + k] for k in ("inter_node_bytes", "intra_node_bytes", "layer_time_s", "comm_time_s")}
    predicted["traffic_matrix_bytes"] = sim[pre + "traffic_matrix_bytes"]
    out = {
        "trace": str(args.trace), "plan": str(args.plan), "strategy": plan.strategy, "cluster": plan.cluster.spec(),
        "emulation": None if emu is None else {"mode": emu.mode, "inter_gbit": emu.inter_gbit,
                                               "inter_delay_ms": emu.inter_delay_ms,
                                               "delay_applied": emu.delay_applied, "note": emu.note},
        "backend": "nccl" if _cuda() else "gloo",
        "config": {"hidden": cfg.hidden, "ffn": cfg.ffn or cfg.hidden, "dtype": cfg.dtype,
                   "bytes_per_element": cfg.bytes_per_element, "two_hop": cfg.two_hop, "repeats": cfg.repeats,
                   "rule": args.rule, "batch_tokens": args.batch_tokens},
        "window": {"phase": args.phase, "skip": args.skip, "num_microbatches": len(batches),
                   "num_tokens": int(sum(len(b) for b in batches))},
        **measured,
        "predicted": predicted,
        "bytes_match_simulator": (measured["inter_node_bytes"]["total"] == predicted["inter_node_bytes"]["total"]
                                  and measured["intra_node_bytes"]["total"]
                                  == predicted["intra_node_bytes"]["total"]),
    }
    _emit(out, args.json)
    if args.json:
        m = measured
        print(f"run-ep {plan.strategy} on {plan.cluster.spec()} ({m['dedup']}): {out['window']['num_tokens']} "
              f"tokens in {len(batches)} micro-batches; inter-node {m['inter_node_bytes']['total']:,} B, "
              f"intra-node {m['intra_node_bytes']['total']:,} B (simulator: "
              f"{'same' if out['bytes_match_simulator'] else 'DIFFERENT'}); layer time "
              f"{m['layer_time_s']['total'] * 1e3:.1f} ms -> {args.json}")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def cmd_cluster_up(args: argparse.Namespace) -> int:
    from moeplace.run.netns import NetnsUnavailable, cluster_up, load_cluster

    before = load_cluster(args.name)
    try:
        c = cluster_up(args.nodes, args.gpus_per_node, args.inter_gbit, args.inter_delay_ms, name=args.name,
                       fallback=not args.strict)
    except NetnsUnavailable as e:
        print(f"moeplace cluster up: error: {e}", file=sys.stderr)
        return 1
    if c.mode != "netns":
        print(f"moeplace cluster up: {c.note}", file=sys.stderr)
    elif before == c:
        print(f"moeplace cluster up: {args.name} already up as asked", file=sys.stderr)
    elif c.note:
        print(f"moeplace cluster up: {c.note}", file=sys.stderr)
    from dataclasses import asdict

    print(json.dumps({**asdict(c), "rank_netns": c.rank_netns(), "master_addr": c.master_addr,
                      "socket_ifname": c.socket_ifname}, indent=1))
    return 0


def cmd_cluster_down(args: argparse.Namespace) -> int:
    from moeplace.run.netns import NetnsError, cluster_down

    try:
        removed = cluster_down(args.name)
    except NetnsError as e:
        print(f"moeplace cluster down: error: {e}", file=sys.stderr)
        return 1
    print(f"moeplace cluster down: removed {', '.join(removed)}" if removed
          else f"moeplace cluster down: nothing to remove for {args.name}", file=sys.stderr)
    return 0


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {s}")
    return v


def register(sub: argparse._SubParsersAction) -> None:
    from moeplace.run.replay import ReplayConfig
    from moeplace.simulate import RULES

    d = ReplayConfig()
    p = sub.add_parser(
        "run-ep", help="replay a trace through the real expert-parallel layer and measure bytes and time",
        description="Run the trace's routing through an expert-parallel MoE layer in W = N*G processes (gloo on "
                    "CPU, NCCL on GPUs), optionally on emulated nodes (network namespaces, shaped links), and "
                    "report bytes handed to all_to_all_single per (source, destination) rank, inter- and "
                    "intra-node totals and wall time per layer, next to the simulator's prediction for the same "
                    "micro-batches (docs/RUNTIME.md).",
        epilog="example:\n  moeplace run-ep demo.trace --plan plan.json --cluster 2x2 --emulate --inter-gbit 1 "
               "--json out/run.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", help="per-token trace directory")
    p.add_argument("--plan", required=True, type=input_file, help="plan JSON (moeplace plan)")
    p.add_argument("--cluster", required=True, type=cluster_spec,
                   help="NODESxGPUS, must match the plan's cluster, e.g. 2x2")
    p.add_argument("--emulate", action="store_true",
                   help="run each node's ranks in its own network namespace (needs root and iproute2; falls back "
                        "to plain loopback, saying so)")
    p.add_argument("--inter-gbit", type=float_in(0, 1e6, lo_open=True), default=None,
                   help="with --emulate: inter-node link rate per node in Gbit/s (default: unshaped)")
    p.add_argument("--inter-delay-ms", type=float_in(0, 1e5, lo_open=True), default=None,
                   help="with --emulate: one-way inter-node delay in ms (needs the netem qdisc)")
    p.add_argument("--netns", default=None, metavar="NAME",
                   help="run on a cluster brought up by 'moeplace cluster up --name NAME' instead")
    p.add_argument("--hidden", type=int_in(1, 1 << 16), default=d.hidden, help=f"hidden size H (default {d.hidden})")
    p.add_argument("--ffn", type=int_in(1, 1 << 18), default=None, help="expert intermediate size (default: = hidden)")
    p.add_argument("--dtype", default=d.dtype, choices=("float32", "bfloat16", "float16"),
                   help=f"element type of hidden vectors (default {d.dtype})")
    p.add_argument("--batch-tokens", type=int_in(1, 1 << 20), default=256,
                   help="micro-batch size as the simulator forms it: requests per decode window and prefill token "
                        "budget (default 256)")
    p.add_argument("--phase", default="decode", choices=("prefill", "decode"), help="which micro-batches")
    p.add_argument("--microbatches", type=int_in(1, 1 << 16), default=8, help="micro-batches to replay (default 8)")
    p.add_argument("--skip", type=int_in(0, 1 << 24), default=0,
                   help="micro-batches of the phase to skip first (default 0)")
    p.add_argument("--repeats", type=int_in(1, 1 << 12), default=d.repeats, help=f"timed repeats (default {d.repeats})")
    p.add_argument("--two-hop", action="store_true", help="per-node dedup, forwarding inside the node")
    p.add_argument("--rule", default=RULES[0], choices=RULES, help=f"replica rule (default {RULES[0]})")
    p.add_argument("--timeout", type=float_in(0, 86400, lo_open=True), default=d.timeout,
                   help=f"seconds (default {d.timeout:g})")
    p.add_argument("--json", type=output_file, default=None, metavar="OUT.json",
                   help="write the report here (default: stdout)")
    p.set_defaults(func=cmd_run_ep)

    c = sub.add_parser("cluster", help="emulated nodes: network namespaces with shaped links",
                       description="Build or remove an emulated cluster: one Linux network namespace per node, "
                                   "joined by veth pairs to a bridge, inter-node links shaped with tc.",
                       epilog="examples:\n  moeplace cluster up --nodes 2 --gpus-per-node 2 --inter-gbit 1\n"
                              "  moeplace cluster down",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    csub = c.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND")
    c.set_defaults(func=lambda a: (c.print_help(), 2)[1])
    up = csub.add_parser("up", help="build (or keep) an emulated cluster",
                         epilog="example:\n  moeplace cluster up --nodes 2 --gpus-per-node 2 --inter-gbit 1",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    up.add_argument("--nodes", type=int_in(1, 64), required=True, help="N nodes")
    up.add_argument("--gpus-per-node", type=int_in(1, 64), required=True, help="G ranks per node")
    up.add_argument("--inter-gbit", type=float_in(0, 1e6, lo_open=True), default=None,
                    help="inter-node rate per node, Gbit/s")
    up.add_argument("--inter-delay-ms", type=float_in(0, 1e5, lo_open=True), default=None,
                    help="inter-node one-way delay, ms")
    up.add_argument("--name", default="moeplace", help="namespace prefix (default moeplace)")
    up.add_argument("--strict", action="store_true", help="fail instead of falling back to plain loopback")
    up.set_defaults(func=cmd_cluster_up)
    down = csub.add_parser(
        "down", help="remove an emulated cluster (idempotent)",
        description="Remove the network namespaces, veth pairs and bridge of an emulated cluster. Removing a "
                    "cluster that does not exist is not an error.",
        epilog="example:\n  moeplace cluster down --name moeplace",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    down.add_argument("--name", default="moeplace", help="namespace prefix (default moeplace)")
    down.set_defaults(func=cmd_cluster_down)
