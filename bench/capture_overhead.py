"""Overhead of routing capture on ``model.generate``: wall time recording every token / the same run without hooks.

A small randomly initialised Qwen3-MoE (no download) generates from the same left-padded batch, alternately with
no hooks at all and with a RoutingRecorder (hooks + conversion to rows + rows handed to one TraceWriter that
lives for the whole benchmark, as in a real capture; its shard writes are amortised over many batches).
Runs are interleaved (the order flips every repeat, so drift hits both sides) and the median per-pair ratio is
reported. Greedy decoding with EOS off, so both runs compute exactly the same tokens.

    python bench/capture_overhead.py [--repeats 11] [--json PATH]     # default: bench/results/capture_overhead.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import BenchRun
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from moeplace.trace import TraceWriter
from moeplace.trace.capture import RoutingRecorder, trace_meta


def build_model(layers: int, hidden: int, experts: int, top_k: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden,
                         moe_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=hidden // 8, num_experts=experts,
                         num_experts_per_tok=top_k, max_position_embeddings=1024)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=11, help="timed pairs (after one warm-up pair)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 keeps shared machines quieter)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, help="write here instead of bench/results/capture_overhead.json")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    torch.set_num_threads(args.threads)
    run = BenchRun("capture_overhead", baseline="the same model.generate without hooks (interleaved pairs)")

    model = build_model(args.layers, args.hidden, args.experts, args.top_k).to(args.device)
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.batch,), generator=g)
    inp = torch.randint(1, 1024, (args.batch, args.prompt_len), generator=g)
    mask = (torch.arange(args.prompt_len)[None, :] >= (args.prompt_len - lens)[:, None]).long()
    inp = (inp * mask).to(args.device)
    mask = mask.to(args.device)
    kw = dict(input_ids=inp, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    meta = trace_meta(model, model_name="bench-qwen3-moe")

    def sync() -> None:
        if torch.device(args.device).type == "cuda":
            torch.cuda.synchronize()

    def plain() -> tuple[float, float]:
        sync()
        t, c = time.perf_counter(), time.process_time()
        with torch.no_grad():
            model.generate(**kw)
        sync()
        return time.perf_counter() - t, time.process_time() - c

    inside = [0.0]  # seconds spent in the recorder's own code (hooks, begin/end_batch) in the current run

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                inside[0] += time.perf_counter() - t

        return wrapper

    def timed_recorder(w: TraceWriter) -> RoutingRecorder:
        """The real recorder with its hooks and batch methods wrapped in timers (before the hooks attach)."""
        rec = RoutingRecorder(model, writer=w)
        make_hook = rec._router_hook
        rec._router_hook = lambda slot: timed(make_hook(slot))
        for name in ("_pre_forward", "_post_forward", "begin_batch", "end_batch"):
            setattr(rec, name, timed(getattr(rec, name)))
        return rec

    def recorded(w: TraceWriter, i: int) -> tuple[float, float, int]:
        sync()
        inside[0] = 0.0
        t, c = time.perf_counter(), time.process_time()
        with timed_recorder(w) as rec:
            rec.begin_batch(np.arange(args.batch) + i * args.batch, prompt_width=args.prompt_len)
            with torch.no_grad():
                out = model.generate(**kw)
            cb = rec.end_batch(out)
        sync()
        return time.perf_counter() - t, time.process_time() - c, len(cb.tokens)

    base, rec, ratios, cpu_ratios, in_rec = [], [], [], [], []
    rows = 0
    with tempfile.TemporaryDirectory() as td, TraceWriter(Path(td) / "bench.trace", meta) as w:
        plain()
        recorded(w, args.repeats)  # warm-up pair
        for i in range(args.repeats):
            if i % 2 == 0:
                b, bc = plain()
                r, rc, rows = recorded(w, i)
            else:
                r, rc, rows = recorded(w, i)
                b, bc = plain()
            base.append(b)
            rec.append(r)
            ratios.append(r / b)
            cpu_ratios.append(rc / bc)
            in_rec.append(inside[0] / b)
            print(f"repeat {i}: plain {b:.3f} s, recorded {r:.3f} s, ratio {r / b:.4f}, "
                  f"in recorder {inside[0] * 1000:.1f} ms", file=sys.stderr)

    result = {
        "median_ratio": float(np.median(ratios)),
        "ratios": ratios,
        "best_of_ratio": float(min(rec) / min(base)),  # fastest recorded / fastest plain: robust to neighbours
        "median_in_recorder_share": float(np.median(in_rec)),  # time inside recorder code / plain wall time
        "median_cpu_time_ratio": float(np.median(cpu_ratios)),  # process CPU time: less sensitive to neighbours
        "cpu_time_ratios": cpu_ratios,
        "plain_s": base,
        "recorded_s": rec,
        "median_plain_s": float(np.median(base)),
        "median_recorded_s": float(np.median(rec)),
        "token_rows_per_run": rows,
        "model": {"arch": "Qwen3MoeForCausalLM (random init)", "L": meta.num_layers, "E": meta.num_experts,
                  "k": meta.top_k, "hidden": meta.hidden_size},
    }
    print(f"capture overhead: median ratio {result['median_ratio']:.4f} "
          f"({(result['median_ratio'] - 1) * 100:+.1f}%) over {args.repeats} interleaved pairs "
          f"(best-of ratio {result['best_of_ratio']:.4f}, CPU-time ratio {result['median_cpu_time_ratio']:.4f}, "
          f"time inside the recorder {result['median_in_recorder_share'] * 100:.1f}% of plain); "
          f"plain generate {result['median_plain_s']:.2f} s, {rows} token rows recorded per run")
    run.write({"params": {k: v for k, v in vars(args).items() if k != "json"},
               "excluded": "building the model; one untimed warm-up pair", "results": result}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
