"""Export a plan's placement to the engines: SGLang's ``--init-expert-location`` and vLLM's EPLB mapping.

Shape legend: L = MoE layers, D = decoder layers of the model (dense ones included), E = logical experts,
P = physical slots, M = max replicas of one expert.

SGLang (``python/sglang/srt/eplb/expert_location.py``): ``--init-expert-location FILE.json`` reads a JSON object
and, when it has ``physical_to_logical_map``, calls ``init_by_mapping(model_config, **data, moe_ep_rank=...)``,
so the object must hold that one key and nothing else. The map is ``[D][P]``: one row per decoder layer of the
model (DeepSeek-V3: 61 rows for its 58 MoE layers), indexed by the model's own layer id. SGLang does not check the
row count, so a short map loads and fails later at the first missing layer: the row count must be known (the
plan's ``model_layers``, a trace's ``moe_layer_map``, or ``num_decoder_layers`` = L when every layer is MoE) and
an export that cannot know it is refused. Rows of dense layers are SGLang's trivial map ``p % E`` (never read).

vLLM (``vllm/distributed/eplb/eplb_state.py``): the EPLB state is over MoE layers only. vLLM rebuilds
``logical_to_physical_map`` (padded to its own fixed width) and ``logical_replica_count`` from
``physical_to_logical_map`` [L, P] (``compute_logical_maps``, ``EplbState.update_mapping``), so that map and the
shape facts are what is exported. vLLM has no file option for an initial map: :func:`apply_to_vllm` moves the
expert weights and installs the map in a running ``EplbState`` with vLLM's own functions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moeplace import schema
from moeplace.io import atomic_write_json
from moeplace.placement import ModelLayers, Placement, Plan

FORMATS = ("sglang", "vllm")
MAX_DECODER_LAYERS = 10000  # D: bounds the [D, P] SGLang map (DeepSeek-V3 has 61)


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
        if lm and max(lm) >= MAX_DECODER_LAYERS:
            raise ValueError(f"moe_layer_map: layer id {max(lm)} is beyond {MAX_DECODER_LAYERS} decoder layers")
        return ModelLayers(tuple(lm), D)
    if recorded is not None:
        if num_decoder_layers is not None and int(num_decoder_layers) != recorded.num_decoder_layers:
            raise ValueError(f"num_decoder_layers={num_decoder_layers} but {where} records "
                             f"{recorded.num_decoder_layers} decoder layers")
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
    """vLLM EPLB mapping over MoE layers: ``physical_to_logical_map`` [L][P] and the shape facts vLLM checks it
    against (see the module docstring)."""
    L, P = placement.phy2log.shape
    E = placement.num_experts
    return {
        "format": "vllm-eplb-state",
        "num_moe_layers": int(L),
        "num_logical_experts": int(E),
        "num_redundant_experts": int(P - E),
        "ep_size": int(placement.num_gpus),
        "physical_to_logical_map": placement.phy2log.tolist(),
    }


def from_vllm(d: object, num_experts: int | None = None, where: str = "vLLM mapping") -> Placement:
    """Read a vLLM EPLB mapping back; checks the schema, the shape facts and, in older exports that carry them,
    that ``logical_to_physical_map`` and ``logical_replica_count`` agree with the physical map."""
    m = schema.validate(schema.VLLMMappingJSON, d, where)
    p2l = _matrix(m.physical_to_logical_map, where, "physical_to_logical_map")
    rc = None if m.logical_replica_count is None else _matrix(m.logical_replica_count, where, "logical_replica_count")
    E = num_experts if num_experts is not None else m.num_logical_experts if m.num_logical_experts is not None \
        else rc.shape[1] if rc is not None else p2l.shape[1] - m.num_redundant_experts
    if m.num_logical_experts is not None and E != m.num_logical_experts:
        raise schema.SchemaError(f"{where}: num_logical_experts={m.num_logical_experts} but {E} were expected")
    if m.num_moe_layers is not None and m.num_moe_layers != p2l.shape[0]:
        raise schema.SchemaError(f"{where}: num_moe_layers={m.num_moe_layers} but physical_to_logical_map has "
                                 f"{p2l.shape[0]} rows")
    try:
        pl = Placement(p2l, int(E), m.ep_size)
    except ValueError as e:
        raise schema.SchemaError(f"{where}: {e}") from None
    if m.num_redundant_experts != pl.num_slots - E:
        raise schema.SchemaError(f"{where}: num_redundant_experts={m.num_redundant_experts} but the map has "
                                 f"{pl.num_slots} slots for {E} experts")
    if rc is not None and (rc.shape != pl.replica_count.shape or not np.array_equal(rc, pl.replica_count)):
        raise schema.SchemaError(f"{where}: logical_replica_count disagrees with physical_to_logical_map")
    if m.logical_to_physical_map is not None:
        l2p, cur = m.logical_to_physical_map, pl.log2phy
        width = {len(row) for layer in l2p for row in layer}
        if len(l2p) != pl.num_layers or any(len(layer) != E for layer in l2p) or len(width) != 1 \
                or width.pop() < cur.shape[2]:
            raise schema.SchemaError(f"{where}: logical_to_physical_map must be [{pl.num_layers}][{E}][R + 1]")
        l2p = np.asarray(l2p, np.int64)
        if not np.array_equal(l2p[:, :, : cur.shape[2]], cur) or (l2p[:, :, cur.shape[2]:] != -1).any():
            raise schema.SchemaError(f"{where}: logical_to_physical_map disagrees with physical_to_logical_map")
    return pl


def apply_to_vllm(eplb_state, model_config, mapping: dict, ep_group) -> None:  # pragma: no cover - needs vLLM
    """Install a moeplace vLLM export in a running vLLM (0.32) on every EP rank, with vLLM's own functions.

    ``eplb_state``: the worker's ``vllm.distributed.eplb.eplb_state.EplbState`` (``model_runner.eplb_state``);
    ``model_config``: the ``ModelConfig`` it was built for; ``mapping``: the JSON written by ``moeplace export
    --format vllm``; ``ep_group``: the EP ``ProcessGroup`` (``get_ep_group().device_group``). Moves the expert
    weights with ``rearrange_expert_weights_inplace`` (old map -> new map), then ``EplbState.update_mapping``
    installs the physical map and rebuilds the logical map and replica counts (``compute_logical_maps``).
    Call it on every rank between forward passes. ValueError when the export does not fit the running model.
    """
    import torch
    from vllm.distributed.eplb.rebalance_execute import rearrange_expert_weights_inplace

    state = eplb_state.model_states[model_config.compute_hash()]
    cur = state.physical_to_logical_map
    pl = from_vllm(mapping, int(state.model.num_logical_experts))
    if tuple(pl.phy2log.shape) != tuple(cur.shape) or pl.num_gpus != ep_group.size():
        raise ValueError(f"vLLM mapping: {list(pl.phy2log.shape)} for {pl.num_gpus} EP ranks, but the running "
                         f"model has {list(cur.shape)} on {ep_group.size()}")
    new = torch.as_tensor(pl.phy2log, dtype=cur.dtype, device=cur.device)
    rearrange_expert_weights_inplace(cur, new, state.model.expert_weights, state.expert_buffer, ep_group,
                                     state.communicator)
    eplb_state.update_mapping(model_config, new)


def export_plan(plan: Plan, fmt: str, out: str | Path, moe_layer_map: list[int] | None = None,
                num_decoder_layers: int | None = None) -> Path:
    """Write ``plan`` in engine format ``fmt`` ("sglang" or "vllm") to ``out``.

    sglang: the layout comes from :func:`resolve_layers` (``moe_layer_map`` / ``num_decoder_layers`` override the
    plan's ``model_layers``); ValueError when the row count cannot be known.
    """
    if fmt == "sglang":
        layers = resolve_layers(plan.placement.num_layers, moe_layer_map, num_decoder_layers, plan.model_layers)
        obj = to_sglang(plan.placement, layers)
    elif fmt == "vllm":
        obj = to_vllm(plan.placement)
    else:
        raise ValueError(f"export format {fmt!r}: expected one of {FORMATS}")
    return atomic_write_json(obj, out, indent=None)
