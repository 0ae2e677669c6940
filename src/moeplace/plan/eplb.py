"""DeepSeek's Expert Parallelism Load Balancer (EPLB), re-expressed in numpy and vectorised across layers.

Shape legend: L = MoE layers, E = logical experts, P = physical slots, W = GPUs, N = nodes, X = rows of a batch
of independent problems (layers, or layers x nodes).

Semantics follow github.com/deepseek-ai/EPLB (``rebalance_experts``): plan from load alone.

1. *Hierarchical* policy (when the expert groups divide evenly among nodes): pack expert groups onto nodes with
   balanced packing, replicate experts inside each node, then pack the node's physical experts onto its GPUs.
2. *Global* policy (otherwise): replicate over all experts, then pack all physical experts onto all GPUs.

Replication repeatedly gives one more replica to the expert with the largest load per replica. Balanced packing
puts items, heaviest first, into the lightest pack that still has room, so that every pack gets exactly the same
number of items.

Difference from the original: a pack never receives two replicas of one logical expert (the original can put two
replicas of a hot expert on one GPU, which wastes a slot and balances nothing). Replica counts are capped at the
number of packs that could hold them, the packing skips packs that already hold the expert, and a repair pass
swaps items if the greedy order ever leaves no such pack.

Example (EPLB's README): 2 layers x 12 experts, 16 slots, 4 groups, 2 nodes, 8 GPUs -> hierarchical policy.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moeplace.placement import Cluster
from moeplace.plan.base import StrategyResult, Workload, check_sizes
from moeplace.plan.registry import DEFAULT_EPLB_PACKING


def balanced_packing(weight: np.ndarray, num_packs: int, key: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Pack the n items of each row into ``num_packs`` packs of exactly n / num_packs items, balancing pack weight.

    weight: float [X, n] item weights; key: optional int [X, n], items with equal key never share a pack (a
    logical expert id). Returns (pack [X, n], rank [X, n]): each item's pack and its position inside the pack.
    Greedy: items by decreasing weight, each into the lightest pack with room (and without the same key).
    """
    weight = np.asarray(weight, np.float64)
    X, n = weight.shape
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"balanced_packing: {n} items cannot fill {num_packs} packs equally")
    per = n // num_packs
    if per == 1 and key is None:
        ar = np.broadcast_to(np.arange(n), (X, n)).copy()
        return ar, np.zeros((X, n), np.int64)
    order = np.argsort(-weight, axis=1, kind="stable")  # [X, n]
    pack = np.full((X, n), -1, np.int64)
    rank = np.full((X, n), -1, np.int64)
    if key is not None:
        key = np.asarray(key, np.int64)
    kk = np.zeros((X, n), np.int64) if key is None else np.ascontiguousarray(key)
    _pack_rows(np.ascontiguousarray(weight), order, kk, key is not None, num_packs, per, pack, rank)
    if key is not None:
        _repair_duplicates(weight, key, pack, rank)
    return pack, rank


@njit(cache=True)
def _pack_rows(weight, order, key, use_key, num_packs, per, pack, rank):
    """The greedy of :func:`balanced_packing` on every row; pack, rank filled in place. Per row, items in ``order``
    each go to the lightest pack with room that does not hold their key (lowest index on ties); when every pack
    with room holds it, to the lightest pack with room (the caller repairs those rows)."""
    X, n = weight.shape
    nk = np.int64(1)
    if use_key:
        for x in range(X):
            for i in range(n):
                nk = max(nk, key[x, i] + 1)
    for x in range(X):
        pw = np.zeros(num_packs)
        pn = np.zeros(num_packs, np.int64)
        has = np.zeros((num_packs, nk), np.bool_)
        for j in range(n):
            item = order[x, j]
            k = key[x, item]
            best, best_free = -1, -1
            for q in range(num_packs):
                if pn[q] >= per:
                    continue
                if best < 0 or pw[q] < pw[best]:
                    best = q
                if use_key and not has[q, k] and (best_free < 0 or pw[q] < pw[best_free]):
                    best_free = q
            q = best_free if use_key and best_free >= 0 else best
            pack[x, item] = q
            rank[x, item] = pn[q]
            pw[q] += weight[x, item]
            pn[q] += 1
            if use_key:
                has[q, k] = True


@njit(cache=True)
def _refine_rows(weight, key, pack, rank, num_packs):
    """Swap local search on every row (see :func:`refine_packing`); pack, rank updated in place."""
    X, n = weight.shape
    nk = np.int64(0)
    for x in range(X):
        for i in range(n):
            nk = max(nk, key[x, i] + 1)
    for x in range(X):
        pw = np.zeros(num_packs)
        has = np.zeros((num_packs, nk), np.int64)
        for i in range(n):
            pw[pack[x, i]] += weight[x, i]
            has[pack[x, i], key[x, i]] += 1
        for _ in range(n * n):
            top = pw.max()
            moved = False
            for p in range(num_packs):
                if pw[p] < top:
                    continue
                best_i, best_j, best_v = -1, -1, pw[p] - 1e-12 * max(1.0, abs(pw[p]))
                for i in range(n):
                    if pack[x, i] != p:
                        continue
                    for j in range(n):
                        q = pack[x, j]
                        d = weight[x, i] - weight[x, j]
                        if q == p or d <= 0:
                            continue
                        if key[x, i] != key[x, j] and (has[q, key[x, i]] > 0 or has[p, key[x, j]] > 0):
                            continue  # the swap would put two replicas of one expert on one GPU
                        v = max(pw[p] - d, pw[q] + d)
                        if v < best_v:
                            best_i, best_j, best_v = i, j, v
                if best_i >= 0:
                    i, j = best_i, best_j
                    q = pack[x, j]
                    d = weight[x, i] - weight[x, j]
                    pw[p] -= d
                    pw[q] += d
                    has[p, key[x, i]] -= 1
                    has[q, key[x, i]] += 1
                    has[q, key[x, j]] -= 1
                    has[p, key[x, j]] += 1
                    pack[x, i], pack[x, j] = q, p
                    rank[x, i], rank[x, j] = rank[x, j], rank[x, i]
                    moved = True
                    break
            if not moved:
                break


def refine_packing(weight: np.ndarray, pack: np.ndarray, rank: np.ndarray, num_packs: int,
                   key: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Lower the heaviest pack of a balanced packing by swapping items between packs (a local search).

    weight: float [X, n]; pack, rank: int [X, n] from :func:`balanced_packing`; key: optional int [X, n], items
    with equal key never share a pack (twin-free; kept by every swap). Returns new (pack, rank): pack sizes are
    unchanged. Each step takes a heaviest pack p (lowest index first) and the swap of one of its items with a
    lighter item of another pack q that minimises max(new weight of p, new weight of q), if that is below p's
    weight (ties: lowest item indices); it stops when no heaviest pack has such a swap. A step never raises any
    pack above the old maximum, so the max pack weight never rises: the result is never worse than its input.
    """
    w = np.ascontiguousarray(weight, np.float64)
    X, n = w.shape
    k = np.broadcast_to(np.arange(n), (X, n)) if key is None else np.asarray(key, np.int64)
    pk, rk = np.array(pack, np.int64), np.array(rank, np.int64)
    if n and num_packs > 1:
        _refine_rows(w, np.ascontiguousarray(k, np.int64), pk, rk, int(num_packs))
    return pk, rk


def _repair_duplicates(weight: np.ndarray, key: np.ndarray, pack: np.ndarray, rank: np.ndarray) -> None:
    """Swap items so no pack holds two items with one key (rows where the greedy got stuck; rare). In place."""
    X, n = weight.shape
    for x in range(X):
        for _ in range(n):
            pk = pack[x] * (key[x].max() + 1) + key[x]
            u, c = np.unique(pk, return_counts=True)
            if (c == 1).all():
                break
            dup_code = u[np.argmax(c > 1)]
            i = int(np.flatnonzero(pk == dup_code)[-1])  # the lighter of the two (heaviest-first order)
            p, k = int(pack[x, i]), int(key[x, i])
            best, best_cost = -1, np.inf
            for j in range(n):
                q, kj = int(pack[x, j]), int(key[x, j])
                if q == p or kj == k:
                    continue
                keys_q = key[x, pack[x] == q]
                keys_p = key[x, pack[x] == p]
                if k in keys_q or kj in keys_p:
                    continue
                cst = abs(weight[x, i] - weight[x, j])
                if cst < best_cost:
                    best, best_cost = j, cst
            if best < 0:
                return  # infeasible; Placement validation will report the duplicate
            pack[x, i], pack[x, best] = pack[x, best], pack[x, i]
            rank[x, i], rank[x, best] = rank[x, best], rank[x, i]


def replicate_experts(weight: np.ndarray, num_phy: int, max_replicas: int | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give ``num_phy - n`` extra replicas, one at a time, to the expert with the largest load per replica.

    weight: float [X, n]; ``max_replicas`` caps the replicas of one expert (the number of packs, so that no two
    replicas need to share one). Returns (phy2log [X, num_phy], rank [X, num_phy], count [X, n]); the first n
    physical experts are the logical ones in order.
    """
    weight = np.asarray(weight, np.float64)
    X, n = weight.shape
    extra = num_phy - n
    if extra < 0:
        raise ValueError(f"replicate_experts: {num_phy} physical experts cannot hold {n} logical ones")
    if max_replicas is not None and n * max_replicas < num_phy:
        raise ValueError(f"replicate_experts: {num_phy} slots need more than {max_replicas} replicas per expert")
    rows = np.arange(X)
    phy2log = np.concatenate([np.broadcast_to(np.arange(n), (X, n)), np.zeros((X, extra), np.int64)], axis=1)
    rank = np.zeros((X, num_phy), np.int64)
    cnt = np.ones((X, n), np.int64)
    for i in range(n, num_phy):
        score = weight / cnt
        if max_replicas is not None:
            score = np.where(cnt >= max_replicas, -np.inf, score)
        e = np.argmax(score, axis=1)
        phy2log[:, i] = e
        rank[:, i] = cnt[rows, e]
        cnt[rows, e] += 1
    return phy2log.astype(np.int64), rank, cnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    """Row-wise inverse of permutations [X, n]."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def rebalance_hierarchical(load: np.ndarray, num_slots: int, num_groups: int, num_nodes: int,
                           num_gpus: int, refine: bool = True, max_replicas: int | None = None) -> np.ndarray:
    """EPLB's hierarchical policy. load: float [L, E]. Returns phy2log int [L, P] (P = num_slots).

    Expert groups (``num_groups`` contiguous blocks of E / num_groups experts) are packed onto nodes, experts are
    replicated inside each node, and each node's physical experts are packed onto its GPUs; ``refine`` follows
    that last, greedy packing with :func:`refine_packing` (never a heavier GPU; off: EPLB's answer exactly).
    ``max_replicas``: replicas of one expert at most (None: the GPUs of a node, so that no two share a GPU; a
    lower cap spreads the redundant slots over more experts).
    """
    load = np.asarray(load, np.float64)
    L, E = load.shape
    N, W, P = num_nodes, num_gpus, num_slots
    if E % num_groups or num_groups % N or W % N or P % W or P % N:
        raise ValueError(f"hierarchical EPLB: need E={E} divisible by groups={num_groups}, groups by nodes={N}, "
                         f"GPUs={W} by nodes and slots={P} by GPUs")
    gsize, G, S = E // num_groups, W // N, P // W
    cap = G if max_replicas is None else int(max_replicas)
    if not 1 <= cap <= G:
        raise ValueError(f"EPLB: max_replicas must be in [1, {G}] (GPUs per node: two replicas of one expert never "
                         f"share a GPU), got {max_replicas}")
    en, pn = E // N, P // N  # logical experts and slots per node
    # 1. groups -> nodes
    group_load = load.reshape(L, num_groups, gsize).sum(axis=2)
    gpack, grank = balanced_packing(group_load, N)
    groups_per_node = num_groups // N
    # node-major order of logical experts: m = (node * groups_per_node + rank) * gsize + offset
    log2m = ((gpack * groups_per_node + grank) * gsize)[:, :, None] + np.arange(gsize)
    log2m = log2m.reshape(L, E)
    m2log = _inverse(log2m)
    # 2. replicate inside each node: rows are (layer, node)
    w_m = np.take_along_axis(load, m2log, axis=1).reshape(L * N, en)
    phy2m, _, mcnt = replicate_experts(w_m, pn, max_replicas=cap)
    # 3. pack each node's physical experts onto its G GPUs
    w_phy = np.take_along_axis(w_m / mcnt, phy2m, axis=1)
    pack, rank = balanced_packing(w_phy, G, key=phy2m)
    if refine:
        pack, rank = refine_packing(w_phy, pack, rank, G, key=phy2m)
    pos = pack * S + rank  # slot inside the node of each physical expert
    slot2m = np.empty_like(phy2m)
    np.put_along_axis(slot2m, pos, phy2m, axis=1)
    slot2m = (slot2m.reshape(L, N, pn) + (np.arange(N) * en)[None, :, None]).reshape(L, P)
    return np.take_along_axis(m2log, slot2m, axis=1)


def rebalance(load: np.ndarray, num_slots: int, num_groups: int, num_nodes: int, num_gpus: int,
              refine: bool = True, max_replicas: int | None = None) -> np.ndarray:
    """EPLB entry point: hierarchical policy when ``num_groups % num_nodes == 0``, else the global policy.

    load: float [L, E] per-expert load; returns phy2log int [L, P] with P = num_slots (a multiple of num_gpus).
    refine: swap local search after the greedy GPU packing (:func:`refine_packing`; never worse on the load it
    plans from). max_replicas: replicas of one expert at most (None: the GPUs it may spread over).
    """
    load = np.asarray(load, np.float64)
    if load.ndim != 2:
        raise ValueError(f"load: expected shape [L, E], got {load.shape}")
    E = load.shape[1]
    if num_groups >= 1 and num_groups % num_nodes == 0 and E % num_groups == 0:
        return rebalance_hierarchical(load, num_slots, num_groups, num_nodes, num_gpus, refine, max_replicas)
    return rebalance_hierarchical(load, num_slots, 1, 1, num_gpus, refine, max_replicas)


def plan_eplb(work: Workload, cluster: Cluster, num_redundant: int, num_groups: int = 1,
              packing: str = DEFAULT_EPLB_PACKING) -> StrategyResult:
    """Registry adapter: EPLB from the window's load [L, E]. ``num_groups``: the model's expert groups
    (DeepSeek-V3: 8); the default 1 selects the global policy unless the cluster has one node. ``packing``:
    ``greedy`` (EPLB's greedy, twin-free; the default, as good as the engines' on the next window under a workload
    change) or ``refined`` (then :func:`refine_packing`: better on a stationary next window, worse after a
    change: docs/PLANNER.md, "EPLB chosen for the next window")."""
    if packing not in ("greedy", "refined"):
        raise ValueError(f"packing must be greedy or refined, got {packing!r}")
    P, _S = check_sizes(work.num_layers, work.num_experts, cluster, num_redundant)
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    if work.num_experts % num_groups:  # expert groups are equal blocks: a count that does not divide E is a mistake
        raise ValueError(f"num_groups={num_groups} (--groups) does not divide the {work.num_experts} experts (expert "
                         "groups are equal contiguous blocks, e.g. DeepSeek-V3's 8 groups of 32)")
    phy2log = rebalance(work.load, P, num_groups, cluster.num_nodes, cluster.world_size, refine=packing == "refined")
    policy = "hierarchical" if num_groups % cluster.num_nodes == 0 and work.num_experts % num_groups == 0 \
        else "global"
    return StrategyResult(phy2log, extra={"num_groups": num_groups, "policy": policy, "packing": packing})
