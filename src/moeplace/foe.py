"""Federation of Experts (FoE): closed forms of docs/MODEL.md and the mapping that lets the simulator replay FoE.

FoE: ``H`` groups (one per KV head), each owning ``E/H`` experts and routing ``k/H`` of them per token; the groups
sum their residuals with one cross-group all-reduce per layer. ``W`` GPUs, ``n`` per node, ``r = B_intra / B_inter``.
Volumes are in token vectors per token per layer (dispatch + combine, pair level: no dedup).

To replay an FoE model, :func:`foe_split` turns each token into ``H`` sub-tokens, one per group, each starting on
its group's GPUs (where that group's attention head lives) and selecting only its group's ``k/H`` experts;
:func:`foe_plan` puts group ``h``'s experts on GPU block ``h``. The simulator's pair counts then match the closed
forms (``tests/test_foe.py``).
"""

from __future__ import annotations

import numpy as np

from moeplace.placement import Cluster, Placement, Plan
from moeplace.trace.store import Requests, TokenChunk, Trace, TraceMeta


def _check(**kw) -> None:
    for name, v in kw.items():
        if not v >= 1:
            raise ValueError(f"FoE: {name} must be >= 1, got {v!r}")


def lar_moe(W: int) -> float:
    """Local activation rate of plain MoE with uniform routing: 1/W."""
    _check(W=W)
    return 1.0 / W


def lar_foe(H: int, W: int) -> float:
    """Local activation rate of FoE: min(H/W, 1)."""
    _check(H=H, W=W)
    return min(H / W, 1.0)


def moe_all_to_all_vectors(k: int, W: int, n: int) -> tuple[float, float]:
    """(total, inter-node) vectors per token per layer of plain MoE: 2k(W-1)/W and 2k(W-n)/W."""
    _check(k=k, W=W, n=n)
    return 2 * k * (W - 1) / W, 2 * k * max(W - n, 0) / W


def foe_all_to_all_vectors(k: int, H: int, W: int) -> float:
    """FoE all-to-all vectors per token per layer: 2k(W-H)/W (0 once H >= W), intra-node when W/H <= n."""
    _check(k=k, H=H, W=W)
    return 2 * k * max(W - H, 0) / W


def foe_all_reduce_vectors(H: int, W: int) -> float:
    """FoE cross-group all-reduce vectors per token per layer: 2(p-1)/p with p = min(W, H)."""
    _check(H=H, W=W)
    p = min(W, H)
    return 2 * (p - 1) / p


def moe_foe_time_ratio(k: int, H: int, r: float, W: int | None = None, n: int | None = None) -> float:
    """T_moe / T_foe in the bandwidth model (time in units of one vector over NVLink).

    T_moe = 2k(W-n)/W * r + 2k(n-1)/W;  T_foe = 2k(W-H)/W + 2(p-1)/p * r (the all-reduce crosses nodes).
    With W None (the large-cluster limit) this is k*H*r / (k*H + r*(H-1)); k=8, H=8, r=20 gives 6.27.
    """
    _check(k=k, H=H, r=r)
    if W is None:
        return k * H * r / (k * H + r * (H - 1))
    if n is None:
        raise ValueError("moe_foe_time_ratio: give n (GPUs per node) with W")
    total, inter = moe_all_to_all_vectors(k, W, n)
    t_moe = inter * r + (total - inter)
    t_foe = foe_all_to_all_vectors(k, H, W) + foe_all_reduce_vectors(H, W) * r
    return t_moe / t_foe


def expert_group(expert_ids: np.ndarray, num_experts: int, num_groups: int) -> np.ndarray:
    """FoE group of each expert id: contiguous blocks of E/H experts."""
    if num_experts % num_groups:
        raise ValueError(f"FoE: {num_experts} experts do not split into {num_groups} equal groups")
    return np.asarray(expert_ids) // (num_experts // num_groups)


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


def foe_plan(cluster: Cluster, num_layers: int, num_experts: int, num_groups: int, request_ids: np.ndarray) -> Plan:
    """Group h's experts on GPU block h (linear placement of contiguous groups); sub-request r*H + h homed on a GPU
    of block h (round-robin over the block by r)."""
    W, H = cluster.world_size, int(num_groups)
    if W % H and H % W:
        raise ValueError(f"FoE: {W} GPUs and H={H} groups: one must divide the other")
    placement = Placement.linear(num_layers, num_experts, W)
    rid = np.asarray(request_ids, np.int64)
    h, r = rid % H, rid // H
    if W >= H:
        per = W // H
        home = h * per + r % per
    else:
        home = h // (H // W)
    return Plan(placement, cluster, {int(a): int(b) for a, b in zip(rid, home, strict=True)}, strategy=f"foe-H{H}")
