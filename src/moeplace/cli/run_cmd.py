"""``moeplace run-ep`` (a trace through the real expert-parallel layer) and ``moeplace cluster up/down``.

Parses arguments, calls one library function (:func:`moeplace.run.report.run_ep`, or :mod:`moeplace.run.netns`'s
``cluster_up`` / ``cluster_down`` / ``remove_stale``) and prints. Every option is range-checked as it is parsed;
a bad value ends with exit 2 and one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import NoReturn

from moeplace.cli import input_file, output_file
from moeplace.cli.options import add_deployment_options

# deployment-group flags with no meaning for a measured run, and why (a non-default value is refused, exit 2)
RUN_EP_INAPPLICABLE = {
    "mode": "the run measures its own all-to-all and predicts with the nccl kernel model (deepep-normal with "
            "--two-hop)",
    "overlap": "the runtime layer runs dispatch, expert compute and combine one after another",
    "dispatch_bytes": "the run sends --dtype elements both ways; set --dtype",
    "combine_bytes": "the run sends --dtype elements both ways; set --dtype",
}

FAIL_RANK_ENV = "MOEPLACE_RUN_FAIL_RANK"  # test hook: that rank exits right after joining the group


def _bounded(kind: type, lo: float, hi: float) -> Callable[[str], float]:
    """An argparse type: ``kind`` (int or float) within [lo, hi]; NaN and infinities are refused."""

    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {s!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"expected a value in [{lo:g}, {hi:g}], got {s}")
        return v

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make ``parser`` report a bad argument as one line (exit 2) instead of usage + error."""

    def error(message: str) -> NoReturn:
        parser.exit(2, f"{parser.prog}: error: {message} (see {parser.prog} --help)\n")

    parser.error = error  # type: ignore[method-assign]
    return parser


def _fail_rank_from_env() -> int | None:
    v = os.environ.get(FAIL_RANK_ENV, "")
    if not v:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{FAIL_RANK_ENV}={v!r}: expected a rank number") from None


def refuse_inapplicable(args: argparse.Namespace) -> None:
    """CliError (exit 2, one line) for a deployment-group flag run-ep has no use for, given a non-default value;
    also for --batch-tokens together with --decode-batch or --prefill-tokens."""
    from moeplace.cli import CliError
    from moeplace.deploy import Deployment

    if not args.cluster:
        raise CliError("--cluster is required: NODESxGPUS of the plan (e.g. 2x2), a preset name, or NODES with "
                       "--cluster-preset")
    d = Deployment.__dataclass_fields__
    for k, why in RUN_EP_INAPPLICABLE.items():
        if getattr(args, k) != d[k].default:
            raise CliError(f"--{k.replace('_', '-')} does not apply to run-ep: {why}")
    if args.batch_tokens is not None:
        for k in ("decode_batch", "prefill_tokens"):
            if getattr(args, k) != d[k].default:
                raise CliError(f"--batch-tokens sets both --decode-batch and --prefill-tokens; give it or "
                               f"--{k.replace('_', '-')}, not both")


def cmd_run_ep(args: argparse.Namespace) -> int:
    from moeplace.run.launch import RankFailed
    from moeplace.run.netns import ClusterBusy, NetnsError
    from moeplace.run.report import ReportWriteError, RunEpOptions, run_ep, summary_line

    refuse_inapplicable(args)
    opts = RunEpOptions(
        trace=Path(args.trace), plan=Path(args.plan), cluster=args.cluster, cluster_preset=args.cluster_preset,
        hidden=args.hidden_size, ffn=args.ffn, dtype=args.dtype, decode_batch=args.decode_batch,
        prefill_tokens=args.prefill_tokens, batch_tokens=args.batch_tokens, phase=args.phase,
        microbatches=args.microbatches,
        skip=args.skip, repeats=args.repeats, two_hop=args.two_hop, rule=args.rule, timeout=args.timeout,
        emulate=args.emulate, inter_gbit=args.inter_gbit, inter_delay_ms=args.inter_delay_ms, netns=args.netns,
        json_out=None if args.json is None else Path(args.json), fail_rank=_fail_rank_from_env(),
        emulate_compute=args.emulate_compute, compute_flops=args.compute_flops,
        compute_hbm_gbps=args.compute_hbm_gbps)
    try:
        report = run_ep(opts)  # every user error is raised before a process starts
    except ClusterBusy as e:
        print(f"moeplace run-ep: error: {e}", file=sys.stderr)
        return 2
    except ReportWriteError as e:
        print(json.dumps(e.report, indent=1))  # the run's results, on stdout rather than lost
        print(f"moeplace run-ep: error: {e}; the report was printed to stdout instead", file=sys.stderr)
        return 1
    except (RankFailed, TimeoutError, NetnsError) as e:
        print(f"moeplace run-ep: error: {e}", file=sys.stderr)
        return 1
    note = (report["emulation"] or {}).get("note")
    if note:
        print(f"moeplace run-ep: {note}", file=sys.stderr)
    if args.json:
        print(summary_line(report, args.json))
    else:  # stdout stays the JSON; the text goes beside it
        print(json.dumps(report, indent=1))
        print(summary_line(report), file=sys.stderr)
    return 0


def cmd_cluster_up(args: argparse.Namespace) -> int:
    from moeplace.run.netns import ClusterBusy, NetnsError, NetnsUnavailable, cluster_up, load_cluster

    before = load_cluster(args.name)
    try:
        c = cluster_up(args.nodes, args.gpus_per_node, args.inter_gbit, args.inter_delay_ms, name=args.name,
                       fallback=not args.strict)
    except ClusterBusy as e:
        print(f"moeplace cluster up: error: {e}", file=sys.stderr)
        return 2
    except (NetnsUnavailable, NetnsError) as e:
        print(f"moeplace cluster up: error: {e}", file=sys.stderr)
        return 1
    if c.mode != "netns":
        print(f"moeplace cluster up: {c.note}", file=sys.stderr)
    elif before == c:
        print(f"moeplace cluster up: {args.name} already up as asked", file=sys.stderr)
    elif c.note:
        print(f"moeplace cluster up: {c.note}", file=sys.stderr)
    print(json.dumps({**asdict(c), "rank_netns": c.rank_netns(), "master_addr": c.master_addr,
                      "socket_ifname": c.socket_ifname}, indent=1))
    return 0


def cmd_cluster_down(args: argparse.Namespace) -> int:
    from moeplace.run.netns import ClusterBusy, NetnsError, cluster_down, remove_stale

    try:
        removed = remove_stale() if args.stale else cluster_down(args.name)
    except ClusterBusy as e:
        print(f"moeplace cluster down: error: {e}", file=sys.stderr)
        return 2
    except NetnsError as e:
        print(f"moeplace cluster down: error: {e}", file=sys.stderr)
        return 1
    nothing = "no orphaned cluster to remove" if args.stale else f"nothing to remove for {args.name}"
    print(f"moeplace cluster down: removed {', '.join(removed)}" if removed else f"moeplace cluster down: {nothing}",
          file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from moeplace.run.netns import MAX_GPUS_PER_NODE, MAX_NODES
    from moeplace.run.options import DTYPE_BYTES, LIMITS, RunEpOptions

    def lim(name: str, kind: type = int) -> Callable[[str], float]:
        return _bounded(kind, *LIMITS[name])

    d = RunEpOptions(Path("."), Path("."), "1x1")  # the library's defaults, shown and used by the CLI
    p = _one_line_errors(sub.add_parser(
        "run-ep", help="replay a trace through the real expert-parallel layer and measure bytes and time",
        description="Run the trace's routing through an expert-parallel MoE layer in W = N*G processes (gloo on "
                    "CPU, NCCL on GPUs), optionally on emulated nodes (network namespaces, shaped links), and "
                    "report bytes handed to all_to_all_single per (source, destination) rank, inter- and "
                    "intra-node totals and wall time per layer, next to the simulator's prediction for the same "
                    "micro-batches (docs/RUNTIME.md). Options, inputs, the output path and the memory the ranks "
                    "need are all checked before any process starts.",
        epilog="example:\n  moeplace run-ep demo.trace --plan plan.json --cluster 2x2 --emulate --inter-gbit 1 "
               "--json out/run.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ))
    p.add_argument("trace", help="per-token trace directory")
    p.add_argument("--plan", required=True, type=input_file, help="plan JSON (moeplace plan)")
    # --cluster, --hidden-size, --rule, batch sizes, ... (no --profile: run-ep emulates its own layer)
    add_deployment_options(p, hidden_default=d.hidden, profiles=False)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--emulate", action="store_true",
                       help="run each node's ranks in its own network namespace (needs root and iproute2; falls "
                            "back to plain loopback, saying so)")
    where.add_argument("--netns", default=None, metavar="NAME",
                       help="run on a cluster brought up by 'moeplace cluster up --name NAME' instead")
    p.add_argument("--inter-gbit", type=lim("inter_gbit", float), default=None,
                   help="with --emulate: inter-node link rate per node in Gbit/s (default: unshaped)")
    p.add_argument("--inter-delay-ms", type=lim("inter_delay_ms", float), default=None,
                   help="with --emulate: one-way inter-node delay in ms (needs the netem qdisc)")
    p.add_argument("--ffn", type=lim("ffn"), default=d.ffn,
                   help=f"expert intermediate size, at most {LIMITS['ffn'][1]:g} (default: = hidden)")
    p.add_argument("--dtype", default=d.dtype, choices=tuple(DTYPE_BYTES),
                   help=f"element type of hidden vectors (default {d.dtype})")
    p.add_argument("--batch-tokens", type=lim("batch_tokens"), default=None,
                   help="shorthand for --decode-batch N --prefill-tokens N (small micro-batches for a quick run)")
    p.add_argument("--phase", default=d.phase, choices=("prefill", "decode"), help="which micro-batches")
    p.add_argument("--microbatches", type=lim("microbatches"), default=d.microbatches,
                   help=f"micro-batches to replay (default {d.microbatches})")
    p.add_argument("--skip", type=lim("skip"), default=d.skip,
                   help=f"micro-batches of the phase to skip first (default {d.skip})")
    p.add_argument("--repeats", type=lim("repeats"), default=d.repeats, help=f"timed repeats (default {d.repeats})")
    p.add_argument("--two-hop", action="store_true", help="per-node dedup, forwarding inside the node")
    p.add_argument("--emulate-compute", action="store_true",
                   help="each rank waits the time model's expert compute for its own pairs instead of computing "
                        "(roofline of the plan cluster's FLOP rate and HBM bandwidth); all-to-all stays real")
    p.add_argument("--compute-flops", type=lim("compute_flops", float), default=None,
                   help="with --emulate-compute: FLOP/s per rank (default: the plan cluster's)")
    p.add_argument("--compute-hbm-gbps", type=lim("compute_hbm_gbps", float), default=None,
                   help="with --emulate-compute: expert weight memory GB/s per rank (default: the plan cluster's)")
    p.add_argument("--timeout", type=lim("timeout", float), default=d.timeout,
                   help=f"seconds (default {d.timeout:g})")
    p.add_argument("--json", type=output_file, default=None, metavar="OUT.json",
                   help="write the report here (default: stdout); checked before the run starts")
    p.set_defaults(func=cmd_run_ep)

    c = _one_line_errors(sub.add_parser(
        "cluster", help="emulated nodes: network namespaces with shaped links",
        description="Build or remove an emulated cluster: one Linux network namespace per node, joined by veth "
                    "pairs to a bridge, inter-node links shaped with tc. One process at a time may change a "
                    "cluster: another gets 'busy' (exit 2).",
        epilog="examples:\n  moeplace cluster up --nodes 2 --gpus-per-node 2 --inter-gbit 1\n"
               "  moeplace cluster down\n  moeplace cluster down --stale",
        formatter_class=argparse.RawDescriptionHelpFormatter))
    csub = c.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND")
    c.set_defaults(func=lambda a: (c.print_help(), 2)[1])
    up = _one_line_errors(csub.add_parser(
        "up", help="build (or keep) an emulated cluster",
        epilog="example:\n  moeplace cluster up --nodes 2 --gpus-per-node 2 --inter-gbit 1",
        formatter_class=argparse.RawDescriptionHelpFormatter))
    up.add_argument("--nodes", type=_bounded(int, 1, MAX_NODES), required=True, help=f"N nodes, 1-{MAX_NODES}")
    up.add_argument("--gpus-per-node", type=_bounded(int, 1, MAX_GPUS_PER_NODE), required=True,
                    help=f"G ranks per node, 1-{MAX_GPUS_PER_NODE}")
    up.add_argument("--inter-gbit", type=lim("inter_gbit", float), default=None,
                    help="inter-node rate per node, Gbit/s")
    up.add_argument("--inter-delay-ms", type=lim("inter_delay_ms", float), default=None,
                    help="inter-node one-way delay, ms")
    up.add_argument("--name", default="moeplace", help="namespace prefix (default moeplace)")
    up.add_argument("--strict", action="store_true", help="fail instead of falling back to plain loopback")
    up.set_defaults(func=cmd_cluster_up)
    down = _one_line_errors(csub.add_parser(
        "down", help="remove an emulated cluster (idempotent)",
        description="Remove the network namespaces, veth pairs and bridge of an emulated cluster. Removing a "
                    "cluster that does not exist is not an error. --stale removes instead every cluster left by "
                    "a run whose process is gone, and any bring-up killed half-way.",
        epilog="examples:\n  moeplace cluster down --name moeplace\n  moeplace cluster down --stale",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ))
    which = down.add_mutually_exclusive_group()
    which.add_argument("--name", default="moeplace", help="namespace prefix (default moeplace)")
    which.add_argument("--stale", action="store_true", help="remove every orphaned cluster instead of one name")
    down.set_defaults(func=cmd_cluster_down)
