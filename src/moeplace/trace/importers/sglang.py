"""SGLang's expert distribution recorder dumps: ``per_token`` mode (``sglang-per-token``) and ``stat`` mode
(``sglang-stat``, counts-only). Layout: docs/IMPORTERS.md.

Shape legend: T = tokens, L = MoE layers, K = top-k, E = logical experts, P = physical slots, G = count groups.
"""

from __future__ import annotations

import os
import re
import warnings
import zipfile
from pathlib import Path

import numpy as np

from moeplace.trace.importers.common import (
    as_int,
    as_int_array,
    check_ids,
    engine_meta,
    first_line,
    open_writer,
    prepare_out,
    regular_input,
)
from moeplace.trace.types import DECODE, PREFILL, TraceError

# SGLang ForwardMode values (python/sglang/srt/model_executor/forward_batch_info.py): stable for these three.
_SGL_EXTEND, _SGL_DECODE, _SGL_MIXED = 1, 2, 3


def _torch_load(path: Path) -> dict:
    regular_input(path, "a .pt file written by SGLang's expert distribution recorder")
    import pickle

    import torch

    try:  # weights_only: a pickle that would run code is refused, never executed
        with warnings.catch_warnings():  # torch warns about pickle protocols on stderr
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        m = re.search(r"GLOBAL ([\w.]+)", str(e))
        why = f"it names {m.group(1)}" if m else "it holds more than tensors and plain containers"
        raise TraceError(f"{path}: not a readable torch.save file: loading it would run code ({why}); refused, "
                         "nothing was executed") from None
    except (RuntimeError, OSError, EOFError, ValueError, IndexError, KeyError, TypeError, AttributeError,
            UnicodeDecodeError, zipfile.BadZipFile, RecursionError, MemoryError) as e:
        raise TraceError(f"{path}: not a readable torch.save file ({type(e).__name__}: {first_line(e)})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{path}: expected a dict (torch.save of the recorder dump), got {type(obj).__name__}")
    return obj


def _np(t, where: str) -> np.ndarray:
    import torch

    if isinstance(t, torch.Tensor):
        return t.detach().cpu().numpy()
    try:
        return np.asarray(t)
    except ValueError as e:
        raise TraceError(f"{where}: not an array ({e})") from None


def logical_ids(ids: np.ndarray, p2l: np.ndarray, layers: np.ndarray, top_k: int) -> np.ndarray:
    """int [T, L, K]: logical expert ids of a record's physical slot ids.

    ids: int [Lm, T, K8] (``topk_ids_of_layer``); p2l: int [Lm, P] (``last_physical_to_logical_map``); layers:
    int [L] the routed model layers kept; the first ``top_k`` columns are used. TraceError when one of them is -1
    (an incomplete top-k) or beyond P. Used by the importer and by :func:`moeplace.plan.route.counts_from_sglang`."""
    phys = ids[layers][:, :, :top_k]  # [L, T, K]
    if (phys < 0).any():
        raise TraceError(f"a routed layer has -1 in its first {top_k} columns (incomplete top-k)")
    if phys.size and phys.max() >= p2l.shape[1]:
        raise TraceError(f"physical expert id {int(phys.max())} out of range [0, {p2l.shape[1]})")
    logical = np.take_along_axis(p2l[layers], phys.reshape(len(layers), -1), axis=1)
    return logical.reshape(phys.shape).transpose(1, 0, 2)


def import_sglang_per_token(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    model: str = "unknown",
    num_experts: int | None = None,
    hidden_size: int | None = None,
    num_shared_experts: int = 0,
    overwrite: bool = False,
) -> Path:
    """Import one rank's SGLang expert-distribution dump in ``per_token`` mode (``expert_distribution_recorder_*.pt``).

    Dump: ``{"records": [...], "last_physical_to_logical_map": int [Lm, P]}``; each record has
    ``topk_ids_of_layer`` int [Lm, T, 8] (physical slot ids, -1 padding), ``positions`` [T], ``forward_mode``
    and ``extend_seq_lens``. Physical ids are mapped to logical experts with the map (the placement in force
    when the dump was written). Layers that never route (dense layers, all -1) are dropped; K = the number of
    columns that are ever used. The dump carries no request ids: each sequence of an extend pass (by
    ``extend_seq_lens``) and each token of a decode pass becomes its own request. Other modes are skipped.
    """
    path = Path(src)
    obj = _torch_load(path)
    for key in ("records", "last_physical_to_logical_map"):
        if key not in obj:
            raise TraceError(f"{path}: missing key {key!r} (found: {', '.join(map(str, obj)) or 'none'}); is this a "
                             "per_token dump? (stat dumps have 'logical_count': use --format sglang-stat)")
    records = obj["records"]
    if not isinstance(records, list):
        raise TraceError(f"{path}: 'records' must be a list")
    p2l = _np(obj["last_physical_to_logical_map"], f"{path}: last_physical_to_logical_map")
    if p2l.ndim != 2 or p2l.dtype.kind not in "iu" or p2l.size == 0:
        raise TraceError(f"{path}: last_physical_to_logical_map must be an integer [layers, physical] array, "
                         f"got shape {list(p2l.shape)} dtype {p2l.dtype}")
    Lm, P = p2l.shape
    E = int(num_experts) if num_experts is not None else int(p2l.max()) + 1
    check_ids(p2l, E, f"{path}: last_physical_to_logical_map")

    kept: list[tuple[int, dict, np.ndarray]] = []  # (record index, record, ids [T, Lm, K8])
    skipped: dict[str, int] = {}
    used_layer = np.zeros(Lm, bool)
    used_cols = None
    for j, rec in enumerate(records):
        w = f"{path}: record {j}"
        if not isinstance(rec, dict) or "topk_ids_of_layer" not in rec:
            raise TraceError(f"{w}: missing 'topk_ids_of_layer' (is this a per_token dump?)")
        ids = _np(rec["topk_ids_of_layer"], f"{w} topk_ids_of_layer")
        if ids.ndim != 3 or ids.shape[0] != Lm or ids.dtype.kind not in "iu":
            raise TraceError(f"{w}: topk_ids_of_layer must be an integer [{Lm}, tokens, k] array (layers from "
                             f"last_physical_to_logical_map), got shape {list(ids.shape)} dtype {ids.dtype}")
        mode = as_int(rec.get("forward_mode", -1), f"{w}: forward_mode")
        if ids.shape[1] == 0:
            continue
        if mode not in (_SGL_EXTEND, _SGL_DECODE, _SGL_MIXED):
            skipped[str(mode)] = skipped.get(str(mode), 0) + 1
            continue
        valid = ids >= 0
        if (ids >= P).any():
            raise TraceError(f"{w}: physical expert id {int(ids.max())} out of range [0, {P})")
        if used_cols is None:
            used_cols = np.zeros(ids.shape[2], bool)
        elif ids.shape[2] != len(used_cols):
            raise TraceError(f"{w}: topk_ids_of_layer has {ids.shape[2]} columns, earlier records {len(used_cols)}")
        used_layer |= valid.any(axis=(1, 2))
        used_cols |= valid.any(axis=(0, 1))
        kept.append((j, rec, ids))
    if not kept or not used_layer.any():
        raise TraceError(f"{path}: no routed tokens in extend/decode records")
    layers = np.flatnonzero(used_layer)
    K = int(np.flatnonzero(used_cols)[-1]) + 1
    extra = {"importer": "sglang-per-token", "num_model_layers": int(Lm), "num_physical_experts": int(P),
             "num_experts_inferred": num_experts is None, "skipped_records_by_forward_mode": skipped,
             "request_granularity": "one per extend sequence / decode token (SGLang records no request ids)",
             "physical_to_logical": "last_physical_to_logical_map (placement at dump time)"}
    meta = engine_meta(model, len(layers), E, K, layers.tolist(), hidden_size, num_shared_experts,
                        f"sglang-per-token:{path}", extra)
    out_p = prepare_out(out, path)
    next_rid = 0
    with open_writer(out_p, meta, overwrite, [path]) as w:
        for j, rec, ids in kept:
            where = f"{path}: record {j}"
            try:
                logical = logical_ids(ids, p2l, layers, K)  # [T, L, K]
            except TraceError as e:
                raise TraceError(f"{where}: {e}") from None
            T = logical.shape[0]
            pos = as_int_array(_np(rec.get("positions", np.arange(T)), f"{where} positions"),
                                f"{where} positions").ravel()
            if len(pos) != T:
                raise TraceError(f"{where}: positions has {len(pos)} entries, topk_ids_of_layer {T} tokens")
            mode = as_int(rec["forward_mode"], f"{where}: forward_mode")
            if mode == _SGL_DECODE:
                seq_lens = np.ones(T, np.int64)
            else:
                esl = rec.get("extend_seq_lens")
                seq_lens = as_int_array([T] if esl is None else _np(esl, f"{where} extend_seq_lens"),
                                         f"{where} extend_seq_lens").ravel()
                if seq_lens.sum() != T or (seq_lens < 0).any():
                    raise TraceError(f"{where}: extend_seq_lens sum to {int(seq_lens.sum())}, expected {T} tokens")
                seq_lens = seq_lens[seq_lens > 0]
            if mode == _SGL_EXTEND:
                seq_phase = np.full(len(seq_lens), PREFILL, np.int8)
            elif mode == _SGL_DECODE:
                seq_phase = np.full(len(seq_lens), DECODE, np.int8)
            else:  # MIXED: running requests join a chunked-prefill batch with one token each
                seq_phase = np.where(seq_lens == 1, DECODE, PREFILL).astype(np.int8)
            rids = next_rid + np.arange(len(seq_lens))
            next_rid += len(seq_lens)
            is_pre = seq_phase == PREFILL
            w.add_requests(rids, source=[f"sglang forward_pass {rec.get('forward_pass_id', j)}"] * len(rids),
                           prompt_len=np.where(is_pre, seq_lens, 0), gen_len=np.where(is_pre, 0, seq_lens))
            try:
                w.add_tokens(np.repeat(rids, seq_lens), pos, np.repeat(seq_phase, seq_lens), logical)
            except TraceError as e:
                raise TraceError(f"{where}: {e}") from None
    return out_p


def import_sglang_stat(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    model: str = "unknown",
    top_k: int | None = None,
    hidden_size: int | None = None,
    num_shared_experts: int = 0,
    overwrite: bool = False,
) -> Path:
    """Import an SGLang expert-distribution dump in ``stat`` mode as a counts-only trace.

    Dump: ``{"rank": int, "logical_count": int [buffer, Lm, E], ...}`` (already logical, summed over ranks).
    Each non-empty buffer row (one forward pass) becomes a group ``pass<i>`` with phase -1 (the dump does not say
    prefill or decode); all-zero rows (unused buffer slots) are dropped and counted. Layers that never count a
    token (dense layers) are dropped. The dump does not record K: pass ``top_k`` to fill ``num_tokens`` and the
    metadata (without it K is recorded as 1 and num_tokens as NaN).
    """
    path = Path(src)
    obj = _torch_load(path)
    if "logical_count" not in obj:
        hint = " (per_token dumps have 'records': use --format sglang-per-token)" if "records" in obj else ""
        raise TraceError(f"{path}: missing key 'logical_count' (found: {', '.join(map(str, obj)) or 'none'}){hint}")
    c = _np(obj["logical_count"], f"{path}: logical_count")
    if c.ndim != 3 or c.dtype.kind not in "iuf":
        raise TraceError(f"{path}: logical_count must be a numeric [buffer, layers, experts] array, "
                         f"got shape {list(c.shape)} dtype {c.dtype}")
    c = c.astype(np.float64)
    bad = ~np.isfinite(c)
    if bad.any():
        b, layer, e = (int(x[0]) for x in np.nonzero(bad))
        raise TraceError(f"{path}: logical_count holds {c[b, layer, e]} (NaN or infinite) at buffer row {b}, "
                         f"layer {layer}, expert {e}")
    if (c < 0).any():
        raise TraceError(f"{path}: logical_count holds negative counts")
    if (c != np.round(c)).any():
        raise TraceError(f"{path}: logical_count holds fractional counts (token counts are integers)")
    rows = np.flatnonzero(c.sum(axis=(1, 2)) > 0)
    if not len(rows):
        raise TraceError(f"{path}: logical_count is all zeros (nothing was recorded)")
    layers = np.flatnonzero(c.sum(axis=(0, 2)) > 0)
    E = c.shape[2]
    K = int(top_k) if top_k is not None else 1
    counts = c[rows][:, layers, :]
    ntok = counts.sum(axis=2).max(axis=1) / K if top_k is not None else np.full(len(rows), np.nan)
    extra = {"importer": "sglang-stat", "rank": obj.get("rank"), "num_model_layers": int(c.shape[1]),
             "buffer_rows": int(c.shape[0]), "empty_buffer_rows_dropped": int(c.shape[0] - len(rows)),
             "top_k_known": top_k is not None,
             "note": "rows are forward passes in circular-buffer order (not chronological after wrap-around)"}
    meta = engine_meta(model, len(layers), E, K, layers.tolist(), hidden_size, num_shared_experts,
                        f"sglang-stat:{path}", extra, kind="counts")
    out_p = prepare_out(out, path)
    with open_writer(out_p, meta, overwrite, [path]) as w:
        w.add_counts([f"pass{i}" for i in rows], ["unknown"] * len(rows), np.full(len(rows), -1, np.int8), ntok,
                     counts)
    return out_p
