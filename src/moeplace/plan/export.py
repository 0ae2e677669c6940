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

from moeplace.io import atomic_write_json
from moeplace.placement import Placement, Plan

FORMATS = ("sglang", "vllm")


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
    if D <= max(lm):
        raise ValueError(f"num_decoder_layers={D} is too small for MoE layer id {max(lm)}")
    rows = np.tile(np.arange(P) % E, (D, 1))
    rows[lm] = placement.phy2log
    return {"physical_to_logical_map": rows.tolist()}


def from_sglang(d: dict, num_experts: int, num_gpus: int, moe_layer_map: list[int] | None = None) -> Placement:
    """Read an SGLang init-expert-location mapping back (the MoE rows only)."""
    if not isinstance(d, dict) or "physical_to_logical_map" not in d:
        raise ValueError("SGLang mapping: expected a JSON object with 'physical_to_logical_map'")
    rows = np.asarray(d["physical_to_logical_map"], np.int64)
    if rows.ndim != 2:
        raise ValueError(f"SGLang mapping: physical_to_logical_map must be [layers][P], got shape {rows.shape}")
    lm = list(range(rows.shape[0])) if moe_layer_map is None else list(moe_layer_map)
    return Placement(rows[lm], num_experts, num_gpus)


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


def from_vllm(d: dict, num_experts: int | None = None) -> Placement:
    """Read the vLLM EPLB JSON back; checks that the three arrays agree."""
    for k in ("physical_to_logical_map", "logical_to_physical_map", "logical_replica_count", "ep_size"):
        if k not in d:
            raise ValueError(f"vLLM mapping: missing key {k!r}")
    p2l = np.asarray(d["physical_to_logical_map"], np.int64)
    E = int(num_experts) if num_experts is not None else len(d["logical_replica_count"][0])
    pl = Placement(p2l, E, int(d["ep_size"]))
    if not np.array_equal(np.asarray(d["logical_replica_count"]), pl.replica_count):
        raise ValueError("vLLM mapping: logical_replica_count disagrees with physical_to_logical_map")
    l2p = np.asarray(d["logical_to_physical_map"], np.int64)
    cur = pl.log2phy
    if not np.array_equal(l2p[:, :, : cur.shape[2]], cur) or (l2p[:, :, cur.shape[2]:] != -1).any():
        raise ValueError("vLLM mapping: logical_to_physical_map disagrees with physical_to_logical_map")
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
