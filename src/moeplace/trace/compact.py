"""Compact a trace: rewrite many small shards into few large ones, verified before it appears.

Shape legend: T = tokens, L = MoE layers, K = top-k, E = logical experts, R = requests, G = count groups.

A capture or an import flushes a shard every few requests, so a long trace holds thousands of small Parquet files;
each costs a footer, an open and a tiny row group to every reader. :func:`compact_trace` copies a trace into shards
of ``shard_tokens`` rows (one row group each), through the one validating reader and the one writer:

- *atomic*: the copy is built in a hidden folder beside the output (:class:`moeplace.trace.writer.TraceWriter`
  with ``keep_partial=False``) and renamed into place only after it is verified; an existing output is replaced
  only with ``overwrite`` and only if moeplace wrote it (it is swapped in, the old one kept until then);
- *verified*: before the rename the copy is read back and its row counts and content digest
  (:func:`trace_digest`: SHA-256 over every column of the request table and of the token rows or count groups,
  in trace order) must equal those of the input as it was read;
- *nothing lost on kill*: the input is only read; a killed run leaves a hidden build folder that the next writer of
  the same output removes, and never a half-written output.

The request table keeps its order (it is the arrival order, docs/SIMULATOR.md); each request is written in the
shard that holds its first token row, or an earlier one.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moeplace.trace.budget import check_memory
from moeplace.trace.reader import (
    decoded_row_bytes,
    iter_token_chunks,
    read_counts,
    read_meta,
    read_requests,
    shard_files,
)
from moeplace.trace.types import Counts, Requests, TokenChunk, TraceError, TraceMeta
from moeplace.trace.writer import DEFAULT_SHARD_TOKENS, TraceWriter

DIGEST_CHUNK_TOKENS = 65536  # token rows read at once while copying and verifying
META_KEPT_OUT = ("complete", "written_by", "format_version")  # what the writer sets; the rest is copied as it is


@dataclass(frozen=True)
class TraceDigest:
    """Row counts and a SHA-256 of a trace's content in trace order (independent of how it is sharded)."""

    request_rows: int
    token_rows: int
    count_rows: int
    sha256: str


@dataclass(frozen=True)
class CompactResult:
    """What :func:`compact_trace` did: shards before and after, and the digest both traces share."""

    source: str
    dest: str
    shards_in: int
    shards_out: int
    bytes_in: int
    bytes_out: int
    digest: TraceDigest

    def to_json(self) -> dict:
        return asdict(self)


class _Digester:
    """SHA-256 of each column's bytes concatenated over chunks, combined at the end (chunking does not matter)."""

    def __init__(self) -> None:
        self.cols: dict[str, Any] = {}  # name -> hashlib sha256 object
        self.rows = {"requests": 0, "tokens": 0, "counts": 0}

    def add(self, name: str, a: np.ndarray) -> None:
        h = self.cols.setdefault(name, hashlib.sha256())
        if a.dtype == object:  # strings: each as its UTF-8 length (4 bytes) and bytes
            for v in a.tolist():
                b = str(v).encode("utf-8", "surrogateescape")
                h.update(len(b).to_bytes(4, "little"))
                h.update(b)
        else:
            h.update(np.ascontiguousarray(a).tobytes())

    def requests(self, r: Requests) -> None:
        self.rows["requests"] += len(r)
        for name in ("request_id", "domain", "source", "prompt_len", "gen_len"):
            self.add(f"requests.{name}", getattr(r, name))

    def tokens(self, ch: TokenChunk) -> None:
        self.rows["tokens"] += len(ch)
        self.add("tokens.request_id", np.asarray(ch.request_id, np.int64))
        self.add("tokens.position", np.asarray(ch.position, np.int32))
        self.add("tokens.phase", np.asarray(ch.phase, np.int8))
        self.add("tokens.expert_ids", np.asarray(ch.expert_ids, np.int16))
        if ch.expert_weights is not None:
            self.add("tokens.expert_weights", np.asarray(ch.expert_weights, np.float16))

    def counts(self, c: Counts) -> None:
        self.rows["counts"] += len(c)
        for name in ("group", "domain"):
            self.add(f"counts.{name}", getattr(c, name))
        self.add("counts.phase", np.asarray(c.phase, np.int8))
        self.add("counts.num_tokens", np.asarray(c.num_tokens, np.float64))
        self.add("counts.counts", np.asarray(c.counts, np.float64))

    def result(self) -> TraceDigest:
        h = hashlib.sha256()
        for name in sorted(self.cols):
            h.update(name.encode())
            h.update(self.cols[name].digest())
        return TraceDigest(self.rows["requests"], self.rows["tokens"], self.rows["counts"], h.hexdigest())


def _slice_requests(r: Requests, a: int, b: int) -> Requests:
    return Requests(r.request_id[a:b], r.domain[a:b], r.source[a:b], r.prompt_len[a:b], r.gen_len[a:b])


def trace_digest(path: str | os.PathLike, budget: int | None = None) -> TraceDigest:
    """Row counts and SHA-256 of a trace's request table and token rows (or count groups), read in trace order
    through the validating reader; two traces with equal digests hold the same rows in the same order."""
    meta = read_meta(path, budget)
    d = _Digester()
    d.requests(read_requests(path, budget))
    if meta.kind == "counts":
        d.counts(read_counts(path, budget))
    else:
        for ch in iter_token_chunks(path, chunk_tokens=DIGEST_CHUNK_TOKENS, columns_weights=meta.has_weights,
                                    budget=budget):
            d.tokens(ch)
    return d.result()


def _same_meta(a: TraceMeta, b: TraceMeta) -> list[str]:
    da, db = a.to_json(), b.to_json()
    return [k for k in da if k not in META_KEPT_OUT and da[k] != db.get(k)]


def _folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.iterdir() if f.is_file())


def compact_trace(src: str | os.PathLike, dest: str | os.PathLike, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                  overwrite: bool = False, budget: int | None = None) -> CompactResult:
    """Copy the trace ``src`` into ``dest`` with shards of ``shard_tokens`` token rows (or count groups), verified
    and renamed into place (module docstring). ``src`` must be complete (its writer closed cleanly); TraceError
    naming the trace otherwise, when a shard of ``shard_tokens`` rows would not fit the memory budget, or when the
    copy read back differs from the input (then ``dest`` is left as it was)."""
    src_p, dest_p = Path(src), Path(dest)
    meta = read_meta(src_p, budget)
    if not meta.complete:
        raise TraceError(f"{src_p}: incomplete trace (its writer did not close cleanly); compact copies complete "
                         "traces only")
    if shard_tokens < 1:
        raise TraceError(f"shard_tokens must be >= 1, got {shard_tokens}")
    # the writer holds a shard while it flushes it, and a reader decodes a shard's row group at once: both must fit
    check_memory(shard_tokens * decoded_row_bytes(meta.kind, meta), f"a shard of {shard_tokens} rows",
                 src_p, budget)
    n_in = len(shard_files(src_p, meta))
    bytes_in = _folder_bytes(src_p)
    reqs = read_requests(src_p, budget)
    got = _Digester()
    got.requests(reqs)

    def verify(folder: Path) -> None:
        bad = _same_meta(meta, read_meta(folder, budget))
        if bad:
            raise TraceError(f"{dest_p}: compacted copy's metadata differs from {src_p} in {', '.join(bad)}; "
                             "nothing was written")
        want, have = got.result(), trace_digest(folder, budget)
        if want != have:
            raise TraceError(f"{dest_p}: compacted copy differs from {src_p} (rows {have.token_rows} vs "
                             f"{want.token_rows}, requests {have.request_rows} vs {want.request_rows}, sha256 "
                             f"{have.sha256[:12]} vs {want.sha256[:12]}); nothing was written")

    with TraceWriter(dest_p, meta, shard_tokens=shard_tokens, overwrite=overwrite, keep_partial=False,
                     inputs=[src_p], verify=verify) as w:
        R = len(reqs)
        if meta.kind == "counts":
            w.add_requests(reqs.request_id, reqs.domain, reqs.source, reqs.prompt_len, reqs.gen_len)
            c = read_counts(src_p, budget)
            got.counts(c)
            for s in range(0, len(c), shard_tokens):
                sl = slice(s, s + shard_tokens)
                w.add_counts(c.group[sl], c.domain[sl], c.phase[sl], c.num_tokens[sl], c.counts[sl])
        else:
            order = np.argsort(reqs.request_id, kind="stable")
            rid_sorted = reqs.request_id[order]
            written = 0  # request-table rows written so far (table order)
            for ch in iter_token_chunks(src_p, chunk_tokens=min(shard_tokens, DIGEST_CHUNK_TOKENS),
                                        columns_weights=meta.has_weights, budget=budget):
                got.tokens(ch)
                if R and len(ch):  # requests up to the last one this chunk names, in table order
                    need = int(order[np.searchsorted(rid_sorted, ch.request_id)].max()) + 1
                    if need > written:
                        r = _slice_requests(reqs, written, need)
                        w.add_requests(r.request_id, r.domain, r.source, r.prompt_len, r.gen_len)
                        written = need
                w.add_tokens(ch.request_id, ch.position, ch.phase, ch.expert_ids, ch.expert_weights)
            if written < R:
                r = _slice_requests(reqs, written, R)
                w.add_requests(r.request_id, r.domain, r.source, r.prompt_len, r.gen_len)
    out_meta = read_meta(dest_p, budget)
    return CompactResult(str(src_p), str(dest_p), n_in, len(shard_files(dest_p, out_meta)), bytes_in,
                         _folder_bytes(dest_p), got.result())
