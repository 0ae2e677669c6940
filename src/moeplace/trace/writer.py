"""Writing traces: :class:`TraceWriter` (sharded, each shard renamed into place) and :func:`write_trace`.

Shape legend: T = tokens, L = MoE layers, K = top-k, E = logical experts, R = requests, G = count groups.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moeplace.io import (
    OutputError,
    atomic_write_json,
    atomic_write_with,
    input_output_clash,
    make_dirs,
    make_temp_dir,
    move_folder_into_place,
    remove_stale,
    stale_paths,
    unique_keys,
)
from moeplace.trace.format import (
    COMPRESSION,
    as_1d,
    check_expert_ids,
    check_lengths,
    check_phase,
    check_positions,
    counts_schema,
    data_suffix,
    requests_schema,
    tokens_schema,
)
from moeplace.trace.types import FORMAT_VERSION, META_FILE, META_MAX_BYTES, WRITTEN_BY, Trace, TraceError, TraceMeta

DEFAULT_SHARD_TOKENS = 1 << 18  # tokens per shard; bounds writer memory (~L*K*4 bytes each)


def _atomic_write_table(table: pa.Table, dest: Path) -> None:
    # page checksums (CRC32): a flipped byte in a data page is caught on read instead of decoding to wrong ids
    atomic_write_with(dest, lambda tmp: pq.write_table(table, tmp, compression=COMPRESSION, write_page_checksum=True),
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
        d = json.loads(mf.read_bytes(), object_pairs_hook=unique_keys)
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(d, dict) and d.get("written_by") == WRITTEN_BY


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
    ``verify(folder)``, when given, is called on the finished trace before it is moved into place; whatever it
    raises discards the new trace (built aside) and leaves ``path`` as it was.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        meta: TraceMeta,
        shard_tokens: int = DEFAULT_SHARD_TOKENS,
        overwrite: bool = False,
        keep_partial: bool = True,
        inputs: Sequence[str | os.PathLike] = (),
        verify: Callable[[Path], None] | None = None,
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
        self.verify = verify
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
            clash = input_output_clash([("output trace", fp)], [("", inp) for inp in inputs])
            if clash:
                raise TraceError(clash)
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
        rid = as_1d("request_id", request_id, np.int64)
        n = len(rid)
        dom = np.asarray(["unknown"] * n if domain is None else list(domain), dtype=object)
        src = np.asarray([""] * n if source is None else list(source), dtype=object)
        pl = as_1d("prompt_len", np.zeros(n) if prompt_len is None else prompt_len, np.int32, n)
        gl = as_1d("gen_len", np.zeros(n) if gen_len is None else gen_len, np.int32, n)
        check_lengths(pl, "prompt_len", "add_requests")
        check_lengths(gl, "gen_len", "add_requests")
        if len(dom) != n or len(src) != n:
            raise TraceError(f"add_requests: domain/source must have {n} entries like request_id")
        self._req.append(
            pa.table(
                [pa.array(rid), pa.array(dom.tolist(), pa.string()), pa.array(src.tolist(), pa.string()),
                 pa.array(pl), pa.array(gl)],
                schema=requests_schema(),
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
        rid = as_1d("request_id", request_id, np.int64, t)
        pos = as_1d("position", position, np.int32, t)
        ph = as_1d("phase", phase, np.int8, t)
        check_phase(ph, "add_tokens")
        check_positions(pos, "add_tokens")
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
            self._data.append(pa.table(cols, schema=tokens_schema(self.meta)))
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
        ph = as_1d("phase", phase, np.int8, g)
        check_phase(ph, "add_counts", allow_unknown=True)
        nt = as_1d("num_tokens", num_tokens, np.float64, g)
        grp, dom = list(group), list(domain)
        if len(grp) != g or len(dom) != g:
            raise TraceError(f"add_counts: group and domain must have {g} entries")
        if np.any(c[np.isfinite(c)] < 0):
            raise TraceError("counts: negative count")
        self._data.append(
            pa.table(
                [pa.array(grp, pa.string()), pa.array(dom, pa.string()), pa.array(ph), pa.array(nt),
                 _fixed_list(c, want[0] * want[1], pa.float64())],
                schema=counts_schema(self.meta),
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
        data_schema = tokens_schema(self.meta) if self.meta.kind == "tokens" else counts_schema(self.meta)
        req = pa.concat_tables(self._req) if self._req else requests_schema().empty_table()
        data = pa.concat_tables(self._data) if self._data else data_schema.empty_table()
        _atomic_write_table(req, Path(f"{stem}.requests.parquet"))
        _atomic_write_table(data, Path(f"{stem}{data_suffix(self.meta)}"))
        self._shard += 1
        self._req, self._data, self._rows = [], [], 0

    def close(self) -> None:
        """Flush the last shard and mark the trace complete (then move it into place if it was built aside)."""
        if self._closed:
            return
        try:
            if self._shard == 0 and not self._req and not self._data:  # a complete trace has at least one shard
                self._req.append(requests_schema().empty_table())
            self.flush()
            self.meta.complete = True
            atomic_write_json(self.meta.to_json(), self.path / META_FILE, indent=2)
            if self.verify is not None:  # e.g. trace compact: the copy must equal its input before it is renamed
                self.verify(self.path)
            if self._aside:
                self._move_into_place()
        except BaseException:
            self._closed = True
            self._discard()
            raise
        self._closed = True

    def _move_into_place(self) -> None:
        fp = self.final_path
        try:  # atomic; an old trace (or an empty folder created meanwhile) is moved aside first
            move_folder_into_place(self.path, fp)
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
