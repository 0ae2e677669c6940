"""How fast the analysis runs: routing decisions (token x layer x k) analysed per second.

Measures, in one run on this machine:
  1. the vectorised load + co-activation accumulation (``TokenAccumulator`` with only those two statistics on),
     fed in chunks of 65,536 tokens from memory;
  2. the same two statistics with a plain per-token Python loop (``moeplace.analyse.reference``) on a slice;
  3. the whole ``analyse_trace`` (every statistic, reading the Parquet trace from disk), for context.

Routing: gpt-oss-20b's recorded decode routing (../shared/data, real) when present, and always a SYNTHETIC
DeepSeek-V3-shaped trace (L=58, E=256, k=8; Zipf-skewed random experts).

    python bench/analyse_speed.py [--tokens 131072] [--loop-tokens 1500]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from moeplace.analyse import TokenAccumulator, analyse_trace
from moeplace.analyse.reference import load_coactivation_loop
from moeplace.trace import TraceMeta, TraceWriter

TARGET = 20e6  # decisions per second
CHUNK = 65536
GPT_OSS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gpt-oss-20b" / "decode_routing.npz"


def synthetic_ids(rng: np.random.Generator, T: int, L: int, E: int, K: int) -> np.ndarray:
    """[T, L, K] int16: K distinct experts per token and layer, drawn with Zipf-like popularity (SYNTHETIC)."""
    ids = np.empty((T, L, K), np.int16)
    for lyr in range(L):
        w = 1.0 / np.arange(1, E + 1) ** 0.6
        w = w[rng.permutation(E)]
        g = rng.gumbel(size=(T, E)) + np.log(w)  # Gumbel top-k = sampling without replacement by weight
        ids[:, lyr] = np.argpartition(-g, K, axis=1)[:, :K]
    return ids


def time_accumulate(ids: np.ndarray, E: int, repeat: int = 3) -> tuple[float, float]:
    """Best-of-``repeat`` (wall, CPU) seconds to accumulate load + co-activation of ids [T, L, K] in chunks."""
    T, L, K = ids.shape
    rid = np.zeros(T, np.int64)
    pos = np.arange(T, dtype=np.int32)
    ph = np.ones(T, np.int8)
    best, best_cpu = np.inf, np.inf
    for _ in range(repeat):
        acc = TokenAccumulator(L, E, K, interlayer=False, temporal=False)
        t0, c0 = time.perf_counter(), time.process_time()
        for s in range(0, T, CHUNK):
            sl = slice(s, s + CHUNK)
            acc.update(ids[sl], rid[sl], pos[sl], ph[sl])
        acc.finish()
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    load_ref, co_ref = load_coactivation_loop(ids[:200], E)  # the two paths agree
    acc = TokenAccumulator(L, E, K, interlayer=False, temporal=False)
    acc.update(ids[:200], rid[:200], pos[:200], ph[:200])
    acc.finish()
    assert np.array_equal(acc.load.sum((0, 1)), load_ref) and np.array_equal(acc.coact, co_ref)
    return best, best_cpu


def time_loop(ids: np.ndarray, E: int) -> float:
    t0 = time.perf_counter()
    load_coactivation_loop(ids, E)
    return time.perf_counter() - t0


def time_full(ids: np.ndarray, E: int, label: str) -> tuple[float, float]:
    """Seconds for analyse_trace (all statistics, from disk) on ids, written as 64-token requests."""
    T, L, K = ids.shape
    with tempfile.TemporaryDirectory() as tmp:
        meta = TraceMeta(model=label, num_layers=L, num_experts=E, top_k=K, synthetic=True, source="bench")
        rid = np.arange(T) // 64
        with TraceWriter(Path(tmp) / "t", meta) as w:
            w.add_requests(np.unique(rid), domain=np.array(["a", "b", "c"])[np.unique(rid) % 3])
            w.add_tokens(rid, np.arange(T) % 64, (np.arange(T) % 64 >= 16).astype(np.int8), ids)
        t0 = time.perf_counter()
        analyse_trace(Path(tmp) / "t", chunk_tokens=CHUNK)
        return time.perf_counter() - t0, T * L * K


def run(label: str, ids: np.ndarray, E: int, loop_tokens: int) -> dict:
    T, L, K = ids.shape
    n = T * L * K
    sec, cpu = time_accumulate(ids, E)
    lsec = time_loop(ids[:loop_tokens], E)
    ln = loop_tokens * L * K
    vec, loop = n / sec, ln / lsec
    print(f"\n{label}: T={T:,} tokens, L={L}, E={E}, k={K} -> {n / 1e6:.1f} M decisions")
    print(f"  load + co-activation, vectorised : {vec / 1e6:8.1f} M decisions/s wall ({sec:.2f} s), "
          f"{n / cpu / 1e6:.1f} M/s per CPU-second; {'meets' if vec >= TARGET else 'BELOW'} the "
          f"{TARGET / 1e6:.0f} M/s target")
    print(f"  load + co-activation, Python loop: {loop / 1e6:8.3f} M decisions/s  ({loop_tokens:,} tokens, "
          f"{lsec:.2f} s)")
    print(f"  speed-up over the loop           : {vec / loop:8.0f} x")
    fsec, fn = time_full(ids, E, label)
    print(f"  analyse_trace, every statistic, from disk: {fn / fsec / 1e6:.1f} M decisions/s ({fsec:.2f} s)")
    return {"label": label, "decisions": n, "vectorised_per_s": vec, "per_cpu_second": n / cpu,
            "loop_per_s": loop, "speedup": vec / loop, "full_analyse_per_s": fn / fsec}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072, help="synthetic tokens (default 131072)")
    ap.add_argument("--loop-tokens", type=int, default=1500, help="tokens for the Python loop (default 1500)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    results = []
    print(f"analyse_speed: {os.cpu_count()} CPU cores visible; numpy {np.__version__}; chunks of {CHUNK} tokens")
    if GPT_OSS.exists():
        ids = np.load(GPT_OSS, allow_pickle=False)["expert_ids"].astype(np.int16)
        results.append(run("gpt-oss-20b decode routing (real, ../shared/data)", ids, 32, args.loop_tokens))
    else:
        print(f"\n(gpt-oss data not found at {GPT_OSS}; real-data run skipped)")
    ids = synthetic_ids(np.random.default_rng(0), args.tokens, 58, 256, 8)
    results.append(run("SYNTHETIC DeepSeek-V3 shape", ids, 256, max(1, args.loop_tokens // 4)))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"target_per_s": TARGET, "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
