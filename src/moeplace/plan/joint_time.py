"""``joint`` with ``objective="time"`` (the default): placement and request grouping chosen by predicted MoE layer
time per micro-batch, never worse than EPLB on the planning window.

Shape legend: L = MoE layers, E = logical experts, K = top-k, P = slots, W = GPUs, N = nodes, G = GPUs per node,
T = token rows, Rq = requests, C = candidate placements, F = folds (2).

Objective: the simulator's kernel time model (:func:`moeplace.simulate.simulator.simulate_rows`): dispatch +
expert compute + combine per micro-batch and layer, the max over GPUs inside each micro-batch, summed over the
window's prefill and decode micro-batches as serving forms them (:func:`moeplace.simulate.batching.
window_microbatches`, requests in a seeded mixed arrival order). The layer time decomposes by layer, so a plan can
take each layer's placement from a different candidate.

1. Homes: round-robin (what engines do) and the grouper's homes (K-means of the requests' admission activations,
   one cluster per node, admitted in balanced rounds; :mod:`moeplace.plan.grouping`).
2. Candidates per layer: EPLB's placement (the baseline users run), the node-affinity placement (each expert's
   primary on the node that uses it most, spare slots to each node's most used missing experts), and the
   node-affinity placement with EPLB's replica counts (EPLB decides how many replicas an expert gets, affinity
   decides on which nodes they go), each packed onto GPUs by load.
3. Robust choice by cross-validation: the planning requests are split into two folds (seeded). The grouper and
   every candidate are built on one fold and scored on the other (its own micro-batches, prefill and decode
   apart), both ways: out of sample, as a plan meets new requests. A layer's candidate is the one with the
   smallest worst ratio to EPLB (with round-robin homes) over (fold, phase); the grouped plan is kept only if it
   beats EPLB out of sample on both folds in both phases, else the plan is EPLB's (``fallback`` says so). The
   kept choices are rebuilt on the whole window. A plan that fits its own window but not the next one (grouping
   that concentrates load, replicas placed for this window's hot experts) is refused.

Everything is a function of (window, parameters, seed): no wall clock, no sampling beyond the seeded folds.
"""

from __future__ import annotations

import numpy as np

from moeplace.placement import Cluster, CostModel, Fallback
from moeplace.placement.grouper import DEFAULT_ROUND, Grouper
from moeplace.plan.activation_clusters import fill_node_slots, pack_within_nodes, replica_load
from moeplace.plan.base import StrategyResult, Workload, check_sizes, load_from_tokens
from moeplace.plan.grouping import kmeans
from moeplace.plan.joint_common import assign_all, feature_layers, initial_placement, signal_features, use_by_gpu
from moeplace.simulate.batching import BatchConfig, window_microbatches
from moeplace.simulate.cost import CostConfig
from moeplace.simulate.routing import DEFAULT_RULE
from moeplace.simulate.simulator import simulate_rows

DEFAULT_HIDDEN = 4096  # elements per token vector when the window does not say (a trace's metadata usually does)
MAX_EVAL_REQUESTS = 2048  # requests the candidates are scored on (the grouper still homes every request)


def affinity_with_counts(use_node: np.ndarray, replica_count: np.ndarray, num_slots: int,
                         gpus_per_node: int) -> np.ndarray:
    """phy2log int [L, P]: ``replica_count`` [L, E] copies of every expert, each copy on the node that uses the
    expert most among those with room (at most one copy per GPU of a node), then packed onto GPUs by load.

    use_node: float [N, L, E] pairs by the node of the token's home. The copies of an expert are handed out in
    order of decreasing per-copy use (use / copies), so the most used (node, expert) pairs are served locally.
    """
    N, L, E = use_node.shape
    P, G = num_slots, gpus_per_node
    per_node = P // N
    out = np.zeros((L, N, per_node), np.int64)
    for layer in range(L):
        u = use_node[:, layer, :]  # [N, E]
        cnt = np.asarray(replica_count[layer], np.int64)
        held: list[list[int]] = [[] for _ in range(N)]
        on = np.zeros((N, E), np.int64)
        left = cnt.copy()
        # (node, expert) pairs by decreasing use per copy, ties by node then expert (deterministic)
        score = u / np.maximum(cnt, 1)[None, :]
        for flat in np.argsort(-score, axis=None, kind="stable"):
            n, e = divmod(int(flat), E)
            if left[e] > 0 and len(held[n]) < per_node and on[n, e] < G:
                held[n].append(e)
                on[n, e] += 1
                left[e] -= 1
        for e in np.flatnonzero(left > 0):  # copies no node with room wanted: any node with room, if one can
            for _ in range(int(left[e])):  # take it (else the slot goes to fill_node_slots below)
                room = [n for n in range(N) if len(held[n]) < per_node and on[n, e] < G]
                if room:
                    n = min(room, key=lambda n: (len(held[n]), n))
                    held[n].append(int(e))
                    on[n, e] += 1
        for n in range(N):
            out[layer, n] = fill_node_slots(held[n], u[n], per_node, G)
    p2l = out.reshape(L, P)
    return pack_within_nodes(p2l, replica_load(p2l, use_node, N), N, G)


def node_use(token_request: np.ndarray, ids: np.ndarray, homes: np.ndarray, num_nodes: int, gpus_per_node: int,
             num_experts: int) -> np.ndarray:
    """float [N, L, E]: pairs by the node of the row's home, per layer and expert (joint's per-GPU use summed
    over each node's GPUs). ids: int [T, L, K]."""
    L = ids.shape[1]
    use = use_by_gpu(token_request, ids, homes, num_nodes * gpus_per_node, num_experts)  # [L, W, E]
    return use.reshape(L, num_nodes, gpus_per_node, num_experts).sum(axis=2).transpose(1, 0, 2)


def window_layer_time(work: Workload, requests: np.ndarray, homes: np.ndarray, phy2log: np.ndarray,
                      cluster: Cluster, cost: CostConfig, batching: BatchConfig, arrival_seed: int,
                      rule: str) -> np.ndarray:
    """float [2, L]: predicted layer time (seconds) summed over the prefill (row 0) and the decode (row 1)
    micro-batches of ``requests`` (indices into the window), in a seeded mixed arrival order. homes: int [Rq] home
    GPU of every request."""
    sel = np.isin(work.token_request, requests)
    idx = np.full(work.num_requests, -1, np.int64)
    idx[requests] = np.arange(len(requests))
    tr = idx[work.token_request[sel]]
    ids = work.expert_ids[sel]
    # prefill: the prompt's rows; decode: the other rows, less a decode-only request's stand-in admission rows
    pre = (work.prefill_rows if work.prefill_rows is not None else work.admission_rows)[sel]
    dec = ~work.admission_rows[sel] & ~pre
    arrival = np.random.default_rng([arrival_seed, 7]).permutation(len(requests))
    mb = window_microbatches(tr, pre, arrival, batching)
    h = homes[requests][tr]
    total = np.zeros((2, work.num_layers))
    for i, (phase, m) in enumerate((("prefill", pre), ("decode", dec))):
        if m.any():
            _, met = simulate_rows(ids[m], h[m], mb[m], phase, phy2log, cluster, cost, model=work.model,
                                   rule=rule, num_experts=work.num_experts)
            total[i] = met["layer_time"].sum(0)
    return total


def candidate_placements(work: Workload, requests: np.ndarray, homes: np.ndarray, cluster: Cluster,
                         num_slots: int) -> dict[str, np.ndarray]:
    """The candidate placements (phy2log [L, P] each) built from the rows of ``requests`` (indices into the window)
    with request homes [Rq]: EPLB on their load, node affinity, node affinity with EPLB's replica counts."""
    from moeplace.placement import replica_counts
    from moeplace.plan.eplb import rebalance

    N, G, W, E = cluster.num_nodes, cluster.gpus_per_node, cluster.world_size, work.num_experts
    sel = np.isin(work.token_request, requests)
    tr, ids = work.token_request[sel], work.expert_ids[sel]
    traffic = ~work.admission_rows[sel]
    eplb = rebalance(load_from_tokens(ids[traffic], E), num_slots, 1, N, W)
    use_n = node_use(tr, ids, homes, N, G, E)  # prefill and decode rows
    return {"eplb": eplb, "affinity": initial_placement(use_n, num_slots, G),
            "affinity+eplb-replicas": affinity_with_counts(use_n, replica_counts(eplb, E), num_slots, G)}


def plan_joint_time(work: Workload, cluster: Cluster, num_redundant: int, seed: int = 0,
                    round_size: int = DEFAULT_ROUND, hidden_size: int | None = None, dispatch_bytes: float = 1.0,
                    combine_bytes: float = 2.0, mode: str = "auto", rule: str = DEFAULT_RULE, overlap: bool = False,
                    decode_batch: int = 256, prefill_tokens: int = 8192,
                    max_eval_requests: int = MAX_EVAL_REQUESTS) -> StrategyResult:
    """The time objective (see the module docstring), priced with the deployment's time model (hidden_size:
    default the window's, else 4096; element bytes, kernel mode, overlap, replica rule, batch sizes); the plan's
    ``cost_model`` records all of them."""
    from moeplace.plan.eplb import rebalance

    P, _ = check_sizes(work.num_layers, work.num_experts, cluster, num_redundant)
    N, G, W, E, L = cluster.num_nodes, cluster.gpus_per_node, cluster.world_size, work.num_experts, work.num_layers
    Rq = work.num_requests
    hidden = int(hidden_size or work.hidden_size or DEFAULT_HIDDEN)
    cost = CostConfig(hidden_size=hidden, dispatch_bytes=dispatch_bytes, combine_bytes=combine_bytes, mode=mode,
                      overlap=overlap)
    batching = BatchConfig(decode_batch=decode_batch, prefill_tokens=prefill_tokens)
    cm = CostModel(objective="layer_time", rule=rule, dedup=mode, hidden_size=hidden,
                   dispatch_bytes=cost.dispatch_bytes, combine_bytes=cost.combine_bytes, overlap=overlap,
                   decode_batch=decode_batch, prefill_tokens=prefill_tokens)
    if Rq < 4 * N:  # too few requests to build on one half and check on the other
        reason = f"the planning window has {Rq} requests, fewer than 4 per node ({N} nodes): used EPLB's placement"
        return StrategyResult(rebalance(work.load, P, 1, N, W), np.arange(Rq) % W, None, {"objective": "time"},
                              fallback=Fallback("eplb", reason), cost_model=cm)
    rng = np.random.default_rng(seed)
    ev = np.sort(rng.choice(Rq, max_eval_requests, replace=False)) if Rq > max_eval_requests else np.arange(Rq)
    perm = rng.permutation(len(ev))
    folds = [np.sort(ev[perm[: len(ev) // 2]]), np.sort(ev[perm[len(ev) // 2:]])]
    flayers = feature_layers(L, E)
    rr = np.arange(Rq) % W  # round-robin homes, as engines place requests

    def grouping(train: np.ndarray) -> tuple[Grouper, np.ndarray]:
        """A grouper fitted on ``train`` (K-means of admission activations, one cluster per node) and the homes
        it gives every request of the window (each request admitted in balanced rounds)."""
        cent, _ = kmeans(signal_features(work, train, flayers), N, seed=seed)
        g = Grouper(cent, G, round_size, kind="centroids", layers=flayers)
        return g, assign_all(g, work)  # features in chunks: bounded memory on 100k-request windows

    def times(p2l: np.ndarray, homes: np.ndarray, test: np.ndarray) -> np.ndarray:  # [2 (phase), L]
        return window_layer_time(work, test, homes, p2l, cluster, cost, batching, seed, rule)

    # cross-validation: build on one fold, score on the other, both ways
    names: list[str] = []
    cv: dict[str, list[np.ndarray]] = {}
    base: list[np.ndarray] = []
    for f in range(2):
        train, test = folds[1 - f], folds[f]
        _, homes = grouping(train)
        cands = candidate_placements(work, train, homes, cluster, P)
        names = list(cands)
        base.append(times(cands["eplb"], rr, test))  # EPLB as users run it: its placement, round-robin homes
        for n, p2l in cands.items():
            cv.setdefault(n, []).append(times(p2l, homes, test))
    B = np.concatenate(base)  # [F * 2 (fold, phase), L]
    has = B.sum(1) > 0  # (fold, phase) rows with micro-batches
    T = {n: np.concatenate(v) for n, v in cv.items()}
    ratio = np.stack([(T[n][has] / np.maximum(B[has], 1e-30)).max(axis=0) for n in names])  # [C, L] worst case
    pick = ratio.argmin(axis=0)
    chosen = np.stack([T[names[c]][:, layer] for layer, c in enumerate(pick)], axis=1)  # [F * 2, L]
    cv_ratio = chosen.sum(1)[has] / B.sum(1)[has]
    extra = {"objective": "time", "seed": seed, "mode": mode, "rule": rule, "hidden_size": hidden,
             "eval_requests": int(len(ev)), "layer_choice": [names[c] for c in pick],
             "cv_time_vs_eplb": [float(x) for x in cv_ratio]}
    if (cv_ratio < 1.0).all():
        grouper, homes = grouping(ev)
        full = candidate_placements(work, ev, homes, cluster, P)
        p2l = np.stack([full[names[c]][layer] for layer, c in enumerate(pick)])
        return StrategyResult(p2l, homes, grouper, extra, cost_model=cm)
    reason = (f"no grouped plan beat EPLB out of sample (built on one half of the planning window, scored on the "
              f"other, both ways, prefill and decode: time ratios {', '.join(f'{x:.3f}' for x in cv_ratio)}); "
              "used EPLB's placement with round-robin homes")
    return StrategyResult(rebalance(work.load, P, 1, N, W), rr, None, extra, fallback=Fallback("eplb", reason),
                          cost_model=cm)
