"""``moeplace operate``: run a stream of routing through the live loop: counters, Prometheus metrics, the
dashboard, a rebalance policy, migration plans and engine exports. The stream is a trace replayed (``STREAM``), or
routing produced as it happens by a model's ``generate`` (``--source live --model reference --prompts builtin``)."""

from __future__ import annotations

import argparse

from moeplace.cli import MAX_REDUNDANT, device_spec, float_in, int_in, output_dir, output_file


def cmd_operate(args: argparse.Namespace) -> int:
    from moeplace.operate import OperateConfig
    from moeplace.operate.service import open_stream, run
    from moeplace.presets import cluster_from_spec
    from moeplace.simulate import BatchConfig

    cfg = OperateConfig(cluster_from_spec(args.cluster, args.cluster_preset), args.redundant, args.window_requests,
                        args.sample_every, args.capacity_factor, args.model_preset, args.weight_bytes,
                        BatchConfig(args.decode_batch, args.prefill_tokens), args.rule, args.dedup,
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
        schedule = None
        if args.schedule is not None:
            from moeplace.schema import read_json_file
            from moeplace.workloads import MixSchedule

            schedule = MixSchedule.from_json(read_json_file(args.schedule, "mix schedule"), str(args.schedule))
        stream = open_stream(args.stream, args.window_requests, args.order, args.seed, args.drift_requests,
                             schedule, args.stream_requests, args.stream_key)
    params = {}
    if args.period_steps is not None:
        params["period_steps"] = args.period_steps
    if args.threshold is not None:
        params["threshold"] = args.threshold
    if args.horizon_steps is not None:
        params["horizon_steps"] = args.horizon_steps
    print(f"stream: {stream.label}", flush=True)
    res = run(stream, cfg, args.policy, args.out, args.json, args.metrics_port, args.linger,
              on_start=lambda url: print(f"metrics on {url}/metrics, dashboard on {url}/", flush=True), **params)
    print(f"policy {res.policy}: total {res.total_time_s:.6f} s = layers {res.layer_time_s:.6f} s + migration "
          f"{res.migration_time_s:.6f} s; {res.rebalances} rebalances moving {res.migration_bytes / 1e9:.3f} GB; "
          f"mean balancedness {res.mean_balancedness:.4f} over {len(res.windows)} windows")
    for what, path in (("summary", args.json), ("plans", args.out)):
        if path:
            print(f"wrote {what} to {path}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from moeplace.operate.policies import POLICIES
    from moeplace.operate.service import STREAM_ORDERS
    from moeplace.simulate import RULES, BatchConfig

    b = BatchConfig()
    p = sub.add_parser(
        "operate", help="live loop: counters, Prometheus metrics, dashboard, rebalance policy, migration plans",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="policies:\n" + "\n".join(f"  {k:18s} {v[0]}" for k, v in POLICIES.items()) + "\n\nexample:\n"
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
                   "bursts: moeplace.workloads.MixSchedule.to_json)")
    p.add_argument("--stream-requests", type=int_in(1, 1 << 24), help="--order schedule: arrivals (default one "
                   "pass over the schedule's phases)")
    p.add_argument("--stream-key", choices=("domain", "dataset", "subdomain"), default="domain",
                   help="--order schedule: the schedule's keys are domains, datasets (source before '/') or "
                        "sub-domain labels (the whole source, e.g. code/c)")
    p.add_argument("--drift-requests", type=int_in(1, 1 << 24), default=1000,
                   help="--order drift: requests per phase (one phase per domain)")
    p.add_argument("--cluster", required=True, help="NODESxGPUS, or nodes with --cluster-preset")
    p.add_argument("--cluster-preset", help="links and GPU speed (moeplace.presets), e.g. h200-8")
    p.add_argument("--redundant", type=int_in(0, MAX_REDUNDANT), default=0, help="redundant slots per layer")
    p.add_argument("--policy", choices=list(POLICIES), default="moeplace")
    p.add_argument("--period-steps", type=int_in(1, 1 << 40), help="periodic: steps between rebalances "
                   "(default SGLang's 1000)")
    p.add_argument("--threshold", type=float_in(0, 1, lo_open=True), help="threshold: balancedness below which "
                   "to rebalance (default 0.5)")
    p.add_argument("--horizon-steps", type=int_in(1, 1 << 40), help="moeplace: steps a change must pay back "
                   "over (default 1000)")
    p.add_argument("--window-requests", type=int_in(1, 1 << 24), default=256, help="requests per window")
    p.add_argument("--decode-batch", type=int_in(1, 1 << 24), default=b.decode_batch)
    p.add_argument("--prefill-tokens", type=int_in(1, 1 << 24), default=b.prefill_tokens)
    p.add_argument("--sample-every", type=int_in(1, 1 << 20), default=16, help="1-in-n sampling of the counters")
    p.add_argument("--capacity-factor", type=float_in(0, 1e6, lo_open=True), default=1.25)
    p.add_argument("--model-preset", help="model sizes for the time model and the expert bytes "
                   "(default: the trace's model)")
    p.add_argument("--weight-bytes", type=float_in(0, 64, lo_open=True), default=2.0,
                   help="bytes per expert parameter (2 = bf16)")
    p.add_argument("--rule", choices=RULES, default=RULES[0], help="replica choice rule")
    p.add_argument("--dedup", choices=("per_gpu", "two_hop"), default="per_gpu", help="time model's comm mode")
    p.add_argument("--step-seconds", type=float_in(0, 3600), default=0.0,
                   help="pace the replay: wall-clock seconds per forward pass (0: as fast as possible)")
    p.add_argument("--metrics-port", type=int_in(0, 65535), help="serve /metrics and the dashboard on "
                   "127.0.0.1:PORT (0: any free port)")
    p.add_argument("--linger", type=float_in(0, 86400), default=0.0, help="keep serving SECONDS after the end")
    p.add_argument("--out", type=output_dir, help="folder for plan.json, migration.json, sglang.json, vllm.json "
                   "and changes/")
    p.add_argument("--json", type=output_file, help="write the summary (benchmark keys + per-window history)")
    p.set_defaults(func=cmd_operate)
