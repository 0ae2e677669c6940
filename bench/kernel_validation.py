"""The kernel time model against DeepEP's published H800 measurements (bench/results/deepep_published.json).

For every published row, ``moeplace.simulate.kernel_bench.predict_kernel`` prices the same setting (DeepSeek-V3 shape,
h800-8 preset, the benchmark's routing and token count) and the error is predicted / published - 1 on time. DeepEP
publishes the normal kernels as bandwidth only; their time is the benchmark's byte count (counted the same way,
on the same routing: ``kernel_bench.benchmark_bytes``) over the published bandwidth. Three constants of the model were
fitted on one row each (``fitted``); every other row is a check.

    python bench/kernel_validation.py          # writes bench/results/kernel_validation.json (about 30 s)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, BenchRun  # noqa: E402

from moeplace.simulate import kernel_bench, kernels  # noqa: E402

FITTED = {  # (kernel, ep, part) -> the constant fitted on that row
    ("deepep-normal", 8, "dispatch"): "DEEPEP_NVLINK_EFF",
    ("deepep-normal", 32, "dispatch"): "DEEPEP_RDMA_EFF",
    ("deepep-ll", 32, "dispatch"): "DEEPEP_LL_ALPHA",
}


def compare(published: dict, seed: int) -> list[dict]:
    out = []
    for kernel, key in (("deepep-normal", "normal"), ("deepep-ll", "low_latency")):
        pub = published[key]
        eps = [r["ep"] for r in pub["rows"]]
        pred = {r["ep"]: r for r in kernel_bench.predict_kernel("deepseek-v3", "h800-8", eps, kernel,
                                                                pub["tokens_per_rank"], seed=seed)}
        for r in pub["rows"]:
            p = pred[r["ep"]]
            row = {"kernel": kernel, "ep": r["ep"]}
            for part in ("dispatch", "combine"):
                pub_us = r.get(f"{part}_us") or p[f"{part}_bytes"] / (r[f"{part}_gbps"] * 1e9) * 1e6
                row[part] = {"predicted_us": p[f"{part}_us"], "published_us": pub_us,
                             "published_from": "latency" if f"{part}_us" in r else "bandwidth",
                             "predicted_gbps": p[f"{part}_gbps"], "published_gbps": r[f"{part}_gbps"],
                             "bytes_per_rank": p[f"{part}_bytes"], "error": p[f"{part}_us"] / pub_us - 1,
                             "fitted": FITTED.get((kernel, r["ep"], part))}
            out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write here instead of bench/results/kernel_validation.json")
    args = ap.parse_args()
    run = BenchRun("kernel_validation", baseline="DeepEP's published H800 numbers (bench/results/"
                   "deepep_published.json)")
    published = json.loads((RESULTS / "deepep_published.json").read_text())
    rows = compare(published, args.seed)
    errs = [abs(r[p]["error"]) for r in rows for p in ("dispatch", "combine")]
    checked = [abs(r[p]["error"]) for r in rows for p in ("dispatch", "combine") if not r[p]["fitted"]]
    for r in rows:
        print(f"{r['kernel']:14s} EP{r['ep']:<4d} dispatch {r['dispatch']['predicted_us']:8.1f} us vs "
              f"{r['dispatch']['published_us']:8.1f} ({r['dispatch']['error']:+.0%})   combine "
              f"{r['combine']['predicted_us']:8.1f} us vs {r['combine']['published_us']:8.1f} "
              f"({r['combine']['error']:+.0%})")
    run.write({"params": {"model": "deepseek-v3", "cluster_preset": "h800-8", "seed": args.seed,
                          "constants": {"DEEPEP_NVLINK_EFF": kernels.DEEPEP_NVLINK_EFF,
                                        "DEEPEP_RDMA_EFF": kernels.DEEPEP_RDMA_EFF,
                                        "DEEPEP_LL_ALPHA_us": kernels.DEEPEP_LL_ALPHA * 1e6}},
               "source": published["source"],
               "excluded": "nothing is timed: predictions of the model, compared with published measurements",
               "results": {"rows": rows, "max_abs_error": max(errs), "max_abs_error_checked": max(checked),
                           "within_25pct": sum(e <= 0.25 for e in errs), "num_compared": len(errs)}},
              args.json)


if __name__ == "__main__":
    main()
