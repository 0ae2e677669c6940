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

Every reader here validates before it allocates: ``meta.json`` must be a small regular file with values of the
right types in sane ranges, and the row counts claimed by Parquet footers must fit the files' sizes and the memory
budget (:func:`memory_budget`). Whatever is wrong raises :class:`TraceError` naming the file (docs/RELIABILITY.md).
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import stat
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moeplace.io import (
    OutputError,
    atomic_write_json,
    atomic_write_with,
    make_dirs,
    make_temp_dir,
    remove_stale,
    stale_paths,
    temp_path,
)

FORMAT_VERSION = 1
PHASES = ("prefill", "decode")
PREFILL, DECODE = 0, 1
KINDS = ("tokens", "counts")
META_FILE = "meta.json"
WRITTEN_BY = "moeplace"  # meta.json "written_by": marks a folder --overwrite may replace
DEFAULT_SHARD_TOKENS = 1 << 18  # tokens per shard; bounds writer memory (~L*K*4 bytes each)
_COMPRESSION = "zstd"

# Limits checked before anything is allocated (docs/RELIABILITY.md).
META_MAX_BYTES = 1 << 20  # meta.json larger than this is refused unread
MAX_LAYERS = 4096  # L
MAX_EXPERTS = int(np.iinfo(np.int16).max)  # E: expert ids are int16
MAX_TOP_K = 1024  # K
MAX_SHARED_EXPERTS = 4096
MAX_HIDDEN_SIZE = 1 << 20
MAX_LAYER_INDEX = 1 << 20  # entries of moe_layer_map
MAX_ROWS_PER_BYTE = 4096  # a Parquet file cannot hold more rows than this per byte (measured: < 300)
MEMORY_BUDGET_ENV = "MOEPLACE_MEMORY_BUDGET"  # bytes (suffixes K, M, G allowed) a reader may allocate
DEFAULT_MEMORY_BUDGET = 8 << 30


class TraceError(ValueError):
    """A trace that cannot be read or written as asked; the message names the file and the problem."""


def _parse_bytes(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMGT" and t else t
    try:
        v = float(num)
    except ValueError:
        raise TraceError(f"{MEMORY_BUDGET_ENV}={text!r}: expected a number of bytes such as 4G or 512M") from None
    if not math.isfinite(v) or v <= 0:
        raise TraceError(f"{MEMORY_BUDGET_ENV}={text!r}: must be a positive number of bytes")
    return int(v * mult)


def memory_budget(budget: int | None = None) -> int:
    """Bytes a trace reader may allocate at once.

    ``budget`` if given; else the environment variable ``MOEPLACE_MEMORY_BUDGET`` (e.g. ``4G``); else the
    smallest of 8 GiB, half the physical memory and half the address-space limit (``ulimit -v``).
    """
    if budget is not None:
        if budget <= 0:
            raise TraceError(f"memory budget must be positive, got {budget}")
        return int(budget)
    env = os.environ.get(MEMORY_BUDGET_ENV)
    if env:
        return _parse_bytes(env)
    out = DEFAULT_MEMORY_BUDGET
    try:
        out = min(out, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)
    except (ValueError, OSError, AttributeError):
        pass
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        out = min(out, soft // 2)
    return max(out, 1 << 20)


def check_memory(nbytes: float, what: str, where: str | os.PathLike, budget: int | None = None) -> None:
    """Raise TraceError naming ``where`` if ``nbytes`` (what ``what`` would allocate) exceeds the memory budget."""
    b = memory_budget(budget)
    if nbytes > b:
        raise TraceError(f"{where}: {what} would need {nbytes / (1 << 30):.2f} GiB, over the memory budget of "
                         f"{b / (1 << 30):.2f} GiB (set {MEMORY_BUDGET_ENV} to raise it if this file is genuine)")


def _int_value(name: str, v, lo: int, hi: int) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TraceError(f"{name} must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise TraceError(f"{name} must be in [{lo}, {hi}], got {v}")
    return int(v)


def _of_type(name: str, v, types: tuple, what: str):
    if not isinstance(v, types) or (isinstance(v, (bool, np.bool_)) and bool not in types):
        raise TraceError(f"{name} must be {what}, got {v!r}")
    return v


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
    written_by: str = ""  # "moeplace" when TraceWriter made the folder: only then may --overwrite replace it
    foe_groups: int = 1  # H: Federation-of-Experts groups (1 = plain MoE); H > 1: ids ordered group by group

    def __post_init__(self) -> None:
        try:
            self._validate()
        except TraceError as e:
            raise TraceError(f"trace metadata: {e}") from None

    def _validate(self) -> None:
        _of_type("model", self.model, (str,), "a string")
        self.num_layers = _int_value("num_layers", self.num_layers, 1, MAX_LAYERS)
        self.num_experts = _int_value("num_experts", self.num_experts, 1, MAX_EXPERTS)
        if not isinstance(self.top_k, bool) and isinstance(self.top_k, (int, np.integer)) \
                and self.top_k > self.num_experts:
            raise TraceError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        self.top_k = _int_value("top_k", self.top_k, 1, min(MAX_TOP_K, self.num_experts))
        self.num_shared_experts = _int_value("num_shared_experts", self.num_shared_experts, 0, MAX_SHARED_EXPERTS)
        if self.hidden_size is not None:
            self.hidden_size = _int_value("hidden_size", self.hidden_size, 1, MAX_HIDDEN_SIZE)
        if self.moe_layer_map is not None:
            lm = _of_type("moe_layer_map", self.moe_layer_map, (list, tuple), "a list of layer indices")
            if len(lm) != self.num_layers:
                raise TraceError(f"moe_layer_map has {len(lm)} entries, expected {self.num_layers}")
            self.moe_layer_map = [_int_value("moe_layer_map entry", v, 0, MAX_LAYER_INDEX) for v in lm]
        sr = _of_type("sampling_rate", self.sampling_rate, (int, float, np.floating, np.integer), "a number")
        if not (math.isfinite(float(sr)) and 0.0 < float(sr) <= 1.0):
            raise TraceError(f"sampling_rate must be in (0, 1], got {sr!r}")
        self.sampling_rate = float(sr)
        if not isinstance(self.kind, str) or self.kind not in KINDS:
            raise TraceError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("has_weights", "synthetic", "complete"):
            setattr(self, name, bool(_of_type(name, getattr(self, name), (bool, np.bool_), "true or false")))
        _of_type("source", self.source, (str,), "a string")
        _of_type("written_by", self.written_by, (str,), "a string")
        _of_type("extra", self.extra, (dict,), "a JSON object")
        self.format_version = _int_value("format_version", self.format_version, 1, FORMAT_VERSION)
        self.foe_groups = _int_value("foe_groups", self.foe_groups, 1, MAX_TOP_K)
        if self.num_experts % self.foe_groups or self.top_k % self.foe_groups:
            raise TraceError(f"foe_groups={self.foe_groups} must divide num_experts={self.num_experts} and "
                             f"top_k={self.top_k} (each group owns E/H experts and routes K/H of them)")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict, where: str = "meta.json") -> TraceMeta:
        if not isinstance(d, dict):
            raise TraceError(f"{where}: expected a JSON object")
        version = d.get("format_version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise TraceError(f"{where}: missing or invalid format_version {version!r} (expected a positive integer)")
        if version > FORMAT_VERSION:
            raise TraceError(
                f"{where}: format_version {version} is newer than this moeplace reads ({FORMAT_VERSION}); "
                "upgrade moeplace"
            )
        known = {f.name for f in fields(cls)}
        missing = [k for k in ("model", "num_layers", "num_experts", "top_k") if k not in d]
        if missing:
            raise TraceError(f"{where}: missing required keys {missing}")
        try:
            return cls(**{k: v for k, v in d.items() if k in known})
        except TraceError as e:
            raise TraceError(f"{where}: {e}") from None


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
    dt = np.dtype(dtype)
    if dt.kind in "iu" and arr.size:
        if arr.dtype.kind not in "iu":
            if arr.dtype.kind != "f" or not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
                raise TraceError(f"{name}: expected integers, got dtype {arr.dtype}")
        info = np.iinfo(dt)
        lo, hi = arr.min(), arr.max()
        if lo < info.min or hi > info.max:
            raise TraceError(f"{name}: value {lo if lo < info.min else hi} does not fit {dt.name}")
    return arr.astype(dtype, copy=False)


def check_expert_ids(expert_ids: np.ndarray, meta: TraceMeta, where: str = "expert_ids") -> np.ndarray:
    """Validate routing ids against the metadata; returns them as int16 [T, L, K].

    Ids must be integers in [0, E), and a token's K experts in one layer must be distinct (a router picks K
    different experts). With ``meta.foe_groups`` = H > 1, column j of every layer must hold an expert of group
    ``j // (K/H)``, i.e. an id in ``[h*E/H, (h+1)*E/H)`` for ``h = j // (K/H)`` (docs/TRACE_FORMAT.md).
    """
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
    ids = ids.astype(np.int16, copy=False)
    if ids.size and meta.top_k > 1:
        s = np.sort(ids, axis=2)
        rep = s[:, :, 1:] == s[:, :, :-1]
        if rep.any():
            t, layer, j = (int(x[0]) for x in np.nonzero(rep))
            raise TraceError(f"{where}: token row {t} selects expert {int(s[t, layer, j])} more than "
                             f"once in MoE layer {layer} (a token's top-k experts must be distinct)")
    if ids.size and meta.foe_groups > 1:
        H = meta.foe_groups
        eg, kg = meta.num_experts // H, meta.top_k // H
        want = np.arange(meta.top_k) // kg  # [K] group of each column
        off = (ids // eg) != want  # [T, L, K]
        if off.any():
            t, layer, j = (int(x[0]) for x in np.nonzero(off))
            h = int(want[j])
            raise TraceError(f"{where}: token row {t}, MoE layer {layer}, column {j} holds expert "
                             f"{int(ids[t, layer, j])}, outside FoE group {h}'s experts [{h * eg}, {(h + 1) * eg}) "
                             f"(foe_groups={H}: columns [{h * kg}, {(h + 1) * kg}) belong to group {h})")
    return ids


def _check_positions(pos: np.ndarray, where: str) -> None:
    if pos.size and int(pos.min()) < 0:
        raise TraceError(f"{where}: negative position {int(pos.min())} (positions count from 0)")


def _check_lengths(a: np.ndarray, name: str, where: str) -> None:
    if a.size and int(a.min()) < 0:
        raise TraceError(f"{where}: negative {name} {int(a.min())}")


def _check_phase(phase: np.ndarray, where: str, allow_unknown: bool = False) -> None:
    ok = (phase == PREFILL) | (phase == DECODE)
    if allow_unknown:
        ok |= phase == -1
    if not ok.all():
        raise TraceError(f"{where}: phase must be 0 (prefill) or 1 (decode), found {int(phase[~ok][0])}")


# --------------------------------------------------------------------------------------------------- writer


def _atomic_write_table(table: pa.Table, dest: Path) -> None:
    # page checksums (CRC32): a flipped byte in a data page is caught on read instead of decoding to wrong ids
    atomic_write_with(dest, lambda tmp: pq.write_table(table, tmp, compression=_COMPRESSION, write_page_checksum=True),
                      "trace shard")


def _fixed_list(flat: np.ndarray, size: int, pa_type: pa.DataType) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(flat).ravel(), type=pa_type), size)


def written_by_moeplace(path: str | os.PathLike) -> bool:
    """Whether the folder's ``meta.json`` carries ``"written_by": "moeplace"`` (read without following links)."""
    mf = Path(path) / META_FILE
    try:
        st = os.lstat(mf)
        if not stat.S_ISREG(st.st_mode) or st.st_size > META_MAX_BYTES:
            return False
        d = json.loads(mf.read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(d, dict) and d.get("written_by") == WRITTEN_BY


def _holds_input(dest: Path, inputs: Sequence[str | os.PathLike]) -> Path | None:
    """The first input that is ``dest`` itself or lies inside it (paths resolved), else None."""
    d = dest.resolve()
    for inp in inputs:
        r = Path(inp).resolve()
        if r == d or d in r.parents:
            return Path(inp)
    return None


def _clean_leftovers(final: Path) -> None:
    """Remove what a killed writer of ``final`` left: its build folder, and its backup unless ``final`` is gone
    (a kill between the two renames of a swap: then the backup, the old trace, is put back)."""
    remove_stale(final, "new")
    olds = stale_paths(final, "old")
    if olds and not final.exists() and not final.is_symlink():
        os.replace(olds[-1], final)
    remove_stale(final, "old")


class TraceWriter:
    """Streams a trace to disk in atomic shards, in bounded memory.

    Use as a context manager::

        with TraceWriter("out.trace", meta) as w:
            w.add_requests([0], domain=["code"], prompt_len=[12], gen_len=[8])
            w.add_tokens(request_id, position, phase, expert_ids)   # [T], [T], [T], [T, L, K]

    A shard is flushed every ``shard_tokens`` token rows (or count groups), or when :meth:`flush` is called.

    - ``keep_partial=True`` (streaming capture): shards go straight into ``path``; on an exception (Ctrl-C
      included) the rows already validated are flushed as a last shard and ``meta.complete`` stays False (a
      folder this writer created and wrote no shard into is removed), and after a kill -9 every shard flushed
      before it stays readable.
    - ``keep_partial=False`` (importers, synth): the trace is built in a hidden folder beside ``path`` and renamed
      into place only when it closes cleanly; a failure removes it, so nothing half-made appears under ``path``.
    - An existing non-empty folder is refused unless ``overwrite=True``, and even then only if its ``meta.json``
      says ``"written_by": "moeplace"`` and it neither is nor contains one of ``inputs``. The new trace is built
      beside it and swapped in only when it closes cleanly; the old one is kept if anything fails.

    Leftovers of a killed writer of the same ``path`` (hidden ``.<name>.new-<pid>-*`` folders) are removed.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        meta: TraceMeta,
        shard_tokens: int = DEFAULT_SHARD_TOKENS,
        overwrite: bool = False,
        keep_partial: bool = True,
        inputs: Sequence[str | os.PathLike] = (),
    ) -> None:
        if shard_tokens < 1:
            raise TraceError(f"shard_tokens must be >= 1, got {shard_tokens}")
        self.final_path = Path(path)
        if self.final_path.name in ("", ".", ".."):
            raise TraceError(f"{self.final_path}: not a usable trace folder name")
        self.meta = TraceMeta(**{**asdict(meta), "complete": False, "format_version": FORMAT_VERSION,
                                 "written_by": WRITTEN_BY})
        self.shard_tokens = shard_tokens
        self.keep_partial = keep_partial
        try:
            make_dirs(self.final_path.parent)
        except OutputError as e:
            raise TraceError(str(e)) from None
        _clean_leftovers(self.final_path)
        self._replace = False
        fp = self.final_path
        if fp.exists() or fp.is_symlink():
            if not fp.is_dir():
                raise TraceError(f"{fp}: exists and is not a trace directory")
            inp = _holds_input(fp, inputs)
            if inp is not None:
                raise TraceError(f"{fp}: output folder is or contains the input {inp}; choose another output")
            if any(fp.iterdir()):
                if not overwrite:
                    raise TraceError(f"{fp}: already exists and is not empty (use overwrite)")
                if not written_by_moeplace(fp):
                    raise TraceError(f"{fp}: not replaced: not written by moeplace (its {META_FILE} lacks "
                                     f'"written_by": "{WRITTEN_BY}"); overwrite only replaces moeplace traces: '
                                     "remove it yourself or pick another output")
                self._replace = True
        self._aside = self._replace or not keep_partial
        self._created = not (fp.exists() or fp.is_symlink())  # so a writer that wrote no shard can remove it
        if self._aside:
            self.path = make_temp_dir(fp, "new")
        else:
            self.path = fp
            make_dirs(fp)
        self._shard = 0
        self._req: list[pa.Table] = []
        self._data: list[pa.Table] = []
        self._rows = 0
        self.num_tokens = 0
        self._closed = False
        try:
            atomic_write_json(self.meta.to_json(), self.path / META_FILE, indent=2)
        except BaseException:
            self._discard()
            raise

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
        _check_lengths(pl, "prompt_len", "add_requests")
        _check_lengths(gl, "gen_len", "add_requests")
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
        _check_positions(pos, "add_tokens")
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
        """Flush the last shard and mark the trace complete (then move it into place if it was built aside)."""
        if self._closed:
            return
        try:
            self.flush()
            self.meta.complete = True
            atomic_write_json(self.meta.to_json(), self.path / META_FILE, indent=2)
            if self._aside:
                self._move_into_place()
        except BaseException:
            self._closed = True
            self._discard()
            raise
        self._closed = True

    def _move_into_place(self) -> None:
        fp = self.final_path
        if self._replace:
            backup = temp_path(fp, "old")
            os.replace(fp, backup)
            os.replace(self.path, fp)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            try:
                os.replace(self.path, fp)  # atomic; an empty folder created meanwhile is replaced
            except OSError as e:
                raise TraceError(f"{fp}: could not move the new trace into place ({e.strerror})") from None
        self.path = fp

    def _discard(self) -> None:
        if self._aside and self.path != self.final_path:
            shutil.rmtree(self.path, ignore_errors=True)

    def abort(self) -> None:
        """Stop writing. With ``keep_partial`` (and nothing to replace) the rows validated so far are flushed as a
        last shard and the trace stays marked incomplete; otherwise the partial trace is removed."""
        if self._closed:
            return
        self._closed = True
        if self._aside:
            self._discard()
            return
        self.flush()
        if self._shard == 0 and self._created:  # nothing was recorded: leave no folder that blocks a rerun
            shutil.rmtree(self.path, ignore_errors=True)

    def _check_open(self) -> None:
        if self._closed:
            raise TraceError(f"{self.final_path}: writer is closed")


def write_trace(path: str | os.PathLike, trace: Trace, overwrite: bool = False,
                shard_tokens: int = DEFAULT_SHARD_TOKENS, keep_partial: bool = True) -> Path:
    """Write an in-memory :class:`Trace` to ``path``; returns the path."""
    with TraceWriter(path, trace.meta, shard_tokens=shard_tokens, overwrite=overwrite,
                     keep_partial=keep_partial) as w:
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
        d = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
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
    """Data files of the committed shards, in order."""
    p = _trace_dir(path)
    meta = meta or read_meta(p)
    try:
        return sorted(p.glob(f"part-*{_data_suffix(meta)}"))
    except PermissionError:
        raise TraceError(f"{p}: permission denied (cannot list the trace folder)") from None


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
        tables.append(_read_table(rf, _requests_schema(), rb, budget, "request file"))
    t = pa.concat_tables(tables) if tables else _requests_schema().empty_table()
    rid = t.column("request_id").to_numpy().astype(np.int64)
    if len(np.unique(rid)) != len(rid):
        dup = rid[np.argsort(rid)][np.flatnonzero(np.diff(np.sort(rid)) == 0)[0]]
        raise TraceError(f"{p}: request_id {int(dup)} appears more than once in the request table")
    reqs = Requests(
        request_id=rid,
        domain=np.asarray(t.column("domain").to_pylist(), dtype=object),
        source=np.asarray(t.column("source").to_pylist(), dtype=object),
        prompt_len=t.column("prompt_len").to_numpy().astype(np.int32),
        gen_len=t.column("gen_len").to_numpy().astype(np.int32),
    )
    _check_lengths(reqs.prompt_len, "prompt_len", f"{p}: request table")
    _check_lengths(reqs.gen_len, "gen_len", f"{p}: request table")
    return reqs


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
    _check_phase(phase, f"{f}")
    _check_positions(pos, f"{f}")
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


def _iter_token_batches(p: Path, meta: TraceMeta, columns: list[str], batch_rows: int, check_requests: bool,
                        budget: int | None) -> Iterator[tuple[Path, pa.RecordBatch, _KnownRequests | None]]:
    files = shard_files(p, meta)
    known = _KnownRequests(_read_requests(p, files, meta, budget).request_id) if check_requests else None
    schema = _tokens_schema(meta)
    rb = _row_bytes("tokens", meta, columns)
    for f in files:
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
) -> Iterator[TokenChunk]:
    """Stream a per-token trace in chunks of at most ``chunk_tokens`` rows (bounded memory).

    Every chunk is validated: schema, shape, no nulls, expert ids in range and distinct within a token's top-k,
    phase, positions >= 0 and (``check_requests``) request ids present in the request table. Set
    ``columns_weights=False`` to skip reading routing weights.
    """
    if chunk_tokens < 1:
        raise TraceError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    p = _trace_dir(path)
    meta = read_meta(p, budget)
    _require_tokens(meta, p, "reading token rows")
    cols = [c for c in _tokens_schema(meta).names if columns_weights or c != "expert_weights"]
    m = meta if columns_weights else TraceMeta(**{**asdict(meta), "has_weights": False})
    check_memory(chunk_tokens * _row_bytes("tokens", meta, cols), f"a chunk of {chunk_tokens} token rows", p, budget)
    for f, batch, known in _iter_token_batches(p, meta, cols, chunk_tokens, check_requests, budget):
        yield _batch_to_chunk(batch, m, f, known)


def iter_light_columns(
    source: str | os.PathLike | Trace,
    batch_rows: int = 1 << 20,
    check_requests: bool = True,
    budget: int | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Stream ``(request_id int64 [T], position int32 [T], phase int8 [T])`` of every token, without routing.

    ``source`` is a trace directory (read in batches of ``batch_rows`` rows, with the same validation as
    :func:`iter_token_chunks`: footers against file sizes and the memory budget, schema, nulls, phase,
    positions >= 0, request ids in the request table) or an in-memory :class:`Trace` (one batch).
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
    for f, batch, known in _iter_token_batches(p, meta, cols, batch_rows, check_requests, budget):
        _check_nulls(f, batch)
        yield _light_arrays(batch, f, known)


def num_token_rows(path: str | os.PathLike, budget: int | None = None) -> int:
    """Token rows of a per-token trace, from the validated Parquet footers (nothing is decoded)."""
    p = _trace_dir(path)
    meta = read_meta(p, budget)
    _require_tokens(meta, p, "counting token rows")
    rb = _row_bytes("tokens", meta, ["request_id", "position", "phase"])
    return sum(_open_parquet(f, rb, budget).metadata.num_rows for f in shard_files(p, meta))


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
    schema = _counts_schema(meta)
    rb = _row_bytes("counts", meta)
    parts, total = [], 0
    for f in shard_files(p, meta):
        total += _open_parquet(f, rb, budget).metadata.num_rows
        check_memory(total * rb, f"the count groups ({total} rows)", f, budget)
        t = _read_table(f, schema, rb, budget, "trace shard")
        _check_phase(t.column("phase").to_numpy(), f"{f}", allow_unknown=True)
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
            _check_schema(f, pf.schema_arrow, _tokens_schema(meta))
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
