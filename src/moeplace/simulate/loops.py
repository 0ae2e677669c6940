"""Compiled loops of the simulator (numba): the work here is sequential by nature (the least-loaded replica rule
depends on every earlier pair of the micro-batch), so it is a loop, compiled once per checkout.

Shape legend: T = tokens, L = MoE layers, K = top-k, E = logical experts, P = physical slots, W = GPUs,
M = max replicas of one expert (candidates), B = micro-batches, N_n = nodes, G = GPUs per node.

These are the compiled *implementations*; :mod:`moeplace.simulate.routing` is the public definition that the
simulator, the planner and the runtime call. ``cache=True`` keeps the compiled code in __pycache__ next to this
file, so only the first run of a checkout pays the compile (about 7 s on 2 busy cores).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, inline="always")
def first_visit(seen, i, stamp):
    """1 the first time index ``i`` is met under ``stamp`` (one token-layer), else 0; marks it seen.

    The one dedup rule of send counting: a token's hidden vector goes once per distinct destination GPU (per-GPU
    dedup) and once per distinct remote node (two-hop), however many of its experts sit there.
    """
    new = seen[i] != stamp
    seen[i] = stamp
    return new


@njit(cache=True, nogil=True)
def tier_kernel(cand, cgpu, nog, ok, static, nbest):
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


# microbatch_kernel routes complete micro-batches layer by layer (replica choice, per-GPU and per-node dedup, load)
# and reduces each to its per-layer counts; the functions above are its building blocks.


@njit(cache=True, nogil=True)
def least_loaded(cand_gpu, cand_ok, layer, e, fi, load, base):
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
def assign_kernel(ex, home, serve, serve_slot, cand_slot, cand_gpu, cand_ok, slot_gpu, W, load):
    """Slots [T, K] of one micro-batch in layer 0; serve[fi] < 0 marks a least-loaded choice; updates load [W]."""
    T, K = ex.shape
    out = np.empty((T, K), np.int64)
    for t in range(T):
        h = home[t]
        for k in range(K):
            e = ex[t, k]
            fi = e * W + h
            if serve[fi] < 0:
                p = cand_slot[0, e, least_loaded(cand_gpu, cand_ok, 0, e, fi, load, 0)]
            else:
                p = serve_slot[fi]
            out[t, k] = p
            load[slot_gpu[p]] += 1
    return out


@njit(cache=True, nogil=True)
def counts_and_clear(X, node, G, tot, out, col, own):
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
def microbatch_kernel(ids, rows, home, starts, serve, cand_gpu, cand_ok, pick, node, G, loads, cpg, cth, tot_pg,
                      tot_b, local, nlocal, act, cpp, l0, l1):
    """Route complete micro-batches in layers [l0, l1) and reduce each to its per-layer counts.

    ids: int16 [T, L, K]; rows: int64 [n] rows of ids grouped by micro-batch (trace order inside), micro-batch b
    being rows[starts[b]:starts[b+1]]; home: int64 [n] home GPU of each of those rows. serve: int16 [L*E*W] GPU of
    each (layer, expert, home), -1 where least-loaded must choose; node: int64 [W] node of each GPU (a table: a
    64-bit division costs more than the rest of a pair). pick: int16 [n, L, K] the serving GPU of every pair,
    chosen beforehand per micro-batch (the balanced rules, :func:`balance_kernel`), or [0, L, K] to choose here
    from ``serve`` (the nearest rules).

    Each token-layer: K replica choices, load per GPU, one send per distinct target GPU into the per-GPU dedup
    matrix M [W, W] (home, target), one send per distinct remote node into B [W, N_n]. Tokens go in blocks, layer by
    layer inside a block, so the layer's tables and matrices stay in cache. At the end of a micro-batch the
    two-hop matrix is built from M and B (sends inside the home node stay direct; a send to a remote node lands on
    the GPU of the home's local rank there and is forwarded over NVLink to each other target), and both matrices
    are reduced by counts_and_clear. Writes loads int64 [B, L, W], cpg, cth int64 [B, L, 6]; adds into tot_pg
    int64 [L, W, W] (per-GPU sends), tot_b int64 [L, W, N_n] (B; the two-hop totals are linear in both, see
    routing.two_hop_matrix) and local, nlocal int64 [L]. Layers are independent: disjoint layer ranges may run in
    parallel threads. Returns -1, or a row whose expert id is out of range.

    For the time model (:mod:`moeplace.simulate.cost`) it also writes act int64 [B, L, W]: distinct logical experts
    with at least one pair on each GPU (the expert weights a GPU reads from HBM), and cpp int64 [B, L, 4]: sends
    with no dedup, one per (token, expert) pair off the home GPU (DeepEP low-latency): intra-node pairs,
    inter-node pairs, and the busiest GPU's max(sent, received) pairs over intra-node and over inter-node links.
    """
    L, K = ids.shape[1], ids.shape[2]
    E = cand_gpu.shape[1]
    W = node.shape[0]
    Nn = node[W - 1] + 1
    LK = L * K
    npick = pick.shape[0] > 0
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
    af = act.reshape(-1)
    seen_a = np.zeros((l1 - l0, E * W), np.int32)  # micro-batch number + 1 that last used (expert, GPU) per layer
    pp = np.zeros((l1 - l0, 4, W), np.int64)  # per-pair sends: sent intra, received intra, sent inter, received inter
    for b in range(starts.shape[0] - 1):
        for t0 in range(starts[b], starts[b + 1], 512):
            t1 = min(starts[b + 1], t0 + 512)
            for layer in range(l0, l1):
                Ml = M[layer - l0]
                Bl = B[layer - l0]
                rb = layer * E * W
                lb = (b * L + layer) * W
                sa = seen_a[layer - l0]
                ppl = pp[layer - l0]
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
                        if npick:
                            g = np.int64(pick[t, layer, k])
                        else:
                            g = np.int64(serve[rb + e * W + h])
                            if g < 0:
                                g = cand_gpu[layer, e, least_loaded(cand_gpu, cand_ok, layer, e, rb + e * W + h, lf,
                                                                    lb)]
                        lf[lb + g] += 1
                        nd = node[g]
                        loc += g == h
                        nloc += nd == hn
                        mrow[g] += first_visit(seen_g, g, stamp)  # first pair of this token-layer on GPU g
                        brow[nd] += first_visit(seen_n, nd, stamp) & (nd != hn)  # first pair on remote node nd
                        af[lb + g] += first_visit(sa, e * W + g, b + 1)  # first pair of expert e on GPU g
                        if g != h:  # per-pair sends (no dedup): class 0 intra-node, 2 inter-node
                            c = 2 * (nd != hn)
                            ppl[c, h] += 1
                            ppl[c + 1, g] += 1
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
            counts_and_clear(X, node, G, tot_pg[layer], cpg[b, layer], col, own)
            counts_and_clear(TH, node, G, none, cth[b, layer], col, own)
            ppl = pp[layer - l0]
            for c in range(2):
                tot = 0
                busy = 0
                for g in range(W):
                    tot += ppl[2 * c, g]
                    busy = max(busy, ppl[2 * c, g], ppl[2 * c + 1, g])
                cpp[b, layer, c] = tot
                cpp[b, layer, 2 + c] = busy
            ppl[:] = 0
    return -1


@njit(cache=True, nogil=True)
def distinct_kernel(cand_slot, cand_gpu, rep_gpu, rep_slot, rep_n):
    """The distinct GPUs holding each (layer, expert), in slot order: rep_gpu [L, E, M] (-1 padded), rep_slot
    [L, E, M] the expert's first slot on that GPU, rep_n [L, E] how many. cand_slot, cand_gpu: [L, E, M]."""
    L, E, M = cand_slot.shape
    for layer in range(L):
        for e in range(E):
            n = 0
            for m in range(M):
                if cand_slot[layer, e, m] < 0:
                    continue
                g = cand_gpu[layer, e, m]
                new = True
                for i in range(n):
                    new &= rep_gpu[layer, e, i] != g
                if new:
                    rep_gpu[layer, e, n] = g
                    rep_slot[layer, e, n] = cand_slot[layer, e, m]
                    n += 1
            rep_n[layer, e] = n


@njit(cache=True, nogil=True, inline="always")
def first_above(load, cap):
    """The lowest GPU whose load is above ``cap`` (load int [W]), or -1 when none is."""
    for g in range(load.shape[0]):
        if load[g] > cap:
            return g
    return -1


@njit(cache=True, nogil=True, inline="always")
def residual_row(u, x, gh, ge, rep_gpu, rep_n, layer, cc, wc, wj, wm, wm2, gs, gj, gm):
    """Row u of the residual graph on GPUs (:func:`reduce_cap`, :func:`settle_cap`): wc[u, v] the cheapest move of
    one pair of any group with pairs on u to its replica on v (first in group then replica order; 1 << 62 where
    none), wj, wm, wm2 its group and replica indices. Built from the (group, replica) entries on u (gs, gj, gm:
    CSR, groups in order)."""
    big = np.int64(1) << 62
    for v in range(wc.shape[1]):
        wc[u, v] = big
    for i in range(gs[u], gs[u + 1]):
        j = gj[i]
        m = gm[i]
        if x[j, m] == 0:
            continue
        h = gh[j]
        e = ge[j]
        cu = cc[h, u]
        for m2 in range(rep_n[layer, e]):
            if m2 == m:
                continue
            v = rep_gpu[layer, e, m2]
            c = cc[h, v] - cu
            if c < wc[u, v]:
                wc[u, v] = c
                wj[u, v] = j
                wm[u, v] = m
                wm2[u, v] = m2


@njit(cache=True, nogil=True, inline="always")
def augment(a, b, cap, x, ge, rep_gpu, layer, ld, pj, pm, pm2, dirty):
    """Move pairs from GPU a (above cap) to b (below it) along the path pj/pm/pm2 leads back from b, as many as
    every link and both caps allow; marks the GPUs on the path dirty, updates x and ld. Returns the pairs moved."""
    W = ld.shape[0]
    d = min(ld[a] - cap, cap - ld[b])
    v = b
    for _ in range(W):
        if v == a:
            break
        j = pj[v]
        d = min(d, x[j, pm[v]])
        v = rep_gpu[layer, ge[j], pm[v]]
    v = b
    for _ in range(W):
        if v == a:
            break
        j = pj[v]
        x[j, pm[v]] -= d
        x[j, pm2[v]] += d
        dirty[v] = True
        v = rep_gpu[layer, ge[j], pm[v]]
        dirty[v] = True
    ld[a] -= d
    ld[b] += d
    return d


@njit(cache=True, nogil=True)
def reduce_cap(cap, x, gh, ge, J, rep_gpu, rep_n, layer, cc, ld, dist, pj, pm, pm2, wc, wj, wm, wm2, gs, gj, gm):
    """Successive shortest paths: move pairs between replicas until no GPU holds more than ``cap`` pairs, at the
    least added locality cost. x [J, M] pairs of group j on its m-th replica GPU, ld [W] loads (both updated).
    Returns the added cost, or -1 when no move can bring every GPU under ``cap`` (x and ld are then partly moved:
    the caller restores them). dist, pj, pm, pm2: int64 [W] scratch; wc, wj, wm, wm2: int64 [W, W] scratch (the
    residual graph on GPUs: the cheapest single-pair move u -> v, its group and replica indices).

    Each step takes the lowest GPU a above cap, finds by Bellman-Ford the cheapest chain of moves (a pair of
    group j from GPU u to another replica GPU v costs cc[home_j, v] - cc[home_j, u]) from a to a GPU below cap
    (the cheapest, ties to the lowest GPU) over the residual graph on GPUs (edge u -> v: the cheapest such move of
    any group, first in group then replica order; relaxations in GPU order, strict improvements only), and
    moves as many pairs along it as every link allows. The start (each group on its cheapest replica) and every
    step keep the residual graph free of negative cycles, so each cap's result has the least cost (the
    successive-shortest-path algorithm of min-cost flow; Ahuja, Magnanti and Orlin, ch. 9).
    """
    W = ld.shape[0]
    big = np.int64(1) << 62
    added = np.int64(0)
    fresh = np.zeros(W, np.bool_)
    dirty = np.ones(W, np.bool_)
    while True:
        a = first_above(ld, cap)
        if a < 0:
            return added
        # the residual graph on GPUs: edge u -> v is the cheapest move of one pair of any group from u to v (first
        # in group then replica order). Row u depends only on which groups have pairs on u, so after a move only
        # the rows of the GPUs on its path are rebuilt, each from the (group, replica) entries on that GPU (gs, gj,
        # gm: CSR, groups in order), which gives the same graph as a full rebuild.
        for u in range(W):
            if dirty[u]:
                dirty[u] = False
                residual_row(u, x, gh, ge, rep_gpu, rep_n, layer, cc, wc, wj, wm, wm2, gs, gj, gm)
        for g in range(W):
            dist[g] = big
            pj[g] = -1
            fresh[g] = False
        dist[a] = 0
        fresh[a] = True
        for _ in range(W):  # Bellman-Ford from a (no negative cycles: see the docstring)
            changed = False
            for u in range(W):
                # a GPU whose distance has not dropped since its edges were last relaxed cannot improve any
                # other (each of its targets is already at most du + c), so skipping it changes no result
                if not fresh[u]:
                    continue
                fresh[u] = False
                du = dist[u]
                for v in range(W):
                    c = wc[u, v]
                    if c == big:
                        continue
                    if du + c < dist[v]:
                        dist[v] = du + c
                        pj[v] = wj[u, v]
                        pm[v] = wm[u, v]
                        pm2[v] = wm2[u, v]
                        fresh[v] = True
                        changed = True
            if not changed:
                break
        b = -1
        for g in range(W):
            if ld[g] < cap and dist[g] < big and (b < 0 or dist[g] < dist[b]):
                b = g
        if b < 0:
            return -1
        d = augment(a, b, cap, x, ge, rep_gpu, layer, ld, pj, pm, pm2, dirty)
        added += d * dist[b]


@njit(cache=True, nogil=True)
def settle_cap(cap, x, gh, ge, J, rep_gpu, rep_n, layer, cc, ld, dist, pj, pm, pm2, wc, wj, wm, wm2, gs, gj, gm,
               pot, done):
    """:func:`reduce_cap` from a state of least cost for its loads (each group on a cheapest replica is one), by
    Dijkstra's algorithm on reduced costs instead of Bellman-Ford: the same least added cost at ``cap`` (-1 when
    no move can reach it), other tie-breaks. pot int64 [W] (potentials, zero on entry), done bool [W]: scratch.

    With potentials p, every residual edge u -> v has reduced cost wc[u, v] + p[u] - p[v] >= 0 (zero potentials
    hold at a least-cost start). Each step takes the lowest GPU a above cap and settles GPUs in order of reduced
    distance from a (ties to the lowest GPU), stopping at the first GPU below cap, b; then moves as many pairs as
    every link of the path allows and raises each GPU's potential by min(its distance, b's). That keeps every
    reduced cost >= 0 on the new residual graph (edges of the path get 0, new ones follow from the group's
    old edges), so each path is a cheapest one and the result has the least cost at the cap (successive shortest
    paths with potentials; Ahuja, Magnanti and Orlin, ch. 9.7). Rows of the residual graph are rebuilt only when a
    GPU they leave is settled, from the (group, replica) entries on it (gs, gj, gm: CSR).
    """
    W = ld.shape[0]
    big = np.int64(1) << 62
    added = np.int64(0)
    dirty = np.ones(W, np.bool_)
    while True:
        a = first_above(ld, cap)
        if a < 0:
            return added
        for g in range(W):
            dist[g] = big
            done[g] = False
        dist[a] = 0
        b = -1
        while True:
            u = -1
            for g in range(W):
                if not done[g] and dist[g] < big and (u < 0 or dist[g] < dist[u]):
                    u = g
            if u < 0:
                break
            done[u] = True
            if u != a and ld[u] < cap:
                b = u
                break
            if dirty[u]:
                dirty[u] = False
                residual_row(u, x, gh, ge, rep_gpu, rep_n, layer, cc, wc, wj, wm, wm2, gs, gj, gm)
            du = dist[u] + pot[u]
            for v in range(W):
                c = wc[u, v]
                if c == big or done[v]:
                    continue
                dv = du + c - pot[v]
                if dv < dist[v]:
                    dist[v] = dv
                    pj[v] = wj[u, v]
                    pm[v] = wm[u, v]
                    pm2[v] = wm2[u, v]
        if b < 0:
            return -1
        db = dist[b]
        d = augment(a, b, cap, x, ge, rep_gpu, layer, ld, pj, pm, pm2, dirty)
        added += d * (db - pot[a] + pot[b])
        for g in range(W):
            pot[g] += min(dist[g], db)


@njit(cache=True, nogil=True)
def entries_by_gpu(ge, J, rep_gpu, rep_n, layer, gs, gj, gm, nxt):
    """The (group, replica) entries of groups 0..J-1 by GPU, as CSR: GPU g's entries are gj[gs[g]:gs[g + 1]] (group)
    and gm[...] (replica index), in group order. gs int64 [W + 1]; gj, gm int64 [>= J * M]; nxt int64 [W] scratch."""
    W = nxt.shape[0]
    for g in range(W + 1):
        gs[g] = 0
    for j in range(J):
        for m in range(rep_n[layer, ge[j]]):
            gs[rep_gpu[layer, ge[j], m] + 1] += 1
    for g in range(W):
        gs[g + 1] += gs[g]
        nxt[g] = gs[g]
    for j in range(J):
        for m in range(rep_n[layer, ge[j]]):
            g = rep_gpu[layer, ge[j], m]
            gj[nxt[g]] = j
            gm[nxt[g]] = m
            nxt[g] += 1


@njit(cache=True, nogil=True)
def min_feasible_cap(lo, hi, x, ld, ge, J, rep_gpu, rep_n, layer, gs, gj, gm, xf, ldf, cnt, prev, pg, p1, p2, queue):
    """The lowest cap in [lo, hi] at which the pairs of groups 0..J-1 can be spread over their replica GPUs so
    that no GPU holds more than the cap (``hi`` must be feasible: the state x [J, M], ld [W] meets it).

    Feasibility only (max flow, no costs): from a copy of the state (xf, ldf), the cap is lowered one pair at a
    time and every GPU above it sends pairs along a breadth-first path of single-pair moves (u -> v: some group
    with pairs on u has a replica on v; cnt [W, W] counts those groups) to a GPU below it. No path means the GPUs
    reachable from the one above the cap hold more than cap x their number with nowhere else to go, so the cap is
    infeasible from any state. gs [W + 1], gj, gm: the (group, replica) entries on each GPU (CSR). prev, pg, p1,
    p2, queue: int64 [W] scratch; xf [J, M], ldf [W], cnt [W, W]: scratch. Leaves x and ld untouched.
    """
    W = ld.shape[0]
    M = x.shape[1]
    for g in range(W):
        ldf[g] = ld[g]
        for v in range(W):
            cnt[g, v] = 0
    for j in range(J):
        e = ge[j]
        nr = rep_n[layer, e]
        for m in range(M):
            xf[j, m] = x[j, m]
        for m in range(nr):
            if xf[j, m] > 0:
                u = rep_gpu[layer, e, m]
                for m2 in range(nr):
                    if m2 != m:
                        cnt[u, rep_gpu[layer, e, m2]] += 1
    c = hi
    while c > lo:
        t = c - 1
        while True:
            a = first_above(ldf, t)
            if a < 0:
                break
            for g in range(W):
                prev[g] = -2
            prev[a] = -1
            head = 0
            tail = 1
            queue[0] = a
            b = -1
            while head < tail and b < 0:
                u = queue[head]
                head += 1
                for v in range(W):
                    if prev[v] == -2 and cnt[u, v] > 0:
                        prev[v] = u
                        if ldf[v] < t:
                            b = v
                            break
                        queue[tail] = v
                        tail += 1
            if b < 0:
                return c
            d = min(ldf[a] - t, t - ldf[b])
            v = b
            while v != a:  # one group per link of the path: the first on u with pairs there and a replica on v
                u = prev[v]
                p1[v] = -1
                for i in range(gs[u], gs[u + 1]):
                    j = gj[i]
                    m = gm[i]
                    if xf[j, m] > 0:
                        e = ge[j]
                        for m2 in range(rep_n[layer, e]):
                            if rep_gpu[layer, e, m2] == v:
                                pg[v] = j
                                p1[v] = m
                                p2[v] = m2
                                break
                        if p1[v] >= 0:
                            break
                d = min(d, xf[pg[v], p1[v]])
                v = u
            v = b
            while v != a:
                u = prev[v]
                j = pg[v]
                e = ge[j]
                nr = rep_n[layer, e]
                xf[j, p1[v]] -= d
                if xf[j, p1[v]] == 0:
                    for k in range(nr):
                        if k != p1[v]:
                            cnt[u, rep_gpu[layer, e, k]] -= 1
                if xf[j, p2[v]] == 0:
                    for k in range(nr):
                        if k != p2[v]:
                            cnt[v, rep_gpu[layer, e, k]] += 1
                xf[j, p2[v]] += d
                v = u
            ldf[a] -= d
            ldf[b] += d
        c = t
    return c


LINK_CAPS = 6  # balanced-links: load caps tried, from the balanced max load up in steps of LINK_STEP
LINK_WORK = 32  # balanced-links: candidate moves per pair of a micro-batch and layer, at most, per cap
LINK_STEP = 20  # balanced-links: a cap step is max(1, ML // LINK_STEP) pairs

@njit(cache=True, nogil=True, inline="always")
def _top_after(hist, M, o1, n1, o2, n2, o3, n3):
    """(max, count at max) of a histogram ``hist`` with max M after up to three GPUs change value o -> n (each by
    at most 1; o = n = -1 marks an unused slot): the new max is M + 1, M or M - 1."""
    for v in (M + 1, M, M - 1):
        if v < 0:
            continue
        c = hist[v] if v <= M else 0
        c += (n1 == v) + (n2 == v) + (n3 == v) - (o1 == v) - (o2 == v) - (o3 == v)
        if c > 0:
            return v, c
    return 0, 0


@njit(cache=True, nogil=True)
def link_descent(lcap, x, gh, ge, J, rep_gpu, rep_n, layer, node, ld, rc, sd, hist, gs, gj, gm, hs, hj, budget):
    """Lower the busiest GPU's inter-node pairs (the larger of received ``rc`` and sent ``sd``) by moving single
    pairs of groups between their expert's replicas while no GPU's load ``ld`` exceeds ``lcap``: each step takes,
    among the moves off a GPU at the maximum, the one with the least (max, GPUs at the max) (ties: GPU, entry and
    replica order), and stops when no move lowers it or after ``budget`` candidate moves. Entries by GPU: gs/gj/gm
    (:func:`entries_by_gpu`); groups by home: hj[hs[h]:hs[h + 1]]. hist int64 [>= max + 2] scratch. Returns the
    max reached; x, ld, rc, sd are updated in place."""
    W = ld.shape[0]
    M = np.int64(0)
    for g in range(W):
        M = max(M, max(rc[g], sd[g]))
    for v in range(M + 2):
        hist[v] = 0
    for g in range(W):
        hist[max(rc[g], sd[g])] += 1
    C = hist[M]
    work = np.int64(0)
    while M > 0 and work < budget:
        bM, bC, bj, bm, bm2 = M, C, np.int64(-1), np.int64(-1), np.int64(-1)
        for a in range(W):
            if max(rc[a], sd[a]) != M:
                continue
            for side in range(2):
                if side == 0:
                    if rc[a] != M:
                        continue
                    i0, i1 = gs[a], gs[a + 1]
                else:
                    if sd[a] != M:
                        continue
                    i0, i1 = hs[a], hs[a + 1]
                for i in range(i0, i1):
                    if side == 0:
                        j, m = gj[i], gm[i]
                        ms = m
                        me = m + 1
                    else:
                        j = hj[i]
                        ms = 0
                        me = rep_n[layer, ge[j]]
                    h = gh[j]
                    e = ge[j]
                    for m in range(ms, me):
                        ga = rep_gpu[layer, e, m]
                        if x[j, m] == 0 or node[ga] == node[h]:
                            continue  # only a pair served on another node than its home moves
                        for m2 in range(rep_n[layer, e]):
                            gc = rep_gpu[layer, e, m2]
                            if m2 == m or ld[gc] + 1 > lcap:
                                continue
                            work += 1
                            nc = np.int64(node[gc] != node[h])
                            # GPUs that change: ga (receives one less), gc (one more if remote), h (sends 1 - nc less)
                            oa, na_ = max(rc[ga], sd[ga]), max(rc[ga] - 1, sd[ga])
                            oc, ncv = max(rc[gc], sd[gc]), max(rc[gc] + nc, sd[gc] + (gc == h) * (nc - 1))
                            if h == gc:
                                oh, nh = np.int64(-1), np.int64(-1)
                            else:
                                oh, nh = max(rc[h], sd[h]), max(rc[h], sd[h] + nc - 1)
                            tM, tC = _top_after(hist, M, oa, na_, oc, ncv, oh, nh)
                            if tM < bM or (tM == bM and tC < bC):
                                bM, bC, bj, bm, bm2 = tM, tC, j, m, m2
        if bj < 0:
            break
        e = ge[bj]
        h = gh[bj]
        ga = rep_gpu[layer, e, bm]
        gc = rep_gpu[layer, e, bm2]
        nc = np.int64(node[gc] != node[h])
        hist[max(rc[ga], sd[ga])] -= 1
        hist[max(rc[gc], sd[gc])] -= 1
        if h != gc:
            hist[max(rc[h], sd[h])] -= 1
        x[bj, bm] -= 1
        x[bj, bm2] += 1
        ld[ga] -= 1
        ld[gc] += 1
        rc[ga] -= 1
        rc[gc] += nc
        sd[h] += nc - 1
        hist[max(rc[ga], sd[ga])] += 1
        hist[max(rc[gc], sd[gc])] += 1
        if h != gc:
            hist[max(rc[h], sd[h])] += 1
        M, C = bM, bC
    return M


@njit(cache=True, nogil=True)
def link_refine(x, xb, gh, ge, J, rep_gpu, rep_n, layer, node, ld, ldb, rc, sd, rcf, sdf, act, mark, stamp, hist,
                gs, gj, gm, hs, hj, nxt, lw, npairs):
    """The ``balanced-links`` search of :func:`links_kernel` on the balanced assignment x / ld of one micro-batch
    and layer (rcf, sdf, act: the single-replica pairs' inter-node receives and sends and active experts per GPU,
    marked in ``mark`` with ``stamp``). Load caps ``c_i = max(ML, F) + i * max(1, ML // LINK_STEP)``, i = 0 ..
    LINK_CAPS - 1 (ML: the balanced max load; F = ceil(lw[2] * A / lw[0]), the load the busiest GPU's A active
    experts' weight reads already cost), each :func:`link_descent` continuing from the last cap's state; after
    each, the objective ``max(lw[0] * max load, lw[2] * A) + lw[1] * max inter-node pairs`` is taken, and the
    least is kept (ties: the balanced start, then the lower cap), so the result is never above the balanced start
    on it. Leaves the kept assignment in x and ld."""
    W = ld.shape[0]
    M = x.shape[1]
    entries_by_gpu(ge, J, rep_gpu, rep_n, layer, gs, gj, gm, nxt)
    for g in range(W + 1):
        hs[g] = 0
    for j in range(J):
        hs[gh[j] + 1] += 1
    for g in range(W):
        hs[g + 1] += hs[g]
        nxt[g] = hs[g]
    for j in range(J):
        hj[nxt[gh[j]]] = j
        nxt[gh[j]] += 1
    most_act = np.int64(0)
    ml0 = np.int64(0)
    for j in range(J):
        e = ge[j]
        for m in range(rep_n[layer, e]):
            g = rep_gpu[layer, e, m]
            if x[j, m] > 0 and mark[g, e] != stamp:
                mark[g, e] = stamp
                act[g] += 1
    for g in range(W):
        most_act = max(most_act, act[g])
        ml0 = max(ml0, ld[g])
        ldb[g] = ld[g]
    for j in range(J):
        for m in range(M):
            xb[j, m] = x[j, m]
    mem = lw[2] * most_act
    floor = (mem + lw[0] - 1) // lw[0]
    step = max(np.int64(1), ml0 // LINK_STEP)
    for g in range(W):
        rc[g] = rcf[g]
        sd[g] = sdf[g]
    for j in range(J):
        h = gh[j]
        e = ge[j]
        for m in range(rep_n[layer, e]):
            g = rep_gpu[layer, e, m]
            if x[j, m] > 0 and node[g] != node[h]:
                rc[g] += x[j, m]
                sd[h] += x[j, m]
    mi = np.int64(0)
    for g in range(W):
        mi = max(mi, max(rc[g], sd[g]))
    best = max(lw[0] * ml0, mem) + lw[1] * mi  # the balanced start
    for i in range(LINK_CAPS):  # each cap continues from the last one's state (raising a cap only adds moves)
        mi = link_descent(max(ml0, floor) + i * step, x, gh, ge, J, rep_gpu, rep_n, layer, node, ld, rc, sd,
                          hist, gs, gj, gm, hs, hj, LINK_WORK * npairs + 1024)
        ml = np.int64(0)
        for g in range(W):
            ml = max(ml, ld[g])
        f = max(lw[0] * ml, mem) + lw[1] * mi
        if f < best:
            best = f
            for j in range(J):
                for m in range(M):
                    xb[j, m] = x[j, m]
            for g in range(W):
                ldb[g] = ld[g]
    for j in range(J):
        for m in range(M):
            x[j, m] = xb[j, m]
    for g in range(W):
        ld[g] = ldb[g]


@njit(cache=True, nogil=True)
def fill_groups(flat, rows, home, s0, s1, layer, K, rep_gpu, rep_n, gid, x, used, pick):
    """The pairs of one micro-batch (rows s0..s1) and layer onto their GPUs from the group counts: a group's
    (home, expert: gid) pairs fill its replica GPUs in slot order, x[j, m] of them on replica m, in token order then
    k order (``used`` counts them, zero on entry). Single-replica pairs are left as they are in pick. flat: ids
    raveled [T * L * K]."""
    LK = pick.shape[1] * K
    for t in range(s0, s1):
        h = home[t]
        ib = rows[t] * LK + layer * K
        for k in range(K):
            e = np.int64(flat[ib + k])
            if rep_n[layer, e] == 1:
                continue
            j = gid[h, e]
            m = 0
            while used[j, m] == x[j, m]:
                m += 1
            used[j, m] += 1
            pick[t, layer, k] = rep_gpu[layer, e, m]


@njit(cache=True, nogil=True)
def balance_kernel(ids, rows, home, starts, rep_gpu, rep_n, cc, unit, lexi, base, pick, l0, l1):
    """The balanced replica rules: the serving GPU of every pair of complete micro-batches in layers [l0, l1).

    ids: int16 [T, L, K]; rows, home, starts: as :func:`microbatch_kernel`. rep_gpu [L, E, M], rep_n [L, E]: the
    distinct GPUs of each expert (:func:`distinct_kernel`). cc: int64 [W, W] locality cost of a pair homed on h and
    served on g, in 1/``unit`` of a pair; lexi: ignore cc except among assignments of least max load (``unit``
    becomes larger than any total locality cost). base: int64 [W] pairs already on each GPU. Writes pick int16
    [n, L, K] (GPU of each pair, rows in micro-batch order). Returns -1, or a row whose expert id is out of range.

    Per micro-batch and layer: pairs of experts with one GPU are fixed; the others form groups (home, expert), in
    order of first appearance. Each group starts on its cheapest replica GPU (ties: slot order); then the cap on
    every GPU's load is the lowest k whose step down to k - 1 would add more than ``unit`` of locality cost or be
    infeasible (objective max load x unit + cost is convex in the cap, so that k is its minimum; equal objective:
    the lower cap), found by bisection over [max(fixed, ceil(mean)), start], each probe by :func:`reduce_cap`. Under
    ``lexi`` that k is the lowest feasible cap (:func:`min_feasible_cap`), reached by one :func:`settle_cap` from the
    start.
    Pairs of a group then fill its replica GPUs in slot order, in token order.
    """
    L, K = ids.shape[1], ids.shape[2]
    E = rep_gpu.shape[1]
    M = rep_gpu.shape[2]
    W = cc.shape[0]
    LK = L * K
    flat = ids.reshape(-1)
    gid = np.full((W, E), -1, np.int64)
    nmax = W * E
    gh = np.zeros(nmax, np.int64)
    ge = np.zeros(nmax, np.int64)
    gn = np.zeros(nmax, np.int64)
    x = np.zeros((nmax, M), np.int64)
    xs = np.zeros((nmax, M), np.int64)
    used = np.zeros((nmax, M), np.int64)
    ld = np.zeros(W, np.int64)
    lds = np.zeros(W, np.int64)
    dist = np.zeros(W, np.int64)
    pj = np.zeros(W, np.int64)
    pm = np.zeros(W, np.int64)
    pm2 = np.zeros(W, np.int64)
    wc = np.zeros((W, W), np.int64)
    wj = np.zeros((W, W), np.int64)
    wm = np.zeros((W, W), np.int64)
    wm2 = np.zeros((W, W), np.int64)
    gs = np.zeros(W + 1, np.int64)
    gj = np.zeros(nmax * M, np.int64)
    gm = np.zeros(nmax * M, np.int64)
    xf = np.zeros((nmax, M), np.int64)
    ldf = np.zeros(W, np.int64)
    cnt = np.zeros((W, W), np.int64)
    prev = np.zeros(W, np.int64)
    pg = np.zeros(W, np.int64)
    p1 = np.zeros(W, np.int64)
    p2 = np.zeros(W, np.int64)
    queue = np.zeros(W, np.int64)
    pot = np.zeros(W, np.int64)
    done = np.zeros(W, np.bool_)
    ccmax = np.int64(0)
    for h in range(W):
        for g in range(W):
            ccmax = max(ccmax, cc[h, g])
    for b in range(starts.shape[0] - 1):
        s0, s1 = starts[b], starts[b + 1]
        for layer in range(l0, l1):
            J = 0
            fixed_max = np.int64(0)
            for g in range(W):
                ld[g] = base[g]
            for t in range(s0, s1):
                h = home[t]
                ib = rows[t] * LK + layer * K
                for k in range(K):
                    e = np.int64(flat[ib + k])
                    if e < 0 or e >= E:
                        return rows[t]
                    if rep_n[layer, e] == 1:
                        g = rep_gpu[layer, e, 0]
                        ld[g] += 1
                        pick[t, layer, k] = g
                        continue
                    j = gid[h, e]
                    if j < 0:
                        j = J
                        J += 1
                        gid[h, e] = j
                        gh[j] = h
                        ge[j] = e
                        gn[j] = 0
                    gn[j] += 1
            for g in range(W):
                fixed_max = max(fixed_max, ld[g])
            npairs = np.int64(0)
            for j in range(J):
                h = gh[j]
                e = ge[j]
                best = 0
                for m in range(M):
                    x[j, m] = 0
                    used[j, m] = 0
                for m in range(1, rep_n[layer, e]):
                    if cc[h, rep_gpu[layer, e, m]] < cc[h, rep_gpu[layer, e, best]]:
                        best = m
                x[j, best] = gn[j]
                ld[rep_gpu[layer, e, best]] += gn[j]
                npairs += gn[j]
            u = unit
            if lexi:
                u = npairs * ccmax + 1
            cap = np.int64(0)
            total = np.int64(0)
            for g in range(W):
                cap = max(cap, ld[g])
                total += ld[g]
            if J > 0:
                # the best cap k* by bisection: F(k) = k * u + least cost at cap k is convex, so P(k) = "cap k - 1
                # is reachable from k at added cost <= u" holds exactly for k > k*; x and ld always hold the
                # least-cost state at cap hi (successive shortest paths only lower a cap), restored after a probe
                # that fails. The first probe tries k* = lb (the common case); then halves [lo, hi].
                lo = max(fixed_max, (total + W - 1) // W)  # no cap below this is feasible: k* >= lo
                hi = cap
                feas = hi
                if lo < hi:
                    # the lowest feasible cap, by max flow: a probe below it fails and leaves x as it was, so it is
                    # skipped (the same result without the min-cost work of a probe that cannot succeed)
                    entries_by_gpu(ge, J, rep_gpu, rep_n, layer, gs, gj, gm, prev)
                    feas = min_feasible_cap(lo, hi, x, ld, ge, J, rep_gpu, rep_n, layer, gs, gj, gm, xf, ldf, cnt,
                                            prev, pg, p1, p2, queue)
                if lexi:
                    # any feasible step down adds less than u, so k* is the lowest feasible cap: one successive-
                    # shortest-path run straight to it gives the least locality cost there (no bisection probes)
                    if feas < hi:
                        for g in range(W):
                            pot[g] = 0
                        settle_cap(feas, x, gh, ge, J, rep_gpu, rep_n, layer, cc, ld, dist, pj, pm, pm2, wc, wj, wm,
                                   wm2, gs, gj, gm, pot, done)
                    hi = feas
                    lo = hi
                first = True
                while lo < hi:
                    mid = lo + 1 if first else (lo + hi + 1) // 2
                    first = False
                    if mid - 1 < feas:
                        lo = mid
                        continue
                    for j in range(J):
                        for m in range(M):
                            xs[j, m] = x[j, m]
                    for g in range(W):
                        lds[g] = ld[g]
                    ok = True
                    if mid < hi:
                        ok = reduce_cap(mid, x, gh, ge, J, rep_gpu, rep_n, layer, cc, ld, dist, pj, pm, pm2,
                                        wc, wj, wm, wm2, gs, gj, gm) >= 0
                    if ok:
                        added = reduce_cap(mid - 1, x, gh, ge, J, rep_gpu, rep_n, layer, cc, ld, dist, pj, pm, pm2,
                                           wc, wj, wm, wm2, gs, gj, gm)
                        ok = 0 <= added <= u
                    if ok:
                        hi = mid - 1
                    else:
                        for j in range(J):
                            for m in range(M):
                                x[j, m] = xs[j, m]
                        for g in range(W):
                            ld[g] = lds[g]
                        lo = mid
                cap = hi
            fill_groups(flat, rows, home, s0, s1, layer, K, rep_gpu, rep_n, gid, x, used, pick)
            for j in range(J):
                gid[gh[j], ge[j]] = -1
    return -1



@njit(cache=True, nogil=True)
def links_kernel(ids, rows, home, starts, rep_gpu, rep_n, base, node, lw, start, pick, l0, l1):
    """The ``balanced-links`` rule from a balanced assignment: the serving GPU of every pair of complete
    micro-batches in layers [l0, l1).

    ids, rows, home, starts, rep_gpu, rep_n, base: as :func:`balance_kernel`; node int64 [W]: node of each GPU;
    lw int64 [3]: weights of one pair of load, one inter-node pair and one active expert (routing.LinkWeights);
    start int16 [n, L, K]: the ``balanced`` rule's GPUs (:func:`balance_kernel` with lexi). Writes pick int16
    [n, L, K]. Per micro-batch and layer the pairs of multi-replica experts form groups (home, expert) in order of
    first appearance with the start's counts per replica GPU; :func:`link_refine` changes the counts, and a group's
    pairs then fill its replica GPUs in slot order, in token order, as :func:`balance_kernel` fills them (so an
    unchanged group keeps the start's GPUs). Returns -1, or a row whose expert id is out of range."""
    L, K = ids.shape[1], ids.shape[2]
    E = rep_gpu.shape[1]
    M = rep_gpu.shape[2]
    W = node.shape[0]
    LK = L * K
    flat = ids.reshape(-1)
    gid = np.full((W, E), -1, np.int64)
    nmax = W * E
    gh = np.zeros(nmax, np.int64)
    ge = np.zeros(nmax, np.int64)
    x = np.zeros((nmax, M), np.int64)
    used = np.zeros((nmax, M), np.int64)
    xb = np.zeros((nmax, M), np.int64)
    ld = np.zeros(W, np.int64)
    ldb = np.zeros(W, np.int64)
    rc = np.zeros(W, np.int64)
    sd = np.zeros(W, np.int64)
    rcf = np.zeros(W, np.int64)
    sdf = np.zeros(W, np.int64)
    act = np.zeros(W, np.int64)
    mark = np.zeros((W, E), np.int64)
    gs = np.zeros(W + 1, np.int64)
    gj = np.zeros(nmax * M, np.int64)
    gm = np.zeros(nmax * M, np.int64)
    hs = np.zeros(W + 1, np.int64)
    hj = np.zeros(nmax, np.int64)
    nxt = np.zeros(W, np.int64)
    mostpairs = np.int64(0)
    for b in range(starts.shape[0] - 1):
        mostpairs = max(mostpairs, (starts[b + 1] - starts[b]) * K)
    hist = np.zeros(mostpairs + 2, np.int64)
    for b in range(starts.shape[0] - 1):
        s0, s1 = starts[b], starts[b + 1]
        for layer in range(l0, l1):
            stamp = b * L + layer + 1
            J = 0
            npairs = np.int64(0)
            for g in range(W):
                ld[g] = base[g]
                rcf[g] = 0
                sdf[g] = 0
                act[g] = 0
            for t in range(s0, s1):
                h = home[t]
                ib = rows[t] * LK + layer * K
                for k in range(K):
                    e = np.int64(flat[ib + k])
                    if e < 0 or e >= E:
                        return rows[t]
                    g = np.int64(start[t, layer, k])
                    pick[t, layer, k] = g
                    ld[g] += 1
                    if rep_n[layer, e] == 1:
                        if node[g] != node[h]:
                            rcf[g] += 1
                            sdf[h] += 1
                        if mark[g, e] != stamp:
                            mark[g, e] = stamp
                            act[g] += 1
                        continue
                    j = gid[h, e]
                    if j < 0:
                        j = J
                        J += 1
                        gid[h, e] = j
                        gh[j] = h
                        ge[j] = e
                        for m in range(M):
                            x[j, m] = 0
                            used[j, m] = 0
                    m = 0
                    while rep_gpu[layer, e, m] != g:
                        m += 1
                    x[j, m] += 1
                    npairs += 1
            if J > 0:
                link_refine(x, xb, gh, ge, J, rep_gpu, rep_n, layer, node, ld, ldb, rc, sd, rcf, sdf, act, mark,
                            stamp, hist, gs, gj, gm, hs, hj, nxt, lw, npairs)
                fill_groups(flat, rows, home, s0, s1, layer, K, rep_gpu, rep_n, gid, x, used, pick)
            for j in range(J):
                gid[gh[j], ge[j]] = -1
    return -1

@njit(cache=True, nogil=True)
def token_sends_kernel(gpu, home, node, out):
    """Sends of each token in one layer: gpu int [T, K] serving GPU of each pair, home int [T], node int [W].

    Writes out int64 [T, 3]: per-GPU dedup sends to other GPUs of the home node, per-GPU dedup sends to GPUs of
    other nodes, and two-hop (per-node dedup) inter-node sends (one per distinct remote node).
    """
    T, K = gpu.shape
    W = node.shape[0]
    seen_g = np.zeros(W, np.int64)
    seen_n = np.zeros(node[W - 1] + 1, np.int64)
    for t in range(T):
        h = home[t]
        hn = node[h]
        stamp = t + 1
        a = 0
        b = 0
        c = 0
        for k in range(K):
            g = gpu[t, k]
            nd = node[g]
            new_g = first_visit(seen_g, g, stamp)
            new_n = first_visit(seen_n, nd, stamp)
            if g != h and nd == hn:
                a += new_g
            elif nd != hn:
                b += new_g
                c += new_n
        out[t, 0] = a
        out[t, 1] = b
        out[t, 2] = c




_POOL: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, pool): a forked child makes its own


def kernel_threads() -> int:
    """Kernel threads: MOEPLACE_SIM_THREADS, else the CPUs this process may use (at most 8)."""
    env = os.environ.get("MOEPLACE_SIM_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def by_ranges(kernel, n: int, *args) -> list:
    """Run ``kernel(*args, i0, i1)`` on disjoint ranges covering [0, n) (layers, requests), in threads (the kernels
    release the GIL and write disjoint parts of their outputs). Returns the kernels' return values."""
    global _POOL
    k = min(kernel_threads(), n)
    if k <= 1:
        return [kernel(*args, 0, n)]
    cuts = [n * i // k for i in range(k + 1)]
    if _POOL is None or _POOL[0] != os.getpid() or _POOL[1] < k:
        _POOL = (os.getpid(), k, ThreadPoolExecutor(max_workers=k, thread_name_prefix="moeplace-sim"))
    futs = [_POOL[2].submit(kernel, *args, cuts[i], cuts[i + 1]) for i in range(k)]
    return [f.result() for f in futs]
