"""Federation of Experts vs MoE quality at equal parameters: held-out loss per domain, FoE H = 2 and H = 4 against
the MoE baseline (H = 1), same corpus, steps and seeds (`moeplace.models.train.train_reference`).

Usage:
  python bench/foe_quality.py [--steps 1000] [--seeds 0,1] [--groups 1,2,4] [--jobs 2] [--keep DIR] [--json PATH]

Architecture: the reference model's (8 layers x 32 experts, top-4, hidden 128) with 4 KV heads so that H = 4 has
one KV head per group; everything else equal across H (parameter counts are checked equal). Data and budget: the
shipped reference model's (its full corpus, tokenizer and 1,000 steps) unless --steps / --reduced say otherwise.
Baseline: the MoE (H = 1) trained in the same run.

Each (H, seed) run is a worker process (`--jobs` at a time, `threads` torch threads each, so two single-thread runs
use the 2 cores of the dev machine); a finished run's folder under --keep (model, train_metrics.json) is reused on
a rerun, so a killed bench loses only the runs in flight. The H = 2 seed-0 model is the one whose routing ships as
src/moeplace/data/reference-foe.trace.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
from common import RESULTS, BenchRun

REDUCED = {"max_train_docs": 3000, "math_problems": 8000, "tokenizer_bytes": 400_000}


def config(h: int, steps: int, threads: int, reduced: bool):
    from moeplace.models.reference import preset

    extra = dict(REDUCED) if reduced else {}
    return preset("default", num_kv_heads=4, foe_groups=h, steps=steps, eval_every=max(steps // 10, 1),
                  threads=threads, prompts_per_domain=4 if reduced else 250, sample_tokens=8, **extra)


def one_run(args: tuple) -> tuple[str, str]:
    """Train one (H, seed) into ``keep/H{h}-seed{seed}`` (skipped when its metrics exist). -> (key, folder)."""
    h, seed, steps, threads, reduced, keep = args
    from moeplace.models.reference import METRICS_FILE
    from moeplace.models.train import train_reference

    key = f"H{h}-seed{seed}"
    out = Path(keep) / key
    if not (out / METRICS_FILE).is_file():
        tmp = Path(keep) / f".{key}.partial"
        train_reference(config(h, steps, threads, reduced), tmp, seed=seed, progress=False,
                        log=lambda s, key=key: print(f"[{key}] {s}", flush=True))
        os.replace(tmp, out)
    return key, str(out)


def plot(summary: dict, groups: list[int], domains: list[str], steps: int, dest: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dx) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=120, gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(groups)
    x = np.arange(len(domains) + 1)
    labels = domains + ["mean"]
    for i, h in enumerate(groups):
        s = summary[f"H{h}"]
        mean = [s[d]["mean"] for d in domains] + [s["mean_over_domains"]]
        lo = [s[d]["mean"] - s[d]["min"] for d in domains] + [0.0]
        hi = [s[d]["max"] - s[d]["mean"] for d in domains] + [0.0]
        ax.bar(x + (i - (len(groups) - 1) / 2) * width, mean, width, yerr=[lo, hi], capsize=3,
               label="MoE (H = 1)" if h == 1 else f"FoE H = {h}")
    ax.set_xticks(x, labels)
    ax.set_ylabel("held-out cross-entropy (nats/token)")
    ax.set_title(f"held-out loss, {steps} steps, 2 seeds (bars: min..max)", fontsize=9)
    ax.legend(fontsize=8)
    foe = [h for h in groups if h != 1]
    if "H1" in summary and foe:  # the differences the left panel cannot show at its scale
        w2 = 0.8 / len(foe)
        xd = np.arange(len(domains))
        base = summary["H1"]
        for i, h in enumerate(foe):
            s = summary[f"H{h}"]
            diff = np.array([s[d]["mean"] - base[d]["mean"] for d in domains])
            lo = diff - np.array([s[d]["min"] - base[d]["max"] for d in domains])  # widest gap over seed pairs
            hi = np.array([s[d]["max"] - base[d]["min"] for d in domains]) - diff
            dx.bar(xd + (i - (len(foe) - 1) / 2) * w2, diff, w2, yerr=[lo, hi], capsize=3, label=f"FoE H = {h}",
                   color=f"C{groups.index(h)}")
        dx.axhline(0, color="k", lw=0.8)
        dx.set_xticks(xd, domains)
        dx.set_ylabel("FoE - MoE (nats/token; < 0: FoE better)")
        dx.set_title("difference to the MoE (bars: min..max over seed pairs)", fontsize=9)
        dx.legend(fontsize=8)
    fig.tight_layout()
    tmp = dest.with_name(f".{dest.name}.tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, dest)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--groups", default="1,2,4")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--reduced", action="store_true", help="the reduced data of the first small-budget run")
    ap.add_argument("--keep", default="build/foe-runs", help="folder of the trained runs (reused)")
    ap.add_argument("--json")
    args = ap.parse_args()
    run = BenchRun("foe_quality", baseline="the MoE (foe_groups = 1) with the same data, steps and seeds")

    seeds = [int(s) for s in args.seeds.split(",")]
    groups = [int(h) for h in args.groups.split(",")]
    keep = Path(args.keep)
    keep.mkdir(parents=True, exist_ok=True)
    jobs = [(h, s, args.steps, args.threads, args.reduced, str(keep)) for s in seeds for h in groups]
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        folders = dict(pool.imap_unordered(one_run, jobs))

    runs: dict = {}
    for h in groups:
        for seed in seeds:
            key = f"H{h}-seed{seed}"
            m = json.loads((Path(folders[key]) / "train_metrics.json").read_text())
            if m["steps"] != args.steps or m["config"]["foe_groups"] != h:
                raise SystemExit(f"{folders[key]}: kept run has steps={m['steps']}, foe_groups="
                                 f"{m['config']['foe_groups']}; remove it or choose another --keep")
            runs[key] = {"groups": h, "seed": seed, "heldout_ce": m["heldout_ce_saved_weights"],
                         "parameters": m["parameters"], "active_parameters": m["active_parameters_per_token"],
                         "seconds_train": m["seconds_train"], "threads": m["threads"],
                         "eval_history": m["history"]["eval"]}
            print(f"H={h} seed={seed}: held-out CE "
                  + ", ".join(f"{d} {v:.3f}" for d, v in m["heldout_ce_saved_weights"].items()), flush=True)
    domains = list(next(iter(runs.values()))["heldout_ce"])
    summary: dict = {}
    for h in groups:
        rs = [r for r in runs.values() if r["groups"] == h]
        vals = {d: [r["heldout_ce"][d] for r in rs] for d in domains}
        summary[f"H{h}"] = {d: {"mean": float(np.mean(v)), "min": float(np.min(v)), "max": float(np.max(v)),
                                "spread": float(np.ptp(v))} for d, v in vals.items()}
        summary[f"H{h}"]["mean_over_domains"] = float(np.mean([summary[f"H{h}"][d]["mean"] for d in domains]))
        if h != 1 and "H1" in summary:
            summary[f"H{h}"]["minus_moe"] = {d: summary[f"H{h}"][d]["mean"] - summary["H1"][d]["mean"]
                                             for d in domains}
    params = {r["parameters"] for r in runs.values()}
    active = {r["active_parameters"] for r in runs.values()}
    png = RESULTS / "foe_quality.png"
    plot(summary, groups, domains, args.steps, png)
    data = "reduced: 3000 train docs/domain, 8000 math problems, 400 kB tokenizer text" if args.reduced else \
        "the shipped reference model's corpus and tokenizer settings"
    run.write({"params": {"steps": args.steps, "seeds": seeds, "groups": groups, "num_kv_heads": 4,
                          "threads_per_run": args.threads, "parallel_runs": args.jobs, "data": data},
               "excluded": "nothing: each run builds its corpus and tokenizer (same seeds, same data)",
               "equal_parameters": len(params) == 1 and len(active) == 1, "results": runs, "summary": summary,
               "plot": str(png.relative_to(RESULTS.parents[1]))}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
