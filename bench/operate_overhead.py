"""Overhead of the live operate counters on ``generate``: wall time of the reference model's ``generate`` with the
live source and the 1-in-16 counters attached / the same ``generate`` without them.

The bundled reference MoE (8 layers, 32 experts, top-4) generates from held-out prompts (interleaved over the
domains) in left-padded batches, alternately

- plain: ``model.generate`` on the batches, no hooks;
- counted: the live source of ``moeplace operate --source live`` (:func:`moeplace.operate.live.live_stream`: the
  capture hooks of ``record_generate`` on every router, rows handed to the in-memory window) and, for each window,
  the loop's counters (:func:`moeplace.operate.counters.count_window`: 1-in-n sampled per-domain expert counts,
  drops above capacity on every row).

Both sides compute the same tokens (greedy, the same batches, padding and EOS). The loop's per-window replay in the
simulator and the policy are not counted: they are the rebalancer's work, not the counters'. Runs are interleaved
(the order flips every repeat, so drift hits both sides) and the median per-pair ratio is reported, with the
best-of ratio and the CPU-time ratio (less sensitive to neighbours on a shared machine).

    python bench/operate_overhead.py [--repeats 11] [--json PATH]    # default: bench/results/operate_overhead.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import BenchRun

from moeplace.models.reference import builtin_prompts, load_reference
from moeplace.operate.counters import count_window
from moeplace.operate.live import REFERENCE_NAME, live_stream
from moeplace.simulate import BatchConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32, help="prompts per run (interleaved over the domains)")
    ap.add_argument("--batch", type=int, default=8, help="requests per generate call")
    ap.add_argument("--window", type=int, default=32, help="requests per operate window")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--sample-every", type=int, default=16, help="1-in-n sampling of the counters")
    ap.add_argument("--gpus", type=int, default=32, help="GPUs the homes are spread over (round-robin)")
    ap.add_argument("--repeats", type=int, default=11, help="timed pairs (after one warm-up pair)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 keeps shared machines quieter)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, help="write here instead of bench/results/operate_overhead.json")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    torch.set_num_threads(args.threads)
    run = BenchRun("operate_overhead", baseline="the same model.generate without hooks or counters (interleaved "
                                                "pairs)")
    model, tok = load_reference(device=args.device)
    by_dom: dict[str, list[dict]] = {}
    for r in builtin_prompts():
        by_dom.setdefault(r["domain"], []).append(r)
    doms = list(by_dom)
    prompts = [by_dom[doms[i % len(doms)]][i // len(doms)] for i in range(args.requests)]
    eos = model.generation_config.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    batching = BatchConfig(decode_batch=args.window)

    def sync() -> None:
        if torch.device(args.device).type == "cuda":
            torch.cuda.synchronize()

    # plain side: the same left-padded batches record_generate builds
    ids = [tok(r["prompt"])["input_ids"] for r in prompts]
    batches = []
    for s in range(0, len(ids), args.batch):
        part = ids[s:s + args.batch]
        width = max(len(t) for t in part)
        inp = torch.full((len(part), width), pad, dtype=torch.long)
        mask = torch.zeros((len(part), width), dtype=torch.long)
        for b, t in enumerate(part):
            inp[b, width - len(t):] = torch.tensor(t)
            mask[b, width - len(t):] = 1
        batches.append((inp.to(args.device), mask.to(args.device)))
    kw = dict(do_sample=False, max_new_tokens=args.new_tokens, pad_token_id=pad, eos_token_id=eos)

    def plain() -> tuple[float, float, int]:
        sync()
        t, c = time.perf_counter(), time.process_time()
        n = 0
        with torch.no_grad():
            for inp, mask in batches:
                out = model.generate(input_ids=inp, attention_mask=mask, **kw)
                n += int(out.shape[1] - inp.shape[1])
        sync()
        return time.perf_counter() - t, time.process_time() - c, n

    def counted() -> tuple[float, float, float, int]:
        sync()
        t, c = time.perf_counter(), time.process_time()
        stream = live_stream(model, tok, prompts, args.window, args.new_tokens, args.batch, REFERENCE_NAME,
                             "builtin")
        first_row, in_counters, rows = 0, 0.0, 0
        for window in stream.windows:
            t1 = time.perf_counter()
            home = np.arange(len(window.requests)) % args.gpus
            count_window(window, home, batching, args.sample_every, 1.25, first_row)
            first_row += len(window.tokens)
            in_counters += time.perf_counter() - t1
            rows += len(window.tokens)
        sync()
        return time.perf_counter() - t, time.process_time() - c, in_counters, rows

    base, cnt, ratios, cpu_ratios, count_share = [], [], [], [], []
    rows = 0
    plain()
    counted()  # warm-up pair
    for i in range(args.repeats):
        if i % 2 == 0:
            b, bc, _ = plain()
            r, rc, inside, rows = counted()
        else:
            r, rc, inside, rows = counted()
            b, bc, _ = plain()
        base.append(b)
        cnt.append(r)
        ratios.append(r / b)
        cpu_ratios.append(rc / bc)
        count_share.append(inside / b)
        print(f"repeat {i}: plain {b:.3f} s, counted {r:.3f} s, ratio {r / b:.4f}, "
              f"in count_window {inside * 1000:.1f} ms", file=sys.stderr)

    result = {
        "median_ratio": float(np.median(ratios)),
        "ratios": ratios,
        "best_of_ratio": float(min(cnt) / min(base)),  # fastest counted / fastest plain: robust to neighbours
        "median_cpu_time_ratio": float(np.median(cpu_ratios)),
        "cpu_time_ratios": cpu_ratios,
        "median_in_count_window_share": float(np.median(count_share)),  # count_window time / plain wall time
        "plain_s": base,
        "counted_s": cnt,
        "median_plain_s": float(np.median(base)),
        "median_counted_s": float(np.median(cnt)),
        "token_rows_per_run": rows,
        "target_ratio": 1.01,
        "model": {"name": REFERENCE_NAME, "L": int(model.config.num_hidden_layers),
                  "E": int(model.config.num_experts), "k": int(model.config.num_experts_per_tok),
                  "hidden": int(model.config.hidden_size)},
    }
    print(f"operate counter overhead: median ratio {result['median_ratio']:.4f} "
          f"({(result['median_ratio'] - 1) * 100:+.1f}%) over {args.repeats} interleaved pairs "
          f"(best-of {result['best_of_ratio']:.4f}, CPU-time {result['median_cpu_time_ratio']:.4f}, "
          f"count_window {result['median_in_count_window_share'] * 100:.2f}% of plain); "
          f"plain generate {result['median_plain_s']:.2f} s, {rows} token rows per run")
    run.write({"params": {k: v for k, v in vars(args).items() if k != "json"},
               "excluded": "loading the model; tokenizing the plain side's prompts; one untimed warm-up pair; the "
                           "loop's simulator replay and policy per window", "results": result}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
