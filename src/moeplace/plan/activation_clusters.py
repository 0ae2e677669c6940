"""``activation-clusters``: the published workload-aware method (Bambhaniya et al., arXiv 2604.23150).

Shape legend: L = MoE layers, E = logical experts, P = slots, N = nodes, G = GPUs per node, W = N * G,
Rq = requests, T = token rows, D = L * E.

1. K-means (k = N) over L2-normalised per-request expert-activation vectors (prefill routing), one cluster per node.
2. Requests are routed to their cluster's node by their prefill activations (nearest centroid, under a per-GPU
   capacity so batches stay balanced; see grouping.py).
3. Per layer, each expert goes to the node whose requests use it most, under a per-node capacity of P / N slots
   (greedy over (expert, node) pairs by decreasing use). Leftover slots of a node (the redundant ones) take the
   node's most used experts it does not hold yet. Inside a node, slots are packed onto GPUs by estimated load.

``cluster_by="usage"`` (not the published method) changes step 1 only: the planning requests are clustered by what
they go on to use (their traffic rows: decode, or the rows after the signal prefix), capped at ceil(Rq / N) each
(:func:`moeplace.plan.grouping.capped_kmeans`), and node n's grouper row is the mean signal feature of cluster n's
requests, so a new request still routes by its signal alone (the same deployable :class:`Grouper`, kind
``"usage-centroids"``). K-means on the signal finds the signal's own strongest structure, which need not be what
decode will use; this fits the groups on the usage and only the routing on the signal.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moeplace.placement import Cluster
from moeplace.placement.grouper import DEFAULT_ROUND, Grouper, balanced_assign, normalise_rows
from moeplace.plan.base import StrategyResult, Workload, check_sizes
from moeplace.plan.eplb import balanced_packing
from moeplace.plan.grouping import capped_kmeans, kmeans


def node_counts(token_request: np.ndarray, expert_ids: np.ndarray, request_node: np.ndarray, num_nodes: int,
                num_experts: int) -> np.ndarray:
    """float64 [N, L, E]: token-expert selections of the requests homed on each node.

    token_request: int [T] request index; expert_ids: int [T, L, K]; request_node: int [Rq] node of each request.
    """
    T, L, K = expert_ids.shape
    node = np.asarray(request_node, np.int64)[token_request]
    flat = ((node[:, None, None] * L + np.arange(L)[None, :, None]) * num_experts + expert_ids.astype(np.int64))
    return np.bincount(flat.ravel(), minlength=num_nodes * L * num_experts).reshape(
        num_nodes, L, num_experts).astype(np.float64)


def replica_load(phy2log: np.ndarray, use: np.ndarray, nodes: int) -> np.ndarray:
    """float [L, P]: expected load of each slot when requests use a replica on their own node if there is one,
    and otherwise spread evenly over the expert's replicas.

    phy2log: int [L, P] (slots node-major: slot p on node p // (P / N)); use: float [N, L, E] traffic by home node.
    """
    local, remote = slot_shares(phy2log, use, nodes)
    return local + remote


def replica_receive(phy2log: np.ndarray, use: np.ndarray, nodes: int) -> np.ndarray:
    """float [L, P]: the part of :func:`replica_load` that arrives from other nodes (pairs of requests homed on a
    node without a replica of the slot's expert): what the slot's GPU receives over inter-node links."""
    return slot_shares(phy2log, use, nodes)[1]


def slot_shares(phy2log: np.ndarray, use: np.ndarray, nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) float [L, P]: each slot's expected pairs from its own node's requests and from other
    nodes' (the replica rule of :func:`replica_load`)."""
    L, P = phy2log.shape
    E = use.shape[2]
    slot_node = np.arange(P) // (P // nodes)
    on = np.zeros((L, nodes, E), bool)
    on[np.arange(L)[:, None], slot_node[None, :], phy2log] = True
    cnt_node = np.zeros((L, nodes, E))  # replicas of e on node n
    np.add.at(cnt_node, (np.arange(L)[:, None], slot_node[None, :], phy2log), 1)
    use_l = use.transpose(1, 0, 2)  # [L, N, E]
    remote = (use_l * ~on).sum(axis=1)  # [L, E] traffic from nodes without a replica
    total_cnt = cnt_node.sum(axis=1)  # [L, E]
    local_share = np.where(cnt_node > 0, use_l / np.maximum(cnt_node, 1), 0.0)  # per replica on node
    li = np.arange(L)[:, None]
    return local_share[li, slot_node[None, :], phy2log], (remote / np.maximum(total_cnt, 1))[li, phy2log]


def place_by_node_affinity(use: np.ndarray, num_slots: int, gpus_per_node: int) -> np.ndarray:
    """Expert placement from per-node use. use: float [N, L, E]; returns phy2log int [L, P].

    Greedy per layer over (expert, node) pairs by decreasing use: an unplaced expert goes to the node if the node
    has a free slot. Then each node's free slots take its most used experts it lacks. Finally each node's slots
    are packed onto its G GPUs by :func:`replica_load` (balanced packing).
    """
    N, L, E = use.shape
    P, G = num_slots, gpus_per_node
    if P % N or P < E:
        raise ValueError(f"place_by_node_affinity: {P} slots do not split over {N} nodes or hold {E} experts")
    per_node = P // N
    node_slots = np.zeros((L, N, per_node), np.int64)
    for layer in range(L):
        u = use[:, layer, :]  # [N, E]
        order = np.argsort(-u, axis=None, kind="stable")
        held = [[] for _ in range(N)]
        placed = np.zeros(E, bool)
        for flat in order:
            n, e = divmod(int(flat), E)
            if not placed[e] and len(held[n]) < per_node:
                held[n].append(e)
                placed[e] = True
        for n in range(N):
            node_slots[layer, n] = fill_node_slots(held[n], u[n], per_node, G)
    phy2log = node_slots.reshape(L, P)
    return pack_by_use(phy2log, use, N, G)


def fill_node_slots(held: list[int], use: np.ndarray, per_node: int, gpus_per_node: int) -> list[int]:
    """A node's full slot list: ``held`` (experts already placed there), then the node's most used experts it
    lacks, then, only when the node has more slots than experts, second (third, ...) copies by decreasing
    ``use / (copies + 1)``, at most one copy per GPU of the node. use: float [E] the node's use of each expert."""
    E = len(use)
    out = list(held)
    copies = np.bincount(np.asarray(out, np.int64), minlength=E) if out else np.zeros(E, np.int64)
    for e in np.argsort(-use, kind="stable"):
        if len(out) >= per_node:
            return out
        if copies[e] == 0:
            out.append(int(e))
            copies[e] += 1
    while len(out) < per_node:
        room = copies < gpus_per_node
        if not room.any():
            raise ValueError(f"a node with {per_node} slots cannot hold them on {gpus_per_node} GPUs without two "
                             f"copies of one expert on a GPU ({E} experts)")
        e = int(np.argmax(np.where(room, use / (copies + 1), -np.inf)))
        out.append(e)
        copies[e] += 1
    return out


def pack_within_nodes(phy2log: np.ndarray, slot_load: np.ndarray, num_nodes: int, gpus_per_node: int
                      ) -> np.ndarray:
    """Reorder each node's slots so its G GPUs get balanced load (and no GPU two replicas of one expert).

    phy2log: int [L, P] node-major; slot_load: float [L, P]. Returns the reordered phy2log [L, P].
    """
    L, P = phy2log.shape
    N, G = num_nodes, gpus_per_node
    per_node = P // N
    S = per_node // G
    w = slot_load.reshape(L * N, per_node)
    key = phy2log.reshape(L * N, per_node)
    pack, rank = balanced_packing(w, G, key=key)
    out = np.empty_like(key)
    np.put_along_axis(out, pack * S + rank, key, axis=1)
    return out.reshape(L, P)


def pack_by_use(phy2log: np.ndarray, use: np.ndarray, num_nodes: int, gpus_per_node: int,
                max_passes: int = 8) -> np.ndarray:
    """Each node's slots onto its G GPUs balancing two things the layer time waits for: the GPU's pairs
    (:func:`replica_load`, expert compute) and the pairs it receives from other nodes (:func:`replica_receive`,
    the busiest GPU's inter-node link). phy2log: int [L, P] node-major; use: float [N, L, E]. Returns phy2log
    [L, P] with the same slots per node (node-level traffic unchanged).

    Starts from the load packing of :func:`pack_within_nodes` and swaps slots between a node's GPUs while that
    lowers ``max_g load / mean + max_g receive / mean`` (ties: the sum of squares of both), never two replicas of
    one expert on a GPU; at most ``max_passes`` passes over the pairs of slots (a work budget, not a clock). A
    node that receives nothing keeps the load packing. Why: a placement that keeps most pairs on their node
    leaves the rest concentrated on the few GPUs holding the experts other nodes want, and the load packing
    does not see that (reference-fg 3x8 decode: the busiest GPU's inter-node traffic 2.0x the mean)."""
    L, P = phy2log.shape
    N, G = num_nodes, gpus_per_node
    per_node = P // N
    S = per_node // G
    local, remote = slot_shares(phy2log, use, N)
    base = pack_within_nodes(phy2log, local + remote, N, G)
    if S < 2 or G < 2:
        return base
    # the shares follow the slots: recompute them for the packed order (same multiset per node)
    local, remote = slot_shares(base, use, N)
    key = np.ascontiguousarray(base.reshape(L * N, G, S))
    a = np.ascontiguousarray((local + remote).reshape(L * N, G, S))
    b = np.ascontiguousarray(remote.reshape(L * N, G, S))
    _swap_two_resources(a, b, key, int(phy2log.max()) + 1 if phy2log.size else 1, int(max_passes))
    return key.reshape(L, P)


@njit(cache=True)
def _swap_two_resources(a, b, key, num_keys, max_passes):  # pragma: no cover - compiled
    """In place, per row x: swap items between packs (a, b, key: [X, G, S]) while ``max(A) / mean(A) +
    max(B) / mean(B)`` falls (A, B: pack sums), ties broken by the sum of squares; keys stay unique per pack."""
    X, G, S = a.shape
    for x in range(X):
        ta = 0.0
        tb = 0.0
        for g in range(G):
            for s in range(S):
                ta += a[x, g, s]
                tb += b[x, g, s]
        if ta <= 0.0 or tb <= 0.0:
            continue
        ma = ta / G
        mb = tb / G
        A = np.zeros(G)
        B = np.zeros(G)
        has = np.zeros((G, num_keys), np.int64)
        for g in range(G):
            for s in range(S):
                A[g] += a[x, g, s] / ma
                B[g] += b[x, g, s] / mb
                has[g, key[x, g, s]] += 1
        cur = A.max() + B.max()
        sq = (A * A).sum() + (B * B).sum()
        for _ in range(max_passes):
            moved = False
            for p in range(G):
                for i in range(S):
                    for q in range(p + 1, G):
                        for j in range(S):
                            ki = key[x, p, i]
                            kj = key[x, q, j]
                            if ki == kj or has[q, ki] > 0 or has[p, kj] > 0:
                                continue
                            da = (a[x, q, j] - a[x, p, i]) / ma
                            db = (b[x, q, j] - b[x, p, i]) / mb
                            nmax_a = da + A[p]
                            nq = A[q] - da
                            nmax_b = db + B[p]
                            nqb = B[q] - db
                            ba = max(nmax_a, nq)
                            bb = max(nmax_b, nqb)
                            for g in range(G):
                                if g != p and g != q:
                                    ba = max(ba, A[g])
                                    bb = max(bb, B[g])
                            new = ba + bb
                            nsq = (sq - A[p] * A[p] - A[q] * A[q] - B[p] * B[p] - B[q] * B[q]
                                   + nmax_a * nmax_a + nq * nq + nmax_b * nmax_b + nqb * nqb)
                            if new < cur - 1e-12 or (new <= cur + 1e-12 and nsq < sq - 1e-12):
                                A[p] = nmax_a
                                A[q] = nq
                                B[p] = nmax_b
                                B[q] = nqb
                                cur = new
                                sq = nsq
                                has[p, ki] -= 1
                                has[q, ki] += 1
                                has[q, kj] -= 1
                                has[p, kj] += 1
                                t = a[x, p, i]
                                a[x, p, i] = a[x, q, j]
                                a[x, q, j] = t
                                t = b[x, p, i]
                                b[x, p, i] = b[x, q, j]
                                b[x, q, j] = t
                                key[x, p, i] = kj
                                key[x, q, j] = ki
                                moved = True
            if not moved:
                break


def pack_by_dispatch(phy2log: np.ndarray, ids: np.ndarray, home: np.ndarray, microbatch: np.ndarray,
                     num_nodes: int, gpus_per_node: int, num_experts: int, max_passes: int = 8,
                     max_rows: int = 1 << 15) -> np.ndarray:
    """Each node's slots onto its G GPUs balancing what the dispatch actually puts on each slot: the pairs it
    serves and the pairs it receives from other nodes, counted by routing ``ids`` int [T, L, K] (home GPU int [T]
    and micro-batch id int [T] of each row, -1: not routed) under the ``balanced`` rule on ``phy2log`` int [L, P]
    node-major (``balanced-links`` starts from its picks; counting its refinement too doubled the cost and moved
    the 3x8 decode cells by under 0.001, scratch runs). The same swap search as :func:`pack_by_use`; returns
    phy2log [L, P] with the same slots per node (node-level traffic unchanged). Beyond ``max_rows`` routed rows,
    every k-th micro-batch is routed (the least k that fits; a work budget, deterministic).

    Why: :func:`pack_by_use` prices a slot by a model (remote use spread evenly over an expert's replicas), but the
    balanced rules send pairs where load is lowest, so the model's slot receive is not the dispatch's; held out,
    the busiest GPU of joint's grouped plans received 1.6x the mean inter-node pairs, almost all of it inside one
    node (reference-fg 3x8 decode, docs/PLANNER.md)."""
    from moeplace.simulate.routing import balanced_gpus, build_route_tables

    L, P = phy2log.shape
    N, G = num_nodes, gpus_per_node
    W = N * G
    S = P // W
    if S < 2 or G < 2:
        return phy2log
    rows = np.flatnonzero(microbatch >= 0)
    if rows.size == 0:
        return phy2log
    if rows.size > max_rows:
        u = np.unique(microbatch[rows])
        rows = rows[np.isin(microbatch[rows], u[::-(-rows.size // max_rows)])]
    rows = rows[np.argsort(microbatch[rows], kind="stable")]
    _, cnt = np.unique(microbatch[rows], return_counts=True)
    starts = np.r_[0, np.cumsum(cnt)].astype(np.int64)
    slot_gpu = np.arange(P) // S
    tab = build_route_tables(phy2log, slot_gpu, np.arange(W) // G, num_experts)
    pick = balanced_gpus(ids, rows, home[rows], starts, tab, "balanced")
    g = pick.astype(np.int64)  # [n, L, K]
    e = ids[rows].astype(np.int64)
    slot_of = np.full((L, W, num_experts), -1, np.int64)
    li = np.broadcast_to(np.arange(L)[:, None], (L, P))
    slot_of[li, np.broadcast_to(slot_gpu, (L, P)), phy2log] = np.broadcast_to(np.arange(P), (L, P))
    lay = np.broadcast_to(np.arange(L)[None, :, None], g.shape)
    slot = slot_of[lay, g, e]
    remote = (g // G) != (home[rows] // G)[:, None, None]
    flat = (lay * P + slot).ravel()
    a = np.bincount(flat, minlength=L * P).astype(np.float64).reshape(L, P)
    b = np.bincount(flat, weights=remote.ravel().astype(np.float64), minlength=L * P).reshape(L, P)
    key = np.ascontiguousarray(phy2log.reshape(L * N, G, S).copy())
    _swap_two_resources(np.ascontiguousarray(a.reshape(L * N, G, S)), np.ascontiguousarray(b.reshape(L * N, G, S)),
                        key, int(phy2log.max()) + 1 if phy2log.size else 1, int(max_passes))
    return key.reshape(L, P)


CLUSTER_BY = ("signal", "usage")


def plan_activation_clusters(work: Workload, cluster: Cluster, num_redundant: int, seed: int = 0,
                             round_size: int = DEFAULT_ROUND, max_fit_requests: int = 4096,
                             cluster_by: str = "signal") -> StrategyResult:
    """Registry adapter: K-means on the window's prefill activations (or, ``cluster_by="usage"``, on what the
    requests go on to use, routed by their mean signal), clusters -> nodes, affinity placement."""
    if cluster_by not in CLUSTER_BY:
        raise ValueError(f"activation-clusters: cluster_by must be one of {CLUSTER_BY}, got {cluster_by!r}")
    P, _S = check_sizes(work.num_layers, work.num_experts, cluster, num_redundant)
    N, G = cluster.num_nodes, cluster.gpus_per_node
    feats = signal_features(work)
    rng = np.random.default_rng(seed)
    pick = None if len(feats) <= max_fit_requests else rng.choice(len(feats), max_fit_requests, False)
    fit = feats if pick is None else feats[pick]
    if len(fit) < N:
        raise ValueError(f"activation-clusters: the planning window has {len(fit)} requests, fewer than {N} nodes")
    if cluster_by == "signal":
        cent, _ = kmeans(fit, N, seed=seed)
        grouper = Grouper(cent, G, round_size, kind="centroids")
    else:
        usage = normalise_rows(work.request_counts("traffic"))
        rows, lam = usage_weights(fit, usage if pick is None else usage[pick], N, seed)
        grouper = Grouper(rows, G, round_size, kind="usage-ridge")
    homes = grouper.assign(feats)
    tr, ids = work.traffic()
    use = node_counts(tr, ids, homes // G, N, work.num_experts)
    phy2log = place_by_node_affinity(use, P, G)
    extra = {"clusters": N, "seed": seed, "round_size": round_size, "cluster_by": cluster_by}
    if cluster_by == "usage":
        extra["ridge_penalty"] = lam
    return StrategyResult(phy2log, homes, grouper, extra)


RIDGE_GRID = (0.1, 1.0, 10.0, 100.0)  # ridge penalties usage_weights chooses from, by 2-fold cross-validation


def _ridge(x: np.ndarray, y: np.ndarray, lams: tuple[float, ...]) -> list[np.ndarray]:
    """float64 [D, C] per penalty: argmin_W |x W - y|^2 + lam |W|^2 for x [R, D], y [R, C] (lam > 0).

    From one symmetric eigendecomposition of the smaller Gram matrix: with R <= D, x x^T = U diag(s2) U^T and
    W = x^T U diag(1 / (s2 + lam)) U^T y (the kernel form); else x^T x = V diag(s2) V^T and
    W = V diag(1 / (s2 + lam)) V^T x^T y. Both equal the thin-SVD solution V diag(s / (s^2 + lam)) U^T y; the
    Gram matrix of a [512, 768] fold takes a tenth of the SVD's time (a sixth of joint's plan at reference-fg 4x8)."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    if x.shape[0] <= x.shape[1]:
        s2, u = np.linalg.eigh(x @ x.T)
        uy = u.T @ y
        return [x.T @ (u @ (uy / (s2 + lam)[:, None])) for lam in lams]
    s2, v = np.linalg.eigh(x.T @ x)
    vxy = v.T @ (x.T @ y)
    return [v @ (vxy / (s2 + lam)[:, None]) for lam in lams]


def usage_weights(signal: np.ndarray, usage: np.ndarray, num_groups: int, seed: int = 0) -> tuple[np.ndarray, float]:
    """(float32 [N, D] grouper rows, the ridge penalty chosen): rows that route by signal towards groups of similar
    usage.

    signal: float [Rq, D] unit rows (what a request is routed by); usage: float [Rq, D'] unit rows (what it then
    uses). The requests are clustered by usage (:func:`moeplace.plan.grouping.capped_kmeans`, 4 seeds from
    ``seed``), and a ridge regression from the signal to the clusters' centred one-hot labels gives the rows
    (a least-squares linear classifier: signal directions that vary without saying anything about usage get small
    weights). Its penalty is the one of :data:`RIDGE_GRID` whose rows label the most requests right in 2-fold
    cross-validation over the requests (alternate requests; ties go to the larger penalty), so nothing is tuned on
    held-out data. Deterministic."""
    groups = capped_kmeans(usage, num_groups, 4, seed)
    x = np.asarray(signal, np.float64)
    y = np.eye(num_groups)[groups] - 1.0 / num_groups
    u = np.asarray(usage, np.float64)
    fold = np.arange(len(x)) % 2
    right = np.zeros(len(RIDGE_GRID))
    for f in (0, 1):
        tr, te = fold != f, fold == f
        cent = normalise_rows(np.stack([u[tr][groups[tr] == n].sum(axis=0) for n in range(num_groups)]))
        cap = np.full(num_groups, -(-int(te.sum()) // num_groups), np.int64)
        for i, w in enumerate(_ridge(x[tr], y[tr], RIDGE_GRID)):
            g = balanced_assign(x[te] @ w, cap)
            right[i] += float(np.sum(u[te] * cent[g]))
    best = max(range(len(RIDGE_GRID)), key=lambda i: (right[i], i))
    lam = RIDGE_GRID[best]
    return _ridge(x, y, (lam,))[0].T.astype(np.float32), lam


def signal_features(work: Workload) -> np.ndarray:
    """float32 [Rq, D]: L2-normalised prefill (signal-row) activation vector of every request of the window."""
    if not work.has_tokens:
        raise ValueError("request grouping needs per-token routing (this input is a bare load matrix)")
    return normalise_rows(work.request_counts("admission"))
