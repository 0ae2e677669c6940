"""``moeplace operate``: run a stream of routing through the live loop: counters, Prometheus metrics, the
dashboard, a rebalance policy, migration plans and engine exports. The stream is a trace replayed (``STREAM``), or
routing produced as it happens by a model's ``generate`` (``--source live --model reference --prompts builtin``)."""

from __future__ import annotations

import argparse
import sys

from moeplace.cli import MAX_REDUNDANT, CliError, device_spec, float_in, int_in, output_dir, output_file, param_type
from moeplace.cli.options import add_deployment_options, batch_config, deployment_from_args, refuse_unpriced

POLICY_DEST = "policy_param_"  # argparse dest prefix of the flags generated from the policies' parameters


def policy_flags(args: argparse.Namespace) -> dict[str, object]:
    """The policy parameters given on the command line; CliError (exit 2, one line) naming a flag the chosen
    policy does not declare."""
    from moeplace.operate.policies import POLICIES, policy_params

    given = {k[len(POLICY_DEST):]: v for k, v in vars(args).items() if k.startswith(POLICY_DEST)}
    spec = POLICIES[args.policy]
    takes = {p.name for p in spec.params}
    for name in given:
        if name not in takes:
            flags = ", ".join(p.flag for p in spec.params) or "none"
            raise CliError(f"{policy_params()[name].flag} is not a parameter of policy {args.policy!r} (its "
                           f"flags: {flags}; see --list-policies)")
    return given


class ListPolicies(argparse.Action):
    """``--list-policies``: every policy, its summary and its parameters; exits 0 (as --help)."""

    def __init__(self, option_strings: list[str], dest: str, **kw: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(format_policies())
        parser.exit(0)


def format_policies() -> str:
    """The policy registry as text: one line per policy, one per parameter (flag, help, type, range, default)."""
    from moeplace.operate.policies import POLICIES

    lines = []
    for s in POLICIES.values():
        lines.append(f"{s.name:18s} {s.summary}")
        lines += [f"  {p.flag:16s} {p.describe()}" for p in s.params]
    return "\n".join(lines)


def schedule_error(path: str, e: Exception) -> str:
    """A mix schedule's error as one line naming the flag and the file (once)."""
    text = str(e)
    return f"--schedule {path}: {text[len(path) + 2:] if text.startswith(f'{path}: ') else text}"


def cmd_operate(args: argparse.Namespace) -> int:
    from moeplace.operate import OperateConfig
    from moeplace.operate.metrics import DEFAULT_HOST, check_listen, is_loopback
    from moeplace.operate.service import open_stream, run

    params = policy_flags(args)  # before any work: a flag the policy does not take is exit 2
    if args.metrics_host is not None and args.metrics_port is None:
        raise CliError("--metrics-host applies to the metrics server: give --metrics-port too")
    host = DEFAULT_HOST if args.metrics_host is None else args.metrics_host
    if args.metrics_port is not None:
        check_listen(host, args.metrics_port)  # an unknown host or a port in use: one line, before any work
        if not is_loopback(host):
            print(f"moeplace operate: note: --metrics-host {host} is not loopback: every machine that reaches it "
                  "can read the metrics and the dashboard (per-window aggregates, no request data; "
                  "docs/PRIVACY.md)", file=sys.stderr)
    refuse_unpriced(args, ("--cluster", "--cluster-preset", "--rule", "--decode-batch", "--prefill-tokens"),
                    "operate (sizes come from --model-preset)")
    dep = deployment_from_args(args)
    preset = args.model_preset
    if preset is None and args.profile:  # a profile names the model whose sizes it prices
        from moeplace.deploy.profiles import get_profile

        preset = get_profile(args.profile).model
    cfg = OperateConfig(dep.cluster, args.redundant, args.window_requests, args.sample_every, args.capacity_factor,
                        preset, args.weight_bytes, batch_config(dep), dep.rule, args.dedup,
                        args.step_seconds)
    if args.source == "live":
        if args.stream is not None or args.model is None or args.prompts is None:
            raise ValueError("--source live takes --model and --prompts (and no STREAM): e.g. --source live "
                             "--model reference --prompts builtin --max-new-tokens 32")
        from moeplace.operate.live import open_live

        stream = open_live(args.model, args.prompts, args.window_requests, args.max_new_tokens, args.batch_size,
                           args.max_requests, args.device)
    else:
        if args.stream is None:
            raise ValueError("give a STREAM (a per-token trace directory), or --source live --model ... --prompts ...")
        from moeplace.operate.service import check_stream_model

        # explicit only: a --profile prices its model
        note = check_stream_model(args.stream, args.model_preset, args.model_sizes_meant)
        if note:
            print(note, flush=True)
        schedule = None
        if args.schedule is not None:
            from moeplace.operate.workloads import MixSchedule
            from moeplace.schema import read_json_file

            try:
                schedule = MixSchedule.from_json(read_json_file(args.schedule, "mix schedule"), "schedule")
            except ValueError as e:
                raise CliError(schedule_error(args.schedule, e)) from None
        try:
            stream = open_stream(args.stream, args.window_requests, args.order, args.seed, args.drift_requests,
                                 schedule, args.stream_requests, args.stream_key)
        except ValueError as e:
            from moeplace.trace.types import TraceError

            if schedule is None or isinstance(e, TraceError):  # a trace's error names its file
                raise
            raise CliError(schedule_error(args.schedule, e)) from None
    print(f"stream: {stream.label}", flush=True)
    res = run(stream, cfg, args.policy, args.out, args.json, args.metrics_port, args.linger,
              on_start=lambda url: print(f"metrics on {url}/metrics, dashboard on {url}/", flush=True),
              metrics_host=host, **params)
    print(f"policy {res.policy}: total {res.total_time_s:.6f} s = layers {res.layer_time_s:.6f} s + migration "
          f"{res.migration_time_s:.6f} s; {res.rebalances} rebalances moving {res.migration_bytes / 1e9:.3f} GB; "
          f"mean balancedness {res.mean_balancedness:.4f} over {len(res.windows)} windows")
    for what, path in (("summary", args.json), ("plans", args.out)):
        if path:
            print(f"wrote {what} to {path}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from moeplace.operate.orders import STREAM_ORDERS
    from moeplace.operate.policies import POLICIES, policy_params

    p = sub.add_parser(
        "operate", help="live loop: counters, Prometheus metrics, dashboard, rebalance policy, migration plans",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="policies (--list-policies for their parameters):\n"
        + "\n".join(f"  {s.name:18s} {s.summary}" for s in POLICIES.values()) + "\n\nexample:\n"
        "  moeplace operate src/moeplace/data/reference-default.trace --order drift --cluster 4 "
        "--cluster-preset h200-8 --redundant 32 --model-preset gpt-oss-20b --policy moeplace --json out.json\n"
        "  moeplace operate --source live --model reference --prompts builtin --max-requests 64 --max-new-tokens 32 "
        "--window-requests 32 --decode-batch 32 --cluster 4 --cluster-preset h200-8 --model-preset gpt-oss-20b")
    p.add_argument("stream", metavar="STREAM", nargs="?", help="a per-token trace directory to replay "
                   "(--source trace)")
    p.add_argument("--source", choices=("trace", "live"), default="trace",
                   help="trace: replay STREAM; live: routing of --model's generate on --prompts, as it happens")
    p.add_argument("--model", metavar="DIR", help="--source live: 'reference' (the bundled reference MoE) or a "
                   "local Hugging Face model directory")
    p.add_argument("--prompts", metavar="FILE", help="--source live: 'builtin' (the reference held-out prompts) or "
                   "a JSONL file of {\"prompt\": ..., \"domain\": ...}")
    p.add_argument("--max-requests", type=int_in(1, 1 << 24), help="--source live: the first N prompts only")
    p.add_argument("--max-new-tokens", type=int_in(1, 1 << 20), default=32, help="--source live: tokens "
                   "generated per request (default 32)")
    p.add_argument("--batch-size", type=int_in(1, 4096), default=8, help="--source live: requests per generate "
                   "call (default 8, as trace record)")
    p.add_argument("--device", type=device_spec, default="cpu", help="--source live: torch device (default cpu)")
    p.add_argument("--order", choices=STREAM_ORDERS, default="table",
                   help="arrival order: table (as stored), dataset, domain, drift (a seeded drift built from it), "
                   "or schedule (re-ordered by --schedule, docs/WORKLOADS.md)")
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0, help="seed of --order drift / schedule")
    p.add_argument("--schedule", metavar="FILE", help="--order schedule: a mix schedule JSON (phases, daily cycle, "
                   "bursts: moeplace.operate.workloads.MixSchedule.to_json)")
    p.add_argument("--stream-requests", type=int_in(1, 1 << 24), help="--order schedule: arrivals (default one "
                   "pass over the schedule's phases)")
    p.add_argument("--stream-key", choices=("domain", "dataset", "subdomain"), default="domain",
                   help="--order schedule: the schedule's keys are domains, datasets (source before '/') or "
                        "sub-domain labels (the whole source, e.g. code/c)")
    p.add_argument("--drift-requests", type=int_in(1, 1 << 24), default=1000,
                   help="--order drift: requests per phase (one phase per domain)")
    p.add_argument("--redundant", type=int_in(0, MAX_REDUNDANT), default=0, help="redundant slots per layer")
    p.add_argument("--policy", choices=list(POLICIES), default="moeplace", help="rebalance policy (default "
                   "moeplace; --list-policies shows each one's parameters)")
    p.add_argument("--list-policies", action=ListPolicies, help="list the policies and their parameters, and exit")
    g = p.add_argument_group("policy parameters", "each applies to the policies that declare it "
                             "(--list-policies); a flag the chosen policy does not declare is an error")
    for prm in policy_params().values():
        users = ", ".join(s.name for s in POLICIES.values() if prm in s.params)
        g.add_argument(prm.flag, dest=POLICY_DEST + prm.name, type=param_type(prm), default=argparse.SUPPRESS,
                       metavar=prm.type.__name__.upper(), help=f"{users}: {prm.describe()}")
    p.add_argument("--window-requests", type=int_in(1, 1 << 24), default=256, help="requests per window")
    p.add_argument("--sample-every", type=int_in(1, 1 << 20), default=16, help="1-in-n sampling of the counters")
    p.add_argument("--capacity-factor", type=float_in(0, 1e6, lo_open=True),
                   help="count drops as a token-dropping engine would: pairs above floor(F x pairs / experts) per "
                        "expert per micro-batch (default: dropless, as SGLang and vLLM serve; no drop metrics)")
    p.add_argument("--model-preset", help="model sizes for the time model and the expert bytes "
                   "(default: the trace's model)")
    p.add_argument("--model-sizes-meant", action="store_true",
                   help="price the stream with --model-preset's sizes although its expert count or top-k differs "
                        "from the trace's (a what-if; refused without this flag)")
    p.add_argument("--weight-bytes", type=float_in(0, 64, lo_open=True), default=2.0,
                   help="bytes per expert parameter (2 = bf16)")
    p.add_argument("--dedup", choices=("per_gpu", "two_hop"), default="per_gpu", help="time model's comm mode")
    p.add_argument("--step-seconds", type=float_in(0, 3600), default=0.0,
                   help="pace the replay: wall-clock seconds per forward pass (0: as fast as possible)")
    p.add_argument("--metrics-port", type=int_in(0, 65535), help="serve /metrics and the dashboard on "
                   "127.0.0.1:PORT (0: any free port)")
    p.add_argument("--metrics-host", metavar="HOST", help="address the metrics server listens on (default "
                   "127.0.0.1: this machine only; 0.0.0.0 or :: for every interface; docs/PRIVACY.md)")
    p.add_argument("--linger", type=float_in(0, 86400), default=0.0, help="keep serving SECONDS after the end")
    p.add_argument("--out", type=output_dir, help="folder for plan.json, migration.json, sglang.json, vllm.json "
                   "and changes/")
    p.add_argument("--json", type=output_file, help="write the summary (benchmark keys + per-window history)")
    add_deployment_options(p)
    p.set_defaults(func=cmd_operate, folder_files={"out": plan_folder_files})


def plan_folder_files() -> tuple[str, ...]:
    """The files ``--out`` receives (checked against the inputs and a user's files before any work)."""
    from moeplace.operate.loop import plan_folder_files

    return plan_folder_files()
