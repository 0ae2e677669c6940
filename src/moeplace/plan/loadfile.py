"""Expert-load files a plan can be made from when there is no per-token trace.

Shape legend: B = SGLang's buffer of recorded passes, L = MoE layers, E = logical experts.

Formats: a JSON ``[L][E]`` (or ``[B][L][E]``, summed over B) of non-negative finite numbers; a JSON object with
``logical_count`` in either shape (SGLang's expert-distribution JSON); an SGLang ``.pt`` stat dump, a dict with
``logical_count`` [B, L, E], read with ``torch.load(weights_only=True)`` so a malicious pickle is refused.
"""

from __future__ import annotations

import os
import re
import warnings

import numpy as np

from moeplace import schema
from moeplace.trace.types import MAX_EXPERTS, MAX_LAYERS

MAX_LOAD_CELLS = 1 << 26  # B * L * E of a load file (512 MiB as float64)
MAX_LAYER_LOAD = float(1 << 53)  # a layer's total load: integers are exact up to here, and its sums stay finite
MAX_PT_BYTES = 1 << 30  # largest .pt dump read


def read_load(path: str | os.PathLike) -> np.ndarray:
    """float64 [L, E] from a load file (see the module docstring); ValueError naming the file and the problem."""
    pt = str(path).endswith(".pt")
    p = schema.check_input_file(path, "load file", max_bytes=MAX_PT_BYTES if pt else schema.MAX_JSON_BYTES,
                                parse_factor=2 if pt else schema.JSON_PARSE_FACTOR)  # a .pt holds its tensors
    if p.suffix == ".pt":
        arr = _read_pt(p)
    else:
        obj = schema.parse_json(p.read_bytes(), str(p))
        if isinstance(obj, dict):
            obj = schema.validate(schema.LoadObjectJSON, obj, str(p)).logical_count
        else:
            obj = schema.validate(schema.LOAD_ADAPTER, obj, str(p))
        if not obj or not obj[0]:
            raise schema.SchemaError(f"{p}: the load matrix is empty (expected [L][E] with L, E >= 1)")
        try:
            arr = np.asarray(obj, np.float64)
        except ValueError:
            raise schema.SchemaError(f"{p}: load rows have different lengths (expected a rectangular [L][E] or "
                                     "[B][L][E] array)") from None
    if arr.ndim == 3:
        if not np.isfinite(arr).all():
            raise schema.SchemaError(f"{p}: load entries must be finite numbers >= 0")
        with np.errstate(over="ignore"):
            arr = arr.sum(axis=0)
    if arr.ndim != 2 or 0 in arr.shape:
        raise schema.SchemaError(f"{p}: load must have shape [L, E] (or [buffer, L, E]), got {arr.shape}")
    L, E = arr.shape
    if L > MAX_LAYERS or E > MAX_EXPERTS:  # what a trace may hold: a plan of it must be simulable and exportable
        raise schema.SchemaError(f"{p}: load of {L} layers x {E} experts is beyond the trace limits ({MAX_LAYERS} "
                                 f"layers, {MAX_EXPERTS} experts)")
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise schema.SchemaError(f"{p}: load entries must be finite numbers >= 0")
    with np.errstate(over="ignore"):
        per_layer = arr.sum(axis=1)
    if not (per_layer <= MAX_LAYER_LOAD).all():  # sums the planner forms must stay exact and finite
        layer = int(np.flatnonzero(~(per_layer <= MAX_LAYER_LOAD))[0])
        raise schema.SchemaError(f"{p}: layer {layer}'s load sums to {per_layer[layer]:.3g}, more than "
                                 f"{MAX_LAYER_LOAD:.3g} (2^53: counts beyond it are not exact; scale the load down)")
    return arr


def _torch_reason(e: Exception) -> str:
    """The useful part of a torch.load error: the refused global of an unsafe pickle, else its first line (never
    torch's advice to retry with weights_only=False, which would run the pickle)."""
    text = str(e)
    m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if m:
        return f"it would call {m.group(1)}, which is refused"
    m = re.search(r"WeightsUnpickler error: ([^\n]+)", text)
    if m:
        return m.group(1).strip()[:200]
    first = text.strip().splitlines()[0][:200] if text.strip() else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _read_pt(p) -> np.ndarray:
    """float64 [B, L, E] or [L, E] of an SGLang stat dump."""
    try:
        import torch
    except ImportError:
        raise schema.SchemaError(f"{p}: reading a .pt dump needs torch, which is not installed") from None
    with open(p, "rb"):  # an unreadable file is an OSError naming it, not a "bad dump"
        pass
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols on stderr; the error says enough
            warnings.simplefilter("ignore")
            obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types (UnpicklingError, RuntimeError, IndexError...) for a bad file
        raise schema.SchemaError(f"{p}: not a torch file that loads safely with weights_only=True "
                                 f"({_torch_reason(e)})") from None
    if not isinstance(obj, dict) or "logical_count" not in obj:
        raise schema.SchemaError(f"{p}: expected an SGLang stat dump (a dict with 'logical_count')")
    lc = obj["logical_count"]
    if not isinstance(lc, torch.Tensor) or lc.dim() not in (2, 3) or lc.is_complex() or lc.dtype == torch.bool:
        raise schema.SchemaError(f"{p}: logical_count must be a real [B, L, E] or [L, E] tensor")
    if lc.numel() > MAX_LOAD_CELLS:
        raise schema.SchemaError(f"{p}: logical_count has {lc.numel()} entries, more than {MAX_LOAD_CELLS}")
    arr = lc.detach().to(torch.float64).numpy()
    if not np.isfinite(arr).all():
        raise schema.SchemaError(f"{p}: logical_count holds NaN or infinite counts")
    return arr
