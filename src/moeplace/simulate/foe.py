"""The simulator's replay of a Federation-of-Experts layer: all-to-all bytes per link class, all-reduce bytes.

Shape legend: T = tokens, L = MoE layers, K = top-k, W = GPUs, H = FoE groups, M = micro-batches.

The all-to-all is the plain simulator on :func:`moeplace.foe.foe_split` sub-tokens (one per token and group, each
homed on its group's GPU with the token's ring index, :func:`moeplace.foe.foe_plan`), so sends, dedup and the link
split are the one definition in :mod:`moeplace.simulate.routing`. The all-reduce is the ring schedule of
:mod:`moeplace.foe` applied to the rows each ring holds: every ring member sends 2(p-1)/p of its rows, which over
a ring is exactly 2(p-1) times the rows, the closed form of docs/MODEL.md.
"""

from __future__ import annotations

import numpy as np

from moeplace.foe import (
    FoeLayout,
    allreduce_bytes,
    foe_all_reduce_vectors,
    foe_all_to_all_vectors,
    foe_plan,
    foe_split,
    lar_foe,
)
from moeplace.placement import Plan
from moeplace.simulate.batching import BatchConfig
from moeplace.simulate.cost import CostConfig
from moeplace.simulate.routing import link_counts
from moeplace.simulate.simulator import simulate
from moeplace.trace.store import Trace


def replay_foe(window: Trace, microbatch_rows: list[np.ndarray], plan: Plan, cost: CostConfig,
               batching: BatchConfig | None = None) -> dict:
    """Bytes of an FoE layer on the window's tokens: ``inter_node_bytes`` / ``intra_node_bytes`` of the
    all-to-all (per-GPU dedup, dispatch + combine, ``cost.dispatch_bytes`` per element, totals and per layer),
    ``allreduce_inter_node_bytes`` / ``allreduce_intra_node_bytes`` (ring all-reduce of one vector per token
    held, ``cost.combine_bytes`` per element), and the closed forms.

    window: an FoE trace (``foe_groups`` = H of the plan) holding the replayed tokens; microbatch_rows[m]: int [T_m]
    its token indices of micro-batch m (the all-reduce runs per micro-batch); plan: an FoE plan.
    """
    H = plan.foe_groups
    meta = window.meta
    if H <= 1:
        raise ValueError("replay_foe: the plan is not an FoE plan (foe_groups = 1)")
    lay = FoeLayout(H, plan.cluster.world_size, plan.cluster.gpus_per_node)
    W, G, L, K = lay.world_size, lay.gpus_per_node, meta.num_layers, meta.top_k
    rings = lay.ring_index(plan.home_of(window.requests.request_id))  # [R]
    sub = foe_split(window, H)
    sub_plan = foe_plan(plan.cluster, L, meta.num_experts, H, sub.requests.request_id, np.repeat(rings, H))
    sim = simulate(sub, sub_plan, cost=cost, batching=batching or BatchConfig()).all
    res = sim.to_json()
    hidden = cost.hidden_size or meta.hidden_size or 1
    row_bytes = int(round(hidden * cost.combine_bytes))
    order = np.argsort(window.requests.request_id, kind="stable")
    tok_ring = rings[order][np.searchsorted(window.requests.request_id[order], window.tokens.request_id)]
    ar = np.zeros((W, W), np.int64)
    tokens = 0
    for rows in microbatch_rows:
        ar += allreduce_bytes(np.bincount(tok_ring[rows], minlength=lay.block_size), lay, row_bytes)
        tokens += len(rows)
    c = link_counts(ar, G) * L  # every layer reduces the same rows
    p = lay.ring_size
    remote = int(sim.pairs.sum() - sim.local_pairs.sum())  # pairs served off the sub-token's home GPU
    return {
        "inter_node_bytes": {k: res["inter_node_bytes"][k] for k in ("total", "per_layer")},
        "intra_node_bytes": {k: res["intra_node_bytes"][k] for k in ("total", "per_layer")},
        "allreduce_inter_node_bytes": {"total": int(c[2]), "per_layer": [int(c[2]) // L] * L},  # exact: c = x L
        "allreduce_intra_node_bytes": {"total": int(c[1]), "per_layer": [int(c[1]) // L] * L},
        "allreduce_matrix_bytes": (ar * L).tolist(),
        "closed_form": {
            "allreduce_vectors_per_row": foe_all_reduce_vectors(H, W),
            "allreduce_bytes": int(2 * (p - 1) * tokens * L * row_bytes),
            "alltoall_vectors_per_token_uniform": foe_all_to_all_vectors(K, H, W),
            # the same count on this window's routing, pair level (no dedup), dispatch + combine, per token
            "alltoall_pair_vectors_per_token": 2 * remote / max(tokens * L, 1),
            "local_activation_rate": float(sim.local_pairs.sum() / max(int(sim.pairs.sum()), 1)),
            "local_activation_rate_closed_form": lar_foe(H, W),
        },
    }
