"""What every engine export shares: the model's layer layout (which decoder layers are MoE layers) and the matrix
reader of the engines' JSON.

Shape legend: L = MoE layers, D = decoder layers of the model (dense ones included), P = physical slots.
"""

from __future__ import annotations

import numpy as np

from moeplace import schema
from moeplace.placement import ModelLayers
from moeplace.plan.export import MAX_DECODER_LAYERS


def check_plain_moe(plan, fmt: str) -> None:
    """ValueError for an FoE plan (``plan.foe_groups > 1``): the engines serve plain MoE, so no engine map of it
    means what the plan means."""
    if getattr(plan, "foe_groups", 1) > 1:
        raise ValueError(f"an FoE plan (foe_groups={plan.foe_groups}) has no {fmt} mapping: the engines serve plain "
                         "MoE; an FoE plan runs with moeplace run-ep (docs/FOE.md)")


def resolve_layers(num_moe_layers: int, moe_layer_map: list[int] | None = None,
                   num_decoder_layers: int | None = None, recorded: ModelLayers | None = None,
                   where: str = "plan") -> ModelLayers:
    """The model's layer layout for an export of ``num_moe_layers`` MoE layers, or ValueError when unknown.

    Precedence: an explicit ``moe_layer_map`` (e.g. from a trace; D = ``num_decoder_layers``, else the layout
    ``recorded`` in the plan when it maps the same layers, else the last MoE layer + 1), then the ``recorded``
    layout, then ``num_decoder_layers`` equal to ``num_moe_layers`` (every decoder layer is an MoE layer).
    """
    L = int(num_moe_layers)
    if num_decoder_layers is not None and not 0 < int(num_decoder_layers) <= MAX_DECODER_LAYERS:
        raise ValueError(f"num_decoder_layers={num_decoder_layers}: expected 1..{MAX_DECODER_LAYERS}")
    if moe_layer_map is not None:
        lm = [int(x) for x in moe_layer_map]
        if len(lm) != L:
            raise ValueError(f"moe_layer_map has {len(lm)} entries but {where} has {L} MoE layers")
        D = num_decoder_layers
        if D is None and recorded is not None and list(recorded.moe_layer_map) == lm:
            D = recorded.num_decoder_layers
        D = max(lm) + 1 if D is None else int(D)
        if D > MAX_DECODER_LAYERS:
            raise ValueError(f"{where} records model_layers.num_decoder_layers={D}, beyond the "
                             f"{MAX_DECODER_LAYERS} decoder layers an export writes")
        if lm and max(lm) >= MAX_DECODER_LAYERS:
            raise ValueError(f"moe_layer_map: layer id {max(lm)} is beyond {MAX_DECODER_LAYERS} decoder layers")
        return ModelLayers(tuple(lm), D)
    if recorded is not None:
        if num_decoder_layers is not None and int(num_decoder_layers) != recorded.num_decoder_layers:
            raise ValueError(f"num_decoder_layers={num_decoder_layers} but {where} records "
                             f"{recorded.num_decoder_layers} decoder layers")
        if recorded.num_decoder_layers > MAX_DECODER_LAYERS:  # a file's count is bounded as the flag is
            raise ValueError(f"{where} records model_layers.num_decoder_layers={recorded.num_decoder_layers}, "
                             f"beyond the {MAX_DECODER_LAYERS} decoder layers an export writes")
        return recorded
    if num_decoder_layers is not None and int(num_decoder_layers) == L:
        return ModelLayers(tuple(range(L)), L)
    raise ValueError(f"{where}: which decoder layers are MoE layers is not known (the plan records no model layout: "
                     "made from a load file, or by an older moeplace), so the SGLang map's row count cannot be told; "
                     f"pass the trace (--trace) or, if all {L} decoder layers are MoE layers, "
                     f"--num-decoder-layers {L}")


def layers_of_trace(meta) -> ModelLayers | None:
    """The model layout a trace's metadata (:class:`moeplace.trace.TraceMeta`) records: its ``moe_layer_map`` and
    the model's decoder layers from ``extra.num_model_layers`` (engine importers), else the last MoE layer + 1.
    None when the trace has no ``moe_layer_map``."""
    lm = meta.moe_layer_map
    if lm is None:
        return None
    D = meta.extra.get("num_model_layers") if isinstance(meta.extra, dict) else None
    ok = isinstance(D, int) and not isinstance(D, bool) and max(lm) < D <= MAX_DECODER_LAYERS
    return ModelLayers(tuple(int(x) for x in lm), int(D) if ok else max(lm) + 1)


def matrix_of(rows: list[list[int]], where: str, name: str) -> np.ndarray:
    """int64 [L, P] from validated rows; SchemaError when they are ragged or empty."""
    if not rows or len({len(r) for r in rows}) != 1 or not rows[0]:
        raise schema.SchemaError(f"{where}: {name}: expected a non-empty rectangular [layers][slots] array")
    return np.asarray(rows, np.int64)
