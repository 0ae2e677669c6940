"""Analysis speed against plain vectorised numpy: routing decisions (token x layer x k) per second of expert load
and co-activation counts.

Measured in one run, on the same in-memory arrays ids [T, L, K]:
  1. moeplace: ``TokenAccumulator`` with only load and co-activation on, fed in chunks of 65,536 tokens;
  2. baseline: what one would write with numpy alone: ``np.bincount`` over ``l * E + e`` for load, ``np.add.at``
     over every ordered pair of router slots for co-activation, on the whole array at once;
and the two outputs are checked equal. For context, the whole ``analyse_trace`` (every statistic, reading a
Parquet trace from disk) is timed too; it has no baseline.

Routing: gpt-oss-20b's recorded decode routing (../shared/data, real) when present, and always a SYNTHETIC
DeepSeek-V3-shaped trace (L=58, E=256, k=8; Zipf-skewed random experts). Times are the best of ``--repeat``.

    python bench/analyse_speed.py [--tokens 32768] [--json PATH]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from common import REPO, BenchRun

from moeplace.analyse import TokenAccumulator, analyse_trace
from moeplace.trace import TraceMeta, TraceWriter

CHUNK = 65536
GPT_OSS = REPO.parent / "shared" / "data" / "gpt-oss-20b" / "decode_routing.npz"


def synthetic_ids(rng: np.random.Generator, T: int, L: int, E: int, K: int) -> np.ndarray:
    """[T, L, K] int16: K distinct experts per token and layer, drawn with Zipf-like popularity (SYNTHETIC)."""
    ids = np.empty((T, L, K), np.int16)
    for lyr in range(L):
        w = 1.0 / np.arange(1, E + 1) ** 0.6
        w = w[rng.permutation(E)]
        g = rng.gumbel(size=(T, E)) + np.log(w)  # Gumbel top-k = sampling without replacement by weight
        ids[:, lyr] = np.argpartition(-g, K, axis=1)[:, :K]
    return ids


def numpy_baseline(ids: np.ndarray, E: int) -> tuple[np.ndarray, np.ndarray]:
    """Load int64 [L, E] and symmetric co-activation int64 [L, E, E] of ids [T, L, K], numpy one-liners."""
    T, L, K = ids.shape
    lyr = np.arange(L)[None, :]
    load = np.bincount((lyr[..., None] * E + ids).ravel(), minlength=L * E).reshape(L, E)
    co = np.zeros((L, E, E), np.int64)
    lt = np.broadcast_to(lyr, (T, L))
    for a in range(K):
        for b in range(K):
            if a != b:
                np.add.at(co, (lt, ids[:, :, a], ids[:, :, b]), 1)
    return load, co


def moeplace_counts(ids: np.ndarray, E: int) -> TokenAccumulator:
    T, L, K = ids.shape
    rid = np.zeros(T, np.int64)
    pos = np.arange(T, dtype=np.int32)
    ph = np.ones(T, np.int8)
    acc = TokenAccumulator(L, E, K, interlayer=False, temporal=False)
    for s in range(0, T, CHUNK):
        sl = slice(s, s + CHUNK)
        acc.update(ids[sl], rid[sl], pos[sl], ph[sl])
    acc.finish()
    return acc


def best_of(fn, repeat: int) -> tuple[float, object]:
    best, out = np.inf, None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def time_full(ids: np.ndarray, label: str) -> float:
    """Seconds for analyse_trace (all statistics, from disk) on ids, written as 64-token requests."""
    T, L, K = ids.shape
    E = int(ids.max()) + 1
    with tempfile.TemporaryDirectory() as tmp:
        meta = TraceMeta(model=label, num_layers=L, num_experts=E, top_k=K, synthetic=True, source="bench")
        rid = np.arange(T) // 64
        with TraceWriter(Path(tmp) / "t", meta) as w:
            w.add_requests(np.unique(rid), domain=np.array(["a", "b", "c"])[np.unique(rid) % 3])
            w.add_tokens(rid, np.arange(T) % 64, (np.arange(T) % 64 >= 16).astype(np.int8), ids)
        t0 = time.perf_counter()
        analyse_trace(Path(tmp) / "t", chunk_tokens=CHUNK)
        return time.perf_counter() - t0


def run(label: str, ids: np.ndarray, E: int, repeat: int) -> dict:
    T, L, K = ids.shape
    n = T * L * K
    fast_s, acc = best_of(lambda: moeplace_counts(ids, E), repeat)
    base_s, (load, co) = best_of(lambda: numpy_baseline(ids, E), repeat)
    equal = bool(np.array_equal(acc.load.sum((0, 1)), load) and np.array_equal(acc.coact, co))
    if not equal:
        raise SystemExit(f"analyse_speed: {label}: moeplace and the numpy baseline disagree")
    full_s = time_full(ids, label)
    row = {"tokens": T, "L": L, "E": E, "K": K, "decisions": n, "moeplace_s": fast_s, "numpy_s": base_s,
           "moeplace_per_s": n / fast_s, "numpy_per_s": n / base_s, "speedup_vs_numpy": base_s / fast_s,
           "outputs_equal": equal, "full_analyse_s": full_s, "full_analyse_per_s": n / full_s}
    print(f"{label}: {T:,} tokens, L={L}, E={E}, k={K}: {n / 1e6:.1f} M decisions\n"
          f"  moeplace   {n / fast_s / 1e6:8.1f} M decisions/s ({fast_s:.3f} s)\n"
          f"  numpy      {n / base_s / 1e6:8.1f} M decisions/s ({base_s:.3f} s)  -> {base_s / fast_s:.1f}x, "
          f"outputs equal\n  analyse_trace (every statistic, from disk) {n / full_s / 1e6:.1f} M decisions/s",
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768, help="synthetic tokens (default 32768)")
    ap.add_argument("--repeat", type=int, default=2, help="best of this many calls (default 2)")
    ap.add_argument("--json", help="write here instead of bench/results/analyse_speed.json")
    args = ap.parse_args()
    bench = BenchRun("analyse_speed", baseline="numpy: np.bincount (load) and np.add.at (co-activation)")
    results = {}
    if GPT_OSS.exists():
        ids = np.load(GPT_OSS, allow_pickle=False)["expert_ids"].astype(np.int16)
        results["gpt-oss-20b"] = run("gpt-oss-20b decode routing (real, ../shared/data)", ids, 32, args.repeat)
    else:
        print(f"(gpt-oss data not found at {GPT_OSS}; real-data run skipped)")
    ids = synthetic_ids(np.random.default_rng(0), args.tokens, 58, 256, 8)
    results["deepseek-v3-synthetic"] = run("SYNTHETIC DeepSeek-V3 shape", ids, 256, args.repeat)
    bench.write({"params": {k: v for k, v in vars(args).items() if k != "json"}, "chunk_tokens": CHUNK,
                 "excluded": "building the arrays; for analyse_trace, writing the trace (reading it is timed)",
                 "results": results}, args.json)


if __name__ == "__main__":
    main()
