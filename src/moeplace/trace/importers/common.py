"""What the importers share: the domain vocabulary, input checks that name the file, and the trace writer
set-up."""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeplace.io import DuplicateKeyError, unique_keys
from moeplace.trace.reader import regular_file_size
from moeplace.trace.types import TraceError, TraceMeta
from moeplace.trace.writer import TraceWriter

DOMAINS = ("code", "math", "chat", "general", "unknown")


@dataclass(frozen=True)
class KnownModel:
    """What the importers know about a model whose dumps do not say it."""

    model: str  # Hugging Face name
    num_layers: int  # MoE layers of the model
    num_experts: int  # E
    top_k: int  # K
    hidden_size: int
    num_shared_experts: int = 0


def existing(p: Path, what: str) -> Path:
    if not p.exists():
        raise TraceError(f"{p}: no such file ({what})")
    return p


def regular_input(p: Path, what: str) -> Path:
    """``p`` after :func:`moeplace.trace.reader.regular_file_size` checked it is a readable regular file."""
    regular_file_size(p, what)
    return p


def json_loads(text: str, where: str):
    """json.loads with every failure (syntax, nesting too deep) as a TraceError naming ``where``."""
    try:
        return json.loads(text, object_pairs_hook=unique_keys)
    except (json.JSONDecodeError, DuplicateKeyError) as e:
        raise TraceError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise TraceError(f"{where}: JSON nested too deeply") from None


def as_int(v, where: str) -> int:
    """An integer field: ints, or floats with an integral value; fractions, NaN, bools and text are refused."""
    if isinstance(v, (bool, np.bool_)):
        raise TraceError(f"{where}: expected an integer, got {v!r}")
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)) and np.isfinite(v) and float(v).is_integer():
        return int(v)
    raise TraceError(f"{where}: expected an integer, got {v!r}")


def as_int_array(a, where: str) -> np.ndarray:
    """int64 array of ``a``: integers, or floats with integral values (fractions and NaN refused)."""
    try:
        arr = np.asarray(a)
    except (ValueError, RecursionError) as e:
        raise TraceError(f"{where}: not an array ({first_line(e)})") from None
    if arr.dtype.kind == "b" or arr.dtype.kind not in "iuf":
        raise TraceError(f"{where}: expected integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "f" and arr.size and not (np.isfinite(arr).all() and (arr == np.round(arr)).all()):
        raise TraceError(f"{where}: expected integers, found fractional or non-finite values")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise TraceError(f"{where}: value {int(arr.max())} is too large")
    return arr.astype(np.int64)


def first_line(e: BaseException) -> str:
    s = str(e)
    return (s.splitlines()[0] if s else type(e).__name__)[:200]


def load_npz(path: Path) -> np.lib.npyio.NpzFile:
    regular_input(path, "a .npz archive")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise TraceError(f"{path}: not a readable .npz archive ({first_line(e)})") from None


def npz_array(z, path: Path, key: str) -> np.ndarray:
    if key not in z.files:
        raise TraceError(f"{path}: missing array {key!r} (found: {', '.join(sorted(z.files)) or 'none'})")
    try:
        return z[key]
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, MemoryError) as e:
        raise TraceError(f"{path}: array {key!r} is unreadable ({first_line(e)})") from None


def check_ids(ids: np.ndarray, num_experts: int, where: str) -> None:
    if ids.dtype.kind not in "iu":
        raise TraceError(f"{where}: expected integer expert ids, got dtype {ids.dtype}")
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            raise TraceError(f"{where}: expert id {lo if lo < 0 else hi} out of range [0, {num_experts})")


def prepare_out(out: str | os.PathLike, src: Path) -> Path:
    o = Path(out)
    if o.resolve() == src.resolve():
        raise TraceError(f"{o}: output would overwrite the input")
    return o


def open_writer(out: Path, meta: TraceMeta, overwrite: bool, inputs: Sequence[Path]) -> TraceWriter:
    """The importers' writer: built aside and moved into place when complete (a failure leaves nothing), and
    never replacing a folder that is or holds one of ``inputs``. ``meta.extra["importer"]`` names the format; the
    trace records what of it was not imported (token ids, text) in ``extra["not_imported"]`` (docs/PRIVACY.md)."""
    from moeplace.trace.importers import not_imported

    extra = {**meta.extra, "not_imported": not_imported(meta.extra["importer"])}
    return TraceWriter(out, dataclasses.replace(meta, extra=extra), overwrite=overwrite, keep_partial=False,
                       inputs=inputs)


def detect_dense_layers(nonzero_layer: np.ndarray, top_k: int) -> np.ndarray:
    """Indices of the MoE layers: layers that ever route to a nonzero id. Only meaningful for K >= 2."""
    if top_k < 2 or not nonzero_layer.any():
        return np.arange(len(nonzero_layer))
    return np.flatnonzero(nonzero_layer)


def engine_meta(model: str, L: int, E: int, K: int, layer_map: list[int], hidden_size: int | None,
                 num_shared_experts: int, source: str, extra: dict, kind: str = "tokens") -> TraceMeta:
    try:
        return TraceMeta(model=model, num_layers=L, num_experts=E, top_k=K, num_shared_experts=num_shared_experts,
                         hidden_size=hidden_size, moe_layer_map=layer_map, kind=kind, source=source, extra=extra)
    except TraceError as e:
        raise TraceError(f"{source}: {e}") from None
