"""Federation of Experts vs MoE quality at equal parameters: held-out loss per domain, FoE H = 2 and H = 4 against
the MoE baseline (H = 1), same corpus, steps and seeds (`moeplace.models.train.train_reference`).

Usage:
  python bench/foe_quality.py [--steps 60] [--seeds 0,1] [--json PATH]

Architecture: the reference model's (8 layers x 32 experts, top-4, hidden 128) with 4 KV heads so that H = 4 has
one KV head per group; everything else equal across H (parameter counts are checked equal). The data settings are
reduced (3,000 training documents per domain, 8,000 math problems, a 400 kB-per-domain tokenizer) so that the six
runs fit a session on 2 cores: THIS IS A SMALL BUDGET, far below the 1,000-step reference model, so the numbers
say how the variants start, not where they end. Baseline: the MoE (H = 1) in the same run.
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np
from common import BenchRun


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--groups", default="1,2,4")
    ap.add_argument("--json")
    args = ap.parse_args()
    run = BenchRun("foe_quality", baseline="the MoE (foe_groups = 1) with the same data, steps and seeds")

    from moeplace.models.reference import preset
    from moeplace.models.train import train_reference

    seeds = [int(s) for s in args.seeds.split(",")]
    groups = [int(h) for h in args.groups.split(",")]
    runs: dict = {}
    for h in groups:
        for seed in seeds:
            cfg = preset("default", num_kv_heads=4, foe_groups=h, steps=args.steps,
                         eval_every=max(args.steps // 3, 1), max_train_docs=3000, math_problems=8000,
                         tokenizer_bytes=400_000, prompts_per_domain=4, sample_tokens=2)
            with tempfile.TemporaryDirectory() as out:
                m = train_reference(cfg, out, seed=seed, progress=False, log=lambda s: None)
            runs[f"H{h}-seed{seed}"] = {"groups": h, "seed": seed, "heldout_ce": m["heldout_ce_saved_weights"],
                                        "parameters": m["parameters"],
                                        "active_parameters": m["active_parameters_per_token"],
                                        "seconds_train": m["seconds_train"]}
            print(f"H={h} seed={seed}: held-out CE "
                  + ", ".join(f"{d} {v:.3f}" for d, v in m["heldout_ce_saved_weights"].items()), flush=True)
    domains = list(next(iter(runs.values()))["heldout_ce"])
    summary: dict = {}
    for h in groups:
        rs = [r for r in runs.values() if r["groups"] == h]
        summary[f"H{h}"] = {d: {"mean": float(np.mean([r["heldout_ce"][d] for r in rs])),
                                "spread": float(np.ptp([r["heldout_ce"][d] for r in rs]))} for d in domains}
        summary[f"H{h}"]["mean_over_domains"] = float(np.mean([summary[f"H{h}"][d]["mean"] for d in domains]))
    params = {r["parameters"] for r in runs.values()}
    run.write({"params": {"steps": args.steps, "seeds": seeds, "groups": groups, "num_kv_heads": 4,
                          "data": "reduced: 3000 train docs/domain, 8000 math problems, 400 kB tokenizer text"},
               "excluded": "nothing: each run builds its corpus and tokenizer (same seeds, same data)",
               "equal_parameters": len(params) == 1, "results": runs, "summary": summary}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
