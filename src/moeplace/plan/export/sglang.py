"""SGLang's ``--init-expert-location`` mapping: export and read back.

Shape legend: L = MoE layers, D = decoder layers of the model (dense ones included), E = logical experts,
P = physical slots.

SGLang (``python/sglang/srt/eplb/expert_location.py``): ``--init-expert-location FILE.json`` reads a JSON object
and, when it has ``physical_to_logical_map``, calls ``init_by_mapping(model_config, **data, moe_ep_rank=...)``,
so the object must hold that one key and nothing else. The map is ``[D][P]``: one row per decoder layer of the
model (DeepSeek-V3: 61 rows for its 58 MoE layers), indexed by the model's own layer id. SGLang does not check the
row count, so a short map loads and fails later at the first missing layer: the row count must be known (the
plan's ``model_layers``, a trace's ``moe_layer_map``, or ``num_decoder_layers`` = L when every layer is MoE) and
an export that cannot know it is refused. Rows of dense layers are SGLang's trivial map ``p % E`` (never read).
"""

from __future__ import annotations

import numpy as np

from moeplace import schema
from moeplace.placement import ModelLayers, Placement, Plan
from moeplace.plan.export.base import check_plain_moe, matrix_of, resolve_layers


def to_sglang(placement: Placement, layers: ModelLayers) -> dict:
    """SGLang ``--init-expert-location`` JSON: ``{"physical_to_logical_map": [D][P]}``; MoE layer l goes to row
    ``layers.moe_layer_map[l]``, every other row is SGLang's trivial ``p % E``."""
    L, P = placement.phy2log.shape
    if len(layers.moe_layer_map) != L:
        raise ValueError(f"moe_layer_map has {len(layers.moe_layer_map)} entries but the plan has {L} MoE layers")
    rows = np.tile(np.arange(P) % placement.num_experts, (layers.num_decoder_layers, 1))
    rows[list(layers.moe_layer_map)] = placement.phy2log
    return {"physical_to_logical_map": rows.tolist()}


def from_sglang(d: object, num_experts: int, num_gpus: int, moe_layer_map: list[int] | None = None,
                where: str = "SGLang mapping") -> Placement:
    """Read an SGLang init-expert-location mapping back (the MoE rows only); errors name ``where`` and the field."""
    m = schema.validate(schema.SGLangMappingJSON, d, where)
    rows = matrix_of(m.physical_to_logical_map, where, "physical_to_logical_map")
    lm = list(range(rows.shape[0])) if moe_layer_map is None else [int(x) for x in moe_layer_map]
    if any(not 0 <= x < rows.shape[0] for x in lm):
        raise schema.SchemaError(f"{where}: physical_to_logical_map has {rows.shape[0]} layers; the MoE layer map "
                                 f"needs {max(lm) + 1}")
    try:
        return Placement(rows[lm], num_experts, num_gpus)
    except ValueError as e:
        raise schema.SchemaError(f"{where}: {e}") from None


def export_sglang(plan: Plan, moe_layer_map: list[int] | None = None,
                  num_decoder_layers: int | None = None) -> dict:
    """The SGLang JSON of ``plan``; the layout comes from :func:`resolve_layers` (``moe_layer_map`` /
    ``num_decoder_layers`` override the plan's ``model_layers``); ValueError when the row count cannot be known."""
    check_plain_moe(plan, "SGLang")
    layers = resolve_layers(plan.placement.num_layers, moe_layer_map, num_decoder_layers, plan.model_layers)
    return to_sglang(plan.placement, layers)
