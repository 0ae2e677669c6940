"""Prompt tokens per second of the two ways `moeplace trace record` can record prefill routing (docs/CAPTURE.md).

- generate path: ``record_generate(max_new_tokens=1)`` (``--max-new-tokens 1``: one generate call per batch of
  ``--batch-size`` 8 left-padded prompts; it records no decode row, so its trace is prefill only too);
- batched forward path: ``record_prefill`` (``--max-new-tokens 0``: length-sorted, right-padded forwards of
  ``--batch-tokens`` 1024, no generate), flushing (and sorting) every 32 requests and every 256 (its default).

on two prompt sets of a reference model: its shipped held-out prompts (every 8th by request-id hash, 16-96
tokens) and held-out windows of 128-256 tokens as scripts/prefill_trace.py cuts them. Each measurement runs
``--repeats`` times, alternating the paths; the median is reported. Expert ids only, 1 torch thread.

Usage::

    OMP_NUM_THREADS=1 python scripts/prefill_throughput.py --model reference-fg --json out/prefill_throughput.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="reference-fg", choices=("reference-fg", "reference-ds"))
    ap.add_argument("--window-tokens", type=int, default=40_000, help="tokens of 128-256-token windows")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    from moeplace.models.reference import (
        EOS_TOKEN,
        HELDOUT_PROMPTS_FILE,
        MANIFEST_FILE,
        builtin_prompts,
        load_reference,
        preset,
    )
    from moeplace.models.train import corpus_of
    from moeplace.trace import TraceWriter
    from moeplace.trace.capture import record_generate, record_prefill, sample_mask, trace_meta

    spec = importlib.util.spec_from_file_location("prefill_trace", ROOT / "scripts" / "prefill_trace.py")
    pt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pt)

    torch.set_num_threads(1)
    mdir = ROOT / "src" / "moeplace" / "data" / args.model
    model, tok = load_reference(path=mdir)
    rows = builtin_prompts(mdir)
    keep = np.flatnonzero(sample_mask(np.arange(len(rows)), 8))
    short = [tok(rows[i]["prompt"])["input_ids"] for i in keep]
    manifest = json.loads((mdir / MANIFEST_FILE).read_text())
    shipped = {r["doc_id"] for r in rows}
    assert (mdir / HELDOUT_PROMPTS_FILE).is_file()
    reqs, _ = pt.build_requests(corpus_of(preset(pt.MODELS[args.model])), manifest, shipped, tok,
                                tok.convert_tokens_to_ids(EOS_TOKEN), args.window_tokens, 128, 256, 0)
    long = [r["tokens"].tolist() for r in reqs]
    meta = trace_meta(model, record_weights=False)
    tmp = Path(tempfile.mkdtemp(prefix="prefill-throughput-"))
    ways = {
        "generate (--max-new-tokens 1, --batch-size 8)":
            lambda p, w: record_generate(model, tok, p, w, max_new_tokens=1, batch_size=8),
        "batched forward (--max-new-tokens 0 --flush-every 32)":
            lambda p, w: record_prefill(model, tok, p, w, flush_every=32),
        "batched forward (--max-new-tokens 0, default --flush-every 256)":
            lambda p, w: record_prefill(model, tok, p, w, flush_every=256),
    }
    result = {"model": args.model, "threads": 1, "repeats": args.repeats, "loadavg_before": os.getloadavg(),
              "sets": {}}
    try:
        for set_name, prompts in (("shipped held-out prompts (1 in 8)", short),
                                  ("held-out windows of 128-256 tokens", long)):
            n = sum(map(len, prompts))
            times: dict[str, list[float]] = {k: [] for k in ways}
            for rep in range(args.repeats):
                for k, fn in (ways.items() if rep % 2 == 0 else reversed(ways.items())):
                    shutil.rmtree(tmp / "t.trace", ignore_errors=True)
                    with TraceWriter(tmp / "t.trace", meta) as w:
                        t0 = time.perf_counter()
                        s = fn(prompts, w)
                        times[k].append(time.perf_counter() - t0)
                    assert s["prefill_tokens"] == n
            med = {k: statistics.median(v) for k, v in times.items()}
            base = med[next(iter(ways))]
            result["sets"][set_name] = {
                "requests": len(prompts), "prompt_tokens": n,
                "tokens_per_s": {k: round(n / v) for k, v in med.items()},
                "speedup_vs_generate": {k: round(base / v, 2) for k, v in med.items()},
                "seconds": times,
            }
            print(set_name, json.dumps(result["sets"][set_name]["tokens_per_s"]), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["loadavg_after"] = os.getloadavg()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
