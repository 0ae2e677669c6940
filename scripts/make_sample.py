"""Build the bundled default trace: a small, real, attributed sample of gpt-oss-20b decode routing.

Reads ../shared/data/gpt-oss-20b (see /work/shared/data/README.md), picks generations spread over the upstream
datasets and writes src/moeplace/data/gpt-oss-20b-sample.trace with moeplace's own importer, so the sample is
exactly what ``moeplace trace import --format gpt-oss-npz`` produces for those generations.

Selection (deterministic, no randomness): generations are grouped by upstream dataset; within a dataset they are
taken in file order; the datasets are visited round-robin (sorted by name) until SAMPLE_SIZE generations are chosen.
Prompt and generated text are not stored in the trace, only routing, positions, lengths and dataset/category.
Routing weights are dropped to stay under MAX_BYTES (import the full data with the CLI to keep them).

Usage (from the repository root):  python scripts/make_sample.py [--src ../shared/data/gpt-oss-20b]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE_SIZE = 48
MAX_BYTES = 2_000_000  # keep the installed package small


def select_generations(meta_rows: list[dict], n: int) -> list[int]:
    """0-based positions of ``n`` generations, round-robin over datasets (sorted), file order within each."""
    by_ds: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(meta_rows):
        by_ds[str(r["dataset"])].append(i)
    queues = [by_ds[d] for d in sorted(by_ds)]
    picked: list[int] = []
    depth = 0
    while len(picked) < n and any(depth < len(q) for q in queues):
        for q in queues:
            if depth < len(q) and len(picked) < n:
                picked.append(q[depth])
        depth += 1
    return sorted(picked)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default="../shared/data/gpt-oss-20b", help="gpt-oss-20b data directory")
    ap.add_argument("--out", default="src/moeplace/data/gpt-oss-20b-sample.trace", help="trace to write")
    ap.add_argument("-n", type=int, default=SAMPLE_SIZE, help=f"generations to keep (default {SAMPLE_SIZE})")
    args = ap.parse_args(argv)
    os.chdir(REPO)  # relative paths in the trace metadata, not this machine's layout

    from moeplace.trace import trace_info
    from moeplace.trace.importers import import_gpt_oss_npz

    src = Path(args.src)
    rows = [json.loads(line) for line in open(src / "decode_routing_meta.jsonl", encoding="utf-8") if line.strip()]
    picked = select_generations(rows, args.n)
    # Routing weights are left out: float16 weights are two thirds of the bytes and the sample must stay small.
    out = import_gpt_oss_npz(src, args.out, select=picked, weights=False, overwrite=True)
    info = trace_info(out)
    per_ds: dict[str, int] = defaultdict(int)
    for i in picked:
        per_ds[rows[i]["dataset"]] += 1
    print(f"wrote {out}: {info['num_requests']} generations, {info['num_tokens']['decode']:,} decode tokens, "
          f"{info['size_bytes']:,} bytes")
    print("per dataset:", dict(sorted(per_ds.items())))
    print("per domain: ", info["domains"])
    print("example_index:", [int(rows[i]["example_index"]) for i in picked])
    if info["size_bytes"] > MAX_BYTES:
        print(f"error: sample is {info['size_bytes']:,} bytes, over the {MAX_BYTES:,} budget; lower -n",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
