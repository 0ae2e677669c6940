"""Simulator speed against the spec: token-layers per second of ``moeplace.simulate.simulate`` and of the plain
Python specification ``tests/spec_simulator.py`` (``spec_simulate``), on the same traces in the same run.

A token-layer is one token's K experts in one MoE layer (replica choice, dedup, sends, bytes, load). Workload:
uniform random routing, SYNTHETIC, in memory, on the gpt-oss-20b shape (L=24, E=32, K=4, 4 nodes x 2 GPUs,
8 redundant slots) and the DeepSeek-V3 shape (L=58, E=256, K=8, 4x8, 32 redundant).

What is timed is the token pass only. Each implementation runs on a small trace (the first ``--base-tokens``
tokens' requests) and on the full trace (those requests plus ``--tokens`` more tokens); the rate is the extra
token-layers divided by the extra time, so per-call setup (placement tables, request layout, micro-batch ids of
the whole trace) cancels out. Both traces get one untimed warm-up call first (numba kernels are compiled or
loaded from the cache there). The fast path's times are medians of ``--repeat`` calls; the spec is timed once.

    python bench/simulate_speed.py [--tokens 12288] [--shapes gpt-oss-20b,deepseek-v3] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import numpy as np
from common import REPO, BenchRun, median

from moeplace.placement import Cluster, Placement, Plan
from moeplace.simulate import BatchConfig, CostConfig, simulate
from moeplace.trace import Requests, TokenChunk, Trace, TraceMeta

SPEC = REPO / "tests" / "spec_simulator.py"
SHAPES = {  # name -> (L, E, K, cluster, redundant, hidden)
    "gpt-oss-20b": (24, 32, 4, "4x2", 8, 2880),
    "deepseek-v3": (58, 256, 8, "4x8", 32, 7168),
}
EXCLUDED = ("per-call setup (placement and route tables, request layout): removed by timing each implementation "
            "on a small trace and on a larger one and dividing the extra token-layers by the extra time; numba "
            "compilation: one untimed warm-up call per trace; building the synthetic traces")


def load_spec():
    """The spec's ``spec_simulate``, imported by path (tests/ is not a package)."""
    if not SPEC.exists():
        raise SystemExit(f"simulate_speed: the spec {SPEC} is missing; it is the baseline this bench measures")
    spec = importlib.util.spec_from_file_location("spec_simulator", SPEC)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.spec_simulate


def random_trace(n_tokens: int, L: int, E: int, K: int, prompt: int, gen: int, hidden: int, seed: int = 0
                 ) -> Trace:
    """SYNTHETIC uniform routing: ceil(n_tokens / (prompt + gen)) requests of prompt + gen tokens, K distinct
    experts per token-layer."""
    rng = np.random.default_rng(seed)
    per = prompt + gen
    n_req = max(1, -(-n_tokens // per))
    rid = np.repeat(np.arange(n_req, dtype=np.int64), per)
    pos = np.tile(np.arange(per, dtype=np.int32), n_req)
    phase = (pos >= prompt).astype(np.int8)
    ids = np.empty((len(rid), L, K), np.int16)
    for s in range(0, len(rid), 4096):  # top-K of random keys: K distinct experts
        keys = rng.random((min(4096, len(rid) - s), L, E), dtype=np.float32)
        ids[s:s + 4096] = np.argpartition(keys, K, axis=-1)[..., :K]
    meta = TraceMeta(model="synthetic-uniform", num_layers=L, num_experts=E, top_k=K, hidden_size=hidden,
                     synthetic=True, source="bench/simulate_speed.py (uniform random routing)")
    req = Requests(np.arange(n_req, dtype=np.int64), np.array(["synthetic"] * n_req, object),
                   np.array([""] * n_req, object), np.full(n_req, prompt, np.int32), np.full(n_req, gen, np.int32))
    return Trace(meta, req, TokenChunk(rid, pos, phase, ids))


def first_requests(tr: Trace, n_req: int) -> Trace:
    """The trace of its first ``n_req`` requests (tokens are stored request by request)."""
    end = int(np.searchsorted(tr.tokens.request_id, n_req))
    r = tr.requests
    req = Requests(r.request_id[:n_req], r.domain[:n_req], r.source[:n_req], r.prompt_len[:n_req],
                   r.gen_len[:n_req])
    return Trace(tr.meta, req, tr.tokens.select(slice(0, end)))


def times(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def bench_shape(name: str, args, spec_simulate) -> dict:
    L, E, K, spec_c, redundant, hidden = SHAPES[name]
    cluster = Cluster.parse(spec_c)
    plan = Plan(Placement.linear(L, E, cluster.world_size, redundant), cluster)
    per = args.prompt + args.gen
    small_req = max(1, -(-args.base_tokens // per))
    big_req = small_req + max(1, -(-args.tokens // per))
    big = random_trace(big_req * per, L, E, K, args.prompt, args.gen, hidden)
    small = first_requests(big, small_req)
    extra_tl = (len(big.tokens) - len(small.tokens)) * L
    batching = BatchConfig(decode_batch=args.decode_batch, prefill_tokens=args.prefill_tokens)
    cost = CostConfig(hidden_size=hidden, dispatch_bytes=1.0, combine_bytes=2.0)
    pair_seconds = 6.0 * hidden * hidden / cluster.expert_flops  # the simulator's default: intermediate = hidden
    out = {"L": L, "E": E, "K": K, "cluster": spec_c, "redundant": redundant, "hidden": hidden,
           "small_tokens": len(small.tokens), "large_tokens": len(big.tokens), "timed_token_layers": extra_tl,
           "rules": {}}
    for rule in args.rules.split(","):
        def fast(tr: Trace, rule: str = rule) -> None:
            simulate(tr, plan, cost=cost, batching=batching, rule=rule)

        def spec(tr: Trace, rule: str = rule) -> None:
            spec_simulate(tr, plan, rule=rule, hidden=hidden, dispatch_bytes=1.0, combine_bytes=2.0,
                          pair_seconds=pair_seconds, decode_batch=args.decode_batch,
                          prefill_tokens=args.prefill_tokens)

        fast(small)  # warm-up: kernels compiled or loaded from numba's cache
        fast(big)
        f_small, f_big = times(lambda: fast(small), args.repeat), times(lambda: fast(big), args.repeat)
        fast_s = median(f_big) - median(f_small)
        spec(small)  # warm-up (imports, caches of the spec, if any)
        s_small, s_big = times(lambda: spec(small), 1), times(lambda: spec(big), 1)
        spec_s = s_big[0] - s_small[0]
        if fast_s <= 0 or spec_s <= 0:
            raise SystemExit(f"simulate_speed: {name} {rule}: the larger trace was not slower (fast {fast_s:.4f} s, "
                             f"spec {spec_s:.4f} s); raise --tokens")
        row = {"fast_small_s": f_small, "fast_large_s": f_big, "spec_small_s": s_small[0], "spec_large_s": s_big[0],
               "fast_token_layers_per_s": extra_tl / fast_s, "spec_token_layers_per_s": extra_tl / spec_s,
               "speedup_vs_spec": spec_s / fast_s,
               "whole_call_speedup_vs_spec": s_big[0] / median(f_big)}
        out["rules"][rule] = row
        print(f"{name:12s} {rule:21s} simulate {row['fast_token_layers_per_s'] / 1e6:7.2f} M token-layers/s   "
              f"spec {row['spec_token_layers_per_s'] / 1e3:7.1f} k/s   speedup {row['speedup_vs_spec']:,.0f}x "
              f"(whole call on {len(big.tokens):,} tokens: {row['whole_call_speedup_vs_spec']:,.0f}x)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=12288, help="tokens whose pass is timed (default 12288)")
    ap.add_argument("--base-tokens", type=int, default=1024, help="tokens of the small trace (setup; default 1024)")
    ap.add_argument("--shapes", default="gpt-oss-20b", help=f"comma-separated, of {list(SHAPES)}")
    ap.add_argument("--rules", default="nearest-least-loaded,nearest-static")
    ap.add_argument("--prompt", type=int, default=384)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=3, help="timed calls of the fast path per trace (median)")
    ap.add_argument("--json", help="write here instead of bench/results/simulate_speed.json")
    args = ap.parse_args()
    if args.tokens < 10_000:
        raise SystemExit(f"--tokens must be >= 10000 (a token pass long enough to time), got {args.tokens}")
    run = BenchRun("simulate_speed", baseline="spec_simulate from tests/spec_simulator.py (plain Python loops)")
    spec_simulate = load_spec()
    shapes = {s.strip(): bench_shape(s.strip(), args, spec_simulate) for s in args.shapes.split(",")}
    params = {k: v for k, v in vars(args).items() if k != "json"}
    run.write({"params": params, "workload": "SYNTHETIC uniform random routing", "excluded": EXCLUDED,
               "results": shapes}, args.json)


if __name__ == "__main__":
    main()
