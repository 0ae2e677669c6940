"""Simulator speed: token-layer routings simulated per second, vectorised path vs the per-token reference loop.

A token-layer routing is one token's K experts in one MoE layer (dedup, replica choice, bytes, load). The workload is
uniform random routing with a DeepSeek-V3 shape (L=58, E=256, K=8) on 4 nodes x 8 GPUs with 32 redundant experts
(synthetic, in memory). The reference runs on a slice in the same process.

    python bench/simulate_speed.py --tokens 65536 --json out/simulate_speed.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from moeplace.placement import Cluster, Placement, Plan
from moeplace.simulate import RULES, BatchConfig, simulate, simulate_reference
from moeplace.trace.store import Requests, TokenChunk, Trace, TraceMeta


def random_trace(n_tokens: int, L: int, E: int, K: int, prompt: int, gen: int, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    per = prompt + gen
    n_req = max(1, n_tokens // per)
    rid = np.repeat(np.arange(n_req, dtype=np.int64), per)
    pos = np.tile(np.arange(per, dtype=np.int32), n_req)
    phase = (pos >= prompt).astype(np.int8)
    ids = np.empty((len(rid), L, K), np.int16)
    for s in range(0, len(rid), 4096):  # K distinct experts per token-layer: top-K of random keys
        keys = rng.random((min(4096, len(rid) - s), L, E), dtype=np.float32)
        ids[s:s + 4096] = np.argpartition(keys, K, axis=-1)[..., :K]
    meta = TraceMeta(model="synthetic-uniform", num_layers=L, num_experts=E, top_k=K, hidden_size=7168,
                     synthetic=True, source="bench/simulate_speed.py (uniform random routing)")
    req = Requests(np.arange(n_req, dtype=np.int64), np.array(["synthetic"] * n_req, object),
                   np.array([""] * n_req, object), np.full(n_req, prompt, np.int32), np.full(n_req, gen, np.int32))
    return Trace(meta, req, TokenChunk(rid, pos, phase, ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=65536, help="tokens for the vectorised run")
    ap.add_argument("--ref-tokens", type=int, default=48, help="tokens for the reference loop")
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--cluster", default="4x8")
    ap.add_argument("--redundant", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=384)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    L, E, K = args.layers, args.experts, args.top_k
    cluster = Cluster.parse(args.cluster)
    plan = Plan(Placement.linear(L, E, cluster.world_size, args.redundant), cluster)
    batching = BatchConfig(decode_batch=64, prefill_tokens=8192)
    t0 = time.perf_counter()
    tr = random_trace(args.tokens, L, E, K, args.prompt, args.gen)
    gen_s = time.perf_counter() - t0
    T = len(tr.tokens)
    small = Trace(tr.meta, tr.requests, tr.tokens.select(slice(0, args.ref_tokens)))
    rows = []
    for rule in RULES:
        t0 = time.perf_counter()
        simulate(tr, plan, batching=batching, rule=rule)
        fast_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        simulate_reference(small, plan, batching=batching, rule=rule)
        ref_s = time.perf_counter() - t0
        fast_rate = T * L / fast_s
        ref_rate = len(small.tokens) * L / ref_s
        rows.append({"rule": rule, "tokens": T, "token_layers": T * L, "fast_seconds": fast_s,
                     "fast_token_layers_per_s": fast_rate, "reference_tokens": len(small.tokens),
                     "reference_seconds": ref_s, "reference_token_layers_per_s": ref_rate,
                     "speedup": fast_rate / ref_rate})
        print(f"{rule:22s} vectorised {fast_rate / 1e6:7.2f} M token-layers/s ({T:,} tokens x {L} layers in "
              f"{fast_s:.2f} s)   reference loop {ref_rate / 1e3:7.2f} k/s   speedup {fast_rate / ref_rate:,.0f}x")
    out = {"benchmark": "simulate_speed", "workload": "synthetic uniform routing (labelled synthetic)",
           "shape": {"L": L, "E": E, "K": K, "cluster": cluster.spec(), "redundant": args.redundant,
                     "prompt": args.prompt, "gen": args.gen}, "trace_generation_seconds": gen_s,
           "machine": {"python": platform.python_version(), "numpy": np.__version__, "processor": platform.machine()},
           "results": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
