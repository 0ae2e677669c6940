"""``joint`` (ours): placement, replication and request grouping optimised together for inter-node bytes, subject
to a balancedness floor.

Shape legend: L = MoE layers, E = logical experts, K = top-k, P = slots, W = GPUs, N = nodes, G = GPUs per node,
S = P / W, T = token rows (a sample of the window's traffic), Rq = requests, D = L * E.

Objective: inter-node sends under per-GPU dedup (a token sends its hidden vector once to every GPU on another node
that serves one of its experts), counted exactly on a sample of the planning window's traffic rows with the
simulator's replica tiers (own GPU, else own node, else any replica; ties by the static rule ``home % tier``).
Constraint: every layer's GPU load max <= mean / floor (load of the whole window's traffic, same replica rule).

Alternation (``iters`` rounds, the best round kept):

1. homes: K-means clusters of the requests' prefill activations, one per node (first round), then the node that
   minimises each request's own inter-node sends under the current placement, under equal node capacities;
   a :class:`~moeplace.plan.grouping.Grouper` is fitted to those labels from prefill routing alone, and the
   planning window gets the grouper's homes (what new requests will get online, so the placement is planned for
   the grouping that will really happen).
2. placement given homes, per layer: each expert's primary slot on the node that uses it most (equal primaries per
   node), the redundant slots to the experts each node uses most among those it lacks (a replica on the node
   cuts that node's traffic and splits the expert's load), node slots packed onto GPUs by load; then a local
   search over slot swaps and replica re-targeting that accepts a move when it lowers
   ``sends + penalty * overflow`` (overflow = load above the cap), sends counted exactly on the sample by
   :mod:`moeplace.simulate.routing`. The search budget counts evaluated moves (``search_evals``), never seconds,
   so the same inputs and seed give the same plan on any machine at any load. The cap
   applies to each GPU's load plus ``robust * sqrt(F) * std`` of its load over F random request folds (how much
   the load moves on another window of requests), so the balance holds on unseen request mixes too.
3. The final plan is replayed by the simulator on the planning window (its default least-loaded replica rule);
   if balancedness falls below the floor, the search reruns with the simulator's per-GPU load correction and a
   tighter cap; if it still misses the floor, EPLB's placement (with the same homes) is used when it balances
   better, and the plan's ``fallback`` field says so.
"""

from __future__ import annotations

import time

import numpy as np

from moeplace.placement import Cluster
from moeplace.placement.grouper import DEFAULT_ROUND, Grouper, balanced_assign
from moeplace.plan.base import StrategyResult, Workload, check_sizes
from moeplace.plan.grouping import kmeans
from moeplace.plan.joint_common import assign_all, feature_layers, initial_placement, signal_features, use_by_gpu
from moeplace.plan.joint_time import plan_joint_time
from moeplace.plan.registry import DEFAULT_BALANCE_FLOOR, DEFAULT_SEARCH_EVALS, PENALTY
from moeplace.simulate import routing
from moeplace.simulate.batching import BatchConfig, window_microbatches
from moeplace.simulate.routing import mean_balancedness
from moeplace.simulate.simulator import route_load

MAX_FOLD_CELLS = 1 << 17  # folds * W * E per layer at most (fold loads of the robust balance term)


# --------------------------------------------------------------------------------------------------- replica rule


def serve_table(phy2log_l: np.ndarray, cluster: Cluster, num_experts: int) -> np.ndarray:
    """int [W, E]: GPU serving expert e for a token homed on GPU h (the simulator's nearest-static rule).

    phy2log_l: int [P] one layer. A view of :meth:`moeplace.simulate.routing.RouteTables.serve_table`.
    """
    W = cluster.world_size
    slot_gpu = np.arange(len(phy2log_l)) // (len(phy2log_l) // W)
    tab = routing.build_route_tables(phy2log_l[None, :], slot_gpu, np.arange(W) // cluster.gpus_per_node,
                                     num_experts)
    return tab.serve_table(0)


def inter_node_sends(serve: np.ndarray, home: np.ndarray, ids: np.ndarray, node_of_gpu: np.ndarray) -> np.ndarray:
    """int64 [T]: inter-node sends (per-GPU dedup) of each token in one layer, by
    :func:`moeplace.simulate.routing.token_sends`. serve: int [W, E]; home: int [T]; ids: int [T, K]."""
    return routing.token_sends(serve[home[:, None], ids], home, node_of_gpu)[:, 1]


def gpu_load(serve: np.ndarray, use: np.ndarray) -> np.ndarray:
    """float [W]: pairs each GPU computes. serve: int [W, E]; use: float [W, E] pairs by home GPU and expert."""
    return np.bincount(serve.ravel(), weights=use.ravel(), minlength=serve.shape[0])


# --------------------------------------------------------------------------------------------------- local search


class LayerSearch:
    """Incremental objective of one layer: sampled inter-node sends + penalty * load above the cap, under the
    static replica rule. Sends are counted exactly on the sampled tokens (scaled to the window) by the simulator's
    own routing functions; load is the whole window's.
    """

    def __init__(self, p2l: np.ndarray, cluster: Cluster, use: np.ndarray, cap: float, penalty: float,
                 home: np.ndarray, ids: np.ndarray, scale: float = 1.0, offset: np.ndarray | None = None,
                 fold_use: np.ndarray | None = None, robust: float = 0.0) -> None:
        self.p2l = p2l.copy()
        self.W = cluster.world_size
        self.S = len(p2l) // self.W
        self.E = use.shape[1]
        self.node = np.arange(self.W) // cluster.gpus_per_node
        self.slot_gpu = np.arange(len(p2l)) // self.S
        self.use, self.cap, self.penalty, self.scale = use, cap, penalty, scale
        self.serve = serve_table(self.p2l, cluster, self.E)
        self.load = gpu_load(self.serve, use) + (0.0 if offset is None else offset)
        # fold loads [F, W]: each GPU's load on F disjoint request folds; their spread across folds estimates how
        # much the GPU's load moves on another window of requests (co-located experts whose loads rise and fall
        # together spread most), and ``robust * sqrt(F) * std`` is added to the load the cap applies to
        self.fold_use, self.robust = fold_use, robust  # [F, W, E] or None
        self.fold_load = None
        if fold_use is not None:
            onehot = np.eye(self.W)[self.serve]  # [W(home), E, W(gpu)]
            self.fold_load = np.einsum("fhe,heg->fg", fold_use, onehot)
        self.home, self.ids = home.astype(np.int64), ids.astype(np.int64)
        self.sends = inter_node_sends(self.serve, self.home, self.ids, self.node)
        T, K = self.ids.shape
        flat = self.ids.ravel()
        order = np.argsort(flat, kind="stable")
        self.tok_sorted = order // K
        self.tok_start = np.searchsorted(flat[order], np.arange(self.E + 1))
        self._mark = np.zeros(T, bool)
        self.evaluations = 0

    def tokens_of(self, experts: tuple[int, ...]) -> np.ndarray:
        """int [n]: sample tokens selecting any of ``experts`` (each once, ascending)."""
        for e in experts:
            self._mark[self.tok_sorted[self.tok_start[e]:self.tok_start[e + 1]]] = True
        idx = np.flatnonzero(self._mark)
        self._mark[idx] = False
        return idx

    def overflow(self, load: np.ndarray, fold_load: np.ndarray | None = None) -> float:
        """Load above the cap, the load raised by ``robust * sqrt(F)`` standard deviations of the fold loads."""
        if fold_load is not None and self.robust > 0:
            load = load + self.robust * np.sqrt(fold_load.shape[0]) * fold_load.std(axis=0, ddof=1)
        return float(np.maximum(load - self.cap, 0.0).sum())

    def try_move(self, new_slots: dict[int, int]) -> float:
        """Objective change of setting slots to experts ({slot: expert}); applied when it improves (< 0)."""
        self.evaluations += 1
        old = {p: int(self.p2l[p]) for p in new_slots}
        touched = tuple(sorted(set(old.values()) | set(new_slots.values())))
        for p, e in new_slots.items():
            self.p2l[p] = e
        saved = self.serve[:, touched].copy()
        load = self.load.copy()
        fold_load = None if self.fold_load is None else self.fold_load.copy()
        hw = np.arange(self.W)
        for e in touched:
            col = routing.serve_column(self.slot_gpu[np.flatnonzero(self.p2l == e)], self.node)
            u = self.use[:, e]
            load -= np.bincount(self.serve[:, e], weights=u, minlength=self.W)
            load += np.bincount(col, weights=u, minlength=self.W)
            if fold_load is not None:
                d = (col[:, None] == hw).astype(np.float64) - (self.serve[:, e][:, None] == hw)
                fold_load += self.fold_use[:, :, e] @ d
            self.serve[:, e] = col
        dpen = self.penalty * (self.overflow(load, fold_load) - self.overflow(self.load, self.fold_load))
        tok = self.tokens_of(touched)
        new_sends = inter_node_sends(self.serve, self.home[tok], self.ids[tok], self.node)
        delta = float(new_sends.sum() - self.sends[tok].sum()) * self.scale + dpen
        if delta < -1e-9:
            self.sends[tok] = new_sends
            self.load = load
            self.fold_load = fold_load
            return delta
        for p, e in old.items():
            self.p2l[p] = e
        self.serve[:, touched] = saved
        return delta

    def run(self, rng: np.random.Generator, max_evals: int, max_passes: int = 6,
            deadline: float | None = None) -> tuple[int, bool]:
        """First-improvement passes over slot swaps and replica re-targeting, in random order, until a pass
        improves nothing, ``max_passes`` passes, or ``max_evals`` evaluated moves. Returns (moves made, whether
        the optional wall-clock ``deadline`` stopped it).

        The budget counts evaluations, so the result depends only on the inputs and the generator, never on the
        machine's speed or load. Candidates are indices into P * P ordered slot pairs (swaps, p < q on
        different GPUs) followed by P * E (slot, new expert) re-targetings, decoded on the fly.
        """
        P, S, E = len(self.p2l), self.S, self.E
        n_swap = P * P
        moves = 0
        stop = self.evaluations + max_evals
        for _ in range(max_passes):
            improved = False
            for i in rng.permutation(n_swap + P * E):
                if self.evaluations >= stop:
                    return moves, False
                if deadline is not None and time.perf_counter() > deadline:
                    return moves, True
                if i < n_swap:
                    p, x = divmod(int(i), P)
                    if p >= x or p // S == x // S:
                        continue
                    a, b = int(self.p2l[p]), int(self.p2l[x])
                    on_p, on_x = self.p2l[p // S * S:(p // S + 1) * S], self.p2l[x // S * S:(x // S + 1) * S]
                    if a == b or b in on_p or a in on_x:
                        continue
                    move = {p: b, x: a}
                else:
                    p, x = divmod(int(i) - n_swap, E)
                    a = int(self.p2l[p])
                    if x == a or x in self.p2l[p // S * S:(p // S + 1) * S] or (self.p2l == a).sum() < 2:
                        continue
                    move = {p: x}
                if self.try_move(move) < 0:
                    improved = True
                    moves += 1
            if not improved:
                break
        return moves, False


# --------------------------------------------------------------------------------------------------- steps


def request_node_cost(phy2log: np.ndarray, tok_req: np.ndarray, ids: np.ndarray, num_requests: int,
                      cluster: Cluster, num_experts: int) -> np.ndarray:
    """float [Rq, N]: inter-node sends of each request's rows (ids [T, L, K]) if it were homed on each node."""
    T, L, K = ids.shape
    G, N = cluster.gpus_per_node, cluster.num_nodes
    node = np.arange(cluster.world_size) // G
    out = np.zeros((num_requests, N))
    for layer in range(L):
        serve = serve_table(phy2log[layer], cluster, num_experts)
        for n in range(N):
            home = n * G + tok_req % G
            out[:, n] += np.bincount(tok_req, weights=inter_node_sends(serve, home, ids[:, layer, :], node),
                                     minlength=num_requests)
    return out


def fit_grouper(feats: np.ndarray, labels: np.ndarray, num_nodes: int, gpus_per_node: int, round_size: int,
                layers: list[int] | None = None) -> Grouper:
    """Nearest-centroid classifier: node n's row is the normalised mean prefill feature of the requests labelled n."""
    rows = []
    for n in range(num_nodes):
        m = labels == n
        v = feats[m].sum(axis=0) if m.any() else np.zeros(feats.shape[1], np.float32)
        rows.append(v / max(float(np.linalg.norm(v)), 1e-12))
    return Grouper(np.stack(rows), gpus_per_node, round_size, kind="centroids", layers=layers)


def fold_use(tok_req: np.ndarray, ids: np.ndarray, homes: np.ndarray, fold: np.ndarray, W: int,
              E: int) -> tuple[np.ndarray, np.ndarray]:
    """(float [L, F, W, E], float [L, W, E]): traffic pairs by fold, home GPU and expert, and the window's pairs
    by home GPU and expert (the folds' sum).

    fold: int [Rq] fold of every request (F = fold.max() + 1).
    """
    T, L, K = ids.shape
    F = int(fold.max()) + 1
    key = (fold[tok_req].astype(np.int64) * W + homes[tok_req].astype(np.int64))[:, None] * E
    out = np.empty((L, F, W, E))
    for layer in range(L):
        out[layer] = np.bincount((key + ids[:, layer, :]).ravel(), minlength=F * W * E).reshape(F, W, E)
    return out, out.sum(axis=1)


def request_folds(num_requests: int, num_folds: int, rng: np.random.Generator) -> np.ndarray:
    """int [Rq]: a random partition of the requests into ``num_folds`` folds of equal size (+-1)."""
    out = np.empty(num_requests, np.int64)
    out[rng.permutation(num_requests)] = np.arange(num_requests) % num_folds
    return out


def _sample_rows(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    return np.arange(n) if n <= k else np.sort(rng.choice(n, k, replace=False))


def window_objective(phy2log: np.ndarray, homes: np.ndarray, tok_req: np.ndarray, ids: np.ndarray,
                     cluster: Cluster, num_experts: int) -> float:
    """Total inter-node sends (static rule) of rows ids [T, L, K] with request homes [Rq]."""
    h = homes[tok_req].astype(np.int64)
    node = np.arange(cluster.world_size) // cluster.gpus_per_node
    return float(sum(inter_node_sends(serve_table(phy2log[layer], cluster, num_experts), h, ids[:, layer, :],
                                      node).sum() for layer in range(ids.shape[1])))


def place_given_homes(homes: np.ndarray, tok_req: np.ndarray, ids: np.ndarray, sample: np.ndarray, P: int,
                      cluster: Cluster, floor: float, rng: np.random.Generator, evals_per_layer: int,
                      penalty: float = PENALTY, start: np.ndarray | None = None, offset: np.ndarray | None = None,
                      fold: np.ndarray | None = None, robust: float = 0.0, num_experts: int | None = None,
                      deadline: float | None = None) -> tuple[np.ndarray, dict]:
    """Step 2 of the alternation: phy2log [L, P] for fixed homes [Rq] (traffic rows ids [T, L, K]).

    Per layer: :func:`initial_placement` (or ``start`` [L, P]), then a local search of at most
    ``evals_per_layer`` evaluated moves on the sampled rows. ``offset`` [L, W] is added to the modelled GPU load
    (the simulator's least-loaded rule minus the static model). Returns (phy2log, stats).
    """
    N, G, W = cluster.num_nodes, cluster.gpus_per_node, cluster.world_size
    L = ids.shape[1]
    E = num_experts if num_experts is not None else (int(ids.max()) + 1 if ids.size else 1)
    if fold is None:
        use, fuse = use_by_gpu(tok_req, ids, homes, W, E), None
    else:
        fuse, use = fold_use(tok_req, ids, homes, fold, W, E)
    if start is None:
        use_node = use.reshape(L, N, G, E).sum(axis=2).transpose(1, 0, 2)  # [N, L, E]
        p2l = initial_placement(use_node, P, G)
    else:
        p2l = start
    scale = len(tok_req) / max(len(sample), 1)
    h = homes[tok_req][sample]
    out = p2l.copy()
    moves = evals = 0
    stopped = False
    for layer in range(L):
        cap = use[layer].sum() / W / floor
        off = None if offset is None else offset[layer]
        fu = None if fuse is None else fuse[layer]
        search = LayerSearch(p2l[layer], cluster, use[layer], cap, penalty, h, ids[sample, layer, :], scale=scale,
                             offset=off, fold_use=fu, robust=robust)
        m, hit = search.run(rng, evals_per_layer, deadline=deadline)
        moves += m
        evals += search.evaluations
        stopped |= hit
        out[layer] = search.p2l
    return out, {"moves": moves, "evaluations": evals, "time_limit_hit": stopped}


def simulated_load(work: Workload, phy2log: np.ndarray, homes: np.ndarray, cluster: Cluster,
                   requests: np.ndarray | None = None, decode_batch: int = 256) -> np.ndarray:
    """float [L, W]: GPU load of the window's traffic rows routed by the simulator's default replica rule.

    homes: int [Rq] home GPU of every window request; requests: optional int [n] subset of request indices.
    Micro-batches are the simulator's decode windows (:func:`moeplace.simulate.batching.window_microbatches`, requests
    in window order): the i-th traffic row of every request of a window of ``decode_batch`` requests.
    """
    tr = work.token_request
    m = work.traffic_rows().copy()
    if requests is not None:
        m &= np.isin(tr, requests)
    rows = tr[m]
    mb = window_microbatches(rows, np.zeros(len(rows), bool), np.arange(work.num_requests),
                             BatchConfig(decode_batch=decode_batch))
    return route_load(work.expert_ids[m], homes[tr[m]], mb, phy2log, cluster).astype(np.float64)


# --------------------------------------------------------------------------------------------------- strategy


def plan_joint(work: Workload, cluster: Cluster, num_redundant: int, balance_floor: float = DEFAULT_BALANCE_FLOOR,
               seed: int = 0, iters: int = 3, round_size: int = DEFAULT_ROUND, sample_tokens: int = 16384,
               search_evals: int = DEFAULT_SEARCH_EVALS, time_limit: float | None = None,
               max_fit_requests: int = 4096, balance_rounds: int = 2, max_rows: int = 1 << 18,
               max_check_requests: int = 2048, folds: int = 64, robust: float = 0.3, penalty: float = PENALTY,
               objective: str = "time", hidden_size: int | None = None, dispatch_bytes: float = 1.0,
               combine_bytes: float = 2.0, mode: str = "auto", rule: str = "nearest-least-loaded",
               overlap: bool = False, decode_batch: int = 256, prefill_tokens: int = 8192,
               decode_running: int | None = None, dispatch: str = "choose", phases: str = "both",
               cv_folds: int = 2, intermediate_size: int | None = None, deploy: str = "rebuilt") -> StrategyResult:
    """Registry adapter for the joint strategy.

    objective: ``time`` (default; :mod:`moeplace.plan.joint_time`: predicted layer time per micro-batch, never
    worse than EPLB on the planning window; uses seed, round_size, max_check_requests and the deployment's time
    model: hidden_size, dispatch_bytes, combine_bytes, mode, rule, overlap, decode_batch, prefill_tokens,
    intermediate_size) or
    ``bytes`` (this module's docstring: inter-node bytes under a balance floor).

    balance_floor: required balancedness (mean/max GPU load per layer, averaged) on the planning window.
    sample_tokens: traffic rows the local search measures exactly. search_evals: moves evaluated per layer over
    all local searches (the budget counts work, so a plan depends only on its inputs and ``seed``).
    time_limit: optional wall-clock cap in seconds on the local searches (off by default; when it triggers, the
    plan records it in ``extra["time_limit_hit"]`` and is no longer reproducible).
    Large windows: the alternation learns on at most ``max_fit_requests`` requests and ``max_rows`` of their
    traffic rows, the simulator check replays ``max_check_requests`` of them, and every request of the window
    gets its home from the fitted grouper.
    """
    if objective == "time":
        return plan_joint_time(work, cluster, num_redundant, seed=seed, round_size=round_size,
                               hidden_size=hidden_size, dispatch_bytes=dispatch_bytes, combine_bytes=combine_bytes,
                               mode=mode, rule=rule, overlap=overlap, decode_batch=decode_batch,
                               prefill_tokens=prefill_tokens, max_eval_requests=max_check_requests,
                               decode_running=decode_running, dispatch=dispatch, phases=phases,
                               cv_folds=cv_folds, intermediate_size=intermediate_size, deploy=deploy)
    if objective != "bytes":
        raise ValueError(f"joint: objective must be 'time' or 'bytes', got {objective!r}")
    if not 0.0 < balance_floor <= 1.0:
        raise ValueError(f"balance_floor must be in (0, 1], got {balance_floor}")
    if isinstance(search_evals, bool) or not isinstance(search_evals, (int, np.integer)) or search_evals < 0:
        raise ValueError(f"search_evals must be a non-negative integer, got {search_evals!r}")
    if time_limit is not None and not (np.isfinite(time_limit) and time_limit > 0):
        raise ValueError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    deadline = None if time_limit is None else time.perf_counter() + float(time_limit)
    P, S = check_sizes(work.num_layers, work.num_experts, cluster, num_redundant)
    N, G, W, E = cluster.num_nodes, cluster.gpus_per_node, cluster.world_size, work.num_experts
    rng = np.random.default_rng(seed)
    Rq = work.num_requests
    if Rq < N:
        raise ValueError(f"joint: the planning window has {Rq} requests, fewer than {N} nodes")
    tok_req_all, ids_all = work.traffic()
    # learning set: at most max_fit_requests requests (all of them on small windows) and their traffic rows
    learn = np.sort(rng.choice(Rq, max_fit_requests, replace=False)) if Rq > max_fit_requests else np.arange(Rq)
    flayers = feature_layers(work.num_layers, E)
    feats = signal_features(work, learn, flayers)
    in_learn = np.full(Rq, -1, np.int64)
    in_learn[learn] = np.arange(len(learn))
    rows = np.flatnonzero(in_learn[tok_req_all] >= 0)
    rows = rows if len(rows) <= max_rows else np.sort(rng.choice(rows, max_rows, replace=False))
    tok_req, ids = in_learn[tok_req_all[rows]], ids_all[rows]
    Rl = len(learn)
    sample = _sample_rows(len(tok_req), sample_tokens, rng)
    n_folds = min(folds, Rl, max(8, MAX_FOLD_CELLS // (W * E)))  # bounds the fold loads' memory on wide models
    fold = request_folds(Rl, n_folds, rng) if n_folds > 1 and robust > 0 else None
    cent, _ = kmeans(feats, N, seed=seed)
    grouper = Grouper(cent, G, round_size, kind="centroids", layers=flayers)
    homes = grouper.assign_features(feats)
    best = None
    history = []
    per_search = search_evals // max(iters + balance_rounds, 1)
    L = work.num_layers
    floor = min(1.0, balance_floor + 0.01)
    hit = False
    for it in range(iters):
        p2l, stats = place_given_homes(homes, tok_req, ids, sample, P, cluster, floor, rng, per_search, fold=fold,
                                       penalty=penalty, robust=robust, num_experts=E, deadline=deadline)
        hit |= stats["time_limit_hit"]
        obj = window_objective(p2l, homes, tok_req[sample], ids[sample], cluster, E)
        history.append({"iter": it, "sample_inter_node_sends": obj, "moves": stats["moves"],
                        "evaluations": stats["evaluations"]})
        if best is None or obj < best[0]:
            best = (obj, p2l, homes, grouper)
        if it == iters - 1:
            break
        # re-home: the node each request would send least from, balanced; then a grouper that predicts it online
        cost = request_node_cost(p2l, tok_req[sample], ids[sample], Rl, cluster, E)
        labels = balanced_assign(-cost, np.full(N, -(-Rl // N)))
        grouper = fit_grouper(feats, labels, N, G, round_size, flayers)
        homes = grouper.assign_features(feats)
    obj, p2l, homes, grouper = best
    # balance as the simulator measures it (least-loaded replica rule) on the planning window; correct and re-search
    balance = []
    check = learn if len(learn) <= max_check_requests else np.sort(rng.choice(learn, max_check_requests, False))
    check_homes = np.zeros(Rq, np.int64)
    check_homes[learn] = homes
    for _ in range(balance_rounds):
        sim_load = simulated_load(work, p2l, check_homes, cluster, check)
        balance.append(mean_balancedness(sim_load))
        if balance[-1] >= floor:
            break
        # offset = (simulated - static-model) load shares, in the search's units (all learning rows)
        sel = np.isin(learn[tok_req], check)
        use = use_by_gpu(tok_req[sel], ids[sel], homes, W, E)
        static = np.stack([gpu_load(serve_table(p2l[layer], cluster, E), use[layer]) for layer in range(L)])
        total = use_by_gpu(tok_req, ids, homes, W, E).sum(axis=(1, 2))[:, None]
        share = sim_load / np.maximum(sim_load.sum(axis=1, keepdims=True), 1) \
            - static / np.maximum(static.sum(axis=1, keepdims=True), 1)
        floor = min(1.0, floor + 0.01)
        p2l, stats = place_given_homes(homes, tok_req, ids, sample, P, cluster, floor, rng, per_search, start=p2l,
                                       offset=share * total, fold=fold, penalty=penalty, robust=robust,
                                       num_experts=E, deadline=deadline)
        hit |= stats["time_limit_hit"]
    else:
        balance.append(mean_balancedness(simulated_load(work, p2l, check_homes, cluster, check)))
    fallback = None
    if balance[-1] < balance_floor:
        # the floor is a hard constraint: fall back to EPLB's placement (balance from load alone) with these homes
        from moeplace.plan.eplb import rebalance

        cand = rebalance(use_by_gpu(tok_req, ids, homes, W, E).sum(axis=1), P, 1, N, W)
        b = mean_balancedness(simulated_load(work, cand, check_homes, cluster, check))
        if b > balance[-1]:
            p2l, fallback = cand, f"joint reached {balance[-1]:.4f} < floor {balance_floor}; used EPLB's placement"
            balance.append(b)
    all_homes = homes if len(learn) == Rq else assign_all(grouper, work)
    extra = {"planning_balancedness": balance, "fallback": fallback, "balance_floor": balance_floor, "seed": seed,
             "iters": iters, "sample_tokens": int(len(sample)), "search_evals": int(search_evals),
             "time_limit": time_limit, "time_limit_hit": bool(hit), "history": history}
    return StrategyResult(p2l, all_homes, grouper, extra)
