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
:func:`simulate` (streaming, memory-bounded: each micro-batch, once all its tokens were seen, goes through one
compiled numba kernel, ``_mb_kernel``, run on disjoint layer ranges in threads). ``tests/test_simulate.py`` checks
they agree exactly. :func:`assign_slots` and the kernel share the least-loaded choice (``_least_loaded``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from numba import njit

from moeplace.io import atomic_write_json
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
    ok = np.zeros((L, E, W, M), bool)
    static = np.zeros((L, E, W), np.int64)
    nbest = np.zeros((L, E, W), np.int64)
    _tier_kernel(cand, cgpu, nog, ok, static, nbest)
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


@njit(cache=True, nogil=True)
def _tier_kernel(cand, cgpu, nog, ok, static, nbest):
    """The nearest tier of every (layer, expert, home): ok [L, E, W, M] candidate is in it, nbest [L, E, W] its
    size, static [L, E, W] its candidate number ``home % size`` (slot order). cand, cgpu: [L, E, M], -1 padded."""
    L, E, M = cand.shape
    W = nog.shape[0]
    for layer in range(L):
        for e in range(E):
            for h in range(W):
                best = 3
                for m in range(M):
                    if cand[layer, e, m] >= 0:
                        g = cgpu[layer, e, m]
                        best = min(best, 0 if g == h else (1 if nog[g] == nog[h] else 2))
                n = 0
                for m in range(M):
                    if cand[layer, e, m] >= 0:
                        g = cgpu[layer, e, m]
                        if (0 if g == h else (1 if nog[g] == nog[h] else 2)) == best:
                            ok[layer, e, h, m] = True
                            n += 1
                nbest[layer, e, h] = n
                pick = h % n
                for m in range(M):
                    if ok[layer, e, h, m]:
                        if pick == 0:
                            static[layer, e, h] = cand[layer, e, m]
                            break
                        pick -= 1


# Compiled kernels (numba). _mb_kernel routes complete micro-batches layer by layer (replica choice, per-GPU and
# per-node dedup, load) and reduces each to its per-layer counts. ``cache=True`` keeps the compiled code in
# __pycache__ next to this file, so only the first run of a checkout pays the compile (about 7 s on 2 busy cores).


@njit(cache=True, nogil=True)
def _least_loaded(cand_gpu, cand_ok, layer, e, fi, load, base):
    """Candidate index m of the nearest-tier replica whose GPU has the fewest pairs; ties -> lowest slot.

    cand_gpu: [L, E, M]; cand_ok: bool [L*E*W, M]; fi = (layer*E + e)*W + home; load[base + g]: pairs so far on
    GPU g. Shared by :func:`assign_slots` and the simulator, so both choose identically.
    """
    best = -1
    low = 0
    for m in range(cand_gpu.shape[2]):
        if cand_ok[fi, m]:
            v = load[base + cand_gpu[layer, e, m]]
            if best < 0 or v < low:
                best = m
                low = v
    return best


@njit(cache=True, nogil=True)
def _assign_kernel(ex, home, route, static_slot, cand_slot, cand_gpu, cand_ok, slot_gpu, W, load):
    """Slots [T, K] of one micro-batch in layer 0; route[fi] < 0 marks a least-loaded choice; updates load [W]."""
    T, K = ex.shape
    out = np.empty((T, K), np.int64)
    for t in range(T):
        h = home[t]
        for k in range(K):
            e = ex[t, k]
            fi = e * W + h
            if route[fi] < 0:
                p = cand_slot[0, e, _least_loaded(cand_gpu, cand_ok, 0, e, fi, load, 0)]
            else:
                p = static_slot[fi]
            out[t, k] = p
            load[slot_gpu[p]] += 1
    return out


@njit(cache=True, nogil=True)
def _counts_and_clear(X, node, G, tot, out, col, own):
    """Counts of one send matrix X [W, W] into out[0:6]: intra-GPU, intra-node and inter-node sends, the largest
    off-diagonal entry, and the busiest GPU's max(sent, received) sends over intra-node and over inter-node links.
    Adds X into tot [W, W] when tot has rows (else skips), and zeroes X. col, own: int64 [W] scratch.

    Row h: sent = row sum, intra-node part = its own node's block; received by d: column sum, intra-node part =
    the rows of d's node. The diagonal is taken out first, so the inner loops are plain sums (vectorisable).
    """
    W = X.shape[0]
    add = tot.shape[0] > 0
    col[:] = 0
    own[:] = 0
    diag = 0
    mx = 0
    bi = 0
    be = 0
    intra = 0
    total = 0
    for h in range(W):
        row = X[h]
        dg = np.int64(row[h])
        row[h] = 0
        diag += dg
        rs = 0
        m = 0
        for d in range(W):
            x = np.int64(row[d])
            rs += x
            m = max(m, x)
            col[d] += x
        if add:
            trow = tot[h]
            for d in range(W):
                trow[d] += row[d]
            trow[h] += dg
        c0 = node[h] * G
        os = 0
        for d in range(c0, c0 + G):
            x = np.int64(row[d])
            os += x
            own[d] += x
        for d in range(W):
            row[d] = 0
        bi = max(bi, os)
        be = max(be, rs - os)
        intra += os
        total += rs
        mx = max(mx, m)
    for d in range(W):
        bi = max(bi, own[d])
        be = max(be, col[d] - own[d])
    out[0] = diag
    out[1] = intra
    out[2] = total - intra
    out[3] = mx
    out[4] = bi
    out[5] = be


@njit(cache=True, nogil=True)
def _mb_kernel(ids, rows, home, starts, route, cand_gpu, cand_ok, node, G, loads, cpg, cth, tot_pg, tot_b, local,
               nlocal, l0, l1):
    """Route complete micro-batches in layers [l0, l1) and reduce each to its per-layer counts.

    ids: int16 [T, L, K]; rows: int64 [n] rows of ids grouped by micro-batch (trace order inside), micro-batch b
    being rows[starts[b]:starts[b+1]]; home: int64 [n] home GPU of each of those rows. route: int16 [L*E*W] GPU of
    each (layer, expert, home), -1 where least-loaded must choose; node: int64 [W] node of each GPU (a table: a
    64-bit division costs more than the rest of a pair).

    Each token-layer: K replica choices, load per GPU, one send per distinct target GPU into the per-GPU dedup
    matrix M [W, W] (home, target), one send per distinct remote node into B [W, N_n]. Tokens go in blocks, layer by
    layer inside a block, so the layer's tables and matrices stay in cache. At the end of a micro-batch the
    two-hop matrix is built from M and B (sends inside the home node stay direct; a send to a remote node lands on
    the GPU of the home's local rank there and is forwarded over NVLink to each other target), and both matrices
    are reduced by _counts_and_clear. Writes loads int64 [B, L, W], cpg, cth int64 [B, L, 6]; adds into tot_pg
    int64 [L, W, W] (per-GPU sends), tot_b int64 [L, W, N_n] (B; the two-hop totals are linear in both, see
    two_hop_matrix) and local, nlocal int64 [L]. Layers are independent: disjoint layer ranges may run in
    parallel threads. Returns -1, or a row whose expert id is out of range.
    """
    L, K = ids.shape[1], ids.shape[2]
    E = cand_gpu.shape[1]
    W = node.shape[0]
    Nn = node[W - 1] + 1
    LK = L * K
    flat = ids.reshape(-1)
    lf = loads.reshape(-1)
    M = np.zeros((l1 - l0, W, W), np.int32)
    B = np.zeros((l1 - l0, W, Nn), np.int32)
    TH = np.zeros((W, W), np.int32)
    none = np.zeros((0, W), np.int64)
    col = np.zeros(W, np.int64)
    own = np.zeros(W, np.int64)
    seen_g = np.zeros(W, np.int64)  # stamp of the last token-layer that sent to each GPU / node
    seen_n = np.zeros(Nn, np.int64)
    stamp = 0
    for b in range(starts.shape[0] - 1):
        for t0 in range(starts[b], starts[b + 1], 512):
            t1 = min(starts[b + 1], t0 + 512)
            for layer in range(l0, l1):
                Ml = M[layer - l0]
                Bl = B[layer - l0]
                rb = layer * E * W
                lb = (b * L + layer) * W
                loc = 0
                nloc = 0
                for t in range(t0, t1):
                    h = home[t]
                    hn = node[h]
                    ib = rows[t] * LK + layer * K
                    mrow = Ml[h]
                    brow = Bl[h]
                    stamp += 1
                    for k in range(K):  # branch-free counting: sends dedup by stamps, not by tests
                        e = np.int64(flat[ib + k])
                        if e < 0 or e >= E:
                            return rows[t]
                        g = np.int64(route[rb + e * W + h])
                        if g < 0:
                            g = cand_gpu[layer, e, _least_loaded(cand_gpu, cand_ok, layer, e, rb + e * W + h, lf, lb)]
                        lf[lb + g] += 1
                        nd = node[g]
                        loc += g == h
                        nloc += nd == hn
                        mrow[g] += seen_g[g] != stamp  # first pair of this token-layer on GPU g
                        seen_g[g] = stamp
                        brow[nd] += (seen_n[nd] != stamp) & (nd != hn)  # first pair on remote node nd
                        seen_n[nd] = stamp
                local[layer] += loc
                nlocal[layer] += nloc
        for layer in range(l0, l1):
            X = M[layer - l0]
            Bl = B[layer - l0]
            for h in range(W):
                hn = node[h]
                lr = h - hn * G
                row = X[h]
                for nd in range(Nn):
                    c0 = nd * G
                    if nd == hn:
                        th = TH[h]
                        for d in range(c0, c0 + G):
                            th[d] += row[d]
                    else:
                        land = c0 + lr
                        th = TH[land]
                        for d in range(c0, c0 + G):
                            th[d] += row[d]
                        th[land] -= row[land]
                        TH[h, land] += Bl[h, nd]
                        tot_b[layer, h, nd] += Bl[h, nd]
                        Bl[h, nd] = 0
            _counts_and_clear(X, node, G, tot_pg[layer], cpg[b, layer], col, own)
            _counts_and_clear(TH, node, G, none, cth[b, layer], col, own)
    return -1

_POOL: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, pool): a forked child makes its own


def _threads() -> int:
    """Kernel threads: MOEPLACE_SIM_THREADS, else the CPUs this process may use (at most 8)."""
    env = os.environ.get("MOEPLACE_SIM_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _by_layers(kernel, L: int, *args) -> list:
    """Run ``kernel(*args, l0, l1)`` on disjoint layer ranges covering [0, L), in threads (the kernels release the
    GIL; layers share no accumulator). Returns the kernels' return values."""
    global _POOL
    n = min(_threads(), L)
    if n <= 1:
        return [kernel(*args, 0, L)]
    cuts = [L * i // n for i in range(n + 1)]
    if _POOL is None or _POOL[0] != os.getpid() or _POOL[1] < n:
        _POOL = (os.getpid(), n, ThreadPoolExecutor(max_workers=n, thread_name_prefix="moeplace-sim"))
    futs = [_POOL[2].submit(kernel, *args, cuts[i], cuts[i + 1]) for i in range(n)]
    return [f.result() for f in futs]

def _kernel_route(tab: RouteTables, rule: str) -> np.ndarray:
    """int16 [L*E*W]: the GPU each (layer, expert, home) goes to, -1 where the least-loaded rule must choose."""
    if rule == "nearest-least-loaded":
        return np.where(tab.ambiguous, np.int16(-1), tab.static_gpu).astype(np.int16)
    return tab.static_gpu


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
    load = np.zeros(W, np.int64) if base_load is None else np.array(base_load, np.int64).reshape(W)
    return _assign_kernel(np.ascontiguousarray(ex, np.int64), np.ascontiguousarray(h), _kernel_route(tab, rule),
                          tab.static_slot, tab.cand_slot, tab.cand_gpu, tab.cand_ok, tab.slot_gpu, W, load)


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
    route: np.ndarray | None = None  # int16 [L*E*W] the kernels' table for ``rule`` (see _kernel_route)
    node: np.ndarray | None = None  # int64 [W] node of each GPU

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
                pair_flops / cluster.expert_flops, cost, batching, plan, _kernel_route(tab, rule),
                np.arange(W, dtype=np.int64) // cluster.gpus_per_node)


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


_COUNTS = ("intra_gpu_sends", "intra_node_sends", "inter_node_sends", "max_message_sends", "busiest_intra",
           "busiest_inter")  # last axis of the per-layer send counts (see _matrix_counts)


def _send_counts(ctx: _Ctx, X: np.ndarray) -> np.ndarray:
    """int64 [B, L, 6] counts of send matrices X [B, L, W, W] (plain numpy; the reference path uses it)."""
    W, G, Nn = ctx.W, ctx.G, ctx.num_nodes
    own = np.arange(W) // G  # node of each GPU
    lr = np.arange(W) % G
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
    off = flat.copy()
    off[..., :: W + 1] = 0
    maxmsg = off.max(-1) if W > 1 else np.zeros(lead, np.int64)
    return np.stack([diag.sum(-1), intra_out.sum(-1), inter_out.sum(-1), maxmsg,
                     np.maximum(intra_out.max(-1), intra_in.max(-1)),
                     np.maximum(inter_out.max(-1), inter_in.max(-1))], -1).astype(np.int64)


def _mb_metrics(ctx: _Ctx, counts: dict[str, np.ndarray], load: np.ndarray) -> dict[str, np.ndarray]:
    """Per-micro-batch, per-layer quantities. counts: mode -> int [B, L, 6] (see _COUNTS); load: int [B, L, W].

    Returns name -> [B, L].
    """
    W, G = ctx.W, ctx.G
    cl = ctx.cluster
    out: dict[str, np.ndarray] = {}
    for mode in DEDUP_MODES:
        c = counts[mode]
        for j, name in enumerate(_COUNTS[:4]):
            out[f"{mode}.{name}"] = c[..., j]
        maxmsg = c[..., 3]
        t = {}
        for name, busiest, alpha, bw, peers in (
                ("intra", c[..., 4], cl.intra_latency, cl.intra_bw, G - 1),
                ("inter", c[..., 5], cl.inter_latency, cl.inter_bw, W - G)):
            padded = peers * maxmsg
            for key, sends in (("", busiest), ("_padded", padded)):
                for part, nbytes in (("d", ctx.dispatch_send_bytes), ("c", ctx.combine_send_bytes)):
                    t[name, key, part] = np.where(sends > 0, alpha + sends * nbytes / bw, 0.0)
        for key in ("", "_padded"):
            out[f"{mode}.comm_time{key}"] = (np.maximum(t["intra", key, "d"], t["inter", key, "d"])
                                             + np.maximum(t["intra", key, "c"], t["inter", key, "c"]))
    mx = load.max(-1) if W else np.zeros(load.shape[:-1], np.int64)
    out["compute_time"] = mx * ctx.pair_seconds
    out["pairs"] = load.sum(-1).astype(np.int64)
    out["max_load"] = mx.astype(np.int64)
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
        return atomic_write_json(self.to_json(), path)


# --------------------------------------------------------------------------------------------------- accumulation


class _PhaseAcc:
    """Accumulators of one phase: totals, finished per-micro-batch metrics, and the token rows of open micro-batches.

    A micro-batch is routed only once all its tokens were seen: rows of open micro-batches wait in ``pending``
    (copies of their routing, 2 bytes per token, layer and k: much less than open [L, W, W] matrices), so the
    kernel routes each micro-batch with its matrices hot in cache and reduces them at once.
    """

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
        self.done_ids: list[np.ndarray] = []
        self.done: list[dict] = []
        self.seen: dict[int, int] = {}  # open micro-batch id -> tokens seen so far
        self.pending: list[list] = []  # [ids int16 [n, L, K], home [n], mb [n], alive bool [n]] in trace order
        self.node_sends: np.ndarray | None = None  # int64 [L, W, N_n] once the kernel routed (two-hop totals)

    def finish(self, mbs: list[int], M: np.ndarray, TH: np.ndarray, load: np.ndarray) -> None:
        """Record complete micro-batches given as matrices (reference path): M, TH int [B, L, W, W], load [B, L, W]."""
        if not len(mbs):
            return
        self.sends["per_gpu"] += M.sum(0)
        self.sends["two_hop"] += TH.sum(0)
        self.done_ids.append(np.asarray(mbs, np.int64))
        counts = {"per_gpu": _send_counts(self.ctx, M), "two_hop": _send_counts(self.ctx, TH)}
        self.done.append(_mb_metrics(self.ctx, counts, load))

    def add(self, ids: np.ndarray, rows: np.ndarray, home: np.ndarray, mb: np.ndarray) -> None:
        """Take the rows ``rows`` of ids int16 [T, L, K] (one phase, trace order; home, mb: int [n]) and route
        every micro-batch that is now complete."""
        n = len(rows)
        if n == 0:
            return
        self.tokens += n
        self.pairs += np.int64(ids.shape[2] * n)
        umb, cnt = np.unique(mb, return_counts=True)
        pos = np.searchsorted(self.expect_ids, umb)
        complete = []
        from_pending = False  # a complete micro-batch has rows waiting from earlier chunks
        for m, c, i in zip(umb.tolist(), cnt.tolist(), pos.tolist(), strict=True):
            before = self.seen.pop(m, 0)
            if i < len(self.expect_ids) and self.expect_ids[i] == m and before + c >= self.expect_n[i]:
                complete.append(m)
                from_pending |= before > 0
            else:
                self.seen[m] = before + c
        now = np.isin(mb, complete) if len(complete) < len(umb) else np.ones(n, bool)
        if from_pending:
            parts: list[tuple] = []
            for p in self.pending:
                take = p[3] & np.isin(p[2], complete)
                if take.any():
                    parts.append((p[0][take], p[1][take], p[2][take]))
                    p[3] &= ~take
            self.pending = [p for p in self.pending if p[3].any()]
            parts.append((ids[rows[now]], home[now], mb[now]))
            cat = np.concatenate([x[0] for x in parts])
            self._route(cat, np.arange(len(cat)), np.concatenate([x[1] for x in parts]),
                        np.concatenate([x[2] for x in parts]))
        elif complete:
            self._route(ids, rows[now], home[now], mb[now])
        if not now.all():
            keep = ~now
            self.pending.append([ids[rows[keep]], home[keep], mb[keep], np.ones(int(keep.sum()), bool)])

    def _route(self, ids: np.ndarray, rows: np.ndarray, home: np.ndarray, mb: np.ndarray) -> None:
        """Route complete micro-batches: rows of ids in trace order, mb their micro-batch ids."""
        ctx = self.ctx
        L = ctx.meta.num_layers
        order = np.argsort(mb, kind="stable")  # micro-batches together, trace order inside
        umb, cnt = np.unique(mb, return_counts=True)
        starts = np.r_[0, np.cumsum(cnt)].astype(np.int64)
        nb = len(umb)
        loads = np.zeros((nb, L, ctx.W), np.int64)
        counts = {m: np.zeros((nb, L, 6), np.int64) for m in DEDUP_MODES}
        if self.node_sends is None:
            self.node_sends = np.zeros((L, ctx.W, ctx.num_nodes), np.int64)
        bad = _by_layers(_mb_kernel, L, np.ascontiguousarray(ids, np.int16), np.ascontiguousarray(rows[order]),
                         np.ascontiguousarray(home[order], np.int64), starts, ctx.route, ctx.tab.cand_gpu,
                         ctx.tab.cand_ok, ctx.node, ctx.G, loads, counts["per_gpu"], counts["two_hop"],
                         self.sends["per_gpu"], self.node_sends, self.local, self.node_local)
        if max(bad) >= 0:
            raise ValueError(f"a token row has an expert id out of range [0, {ctx.meta.num_experts})")
        self.load += loads.sum(0)
        self.done_ids.append(umb.astype(np.int64))
        self.done.append(_mb_metrics(ctx, counts, loads))

    def result(self, name: str) -> PhaseResult:
        if self.pending:  # micro-batches the layout expected more tokens for: route what was seen
            ps = [p for p in self.pending if p[3].any()]
            self.pending = []
            if ps:
                ids = np.concatenate([p[0][p[3]] for p in ps])
                self._route(ids, np.arange(len(ids)), np.concatenate([p[1][p[3]] for p in ps]),
                            np.concatenate([p[2][p[3]] for p in ps]))
        if self.node_sends is not None:
            self.sends["two_hop"] = two_hop_matrix(self.sends["per_gpu"], self.node_sends, self.ctx.G)
            self.node_sends = None
        L = self.ctx.meta.num_layers
        if self.done:
            ids = np.concatenate(self.done_ids)
            order = np.argsort(ids, kind="stable")
            pm = {k: np.concatenate([d[k] for d in self.done])[order] for k in self.done[0]}
            ids = ids[order]
        else:
            ids = np.zeros(0, np.int64)
            z = np.zeros((0, L, 6), np.int64)
            pm = _mb_metrics(self.ctx, {m: z for m in DEDUP_MODES}, np.zeros((0, L, self.ctx.W), np.int64))
        return PhaseResult(name, self.tokens, self.ctx.dispatch_send_bytes, self.ctx.combine_send_bytes, ids,
                           self.pairs, self.load, self.local, self.node_local, self.sends, pm)


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
    if len(lay.home) and (lay.home.min() < 0 or lay.home.max() >= ctx.W):
        raise ValueError(f"plan: a request's home GPU is out of range [0, {ctx.W})")
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
        ids = np.ascontiguousarray(ch.expert_ids, np.int16)
        for p in (PREFILL, DECODE):
            sel = np.flatnonzero(ch.phase == p)
            accs[p].add(ids, sel, home[sel], mb[sel])
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
