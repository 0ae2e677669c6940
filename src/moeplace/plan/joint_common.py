"""What both objectives of ``joint`` share (:mod:`moeplace.plan.joint` for bytes, :mod:`moeplace.plan.joint_time`
for time): per-GPU use, the node-affinity placement, the grouping features and the grouper's homes for a window.

Shape legend: L = MoE layers, E = logical experts, K = top-k, P = slots, W = GPUs, N = nodes, G = GPUs per node,
T = token rows, Rq = requests, D = L * E.
"""

from __future__ import annotations

import numpy as np

from moeplace.placement.grouper import Grouper, assign_rounds, normalise_rows
from moeplace.plan.activation_clusters import fill_node_slots, pack_by_use
from moeplace.plan.base import Workload, request_expert_counts

MAX_FEATURE_DIM = 4096  # grouping features use evenly spaced layers beyond this many (layer, expert) entries


def use_by_gpu(tok_req: np.ndarray, ids: np.ndarray, homes: np.ndarray, W: int, E: int) -> np.ndarray:
    """float [L, W, E]: traffic pairs by home GPU and expert."""
    T, L, K = ids.shape
    h = homes[tok_req].astype(np.int64)[:, None] * E
    out = np.empty((L, W, E))
    for layer in range(L):  # one layer at a time bounds the temporaries
        out[layer] = np.bincount((h + ids[:, layer, :]).ravel(), minlength=W * E).reshape(W, E)
    return out


def initial_placement(use_node: np.ndarray, num_slots: int, gpus_per_node: int) -> np.ndarray:
    """phy2log int [L, P] from per-node use [N, L, E]: equal primaries per node by affinity, redundant slots to
    each node's most used missing experts, node slots packed onto GPUs by :func:`replica_load`."""
    N, L, E = use_node.shape
    P = num_slots
    per_node = P // N
    prim = -(-E // N)  # primaries per node (ceil); the last nodes may take fewer
    out = np.zeros((L, N, per_node), np.int64)
    for layer in range(L):
        u = use_node[:, layer, :]
        order = np.argsort(-u, axis=None, kind="stable")
        held: list[list[int]] = [[] for _ in range(N)]
        placed = np.zeros(E, bool)
        for flat in order:
            n, e = divmod(int(flat), E)
            if not placed[e] and len(held[n]) < min(prim, per_node):
                held[n].append(e)
                placed[e] = True
        for e in np.flatnonzero(~placed):  # only when primaries cannot split evenly
            n = min(range(N), key=lambda n: (len(held[n]) >= per_node, -u[n, e]))
            held[n].append(int(e))
        out[layer] = np.asarray([fill_node_slots(held[n], u[n], per_node, gpus_per_node) for n in range(N)])
    p2l = out.reshape(L, P)
    return pack_by_use(p2l, use_node, N, gpus_per_node)


def feature_layers(num_layers: int, num_experts: int, max_dim: int = MAX_FEATURE_DIM) -> list[int] | None:
    """MoE layers whose counts form the grouping feature: all (None) when L * E <= max_dim, else evenly spaced."""
    if num_layers * num_experts <= max_dim:
        return None
    n = max(1, max_dim // num_experts)
    return sorted({int(x) for x in np.linspace(0, num_layers - 1, n).round()})


def signal_features(work: Workload, requests: np.ndarray, layers: list[int] | None = None,
                    rows: str = "admission") -> np.ndarray:
    """float32 [n, D]: L2-normalised prefill activation vectors of the given requests (indices into the window),
    over ``layers`` (None: all). ``rows="traffic"``: their activation over the rows after admission (decode)
    instead, what they go on to use (zero for a request without such rows)."""
    if rows not in ("admission", "traffic"):
        raise ValueError(f"rows: expected 'admission' or 'traffic', got {rows!r}")
    pos = np.full(work.num_requests, -1, np.int64)
    pos[requests] = np.arange(len(requests))
    m = (work.admission_rows if rows == "admission" else ~work.admission_rows) & (pos[work.token_request] >= 0)
    ids = work.expert_ids[m] if layers is None else work.expert_ids[m][:, layers, :]
    counts = request_expert_counts(pos[work.token_request[m]], ids, len(requests), work.num_experts)
    return normalise_rows(counts)


def assign_all(grouper: Grouper, work: Workload, chunk: int = 8192) -> np.ndarray:
    """int64 [Rq]: homes of every request of the window from the grouper (features computed in chunks).

    The signal rows are found and sorted by request once, so each chunk reads only its own rows.
    """
    Rq = work.num_requests
    rows = np.flatnonzero(work.admission_rows)
    tr = work.token_request[rows]
    order = np.argsort(tr, kind="stable")
    rows, tr = rows[order], tr[order]
    scores = np.empty((Rq, grouper.num_nodes), np.float32)
    for s in range(0, Rq, chunk):
        e = min(Rq, s + chunk)
        a, b = np.searchsorted(tr, [s, e])
        r = rows[a:b]
        ids = work.expert_ids[r] if grouper.layers is None else work.expert_ids[r[:, None], grouper.layers]
        counts = request_expert_counts(tr[a:b] - s, ids, e - s, work.num_experts)
        scores[s:e] = normalise_rows(counts) @ grouper.weights.T
    return assign_rounds(scores, grouper.gpus_per_node, grouper.round_size)
