"""Predicted MoE layer time per micro-batch on held-out requests, where users run: every deployment profile the data
fills, against the strongest EPLB, as a ratio with a paired 95% interval over split seeds and micro-batches, with
the ideal bound and the gap closed (the protocol of docs/EVALUATION.md).

Usage:
  python bench/plan_time.py [--seeds 5] [--holdout 0.75] [--profiles NAME,...] [--workloads NAME,...]
                            [--phases prefill,decode] [--strategies eplb,activation-clusters,joint] [--json PATH]
                            [--engine {local,ray}] [--address HOST:PORT]

Workloads (real routing of trained models; none synthetic):
- ``reference-fg`` (64 experts in 8 groups, top-6): prefill from the prefill-scale held-out trace that
  ``scripts/prefill_trace.py --model reference-fg`` writes into ``out/cache/`` (``reference-fg-prefill-4m.trace``,
  every held-out token, built with ``--target-tokens 4000000 --out ...``, when present; skipped, and said so, when
  none has been built), decode from the shipped ``reference-fg.trace`` (4,136 requests x 32 decode tokens);
- ``reference-ds`` (DeepSeek-V3-shaped: 256 experts in 8 groups, top-4 groups, top-8): the same two sources;
- ``gpt-oss-20b`` (decode-only routing from ../shared/data, when present).

Per profile (``moeplace.deploy.profiles``) and phase, the profile's per-GPU batch sizes, kernel, rule and model
sizes are kept, and the node count is the largest, up to the profile's, at which the held-out window forms at least
20 full micro-batches (``measure.MIN_MICROBATCHES``) on the first split seed; a phase the data cannot fill even on
one node is reported as such. Each setting: plan every strategy on the planning window of each of ``--seeds``
random splits (mixed arrival order, seeded by the split), score on the held-out window's full micro-batches.
Baseline: the best of EPLB global / hierarchical x {nearest-static, nearest-least-loaded, balanced} dispatch, chosen
per phase on the held-out window, measured in the same run (``moeplace.evaluate.measure``).

``--engine ray [--address ADDR]`` runs each setting's strategies x split seeds as Ray tasks (``compare``'s engine,
docs/SCALE.md); the numbers equal the local run's but for the measured seconds (``seconds``, ``plan_seconds``,
``wall_seconds``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from common import BenchRun, positive_int

from moeplace.cli.options import add_engine_options, engine_from_args

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "src" / "moeplace" / "data"
CACHE = REPO / "out" / "cache"
STRATEGIES = ["eplb", "activation-clusters", "joint"]


def workload_sources() -> dict[str, dict[str, Path | None]]:
    """Workload -> phase -> trace directory (None: not available here)."""
    sys.path.insert(0, str(Path(__file__).parent))
    gpt = None
    if (REPO.parent / "shared" / "data" / "gpt-oss-20b").exists():
        from plan_compare import ensure_trace

        gpt = Path(ensure_trace(None))
    out = {}
    for name in ("reference-fg", "reference-ds"):
        pre = CACHE / f"{name}-prefill-4m.trace"
        if not (pre / "meta.json").exists():
            pre = CACHE / f"{name}-prefill.trace"
        out[name] = {"prefill": pre if (pre / "meta.json").exists() else None, "decode": DATA / f"{name}.trace"}
    out["gpt-oss-20b"] = {"prefill": None, "decode": gpt}
    return out


def fitted_nodes(trace, profile, phase: str, holdout: float, seeds: int, min_microbatches: int = 0
                 ) -> tuple[int | None, dict]:
    """The largest node count (<= the profile's) at which the held-out window of every split seed forms at least
    ``min_microbatches`` (0: MIN_MICROBATCHES) full micro-batches of ``phase``, and the fewest full ones per node
    count tried."""
    from moeplace.deploy.profiles import phase_deployments
    from moeplace.evaluate import split_windows
    from moeplace.evaluate.measure import MIN_MICROBATCHES, microbatch_counts, setup_of

    need = min_microbatches or MIN_MICROBATCHES

    wins = [split_windows(trace, holdout, "random", s, arrival="mixed") for s in range(seeds)]
    tried = {}
    for nodes in range(profile.phase(phase).nodes, 0, -1):
        st = setup_of(phase_deployments(profile, cluster=str(nodes))[phase], full_only=True)
        full = min(microbatch_counts(w, st.batching)[phase]["full"] for w in wins)
        tried[nodes] = full
        if full >= need:
            return nodes, tried
    return None, tried


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5, help="random split seeds (default: 5)")
    ap.add_argument("--holdout", type=float, default=0.75,
                    help="held-out fraction of the requests for decode (default: 0.75: planning on a quarter is "
                         "ample, and full running sets need the requests)")
    ap.add_argument("--prefill-holdout", type=float, default=0.9,
                    help="held-out fraction for prefill (default: 0.9: prefill-scale micro-batches need the tokens; "
                         "the planning tenth still holds hundreds of thousands of prompt tokens)")
    ap.add_argument("--profiles", help="comma-separated profile names (default: all)")
    ap.add_argument("--workloads", help="comma-separated: reference-fg, reference-ds, gpt-oss-20b (default: all)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--phases", default="prefill,decode", help="phases to measure (runs can be split by phase)")
    ap.add_argument("--min-microbatches", type=positive_int, default=None,
                    help="full held-out micro-batches a setting needs (default: the protocol's 20); lower only for "
                         "a trial the data cannot fill otherwise, and say so")
    ap.add_argument("--max-check-requests", type=positive_int, default=None,
                    help="joint's evaluation requests (default: its own, 2048): more lets a large planning window "
                         "form full-size prefill evidence")
    ap.add_argument("--json")
    add_engine_options(ap)
    args = ap.parse_args()
    run = BenchRun("plan_time", baseline="the strongest EPLB per phase (global/hierarchical x static/least-loaded/"
                   "balanced dispatch), chosen on the held-out window, scored in the same run")

    from moeplace.engine import EngineError

    try:
        engine = engine_from_args(args)  # an unreachable --address fails before any work
    except EngineError as e:
        ap.error(str(e))
    try:
        return measure(args, run, engine)
    finally:
        if engine is not None:
            engine.close()


def measure(args: argparse.Namespace, run: BenchRun, engine) -> int:
    """Every workload x phase x profile setting through ``compare`` (on ``engine``; None: this process)."""
    from moeplace.deploy.profiles import PROFILES, phase_deployments
    from moeplace.evaluate import compare
    from moeplace.trace import read_trace

    profiles = args.profiles.split(",") if args.profiles else list(PROFILES)
    sources = workload_sources()
    wanted = args.workloads.split(",") if args.workloads else list(sources)
    strategies = args.strategies.split(",")
    results: dict = {}
    skipped: dict = {}
    for wname in wanted:
        for phase in [p for p in ("prefill", "decode") if p in args.phases.split(",")]:
            path = sources[wname][phase]
            if path is None:
                skipped[f"{wname}-{phase}"] = ("no prefill-scale trace: run scripts/prefill_trace.py --model "
                                               f"{wname}" if phase == "prefill" and wname != "gpt-oss-20b"
                                               else "no such data here")
                print(f"{wname} {phase}: skipped ({skipped[f'{wname}-{phase}']})", flush=True)
                continue
            trace = read_trace(path)
            done: dict = {}
            for pname in profiles:
                prof = PROFILES[pname]
                key = f"{wname}-{pname}-{phase}"
                holdout = args.prefill_holdout if phase == "prefill" else args.holdout
                nodes, tried = fitted_nodes(trace, prof, phase, holdout, args.seeds, args.min_microbatches or 0)
                if nodes is None:
                    skipped[key] = (f"fewer than {args.min_microbatches or 20} full micro-batches even on 1 node "
                                    f"(fewest per seed, by nodes: {tried})")
                    print(f"{key}: skipped ({skipped[key]})", flush=True)
                    continue
                deps = phase_deployments(prof, cluster=str(nodes))
                bare = dataclasses.replace(deps[phase], profile=None)
                same = next((k for k, d in done.items() if d == bare), None)
                t0 = time.perf_counter()
                if same is not None:  # another profile reduced to the same deployment: the same measurement
                    r = results[same]["compare"]
                else:
                    extra = {"min_microbatches": args.min_microbatches} if args.min_microbatches else {}
                    params = {"max_check_requests": args.max_check_requests} if args.max_check_requests else None
                    r = compare(trace, None, None, strategies, holdout=holdout, arrival="mixed",
                                phase_deployments=deps, split_seeds=list(range(args.seeds)), phases=(phase,),
                                engine=engine, params=params, **extra)
                    done[key] = bare
                dep = deps[phase]
                rows = {n: r["strategies"][n]["phases"].get(phase) for n in strategies}
                results[key] = {
                    "workload": wname, "synthetic": bool(trace.meta.synthetic), "trace": str(path.relative_to(REPO)
                                                                                           if path.is_relative_to(REPO)
                                                                                           else path),
                    "profile": pname, "phase": phase, "holdout": holdout,
                    "profile_nodes": prof.phase(phase).nodes, "nodes": nodes,
                    "cluster": dep.cluster.spec(), "hardware": dep.cluster_preset,
                    "tokens_per_microbatch": dep.prefill_tokens if phase == "prefill" else dep.decode_running,
                    "per_gpu": prof.phase(phase).per_gpu, "mode": dep.mode, "rule": dep.rule,
                    "hidden_size": dep.hidden_size, "num_redundant": r["phase_deployments"][phase]["num_redundant"],
                    "baseline": r["baseline"].get(phase), "baseline_layer_time_s":
                        r["baseline_candidates"].get(phase, {}).get(r["baseline"].get(phase)),
                    "baseline_candidates": r["baseline_candidates"].get(phase),
                    "microbatch_counts": r["microbatch_counts"][phase], "strategies": rows,
                    "same_as": same, "seconds": time.perf_counter() - t0, "compare": r}
                base_t = results[key]["baseline_layer_time_s"] or 0.0
                said = ", ".join(f"{n} {b['ratio_to_baseline']:.3f} [{b['ci95'][0]:.3f}, {b['ci95'][1]:.3f}]"
                                 for n, b in rows.items() if b)
                reach = next((b["bound_reachable_s"] for b in rows.values() if b and b.get("bound_reachable_s")), None)
                rsaid = "" if reach is None else f"; reachable bound {reach * 1e6:.1f} us"
                print(f"{key} on {dep.cluster.spec()}: baseline {results[key]['baseline']} {base_t * 1e6:.1f} us; "
                      f"{said}{rsaid} ({time.perf_counter() - t0:.0f} s)", flush=True)
    for v in results.values():  # the full compare answers are large; keep what the tables need
        v.pop("compare")
    # setting/strategy, as the losses: a setting where two strategies win is listed once per strategy, by name
    decided_wins = [k + "/" + n for k, v in results.items() for n, b in v["strategies"].items()
                    if b and n != "eplb" and b["ci95"][1] < 1.0]
    decided_losses = [k + "/" + n for k, v in results.items() for n, b in v["strategies"].items()
                      if b and b["ci95"][0] > 1.0]
    run.write({"params": {"seeds": args.seeds, "holdout": args.holdout, "prefill_holdout": args.prefill_holdout,
                          "arrival": "mixed (seeded by the split)",
                          "profiles": profiles, "workloads": wanted, "strategies": strategies,
                          "phases": args.phases.split(","), "engine": args.engine, "address": args.address,
                          "min_microbatches": args.min_microbatches, "max_check_requests": args.max_check_requests},
               "results": results, "skipped": skipped,
               "summary": {"settings": len(results), "decided_faster_than_baseline": decided_wins,
                           "decided_slower_than_baseline": decided_losses}}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
