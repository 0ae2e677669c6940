"""Planner benchmark on held-out requests: every strategy on gpt-oss-20b decode routing, several clusters.

Usage:
  python bench/plan_compare.py [--trace gpt-oss.trace] [--clusters 4x2,8x1,2x4] [--redundant 8]
                               [--strategies a,b] [--param KEY=VALUE ...] [--out bench/results/plan_compare]

Without --trace it imports ../shared/data/gpt-oss-20b (528 generations, decode only) into out/cache/ first.
gpt-oss has no prefill, so each request's first 32 decode tokens stand for its prompt: they are the grouping
signal for held-out requests and are not scored. Plans are made on 75% of the requests (random, seed 0) and
scored by the simulator on the other 25%. Writes OUT.md (tables) and OUT.json (all numbers).

This is the bytes-under-a-balance-floor benchmark: joint runs with ``objective="bytes"`` here (override with
``--param objective='"time"'``); predicted layer time, joint's default objective, is bench/plan_time.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common import BenchRun

from moeplace.io import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data" / "gpt-oss-20b"


def ensure_trace(path: str | None) -> Path:
    if path:
        return Path(path)
    from moeplace.trace.importers import import_trace

    out = REPO / "out" / "cache" / "gpt-oss-20b.trace"  # out/ is git-ignored
    if not (out / "meta.json").exists():
        if not SHARED.exists():
            sys.exit(f"no --trace given and {SHARED} is absent")
        out.parent.mkdir(parents=True, exist_ok=True)
        import_trace("gpt-oss-npz", SHARED, out, overwrite=True, weights=False)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace")
    ap.add_argument("--clusters", default="4x2,8x1,2x4")
    ap.add_argument("--redundant", type=int, default=8)
    ap.add_argument("--strategies", default=None, help="comma-separated (default: all)")
    ap.add_argument("--balance-floor", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--param", action="append", default=[],
                    help="KEY=VALUE strategy parameter (a JSON number), e.g. robust=0 for joint; repeatable")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "plan_compare"))
    args = ap.parse_args()
    run = BenchRun("plan_compare", baseline="the linear placement with round-robin homes, scored on the same "
                                            "held-out requests (every figure is a ratio to it)")

    from moeplace.evaluate import compare, format_table
    from moeplace.placement import Cluster
    from moeplace.plan import STRATEGIES
    from moeplace.trace import read_trace

    trace_path = ensure_trace(args.trace)
    t = read_trace(trace_path)
    names = args.strategies.split(",") if args.strategies else list(STRATEGIES)
    params = {"objective": "bytes"}  # this bench measures bytes under the floor (see the module docstring)
    params.update({k: json.loads(v) for k, v in (p.split("=", 1) for p in args.param)})  # 64 -> int, 0.3 -> float
    results = {}
    md = [f"# Planner comparison on {t.meta.model} ({'synthetic' if t.meta.synthetic else 'real'} routing)", "",
          f"Command: `python bench/plan_compare.py --clusters {args.clusters} --redundant {args.redundant}"
          f" --balance-floor {args.balance_floor} --seed {args.seed}"
          + (f" --strategies {args.strategies}" if args.strategies else "")
          + "".join(f" --param {p}" for p in args.param) + "`", ""]
    for spec in args.clusters.split(","):
        t0 = time.perf_counter()
        res = compare(t, Cluster.parse(spec), args.redundant, names, balance_floor=args.balance_floor,
                      seed=args.seed, params=params, progress=lambda m, s=spec: print(f"[{s}] {m}", flush=True))
        res["wall_seconds"] = time.perf_counter() - t0
        results[spec] = res
        md += [f"## {spec} (R={args.redundant}): planned on {res['planning_requests']} requests, scored on "
               f"{res['held_out_requests']} held-out requests ({res['scored_tokens']} decode tokens)", "",
               "```", format_table(res), "```", ""]
        print(format_table(res), flush=True)
    out = Path(args.out)
    run.write({"params": {k: v for k, v in vars(args).items() if k != "out"}, "results": results},
              out.with_suffix(".json"))
    atomic_write_text("\n".join(md) + "\n", out.with_suffix(".md"))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
