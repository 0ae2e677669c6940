"""Export a plan's placement to the engines: SGLang's ``--init-expert-location`` and vLLM's EPLB mapping.

Shape legend: L = MoE layers, D = decoder layers of the model (dense ones included), E = logical experts,
P = physical slots, M = max replicas of one expert.

SGLang (``python/sglang/srt/eplb/expert_location.py``): ``--init-expert-location FILE.json`` reads a JSON object
and, when it has ``physical_to_logical_map``, calls ``init_by_mapping(server_args, model_config, **data)``, so
the object must hold that one key and nothing else. The map is ``[D][P]``: one row per decoder layer of the
model (DeepSeek-V3: 61 rows for its 58 MoE layers), indexed by the model's own layer id; rows of dense layers are
unused by SGLang and are written as its trivial map ``p % E``. MoE layer l goes to row ``moe_layer_map[l]``.

vLLM (``vllm/distributed/eplb``): the EPLB state is three tensors over MoE layers only:
``physical_to_logical_map`` [L, P], ``logical_to_physical_map`` [L, E, R + 1] (slots of each expert ascending,
padded with -1) and ``logical_replica_count`` [L, E]. vLLM has no file option for an initial map, so the JSON
written here holds those three arrays plus ``num_redundant_experts`` and ``ep_size`` for a loader to copy into
``EplbState`` (e.g. after ``EplbState.build``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moeplace import schema
from moeplace.io import atomic_write_json
from moeplace.placement import Placement, Plan

FORMATS = ("sglang", "vllm")
MAX_DECODER_LAYERS = 10000  # D: bounds the [D, P] SGLang map (DeepSeek-V3 has 61)


def to_sglang(placement: Placement, moe_layer_map: list[int] | None = None,
              num_decoder_layers: int | None = None) -> dict:
    """SGLang ``--init-expert-location`` JSON: ``{"physical_to_logical_map": [D][P]}``.

    moe_layer_map: [L] model layer of each MoE layer (default: 0..L-1); num_decoder_layers: D (default: the
    largest mapped layer + 1).
    """
    L, P = placement.phy2log.shape
    E = placement.num_experts
    lm = list(range(L)) if moe_layer_map is None else [int(x) for x in moe_layer_map]
    if len(lm) != L:
        raise ValueError(f"moe_layer_map has {len(lm)} entries but the plan has {L} MoE layers")
    if len(set(lm)) != L or min(lm) < 0:
        raise ValueError(f"moe_layer_map must list distinct non-negative layer ids, got {lm}")
    D = max(lm) + 1 if num_decoder_layers is None else int(num_decoder_layers)
    if D > MAX_DECODER_LAYERS:
        raise ValueError(f"num_decoder_layers={D}: at most {MAX_DECODER_LAYERS} decoder layers")
    if D <= max(lm):
        raise ValueError(f"num_decoder_layers={D} is too small for MoE layer id {max(lm)}")
    rows = np.tile(np.arange(P) % E, (D, 1))
    rows[lm] = placement.phy2log
    return {"physical_to_logical_map": rows.tolist()}


def from_sglang(d: object, num_experts: int, num_gpus: int, moe_layer_map: list[int] | None = None,
                where: str = "SGLang mapping") -> Placement:
    """Read an SGLang init-expert-location mapping back (the MoE rows only); errors name ``where`` and the field."""
    m = schema.validate(schema.SGLangMappingJSON, d, where)
    rows = _matrix(m.physical_to_logical_map, where, "physical_to_logical_map")
    lm = list(range(rows.shape[0])) if moe_layer_map is None else [int(x) for x in moe_layer_map]
    if any(not 0 <= x < rows.shape[0] for x in lm):
        raise schema.SchemaError(f"{where}: physical_to_logical_map has {rows.shape[0]} layers; the MoE layer map "
                                 f"needs {max(lm) + 1}")
    try:
        return Placement(rows[lm], num_experts, num_gpus)
    except ValueError as e:
        raise schema.SchemaError(f"{where}: {e}") from None


def _matrix(rows: list[list[int]], where: str, name: str) -> np.ndarray:
    """int64 [L, P] from validated rows; SchemaError when they are ragged or empty."""
    if not rows or len({len(r) for r in rows}) != 1 or not rows[0]:
        raise schema.SchemaError(f"{where}: {name}: expected a non-empty rectangular [layers][slots] array")
    return np.asarray(rows, np.int64)


def to_vllm(placement: Placement) -> dict:
    """vLLM EPLB state JSON over MoE layers (see the module docstring)."""
    L, P = placement.phy2log.shape
    E = placement.num_experts
    R = P - E
    l2p = np.full((L, E, R + 1), -1, np.int64)
    cur = placement.log2phy
    l2p[:, :, : cur.shape[2]] = cur
    return {
        "format": "vllm-eplb-state",
        "num_redundant_experts": int(R),
        "ep_size": int(placement.num_gpus),
        "physical_to_logical_map": placement.phy2log.tolist(),
        "logical_to_physical_map": l2p.tolist(),
        "logical_replica_count": placement.replica_count.tolist(),
    }


def from_vllm(d: object, num_experts: int | None = None, where: str = "vLLM mapping") -> Placement:
    """Read the vLLM EPLB JSON back; checks the schema and that the three arrays agree."""
    m = schema.validate(schema.VLLMMappingJSON, d, where)
    p2l = _matrix(m.physical_to_logical_map, where, "physical_to_logical_map")
    rc = _matrix(m.logical_replica_count, where, "logical_replica_count")
    E = int(num_experts) if num_experts is not None else rc.shape[1]
    try:
        pl = Placement(p2l, E, m.ep_size)
    except ValueError as e:
        raise schema.SchemaError(f"{where}: {e}") from None
    if rc.shape != pl.replica_count.shape or not np.array_equal(rc, pl.replica_count):
        raise schema.SchemaError(f"{where}: logical_replica_count disagrees with physical_to_logical_map")
    if m.num_redundant_experts != pl.num_slots - E:
        raise schema.SchemaError(f"{where}: num_redundant_experts={m.num_redundant_experts} but the map has "
                                 f"{pl.num_slots} slots for {E} experts")
    l2p = m.logical_to_physical_map
    cur = pl.log2phy
    width = {len(row) for layer in l2p for row in layer}
    if len(l2p) != pl.num_layers or any(len(layer) != E for layer in l2p) or len(width) != 1 \
            or width.pop() < cur.shape[2]:
        raise schema.SchemaError(f"{where}: logical_to_physical_map must be [{pl.num_layers}][{E}][R + 1]")
    l2p = np.asarray(l2p, np.int64)
    if not np.array_equal(l2p[:, :, : cur.shape[2]], cur) or (l2p[:, :, cur.shape[2]:] != -1).any():
        raise schema.SchemaError(f"{where}: logical_to_physical_map disagrees with physical_to_logical_map")
    return pl


def export_plan(plan: Plan, fmt: str, out: str | Path, moe_layer_map: list[int] | None = None,
                num_decoder_layers: int | None = None) -> Path:
    """Write ``plan`` in engine format ``fmt`` ("sglang" or "vllm") to ``out``."""
    if fmt == "sglang":
        obj = to_sglang(plan.placement, moe_layer_map, num_decoder_layers)
    elif fmt == "vllm":
        obj = to_vllm(plan.placement)
    else:
        raise ValueError(f"export format {fmt!r}: expected one of {FORMATS}")
    return atomic_write_json(obj, out, indent=None)
