"""Federation of Experts on real processes: an all-to-all inside each group, then the cross-group all-reduce.

Shape legend: T = tokens of one micro-batch, T_r = tokens this rank holds, L = MoE layers, K = top-k, E = logical
experts, W = ranks, G = ranks per node, H = FoE groups (hidden size is ``cfg.hidden``), M = micro-batches,
R = timed repeats, p = ranks of one all-reduce ring, b = ranks of one group's block.

Where things live is :class:`moeplace.placement.foe.FoeLayout` (docs/FOE.md, "Execution"): group h's experts on its
block of W/H ranks (W > H; one node) or H/W whole groups per rank (W <= H). A token's hidden vector is on one rank of
every block (the ranks with its *ring index*), as after the previous layer's all-reduce. Per layer each rank

1. sends its tokens' pairs of its own groups to the experts of its block (:class:`moeplace.run.dispatch.Dispatcher`
   on the block's process group: the all-to-all never leaves the block) and gets the weighted sums back:
   ``m_g(t)`` summed over the groups it holds;
2. sums ``m`` over its ring (the H ranks, or all W when W <= H, that hold the same tokens for different groups)
   with a ring all-reduce (:func:`ring_all_reduce`: reduce-scatter, then all-gather, each step an
   ``all_to_all_single`` on the ring's process group with rows only to the successor, so the bytes handed to
   torch.distributed are counted exactly as for the all-to-all).

The result on every ring member is ``sum_h m_h(t)`` = the MoE output over all K of the token's experts, which
:func:`moeplace.run.replay.reference_outputs` computes in one process.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moeplace.placement import Plan
from moeplace.placement.foe import FoeLayout, ring_chunks, ring_steps
from moeplace.run.dispatch import Dispatcher, TrafficRecorder
from moeplace.run.layer import ExpertView, MoELayer
from moeplace.run.replay import (
    DTYPES,
    MicroBatch,
    ReplayConfig,
    expert_table,
    make_batch,
    stat_of,
    time_stat,
    token_hidden,
    token_homes,
)
from moeplace.simulate import link_counts
from moeplace.trace.types import Trace


def layout_of(plan: Plan) -> FoeLayout:
    """The FoE layout of an FoE plan (ValueError for a plain MoE plan)."""
    if plan.foe_groups <= 1:
        raise ValueError(f"plan {plan.strategy!r} is not an FoE plan (foe_groups = 1)")
    return FoeLayout(plan.foe_groups, plan.cluster.world_size, plan.cluster.gpus_per_node)


def check_foe_routing(expert_ids: np.ndarray, num_experts: int, groups: int, where: str = "trace") -> None:
    """ValueError unless every token's K columns hold K/H experts of each group, group by group (the FoE trace
    contract, docs/TRACE_FORMAT.md). expert_ids: int [T, L, K]."""
    K = expert_ids.shape[-1]
    if K % groups or num_experts % groups:
        raise ValueError(f"{where}: H={groups} FoE groups do not divide K={K} and E={num_experts}")
    want = np.arange(K) // (K // groups)
    if expert_ids.size and not (np.asarray(expert_ids) // (num_experts // groups) == want).all():
        raise ValueError(f"{where}: routing is not FoE-structured: each token's columns must hold K/H = "
                         f"{K // groups} experts of each of the {groups} groups, in group order")


def foe_batches(sub: Trace, rows: list[np.ndarray], plan: Plan) -> list[MicroBatch]:
    """Micro-batches of an FoE window (:func:`moeplace.run.replay.select_window`): ``home`` is each token's ring
    index (the plan's home of its request modulo the block size; 0 when W <= H) and ``slots`` its experts (an FoE
    plan keeps expert e on slot e)."""
    lay = layout_of(plan)
    tk = sub.tokens
    check_foe_routing(tk.expert_ids, plan.placement.num_experts, lay.groups, "FoE window")
    ring = lay.ring_index(token_homes(sub, plan))  # [T]
    out = []
    for r in rows:
        w = None if tk.expert_weights is None else tk.expert_weights[r].astype(np.float32)
        out.append(make_batch(plan, tk.request_id[r], ring[r], tk.expert_ids[r], w))
    return out


def ring_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None, pos: int, p: int) -> tuple[torch.Tensor, int]:
    """Sum ``x`` [T, H] over the p ranks of ``group`` (this rank at ring position ``pos`` = its group rank).

    Ring reduce-scatter then all-gather over :func:`moeplace.placement.foe.ring_steps`, with chunks of
    :func:`moeplace.placement.foe.ring_chunks` rows; every rank must pass the same T. Returns (sum [T, H], bytes this
    rank handed to ``all_to_all_single``, all of them to its successor)."""
    if p == 1:
        return x.clone(), 0
    T = x.shape[0]
    size = ring_chunks(T, p)
    start = np.concatenate([[0], np.cumsum(size)])
    buf = x.clone()
    row_bytes = x.element_size() * math.prod(x.shape[1:])
    succ, pred = (pos + 1) % p, (pos - 1) % p
    sent = 0
    for stage, chunk in ring_steps(p):
        c_send, c_recv = int(chunk[pos]), int(chunk[pred])
        send_splits = [0] * p
        recv_splits = [0] * p
        send_splits[succ] = int(size[c_send])
        recv_splits[pred] = int(size[c_recv])
        out = buf.new_empty((recv_splits[pred], *buf.shape[1:]))
        dist.all_to_all_single(out, buf[start[c_send]:start[c_send + 1]].contiguous(),
                               output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
        sent += send_splits[succ] * row_bytes
        if stage == "reduce":
            buf[start[c_recv]:start[c_recv + 1]] += out
        else:
            buf[start[c_recv]:start[c_recv + 1]] = out
    return buf, sent


def foe_replay_rank(ctx, batches: list[MicroBatch], waits: np.ndarray | None, num_experts: int, groups: int,
                    gpus_per_node: int, cfg: ReplayConfig) -> dict[str, Any]:
    """One rank's FoE replay (run by :func:`moeplace.run.launch.launch`): every micro-batch and layer, ``repeats``
    times. waits: float [M, L, W] emulated expert compute (None: real compute).

    Returns ``seconds`` / ``alltoall_seconds`` / ``allreduce_seconds`` float [R, M, L]; ``bytes``: {dispatch,
    combine, meta, allreduce}: int64 [M, L, W] sent by this rank per destination; ``outputs`` (if asked): per
    micro-batch (token indices [T_r], outputs [T_r, L, H])."""
    rank, W = ctx.rank, ctx.world_size
    lay = FoeLayout(groups, W, gpus_per_node)
    device = torch.device(ctx.device)
    dtype = DTYPES[cfg.dtype]
    # every rank creates every group, in the same order (torch.distributed requires it); group rank = list index
    block_pg = {tuple(b): dist.new_group(b) for b in lay.blocks()}
    ring_pg = {tuple(r): dist.new_group(r) for r in lay.rings()}
    block, ring = lay.block(rank), lay.ring(rank)
    S = num_experts // W
    K = batches[0].expert_ids.shape[2] if batches else groups
    kh = K // groups
    cols = np.concatenate([np.arange(g * kh, (g + 1) * kh) for g in lay.gpu_groups(rank)])
    rec = TrafficRecorder(len(block))
    disp = Dispatcher(block.index(rank), len(block), len(block), S, group=block_pg[tuple(block)], recorder=rec)
    full = expert_table(cfg, num_experts).to(device)
    L = batches[0].expert_ids.shape[1] if batches else 0
    moe = MoELayer(ExpertView(full, tuple(range(rank * S, (rank + 1) * S))))  # expert e on slot e in every layer
    my_ring = lay.ring_index(rank)
    inputs = []
    for b, mb in enumerate(batches):
        mine = np.flatnonzero(mb.home == my_ring)  # W <= H: every ring index is 0, every token is here
        slots = mb.slots[mine][:, :, cols] - block[0] * S  # [T_r, L, K_r] slot index inside the block
        inputs.append((mine, token_hidden(cfg, b, len(mb))[mine].to(dtype).to(device),
                       torch.as_tensor(slots, device=device), torch.as_tensor(mb.weights[mine][:, :, cols],
                                                                              device=device)))
    M, R = len(batches), cfg.repeats
    seconds = {k: np.zeros((R, M, L)) for k in ("layer", "alltoall", "allreduce")}
    sent = {k: np.zeros((M, L, W), np.int64) for k in ("dispatch", "combine", "meta", "allreduce")}
    outs: list[list[np.ndarray | None]] = [[None] * L for _ in range(M)]
    pos, p, rpg = ring.index(rank), len(ring), ring_pg[tuple(ring)]

    def layer_pass(b: int, layer: int, wait: float | None) -> tuple[torch.Tensor, float, int]:
        _, x, slots, w = inputs[b]
        t0 = time.perf_counter()
        m = moe.forward(x, slots[:, layer], w[:, layer], disp, wait)
        t1 = time.perf_counter()
        y, ar_bytes = ring_all_reduce(m, rpg, pos, p)
        return y, t1 - t0, ar_bytes

    emulated = waits is not None
    if emulated and cfg.return_outputs:  # an untimed pass with real compute gives the outputs to check
        for b in range(M):
            for layer in range(L):
                y, _, _ = layer_pass(b, layer, None)
                outs[b][layer] = y.float().cpu().numpy()
                rec.take()
    for rep in range(R):
        for b in range(M):
            for layer in range(L):
                wait = float(waits[b, layer, rank]) if emulated else None
                dist.barrier()  # every rank starts the layer together
                t0 = time.perf_counter()
                y, t_a2a, ar_bytes = layer_pass(b, layer, wait)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t = time.perf_counter() - t0
                seconds["layer"][rep, b, layer] = t
                seconds["alltoall"][rep, b, layer] = t_a2a
                seconds["allreduce"][rep, b, layer] = t - t_a2a
                got = rec.take()
                if rep == 0:
                    for k in ("dispatch", "combine", "meta"):
                        sent[k][b, layer, block] = got[k]
                    sent["allreduce"][b, layer, ring[(pos + 1) % p]] += ar_bytes
                    if cfg.return_outputs and not emulated:
                        outs[b][layer] = y.float().cpu().numpy()
    outputs = None
    if cfg.return_outputs:
        outputs = [(inp[0], np.stack(o, axis=1) if L else np.zeros((len(inp[0]), 0, cfg.hidden), np.float32))
                   for inp, o in zip(inputs, outs, strict=True)]
    return {"seconds": seconds, "bytes": sent, "outputs": outputs}


@dataclass
class FoeReplayResult:
    """What an FoE replay measured. Byte matrices are [source rank, destination rank]."""

    dispatch_bytes: np.ndarray  # int64 [M, L, W, W] all-to-all hidden-vector bytes (dispatch)
    combine_bytes: np.ndarray  # int64 [M, L, W, W] all-to-all hidden-vector bytes (combine)
    meta_bytes: np.ndarray  # int64 [M, L, W, W] routing metadata beside the rows
    allreduce_bytes: np.ndarray  # int64 [M, L, W, W] cross-group all-reduce bytes
    layer_seconds: np.ndarray  # float [R, M, L] slowest rank's wall time of each layer (all-to-all + all-reduce)
    alltoall_seconds: np.ndarray  # float [R, M, L] slowest rank's dispatch + experts + combine
    allreduce_seconds: np.ndarray  # float [R, M, L] slowest rank's all-reduce
    layout: FoeLayout
    outputs: list | None = None  # per rank, as foe_replay_rank returns them
    compute_seconds: np.ndarray | None = None  # float [M, L, W] emulated compute (None: real)


def foe_replay(plan: Plan, batches: list[MicroBatch], cfg: ReplayConfig, *, waits: np.ndarray | None = None,
               netns: list[str | None] | None = None, master_addr: str = "127.0.0.1",
               socket_ifname: str | None = None, fail_rank: int | None = None,
               env: dict[str, str] | None = None) -> FoeReplayResult:
    """Run the FoE micro-batches in W processes (where ``netns`` etc. say, as :func:`moeplace.run.replay.replay`)."""
    from moeplace.run.launch import launch

    lay = layout_of(plan)
    W = lay.world_size
    res = launch("moeplace.run.foe_replay:foe_replay_rank", W,
                 dict(batches=batches, waits=waits, num_experts=int(plan.placement.num_experts), groups=lay.groups,
                      gpus_per_node=lay.gpus_per_node, cfg=cfg),
                 netns=netns, master_addr=master_addr, socket_ifname=socket_ifname, timeout=cfg.timeout,
                 fail_rank=fail_rank, env=env)
    by = {k: np.stack([r["bytes"][k] for r in res], axis=2) for k in ("dispatch", "combine", "meta", "allreduce")}
    secs = {k: np.max(np.stack([r["seconds"][k] for r in res]), axis=0) for k in ("layer", "alltoall", "allreduce")}
    return FoeReplayResult(by["dispatch"], by["combine"], by["meta"], by["allreduce"], secs["layer"],
                           secs["alltoall"], secs["allreduce"], lay,
                           [r["outputs"] for r in res] if cfg.return_outputs else None, waits)


def summarize_foe(result: FoeReplayResult) -> dict[str, Any]:
    """JSON-ready measurements: the all-to-all's ``inter_node_bytes`` / ``intra_node_bytes`` (dispatch + combine
    payload), the all-reduce's ``allreduce_inter_node_bytes`` / ``allreduce_intra_node_bytes``, and times."""
    G = result.layout.gpus_per_node
    a2a = link_counts(result.dispatch_bytes + result.combine_bytes, G)  # [M, L, 6]
    ar = link_counts(result.allreduce_bytes, G)
    meta = link_counts(result.meta_bytes, G)
    lay = result.layout
    return {
        "foe": {"groups": lay.groups, "block_size": lay.block_size, "ring_size": lay.ring_size,
                "groups_per_gpu": lay.groups_per_gpu},
        "inter_node_bytes": stat_of(a2a[..., 2]),
        "intra_node_bytes": stat_of(a2a[..., 1]),
        "intra_gpu_bytes": stat_of(a2a[..., 0]),
        "meta_inter_node_bytes": stat_of(meta[..., 2]),
        "meta_intra_node_bytes": stat_of(meta[..., 1]),
        "allreduce_inter_node_bytes": stat_of(ar[..., 2]),
        "allreduce_intra_node_bytes": stat_of(ar[..., 1]),
        "layer_time_s": time_stat(result.layer_seconds),
        "alltoall_time_s": time_stat(result.alltoall_seconds),
        "allreduce_time_s": time_stat(result.allreduce_seconds),
        "traffic_matrix_bytes": (result.dispatch_bytes + result.combine_bytes).sum((0, 1)).tolist(),
        "allreduce_matrix_bytes": result.allreduce_bytes.sum((0, 1)).tolist(),
        "num_microbatches": int(result.dispatch_bytes.shape[0]),
        "emulated_compute_s": None if result.compute_seconds is None else stat_of(result.compute_seconds.max(-1)),
    }
