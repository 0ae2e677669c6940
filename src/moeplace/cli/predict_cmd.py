"""``moeplace predict-kernel``: the time model's dispatch and combine time of one EP kernel call under the
routing kernel benchmarks use, per EP size (to check against published kernel measurements)."""

from __future__ import annotations

import argparse

from moeplace.cli import int_in, output_file


def ep_list(text: str) -> list[int]:
    """Comma-separated EP sizes, e.g. ``8,16,32``."""
    try:
        if not text.isascii():  # int() reads full-width digits
            raise ValueError(text)
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 8,16,32") from None
    if not out or min(out) < 1 or max(out) > 4096:
        raise argparse.ArgumentTypeError(f"{text!r}: expected EP sizes in [1, 4096]")
    return out


def cmd_predict_kernel(args: argparse.Namespace) -> int:
    from moeplace.io import atomic_write_json
    from moeplace.simulate.kernel_bench import predict_kernel

    rows = predict_kernel(args.model, args.cluster_preset, args.ep, args.mode, args.tokens_per_rank, seed=args.seed)
    print(f"{args.mode} on {args.cluster_preset}, {args.model}, {args.tokens_per_rank} tokens per rank "
          f"(benchmark routing, seed {args.seed})")
    print(f"{'EP':>5} {'dispatch us':>12} {'combine us':>11} {'dispatch GB/s':>14} {'combine GB/s':>13}")
    for r in rows:  # GB/s is None where the call takes no time (EP 1 with deepep-normal or nccl: nothing sent)
        gb = {k: "-" if r[k] is None else f"{r[k]:.1f}" for k in ("dispatch_gbps", "combine_gbps")}
        print(f"{r['ep']:>5} {r['dispatch_us']:>12.1f} {r['combine_us']:>11.1f} {gb['dispatch_gbps']:>14} "
              f"{gb['combine_gbps']:>13}")
    if args.json:
        atomic_write_json({"model": args.model, "cluster_preset": args.cluster_preset, "mode": args.mode,
                           "tokens_per_rank": args.tokens_per_rank, "seed": args.seed, "rows": rows}, args.json)
        print(f"wrote {args.json}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from moeplace.simulate.config import KERNEL_NAMES

    p = sub.add_parser(
        "predict-kernel", help="predicted dispatch/combine time of one EP kernel call per EP size",
        description="Price one dispatch and one combine of an EP kernel with the simulator's time model, under the "
                    "routing kernel benchmarks use (scores |N(0,1)|+1, top-k; DeepEP's normal-kernel test also "
                    "limits a token to min(nodes, 4) nodes). Bytes are counted as DeepEP's benchmarks count them, "
                    "so GB/s compares with its published bandwidths (docs/SIMULATOR.md, 'Kernel validation').",
        epilog="examples:\n  moeplace predict-kernel --model deepseek-v3 --cluster-preset h800-8 "
               "--ep 8,16,32,64,128,256 --mode deepep-ll --tokens-per-rank 128 --json ll.json\n"
               "  moeplace predict-kernel --model deepseek-v3 --cluster-preset h800-8 --ep 8,16,32,64 "
               "--mode deepep-normal --tokens-per-rank 4096",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="model preset (docs/PRESETS.md), e.g. deepseek-v3")
    p.add_argument("--cluster-preset", required=True, help="cluster preset, e.g. h800-8")
    p.add_argument("--ep", type=ep_list, required=True, help="EP sizes, comma-separated (whole nodes, or one node)")
    p.add_argument("--mode", choices=KERNEL_NAMES, required=True, help="the kernel")
    p.add_argument("--tokens-per-rank", type=int_in(1, 1 << 16), required=True,
                   help="tokens each rank dispatches (DeepEP: 128 low-latency, 4096 normal)")
    p.add_argument("--seed", type=int_in(0, 1 << 31), default=0, help="routing seed (default: %(default)s)")
    p.add_argument("--json", type=output_file, help="write {rows: [{ep, dispatch_us, combine_us, ...}]} here")
    p.set_defaults(func=cmd_predict_kernel)
