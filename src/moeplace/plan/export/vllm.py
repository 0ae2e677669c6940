"""vLLM's EPLB mapping: export, read back, and install in a running vLLM.

Shape legend: L = MoE layers, E = logical experts, P = physical slots, M = max replicas of one expert.

vLLM (``vllm/distributed/eplb/eplb_state.py``): the EPLB state is over MoE layers only. vLLM rebuilds
``logical_to_physical_map`` (padded to its own fixed width) and ``logical_replica_count`` from
``physical_to_logical_map`` [L, P] (``compute_logical_maps``, ``EplbState.update_mapping``), so that map and the
shape facts are what is exported. vLLM has no file option for an initial map: :func:`apply_to_vllm` moves the
expert weights and installs the map in a running ``EplbState`` with vLLM's own functions. The export takes no
parameters: the model's dense layers do not appear in vLLM's map.
"""

from __future__ import annotations

import numpy as np

from moeplace import schema
from moeplace.placement import Placement, Plan
from moeplace.plan.export.base import check_plain_moe, matrix_of


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
    p2l = matrix_of(m.physical_to_logical_map, where, "physical_to_logical_map")
    rc = None if m.logical_replica_count is None else matrix_of(m.logical_replica_count, where, "logical_replica_count")
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


def export_vllm(plan: Plan) -> dict:
    """The vLLM JSON of ``plan`` (:func:`to_vllm` of its placement); ValueError for an FoE plan."""
    check_plain_moe(plan, "vLLM")
    return to_vllm(plan.placement)
