"""``moeplace trace compact``: rewrite a trace's many small shards into few large ones, verified, atomically."""

from __future__ import annotations

import argparse

from moeplace.cli import MAX_TOKENS, int_in, output_dir

DEFAULT_SHARD_TOKENS = 1 << 18  # = moeplace.trace.writer.DEFAULT_SHARD_TOKENS (the CLI imports no pyarrow)


def cmd_compact(args: argparse.Namespace) -> int:
    from moeplace.trace.compact import compact_trace

    res = compact_trace(args.src, args.out, shard_tokens=args.shard_tokens, overwrite=args.overwrite)
    d = res.digest
    rows = f"{d.token_rows:,} token rows" if d.token_rows or not d.count_rows else f"{d.count_rows:,} count groups"
    print(f"compacted {res.source} ({res.shards_in} shards, {res.bytes_in / 1e6:,.1f} MB) -> {res.dest} "
          f"({res.shards_out} shards, {res.bytes_out / 1e6:,.1f} MB)")
    print(f"  verified before the rename: {rows}, {d.request_rows:,} requests, sha256 {d.sha256}")
    return 0


def register(tsub: argparse._SubParsersAction) -> None:
    """Add the ``compact`` subcommand to ``moeplace trace``."""
    p = tsub.add_parser(
        "compact", help="rewrite many small shards into few large ones (verified, atomic)",
        description="Copy a trace into shards of --shard-tokens rows (one Parquet row group each). The copy is "
                    "built beside OUT, read back and checked against the input (row counts and a SHA-256 of every "
                    "column in trace order) and only then renamed into place; the input is only read, so a kill "
                    "loses nothing (docs/SCALE.md).",
        epilog="example:\n  moeplace trace compact capture.trace capture-compact.trace",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", help="trace directory to compact (complete)")
    p.add_argument("out", type=output_dir, help="trace directory to write")
    p.add_argument("--shard-tokens", type=int_in(1, MAX_TOKENS), default=DEFAULT_SHARD_TOKENS,
                   help="token rows (or count groups) per shard; each is one row group, decoded at once by readers "
                        "(default: %(default)s)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it is a moeplace trace that holds no input (swapped in when verified)")
    p.set_defaults(func=cmd_compact)
