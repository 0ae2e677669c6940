"""``activation-clusters``: the published workload-aware method (Bambhaniya et al., arXiv 2604.23150).

Shape legend: L = MoE layers, E = logical experts, P = slots, N = nodes, G = GPUs per node, W = N * G,
Rq = requests, T = token rows, D = L * E.

1. K-means (k = N) over L2-normalised per-request expert-activation vectors (prefill routing), one cluster per node.
2. Requests are routed to their cluster's node by their prefill activations (nearest centroid, under a per-GPU
   capacity so batches stay balanced; see grouping.py).
3. Per layer, each expert goes to the node whose requests use it most, under a per-node capacity of P / N slots
   (greedy over (expert, node) pairs by decreasing use). Leftover slots of a node (the redundant ones) take the
   node's most used experts it does not hold yet. Inside a node, slots are packed onto GPUs by estimated load.
"""

from __future__ import annotations

import numpy as np

from moeplace.placement import Cluster
from moeplace.placement.grouper import DEFAULT_ROUND, Grouper, normalise_rows
from moeplace.plan.base import StrategyResult, Workload, check_sizes
from moeplace.plan.eplb import balanced_packing
from moeplace.plan.grouping import kmeans


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
    return local_share[li, slot_node[None, :], phy2log] + (remote / np.maximum(total_cnt, 1))[li, phy2log]


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
    return pack_within_nodes(phy2log, replica_load(phy2log, use, N), N, G)


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


def plan_activation_clusters(work: Workload, cluster: Cluster, num_redundant: int, seed: int = 0,
                             round_size: int = DEFAULT_ROUND, max_fit_requests: int = 4096) -> StrategyResult:
    """Registry adapter: K-means on the window's prefill activations, clusters -> nodes, affinity placement."""
    P, _S = check_sizes(work.num_layers, work.num_experts, cluster, num_redundant)
    N, G = cluster.num_nodes, cluster.gpus_per_node
    feats = signal_features(work)
    rng = np.random.default_rng(seed)
    fit = feats if len(feats) <= max_fit_requests else feats[rng.choice(len(feats), max_fit_requests, False)]
    if len(fit) < N:
        raise ValueError(f"activation-clusters: the planning window has {len(fit)} requests, fewer than {N} nodes")
    cent, _ = kmeans(fit, N, seed=seed)
    grouper = Grouper(cent, G, round_size, kind="centroids")
    homes = grouper.assign(feats)
    tr, ids = work.traffic()
    use = node_counts(tr, ids, homes // G, N, work.num_experts)
    phy2log = place_by_node_affinity(use, P, G)
    return StrategyResult(phy2log, homes, grouper, {"clusters": N, "seed": seed, "round_size": round_size})


def signal_features(work: Workload) -> np.ndarray:
    """float32 [Rq, D]: L2-normalised prefill (signal-row) activation vector of every request of the window."""
    if not work.has_tokens:
        raise ValueError("request grouping needs per-token routing (this input is a bare load matrix)")
    return normalise_rows(work.request_counts("admission"))
