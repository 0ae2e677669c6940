"""Rebalancer policies of ``moeplace operate`` on drifting streams: total time (predicted MoE layer time plus
migration time), migration bytes and balancedness, each policy's total time as a ratio to doing nothing (static),
to SGLang's periodic EPLB and to the strongest EPLB policy, with paired 95% intervals.

Usage:
  python bench/operate_policies.py [--streams reference-table,reference-drift,fg-drift,fg-schedule,gpt-oss-dataset]
                                   [--seeds 5] [--json PATH]

Protocol. Every policy replays the same windows of the same stream (paired). A stream built from a seed (the
drifts and the schedule) is replayed for ``--seeds`` stream seeds (0..N-1); a fixed order (table, dataset) once.
Per window, its time is the window's predicted layer time plus the transfer time of a migration decided at its end,
so the windows' times add up to the total. A ratio is sum(policy) / sum(baseline) over every window of every seed,
with a two-level paired bootstrap interval (stream seeds, then windows inside each seed; the same windows for both;
``moeplace.evaluate.intervals.paired_ratio_ci``). Windows follow one another (a policy's state carries over), so
the window level treats them as exchangeable: the seed level carries the rest. The strongest EPLB policy of a
stream is the one among static EPLB, periodic (with and without slot preservation) and threshold EPLB with the
lowest total time over all seeds, chosen on the stream itself (which favours it). Absolute times, bytes and
balancedness are medians over seeds with their range.

Streams (each labelled in the result by what it is):
- ``reference-table``: the bundled reference-model trace (1,000 requests, 4 domains) in request-table order, which
  is sorted by domain: a drift code -> chat -> general -> math.
- ``reference-drift``: a seeded drift built from it (``moeplace.operate.streams.drift_stream``, seed 0): one phase
  per domain, 2,000 requests each, 70% of a phase from its domain and 10% from each other one.
- ``fg-drift``: the same seeded drift built from the fine-grained reference model's trace (``reference-fg.trace``,
  4,136 held-out requests, 64 experts in 8 groups, top-6).
- ``fg-schedule``: the fine-grained trace re-ordered by a ``moeplace.operate.workloads`` schedule over its sub-domains
  (``FG_SCHEDULE``, seed 0): a C/C++-heavy hour, then a chat-heavy hour, then a math-heavy hour, on a daily cycle
  that moves Python code against prose, with a burst of Cython; 6,000 arrivals at 2,000 an hour.
- ``gpt-oss-dataset``: the shared gpt-oss-20b decode routing (``../shared/data/gpt-oss-20b``, imported with
  ``moeplace trace import --format gpt-oss-npz`` into out/cache/), ordered by dataset; skipped when absent.

The reference model is small (hidden 128); its routing is priced with gpt-oss-20b's sizes (same E=32, top-4):
hidden 2880, expert 3 x 2880 x 2880 bf16 parameters = 49.8 MB. The fine-grained model's routing is priced with
Instella-MoE-16B-A3B's (same E=64, top-6, 2 shared): hidden 2048, expert 3 x 2048 x 1408 bf16 = 17.3 MB.
Cluster: 4 nodes of h200-8 (32 GPUs), 32 redundant slots, windows of 64 requests, decode batch 64, counters sampled
1-in-16.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common import BenchRun, paired_ci, seed_spread

from moeplace.deploy import parse_cluster
from moeplace.operate import SGLANG_REBALANCE_STEPS, OperateConfig, operate
from moeplace.operate.policies import POLICIES as REGISTERED_POLICIES
from moeplace.operate.service import open_stream
from moeplace.operate.workloads import Burst, DailyCycle, MixSchedule, Phase
from moeplace.simulate import BatchConfig

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "src" / "moeplace" / "data" / "reference-default.trace"
FINE_GRAINED = REPO / "src" / "moeplace" / "data" / "reference-fg.trace"
FG_RATE = 2000  # arrivals an hour


def fg_schedule(keys: list[str]) -> MixSchedule:
    """Phases, a daily cycle and a burst over the fine-grained trace's sub-domain labels ``keys`` (``code/c``,
    ``chat/greetings``, ...): each phase gives 60% of the arrivals to its boosted labels (evenly) and 40% to the
    others (evenly)."""

    def mix(boost: list[str]) -> dict[str, float]:
        rest = [k for k in keys if k not in boost]
        return {**{k: 0.6 / len(boost) for k in boost}, **{k: 0.4 / len(rest) for k in rest}}

    def of(domain: str) -> list[str]:
        return [k for k in keys if k.startswith(domain + "/")]

    return MixSchedule(
        phases=(Phase(FG_RATE, mix(["code/c", "code/cpp"])), Phase(FG_RATE, mix(of("chat"))),
                Phase(FG_RATE, mix(of("math")))),
        cycle=DailyCycle.from_hours(24, FG_RATE, {"code/python": 0.8, "general/fortunes": 0.8},
                                    {"general/fortunes": 0.5}),
        bursts=(Burst(FG_RATE // 2, FG_RATE // 8, "code/cython", 0.5),))

SHARED = REPO.parent / "shared" / "data" / "gpt-oss-20b"
POLICIES = tuple(REGISTERED_POLICIES)  # every registered policy, in registry order (a new one is benchmarked too)
EPLB_POLICIES = tuple(p for p in ("static-eplb", "periodic", "periodic-preserve", "threshold") if p in POLICIES)
WINDOW = 64
ROW_KEYS = ("total_time_s", "layer_time_s", "migration_time_s", "migration_bytes", "mean_balancedness", "rebalances",
            "slot_changes")


def gpt_oss_trace() -> Path | None:
    out = REPO / "out" / "cache" / "gpt-oss-20b.trace"  # out/ is git-ignored
    if (out / "meta.json").exists():
        return out
    if not SHARED.exists():
        return None
    from moeplace.trace.importers import import_trace

    out.parent.mkdir(parents=True, exist_ok=True)
    import_trace("gpt-oss-npz", SHARED, out, overwrite=True, weights=False)
    return out


def streams(names: list[str], seeds: int) -> dict[str, tuple[Path, str, list[dict]]]:
    """name -> (trace, order, open_stream keywords per stream seed: ``seeds`` of them for a seeded stream, one for
    a fixed order)."""
    out: dict[str, tuple[Path, str, list[dict]]] = {}
    for n in names:
        if n == "reference-table":
            out[n] = (REFERENCE, "table", [{}])
        elif n == "reference-drift":
            out[n] = (REFERENCE, "drift", [{"seed": s, "drift_requests": 2000} for s in range(seeds)])
        elif n == "fg-drift":
            out[n] = (FINE_GRAINED, "drift", [{"seed": s, "drift_requests": 2000} for s in range(seeds)])
        elif n == "fg-schedule":
            from moeplace.operate.workloads import keys_of
            from moeplace.trace import read_trace

            keys = sorted(set(keys_of(read_trace(FINE_GRAINED).requests, "subdomain").tolist()))
            out[n] = (FINE_GRAINED, "schedule", [{"seed": s, "schedule": fg_schedule(keys),
                                                  "stream_requests": 3 * FG_RATE, "stream_key": "subdomain"}
                                                 for s in range(seeds)])
        elif n == "gpt-oss-dataset":
            t = gpt_oss_trace()
            if t is None:
                print(f"skipping {n}: {SHARED} is absent")
                continue
            out[n] = (t, "dataset", [{}])
        else:
            sys.exit(f"unknown stream {n!r}")
    return out


def window_times(res) -> tuple[list[float], list[float]]:
    """Per window of an operate result: (seconds: layer time + the migration decided at its end, migration bytes).
    They add up to the result's total time and migration bytes."""
    t = [w.layer_time_s + (w.migration["seconds"] if w.migration else 0.0) for w in res.windows]
    b = [float(w.migration["bytes"]) if w.migration else 0.0 for w in res.windows]
    return t, b


def summarize_stream(per_seed: list[dict[str, dict]]) -> dict:
    """Policies, ratios and verdict of one stream from its seeds' rows (policy -> row with ``window_s`` and
    ``window_bytes``, float [windows])."""
    pols = list(per_seed[0])
    total = {p: sum(r[p]["total_time_s"] for r in per_seed) for p in pols}
    strongest = min(EPLB_POLICIES, key=total.get)  # a tie goes to the first in registry order
    rows: dict[str, dict] = {}
    for p in pols:
        spread = {k: seed_spread([r[p][k] for r in per_seed]) for k in ROW_KEYS}
        # medians at the row's top level; their range and every seed's value under "seeds"
        rows[p] = {**{k: v["median"] for k, v in spread.items()}, "seeds": spread,
                   "wall_s": sum(r[p]["wall_s"] for r in per_seed)}

    def ratio(p: str, base: str, key: str = "window_s") -> dict | None:
        c = paired_ci([r[p][key] for r in per_seed], [r[base][key] for r in per_seed])
        if c is not None:
            c["windows"] = c.pop("microbatches")  # the resampled unit here is the window
        return c

    ratios = {p: {"vs_static": ratio(p, "static"), "vs_periodic": ratio(p, "periodic"),
                  "vs_strongest_eplb": ratio(p, strongest)} for p in pols}
    low = min(total.values())
    best = [p for p in pols if total[p] <= low * (1 + 1e-12)]
    m = ratios["moeplace"]
    others = {p: ratio("moeplace", p) for p in pols if p != "moeplace"}
    bytes_vs_periodic = ratio("moeplace", "periodic", "window_bytes")
    verdict = {
        "lowest_total_time": best, "moeplace_lowest": "moeplace" in best,
        # lower than every other policy beyond the resampling noise (each interval's upper end below 1)
        "moeplace_decided_lowest": all(c is not None and c["ci95"][1] < 1.0 for c in others.values()),
        "moeplace_vs_others": others,
        "moeplace_vs_periodic_bytes": bytes_vs_periodic["ratio"] if bytes_vs_periodic else None,
        "moeplace_vs_periodic_bytes_ci": bytes_vs_periodic,
        "moeplace_balancedness_ge_periodic": rows["moeplace"]["mean_balancedness"]
        >= rows["periodic"]["mean_balancedness"],
        "moeplace_vs_strongest_eplb": m["vs_strongest_eplb"]}
    # the target: at most half of periodic EPLB's bytes at equal or better balancedness; decided: the interval's
    # upper end too
    verdict["bytes_target_met"] = (bytes_vs_periodic is not None and bytes_vs_periodic["ratio"] <= 0.5
                                   and verdict["moeplace_balancedness_ge_periodic"])
    verdict["bytes_target_decided"] = verdict["bytes_target_met"] and bytes_vs_periodic["ci95"][1] <= 0.5
    return {"strongest_eplb": strongest, "policies": rows, "ratios": ratios, "verdict": verdict}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="reference-table,reference-drift,fg-drift,fg-schedule,gpt-oss-dataset")
    ap.add_argument("--seeds", type=int, default=5, help="stream seeds of the seeded streams (default: 5)")
    ap.add_argument("--json", help="write here instead of bench/results/operate_policies.json")
    args = ap.parse_args()
    run = BenchRun("operate_policies", baseline="static (the linear placement, never moved); periodic EPLB every "
                   f"{SGLANG_REBALANCE_STEPS} steps (SGLang's default); the strongest EPLB policy of each stream "
                   "(static, periodic with and without vLLM's slot preservation, threshold), chosen on the stream")
    cluster = parse_cluster("4", "h200-8")
    results: dict = {}
    for name, (trace, order, kws) in streams(args.streams.split(","), args.seeds).items():
        preset = "instella-moe-16b-a3b" if trace == FINE_GRAINED else "gpt-oss-20b"
        cfg = OperateConfig(cluster, num_redundant=32, window_requests=WINDOW, sample_every=16,
                            model_preset=preset, batching=BatchConfig(decode_batch=WINDOW))
        per_seed: list[dict] = []
        label, steps = "", []
        for kw in kws:
            rows: dict = {}
            for pol in POLICIES:
                t0 = time.perf_counter()
                res = operate(open_stream(trace, WINDOW, order, **kw), cfg, pol)
                j = res.to_json(history=False)
                label = res.stream
                rows[pol] = {k: j[k] for k in ROW_KEYS if k in j}
                rows[pol]["slot_changes"] = sum(w.migration["moves"] for w in res.windows if w.migration)
                rows[pol]["window_s"], rows[pol]["window_bytes"] = window_times(res)
                rows[pol]["windows"] = [(w.window, w.tokens) for w in res.windows]
                rows[pol]["wall_s"] = time.perf_counter() - t0
                r = rows[pol]
                print(f"{name:16s} seed {kw.get('seed', '-')} {pol:18s} total {r['total_time_s']:.4f} s  layers "
                      f"{r['layer_time_s']:.4f}  migration {r['migration_time_s']:.4f} s  "
                      f"{r['migration_bytes'] / 1e9:8.2f} GB  bal {r['mean_balancedness']:.4f}  rebalances "
                      f"{r['rebalances']:3d}  slot changes {r['slot_changes']:5d}  ({r['wall_s']:.1f} s)", flush=True)
            first = rows[POLICIES[0]]["windows"]
            if any(r["windows"] != first for r in rows.values()):  # the pairing needs the same windows
                sys.exit(f"{name}: policies saw different windows")
            for r in rows.values():
                del r["windows"]
            steps.append(res.windows[-1].steps if res.windows else 0)
            per_seed.append(rows)
        out = summarize_stream(per_seed)
        results[name] = {"label": label, "stream_seeds": [kw.get("seed") for kw in kws], "steps": steps[0],
                         "steps_per_seed": steps, "windows_per_seed": [len(r["static"]["window_s"]) for r in per_seed],
                         **out}
        v = out["verdict"]
        said = ", ".join(f"{p} {c['ratio']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}]"
                         for p, c in v["moeplace_vs_others"].items() if c)
        print(f"{name}: strongest EPLB {out['strongest_eplb']}; moeplace total time vs {said}; lowest "
              f"{v['lowest_total_time']}", flush=True)
    run.write({"params": {"cluster": "4 x h200-8 (32 GPUs)", "num_redundant": 32, "window_requests": WINDOW,
                          "decode_batch": WINDOW, "sample_every": 16, "capacity_factor": None,
                          "model_preset": "gpt-oss-20b (sizes for the time model and expert bytes); "
                                          "instella-moe-16b-a3b for the fine-grained streams",
                          "weight_bytes": 2.0, "periodic_steps": SGLANG_REBALANCE_STEPS, "threshold": 0.5,
                          "moeplace": {"horizon_steps": SGLANG_REBALANCE_STEPS, "margin": 2.0,
                                       "chunk_layers": "L // 4"},
                          "seeds": args.seeds, "eplb_policies": list(EPLB_POLICIES),
                          "interval": "paired two-level bootstrap over stream seeds and windows, 95%, 2,000 "
                                      "replicates (moeplace.evaluate.intervals); one level for a fixed order"},
               "excluded": "wall_s is the replay's own time (simulation of every window and of moeplace's "
                           "candidates), not part of the predicted times",
               "results": results}, args.json)


if __name__ == "__main__":
    main()
