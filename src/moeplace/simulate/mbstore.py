"""Per-micro-batch metrics of a replay (name -> [B, L]) held so that a replay's memory does not grow with the trace.

A replay finishes micro-batches in the order their last rows arrive; its result lists them by micro-batch id.
:class:`MicrobatchMetrics` keeps the finished ones in memory up to ``SPILL_BYTES`` and writes each full buffer to
one file of a private temporary folder (``MOEPLACE_SPILL_DIR``, else the system's; removed with the result, at
exit, or, after a kill, by the next replay on the host that spills there), layer-major, so that a few
layers of one metric over every micro-batch are read back as contiguous pieces. Every statistic the result
reports (sums, maxima, medians per layer and per micro-batch) is computed a block of layers at a time
(:meth:`MicrobatchMetrics.layer_blocks`, a pure function of B and L), in micro-batch id order, whether the data
was spilled or not: the answer is the same, bit for bit, under any memory budget and on any engine.

Shape legend: B = micro-batches, L = MoE layers, b = micro-batches of one block.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from moeplace.trace.types import TraceError

SPILL_BYTES = 4 << 20  # finished metrics of one phase kept in memory before they are written out (4 MB)
COLUMN_ELEMENTS = 1 << 19  # values of one metric read back at once: B x (layers of a block) <= this (4 MB float64)
SPILL_DIR_ENV = "MOEPLACE_SPILL_DIR"


@dataclass
class _Block:
    """Rows of finished micro-batches, in the order they finished: in memory (name -> [b, L]) or in one file
    (name -> [L, b] at a byte offset)."""

    rows: int
    arrays: dict[str, np.ndarray] | None = None
    path: str | None = None
    offsets: dict[str, int] = field(default_factory=dict)

    def columns(self, key: str, dtype: np.dtype, l0: int, l1: int) -> np.ndarray:
        """[b, l1 - l0] values of ``key`` at layers l0:l1."""
        if self.arrays is not None:
            return self.arrays[key][:, l0:l1]
        n = (l1 - l0) * self.rows
        x = np.fromfile(self.path, dtype=dtype, count=n, offset=self.offsets[key] + l0 * self.rows * dtype.itemsize)
        if len(x) != n:
            raise TraceError(f"{self.path}: a spilled metrics file is shorter than written (was it removed?)")
        return x.reshape(l1 - l0, self.rows).T


class MicrobatchMetrics(Mapping):
    """Metrics name -> [B, L] of finished micro-batches; ``m[name]`` reads one whole metric in micro-batch order.

    Fill with :meth:`append` (ids int [b], metrics name -> [b, L]), then :meth:`freeze` once, which orders the rows
    by micro-batch id. Statistics read it through :meth:`columns` over :meth:`layer_blocks`.
    """

    def __init__(self, num_layers: int, spill_bytes: int | None = SPILL_BYTES) -> None:
        self.num_layers = int(num_layers)
        self._spill_bytes = spill_bytes  # None: never spill
        self._blocks: list[_Block] = []
        self._buf: list[dict[str, np.ndarray]] = []
        self._buf_ids: list[np.ndarray] = []
        self._buf_bytes = 0
        self._block_ids: list[np.ndarray] = []
        self._dtypes: dict[str, np.dtype] = {}
        self._dir: str | None = None
        self._order: np.ndarray | None = None  # rows of the blocks, concatenated, in output order (None: as is)
        self._ids: np.ndarray | None = None
        self._parents: tuple = ()  # stores whose blocks this one reads (a concatenation keeps them alive)

    # ------------------------------------------------------------------------------------------------ filling

    @classmethod
    def from_arrays(cls, ids: np.ndarray, metrics: dict[str, np.ndarray], num_layers: int) -> MicrobatchMetrics:
        """A frozen store of metrics already in output order (ids int [B], name -> [B, L])."""
        m = cls(num_layers, None)
        m.append(ids, metrics)
        return m.freeze(sort=False)

    def append(self, ids: np.ndarray, metrics: dict[str, np.ndarray]) -> None:
        """Add finished micro-batches: ids int [b], metrics name -> [b, L] (every call the same names)."""
        if self._ids is not None:
            raise RuntimeError("MicrobatchMetrics: append after freeze")
        if not self._dtypes:
            self._dtypes = {k: np.asarray(v).dtype for k, v in metrics.items()}
        elif metrics.keys() != self._dtypes.keys():
            raise ValueError("MicrobatchMetrics: every append must carry the same metric names")
        self._buf.append({k: np.asarray(v) for k, v in metrics.items()})
        self._buf_ids.append(np.asarray(ids, np.int64))
        self._buf_bytes += sum(np.asarray(v).nbytes for v in metrics.values())
        if self._spill_bytes is not None and self._buf_bytes >= self._spill_bytes:
            self._flush(to_disk=True)

    def _flush(self, to_disk: bool) -> None:
        if not self._buf:
            return
        ids = np.concatenate(self._buf_ids) if len(self._buf_ids) > 1 else self._buf_ids[0]
        keys = list(self._dtypes)
        if to_disk:
            self._blocks.append(self._write(keys, len(ids)))
        else:
            self._blocks.append(_Block(len(ids), arrays={k: self._buffered(k) for k in keys}))
        self._block_ids.append(ids)
        self._buf, self._buf_ids, self._buf_bytes = [], [], 0

    def _buffered(self, key: str) -> np.ndarray:
        """[b, L] values of ``key`` over the buffered appends, in append order."""
        return np.concatenate([b[key] for b in self._buf]) if len(self._buf) > 1 else self._buf[0][key]

    def _write(self, keys: list[str], rows: int) -> _Block:
        if self._dir is None:
            base = os.environ.get(SPILL_DIR_ENV) or None
            try:
                _remove_stale(base or tempfile.gettempdir())
                self._dir = tempfile.mkdtemp(prefix=f"{_prefix()}{os.getpid()}-", dir=base)
            except OSError as e:
                raise TraceError(f"{base or tempfile.gettempdir()}: cannot make a folder to spill the per-micro-batch "
                                 f"metrics ({e.strerror or e}); set {SPILL_DIR_ENV} to a writable folder") from None
            weakref.finalize(self, shutil.rmtree, self._dir, True)
        path = os.path.join(self._dir, f"block-{len(self._blocks):06d}.bin")
        offsets: dict[str, int] = {}
        pos = 0
        try:
            with open(path, "wb") as f:
                for k in keys:
                    xt = np.ascontiguousarray(np.asarray(self._buffered(k), self._dtypes[k]).T)  # [L, b]
                    offsets[k] = pos
                    f.write(xt.data)
                    pos += xt.nbytes
        except OSError as e:
            raise TraceError(f"{path}: cannot spill the per-micro-batch metrics ({e.strerror or e}); free space there "
                             f"or set {SPILL_DIR_ENV} to a folder with room") from None
        return _Block(rows, path=path, offsets=offsets)

    @property
    def buffered_bytes(self) -> int:
        """Bytes of the micro-batches appended since the last flush or :meth:`take`."""
        return self._buf_bytes

    def take(self) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
        """Hand over the finished micro-batches held so far, as :meth:`pieces` does, and forget them (a task
        streaming its result to another process: ``spill_bytes=None``)."""
        out = self.pieces()
        self._blocks, self._block_ids = [], []
        return out

    def pieces(self) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
        """The finished micro-batches as (ids int [b], name -> [b, L]) blocks in the order they finished, for a task
        that hands them to another process (a store that never spills: ``spill_bytes=None``)."""
        if self._ids is None:
            self._flush(to_disk=False)
        if self.spilled:
            raise RuntimeError("MicrobatchMetrics.pieces: the rows were spilled to this process's files")
        return [(i, b.arrays) for i, b in zip(self._block_ids, self._blocks, strict=True)]

    def freeze(self, sort: bool = True) -> MicrobatchMetrics:
        """Stop appending; order the rows by micro-batch id (stable) when ``sort``. Returns self."""
        if self._ids is not None:
            return self
        self._flush(to_disk=False)
        ids = np.concatenate(self._block_ids) if self._block_ids else np.zeros(0, np.int64)
        if sort and len(ids) and (np.diff(ids) < 0).any():
            self._order = np.argsort(ids, kind="stable")
            ids = ids[self._order]
        self._ids = ids
        return self

    @staticmethod
    def concat(a: MicrobatchMetrics, b: MicrobatchMetrics) -> MicrobatchMetrics:
        """The rows of ``a`` then those of ``b`` (both frozen, the same names), without copying them."""
        a.freeze()
        b.freeze()
        if a._dtypes and b._dtypes and a._dtypes.keys() != b._dtypes.keys():
            raise ValueError("MicrobatchMetrics.concat: the two stores carry different metric names")
        m = MicrobatchMetrics(a.num_layers, None)
        m._blocks = a._blocks + b._blocks
        m._block_ids = a._block_ids + b._block_ids
        m._dtypes = a._dtypes or b._dtypes
        na = a.num_microbatches
        if a._order is not None or b._order is not None:
            oa = a._order if a._order is not None else np.arange(na)
            ob = b._order if b._order is not None else np.arange(b.num_microbatches)
            m._order = np.concatenate([oa, ob + na])
        m._ids = np.concatenate([a.ids, b.ids])
        m._parents = (a, b)
        return m

    # ------------------------------------------------------------------------------------------------ reading

    @property
    def ids(self) -> np.ndarray:
        """int64 [B] micro-batch ids in output order."""
        self.freeze()
        return self._ids

    @property
    def num_microbatches(self) -> int:
        return len(self.ids)

    @property
    def spilled(self) -> bool:
        """Whether any rows live in files."""
        return any(b.arrays is None for b in self._blocks)

    def layer_blocks(self) -> list[tuple[int, int]]:
        """Ranges of layers read at once: B x (layers of a range) <= COLUMN_ELEMENTS, at least one layer."""
        L = self.num_layers
        step = max(1, min(L, COLUMN_ELEMENTS // max(self.num_microbatches, 1)))
        return [(s, min(s + step, L)) for s in range(0, L, step)]

    def columns(self, key: str, l0: int, l1: int) -> np.ndarray:
        """[B, l1 - l0] values of ``key`` at layers l0:l1, in output order."""
        self.freeze()
        dt = self._dtypes[key]
        parts = [blk.columns(key, dt, l0, l1) for blk in self._blocks]
        if not parts:
            return np.zeros((0, l1 - l0), dt)
        x = np.concatenate(parts) if len(parts) > 1 else parts[0]
        return x[self._order] if self._order is not None else np.ascontiguousarray(x)

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self._dtypes:
            raise KeyError(key)
        return self.columns(key, 0, self.num_layers)

    def __iter__(self) -> Iterator[str]:
        return iter(self._dtypes)

    def __len__(self) -> int:
        return len(self._dtypes)

    def __reduce__(self):  # to another process: the values themselves, not paths to this process's files
        return (MicrobatchMetrics.from_arrays, (self.ids, {k: self[k] for k in self}, self.num_layers))


def _prefix() -> str:
    return f"moeplace-spill-{socket.gethostname().replace('-', '_')}-"


def _remove_stale(base: str) -> None:
    """Remove the spill folders this host's killed replays left in ``base`` (their process is gone)."""
    pre = _prefix()
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        if not name.startswith(pre):
            continue
        pid = name[len(pre):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        except OSError:  # alive, another user's
            pass


Spec = tuple[tuple[str, ...], "Callable[..., np.ndarray] | None", str]  # (keys, fn, how) of one reduction


def reduce_many(m: MicrobatchMetrics, specs: list[Spec]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """:func:`reduce_layers` of every ``(keys, fn, how)`` of ``specs`` in one pass over the layer blocks: each block
    of each metric is read once, and dropped after the last spec that uses it."""
    for _, _, how in specs:
        if how not in ("sum", "max"):
            raise ValueError(f"reduce_layers: how={how!r}, expected 'sum' or 'max'")
    L, B = m.num_layers, m.num_microbatches
    out = [(np.zeros(L), np.zeros(L), np.zeros(B) if how == "sum" else np.full(B, -np.inf)) for _, _, how in specs]
    if B == 0:
        return out
    last = {k: i for i, (keys, _, _) in enumerate(specs) for k in keys}
    for l0, l1 in m.layer_blocks():
        cache: dict[str, np.ndarray] = {}
        for i, (keys, fn, how) in enumerate(specs):
            cols = []
            for k in keys:
                if k not in cache:
                    cache[k] = m.columns(k, l0, l1)
                cols.append(cache[k])
            x = np.asarray(fn(*cols) if fn is not None else cols[0], float)
            per_layer, median, row = out[i]
            if how == "sum":
                per_layer[l0:l1] = x.sum(0)
                row += x.sum(1)
            else:
                per_layer[l0:l1] = x.max(0)
                np.maximum(row, x.max(1), out=row)
            median[l0:l1] = np.median(x, 0)
            for k in keys:
                if last[k] == i:
                    cache.pop(k, None)
    return out


def reduce_layers(m: MicrobatchMetrics, keys: tuple[str, ...], fn: Callable[..., np.ndarray] | None = None,
                  how: str = "sum") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reduce ``fn(*columns of keys)`` (elementwise, float [B, l]; None: the one key itself) over layer blocks.

    Returns (per_layer float [L]: sum or max over micro-batches, median_per_layer float [L], row float [B]: sum or
    max over layers of each micro-batch). ``how``: "sum" or "max".
    """
    return reduce_many(m, [(keys, fn, how)])[0]
