"""The simulator: what a placement and a grouping cost, replayed token by token on a routing trace.

Shape legend: T = tokens, L = MoE layers, K = top-k, E = logical experts, P = physical slots, W = GPUs,
S = slots per GPU, M = max replicas of one expert (candidates), B = micro-batches, N_n = nodes, G = GPUs per node.

Pipeline of one micro-batch and layer (docs/SIMULATOR.md has the full definitions):

1. every token starts at its request's home GPU ``h``;
2. each of its K experts is served by one replica, chosen by :func:`assign_slots` (the runtime uses the same
   function, so simulator and runtime route identically);
3. the token's hidden vector is sent once per destination GPU (per-GPU dedup) or once per remote node and then
   forwarded over NVLink (per-node, two-hop dedup); combine returns the same count;
4. costs follow docs/MODEL.md: bytes per link class, per (source, destination) pair, load per GPU, alpha-beta time.

Two implementations compute the same integers: :func:`simulate_reference` (plain per-token Python loops) and
:func:`simulate` (vectorised numpy, streaming, memory-bounded). ``tests/test_simulate.py`` checks they agree exactly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from moeplace.placement import Cluster, Placement, Plan
from moeplace.trace.store import (
    DECODE,
    PREFILL,
    Requests,
    TokenChunk,
    Trace,
    TraceMeta,
    iter_token_chunks,
    read_meta,
    read_requests,
    shard_files,
)

RULES = ("nearest-least-loaded", "nearest-static")
DEFAULT_RULE = "nearest-least-loaded"
DEDUP_MODES = ("per_gpu", "two_hop")
PHASE_NAMES = ("prefill", "decode")
_DECODE_WINDOW_SHIFT = 32  # decode micro-batch id = window << 32 | step
_MAX_BINS = 1 << 23  # bound on bincount output per sub-chunk (micro-batches x L x W x W)


# --------------------------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class CostConfig:
    """What one send and one token-expert pair cost."""

    hidden_size: int | None = None  # elements per token vector; None -> the trace's metadata
    dispatch_bytes: float = 1.0  # bytes per element sent by dispatch (1 = fp8)
    combine_bytes: float = 2.0  # bytes per element returned by combine (2 = bf16)
    pair_flops: float | None = None  # FLOPs of one token-expert pair; None -> 6 * hidden * intermediate
    intermediate_size: int | None = None  # expert FFN width for default pair_flops; None -> model preset or hidden

    def __post_init__(self) -> None:
        hs = self.hidden_size
        if hs is not None and (not isinstance(hs, (int, np.integer)) or hs < 1):
            raise ValueError(f"cost: hidden_size must be a positive integer, got {self.hidden_size!r}")
        for name in ("dispatch_bytes", "combine_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cost: {name} must be > 0, got {getattr(self, name)!r}")
        if self.pair_flops is not None and not self.pair_flops >= 0:
            raise ValueError(f"cost: pair_flops must be >= 0, got {self.pair_flops!r}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ValueError(f"cost: intermediate_size must be >= 1, got {self.intermediate_size!r}")


@dataclass(frozen=True)
class BatchConfig:
    """How trace tokens form micro-batches (one forward pass each). See docs/SIMULATOR.md."""

    decode_batch: int = 256  # requests per decode window: decode micro-batch = the i-th decode token of each
    prefill_tokens: int = 8192  # prefill token budget: prompts laid end to end in request order, cut every budget

    def __post_init__(self) -> None:
        for name in ("decode_batch", "prefill_tokens"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"batching: {name} must be a positive integer, got {v!r}")


# --------------------------------------------------------------------------------------------------- replica choice


@dataclass(frozen=True)
class RouteTables:
    """Replica candidates of every (layer, expert, home GPU), precomputed from a placement.

    The *nearest tier* of expert e for home GPU h: its replicas on h if any, else those on h's node, else all.
    """

    num_experts: int  # E
    num_gpus: int  # W
    slot_gpu: np.ndarray  # int64 [P]: GPU of each slot
    cand_slot: np.ndarray  # int64 [L, E, M]: slots holding each expert, ascending, padded with -1
    cand_gpu: np.ndarray  # int64 [L, E, M]: their GPUs (0 where padded)
    cand_ok: np.ndarray  # bool [L*E*W, M]: candidate is in the nearest tier of (layer, expert, home)
    static_slot: np.ndarray  # int64 [L*E*W]: the nearest-static choice (flat index (l*E + e)*W + h)
    static_gpu: np.ndarray  # int16 [L*E*W]: GPU of static_slot
    ambiguous: np.ndarray  # bool [L*E*W]: nearest tier holds >= 2 candidates (least-loaded must choose)


def build_route_tables(phy2log: np.ndarray, slot_gpu: np.ndarray, node_of_gpu: np.ndarray,
                       num_experts: int | None = None) -> RouteTables:
    """Candidate tables for :func:`assign_slots` and the simulator.

    phy2log: int [L, P] (or [P] for one layer); slot_gpu: int [P]; node_of_gpu: int [W].
    """
    p2l = np.atleast_2d(np.asarray(phy2log, np.int64))
    sg = np.asarray(slot_gpu, np.int64)
    nog = np.asarray(node_of_gpu, np.int64)
    L, P = p2l.shape
    W = len(nog)
    if sg.shape != (P,):
        raise ValueError(f"slot_gpu: expected shape [{P}] like phy2log's slots, got {sg.shape}")
    if P and (sg.min() < 0 or sg.max() >= W):
        raise ValueError(f"slot_gpu: GPU id out of range [0, {W})")
    E = int(p2l.max()) + 1 if num_experts is None else int(num_experts)
    if p2l.size and (p2l.min() < 0 or p2l.max() >= E):
        raise ValueError(f"phy2log: expert id out of range [0, {E})")
    cnt = np.stack([np.bincount(row, minlength=E) for row in p2l]) if L else np.zeros((0, E), np.int64)
    if (cnt == 0).any():
        layer, e = np.argwhere(cnt == 0)[0]
        raise ValueError(f"phy2log: expert {e} has no slot in layer {layer}")
    M = int(cnt.max()) if cnt.size else 1
    order = np.argsort(p2l, axis=1, kind="stable")  # slots grouped by expert, ascending within
    srt = np.take_along_axis(p2l, order, 1)
    start = np.cumsum(cnt, 1) - cnt
    rank = np.arange(P)[None, :] - np.take_along_axis(start, srt, 1)
    cand = np.full((L, E, M), -1, np.int64)
    cand[np.arange(L)[:, None], srt, rank] = order
    valid = cand >= 0
    cgpu = np.where(valid, sg[np.maximum(cand, 0)], 0)
    homes = np.arange(W)
    same_gpu = cgpu[:, :, None, :] == homes[None, None, :, None]  # [L, E, W, M]
    same_node = nog[cgpu][:, :, None, :] == nog[homes][None, None, :, None]
    tier = np.where(same_gpu, 0, np.where(same_node, 1, 2))
    tier = np.where(valid[:, :, None, :], tier, 3)
    ok = tier == tier.min(-1, keepdims=True)
    nbest = ok.sum(-1)  # [L, E, W]
    pick = homes[None, None, :] % nbest
    sel = ok & (np.cumsum(ok, -1) - 1 == pick[..., None])
    j = sel.argmax(-1)  # [L, E, W]
    static = np.take_along_axis(np.broadcast_to(cand[:, :, None, :], ok.shape), j[..., None], -1)[..., 0]
    return RouteTables(
        num_experts=E,
        num_gpus=W,
        slot_gpu=sg,
        cand_slot=cand,
        cand_gpu=cgpu,
        cand_ok=ok.reshape(L * E * W, M),
        static_slot=static.reshape(-1),
        static_gpu=sg[static].reshape(-1).astype(np.int16),
        ambiguous=(nbest >= 2).reshape(-1),
    )


def _resolve_least_loaded(tab: RouteTables, idx: np.ndarray, amb: np.ndarray, gpu: np.ndarray, grp: np.ndarray,
                          n_grp: int, base_load: np.ndarray | None) -> np.ndarray:
    """Choose replicas for the ambiguous pairs under nearest-least-loaded; writes their GPUs into ``gpu``.

    idx: int [K, N] flat table index (l*E + e)*W + h of every pair of N token-layer rows; amb: bool [K, N];
    gpu: int [K, N] (unambiguous entries already final); grp: int [N] group (micro-batch, layer) of each row,
    rows of one group in token order; base_load: int [n_grp, W] pairs already on each GPU, or None.
    Pairs are processed in (row, k) order within their group. Returns int64 [A] chosen slots of the ambiguous
    pairs in ``np.nonzero(amb)`` order.
    """
    K, N = amb.shape
    W = tab.num_gpus
    kk, rr = np.nonzero(amb)
    A = len(kk)
    if A == 0:
        return np.zeros(0, np.int64)
    q = rr.astype(np.int64) * K + kk  # order of the pair inside its group
    g = grp[rr].astype(np.int64)
    order = np.lexsort((q, g))
    ks, rs, qs, gs = kk[order], rr[order], q[order], g[order]
    ug, gd = np.unique(gs, return_inverse=True)  # dense ids of the groups that must choose
    dense = np.full(n_grp, -1, np.int64)
    dense[ug] = np.arange(len(ug))
    # Unambiguous pairs of those groups, keyed (group, gpu, order): prefix counts by binary search.
    NQ = np.int64(N) * K + 1
    in_touched = dense[grp] >= 0
    uk, ur = np.nonzero(~amb & in_touched[None, :])
    ukey = (dense[grp[ur]] * W + gpu[uk, ur].astype(np.int64)) * NQ + ur.astype(np.int64) * K + uk
    ukey.sort()
    fi = idx[ks, rs]
    cand = tab.cand_slot.reshape(-1, tab.cand_slot.shape[-1])[fi // W]  # [A, M]
    cg = tab.cand_gpu.reshape(-1, tab.cand_gpu.shape[-1])[fi // W]
    ok = tab.cand_ok[fi]
    lo = (gd[:, None] * W + cg) * NQ
    fixed = np.searchsorted(ukey, lo + qs[:, None]) - np.searchsorted(ukey, lo)
    if base_load is not None:
        fixed = fixed + base_load[gs[:, None], cg]
    big = np.iinfo(np.int64).max
    fixed = np.where(ok, fixed, big)
    starts = np.flatnonzero(np.r_[True, gd[1:] != gd[:-1]])
    sizes = np.diff(np.r_[starts, A])
    amb_load = np.zeros((len(ug), W), np.int64)
    chosen = np.empty(A, np.int64)
    for j in range(int(sizes.max())):
        sel = starts[sizes > j] + j
        dg = gd[sel]
        cgs = cg[sel]
        load = fixed[sel] + np.where(ok[sel], amb_load[dg[:, None], cgs], 0)
        c = load.argmin(1)  # ties -> first candidate = lowest slot
        rows = np.arange(len(sel))
        chosen[sel] = cand[sel, c]
        amb_load[dg, cgs[rows, c]] += 1
    gpu[ks, rs] = tab.slot_gpu[chosen]
    out = np.empty(A, np.int64)
    out[order] = chosen
    return out


def assign_slots(phy2log_l: np.ndarray, slot_gpu: np.ndarray, node_of_gpu: np.ndarray, home: np.ndarray,
                 experts: np.ndarray, rule: str = DEFAULT_RULE, base_load: np.ndarray | None = None) -> np.ndarray:
    """Choose the physical slot that serves each token-expert pair of one micro-batch in one layer.

    phy2log_l: int [P] logical expert of each slot; slot_gpu: int [P] GPU of each slot; node_of_gpu: int [W];
    home: int [T] home GPU of each token; experts: int [T, K] router choices; base_load: optional int [W] pairs
    already assigned to each GPU in this micro-batch and layer (a micro-batch routed in several calls).
    Returns int64 [T, K] slots.

    Rules (both start from the *nearest tier*: the expert's replicas on the token's own GPU if any, else on its
    node, else all of them):

    - ``nearest-least-loaded`` (default): pairs are taken in token order, then k order; each picks, within its
      nearest tier, the replica whose GPU has the fewest pairs already assigned in this micro-batch and layer
      (all pairs count, including single-replica ones); ties go to the lowest slot.
    - ``nearest-static`` (vectorisable, like SGLang's static dispatch): within the nearest tier, candidate number
      ``home % tier_size`` in slot order; depends only on (layer, expert, home).
    """
    if rule not in RULES:
        raise ValueError(f"replica rule {rule!r}: expected one of {RULES}")
    p2l = np.asarray(phy2log_l, np.int64)
    if p2l.ndim != 1:
        raise ValueError(f"phy2log_l: expected shape [P], got {p2l.shape}")
    ex = np.asarray(experts)
    if ex.ndim != 2:
        raise ValueError(f"experts: expected shape [T, K], got {ex.shape}")
    h = np.asarray(home, np.int64)
    if h.shape != (ex.shape[0],):
        raise ValueError(f"home: expected shape [{ex.shape[0]}], got {h.shape}")
    tab = build_route_tables(p2l[None, :], slot_gpu, node_of_gpu)
    W, E = tab.num_gpus, tab.num_experts
    if h.size and (h.min() < 0 or h.max() >= W):
        raise ValueError(f"home: GPU id out of range [0, {W})")
    if ex.size and (ex.min() < 0 or ex.max() >= E):
        raise ValueError(f"experts: expert id out of range [0, {E})")
    idx = (ex.T.astype(np.int64)) * W + h[None, :]  # [K, T], layer 0
    slots = tab.static_slot[idx]
    if rule == "nearest-least-loaded":
        amb = tab.ambiguous[idx]
        if amb.any():
            gpu = tab.static_gpu[idx].astype(np.int64)
            bl = None if base_load is None else np.asarray(base_load, np.int64).reshape(1, W)
            slots[amb] = _resolve_least_loaded(tab, idx, amb, gpu, np.zeros(ex.shape[0], np.int64), 1, bl)
    return slots.T.copy()


# --------------------------------------------------------------------------------------------------- micro-batches


@dataclass
class _Layout:
    """Request-level facts fixed before the token pass, so micro-batch ids are exact under any chunking."""

    req_sorted: np.ndarray  # int64 [R]: request ids, sorted
    req_index: np.ndarray  # int64 [R]: table index of req_sorted[i]
    home: np.ndarray  # int64 [R]: home GPU (table order)
    prompt: np.ndarray  # int64 [R]: prompt length (table order; see docs/SIMULATOR.md)
    prefill_start: np.ndarray  # int64 [R]: exclusive cumsum of prompt (prompts laid end to end)
    decode_batch: int
    prefill_tokens: int
    mb_ids: dict = field(default_factory=dict)  # phase -> int64 [B] sorted micro-batch ids
    mb_tokens: dict = field(default_factory=dict)  # phase -> int64 [B] tokens of each


def _rows_of(lay: _Layout, rid: np.ndarray) -> np.ndarray:
    """Table index of each token's request; unknown ids raise ValueError."""
    rid = np.asarray(rid, np.int64)
    i = np.searchsorted(lay.req_sorted, rid)
    i = np.minimum(i, max(len(lay.req_sorted) - 1, 0))
    bad = (lay.req_sorted[i] != rid) if len(lay.req_sorted) else np.ones(len(rid), bool)
    if bad.any():
        raise ValueError(f"token rows name request_id {int(rid[bad][0])} that is not in the request table")
    return lay.req_index[i]


def microbatch_ids(lay: _Layout, r: np.ndarray, position: np.ndarray, phase: np.ndarray) -> np.ndarray:
    """int64 [T] micro-batch id of each token (ids of the two phases are separate spaces).

    Prefill: prompts laid end to end in request-table order, token (r, pos) at offset prefill_start[r] + pos,
    micro-batch = offset // prefill_tokens. Decode: window w = r // decode_batch, step i = pos - prompt[r],
    micro-batch = w << 32 | i (the i-th decode token of every request of the window).
    """
    pos = np.asarray(position, np.int64)
    out = np.empty(len(r), np.int64)
    pre = np.asarray(phase) == PREFILL
    if pre.any():
        rp, pp = r[pre], pos[pre]
        badp = (pp < 0) | (pp >= lay.prompt[rp])
        if badp.any():
            j = np.flatnonzero(badp)[0]
            raise ValueError(f"prefill token at position {int(pp[j])} lies outside its request's prompt "
                             f"(prompt length {int(lay.prompt[rp[j]])}, request index {int(rp[j])})")
        out[pre] = (lay.prefill_start[rp] + pp) // lay.prefill_tokens
    dec = ~pre
    if dec.any():
        rd = r[dec]
        step = pos[dec] - lay.prompt[rd]
        if (step < 0).any():
            j = np.flatnonzero(step < 0)[0]
            raise ValueError(f"decode token at position {int(pos[dec][j])} lies inside its request's prompt "
                             f"(prompt length {int(lay.prompt[rd[j]])})")
        if (step >= 1 << _DECODE_WINDOW_SHIFT).any():
            raise ValueError("decode step beyond 2**32")
        out[dec] = ((rd // lay.decode_batch) << _DECODE_WINDOW_SHIFT) | step
    return out


def _light_columns(source) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(request_id, position, phase) of every token, without the routing columns."""
    if isinstance(source, Trace):
        tk = source.tokens
        yield np.asarray(tk.request_id, np.int64), np.asarray(tk.position), np.asarray(tk.phase)
        return
    meta = read_meta(source)
    for f in shard_files(source, meta):
        pf = pq.ParquetFile(f)
        for b in pf.iter_batches(batch_size=1 << 20, columns=["request_id", "position", "phase"]):
            yield (b.column("request_id").to_numpy().astype(np.int64), b.column("position").to_numpy(),
                   b.column("phase").to_numpy())


def _build_layout(source, requests: Requests, home: np.ndarray, batching: BatchConfig) -> _Layout:
    R = len(requests)
    order = np.argsort(requests.request_id, kind="stable")
    prompt = np.asarray(requests.prompt_len, np.int64).copy()
    lay = _Layout(requests.request_id[order].astype(np.int64), order.astype(np.int64), np.asarray(home, np.int64),
                  prompt, np.zeros(R, np.int64), batching.decode_batch, batching.prefill_tokens)
    if (prompt <= 0).any():  # unknown prompt length: 1 + the largest prefill position seen
        seen = np.zeros(R, np.int64)
        for rid, pos, ph in _light_columns(source):
            pre = ph == PREFILL
            np.maximum.at(seen, _rows_of(lay, rid[pre]), pos[pre].astype(np.int64) + 1)
        lay.prompt = np.where(prompt > 0, prompt, seen)
    lay.prefill_start = np.cumsum(lay.prompt) - lay.prompt
    ids: dict[int, list] = {PREFILL: [], DECODE: []}
    for rid, pos, ph in _light_columns(source):
        mb = microbatch_ids(lay, _rows_of(lay, rid), pos, ph)
        for p in (PREFILL, DECODE):
            u, c = np.unique(mb[ph == p], return_counts=True)
            ids[p].append((u, c))
    for p in (PREFILL, DECODE):
        if ids[p]:
            u = np.concatenate([a for a, _ in ids[p]])
            c = np.concatenate([b for _, b in ids[p]])
            uu, inv = np.unique(u, return_inverse=True)
            lay.mb_ids[p], lay.mb_tokens[p] = uu, np.bincount(inv, weights=c, minlength=len(uu)).astype(np.int64)
        else:
            lay.mb_ids[p], lay.mb_tokens[p] = np.zeros(0, np.int64), np.zeros(0, np.int64)
    return lay


# --------------------------------------------------------------------------------------------------- context


@dataclass
class _Ctx:
    meta: TraceMeta
    placement: Placement
    cluster: Cluster
    tab: RouteTables
    rule: str
    hidden: int
    dispatch_send_bytes: float  # bytes of one dispatch send (hidden * dispatch_bytes)
    combine_send_bytes: float
    pair_seconds: float  # compute seconds of one token-expert pair on one GPU
    cost: CostConfig
    batching: BatchConfig
    plan: Plan

    @property
    def W(self) -> int:
        return self.cluster.world_size

    @property
    def G(self) -> int:
        return self.cluster.gpus_per_node

    @property
    def num_nodes(self) -> int:
        return self.cluster.num_nodes


def _default_intermediate(model: str) -> int | None:
    try:
        from moeplace.presets import find_model
    except ImportError:  # pragma: no cover
        return None
    p = find_model(model)
    return None if p is None else p.moe_intermediate_size


def _make_ctx(meta: TraceMeta, plan: Plan | None, cluster: Cluster | None, cost: CostConfig | None,
              batching: BatchConfig | None, rule: str, num_redundant: int) -> _Ctx:
    if rule not in RULES:
        raise ValueError(f"replica rule {rule!r}: expected one of {RULES}")
    if meta.kind != "tokens":
        raise ValueError("simulate needs a per-token trace, but this trace is counts-only (kind='counts')")
    cost = cost or CostConfig()
    batching = batching or BatchConfig()
    if plan is None:
        if cluster is None:
            raise ValueError("simulate: give a plan or a cluster (for the default linear placement)")
        placement = Placement.linear(meta.num_layers, meta.num_experts, cluster.world_size, num_redundant)
        plan = Plan(placement, cluster, strategy="linear" if not num_redundant else f"linear+{num_redundant}")
    elif cluster is not None and cluster.spec() != plan.cluster.spec():
        raise ValueError(f"simulate: cluster {cluster.spec()} differs from the plan's cluster {plan.cluster.spec()}")
    elif cluster is None:
        cluster = plan.cluster
    pl = plan.placement
    if pl.num_layers != meta.num_layers or pl.num_experts != meta.num_experts:
        raise ValueError(f"plan does not fit the trace: plan has L={pl.num_layers} layers and E={pl.num_experts} "
                         f"experts, the trace has L={meta.num_layers} and E={meta.num_experts}")
    if pl.num_gpus != cluster.world_size:
        raise ValueError(f"plan is for {pl.num_gpus} GPUs but cluster {cluster.spec()} has {cluster.world_size}")
    hidden = cost.hidden_size or meta.hidden_size
    if not hidden:
        raise ValueError("hidden size unknown: the trace metadata has no hidden_size; give CostConfig.hidden_size "
                         "(CLI: --hidden-size)")
    inter = cost.intermediate_size or _default_intermediate(meta.model) or hidden
    pair_flops = cost.pair_flops if cost.pair_flops is not None else 6.0 * hidden * inter
    W = cluster.world_size
    tab = build_route_tables(pl.phy2log, pl.slot_gpu, np.arange(W) // cluster.gpus_per_node, meta.num_experts)
    return _Ctx(meta, pl, cluster, tab, rule, int(hidden), hidden * cost.dispatch_bytes, hidden * cost.combine_bytes,
                pair_flops / cluster.expert_flops, cost, batching, plan)


# --------------------------------------------------------------------------------------------------- metrics


def two_hop_matrix(per_gpu: np.ndarray, node_sends: np.ndarray, gpus_per_node: int) -> np.ndarray:
    """Per-node (two-hop) send matrix from the per-GPU dedup matrix and the per-node inter-node sends.

    per_gpu: int [..., W, W] per-GPU dedup sends home -> target; node_sends: int [..., W, N_n] sends of each home to
    each remote node (one per token and remote node). A remote send lands on the GPU of the same local rank on
    that node, which forwards over NVLink to every other target there. Returns int64 [..., W, W].
    """
    X = np.asarray(per_gpu, np.int64)
    lead = X.shape[:-2]
    W = X.shape[-1]
    G = gpus_per_node
    Nn = W // G
    Xr = X.reshape(*lead, Nn, G, Nn, G)  # [..., a, i, b, j]
    TH = np.zeros_like(Xr)
    into = Xr.sum(-4)  # [..., i, b, j]: sends from local rank i (any node) to GPU (b, j)
    Bn = np.asarray(node_sends, np.int64).reshape(*lead, Nn, G, Nn)  # [..., a, i, b]
    eye = np.eye(G, dtype=bool)
    for b in range(Nn):
        own = Xr[..., b, :, b, :]  # sends inside node b
        remote = into[..., :, b, :] - own  # [..., i, j] from other nodes' local rank i to (b, j)
        TH[..., b, :, b, :] = own + np.where(eye, 0, remote)  # forwarding lands on (b, i), goes to (b, j)
        landed = Bn[..., :, :, b]  # [..., a, i] inter-node sends of GPU (a, i) to node b, landing on (b, i)
        for a in range(Nn):
            if a != b:
                d = TH[..., a, :, b, :]
                d[..., np.arange(G), np.arange(G)] += landed[..., a, :]
    return TH.reshape(X.shape)


def _mb_metrics(ctx: _Ctx, M: np.ndarray, TH: np.ndarray, load: np.ndarray) -> dict[str, np.ndarray]:
    """Per-micro-batch, per-layer quantities. M, TH: int [B, L, W, W]; load: int [B, L, W]. Returns name -> [B, L].

    Three passes over each matrix: block row sums, block column sums, and the largest off-diagonal entry.
    """
    W, G, Nn = ctx.W, ctx.G, ctx.num_nodes
    cl = ctx.cluster
    own = np.arange(W) // G  # node of each GPU
    lr = np.arange(W) % G
    out: dict[str, np.ndarray] = {}
    for mode, X in (("per_gpu", M), ("two_hop", TH)):
        lead = X.shape[:-2]
        flat = X.reshape(*lead, W * W)
        diag = flat[..., :: W + 1].copy()  # [..., W] intra-GPU sends
        Xr = X.reshape(*lead, Nn, G, Nn, G)
        brow = Xr.sum(-1)  # [..., N_n(a), G(i), N_n(b)]: sends of GPU (a, i) to node b
        bcol = Xr.sum(-3)  # [..., N_n(a), N_n(b), G(j)]: sends from node a to GPU (b, j)
        same_out = brow[..., own, lr, own]  # [..., W] sends inside the own node, diagonal included
        same_in = bcol[..., own, own, lr]
        intra_out, intra_in = same_out - diag, same_in - diag
        inter_out = brow.sum(-1).reshape(*lead, W) - same_out
        inter_in = bcol.sum(-3).reshape(*lead, W) - same_in
        intra = intra_out.sum(-1)
        out[f"{mode}.intra_gpu_sends"] = diag.sum(-1)
        out[f"{mode}.intra_node_sends"] = intra
        out[f"{mode}.inter_node_sends"] = inter_out.sum(-1)
        flat[..., :: W + 1] = 0  # largest off-diagonal message, then restore the diagonal
        maxmsg = flat.max(-1) if W > 1 else np.zeros(lead, np.int64)
        flat[..., :: W + 1] = diag
        out[f"{mode}.max_message_sends"] = maxmsg
        t = {}
        for name, o, i, alpha, bw, peers in (
                ("intra", intra_out, intra_in, cl.intra_latency, cl.intra_bw, G - 1),
                ("inter", inter_out, inter_in, cl.inter_latency, cl.inter_bw, W - G)):
            busiest = np.maximum(o.max(-1), i.max(-1)) if W else np.zeros(lead, np.int64)
            padded = peers * maxmsg
            for key, sends in (("", busiest), ("_padded", padded)):
                for part, nbytes in (("d", ctx.dispatch_send_bytes), ("c", ctx.combine_send_bytes)):
                    t[name, key, part] = np.where(sends > 0, alpha + sends * nbytes / bw, 0.0)
        for key in ("", "_padded"):
            out[f"{mode}.comm_time{key}"] = (np.maximum(t["intra", key, "d"], t["inter", key, "d"])
                                             + np.maximum(t["intra", key, "c"], t["inter", key, "c"]))
    mx = load.max(-1)
    out["compute_time"] = mx * ctx.pair_seconds
    out["pairs"] = load.sum(-1)
    out["max_load"] = mx
    return out


# --------------------------------------------------------------------------------------------------- results


def _stat_additive(x: np.ndarray) -> dict:
    """x: [B, L] per micro-batch and layer."""
    if x.shape[0] == 0:
        return {"total": 0.0, "per_layer": [0.0] * x.shape[1], "median_microbatch": 0.0,
                "median_per_layer": [0.0] * x.shape[1]}
    return {"total": float(x.sum()), "per_layer": x.sum(0).astype(float).tolist(),
            "median_microbatch": float(np.median(x.sum(1))), "median_per_layer": np.median(x, 0).tolist()}


def _stat_max(x: np.ndarray) -> dict:
    if x.shape[0] == 0:
        return {"total": 0.0, "per_layer": [0.0] * x.shape[1], "median_microbatch": 0.0,
                "median_per_layer": [0.0] * x.shape[1]}
    return {"total": float(x.max()), "per_layer": x.max(0).astype(float).tolist(),
            "median_microbatch": float(np.median(x.max(1))), "median_per_layer": np.median(x, 0).tolist()}


def _ratio(a: np.ndarray, b: np.ndarray, empty: float) -> np.ndarray:
    a = np.asarray(a, float)
    b = np.asarray(b, float)
    return np.divide(a, b, out=np.full(np.broadcast(a, b).shape, empty), where=b > 0)


@dataclass
class PhaseResult:
    """What one phase (prefill, decode, or both) cost. Integers are exact counts; bytes derive from them."""

    phase: str  # "prefill", "decode" or "all"
    num_tokens: int
    dispatch_send_bytes: float  # bytes per dispatch send
    combine_send_bytes: float  # bytes per combine send
    microbatch_ids: np.ndarray  # int64 [B] (phase-specific id spaces; "all" lists prefill then decode)
    pairs: np.ndarray  # int64 [L] token-expert pairs
    load: np.ndarray  # int64 [L, W] pairs computed by each GPU
    local_pairs: np.ndarray  # int64 [L] pairs served on the token's home GPU
    node_local_pairs: np.ndarray  # int64 [L] pairs served on the home GPU's node
    sends: dict  # mode ("per_gpu", "two_hop") -> int64 [L, W, W] sends source -> destination (diagonal: intra-GPU)
    per_microbatch: dict  # name -> [B, L] (see _mb_metrics); sorted by microbatch_ids

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatch_ids)

    @property
    def send_bytes(self) -> float:
        """Bytes one send moves across its link, dispatch plus combine."""
        return self.dispatch_send_bytes + self.combine_send_bytes

    def bytes_per_microbatch(self, mode: str = "per_gpu", where: str = "inter_node") -> np.ndarray:
        """float [B, L] bytes of one link class ("intra_gpu", "intra_node", "inter_node") per micro-batch and layer."""
        if mode not in DEDUP_MODES:
            raise ValueError(f"dedup mode {mode!r}: expected one of {DEDUP_MODES}")
        return self.per_microbatch[f"{mode}.{where}_sends"] * self.send_bytes

    def byte_matrix(self, mode: str = "per_gpu") -> np.ndarray:
        """float [L, W, W] bytes from source GPU to destination GPU: dispatch sends plus returning combines."""
        X = self.sends[mode].astype(float)
        B = X * self.dispatch_send_bytes + np.swapaxes(X, -1, -2) * self.combine_send_bytes
        idx = np.arange(X.shape[-1])
        B[..., idx, idx] = 0.0
        return B

    @property
    def balancedness_per_layer(self) -> np.ndarray:
        """[L] mean_g / max_g of the phase's load (SGLang); 1 where a layer has no load."""
        return _ratio(self.load.mean(-1), self.load.max(-1), 1.0)

    @property
    def imbalance_ratio_per_layer(self) -> np.ndarray:
        """[L] (max_g - mean_g) / mean_g (TensorRT-LLM); 0 where a layer has no load."""
        mean = self.load.mean(-1)
        return _ratio(self.load.max(-1) - mean, mean, 0.0)

    def to_json(self) -> dict:
        pm = self.per_microbatch
        L = len(self.pairs)
        sb = self.send_bytes
        out: dict = {"num_tokens": int(self.num_tokens), "num_microbatches": self.num_microbatches,
                     "num_pairs": int(self.pairs.sum())}
        for mode in DEDUP_MODES:
            prefix = "" if mode == "per_gpu" else "two_hop_"
            for where in ("inter_node", "intra_node"):
                out[f"{prefix}{where}_bytes"] = _stat_additive(pm[f"{mode}.{where}_sends"] * sb)
            out[f"{prefix}sends"] = {w: _stat_additive(pm[f"{mode}.{w}_sends"])
                                     for w in ("intra_gpu", "intra_node", "inter_node")}
            out[f"{prefix}max_peer_message_bytes"] = _stat_max(pm[f"{mode}.max_message_sends"]
                                                               * self.dispatch_send_bytes)
            for key in ("", "_padded"):
                comm = pm[f"{mode}.comm_time{key}"]
                out[f"{prefix}comm_time{key}_s"] = _stat_additive(comm)
                out[f"{prefix}layer_time{key}_s"] = _stat_additive(comm + pm["compute_time"])
            out[f"{prefix}traffic_matrix_bytes"] = self.byte_matrix(mode).sum(0).tolist()
        out["compute_time_s"] = _stat_additive(pm["compute_time"])
        bal, imb = self.balancedness_per_layer, self.imbalance_ratio_per_layer
        load_mb = pm["pairs"] / self.load.shape[-1]
        bal_mb = _ratio(load_mb, pm["max_load"], 1.0).mean(1) if self.num_microbatches else np.zeros(0)
        imb_mb = _ratio(pm["max_load"] - load_mb, load_mb, 0.0).mean(1) if self.num_microbatches else np.zeros(0)
        out["balancedness"] = {"total": float(bal.mean()) if L else 1.0, "per_layer": bal.tolist(),
                               "median_microbatch": float(np.median(bal_mb)) if len(bal_mb) else 1.0}
        out["imbalance_ratio"] = {"total": float(imb.mean()) if L else 0.0, "per_layer": imb.tolist(),
                                  "median_microbatch": float(np.median(imb_mb)) if len(imb_mb) else 0.0}
        out["local_activation_rate"] = {"total": float(_ratio(self.local_pairs.sum(), self.pairs.sum(), 0.0)),
                                        "per_layer": _ratio(self.local_pairs, self.pairs, 0.0).tolist()}
        out["node_local_rate"] = {"total": float(_ratio(self.node_local_pairs.sum(), self.pairs.sum(), 0.0)),
                                  "per_layer": _ratio(self.node_local_pairs, self.pairs, 0.0).tolist()}
        out["load_per_gpu"] = self.load.sum(0).tolist()
        return out


def _merge_phases(a: PhaseResult, b: PhaseResult) -> PhaseResult:
    return PhaseResult(
        "all", a.num_tokens + b.num_tokens, a.dispatch_send_bytes, a.combine_send_bytes,
        np.concatenate([a.microbatch_ids, b.microbatch_ids]), a.pairs + b.pairs, a.load + b.load,
        a.local_pairs + b.local_pairs, a.node_local_pairs + b.node_local_pairs,
        {m: a.sends[m] + b.sends[m] for m in DEDUP_MODES},
        {k: np.concatenate([a.per_microbatch[k], b.per_microbatch[k]]) for k in a.per_microbatch},
    )


@dataclass
class SimResult:
    """The simulator's answer: prefill and decode apart, and both together (``all``)."""

    model: str
    synthetic: bool  # True when the trace is a generated workload
    trace_source: str
    cluster: Cluster
    rule: str
    plan_strategy: str
    cost: CostConfig
    batching: BatchConfig
    hidden_size: int
    pair_seconds: float
    prefill: PhaseResult
    decode: PhaseResult

    @property
    def all(self) -> PhaseResult:
        return _merge_phases(self.prefill, self.decode)

    def to_json(self) -> dict:
        allp = self.all.to_json()
        head = {"model": self.model, "synthetic": self.synthetic, "trace_source": self.trace_source,
                "cluster": self.cluster.to_json(), "num_gpus": self.cluster.world_size, "rule": self.rule,
                "plan_strategy": self.plan_strategy, "cost": asdict(self.cost), "batching": asdict(self.batching),
                "hidden_size": self.hidden_size, "pair_seconds": self.pair_seconds}
        return {**head, **allp, "prefill": self.prefill.to_json(), "decode": self.decode.to_json()}

    def save_json(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        os.replace(tmp, p)
        return p


# --------------------------------------------------------------------------------------------------- accumulation


class _PhaseAcc:
    """Accumulators of one phase: totals, open micro-batches (not yet complete) and finished per-mb metrics."""

    def __init__(self, ctx: _Ctx, lay: _Layout, phase: int) -> None:
        L, W = ctx.meta.num_layers, ctx.W
        self.ctx, self.phase = ctx, phase
        self.expect_ids, self.expect_n = lay.mb_ids[phase], lay.mb_tokens[phase]
        self.tokens = 0
        self.pairs = np.zeros(L, np.int64)
        self.local = np.zeros(L, np.int64)
        self.node_local = np.zeros(L, np.int64)
        self.load = np.zeros((L, W), np.int64)
        self.sends = {m: np.zeros((L, W, W), np.int64) for m in DEDUP_MODES}
        self.open: dict[int, list] = {}  # mb id -> [M [L,W,W], node sends [L,W,N_n], load [L,W], tokens seen]
        self.done_ids: list[np.ndarray] = []
        self.done: list[dict] = []

    def finish(self, mbs: list[int], M: np.ndarray, TH: np.ndarray, load: np.ndarray) -> None:
        """Record complete micro-batches: M, TH int [B, L, W, W], load [B, L, W]."""
        if not len(mbs):
            return
        self.sends["per_gpu"] += M.sum(0)
        self.sends["two_hop"] += TH.sum(0)
        self.done_ids.append(np.asarray(mbs, np.int64))
        self.done.append(_mb_metrics(self.ctx, M, TH, load))

    def finish_open(self, mbs: list[int]) -> None:
        G = self.ctx.G
        for s in range(0, len(mbs), 32):  # bounded temporaries
            part = mbs[s:s + 32]
            st = [self.open.pop(m) for m in part]
            M = np.stack([x[0] for x in st])
            TH = two_hop_matrix(M, np.stack([x[1] for x in st]), G)
            self.finish(part, M, TH, np.stack([x[2] for x in st]))

    def result(self, name: str) -> PhaseResult:
        if self.open:
            self.finish_open(sorted(self.open))
        L = self.ctx.meta.num_layers
        if self.done:
            ids = np.concatenate(self.done_ids)
            order = np.argsort(ids, kind="stable")
            pm = {k: np.concatenate([d[k] for d in self.done])[order] for k in self.done[0]}
            ids = ids[order]
        else:
            ids = np.zeros(0, np.int64)
            z = self.ctx
            empty = _mb_metrics(z, np.zeros((0, L, z.W, z.W), np.int64), np.zeros((0, L, z.W, z.W), np.int64),
                                np.zeros((0, L, z.W), np.int64))
            pm = empty
        return PhaseResult(name, self.tokens, self.ctx.dispatch_send_bytes, self.ctx.combine_send_bytes, ids,
                           self.pairs, self.load, self.local, self.node_local, self.sends, pm)


def _accumulate_fast(acc: _PhaseAcc, ids: np.ndarray, home: np.ndarray, mb: np.ndarray) -> None:
    """Add the tokens of one phase of one chunk. ids: int16 [T, L, K]; home, mb: int [T] (trace order)."""
    ctx = acc.ctx
    T, L, K = ids.shape
    if T == 0:
        return
    W, G, E, Nn = ctx.W, ctx.G, ctx.meta.num_experts, ctx.num_nodes
    order = np.argsort(mb, kind="stable")  # micro-batches contiguous, trace order kept inside each
    ids, home, mb = ids[order], home[order], mb[order]
    umb, mbl, cnt = np.unique(mb, return_inverse=True, return_counts=True)
    per_sub = max(1, _MAX_BINS // (L * W * W))
    bounds = np.r_[0, np.cumsum(cnt)]
    for s in range(0, len(umb), per_sub):
        m0, m1 = s, min(len(umb), s + per_sub)
        t0, t1 = bounds[m0], bounds[m1]
        _accumulate_sub(acc, ids[t0:t1], home[t0:t1], mbl[t0:t1] - m0, umb[m0:m1], L, K, W, G, E, Nn)
    acc.tokens += T
    seen = np.searchsorted(acc.expect_ids, umb)
    complete = []
    for m, n, i in zip(umb.tolist(), cnt.tolist(), seen.tolist(), strict=True):
        st = acc.open[m]
        st[3] += n
        if i < len(acc.expect_ids) and acc.expect_ids[i] == m and st[3] >= acc.expect_n[i]:
            complete.append(m)
    acc.finish_open(complete)


def _first_occurrence(x: np.ndarray) -> np.ndarray:
    """bool [K, N]: x[j, n] differs from x[0..j-1, n]."""
    first = np.ones(x.shape, bool)
    for j in range(1, x.shape[0]):
        dup = x[j] == x[0]
        for i in range(1, j):
            dup |= x[j] == x[i]
        first[j] = ~dup
    return first


def _accumulate_sub(acc: _PhaseAcc, ids, home, mbl, umb, L, K, W, G, E, Nn) -> None:
    ctx = acc.ctx
    T = len(home)
    nm = len(umb)
    N = L * T
    lidx = np.arange(L, dtype=np.int64)
    it = np.int64 if L * E * W >= 1 << 31 else np.int32
    base = (lidx[:, None] * (E * W) + home[None, :]).astype(it)  # [L, T]
    e = np.ascontiguousarray(ids.transpose(2, 1, 0), dtype=it)  # [K, L, T]
    idx = (e * it(W) + base[None]).reshape(K, N)
    del e
    gpu = ctx.tab.static_gpu.take(idx)  # int16 [K, N]
    if ctx.rule == "nearest-least-loaded":
        amb = ctx.tab.ambiguous.take(idx)
        if amb.any():
            grp = (mbl[None, :] * L + lidx[:, None]).reshape(N)
            base_load = np.zeros((nm, L, W), np.int64)
            for j, m in enumerate(umb.tolist()):
                if m in acc.open:
                    base_load[j] = acc.open[m][2]
            g64 = gpu.astype(np.int64)
            _resolve_least_loaded(ctx.tab, idx.astype(np.int64), amb, g64, grp, nm * L, base_load.reshape(nm * L, W))
            gpu = g64.astype(np.int16)
    del idx
    h_row = np.broadcast_to(home[None, :], (L, T)).reshape(N).astype(np.int16)
    node = gpu // np.int16(G)
    hn_row = h_row // np.int16(G)
    local = (gpu == h_row).reshape(K, L, T).sum((0, 2))
    nlocal = (node == hn_row).reshape(K, L, T).sum((0, 2))
    row = (mbl[None, :].astype(np.int64) * L + lidx[:, None]).reshape(N)  # group of each row
    load = np.bincount((row * W + gpu).ravel(), minlength=nm * L * W).reshape(nm, L, W)
    dummy = nm * L * W * W
    rowh = row * W + h_row
    keym = np.where(_first_occurrence(gpu), rowh * W + gpu, dummy)
    Mc = np.bincount(keym.ravel(), minlength=dummy + 1)[:dummy].reshape(nm, L, W, W)
    del keym
    dummyb = nm * L * W * Nn
    keyb = np.where(_first_occurrence(node) & (node != hn_row), rowh * Nn + node, dummyb)
    Bc = np.bincount(keyb.ravel(), minlength=dummyb + 1)[:dummyb].reshape(nm, L, W, Nn)
    acc.pairs += np.int64(K * T)
    acc.local += local
    acc.node_local += nlocal
    acc.load += load.sum(0)
    for j, m in enumerate(umb.tolist()):
        st = acc.open.get(m)
        if st is None:
            acc.open[m] = [Mc[j].astype(np.int64), Bc[j].astype(np.int64), load[j].astype(np.int64), 0]
        else:
            st[0] += Mc[j]
            st[1] += Bc[j]
            st[2] += load[j]


# --------------------------------------------------------------------------------------------------- entry points


def _open_source(trace) -> tuple[TraceMeta, Requests, object]:
    if isinstance(trace, Trace):
        if trace.tokens is None:
            raise ValueError("simulate needs a per-token trace, but this trace is counts-only")
        return trace.meta, trace.requests, trace
    p = Path(trace)
    return read_meta(p), read_requests(p), p


def _chunks(source, chunk_tokens: int) -> Iterator[TokenChunk]:
    if isinstance(source, Trace):
        tk = source.tokens
        for s in range(0, len(tk), chunk_tokens):
            yield tk.select(slice(s, s + chunk_tokens))
    else:
        yield from iter_token_chunks(source, chunk_tokens=chunk_tokens, columns_weights=False)


def _result(ctx: _Ctx, accs: dict[int, _PhaseAcc]) -> SimResult:
    m = ctx.meta
    return SimResult(m.model, bool(m.synthetic), m.source, ctx.cluster, ctx.rule, ctx.plan.strategy, ctx.cost,
                     ctx.batching, ctx.hidden, ctx.pair_seconds, accs[PREFILL].result("prefill"),
                     accs[DECODE].result("decode"))


def simulate(trace, plan: Plan | None = None, cluster: Cluster | None = None, cost: CostConfig | None = None,
             batching: BatchConfig | None = None, rule: str = DEFAULT_RULE, num_redundant: int = 0,
             chunk_tokens: int = 16384, progress: bool = False) -> SimResult:
    """Replay a per-token trace on a plan; vectorised and streaming (memory bounded by open micro-batches).

    trace: a trace directory or an in-memory :class:`Trace`. plan: placement + homes; None -> linear placement
    with ``num_redundant`` redundant slots on ``cluster`` and round-robin homes in request-table order.
    """
    meta, requests, source = _open_source(trace)
    ctx = _make_ctx(meta, plan, cluster, cost, batching, rule, num_redundant)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    lay = _build_layout(source, requests, ctx.plan.home_of(requests.request_id), ctx.batching)
    accs = {p: _PhaseAcc(ctx, lay, p) for p in (PREFILL, DECODE)}
    total = int(sum(lay.mb_tokens[p].sum() for p in (PREFILL, DECODE)))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="tok", desc="simulate")
    for ch in _chunks(source, chunk_tokens):
        r = _rows_of(lay, ch.request_id)
        mb = microbatch_ids(lay, r, ch.position, ch.phase)
        home = lay.home[r]
        for p in (PREFILL, DECODE):
            sel = ch.phase == p
            if sel.any():
                _accumulate_fast(accs[p], ch.expert_ids[sel], home[sel], mb[sel])
        if bar is not None:
            bar.update(len(ch))
    if bar is not None:
        bar.close()
    return _result(ctx, accs)


def simulate_reference(trace: Trace, plan: Plan | None = None, cluster: Cluster | None = None,
                       cost: CostConfig | None = None, batching: BatchConfig | None = None,
                       rule: str = DEFAULT_RULE, num_redundant: int = 0) -> SimResult:
    """Plain per-token Python loops over an in-memory trace; the definition :func:`simulate` must match exactly."""
    meta, requests, source = _open_source(trace)
    ctx = _make_ctx(meta, plan, cluster, cost, batching, rule, num_redundant)
    lay = _build_layout(source, requests, ctx.plan.home_of(requests.request_id), ctx.batching)
    L, W, G = meta.num_layers, ctx.W, ctx.G
    p2l = ctx.placement.phy2log
    S = ctx.placement.slots_per_gpu
    slots_of = [[[p for p in range(p2l.shape[1]) if p2l[layer, p] == e] for e in range(meta.num_experts)]
                for layer in range(L)]
    accs = {p: _PhaseAcc(ctx, lay, p) for p in (PREFILL, DECODE)}
    state: dict[tuple[int, int], list] = {}
    tk = trace.tokens
    rows = _rows_of(lay, tk.request_id)
    mbs = microbatch_ids(lay, rows, tk.position, tk.phase)
    for t in range(len(tk)):
        ph, mb, h = int(tk.phase[t]), int(mbs[t]), int(lay.home[rows[t]])
        acc = accs[ph]
        acc.tokens += 1
        st = state.setdefault((ph, mb), [np.zeros((L, W, W), np.int64), np.zeros((L, W, W), np.int64),
                                         np.zeros((L, W), np.int64)])
        M, TH, load = st
        for layer in range(L):
            targets = []
            for k in range(meta.top_k):
                cands = slots_of[layer][int(tk.expert_ids[t, layer, k])]
                tier = [0 if p // S == h else (1 if p // S // G == h // G else 2) for p in cands]
                best = [p for p, ti in zip(cands, tier, strict=True) if ti == min(tier)]
                if rule == "nearest-static":
                    p = best[h % len(best)]
                else:
                    p = min(best, key=lambda s: (load[layer, s // S], s))
                g = p // S
                load[layer, g] += 1
                acc.pairs[layer] += 1
                acc.local[layer] += g == h
                acc.node_local[layer] += g // G == h // G
                acc.load[layer, g] += 1
                targets.append(g)
            tset = sorted(set(targets))
            for d in tset:
                M[layer, h, d] += 1
            for n in sorted({d // G for d in tset}):
                on_n = [d for d in tset if d // G == n]
                if n == h // G:
                    for d in on_n:
                        TH[layer, h, d] += 1
                else:
                    land = n * G + h % G
                    TH[layer, h, land] += 1
                    for d in on_n:
                        if d != land:
                            TH[layer, land, d] += 1
    for ph in (PREFILL, DECODE):
        keys = sorted(mb for (p, mb) in state if p == ph)
        for mb in keys:
            M, TH, load = state[(ph, mb)]
            accs[ph].finish([mb], M[None], TH[None], load[None])
    return _result(ctx, accs)
