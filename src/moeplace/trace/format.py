"""The on-disk format of a trace, and the Parquet schemas and column checks its writer and reader share.

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

import numpy as np
import pyarrow as pa

from moeplace.trace.types import DECODE, PREFILL, TraceError, TraceMeta

COMPRESSION = "zstd"
MAX_ROWS_PER_BYTE = 4096  # a Parquet file cannot hold more rows than this per byte (measured: < 300)


def requests_schema() -> pa.Schema:
    """Columns of a request file."""
    return pa.schema(
        [
            ("request_id", pa.int64()),
            ("domain", pa.string()),
            ("source", pa.string()),
            ("prompt_len", pa.int32()),
            ("gen_len", pa.int32()),
        ]
    )


def tokens_schema(meta: TraceMeta) -> pa.Schema:
    """Columns of a token file of ``meta`` (``expert_weights`` only when the trace has weights)."""
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


def counts_schema(meta: TraceMeta) -> pa.Schema:
    """Columns of a count file of ``meta``."""
    return pa.schema(
        [
            ("group", pa.string()),
            ("domain", pa.string()),
            ("phase", pa.int8()),
            ("num_tokens", pa.float64()),
            ("counts", pa.list_(pa.float64(), meta.num_layers * meta.num_experts)),
        ]
    )


def data_suffix(meta: TraceMeta) -> str:
    """File suffix of the data files of ``meta``'s kind (tokens or counts)."""
    return ".tokens.parquet" if meta.kind == "tokens" else ".counts.parquet"


def as_1d(name: str, a, dtype, n: int | None = None) -> np.ndarray:
    """``a`` as a 1-D array of ``dtype`` (``n`` entries if given); TraceError naming ``name`` if it is not one or a
    value does not fit the dtype (floats must be whole numbers to become integers)."""
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
    rep = False
    if ids.size:
        from moeplace.trace.kernels import id_range_and_repeat  # compiled (numba): imported where ids are read

        lo, hi, rep = (int(x) for x in id_range_and_repeat(ids))
        if lo < 0 or hi >= meta.num_experts:
            bad = lo if lo < 0 else hi
            raise TraceError(f"{where}: expert id {bad} out of range [0, {meta.num_experts})")
    ids = ids.astype(np.int16, copy=False)
    if rep and meta.top_k > 1:  # find the first repeat to name it
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


def check_positions(pos: np.ndarray, where: str) -> None:
    """TraceError naming ``where`` on a negative token position."""
    if pos.size and int(pos.min()) < 0:
        raise TraceError(f"{where}: negative position {int(pos.min())} (positions count from 0)")


def check_lengths(a: np.ndarray, name: str, where: str) -> None:
    """TraceError naming ``where`` on a negative length (``name``: the column)."""
    if a.size and int(a.min()) < 0:
        raise TraceError(f"{where}: negative {name} {int(a.min())}")


def check_phase(phase: np.ndarray, where: str, allow_unknown: bool = False) -> None:
    """TraceError naming ``where`` unless every phase is PREFILL or DECODE (or -1, unknown, when allowed)."""
    ok = (phase == PREFILL) | (phase == DECODE)
    if allow_unknown:
        ok |= phase == -1
    if not ok.all():
        raise TraceError(f"{where}: phase must be 0 (prefill) or 1 (decode), found {int(phase[~ok][0])}")
