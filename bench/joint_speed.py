"""Joint planner speed on a synthetic DeepSeek-V3 workload: 100k requests, 4 nodes x 8 GPUs, 32 redundant slots.

Usage:
  python bench/joint_speed.py [--trace DS.trace] [--requests 100000] [--prompt-len 8] [--gen-len 4]
                              [--json OUT.json]

Without --trace it generates the workload with moeplace's synthesizer (``moeplace synth --preset deepseek-v3``;
short requests keep the trace in memory: 100k requests x 12 tokens x 58 layers x top-8) into out/cache/.
Target: ``joint`` under 60 s for the whole window (plan_seconds: time inside the strategy).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace")
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--gen-len", type=int, default=4)
    ap.add_argument("--cluster", default="4x8")
    ap.add_argument("--redundant", type=int, default=32)
    ap.add_argument("--time-budget", type=float, default=30.0, help="joint's local-search seconds")
    ap.add_argument("--json")
    args = ap.parse_args()

    from moeplace.placement import Cluster
    from moeplace.plan import make_plan, workload_from_tokens
    from moeplace.trace import read_trace

    path = Path(args.trace) if args.trace else REPO / "out" / "cache" / f"ds-v3-{args.requests}.trace"
    if not (path / "meta.json").exists() or not any(path.glob("part-*")):
        from moeplace.synth import SynthConfig, synthesize

        path.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        synthesize(path, "deepseek-v3", SynthConfig(num_requests=args.requests, prompt_len=args.prompt_len,
                                                    gen_len=args.gen_len), overwrite=True)
        print(f"synthesized {path} in {time.perf_counter() - t:.0f} s")
    t = time.perf_counter()
    tr = read_trace(path)
    tk = tr.tokens
    work = workload_from_tokens(tk.request_id, tk.phase, tk.expert_ids, tr.meta.num_experts)
    load_s = time.perf_counter() - t
    cluster = Cluster.parse(args.cluster)
    plan = make_plan("joint", work, cluster, args.redundant, planned_on=str(path), time_budget=args.time_budget)
    out = {"trace": str(path), "synthetic": bool(tr.meta.synthetic), "requests": int(work.num_requests),
           "tokens": int(len(tk)), "cluster": cluster.spec(), "redundant": args.redundant,
           "read_seconds": load_s, "plan_seconds": plan.plan_seconds,
           "planning_balancedness": plan.extra.get("planning_balancedness"), "fallback": plan.extra.get("fallback"),
           "timings": plan.extra.get("timings"), "homes": len(plan.homes)}
    print(json.dumps(out, indent=1))
    print(f"joint on {work.num_requests} requests ({len(tk)} tokens): {plan.plan_seconds:.1f} s "
          f"({'under' if plan.plan_seconds < 60 else 'OVER'} the 60 s target)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
