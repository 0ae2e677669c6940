"""Reading traces: the one validating reader (meta, requests, token chunks, light columns, counts, info).

Shape legend: T = tokens, L = MoE layers, K = top-k, E = logical experts, R = requests, G = count groups.

Every reader here validates before it allocates: ``meta.json`` must be a small regular file with values of the right
types in sane ranges, and the row counts claimed by Parquet footers must fit the files' sizes and the memory budget
(:func:`moeplace.trace.budget.memory_budget`). Whatever is wrong raises :class:`TraceError` naming the file
(docs/RELIABILITY.md).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moeplace.io import DuplicateKeyError, unique_keys
from moeplace.trace.budget import MEMORY_BUDGET_ENV, check_memory
from moeplace.trace.format import (
    MAX_ROWS_PER_BYTE,
    check_expert_ids,
    check_lengths,
    check_phase,
    check_positions,
    counts_schema,
    data_suffix,
    requests_schema,
    tokens_schema,
)
from moeplace.trace.types import (
    DECODE,
    META_FILE,
    META_MAX_BYTES,
    PREFILL,
    Counts,
    Requests,
    TokenChunk,
    Trace,
    TraceError,
    TraceMeta,
)


def _trace_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise TraceError(f"{p}: no such trace (path does not exist)") from None
    except PermissionError:
        raise TraceError(f"{p}: permission denied") from None
    except OSError as e:
        raise TraceError(f"{p}: cannot open trace ({e.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise TraceError(f"{p}: not a trace directory (a moeplace trace is a directory with meta.json)")
    return p


def regular_file_size(f: str | os.PathLike, what: str) -> int:
    """Size of ``f`` after checking that it is a readable regular file (a link to one is fine): a FIFO or device
    would hang or never end. ``what`` names what the file should be, e.g. "trace metadata (JSON)"; every error is
    a TraceError naming the file and the problem."""
    f = Path(f)
    try:
        st = os.stat(f)
    except FileNotFoundError:
        raise TraceError(f"{f}: no such file ({what})") from None
    except PermissionError:
        raise TraceError(f"{f}: permission denied") from None
    except OSError as e:
        raise TraceError(f"{f}: cannot read {what} ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, socket or device)"
        raise TraceError(f"{f}: is {kind}, expected {what}")
    if not os.access(f, os.R_OK):
        raise TraceError(f"{f}: permission denied")
    return st.st_size


def read_meta(path: str | os.PathLike, budget: int | None = None) -> TraceMeta:
    """Read and validate ``meta.json`` of a trace directory.

    The file must be a regular file of at most :data:`META_MAX_BYTES`; it is opened non-blocking, so a FIFO or
    device never hangs the reader. Values must have the right types and ranges (:class:`TraceMeta`), and the
    per-layer expert tables they imply ([L, E]) must fit the memory budget.
    """
    p = _trace_dir(path)
    mf = p / META_FILE
    if not (mf.exists() or mf.is_symlink()):
        raise TraceError(f"{p}: not a moeplace trace (no {META_FILE})")
    size = regular_file_size(mf, "trace metadata (JSON)")
    if size > META_MAX_BYTES:
        raise TraceError(f"{mf}: {size} bytes, larger than any trace metadata ({META_MAX_BYTES} bytes at most)")
    try:
        fd = os.open(mf, os.O_RDONLY | os.O_NONBLOCK)
    except PermissionError:
        raise TraceError(f"{mf}: permission denied") from None
    except OSError as e:
        raise TraceError(f"{mf}: cannot open ({e.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between stat and open
            raise TraceError(f"{mf}: not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            raw = fh.read(META_MAX_BYTES + 1)
    except OSError as e:
        raise TraceError(f"{mf}: cannot read ({e.strerror})") from None
    finally:
        os.close(fd)
    if len(raw) > META_MAX_BYTES:
        raise TraceError(f"{mf}: larger than any trace metadata ({META_MAX_BYTES} bytes at most)")
    try:
        d = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
    except (json.JSONDecodeError, UnicodeDecodeError, DuplicateKeyError) as e:
        raise TraceError(f"{mf}: corrupt metadata ({e})") from None
    except RecursionError:
        raise TraceError(f"{mf}: corrupt metadata (JSON nested too deeply)") from None
    try:
        meta = TraceMeta.from_json(d, where=str(mf))
    except TypeError as e:
        raise TraceError(f"{mf}: invalid metadata ({e})") from None
    check_memory(4 * 8 * meta.num_layers * max(meta.num_experts, meta.top_k), "per-layer expert tables [L, E]",
                 mf, budget)
    return meta


def shard_files(path: str | os.PathLike, meta: TraceMeta | None = None) -> list[Path]:
    """Data files of the committed shards, in order. TraceError when there are none although ``meta.json`` says
    the trace is complete (every complete trace has at least one shard: its files were removed), or when the
    shards are of the other kind (``"kind": "counts"`` over token shards, or the reverse)."""
    p = _trace_dir(path)
    meta = meta or read_meta(p)
    try:
        files = sorted(p.glob(f"part-*{data_suffix(meta)}"))
        other = ".counts.parquet" if meta.kind == "tokens" else ".tokens.parquet"
        if not files and any(p.glob(f"part-*{other}")):
            raise TraceError(f"{p / META_FILE}: says kind={meta.kind!r}, but the shards are part-*{other} files "
                             "(metadata and data disagree)")
    except PermissionError:
        raise TraceError(f"{p}: permission denied (cannot list the trace folder)") from None
    if not files and meta.complete:
        raise TraceError(f"{p}: {META_FILE} says the trace is complete, but it has no part-*{data_suffix(meta)} "
                         "shard (its files were removed)")
    return files


def _row_bytes(kind: str, meta: TraceMeta, columns: Sequence[str] | None = None) -> int:
    """Bytes one row costs in memory once decoded (x3: Arrow buffers, numpy copies and checks)."""
    lk, le = meta.num_layers * meta.top_k, meta.num_layers * meta.num_experts
    sizes = {
        "tokens": {"request_id": 8, "position": 4, "phase": 1, "expert_ids": 2 * lk + 4,
                   "expert_weights": 2 * lk + 4},
        "requests": {"request_id": 8, "domain": 64, "source": 64, "prompt_len": 4, "gen_len": 4},
        "counts": {"group": 64, "domain": 64, "phase": 1, "num_tokens": 8, "counts": 8 * le + 4},
    }[kind]
    return 3 * sum(v for k, v in sizes.items() if columns is None or k in columns)


def decoded_row_bytes(kind: str, meta: TraceMeta, columns: Sequence[str] | None = None) -> int:
    """Bytes one row of a ``kind`` file ("tokens", "requests" or "counts") costs the readers once decoded: what
    the memory budget is checked against (a writer that sizes shards for the readers uses the same figure)."""
    return _row_bytes(kind, meta, columns)


def _open_parquet(f: Path, row_bytes: int, budget: int | None, what: str = "trace shard") -> pq.ParquetFile:
    """Open a Parquet file after checking it is a readable regular file whose footer fits its size and the budget.

    Each row group (the unit the streaming readers decode at once) must fit the memory budget at ``row_bytes``
    per row, and no file may claim more than :data:`MAX_ROWS_PER_BYTE` rows per byte of its size.
    """
    size = regular_file_size(f, what)
    try:
        pf = pq.ParquetFile(f, page_checksum_verification=True)
        md = pf.metadata
        n = md.num_rows
        groups = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
    except PermissionError:
        raise TraceError(f"{f}: permission denied") from None
    except (pa.ArrowException, OSError, ValueError, IndexError, MemoryError) as e:
        raise TraceError(f"{f}: truncated or corrupt Parquet file ({_short(e)})") from None
    if n < 0 or any(g < 0 for g in groups) or sum(groups) != n:
        raise TraceError(f"{f}: Parquet footer is inconsistent: {n} rows in total, row groups sum to {sum(groups)}")
    if n > MAX_ROWS_PER_BYTE * size:
        raise TraceError(f"{f}: Parquet footer claims {n} rows, more than a file of {size} bytes can hold "
                         "(corrupt or forged footer)")
    check_memory(max(groups, default=0) * row_bytes, f"a row group of {max(groups, default=0)} rows", f, budget)
    return pf


def _short(e: BaseException) -> str:
    s = str(e).splitlines()[0] if str(e) else type(e).__name__
    return s[:200]


def _corrupt(f: Path, e: BaseException) -> TraceError:
    if isinstance(e, MemoryError) or (isinstance(e, pa.ArrowException) and "memory" in str(e).lower()):
        return TraceError(f"{f}: ran out of memory decoding this file (corrupt, or larger than memory allows; "
                          f"{MEMORY_BUDGET_ENV} bounds what is attempted)")
    if isinstance(e, PermissionError):
        return TraceError(f"{f}: permission denied")
    return TraceError(f"{f}: truncated or corrupt Parquet file ({_short(e)})")


_READ_ERRORS = (pa.ArrowException, OSError, ValueError, IndexError, MemoryError)


def _check_schema(f: Path, got: pa.Schema, want: pa.Schema) -> None:
    for fld in want:
        idx = got.get_field_index(fld.name)
        if idx < 0:
            raise TraceError(f"{f}: wrong schema: missing column {fld.name!r}")
        g = got.field(idx).type
        if g != fld.type:
            if pa.types.is_fixed_size_list(g) and pa.types.is_fixed_size_list(fld.type):
                if g.value_type == fld.type.value_type:
                    raise TraceError(
                        f"{f}: shape disagrees with metadata: column {fld.name!r} holds {g.list_size} values "
                        f"per row, metadata implies {fld.type.list_size}"
                    )
            raise TraceError(f"{f}: wrong schema: column {fld.name!r} has type {g}, expected {fld.type}")


def _check_nulls(f: Path, data: pa.RecordBatch | pa.Table) -> None:
    for name, col in zip(data.column_names, data.columns, strict=True):
        chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
        for ch in chunks:
            nulls = ch.null_count
            if pa.types.is_fixed_size_list(ch.type):
                nulls += ch.values.null_count
            if nulls:
                raise TraceError(f"{f}: column {name!r} holds null values")


def _read_table(f: Path, schema: pa.Schema, row_bytes: int, budget: int | None, what: str) -> pa.Table:
    pf = _open_parquet(f, row_bytes, budget, what)
    _check_schema(f, pf.schema_arrow, schema)
    try:
        t = pf.read(columns=schema.names).select(schema.names).cast(schema)
    except _READ_ERRORS as e:
        raise _corrupt(f, e) from None
    _check_nulls(f, t)
    return t


def _request_file(df: Path) -> Path:
    return Path(str(df).rsplit(".", 2)[0] + ".requests.parquet")


def _read_requests(p: Path, data_files: list[Path], meta: TraceMeta, budget: int | None = None) -> Requests:
    tables, total = [], 0
    rb = _row_bytes("requests", meta)
    for df in data_files:
        rf = _request_file(df)
        if not (rf.exists() or rf.is_symlink()):
            raise TraceError(f"{rf}: missing request file for shard {df.name}")
        regular_file_size(rf, "request file")
        pf = _open_parquet(rf, rb, budget, "request file")
        total += pf.metadata.num_rows
        check_memory(total * rb, f"the request table ({total} rows)", rf, budget)
        tables.append(_read_table(rf, requests_schema(), rb, budget, "request file"))
    t = pa.concat_tables(tables) if tables else requests_schema().empty_table()
    rid = t.column("request_id").to_numpy().astype(np.int64)
    if len(np.unique(rid)) != len(rid):
        dup = rid[np.argsort(rid)][np.flatnonzero(np.diff(np.sort(rid)) == 0)[0]]
        raise TraceError(f"{p}: request_id {int(dup)} appears more than once in the request table")
    reqs = Requests(
        request_id=rid,
        domain=shared_strings(t.column("domain")),
        source=shared_strings(t.column("source")),
        prompt_len=t.column("prompt_len").to_numpy().astype(np.int32),
        gen_len=t.column("gen_len").to_numpy().astype(np.int32),
    )
    check_lengths(reqs.prompt_len, "prompt_len", f"{p}: request table")
    check_lengths(reqs.gen_len, "gen_len", f"{p}: request table")
    return reqs


def shared_strings(col: pa.ChunkedArray) -> np.ndarray:
    """object [R] of a string column, each distinct value one Python str shared by its rows (a request table's
    domain and source hold a few values over many rows: one str object per row cost ~60 bytes each, which grew
    with the trace)."""
    enc = col.dictionary_encode().combine_chunks() if len(col) else pa.array([], pa.string()).dictionary_encode()
    values = np.asarray(enc.dictionary.to_pylist() + [None], dtype=object)
    idx = enc.indices.fill_null(len(values) - 1).to_numpy(zero_copy_only=False).astype(np.int64)
    return values[idx]


def read_requests(path: str | os.PathLike, budget: int | None = None) -> Requests:
    """The request table of a trace (all shards)."""
    p = _trace_dir(path)
    meta = read_meta(p, budget)
    return _read_requests(p, shard_files(p, meta), meta, budget)


class _KnownRequests:
    """Membership test of token request ids against the request table (sorted ids, binary search)."""

    def __init__(self, request_id: np.ndarray) -> None:
        self.sorted = np.sort(np.asarray(request_id, np.int64))

    def check(self, rid: np.ndarray, f: Path) -> None:
        if not len(rid):
            return
        if not len(self.sorted):
            raise TraceError(f"{f}: token rows name request_id {int(rid[0])} but the request table is empty")
        i = np.clip(np.searchsorted(self.sorted, rid), 0, len(self.sorted) - 1)
        bad = self.sorted[i] != rid
        if bad.any():
            raise TraceError(f"{f}: token rows name request_id {int(rid[bad][0])} that is not in the request table")


def _light_arrays(batch: pa.RecordBatch, f: Path, known: _KnownRequests | None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rid = batch.column("request_id").to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    pos = batch.column("position").to_numpy(zero_copy_only=False)
    phase = batch.column("phase").to_numpy(zero_copy_only=False)
    check_phase(phase, f"{f}")
    check_positions(pos, f"{f}")
    if known is not None:
        known.check(rid, f)
    return rid, pos, phase


def _batch_to_chunk(batch: pa.RecordBatch, meta: TraceMeta, f: Path, known: _KnownRequests | None) -> TokenChunk:
    _check_nulls(f, batch)
    n = batch.num_rows
    L, K = meta.num_layers, meta.top_k
    rid, pos, phase = _light_arrays(batch, f, known)
    ids = batch.column("expert_ids").flatten().to_numpy(zero_copy_only=False).reshape(n, L, K)
    ids = check_expert_ids(ids, meta, where=f"{f}: expert_ids")
    w = None
    if meta.has_weights:
        w = batch.column("expert_weights").flatten().to_numpy(zero_copy_only=False).reshape(n, L, K)
    return TokenChunk(request_id=rid, position=pos, phase=phase, expert_ids=ids, expert_weights=w)


def _require_tokens(meta: TraceMeta, p: Path, what: str) -> None:
    if meta.kind != "tokens":
        raise TraceError(
            f"{p}: {what} needs a per-token trace, but this trace is counts-only (aggregate expert counts, "
            "e.g. from 'sglang-stat' or 'gpt-oss-summaries'); record or import per-token routing instead"
        )


def _select_shards(p: Path, files: list[Path], shards: Sequence[int] | None) -> list[Path]:
    if shards is None:
        return files
    bad = [i for i in shards if not 0 <= i < len(files)]
    if bad:
        raise TraceError(f"{p}: no shard {bad[0]} (the trace has {len(files)} shards)")
    return [files[i] for i in shards]


def _iter_token_batches(p: Path, meta: TraceMeta, columns: list[str], batch_rows: int, check_requests: bool,
                        budget: int | None, shards: Sequence[int] | None = None
                        ) -> Iterator[tuple[Path, pa.RecordBatch, _KnownRequests | None]]:
    files = shard_files(p, meta)
    known = _KnownRequests(_read_requests(p, files, meta, budget).request_id) if check_requests else None
    schema = tokens_schema(meta)
    rb = _row_bytes("tokens", meta, columns)
    for f in _select_shards(p, files, shards):
        pf = _open_parquet(f, rb, budget)
        _check_schema(f, pf.schema_arrow, schema)  # every column the metadata promises, even those not read
        try:
            for batch in pf.iter_batches(batch_size=batch_rows, columns=columns):
                yield f, batch, known
        except _READ_ERRORS as e:
            raise _corrupt(f, e) from None


def iter_token_chunks(
    path: str | os.PathLike,
    chunk_tokens: int = 65536,
    columns_weights: bool = True,
    check_requests: bool = True,
    budget: int | None = None,
    shards: Sequence[int] | None = None,
) -> Iterator[TokenChunk]:
    """Stream a per-token trace in chunks of at most ``chunk_tokens`` rows (bounded memory).

    Every chunk is validated: schema, shape, no nulls, expert ids in range and distinct within a token's top-k,
    phase, positions >= 0 and (``check_requests``) request ids present in the request table. Set
    ``columns_weights=False`` to skip reading routing weights. ``shards``: indices of the shards to read (in the
    order given; default all, in trace order), so that workers can each stream their own shards.
    """
    if chunk_tokens < 1:
        raise TraceError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    p = _trace_dir(path)
    meta = read_meta(p, budget)
    _require_tokens(meta, p, "reading token rows")
    cols = [c for c in tokens_schema(meta).names if columns_weights or c != "expert_weights"]
    m = meta if columns_weights else TraceMeta(**{**asdict(meta), "has_weights": False})
    check_memory(chunk_tokens * _row_bytes("tokens", meta, cols), f"a chunk of {chunk_tokens} token rows", p, budget)
    for f, batch, known in _iter_token_batches(p, meta, cols, chunk_tokens, check_requests, budget, shards):
        yield _batch_to_chunk(batch, m, f, known)


def iter_light_columns(
    source: str | os.PathLike | Trace,
    batch_rows: int = 1 << 20,
    check_requests: bool = True,
    budget: int | None = None,
    shards: Sequence[int] | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Stream ``(request_id int64 [T], position int32 [T], phase int8 [T])`` of every token, without routing.

    ``source`` is a trace directory (read in batches of ``batch_rows`` rows, with the same validation as
    :func:`iter_token_chunks`: footers against file sizes and the memory budget, schema, nulls, phase,
    positions >= 0, request ids in the request table; ``shards`` as there) or an in-memory :class:`Trace`
    (one batch).
    """
    if isinstance(source, Trace):
        if source.tokens is None:
            raise TraceError("iter_light_columns: this trace is counts-only (no token rows)")
        tk = source.tokens
        yield np.asarray(tk.request_id, np.int64), np.asarray(tk.position), np.asarray(tk.phase)
        return
    if batch_rows < 1:
        raise TraceError(f"batch_rows must be >= 1, got {batch_rows}")
    p = _trace_dir(source)
    meta = read_meta(p, budget)
    _require_tokens(meta, p, "reading token rows")
    cols = ["request_id", "position", "phase"]
    for f, batch, known in _iter_token_batches(p, meta, cols, batch_rows, check_requests, budget, shards):
        _check_nulls(f, batch)
        yield _light_arrays(batch, f, known)


def num_token_rows(path: str | os.PathLike, budget: int | None = None) -> int:
    """Token rows of a per-token trace, from the validated Parquet footers (nothing is decoded)."""
    return sum(shard_token_rows(path, budget))


def shard_token_rows(path: str | os.PathLike, budget: int | None = None) -> list[int]:
    """Token rows of each shard of a per-token trace, in trace order, from the validated Parquet footers (nothing
    is decoded): where each shard starts in trace order, for workers that each take some shards."""
    p = _trace_dir(path)
    meta = read_meta(p, budget)
    _require_tokens(meta, p, "counting token rows")
    rb = _row_bytes("tokens", meta, ["request_id", "position", "phase"])
    return [_open_parquet(f, rb, budget).metadata.num_rows for f in shard_files(p, meta)]


def shard_ranges(rows: list[int], tasks: int) -> list[tuple[int, ...]]:
    """About ``tasks`` ranges of consecutive shard indices with similar token counts (``rows``: token rows per
    shard, :func:`shard_token_rows`), in trace order; every shard in exactly one range, no range empty."""
    if not rows:
        return []
    total = max(sum(rows), 1)
    cuts: list[list[int]] = [[]]
    done = 0
    for i, n in enumerate(rows):
        if cuts[-1] and done >= total * len(cuts) / max(tasks, 1):
            cuts.append([])
        cuts[-1].append(i)
        done += n
    return [tuple(c) for c in cuts]


def _concat_chunks(chunks: list[TokenChunk], meta: TraceMeta) -> TokenChunk:
    if not chunks:
        L, K = meta.num_layers, meta.top_k
        return TokenChunk(
            np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int8), np.zeros((0, L, K), np.int16),
            np.zeros((0, L, K), np.float16) if meta.has_weights else None,
        )
    return TokenChunk(
        np.concatenate([c.request_id for c in chunks]),
        np.concatenate([c.position for c in chunks]),
        np.concatenate([c.phase for c in chunks]),
        np.concatenate([c.expert_ids for c in chunks]),
        None if chunks[0].expert_weights is None else np.concatenate([c.expert_weights for c in chunks]),
    )


def read_counts(path: str | os.PathLike, budget: int | None = None) -> Counts:
    """The count groups of a counts-only trace. Counts must be finite and >= 0; num_tokens >= 0 or NaN."""
    p = _trace_dir(path)
    meta = read_meta(p, budget)
    if meta.kind != "counts":
        raise TraceError(f"{p}: not a counts-only trace (kind={meta.kind!r}); use read_trace or counts_from_tokens")
    schema = counts_schema(meta)
    rb = _row_bytes("counts", meta)
    parts, total = [], 0
    for f in shard_files(p, meta):
        total += _open_parquet(f, rb, budget).metadata.num_rows
        check_memory(total * rb, f"the count groups ({total} rows)", f, budget)
        t = _read_table(f, schema, rb, budget, "trace shard")
        check_phase(t.column("phase").to_numpy(), f"{f}", allow_unknown=True)
        c = t.column("counts").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        if c.size and (not np.isfinite(c).all() or c.min() < 0):
            raise TraceError(f"{f}: column 'counts' holds NaN, infinite or negative counts")
        nt = t.column("num_tokens").to_numpy()
        if (nt[~np.isnan(nt)] < 0).any() or np.isinf(nt).any():
            raise TraceError(f"{f}: column 'num_tokens' holds negative or infinite values (NaN means unknown)")
        parts.append(t)
    t = pa.concat_tables(parts) if parts else schema.empty_table()
    n = t.num_rows
    return Counts(
        group=np.asarray(t.column("group").to_pylist(), dtype=object),
        domain=np.asarray(t.column("domain").to_pylist(), dtype=object),
        phase=t.column("phase").to_numpy().astype(np.int8),
        num_tokens=t.column("num_tokens").to_numpy().astype(np.float64),
        counts=t.column("counts").combine_chunks().flatten().to_numpy(zero_copy_only=False).reshape(
            n, meta.num_layers, meta.num_experts
        ),
    )


def read_trace(path: str | os.PathLike, check_requests: bool = True, budget: int | None = None) -> Trace:
    """Read a whole trace into memory (numpy arrays). For large traces stream with :func:`iter_token_chunks`.

    The rows claimed by the footers must fit the memory budget before anything is decoded.
    """
    p = _trace_dir(path)
    meta = read_meta(p, budget)
    reqs = _read_requests(p, shard_files(p, meta), meta, budget)
    if meta.kind == "counts":
        return Trace(meta, reqs, None, read_counts(p, budget))
    n = num_token_rows(p, budget)
    check_memory(n * _row_bytes("tokens", meta), f"the whole trace in memory ({n} token rows)", p, budget)
    chunks = list(iter_token_chunks(p, chunk_tokens=1 << 20, check_requests=check_requests, budget=budget))
    return Trace(meta, reqs, _concat_chunks(chunks, meta), None)


def sample_request_ids(request_id: np.ndarray, num: int, seed: int = 0) -> np.ndarray:
    """int64 [min(num, R)] a seeded subset of the request table's ids ``request_id`` (int [R]), in table order (the
    table order is the arrival order the simulator batches by, so a sample keeps it)."""
    rid = np.asarray(request_id, np.int64)
    if num < 1:
        raise TraceError(f"a request sample must hold at least 1 request, got {num}")
    if num >= len(rid):
        return rid.copy()
    keep = np.sort(np.random.default_rng([int(seed), 0x5A]).choice(len(rid), size=int(num), replace=False))
    return rid[keep]


def read_trace_sample(path: str | os.PathLike, num_requests: int, seed: int = 0, check_requests: bool = True,
                      budget: int | None = None) -> Trace:
    """The rows of a seeded sample of ``num_requests`` requests (:func:`sample_request_ids`), streamed shard by
    shard: what is held is the sample's rows, checked against the memory budget (counted by a first pass over the
    light columns) before any routing is decoded, plus one chunk. For commands that need their windows in memory
    (``compare``) on traces larger than it. A per-token trace only.
    """
    p = _trace_dir(path)
    meta = read_meta(p, budget)
    _require_tokens(meta, p, "sampling requests")
    reqs = _read_requests(p, shard_files(p, meta), meta, budget)
    keep = sample_request_ids(reqs.request_id, num_requests, seed)
    rows = 0
    for rid, _, _ in iter_light_columns(p, check_requests=check_requests, budget=budget):
        rows += int(np.isin(rid, keep).sum())
    check_memory(rows * _row_bytes("tokens", meta), f"the {len(keep)} sampled requests ({rows} token rows)", p,
                 budget)
    chunks = []
    step = max(1, min(1 << 16, rows))  # a chunk is never more than the sample itself
    for c in iter_token_chunks(p, chunk_tokens=step, check_requests=check_requests, budget=budget):
        m = np.isin(c.request_id, keep)
        if m.any():
            chunks.append(c.select(m))
    sel = np.isin(reqs.request_id, keep)
    sub = Requests(reqs.request_id[sel], reqs.domain[sel], reqs.source[sel], reqs.prompt_len[sel], reqs.gen_len[sel])
    return Trace(meta, sub, _concat_chunks(chunks, meta), None)


def trace_info(path: str | os.PathLike, budget: int | None = None) -> dict:
    """Summary of a trace without loading its routing: the keys of ``moeplace trace info --json``."""
    p = _trace_dir(path)
    meta = read_meta(p, budget)
    files = shard_files(p, meta)
    reqs = _read_requests(p, files, meta, budget)
    n_pre = n_dec = 0
    groups = None
    if meta.kind == "tokens":
        for f in files:  # the routing column's footer is checked too, though only phase is decoded
            pf = _open_parquet(f, _row_bytes("tokens", meta), budget)
            _check_schema(f, pf.schema_arrow, tokens_schema(meta))
        for _, _, ph in iter_light_columns(p, budget=budget):
            n_dec += int((ph == DECODE).sum())
            n_pre += int((ph == PREFILL).sum())
    else:
        c = read_counts(p, budget)
        groups = len(c)
        finite = np.isfinite(c.num_tokens)
        n_pre = float(c.num_tokens[finite & (c.phase == PREFILL)].sum())
        n_dec = float(c.num_tokens[finite & (c.phase == DECODE)].sum())
    domains: dict[str, int] = {}
    for d in reqs.domain.tolist():
        domains[d] = domains.get(d, 0) + 1
    size = sum(f.stat().st_size for f in p.iterdir() if f.is_file())
    info = {
        "path": str(p),
        "model": meta.model,
        "kind": meta.kind,
        "synthetic": meta.synthetic,
        "complete": meta.complete,
        "num_layers": meta.num_layers,
        "num_experts": meta.num_experts,
        "top_k": meta.top_k,
        "num_shared_experts": meta.num_shared_experts,
        "hidden_size": meta.hidden_size,
        "sampling_rate": meta.sampling_rate,
        "foe_groups": meta.foe_groups,
        "num_requests": len(reqs),
        "num_tokens": {"prefill": n_pre, "decode": n_dec},
        "domains": dict(sorted(domains.items())),
        "num_shards": len(files),
        "size_bytes": size,
        "source": meta.source,
    }
    if groups is not None:
        info["num_count_groups"] = groups
    return info
