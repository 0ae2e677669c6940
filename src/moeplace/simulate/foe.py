"""The simulator's replay of a Federation-of-Experts layer: all-to-all bytes per link class, all-reduce bytes.

Shape legend: T = tokens, L = MoE layers, K = top-k, W = GPUs, H = FoE groups, M = micro-batches.

The all-to-all is the plain simulator on :func:`foe_split` sub-tokens (one per token and group, each homed on its
group's GPU with the token's ring index, :func:`moeplace.placement.foe.foe_plan`), so sends, dedup and the link split
are the one definition in :mod:`moeplace.simulate.routing`. The all-reduce is the ring schedule of
:mod:`moeplace.placement.foe` applied to the rows each ring holds: every ring member sends 2(p-1)/p of its rows, which
over a ring is exactly 2(p-1) times the rows, the closed form of docs/MODEL.md.
"""

from __future__ import annotations

import numpy as np

from moeplace.placement import Plan
from moeplace.placement.foe import (
    FoeLayout,
    allreduce_bytes,
    expert_group,
    foe_all_reduce_vectors,
    foe_all_to_all_vectors,
    foe_plan,
    lar_foe,
)
from moeplace.simulate.batching import BatchConfig
from moeplace.simulate.cost import CostConfig
from moeplace.simulate.routing import link_counts
from moeplace.simulate.simulator import simulate
from moeplace.trace.types import Requests, TokenChunk, Trace, TraceMeta


def trace_groups(meta: TraceMeta) -> int:
    """H of a trace: its FoE groups (``meta.foe_groups``; 1 for a plain MoE trace). When H > 1 the reader has
    checked that every layer's K columns are ordered group by group (columns ``[h*K/H, (h+1)*K/H)`` hold experts of
    ``[h*E/H, (h+1)*E/H)``), so ``expert_ids.reshape(T, L, H, K/H)`` splits a token's experts by group."""
    return int(meta.foe_groups)


def foe_split(trace: Trace, num_groups: int) -> Trace:
    """One sub-token per (token, group): request id r*H + h, the group's k/H experts, same position and phase.

    Every token must select exactly k/H experts in each group (an FoE-structured trace, e.g. ``synth`` with
    ``foe_groups=H``); otherwise ValueError.
    """
    H = int(num_groups)
    m = trace.meta
    if H < 1 or m.top_k % H or m.num_experts % H:
        raise ValueError(f"FoE: H={num_groups} must divide k={m.top_k} and E={m.num_experts}")
    tk = trace.tokens
    kh = m.top_k // H
    grp = expert_group(tk.expert_ids, m.num_experts, H)  # [T, L, K]
    order = np.argsort(grp, axis=-1, kind="stable")
    ids = np.take_along_axis(tk.expert_ids, order, -1)
    g_sorted = np.take_along_axis(grp, order, -1)
    want = np.repeat(np.arange(H), kh)
    if not (g_sorted == want).all():
        raise ValueError(f"FoE: not every token selects exactly k/H={kh} experts in each of {H} groups")
    T, L, _ = ids.shape
    sub = ids.reshape(T, L, H, kh).transpose(0, 2, 1, 3).reshape(T * H, L, kh)
    rid = (np.repeat(tk.request_id, H) * H + np.tile(np.arange(H), T)).astype(np.int64)
    meta = TraceMeta(**{**m.to_json(), "top_k": kh, "has_weights": False, "foe_groups": 1,
                        "source": f"{m.source} | foe_split(H={H})"})
    r = trace.requests
    req = Requests(np.repeat(r.request_id, H) * H + np.tile(np.arange(H), len(r)), np.repeat(r.domain, H),
                   np.repeat(r.source, H), np.repeat(r.prompt_len, H), np.repeat(r.gen_len, H))
    return Trace(meta, req, TokenChunk(rid, np.repeat(tk.position, H), np.repeat(tk.phase, H), sub))


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
