"""Planner benchmark on held-out requests: every strategy on gpt-oss-20b decode routing, several clusters, over
several random splits, with paired 95% intervals (the protocol of docs/EVALUATION.md).

Usage:
  python bench/plan_compare.py [--trace gpt-oss.trace] [--clusters 4x2,8x1,2x4] [--redundant 8] [--seeds 5]
                               [--strategies a,b] [--param KEY=VALUE ...] [--out bench/results/plan_compare]
                               [--engine {local,ray}] [--address HOST:PORT]

Without --trace it imports ../shared/data/gpt-oss-20b (528 generations, decode only) into out/cache/ first.
gpt-oss has no prefill, so each request's first 32 decode tokens stand for its prompt: they are the grouping
signal for held-out requests and are not scored. For each of ``--seeds`` random splits (seeds 0..N-1; the held-out
arrival order mixed, seeded by the split; planners seeded by ``--seed``), plans are made on 75% of the requests
and scored by the simulator on the other 25% (``moeplace.evaluate.compare``). No deployment profile: 132 held-out
decode-only requests fill none, so every held-out micro-batch is scored. Each cluster writes OUT_CLUSTER.md (the
table) and OUT_CLUSTER.json (all numbers): bench/results/plan_compare_4x2.json, ...

Reported per cluster and strategy, pooled over splits and micro-batches, each with its paired two-level bootstrap
interval (``moeplace.evaluate.intervals``):
- ``inter_node_bytes_vs_linear``: inter-node bytes / the linear placement's (round-robin homes), same micro-batches;
- ``decode``: predicted layer time / the strongest EPLB's (global or hierarchical x static / least-loaded /
  balanced dispatch, chosen on the held-out window), with the balanced bound and the gap closed;
- balancedness (held-out and planning window), node-local rate and planning seconds as the median over splits
  with their range (not ratios of sums over micro-batches: no bootstrap interval).

This is the bytes-under-a-balance-floor benchmark: joint runs with ``objective="bytes"`` here (override with
``--param objective='"time"'``); predicted layer time, joint's default objective, is bench/plan_time.py.
Each cluster is a run of its own (its own result file, command, commit and load average); ``--clusters 4x2`` runs
one (about 8 minutes on 2 busy cores; 8x1 and 2x4 take less). ``--engine ray [--address ADDR]`` runs every
strategy x split seed as a Ray task (``compare``'s engine, docs/SCALE.md): the same numbers but for the measured
seconds (``plan_seconds``, ``wall_seconds``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common import BenchRun, paired_ci, seed_spread

from moeplace.cli.options import add_engine_options, engine_from_args
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


def txt(c: dict | None, digits: int = 3) -> str:
    """``0.912 [0.881, 0.948]`` (``~`` when the interval contains 1); ``-`` for no ratio."""
    if c is None:
        return "-"
    r, (lo, hi) = c.get("ratio", c.get("ratio_to_baseline")), c["ci95"]
    return f"{r:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]" + ("" if c["decided"] else " ~")


def bench_cluster(trace, cluster, redundant: int, names: list[str], seeds: list[int], seed: int,
                  balance_floor: float, params: dict, spec: str, engine=None) -> dict:
    """One cluster: compare over the split seeds (on ``engine``; None: this process), then the per-strategy rows
    pooled over seeds."""
    from moeplace.evaluate import compare, planning_balance

    per_seed: list[dict] = []

    def keep(s, win, smp, results, plans) -> None:
        dec = {n: results["decode"][n].decode.to_json() for n in names}
        per_seed.append({
            "bytes": {n: smp["decode"][n].inter_node_bytes for n in names},
            "balancedness": {n: dec[n]["balancedness"]["total"] for n in names},
            "node_local_rate": {n: dec[n]["node_local_rate"]["total"] for n in names},
            "planning_balancedness": {n: planning_balance(plans["decode"][n], win) for n in names},
            "plan_seconds": {n: plans["decode"][n].plan_seconds for n in names},
            "scored_tokens": dec["linear"]["num_tokens"],
            "fallback": {n: None if plans["decode"][n].fallback is None else plans["decode"][n].fallback.to_json()
                         for n in names}})

    res = compare(trace, cluster, redundant, names, balance_floor=balance_floor, seed=seed, params=params,
                  arrival="mixed", split_seeds=seeds, on_seed=keep,
                  progress=lambda m: print(f"[{spec}] {m}", flush=True), engine=engine)
    base = res["baseline"]["decode"]
    out: dict = {"cluster": res["cluster"], "num_redundant": res["num_redundant"],
                 "planning_requests": res["planning_requests"], "held_out_requests": res["held_out_requests"],
                 "scored_tokens": res["scored_tokens"], "split_seeds": res["split_seeds"],
                 "scored_tokens_per_seed": [p["scored_tokens"] for p in per_seed],
                 "microbatches_per_seed": res["microbatch_counts"]["decode"]["microbatches"],
                 "baseline": base, "baseline_layer_time_s": res["baseline_candidates"]["decode"][base],
                 "baseline_candidates": res["baseline_candidates"]["decode"], "strategies": {}}
    for n in names:
        ph = res["strategies"][n]["phases"]["decode"]
        out["strategies"][n] = {
            "inter_node_bytes_vs_linear": paired_ci([p["bytes"][n] for p in per_seed],
                                                    [p["bytes"]["linear"] for p in per_seed]),
            "decode": ph,
            **{k: seed_spread([p[k][n] for p in per_seed])
               for k in ("balancedness", "planning_balancedness", "node_local_rate", "plan_seconds")},
            "fallback_per_seed": [p["fallback"][n] for p in per_seed]}
    return out


def table(r: dict) -> str:
    """One cluster's rows as a fixed-width text table."""
    head = (f"{'strategy':<20}{'bytes / linear [95%]':>28}{'balance':>9}{'(range)':>15}{'planning':>10}"
            f"{'decode us':>11}{'decode / ' + r['baseline'] + ' [95%]':>42}{'node-local':>12}{'plan s':>9}")
    lines = [head, "-" * len(head)]
    for n, s in r["strategies"].items():
        b = s["balancedness"]
        rng = f"{b['min']:.3f}-{b['max']:.3f}"
        lines.append(f"{n:<20}{txt(s['inter_node_bytes_vs_linear']):>28}{b['median']:>9.3f}{rng:>15}"
                     f"{s['planning_balancedness']['median']:>10.3f}{s['decode']['layer_time_s'] * 1e6:>11.1f}"
                     f"{txt(s['decode']):>42}{s['node_local_rate']['median']:>12.3f}"
                     f"{s['plan_seconds']['median']:>9.2f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace")
    ap.add_argument("--clusters", default="4x2,8x1,2x4")
    ap.add_argument("--redundant", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=5, help="random split seeds (default: 5)")
    ap.add_argument("--strategies", default=None, help="comma-separated (default: all; linear is always included)")
    ap.add_argument("--balance-floor", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0, help="the planners' seed")
    ap.add_argument("--param", action="append", default=[],
                    help="KEY=VALUE strategy parameter (a JSON number), e.g. robust=0 for joint; repeatable")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "plan_compare"),
                    help="each cluster writes OUT_CLUSTER.json and OUT_CLUSTER.md (default: "
                         "bench/results/plan_compare_4x2.json, ...)")
    add_engine_options(ap)
    args = ap.parse_args()

    from moeplace.engine import EngineError

    try:
        engine = engine_from_args(args)  # an unreachable --address fails before any work
    except EngineError as e:
        ap.error(str(e))
    try:
        return run_clusters(args, engine)
    finally:
        if engine is not None:
            engine.close()


def run_clusters(args: argparse.Namespace, engine) -> int:
    """Each of ``--clusters`` as a run of its own, through ``compare`` on ``engine`` (None: this process)."""
    from moeplace.placement import Cluster
    from moeplace.plan import MOE_STRATEGIES
    from moeplace.trace import read_trace

    trace_path = ensure_trace(args.trace)
    t = read_trace(trace_path)
    names = args.strategies.split(",") if args.strategies else list(MOE_STRATEGIES)
    if "linear" not in names:  # the bytes ratio's denominator
        names.insert(0, "linear")
    params = {"objective": "bytes"}  # this bench measures bytes under the floor (see the module docstring)
    for p in args.param:  # 64 -> int, 0.3 -> float, '"time"' -> str
        k, eq, v = p.partition("=")
        try:
            params[k] = json.loads(v) if eq else None
        except json.JSONDecodeError:
            params[k] = None
        if not eq or params[k] is None:
            print(f"plan_compare: --param {p!r}: expected KEY=VALUE with a JSON value (a string in double quotes, "
                  "e.g. objective='\"time\"')", file=sys.stderr)
            return 2
    seeds = list(range(args.seeds))
    for spec in args.clusters.split(","):  # one result file per cluster: each a run of its own
        run = BenchRun("plan_compare", baseline="bytes: the linear placement with round-robin homes; layer time: the "
                                                "strongest EPLB (global/hierarchical x static/least-loaded/balanced "
                                                "dispatch), chosen on the held-out window; both scored on the same "
                                                "held-out micro-batches")
        t0 = time.perf_counter()
        r = bench_cluster(t, Cluster.parse(spec), args.redundant, names, seeds, args.seed, args.balance_floor, params,
                          spec, engine)
        r["wall_seconds"] = time.perf_counter() - t0
        md = [f"# Planner comparison on {t.meta.model} ({'synthetic' if t.meta.synthetic else 'real'} routing), {spec}",
              "", f"Command: `{run.command}`", "",
              f"{len(seeds)} random splits (75% planning, 25% held out, arrival order mixed by the split's seed); "
              "ratios pooled over splits and micro-batches with their paired 95% interval (`~`: it contains 1, not "
              "told apart); balancedness, node-local rate and planning seconds are medians over the splits (range: "
              "min-max).", "",
              f"## {spec} (R={args.redundant}): planned on {r['planning_requests']} requests, scored on "
              f"{r['held_out_requests']} held-out requests per split ({min(r['scored_tokens_per_seed'])}-"
              f"{max(r['scored_tokens_per_seed'])} decode tokens); "
              f"baseline for time: {r['baseline']} ({r['baseline_layer_time_s'] * 1e6:.1f} us)", "",
              "```", table(r), "```", ""]
        print(table(r), f"\n({r['wall_seconds']:.0f} s)", flush=True)
        out = Path(f"{args.out}_{spec}")
        run.write({"params": {**{k: v for k, v in vars(args).items() if k not in ("out", "clusters")},
                              "cluster": spec, "split_seeds": seeds, "holdout": 0.25, "split": "random",
                              "arrival": "mixed (seeded by the split)", "strategy_params": params,
                              "interval": "paired two-level bootstrap over split seeds and micro-batches, 95%, "
                                          "2,000 replicates (moeplace.evaluate.intervals)"},
                   "results": r}, out.with_suffix(".json"))
        atomic_write_text("\n".join(md) + "\n", out.with_suffix(".md"))
        print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
