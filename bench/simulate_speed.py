"""Simulator speed: token-layer routings simulated per second, compiled path vs the per-token reference loop.

A token-layer routing is one token's K experts in one MoE layer (replica choice, dedup, two-hop, bytes, load). The
workload is uniform random routing (synthetic, in memory, labelled so) on two shapes:

- DeepSeek-V3: L=58, E=256, K=8 on 4 nodes x 8 GPUs with 32 redundant slots (the issue's target: 10 M/s);
- gpt-oss-20b: L=24, E=32, K=4 on 4 nodes x 2 GPUs with 8 redundant slots (for context).

Both replica rules run on the same trace; the reference loop (``simulate_reference``) runs on a slice of it in the
same process, so the speedup compares like with like on whatever the machine is doing. Each rule is timed
``--repeat`` times after one warm-up call (which loads the compiled kernels from numba's cache, or compiles them on
a fresh checkout: reported as ``first_call_seconds``); rates use the median wall time, CPU time is reported too
(on a shared machine the two differ). The load average at the start and end is recorded.

    python bench/simulate_speed.py --tokens 65536 --json out/simulate_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from moeplace.placement import Cluster, Placement, Plan
from moeplace.simulate import RULES, BatchConfig, simulate
from moeplace.trace.store import Requests, TokenChunk, Trace, TraceMeta

SHAPES = {  # name -> (L, E, K, cluster, redundant, hidden)
    "deepseek-v3": (58, 256, 8, "4x8", 32, 7168),
    "gpt-oss-20b": (24, 32, 4, "4x2", 8, 2880),
}


def random_trace(n_tokens: int, L: int, E: int, K: int, prompt: int, gen: int, seed: int = 0,
                 hidden: int = 7168) -> Trace:
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
    meta = TraceMeta(model="synthetic-uniform", num_layers=L, num_experts=E, top_k=K, hidden_size=hidden,
                     synthetic=True, source="bench/simulate_speed.py (uniform random routing)")
    req = Requests(np.arange(n_req, dtype=np.int64), np.array(["synthetic"] * n_req, object),
                   np.array([""] * n_req, object), np.full(n_req, prompt, np.int32), np.full(n_req, gen, np.int32))
    return Trace(meta, req, TokenChunk(rid, pos, phase, ids))


def timed(fn, repeat: int) -> tuple[list[float], list[float]]:
    walls, cpus = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return walls, cpus


def bench_shape(name: str, args, batching: BatchConfig) -> list[dict]:
    L, E, K, spec, redundant, hidden = SHAPES[name]
    cluster = Cluster.parse(spec)
    plan = Plan(Placement.linear(L, E, cluster.world_size, redundant), cluster)
    tr = random_trace(args.tokens, L, E, K, args.prompt, args.gen, hidden=hidden)
    T = len(tr.tokens)
    small = Trace(tr.meta, tr.requests, tr.tokens.select(slice(0, args.ref_tokens)))
    rows = []
    for rule in RULES:
        t0 = time.perf_counter()
        fast = simulate(tr, plan, batching=batching, rule=rule)  # warm-up: kernels from cache (or compiled)
        first = time.perf_counter() - t0
        walls, cpus = timed(lambda rule=rule: simulate(tr, plan, batching=batching, rule=rule), args.repeat)
        rwalls, _ = timed(lambda rule=rule: simulate_reference(small, plan, batching=batching, rule=rule), 1)
        fast_s, ref_s = statistics.median(walls), rwalls[0]
        fast_rate = T * L / fast_s
        ref_rate = len(small.tokens) * L / ref_s
        rows.append({"shape": name, "rule": rule, "L": L, "E": E, "K": K, "cluster": spec, "redundant": redundant,
                     "tokens": T, "token_layers": T * L, "prefill_tokens": int(fast.prefill.num_tokens),
                     "decode_tokens": int(fast.decode.num_tokens),
                     "microbatches": fast.prefill.num_microbatches + fast.decode.num_microbatches,
                     "first_call_seconds": first, "fast_seconds": walls, "fast_cpu_seconds": cpus,
                     "fast_token_layers_per_s": fast_rate, "best_token_layers_per_s": T * L / min(walls),
                     "cpu_token_layers_per_s": T * L / statistics.median(cpus),
                     "reference_tokens": len(small.tokens), "reference_seconds": ref_s,
                     "reference_token_layers_per_s": ref_rate, "speedup": fast_rate / ref_rate})
        print(f"{name:12s} {rule:21s} {fast_rate / 1e6:6.2f} M token-layers/s (median of {args.repeat}, best "
              f"{T * L / min(walls) / 1e6:.2f}, per CPU-second {T * L / statistics.median(cpus) / 1e6:.2f}; "
              f"{T:,} tokens x {L} layers)   reference loop {ref_rate / 1e3:6.2f} k/s   "
              f"speedup {fast_rate / ref_rate:,.0f}x   first call {first:.2f} s", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=65536, help="tokens of each synthetic trace")
    ap.add_argument("--ref-tokens", type=int, default=48, help="tokens for the reference loop")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    ap.add_argument("--prompt", type=int, default=384)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    batching = BatchConfig(decode_batch=args.decode_batch, prefill_tokens=args.prefill_tokens)
    load_before = os.getloadavg()
    rows = []
    for name in args.shapes.split(","):
        rows += bench_shape(name.strip(), args, batching)
    load_after = os.getloadavg()
    print(f"kernel threads {_threads()}, CPUs {os.cpu_count()}, load average (1/5/15 min) before "
          f"{'/'.join(f'{x:.2f}' for x in load_before)}, after {'/'.join(f'{x:.2f}' for x in load_after)}")
    import numba

    out = {"benchmark": "simulate_speed", "workload": "synthetic uniform routing (labelled synthetic)",
           "args": vars(args), "batching": {"decode_batch": args.decode_batch, "prefill_tokens": args.prefill_tokens},
           "machine": {"python": platform.python_version(), "numpy": np.__version__, "numba": numba.__version__,
                       "processor": platform.machine(), "cpus": os.cpu_count(), "kernel_threads": _threads(),
                       "load_average_before": load_before, "load_average_after": load_after},
           "results": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
