"""The moeplace trace store: sharded, compressed Parquet files plus one JSON metadata file.

Shape legend: T = tokens, L = MoE layers, K = top-k, E = logical experts, R = requests, G = count groups.

A trace is a directory::

    TRACE/
      meta.json                      TraceMeta as JSON (format_version, model, L, E, K, ...)
      part-00000.requests.parquet    requests first seen in shard 0
      part-00000.tokens.parquet      tokens of shard 0 (kind "tokens")
      part-00000.counts.parquet      count groups of shard 0 (kind "counts")
      ...

Token files have the columns ``request_id`` int64, ``position`` int32, ``phase`` int8 (0 prefill, 1 decode),
``expert_ids`` fixed_size_list<int16>[L*K] (router order, layer-major) and optionally ``expert_weights``
fixed_size_list<float16>[L*K]. Request files have ``request_id`` int64, ``domain`` string, ``source`` string,
``prompt_len`` int32, ``gen_len`` int32. Count files (counts-only traces, e.g. imported aggregate statistics)
have ``group`` string, ``domain`` string, ``phase`` int8 (-1: both or unknown), ``num_tokens`` float64 and
``counts`` fixed_size_list<float64>[L*E] (token-expert selections per layer and expert).

Each shard is written to a temporary name and renamed into place (requests first, then the data file), so a
reader never accepts a half-written shard: a shard exists once its data file exists. Any tool that reads Parquet
can read a trace without moeplace (see docs/TRACE_FORMAT.md).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moeplace.io import atomic_write_json

FORMAT_VERSION = 1
PHASES = ("prefill", "decode")
PREFILL, DECODE = 0, 1
KINDS = ("tokens", "counts")
META_FILE = "meta.json"
DEFAULT_SHARD_TOKENS = 1 << 18  # tokens per shard; bounds writer memory (~L*K*4 bytes each)
_COMPRESSION = "zstd"


class TraceError(ValueError):
    """A trace that cannot be read or written as asked; the message names the file and the problem."""


@dataclass
class TraceMeta:
    """What a trace records. Field names follow docs/MODEL.md."""

    model: str  # model name or path, e.g. "openai/gpt-oss-20b"
    num_layers: int  # L: MoE layers (dense layers not counted)
    num_experts: int  # E: routed (logical) experts per layer
    top_k: int  # K: experts each token selects per layer
    num_shared_experts: int = 0  # experts every token runs on its own GPU (no all-to-all)
    hidden_size: int | None = None  # model hidden size (bytes per token sent = hidden_size * bytes/elem)
    moe_layer_map: list[int] | None = None  # [L]: MoE layer l -> the model's own layer index
    sampling_rate: float = 1.0  # fraction of requests recorded (record 1 in n -> 1/n)
    kind: str = "tokens"  # "tokens" (per-token routing) or "counts" (aggregate counts only)
    has_weights: bool = False  # whether token files carry expert_weights
    synthetic: bool = False  # True for generated workloads; never pass synthetic data off as real
    source: str = ""  # where the routing came from (capture, importer and file, generator)
    complete: bool = False  # set when the writer closed cleanly
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)  # free-form provenance (licenses, dataset names, ...)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "top_k"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise TraceError(f"trace metadata: {name} must be a positive integer, got {v!r}")
        if self.top_k > self.num_experts:
            raise TraceError(f"trace metadata: top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.num_experts > np.iinfo(np.int16).max:
            raise TraceError(f"trace metadata: num_experts={self.num_experts} does not fit int16 expert ids")
        if self.kind not in KINDS:
            raise TraceError(f"trace metadata: kind must be one of {KINDS}, got {self.kind!r}")
        if not 0.0 < float(self.sampling_rate) <= 1.0:
            raise TraceError(f"trace metadata: sampling_rate must be in (0, 1], got {self.sampling_rate!r}")
        if self.moe_layer_map is not None and len(self.moe_layer_map) != self.num_layers:
            raise TraceError(
                f"trace metadata: moe_layer_map has {len(self.moe_layer_map)} entries, expected {self.num_layers}"
            )

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict, where: str = "meta.json") -> TraceMeta:
        if not isinstance(d, dict):
            raise TraceError(f"{where}: expected a JSON object")
        version = d.get("format_version")
        if not isinstance(version, int):
            raise TraceError(f"{where}: missing or invalid format_version")
        if version > FORMAT_VERSION:
            raise TraceError(
                f"{where}: format_version {version} is newer than this moeplace reads ({FORMAT_VERSION}); "
                "upgrade moeplace"
            )
        known = {f.name for f in fields(cls)}
        missing = [k for k in ("model", "num_layers", "num_experts", "top_k") if k not in d]
        if missing:
            raise TraceError(f"{where}: missing required keys {missing}")
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class Requests:
    """Request table. All arrays have shape [R]."""

    request_id: np.ndarray  # int64 [R]
    domain: np.ndarray  # object (str) [R]
    source: np.ndarray  # object (str) [R]
    prompt_len: np.ndarray  # int32 [R]
    gen_len: np.ndarray  # int32 [R]

    def __len__(self) -> int:
        return len(self.request_id)

    def domain_of(self) -> dict[int, str]:
        return dict(zip(self.request_id.tolist(), self.domain.tolist(), strict=True))


@dataclass
class TokenChunk:
    """A batch of token rows. Routing is layer-major: ``expert_ids[t, l, j]`` is token t's j-th expert in layer l."""

    request_id: np.ndarray  # int64 [T]
    position: np.ndarray  # int32 [T]
    phase: np.ndarray  # int8 [T], 0 = prefill, 1 = decode
    expert_ids: np.ndarray  # int16 [T, L, K]
    expert_weights: np.ndarray | None = None  # float16 [T, L, K]

    def __len__(self) -> int:
        return len(self.request_id)

    def select(self, mask_or_index: np.ndarray) -> TokenChunk:
        w = None if self.expert_weights is None else self.expert_weights[mask_or_index]
        return TokenChunk(
            self.request_id[mask_or_index],
            self.position[mask_or_index],
            self.phase[mask_or_index],
            self.expert_ids[mask_or_index],
            w,
        )


@dataclass
class Counts:
    """Counts-only rows: token-expert selections aggregated over a group of tokens."""

    group: np.ndarray  # object (str) [G]: a name for the group (dataset/category, forward pass, ...)
    domain: np.ndarray  # object (str) [G]
    phase: np.ndarray  # int8 [G]: 0 prefill, 1 decode, -1 both or unknown
    num_tokens: np.ndarray  # float64 [G]: tokens aggregated (NaN if unknown)
    counts: np.ndarray  # float64 [G, L, E]

    def __len__(self) -> int:
        return len(self.group)


@dataclass
class Trace:
    """A whole trace in memory (for small traces; use :func:`iter_token_chunks` for large ones)."""

    meta: TraceMeta
    requests: Requests
    tokens: TokenChunk | None  # None for counts-only traces
    counts: Counts | None = None  # None for per-token traces


# --------------------------------------------------------------------------------------------------- schemas


def _requests_schema() -> pa.Schema:
    return pa.schema(
        [
            ("request_id", pa.int64()),
            ("domain", pa.string()),
            ("source", pa.string()),
            ("prompt_len", pa.int32()),
            ("gen_len", pa.int32()),
        ]
    )


def _tokens_schema(meta: TraceMeta) -> pa.Schema:
    lk = meta.num_layers * meta.top_k
    cols = [
        ("request_id", pa.int64()),
        ("position", pa.int32()),
        ("phase", pa.int8()),
        ("expert_ids", pa.list_(pa.int16(), lk)),
    ]
    if meta.has_weights:
        cols.append(("expert_weights", pa.list_(pa.float16(), lk)))
    return pa.schema(cols)


def _counts_schema(meta: TraceMeta) -> pa.Schema:
    return pa.schema(
        [
            ("group", pa.string()),
            ("domain", pa.string()),
            ("phase", pa.int8()),
            ("num_tokens", pa.float64()),
            ("counts", pa.list_(pa.float64(), meta.num_layers * meta.num_experts)),
        ]
    )


def _data_suffix(meta: TraceMeta) -> str:
    return ".tokens.parquet" if meta.kind == "tokens" else ".counts.parquet"


# --------------------------------------------------------------------------------------------------- validation


def _as_1d(name: str, a, dtype, n: int | None = None) -> np.ndarray:
    arr = np.asarray(a)
    if arr.ndim != 1:
        raise TraceError(f"{name}: expected a 1-D array, got shape {arr.shape}")
    if n is not None and len(arr) != n:
        raise TraceError(f"{name}: expected {n} entries, got {len(arr)}")
    if np.dtype(dtype).kind in "iu" and arr.size and arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.all(arr == np.round(arr)):
            pass
        else:
            raise TraceError(f"{name}: expected integers, got dtype {arr.dtype}")
    return arr.astype(dtype, copy=False)


def check_expert_ids(expert_ids: np.ndarray, meta: TraceMeta, where: str = "expert_ids") -> np.ndarray:
    """Validate routing ids against the metadata; returns them as int16 [T, L, K]."""
    ids = np.asarray(expert_ids)
    want = (meta.num_layers, meta.top_k)
    if ids.ndim != 3 or ids.shape[1:] != want:
        raise TraceError(
            f"{where}: expected shape [tokens, {want[0]}, {want[1]}] (L, K from metadata), got {ids.shape}"
        )
    if ids.dtype.kind not in "iu":
        raise TraceError(f"{where}: expected integer expert ids, got dtype {ids.dtype}")
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= meta.num_experts:
            bad = lo if lo < 0 else hi
            raise TraceError(f"{where}: expert id {bad} out of range [0, {meta.num_experts})")
    return ids.astype(np.int16, copy=False)


def _check_phase(phase: np.ndarray, where: str, allow_unknown: bool = False) -> None:
    ok = (phase == PREFILL) | (phase == DECODE)
    if allow_unknown:
        ok |= phase == -1
    if not ok.all():
        raise TraceError(f"{where}: phase must be 0 (prefill) or 1 (decode), found {int(phase[~ok][0])}")


# --------------------------------------------------------------------------------------------------- writer


def _atomic_write_table(table: pa.Table, dest: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    try:
        pq.write_table(table, tmp, compression=_COMPRESSION)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _fixed_list(flat: np.ndarray, size: int, pa_type: pa.DataType) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(flat).ravel(), type=pa_type), size)


class TraceWriter:
    """Streams a trace to disk in atomic shards, in bounded memory.

    Use as a context manager::

        with TraceWriter("out.trace", meta) as w:
            w.add_requests([0], domain=["code"], prompt_len=[12], gen_len=[8])
            w.add_tokens(request_id, position, phase, expert_ids)   # [T], [T], [T], [T, L, K]

    A shard is flushed every ``shard_tokens`` token rows (or count groups). On an exception (Ctrl-C included)
    the rows already validated are flushed as a last shard and ``meta.complete`` stays False; no half-written
    file is ever left under a name readers accept. An existing non-empty directory is refused unless
    ``overwrite=True``; then the new trace is built beside it and swapped in only when it closes cleanly.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        meta: TraceMeta,
        shard_tokens: int = DEFAULT_SHARD_TOKENS,
        overwrite: bool = False,
    ) -> None:
        if shard_tokens < 1:
            raise TraceError(f"shard_tokens must be >= 1, got {shard_tokens}")
        self.final_path = Path(path)
        self.meta = TraceMeta(**{**asdict(meta), "complete": False, "format_version": FORMAT_VERSION})
        self.shard_tokens = shard_tokens
        self._swap = False
        if self.final_path.exists():
            if not self.final_path.is_dir():
                raise TraceError(f"{self.final_path}: exists and is not a trace directory")
            if any(self.final_path.iterdir()):
                if not overwrite:
                    raise TraceError(f"{self.final_path}: already exists and is not empty (use overwrite)")
                self._swap = True
        if self._swap:
            self.path = Path(tempfile.mkdtemp(prefix=f".{self.final_path.name}.new-", dir=self.final_path.parent))
        else:
            self.path = self.final_path
            self.path.mkdir(parents=True, exist_ok=True)
        self._shard = 0
        self._req: list[pa.Table] = []
        self._data: list[pa.Table] = []
        self._rows = 0
        self.num_tokens = 0
        self._closed = False
        atomic_write_json(self.meta.to_json(), self.path / META_FILE, indent=2)

    # -- context manager
    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def add_requests(
        self,
        request_id: Sequence[int] | np.ndarray,
        domain: Sequence[str] | np.ndarray | None = None,
        source: Sequence[str] | np.ndarray | None = None,
        prompt_len: Sequence[int] | np.ndarray | None = None,
        gen_len: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        """Add request rows (all arguments [R]; missing domain -> "unknown", lengths -> 0)."""
        self._check_open()
        rid = _as_1d("request_id", request_id, np.int64)
        n = len(rid)
        dom = np.asarray(["unknown"] * n if domain is None else list(domain), dtype=object)
        src = np.asarray([""] * n if source is None else list(source), dtype=object)
        pl = _as_1d("prompt_len", np.zeros(n) if prompt_len is None else prompt_len, np.int32, n)
        gl = _as_1d("gen_len", np.zeros(n) if gen_len is None else gen_len, np.int32, n)
        if len(dom) != n or len(src) != n:
            raise TraceError(f"add_requests: domain/source must have {n} entries like request_id")
        self._req.append(
            pa.table(
                [pa.array(rid), pa.array(dom.tolist(), pa.string()), pa.array(src.tolist(), pa.string()),
                 pa.array(pl), pa.array(gl)],
                schema=_requests_schema(),
            )
        )

    def add_tokens(
        self,
        request_id: np.ndarray,
        position: np.ndarray,
        phase: np.ndarray,
        expert_ids: np.ndarray,
        expert_weights: np.ndarray | None = None,
    ) -> None:
        """Add token rows: request_id, position, phase [T]; expert_ids (and weights) [T, L, K]."""
        self._check_open()
        if self.meta.kind != "tokens":
            raise TraceError("add_tokens: this trace is counts-only (kind='counts'); use add_counts")
        ids = check_expert_ids(expert_ids, self.meta)
        t = ids.shape[0]
        rid = _as_1d("request_id", request_id, np.int64, t)
        pos = _as_1d("position", position, np.int32, t)
        ph = _as_1d("phase", phase, np.int8, t)
        _check_phase(ph, "add_tokens")
        w = None
        if self.meta.has_weights:
            if expert_weights is None:
                raise TraceError("add_tokens: metadata says has_weights=True but no expert_weights were given")
            w = np.asarray(expert_weights)
            if w.shape != ids.shape:
                raise TraceError(f"expert_weights: shape {w.shape} differs from expert_ids {ids.shape}")
            w = w.astype(np.float16, copy=False)
        elif expert_weights is not None:
            raise TraceError("add_tokens: expert_weights given but metadata says has_weights=False")
        lk = self.meta.num_layers * self.meta.top_k
        start = 0
        while start < t:  # split at shard boundaries so no shard exceeds shard_tokens rows
            end = min(t, start + self.shard_tokens - self._rows)
            sl = slice(start, end)
            cols = [pa.array(rid[sl]), pa.array(pos[sl]), pa.array(ph[sl]), _fixed_list(ids[sl], lk, pa.int16())]
            if w is not None:
                cols.append(_fixed_list(w[sl], lk, pa.float16()))
            self._data.append(pa.table(cols, schema=_tokens_schema(self.meta)))
            self._rows += end - start
            self.num_tokens += end - start
            if self._rows >= self.shard_tokens:
                self.flush()
            start = end

    def add_counts(
        self,
        group: Sequence[str],
        domain: Sequence[str],
        phase: np.ndarray,
        num_tokens: np.ndarray,
        counts: np.ndarray,
    ) -> None:
        """Add counts-only groups: group, domain, phase, num_tokens [G]; counts [G, L, E]."""
        self._check_open()
        if self.meta.kind != "counts":
            raise TraceError("add_counts: this trace is per-token (kind='tokens'); use add_tokens")
        c = np.asarray(counts, dtype=np.float64)
        want = (self.meta.num_layers, self.meta.num_experts)
        if c.ndim != 3 or c.shape[1:] != want:
            raise TraceError(f"counts: expected shape [groups, {want[0]}, {want[1]}], got {c.shape}")
        g = c.shape[0]
        ph = _as_1d("phase", phase, np.int8, g)
        _check_phase(ph, "add_counts", allow_unknown=True)
        nt = _as_1d("num_tokens", num_tokens, np.float64, g)
        grp, dom = list(group), list(domain)
        if len(grp) != g or len(dom) != g:
            raise TraceError(f"add_counts: group and domain must have {g} entries")
        if np.any(c[np.isfinite(c)] < 0):
            raise TraceError("counts: negative count")
        self._data.append(
            pa.table(
                [pa.array(grp, pa.string()), pa.array(dom, pa.string()), pa.array(ph), pa.array(nt),
                 _fixed_list(c, want[0] * want[1], pa.float64())],
                schema=_counts_schema(self.meta),
            )
        )
        self._rows += g
        self.num_tokens += g
        if self._rows >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        """Write buffered rows as one shard (requests file first, then the data file)."""
        if not self._req and not self._data:
            return
        stem = self.path / f"part-{self._shard:05d}"
        data_schema = _tokens_schema(self.meta) if self.meta.kind == "tokens" else _counts_schema(self.meta)
        req = pa.concat_tables(self._req) if self._req else _requests_schema().empty_table()
        data = pa.concat_tables(self._data) if self._data else data_schema.empty_table()
        _atomic_write_table(req, Path(f"{stem}.requests.parquet"))
        _atomic_write_table(data, Path(f"{stem}{_data_suffix(self.meta)}"))
        self._shard += 1
        self._req, self._data, self._rows = [], [], 0

    def close(self) -> None:
        """Flush the last shard and mark the trace complete."""
        if self._closed:
            return
        self.flush()
        self.meta.complete = True
        atomic_write_json(self.meta.to_json(), self.path / META_FILE, indent=2)
        self._closed = True
        if self._swap:
            backup = self.final_path.with_name(f".{self.final_path.name}.old-{os.getpid()}")
            os.replace(self.final_path, backup)
            os.replace(self.path, self.final_path)
            shutil.rmtree(backup, ignore_errors=True)
            self.path = self.final_path

    def abort(self) -> None:
        """Keep what was validated (as a last shard) but leave the trace marked incomplete."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise TraceError(f"{self.final_path}: writer is closed")


def write_trace(path: str | os.PathLike, trace: Trace, overwrite: bool = False,
                shard_tokens: int = DEFAULT_SHARD_TOKENS) -> Path:
    """Write an in-memory :class:`Trace` to ``path``; returns the path."""
    with TraceWriter(path, trace.meta, shard_tokens=shard_tokens, overwrite=overwrite) as w:
        r = trace.requests
        w.add_requests(r.request_id, r.domain, r.source, r.prompt_len, r.gen_len)
        if trace.meta.kind == "tokens":
            tk = trace.tokens
            if tk is None:
                raise TraceError("write_trace: a per-token trace needs tokens")
            step = max(1, shard_tokens)
            for s in range(0, max(len(tk), 1), step):
                sl = slice(s, s + step)
                w.add_tokens(tk.request_id[sl], tk.position[sl], tk.phase[sl], tk.expert_ids[sl],
                             None if tk.expert_weights is None else tk.expert_weights[sl])
        else:
            c = trace.counts
            if c is None:
                raise TraceError("write_trace: a counts-only trace needs counts")
            w.add_counts(c.group, c.domain, c.phase, c.num_tokens, c.counts)
    return Path(path)


# --------------------------------------------------------------------------------------------------- reader


def _trace_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{p}: no such trace (path does not exist)")
    if not p.is_dir():
        raise TraceError(f"{p}: not a trace directory (a moeplace trace is a directory with meta.json)")
    return p


def read_meta(path: str | os.PathLike) -> TraceMeta:
    """Read and validate ``meta.json`` of a trace directory."""
    p = _trace_dir(path)
    mf = p / META_FILE
    if not mf.exists():
        raise TraceError(f"{p}: not a moeplace trace (no {META_FILE})")
    try:
        d = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"{mf}: corrupt metadata ({e})") from None
    try:
        return TraceMeta.from_json(d, where=str(mf))
    except TypeError as e:
        raise TraceError(f"{mf}: invalid metadata ({e})") from None


def shard_files(path: str | os.PathLike, meta: TraceMeta | None = None) -> list[Path]:
    """Data files of the committed shards, in order."""
    p = _trace_dir(path)
    meta = meta or read_meta(p)
    return sorted(p.glob(f"part-*{_data_suffix(meta)}"))


def _open_parquet(f: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:
        raise TraceError(f"{f}: truncated or corrupt Parquet file ({e})") from None


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


def _read_requests(p: Path, data_files: list[Path]) -> Requests:
    tables = []
    for df in data_files:
        rf = Path(str(df).rsplit(".", 2)[0] + ".requests.parquet")
        if not rf.exists():
            raise TraceError(f"{rf}: missing request file for shard {df.name}")
        pf = _open_parquet(rf)
        _check_schema(rf, pf.schema_arrow, _requests_schema())
        try:
            tables.append(pf.read().select(_requests_schema().names).cast(_requests_schema()))
        except (pa.ArrowException, OSError) as e:
            raise TraceError(f"{rf}: truncated or corrupt Parquet file ({e})") from None
    t = pa.concat_tables(tables) if tables else _requests_schema().empty_table()
    rid = t.column("request_id").to_numpy().astype(np.int64)
    if len(np.unique(rid)) != len(rid):
        dup = rid[np.argsort(rid)][np.flatnonzero(np.diff(np.sort(rid)) == 0)[0]]
        raise TraceError(f"{p}: request_id {int(dup)} appears more than once in the request table")
    return Requests(
        request_id=rid,
        domain=np.asarray(t.column("domain").to_pylist(), dtype=object),
        source=np.asarray(t.column("source").to_pylist(), dtype=object),
        prompt_len=t.column("prompt_len").to_numpy().astype(np.int32),
        gen_len=t.column("gen_len").to_numpy().astype(np.int32),
    )


def read_requests(path: str | os.PathLike) -> Requests:
    """The request table of a trace (all shards)."""
    p = _trace_dir(path)
    meta = read_meta(p)
    return _read_requests(p, shard_files(p, meta))


def _batch_to_chunk(batch: pa.RecordBatch, meta: TraceMeta, f: Path) -> TokenChunk:
    n = batch.num_rows
    L, K = meta.num_layers, meta.top_k
    ids = batch.column("expert_ids").flatten().to_numpy(zero_copy_only=False).reshape(n, L, K)
    ids = check_expert_ids(ids, meta, where=f"{f}: expert_ids")
    phase = batch.column("phase").to_numpy(zero_copy_only=False)
    _check_phase(phase, f"{f}")
    w = None
    if meta.has_weights:
        w = batch.column("expert_weights").flatten().to_numpy(zero_copy_only=False).reshape(n, L, K)
    return TokenChunk(
        request_id=batch.column("request_id").to_numpy(zero_copy_only=False),
        position=batch.column("position").to_numpy(zero_copy_only=False),
        phase=phase,
        expert_ids=ids,
        expert_weights=w,
    )


def _require_tokens(meta: TraceMeta, p: Path, what: str) -> None:
    if meta.kind != "tokens":
        raise TraceError(
            f"{p}: {what} needs a per-token trace, but this trace is counts-only (aggregate expert counts, "
            "e.g. from 'sglang-stat' or 'gpt-oss-summaries'); record or import per-token routing instead"
        )


def iter_token_chunks(
    path: str | os.PathLike,
    chunk_tokens: int = 65536,
    columns_weights: bool = True,
) -> Iterator[TokenChunk]:
    """Stream a per-token trace in chunks of at most ``chunk_tokens`` rows (bounded memory).

    Every chunk is validated (schema, shape, expert id range, phase). Set ``columns_weights=False`` to skip
    reading routing weights.
    """
    p = _trace_dir(path)
    meta = read_meta(p)
    _require_tokens(meta, p, "reading token rows")
    schema = _tokens_schema(meta)
    cols = [c for c in schema.names if columns_weights or c != "expert_weights"]
    m = meta if columns_weights else TraceMeta(**{**asdict(meta), "has_weights": False})
    for f in shard_files(p, meta):
        pf = _open_parquet(f)
        _check_schema(f, pf.schema_arrow, schema)
        try:
            for batch in pf.iter_batches(batch_size=chunk_tokens, columns=cols):
                yield _batch_to_chunk(batch, m, f)
        except (pa.ArrowException, OSError) as e:
            raise TraceError(f"{f}: truncated or corrupt Parquet file ({e})") from None


def iter_light_columns(path: str | os.PathLike, chunk_tokens: int = 1 << 20
                       ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Stream ``(request_id int64 [n], position [n], phase [n])`` of every token row, without the routing columns.

    The same checks as :func:`iter_token_chunks` (schema per shard, corrupt files named); for the simulator's
    first pass, which needs only where each token sits.
    """
    p = _trace_dir(path)
    meta = read_meta(p)
    _require_tokens(meta, p, "reading token rows")
    schema = _tokens_schema(meta)
    cols = ["request_id", "position", "phase"]
    for f in shard_files(p, meta):
        pf = _open_parquet(f)
        _check_schema(f, pf.schema_arrow, schema)
        try:
            for b in pf.iter_batches(batch_size=chunk_tokens, columns=cols):
                ph = b.column("phase").to_numpy()
                _check_phase(ph, str(f))
                yield b.column("request_id").to_numpy().astype(np.int64), b.column("position").to_numpy(), ph
        except (pa.ArrowException, OSError) as e:
            raise TraceError(f"{f}: truncated or corrupt Parquet file ({e})") from None


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


def read_counts(path: str | os.PathLike) -> Counts:
    """The count groups of a counts-only trace."""
    p = _trace_dir(path)
    meta = read_meta(p)
    if meta.kind != "counts":
        raise TraceError(f"{p}: not a counts-only trace (kind={meta.kind!r}); use read_trace or counts_from_tokens")
    schema = _counts_schema(meta)
    parts = []
    for f in shard_files(p, meta):
        pf = _open_parquet(f)
        _check_schema(f, pf.schema_arrow, schema)
        try:
            parts.append(pf.read().select(schema.names).cast(schema))
        except (pa.ArrowException, OSError) as e:
            raise TraceError(f"{f}: truncated or corrupt Parquet file ({e})") from None
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


def read_trace(path: str | os.PathLike, check_requests: bool = True) -> Trace:
    """Read a whole trace into memory (numpy arrays). For large traces stream with :func:`iter_token_chunks`."""
    p = _trace_dir(path)
    meta = read_meta(p)
    reqs = _read_requests(p, shard_files(p, meta))
    if meta.kind == "counts":
        return Trace(meta, reqs, None, read_counts(p))
    tokens = _concat_chunks(list(iter_token_chunks(p, chunk_tokens=1 << 20)), meta)
    if check_requests and len(tokens):
        unknown = np.setdiff1d(np.unique(tokens.request_id), reqs.request_id)
        if len(unknown):
            raise TraceError(f"{p}: token rows name request_id {int(unknown[0])} that is not in the request table")
    return Trace(meta, reqs, tokens, None)


def trace_info(path: str | os.PathLike) -> dict:
    """Summary of a trace without loading its routing: the keys of ``moeplace trace info --json``."""
    p = _trace_dir(path)
    meta = read_meta(p)
    files = shard_files(p, meta)
    reqs = _read_requests(p, files)
    n_pre = n_dec = 0
    groups = None
    if meta.kind == "tokens":
        for f in files:
            pf = _open_parquet(f)
            _check_schema(f, pf.schema_arrow, _tokens_schema(meta))
            try:
                ph = pf.read(columns=["phase"]).column("phase").to_numpy()
            except (pa.ArrowException, OSError) as e:
                raise TraceError(f"{f}: truncated or corrupt Parquet file ({e})") from None
            n_dec += int((ph == DECODE).sum())
            n_pre += int((ph == PREFILL).sum())
    else:
        c = read_counts(p)
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
