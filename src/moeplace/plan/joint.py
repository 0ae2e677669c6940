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
   ``sends + penalty * overflow`` (overflow = load above the cap), measured exactly on the sample. The cap
   applies to each GPU's load plus ``robust * sqrt(F) * std`` of its load over F random request folds (how much
   the load moves on another window of requests), so the balance holds on unseen request mixes too.
3. The final plan is replayed by the simulator on the planning window (its default least-loaded replica rule);
   if balancedness falls below the floor, the search reruns with the simulator's per-GPU load correction and a
   tighter cap; if it still misses the floor, EPLB's placement (with the same homes) is used when it balances
   better, and ``extra["fallback"]`` says so.
"""

from __future__ import annotations

import time

import numpy as np

from moeplace.placement import Cluster
from moeplace.plan.base import StrategyResult, Workload, balancedness, check_sizes, request_expert_counts
from moeplace.plan.clusters import pack_within_nodes, replica_load
from moeplace.plan.grouping import DEFAULT_ROUND, Grouper, balanced_assign, kmeans, normalise_rows

DEFAULT_BALANCE_FLOOR = 0.95
MAX_FEATURE_DIM = 4096  # grouping features use evenly spaced layers beyond this many (layer, expert) entries
MAX_FOLD_CELLS = 1 << 17  # folds * W * E per layer at most (fold loads of the robust balance term)
PENALTY = 4.0  # sends one unit of load above the cap is worth (per layer, in sample units)


# --------------------------------------------------------------------------------------------------- replica rule


def serve_table(phy2log_l: np.ndarray, slots_per_gpu: int, gpus_per_node: int, num_gpus: int,
                num_experts: int) -> np.ndarray:
    """int [W, E]: GPU serving expert e for a token homed on GPU h, by the static nearest-tier rule.

    phy2log_l: int [P]. Tiers: replicas on h, else on h's node, else all; inside the tier, candidate h % size in
    slot order (the simulator's ``nearest-static`` rule).
    """
    out = np.empty((num_gpus, num_experts), np.int64)
    for e in range(num_experts):
        out[:, e] = _serve_column(np.flatnonzero(phy2log_l == e), slots_per_gpu, gpus_per_node, num_gpus)
    return out


def _serve_column(slots: np.ndarray, S: int, G: int, W: int) -> np.ndarray:
    """int [W]: serving GPU for every home, for one expert held by ``slots`` (ascending)."""
    gpus = slots // S
    h = np.arange(W)
    tier = np.where(gpus[None, :] == h[:, None], 0, np.where(gpus[None, :] // G == h[:, None] // G, 1, 2))
    ok = tier == tier.min(axis=1, keepdims=True)
    pick = h % ok.sum(axis=1)
    j = np.argmax(ok & (np.cumsum(ok, axis=1) - 1 == pick[:, None]), axis=1)
    return gpus[j]


def token_sends(serve: np.ndarray, home: np.ndarray, ids: np.ndarray, gpus_per_node: int) -> np.ndarray:
    """int [T]: inter-node sends (per-GPU dedup) of each token in one layer.

    serve: int [W, E]; home: int [T] home GPU; ids: int [T, K] experts.
    """
    g = serve[home[:, None], ids]
    remote = g // gpus_per_node != (home // gpus_per_node)[:, None]
    if serve.shape[0] <= 64:  # bit set of remote GPUs, then popcount
        bits = np.where(remote, np.left_shift(np.uint64(1), g.astype(np.uint64)), np.uint64(0))
        return np.bitwise_count(np.bitwise_or.reduce(bits, axis=1)).astype(np.int64)
    s = np.sort(np.where(remote, g, -1), axis=1)
    return (s[:, 0] >= 0).astype(np.int64) + ((s[:, 1:] != s[:, :-1]) & (s[:, 1:] >= 0)).sum(axis=1)


def gpu_load(serve: np.ndarray, use: np.ndarray) -> np.ndarray:
    """float [W]: pairs each GPU computes. serve: int [W, E]; use: float [W, E] pairs by home GPU and expert."""
    return np.bincount(serve.ravel(), weights=use.ravel(), minlength=serve.shape[0])


# --------------------------------------------------------------------------------------------------- local search


class _LayerSearch:
    """Incremental objective of one layer: sends + penalty * load above the cap, under the static replica rule.

    Two measures of the sends: ``exact`` counts inter-node sends (per-GPU dedup) of the sampled tokens, scaled to
    the window; the pairwise model (``exact=False``) uses whole-window counts: remote pairs minus pairs of one
    token's experts that land on the same remote GPU (inclusion-exclusion to second order; exact whenever no
    three of a token's experts share a remote GPU). The model needs no sample and costs O(W * E) per move, so
    the search runs on it first and the exact measure polishes.
    """

    def __init__(self, p2l: np.ndarray, S: int, G: int, use: np.ndarray, cap: float, penalty: float,
                 co: np.ndarray | None = None, home: np.ndarray | None = None, ids: np.ndarray | None = None,
                 scale: float = 1.0, offset: np.ndarray | None = None, fold_use: np.ndarray | None = None,
                 robust: float = 0.0) -> None:
        self.p2l = p2l.copy()
        self.S, self.G, self.W = S, G, use.shape[0]
        self.E = use.shape[1]
        self.use, self.cap, self.penalty, self.scale = use, cap, penalty, scale
        self.node_h = np.arange(self.W) // G
        self.serve = serve_table(self.p2l, S, G, self.W, self.E)
        self.load = gpu_load(self.serve, use) + (0.0 if offset is None else offset)
        # fold loads [F, W]: each GPU's load on F disjoint request folds; their spread across folds estimates how
        # much the GPU's load moves on another window of requests (co-located experts whose loads rise and fall
        # together spread most), and ``robust * sqrt(F) * std`` is added to the load the cap applies to
        self.fold_use, self.robust = fold_use, robust  # [F, W, E] or None
        self.fold_load = None
        if fold_use is not None:
            onehot = np.eye(self.W)[self.serve]  # [W(home), E, W(gpu)]
            self.fold_load = np.einsum("fhe,heg->fg", fold_use, onehot)
        self.exact = ids is not None
        if self.exact:
            self.home, self.ids = home, ids.astype(np.int64)
            self.sends = token_sends(self.serve, home, self.ids, G)
            T, K = self.ids.shape
            flat = self.ids.ravel()
            order = np.argsort(flat, kind="stable")
            self.tok_sorted = order // K
            self.tok_start = np.searchsorted(flat[order], np.arange(self.E + 1))
            self._mark = np.zeros(T, bool)
        else:
            self.co = co  # [W, E, E]

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

    def model_sends(self, serve: np.ndarray, touched: tuple[int, ...]) -> float:
        """Pairwise-model sends of the pairs involving ``touched`` experts under ``serve`` (each pair once)."""
        rem = (serve // self.G) != self.node_h[:, None]  # [W, E]
        t = np.asarray(touched)
        total = float((self.use[:, t] * rem[:, t]).sum())
        same = serve[:, t][:, :, None] == serve[:, None, :]  # [W, |t|, E]
        coloc = same & rem[:, t][:, :, None]
        c = self.co[:, t, :] * coloc
        inner = np.isin(np.arange(self.E), t)
        total -= float(c[:, :, ~inner].sum()) + 0.5 * float(c[:, :, inner].sum())
        return total

    def try_move(self, new_slots: dict[int, int]) -> float:
        """Objective change of setting slots to experts ({slot: expert}); applied when it improves (< 0)."""
        old = {p: int(self.p2l[p]) for p in new_slots}
        touched = tuple(sorted(set(old.values()) | set(new_slots.values())))
        for p, e in new_slots.items():
            self.p2l[p] = e
        saved = self.serve[:, touched].copy()
        new_serve = self.serve.copy() if not self.exact else self.serve
        load = self.load.copy()
        fold_load = None if self.fold_load is None else self.fold_load.copy()
        hw = np.arange(self.W)
        for e in touched:
            col = _serve_column(np.flatnonzero(self.p2l == e), self.S, self.G, self.W)
            u = self.use[:, e]
            load -= np.bincount(new_serve[:, e], weights=u, minlength=self.W)
            load += np.bincount(col, weights=u, minlength=self.W)
            if fold_load is not None:
                d = (col[:, None] == hw).astype(np.float64) - (new_serve[:, e][:, None] == hw)
                fold_load += self.fold_use[:, :, e] @ d
            new_serve[:, e] = col
        dpen = self.penalty * (self.overflow(load, fold_load) - self.overflow(self.load, self.fold_load))
        if self.exact:
            tok = self.tokens_of(touched)
            new_sends = token_sends(self.serve, self.home[tok], self.ids[tok], self.G)
            delta = float(new_sends.sum() - self.sends[tok].sum()) * self.scale + dpen
        else:
            delta = self.model_sends(new_serve, touched) - self.model_sends(self.serve, touched) + dpen
        if delta < -1e-9:
            if self.exact:
                self.sends[tok] = new_sends
            else:
                self.serve = new_serve
            self.load = load
            self.fold_load = fold_load
            return delta
        for p, e in old.items():
            self.p2l[p] = e
        if self.exact:
            self.serve[:, touched] = saved
        return delta

    def run(self, rng: np.random.Generator, deadline: float, max_passes: int = 6) -> int:
        """First-improvement passes over slot swaps and replica re-targeting, in random order; returns moves made.

        Candidates are indices into P * P ordered slot pairs (swaps, p < q on different GPUs) followed by P * E
        (slot, new expert) re-targetings, decoded on the fly so large layers cost nothing to enumerate.
        """
        P, S, E = len(self.p2l), self.S, self.E
        n_swap = P * P
        moves = 0
        for _ in range(max_passes):
            improved = False
            for i in rng.permutation(n_swap + P * E):
                if time.perf_counter() > deadline:
                    return moves
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
        return moves


def coactivation_by_home(home: np.ndarray, ids: np.ndarray, num_gpus: int, num_experts: int) -> np.ndarray:
    """float [W, E, E]: symmetric counts of expert pairs in one token's top-k, by the token's home GPU (one layer).

    home: int [T]; ids: int [T, K].
    """
    T, K = ids.shape
    E = num_experts
    base = home.astype(np.int64) * E * E
    ids = ids.astype(np.int64)
    i, j = np.triu_indices(K, 1)
    a, b = ids[:, i], ids[:, j]  # [T, K(K-1)/2] pairs, both orders below, one bincount
    keys = np.concatenate([(base[:, None] + a * E + b).ravel(), (base[:, None] + b * E + a).ravel()])
    out = np.bincount(keys, minlength=num_gpus * E * E).astype(np.float64)
    out = out.reshape(num_gpus, E, E)
    out[:, np.arange(E), np.arange(E)] = 0.0
    return out


# --------------------------------------------------------------------------------------------------- steps


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
        for n in range(N):
            have = set(held[n])
            for e in np.argsort(-u[n], kind="stable"):
                if len(held[n]) >= per_node:
                    break
                if int(e) not in have:
                    held[n].append(int(e))
        out[layer] = np.asarray(held)
    p2l = out.reshape(L, P)
    return pack_within_nodes(p2l, replica_load(p2l, use_node, N), N, gpus_per_node)


def request_node_cost(phy2log: np.ndarray, tok_req: np.ndarray, ids: np.ndarray, num_requests: int, S: int,
                      G: int, W: int, E: int) -> np.ndarray:
    """float [Rq, N]: inter-node sends of each request's rows (ids [T, L, K]) if it were homed on each node."""
    T, L, K = ids.shape
    N = W // G
    out = np.zeros((num_requests, N))
    for layer in range(L):
        serve = serve_table(phy2log[layer], S, G, W, E)
        for n in range(N):
            home = n * G + tok_req % G
            out[:, n] += np.bincount(tok_req, weights=token_sends(serve, home, ids[:, layer, :], G),
                                     minlength=num_requests)
    return out


def feature_layers(num_layers: int, num_experts: int, max_dim: int = MAX_FEATURE_DIM) -> list[int] | None:
    """MoE layers whose counts form the grouping feature: all (None) when L * E <= max_dim, else evenly spaced."""
    if num_layers * num_experts <= max_dim:
        return None
    n = max(1, max_dim // num_experts)
    return sorted({int(x) for x in np.linspace(0, num_layers - 1, n).round()})


def signal_features(work: Workload, requests: np.ndarray, layers: list[int] | None = None) -> np.ndarray:
    """float32 [n, D]: L2-normalised prefill activation vectors of the given requests (indices into the window),
    over ``layers`` (None: all)."""
    pos = np.full(work.num_requests, -1, np.int64)
    pos[requests] = np.arange(len(requests))
    m = work.signal & (pos[work.token_request] >= 0)
    ids = work.expert_ids[m] if layers is None else work.expert_ids[m][:, layers, :]
    counts = request_expert_counts(pos[work.token_request[m]], ids, len(requests), work.num_experts)
    return normalise_rows(counts)


def assign_all(grouper: Grouper, work: Workload, chunk: int = 8192) -> np.ndarray:
    """int64 [Rq]: homes of every request of the window from the grouper (features computed in chunks).

    The signal rows are found and sorted by request once, so each chunk reads only its own rows.
    """
    from moeplace.plan.grouping import assign_rounds

    Rq = work.num_requests
    rows = np.flatnonzero(work.signal)
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


def fit_grouper(feats: np.ndarray, labels: np.ndarray, num_nodes: int, gpus_per_node: int, round_size: int,
                layers: list[int] | None = None) -> Grouper:
    """Nearest-centroid classifier: node n's row is the normalised mean prefill feature of the requests labelled n."""
    rows = []
    for n in range(num_nodes):
        m = labels == n
        v = feats[m].sum(axis=0) if m.any() else np.zeros(feats.shape[1], np.float32)
        rows.append(v / max(float(np.linalg.norm(v)), 1e-12))
    return Grouper(np.stack(rows), gpus_per_node, round_size, kind="centroids", layers=layers)


def _use_by_gpu(tok_req: np.ndarray, ids: np.ndarray, homes: np.ndarray, W: int, E: int) -> np.ndarray:
    """float [L, W, E]: traffic pairs by home GPU and expert."""
    T, L, K = ids.shape
    h = homes[tok_req].astype(np.int64)[:, None] * E
    out = np.empty((L, W, E))
    for layer in range(L):  # one layer at a time bounds the temporaries
        out[layer] = np.bincount((h + ids[:, layer, :]).ravel(), minlength=W * E).reshape(W, E)
    return out


def _fold_use(tok_req: np.ndarray, ids: np.ndarray, homes: np.ndarray, fold: np.ndarray, W: int,
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


def window_objective(phy2log: np.ndarray, homes: np.ndarray, tok_req: np.ndarray, ids: np.ndarray, S: int, G: int,
                     W: int, E: int) -> float:
    """Total inter-node sends (static rule) of rows ids [T, L, K] with request homes [Rq]."""
    h = homes[tok_req]
    return float(sum(token_sends(serve_table(phy2log[layer], S, G, W, E), h, ids[:, layer, :], G).sum()
                     for layer in range(ids.shape[1])))


def place_given_homes(homes: np.ndarray, tok_req: np.ndarray, ids: np.ndarray, sample: np.ndarray, P: int,
                      cluster: Cluster, floor: float, rng: np.random.Generator, deadline: float,
                      penalty: float = PENALTY, exact_share: float = 0.3, start: np.ndarray | None = None,
                      offset: np.ndarray | None = None, fold: np.ndarray | None = None,
                      robust: float = 0.0) -> tuple[np.ndarray, dict]:
    """Step 2 of the alternation: phy2log [L, P] for fixed homes [Rq] (traffic rows ids [T, L, K]).

    Per layer: :func:`initial_placement` (or ``start`` [L, P]), a local search on the pairwise model (whole
    window), then on the exact sample measure (``exact_share`` of the time). ``offset`` [L, W] is added to the
    modelled GPU load (the simulator's least-loaded rule minus the static model). Returns (phy2log, stats).
    """
    N, G, W = cluster.num_nodes, cluster.gpus_per_node, cluster.world_size
    L = ids.shape[1]
    E = int(ids.max()) + 1 if ids.size else 1
    S = P // W
    if fold is None:
        use, fuse = _use_by_gpu(tok_req, ids, homes, W, E), None
    else:
        fuse, use = _fold_use(tok_req, ids, homes, fold, W, E)
    if start is None:
        use_node = use.reshape(L, N, G, E).sum(axis=2).transpose(1, 0, 2)  # [N, L, E]
        p2l = initial_placement(use_node, P, G)
    else:
        p2l = start
    scale = len(tok_req) / max(len(sample), 1)
    h_all = homes[tok_req]
    h = h_all[sample]
    out = p2l.copy()
    moves = [0, 0]
    for layer in range(L):
        cap = use[layer].sum() / W / floor
        left = max(deadline - time.perf_counter(), 0.0) / (L - layer)
        t_model = time.perf_counter() + left * (1.0 - exact_share)
        co = coactivation_by_home(h, ids[sample, layer, :], W, E) * scale
        off = None if offset is None else offset[layer]
        fu = None if fuse is None else fuse[layer]
        model = _LayerSearch(p2l[layer], S, G, use[layer], cap, penalty, co=co, offset=off, fold_use=fu,
                             robust=robust)
        moves[0] += model.run(rng, t_model)
        exact = _LayerSearch(model.p2l, S, G, use[layer], cap, penalty, home=h, ids=ids[sample, layer, :],
                             scale=scale, offset=off, fold_use=fu, robust=robust)
        moves[1] += exact.run(rng, time.perf_counter() + left * exact_share)
        out[layer] = exact.p2l
    return out, {"model_moves": moves[0], "exact_moves": moves[1]}


def simulated_load(work: Workload, phy2log: np.ndarray, homes: np.ndarray, cluster: Cluster,
                   requests: np.ndarray | None = None) -> np.ndarray:
    """float [L, W]: GPU load of the window's traffic rows replayed by the simulator (default replica rule).

    homes: int [Rq] home GPU of every window request; requests: optional int [n] subset of request indices.

    Rows keep their order inside each request; a row's decode step is its rank in its request, so micro-batches
    are the ones the simulator forms on the trace itself.
    """
    from moeplace.placement import Placement, Plan
    from moeplace.simulate import CostConfig, simulate
    from moeplace.trace.store import Requests, TokenChunk, Trace, TraceMeta

    tr = work.token_request
    order = np.argsort(tr, kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(tr, minlength=work.num_requests))[:-1]])
    rank = np.empty(len(tr), np.int64)
    rank[order] = np.arange(len(tr)) - starts[tr[order]]
    m = ~work.signal if (~work.signal).any() else np.ones(len(tr), bool)
    if requests is not None:
        m &= np.isin(tr, requests)
    Rq = work.num_requests
    K = work.expert_ids.shape[2]
    meta = TraceMeta(model="planning-window", num_layers=work.num_layers, num_experts=work.num_experts, top_k=K,
                     hidden_size=1)
    reqs = Requests(np.arange(Rq, dtype=np.int64), np.full(Rq, "unknown", object), np.full(Rq, "", object),
                    np.zeros(Rq, np.int32), np.zeros(Rq, np.int32))
    tok = TokenChunk(tr[m].astype(np.int64), rank[m].astype(np.int32), np.ones(int(m.sum()), np.int8),
                     work.expert_ids[m])
    plan = Plan(Placement(phy2log, work.num_experts, cluster.world_size), cluster,
                {i: int(h) for i, h in enumerate(homes.tolist())}, "joint")
    res = simulate(Trace(meta, reqs, tok, None), plan, cost=CostConfig(hidden_size=1))
    return res.decode.load.astype(np.float64)


# --------------------------------------------------------------------------------------------------- strategy


def plan_joint(work: Workload, cluster: Cluster, num_redundant: int, balance_floor: float = DEFAULT_BALANCE_FLOOR,
               seed: int = 0, iters: int = 3, round_size: int = DEFAULT_ROUND, sample_tokens: int = 16384,
               time_budget: float = 45.0, max_fit_requests: int = 4096, balance_rounds: int = 2,
               max_rows: int = 1 << 18, max_check_requests: int = 2048, folds: int = 64, robust: float = 0.3,
               penalty: float = PENALTY, **_: object) -> StrategyResult:
    """Registry adapter for the joint strategy (see the module docstring).

    balance_floor: required balancedness (mean/max GPU load per layer, averaged) on the planning window.
    sample_tokens: traffic rows the local search measures exactly; time_budget: seconds for all local searches.
    Large windows: the alternation learns on at most ``max_fit_requests`` requests and ``max_rows`` of their
    traffic rows, the simulator check replays ``max_check_requests`` of them, and every request of the window
    gets its home from the fitted grouper.
    """
    if not 0.0 < balance_floor <= 1.0:
        raise ValueError(f"balance_floor must be in (0, 1], got {balance_floor}")
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    t_last = [t_start]

    def tick(name: str) -> None:  # seconds per phase, for extra["timings"]
        now = time.perf_counter()
        timings[name] = timings.get(name, 0.0) + now - t_last[0]
        t_last[0] = now

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
    tick("setup")
    best = None
    history = []
    per_iter = time_budget / max(iters + balance_rounds, 1)
    L = work.num_layers
    floor = min(1.0, balance_floor + 0.01)
    for it in range(iters):
        deadline = time.perf_counter() + per_iter
        p2l, stats = place_given_homes(homes, tok_req, ids, sample, P, cluster, floor, rng, deadline, fold=fold,
                                       penalty=penalty, robust=robust)
        tick("search")
        obj = window_objective(p2l, homes, tok_req[sample], ids[sample], S, G, W, E)
        history.append({"iter": it, "sample_inter_node_sends": obj, **stats})
        if best is None or obj < best[0]:
            best = (obj, p2l, homes, grouper)
        if it == iters - 1:
            break
        # re-home: the node each request would send least from, balanced; then a grouper that predicts it online
        cost = request_node_cost(p2l, tok_req[sample], ids[sample], Rl, S, G, W, E)
        labels = balanced_assign(-cost, np.full(N, -(-Rl // N)))
        grouper = fit_grouper(feats, labels, N, G, round_size, flayers)
        homes = grouper.assign_features(feats)
        tick("rehome")
    obj, p2l, homes, grouper = best
    # balance as the simulator measures it (least-loaded replica rule) on the planning window; correct and re-search
    balance = []
    check = learn if len(learn) <= max_check_requests else np.sort(rng.choice(learn, max_check_requests, False))
    check_homes = np.zeros(Rq, np.int64)
    check_homes[learn] = homes
    for _ in range(balance_rounds):
        sim_load = simulated_load(work, p2l, check_homes, cluster, check)
        balance.append(balancedness(sim_load))
        tick("check")
        if balance[-1] >= floor:
            break
        # offset = (simulated - static-model) load shares, in the search's units (all learning rows)
        sel = np.isin(learn[tok_req], check)
        use = _use_by_gpu(tok_req[sel], ids[sel], homes, W, E)
        static = np.stack([gpu_load(serve_table(p2l[layer], S, G, W, E), use[layer]) for layer in range(L)])
        total = _use_by_gpu(tok_req, ids, homes, W, E).sum(axis=(1, 2))[:, None]
        share = sim_load / np.maximum(sim_load.sum(axis=1, keepdims=True), 1) \
            - static / np.maximum(static.sum(axis=1, keepdims=True), 1)
        floor = min(1.0, floor + 0.01)
        deadline = time.perf_counter() + per_iter
        p2l, _ = place_given_homes(homes, tok_req, ids, sample, P, cluster, floor, rng, deadline, start=p2l,
                                   offset=share * total, fold=fold, penalty=penalty,
                                   robust=robust)
        tick("search")
    else:
        balance.append(balancedness(simulated_load(work, p2l, check_homes, cluster, check)))
        tick("check")
    fallback = None
    if balance[-1] < balance_floor:
        # the floor is a hard constraint: fall back to EPLB's placement (balance from load alone) with these homes
        from moeplace.plan.eplb import rebalance

        cand = rebalance(_use_by_gpu(tok_req, ids, homes, W, E).sum(axis=1), P, 1, N, W)
        b = balancedness(simulated_load(work, cand, check_homes, cluster, check))
        if b > balance[-1]:
            p2l, fallback = cand, f"joint reached {balance[-1]:.4f} < floor {balance_floor}; used EPLB's placement"
            balance.append(b)
        tick("check")
    all_homes = homes if len(learn) == Rq else assign_all(grouper, work)
    tick("homes")
    extra = {"planning_balancedness": balance, "fallback": fallback,
             "balance_floor": balance_floor, "seed": seed, "iters": iters, "sample_tokens": int(len(sample)),
             "history": history, "timings": timings, "seconds": time.perf_counter() - t_start}
    return StrategyResult(p2l, all_homes, grouper, extra)
