"""vLLM's ``routed_experts`` per request (``vllm-routed``: 0.32+, and 0.21's ``prompt_routed_experts``), as .jsonl
or .npz. Layout: docs/IMPORTERS.md.

Shape legend: T = tokens, L = MoE layers, K = top-k, E = logical experts, P = physical slots, G = count groups.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeplace.trace.importers.common import (
    DOMAINS,
    as_int,
    as_int_array,
    detect_dense_layers,
    engine_meta,
    existing,
    first_line,
    json_loads,
    load_npz,
    npz_array,
    open_writer,
    prepare_out,
    regular_input,
)
from moeplace.trace.types import DECODE, MAX_EXPERTS, PREFILL, TraceError


@dataclass
class _VllmRequest:
    """One request's routed rows, placed on token positions. Row i is the token at position ``pos0 + i``; positions
    below ``prompt_len`` are prefill, the others decode."""

    orig_id: str
    domain: str
    rows: np.ndarray  # int64 [N, Lm, K] router order
    pos0: int  # position of row 0 (routed_experts_prompt_start in vLLM >= 0.32, else 0)
    prompt_len: int
    gen_len: int
    unknown: np.ndarray  # bool [N]: rows without routing (0.21 prefix-cached rows, zero- or -1-filled)


def routing_array(a, where: str) -> np.ndarray:
    """int64 [N, Lm, K] from a nested list, an array, or the OpenAI server's base64 ``.npy`` string (TraceError
    naming ``where`` otherwise). Used by the importer and by ``moeplace route serve`` (:mod:`moeplace.plan.route`)."""
    if a is None:
        return np.zeros((0, 0, 0), np.int64)
    if isinstance(a, str):
        a = _b64_npy(a, where)
    try:
        arr = np.asarray(a)
    except (ValueError, RecursionError) as e:  # ragged or absurdly nested lists
        raise TraceError(f"{where}: not a rectangular [tokens, layers, k] array ({first_line(e)})") from None
    if arr.size == 0:
        return np.zeros((0, 0, 0), np.int64)
    if arr.ndim != 3:
        raise TraceError(f"{where}: expected shape [tokens, layers, k], got {list(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise TraceError(f"{where}: expected integer expert ids, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and int(arr.max()) > np.iinfo(np.int64).max:
        raise TraceError(f"{where}: expert id {int(arr.max())} is too large")
    return arr.astype(np.int64, copy=False)  # no narrowing: an id of 2**31 must not wrap


def _b64_npy(text: str, where: str) -> np.ndarray:
    """The array of a base64-encoded ``.npy`` (vLLM's ``numpy2base64``, what its OpenAI server returns)."""
    import base64
    import binascii
    import io

    try:
        raw = base64.b64decode(text, validate=True)
        return np.load(io.BytesIO(raw), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as e:
        raise TraceError(f"{where}: not a base64-encoded .npy array ({first_line(e)})") from None


def _opt_len(d: dict, ids_key: str, len_key: str, where: str) -> int | None:
    """Length from a token-id list ``ids_key`` or a count ``len_key`` (they must agree when both are given)."""
    n = None
    if d.get(ids_key) is not None:
        ids = d[ids_key]
        if not isinstance(ids, (list, tuple, np.ndarray)):
            raise TraceError(f"{where}: {ids_key} must be a list of token ids")
        n = len(ids)
    if d.get(len_key) is not None:
        m = as_int(d[len_key], f"{where}: {len_key}")
        if m < 0 or (n is not None and m != n):
            raise TraceError(f"{where}: {len_key}={m} but {ids_key} has {n} tokens" if n is not None
                             else f"{where}: {len_key} must be >= 0, got {m}")
        n = m
    return n


def _vllm_request(d: dict, where: str) -> _VllmRequest:
    """A request from one record (keys as in docs/IMPORTERS.md); refuses what it cannot place on positions."""
    rid = str(d.get("request_id", where))
    domain = str(d.get("domain") or "unknown")
    P = _opt_len(d, "prompt_token_ids", "prompt_len", where)
    G = _opt_len(d, "output_token_ids", "gen_len", where)
    if "prompt_routed_experts" in d:  # vLLM 0.21: prompt rows and generated rows apart
        pr = routing_array(d.get("prompt_routed_experts"), f"{where} prompt_routed_experts")
        dc = routing_array(d.get("routed_experts"), f"{where} routed_experts")
        if pr.size and dc.size and pr.shape[1:] != dc.shape[1:]:
            raise TraceError(f"{where}: prompt_routed_experts has [layers, k] = {list(pr.shape[1:])} but "
                             f"routed_experts {list(dc.shape[1:])}")
        if P is not None and len(pr) != P:
            raise TraceError(f"{where}: prompt_routed_experts has {len(pr)} rows for a {P}-token prompt")
        rows = pr if not dc.size else dc if not pr.size else np.concatenate([pr, dc])
        p_len = len(pr)
        cached = np.zeros(len(rows), bool)
        if len(rows):
            neg = (rows < 0).any(axis=(1, 2))
            partial = neg & ~(rows < 0).all(axis=(1, 2))
            if partial.any():
                i = int(np.flatnonzero(partial)[0])
                name, j = ("prompt_routed_experts", i) if i < p_len else ("routed_experts", i - p_len)
                raise TraceError(f"{where}: {name} row {j} has -1 in some layers only (-1 must mark a whole "
                                 "prefix-cached row)")
            zero = np.zeros(len(rows), bool)
            zero[:p_len] = (pr == 0).all(axis=(1, 2))
            if zero.any() and rows.shape[2] < 2:
                raise TraceError(f"{where}: prompt_routed_experts has all-zero rows and k = 1: a prefix-cached row "
                                 "(vLLM 0.21 leaves them zero) cannot be told from a token routed to expert 0")
            cached = neg | zero  # with k >= 2 a routed token never selects expert 0 twice in a layer
        return _VllmRequest(rid, domain, rows, 0, p_len, len(dc) if G is None else G, cached)
    if "routed_experts" not in d:
        raise TraceError(f"{where}: needs routed_experts (vLLM >= 0.32) or prompt_routed_experts (vLLM 0.21) "
                         f"(found keys: {', '.join(sorted(d)) or 'none'})")
    rows = routing_array(d["routed_experts"], f"{where} routed_experts")
    N = len(rows)
    if P is None:
        raise TraceError(f"{where}: routed_experts holds prompt and generated tokens together (vLLM >= 0.32); "
                         "give prompt_token_ids or prompt_len so prefill rows can be told from decode rows")
    start = d.get("routed_experts_prompt_start")
    s = None if start is None else as_int(start, f"{where}: routed_experts_prompt_start")
    if s is not None and not 0 <= s <= P:
        raise TraceError(f"{where}: routed_experts_prompt_start={s} is outside [0, {P}] (the prompt length)")
    if G is None:
        if s is None:
            raise TraceError(f"{where}: {N} routed_experts rows, but neither output_token_ids (or gen_len) nor "
                             "routed_experts_prompt_start is given, so where the rows start is ambiguous")
        G = N + s + 1 - P
        if G < 0:
            raise TraceError(f"{where}: {N} routed_experts rows from prompt position {s} end inside the {P}-token "
                             "prompt; give output_token_ids")
    else:
        want = max(P + G - 1 - (s or 0), 0)  # vLLM routes every token but the last generated one
        if N != want:
            hint = ("; if the request set routed_experts_prompt_start, give it" if s is None
                    else f" (routed_experts_prompt_start={s})")
            raise TraceError(f"{where}: routed_experts has {N} rows, but a {P}-token prompt with {G} generated "
                             f"tokens gives {want}{hint}")
    if (rows < 0).any():
        raise TraceError(f"{where}: routed_experts holds negative ids (vLLM >= 0.32 returns logical ids >= 0)")
    return _VllmRequest(rid, domain, rows, s or 0, P, G, np.zeros(N, bool))


_NPZ_FIELDS = ("prompt_lens", "gen_lens", "prompt_starts")  # optional [R] int arrays of the .npz layout


def _lines(fh, path: Path) -> Iterator[str]:
    try:
        yield from fh
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text ({e.reason})") from None


def _iter_vllm(path: Path) -> Iterator[_VllmRequest]:
    if path.suffix == ".npz":
        z = load_npz(path)
        idx = sorted({int(k[3:].split("_")[0]) for k in z.files if k.startswith("req") and k[3:].split("_")[0]
                      .isdigit()})
        if idx != list(range(len(idx))):
            raise TraceError(f"{path}: request keys must be numbered req0.., req{{R-1}} without gaps")
        n = len(idx)
        rid_arr = npz_array(z, path, "request_ids") if "request_ids" in z.files else np.arange(n).astype(str)
        dom_arr = npz_array(z, path, "domains") if "domains" in z.files else np.full(n, "unknown")
        per = {k: as_int_array(npz_array(z, path, k), f"{path}: {k}").ravel() for k in _NPZ_FIELDS if k in z.files}
        for name, arr in (("request_ids", rid_arr), ("domains", dom_arr), *per.items()):
            if len(arr) != n:
                raise TraceError(f"{path}: {name} must have one entry per request ({n}), has {len(arr)}")
        for i in range(n):
            d: dict = {"request_id": str(rid_arr[i]), "domain": str(dom_arr[i])}
            for key, name in ((f"req{i}_prompt", "prompt_routed_experts"), (f"req{i}_decode", "routed_experts"),
                              (f"req{i}_routed", "routed_experts")):
                if key in z.files:
                    if name in d:
                        raise TraceError(f"{path}: req{i}_routed (vLLM >= 0.32) and req{i}_decode (0.21) together")
                    d[name] = npz_array(z, path, key)
            if f"req{i}_prompt" in z.files or f"req{i}_decode" in z.files:
                d.setdefault("prompt_routed_experts", None)  # the 0.21 split layout
            for k, field_name in zip(_NPZ_FIELDS, ("prompt_len", "gen_len", "routed_experts_prompt_start"),
                                     strict=True):
                if k in per:
                    d[field_name] = int(per[k][i])
            yield _vllm_request(d, f"{path}: request {i} ({d['request_id']})")
        return
    regular_input(path, "a .jsonl or .npz file of vLLM routed experts")
    with open(path, encoding="utf-8", errors="strict") as fh:
        for ln, line in enumerate(_lines(fh, path), 1):
            if not line.strip():
                continue
            w = f"{path}: line {ln}"
            d = json_loads(line, w)
            if not isinstance(d, dict):
                raise TraceError(f"{w}: expected a JSON object")
            d.setdefault("request_id", ln - 1)
            yield _vllm_request(d, f"{w} (request {d['request_id']})")


def import_vllm_routed(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    model: str = "unknown",
    num_experts: int | None = None,
    hidden_size: int | None = None,
    num_shared_experts: int = 0,
    overwrite: bool = False,
) -> Path:
    """Import vLLM per-request routed experts (``--enable-return-routed-experts``) from .jsonl or .npz.

    vLLM >= 0.32: ``routed_experts`` [N, Lm, K] covers prompt and generated tokens together from prompt position
    ``routed_experts_prompt_start`` (default 0) to the last token but one; the prompt length (``prompt_token_ids``
    or ``prompt_len``) splits prefill rows from decode rows, and the generated length (``output_token_ids`` or
    ``gen_len``) checks the row count. vLLM 0.21: ``prompt_routed_experts`` [prompt_len, Lm, K] (prefill; rows
    of prefix-cached positions are all 0, or -1, and are dropped and counted) and ``routed_experts`` [gen_len,
    Lm, K] (decode). Lm = the model's hidden layers; layers whose ids are all 0 in every row are dense (vLLM
    never writes them) and are dropped when K >= 2, and ``moe_layer_map`` records the kept model layers.
    ``num_experts`` defaults to the largest id + 1. Request ids are renumbered 0..R-1; the original id is in
    ``source``. A request whose rows cannot be placed on token positions is refused, never guessed.
    """
    path = existing(Path(src), "expected a .jsonl or .npz file of vLLM routed experts")
    where = f"vllm-routed:{path}"
    shape = None
    nonzero = None
    max_id = -1
    n_req = 0
    for r in _iter_vllm(path):  # pass 1: shapes, id range, dense layers
        n_req += 1
        if r.rows.shape[0] == 0:
            continue
        if shape is None:
            shape = r.rows.shape[1:]
            nonzero = np.zeros(shape[0], bool)
        elif r.rows.shape[1:] != shape:
            raise TraceError(f"{path}: request {r.orig_id}: routed_experts has [layers, k] = "
                             f"{list(r.rows.shape[1:])}, earlier requests have {list(shape)}")
        kept = r.rows[~r.unknown]
        if kept.size:
            max_id = max(max_id, int(kept.max()))
            nonzero |= (kept != 0).any(axis=(0, 2))
    if n_req == 0:
        raise TraceError(f"{path}: no requests found")
    if shape is None or max_id < 0:
        raise TraceError(f"{path}: no routed rows (every request is empty or fully prefix-cached)")
    Lm, K = shape
    if max_id >= MAX_EXPERTS:
        raise TraceError(f"{path}: expert id {max_id} is beyond what a trace holds (ids < {MAX_EXPERTS}); "
                         "is this file corrupt?")
    E = int(num_experts) if num_experts is not None else max_id + 1
    if max_id >= E:
        raise TraceError(f"{path}: expert id {max_id} out of range [0, {E}) (--num-experts {E})")
    layers = detect_dense_layers(nonzero, K)
    extra = {"importer": "vllm-routed", "num_model_layers": int(Lm),
             "num_experts_inferred": num_experts is None, "request_id_map": "source column holds vLLM request_id"}
    meta = engine_meta(model, len(layers), E, K, layers.tolist(), hidden_size, num_shared_experts, where, extra)
    out_p = prepare_out(out, path)
    dropped = 0
    with open_writer(out_p, meta, overwrite, [path]) as w:
        for i, r in enumerate(_iter_vllm(path)):  # pass 2: write
            w.add_requests([i], domain=[r.domain if r.domain in DOMAINS else "unknown"],
                           source=[f"vllm request_id={r.orig_id}"], prompt_len=[r.prompt_len], gen_len=[r.gen_len])
            keep = ~r.unknown
            dropped += int(r.unknown.sum())
            if not keep.any():
                continue
            pos = (r.pos0 + np.arange(len(r.rows)))[keep]
            phase = np.where(pos < r.prompt_len, PREFILL, DECODE).astype(np.int8)
            try:
                w.add_tokens(np.full(len(pos), i, np.int64), pos, phase, r.rows[keep][:, layers, :])
            except TraceError as e:
                raise TraceError(f"{path}: request {r.orig_id}: {e}") from None
        w.meta.extra["prefix_cached_rows_dropped"] = dropped
    return out_p
