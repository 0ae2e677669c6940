"""Partitioning strategies: ``coactivation`` (graph, METIS) and ``hypergraph`` (Mt-KaHyPar).

Shape legend: L = MoE layers, E = logical experts, K = top-k, P = slots, W = GPUs, S = P / W, T = token rows,
H = distinct expert sets (hyperedges).

Both split each layer's experts into W parts (one per GPU), balanced by load, then :func:`fill_slots` makes every
part fit its S slots and fills the redundant slots with EPLB-style replicas (the expert with the largest load per
replica, onto the least-loaded GPU that has room and does not hold it yet). Neither groups requests (homes stay
round-robin), so what they save comes from putting experts that are selected together on one GPU: under per-GPU
dedup a token sends its hidden vector once per remote GPU.

- coactivation: vertices = experts (weight = load), edges = how often two experts are in one token's top-k; METIS
  minimises the co-activation weight cut.
- hypergraph: each token's expert set is a hyperedge (identical sets merged, weight = multiplicity); Mt-KaHyPar
  minimises connectivity (lambda - 1: the extra GPUs a token must reach), the per-GPU-dedup send count when the
  home holds one of the experts. If mtkahypar cannot be imported, the strategy falls back to METIS on the
  clique expansion and says so in ``extra["fallback"]``.
"""

from __future__ import annotations

import numpy as np

from moeplace.analyse.stats import coactivation_counts
from moeplace.placement import Cluster
from moeplace.plan.base import StrategyResult, Workload, check_sizes

MAX_HYPEREDGES = 200_000  # distinct expert sets kept per layer (the heaviest); bounds partitioning time


def pair_graph(expert_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 [L, E, E]: edge weights of the co-activation graph, per layer: tokens selecting both experts
    (:func:`moeplace.analyse.stats.coactivation_counts`) with the diagonal cleared (no self-loops).

    expert_ids: int [T, L, K].
    """
    co = coactivation_counts(expert_ids, num_experts)
    co[:, np.arange(num_experts), np.arange(num_experts)] = 0
    return co


def fill_slots(part: np.ndarray, load: np.ndarray, num_gpus: int, slots_per_gpu: int,
               affinity: np.ndarray | None = None) -> np.ndarray:
    """Turn a per-expert GPU assignment into a full placement.

    part: int [L, E] GPU of each expert (any sizes); load: float [L, E]; affinity: optional float [L, E, E]
    (co-activation) used to pick where an expert moves when its GPU is over its S slots (else: least loaded).
    Returns phy2log int [L, P], P = W * S: over-full GPUs shed their lightest experts, then redundant slots
    take replicas of the expert with the largest load per replica, each on the least-loaded GPU with room that
    does not hold it.
    """
    L, E = part.shape
    W, S = num_gpus, slots_per_gpu
    P = W * S
    out = np.empty((L, P), np.int64)
    for layer in range(L):
        ld = load[layer]
        members = [list(np.flatnonzero(part[layer] == g)) for g in range(W)]
        # shed over-full GPUs (keep room for no replica: a GPU holds at most S experts)
        for g in range(W):
            while len(members[g]) > S:
                e = min(members[g], key=lambda x: ld[x])
                members[g].remove(e)
                room = [h for h in range(W) if len(members[h]) < S]
                if affinity is not None:
                    h = max(room, key=lambda h: (affinity[layer, e, members[h]].sum(), -ld[members[h]].sum()))
                else:
                    h = min(room, key=lambda h: ld[members[h]].sum())
                members[h].append(e)
        cnt = np.ones(E)
        free = P - E
        for _ in range(free):
            score = ld / cnt
            holders = [set(m) for m in members]
            order = np.argsort(-score, kind="stable")
            placed = False
            gpu_load = np.array([sum(ld[x] / cnt[x] for x in members[h]) for h in range(W)])
            for e in order:
                room = [h for h in range(W) if len(members[h]) < S and e not in holders[h]]
                if room:
                    cnt[e] += 1
                    h = min(room, key=lambda h: gpu_load[h])
                    members[h].append(int(e))
                    placed = True
                    break
            assert placed, "a free slot exists on some GPU and an expert it lacks"
        out[layer] = np.concatenate([np.asarray(m, np.int64) for m in members])
    return out


def _metis_parts(adj: np.ndarray, vweight: np.ndarray, nparts: int, seed: int) -> np.ndarray:
    """int [E]: METIS k-way partition of a weighted graph given as a dense symmetric matrix [E, E]."""
    import pymetis

    E = len(adj)
    if nparts == 1:
        return np.zeros(E, np.int64)
    xadj, adjncy, ew = [0], [], []
    for v in range(E):
        nb = np.flatnonzero(adj[v])
        adjncy.extend(nb.tolist())
        ew.extend(np.maximum(1, adj[v, nb]).astype(np.int64).tolist())
        xadj.append(len(adjncy))
    opts = pymetis.Options(seed=seed)
    vw = np.maximum(1, np.round(vweight)).astype(np.int64).tolist()
    csr = pymetis.CSRAdjacency(adj_starts=xadj, adjacent=adjncy)
    _, parts = pymetis.part_graph(nparts, csr, vweights=vw, eweights=ew, options=opts)
    return np.asarray(parts, np.int64)


def _scaled(x: np.ndarray, top: float = 1e6) -> np.ndarray:
    """Non-negative weights scaled so the largest is ``top`` (METIS/KaHyPar take integers)."""
    m = float(x.max()) if x.size else 0.0
    return x * (top / m) if m > 0 else x


def two_level_parts(split, num_experts: int, num_nodes: int, gpus_per_node: int) -> np.ndarray:
    """int [E]: GPU of each expert from a node-level split and then a GPU-level split inside each node.

    split(vertices int [V], nparts) -> int [V] partitions a vertex subset; nodes get experts first (what crosses
    nodes is what costs), then each node's experts are split over its G GPUs.
    """
    V = np.arange(num_experts)
    node = split(V, num_nodes)
    gpu = np.empty(num_experts, np.int64)
    for n in range(num_nodes):
        vs = V[node == n]
        sub = split(vs, gpus_per_node) if len(vs) else np.zeros(0, np.int64)
        gpu[vs] = n * gpus_per_node + sub
    return gpu


def plan_coactivation(work: Workload, cluster: Cluster, num_redundant: int, seed: int = 0) -> StrategyResult:
    """Registry adapter: METIS on each layer's co-activation graph, parts -> GPUs, then :func:`fill_slots`."""
    P, S = check_sizes(work.num_layers, work.num_experts, cluster, num_redundant)
    _, ids = work.traffic()
    co = pair_graph(ids, work.num_experts)
    W = cluster.world_size
    part = np.stack([_metis_two_level(co[layer], work.load[layer], cluster, seed) for layer in range(work.num_layers)])
    return StrategyResult(fill_slots(part, work.load, W, S, affinity=co), extra={"seed": seed})


def _metis_two_level(co: np.ndarray, load: np.ndarray, cluster: Cluster, seed: int) -> np.ndarray:
    """int [E]: two-level METIS partition of one layer's co-activation graph (co [E, E], load [E])."""
    adj = _scaled(co.astype(np.float64))
    vw = _scaled(np.asarray(load, np.float64), 1e4)

    def split(vs: np.ndarray, k: int) -> np.ndarray:
        if k == 1 or len(vs) <= 1:
            return np.zeros(len(vs), np.int64)
        return _metis_parts(adj[np.ix_(vs, vs)], vw[vs], k, seed)

    return two_level_parts(split, len(load), cluster.num_nodes, cluster.gpus_per_node)


_MTK = None


def _mtkahypar():
    """The mtkahypar module, initialised once with one thread (None if it cannot be imported)."""
    global _MTK
    if _MTK is None:
        try:
            import mtkahypar

            _MTK = (mtkahypar, mtkahypar.initialize(1, False))
        except Exception:  # noqa: BLE001 - any import or init failure means "not usable here"
            _MTK = False
    return _MTK or None


def hyperedges(expert_ids_layer: np.ndarray, max_edges: int = MAX_HYPEREDGES) -> tuple[np.ndarray, np.ndarray]:
    """Distinct expert sets of one layer and their multiplicity, heaviest first.

    expert_ids_layer: int [T, K]. Returns (sets int [H, K] sorted rows, weight int [H]).
    """
    s = np.sort(expert_ids_layer.astype(np.int64), axis=1)
    u, c = np.unique(s, axis=0, return_counts=True)
    order = np.argsort(-c, kind="stable")[:max_edges]
    return u[order], c[order]


def hypergraph_parts(sets: np.ndarray | list, weight: np.ndarray, vweight: np.ndarray, nparts: int, seed: int = 0,
                     epsilon: float = 0.05) -> np.ndarray:
    """int [E]: Mt-KaHyPar connectivity (km1) partition of E vertices; sets: H hyperedges (int [H, K] or lists of
    vertex ids), weight [H]."""
    mt = _mtkahypar()
    if mt is None:
        raise RuntimeError("mtkahypar is not usable")
    mtk, init = mt
    E = len(vweight)
    if nparts == 1:
        return np.zeros(E, np.int64)
    ctx = init.context_from_preset(mtk.PresetType.DEFAULT)
    ctx.set_partitioning_parameters(nparts, epsilon, mtk.Objective.KM1)
    ctx.logging = False
    mtk.set_seed(seed)
    edges = [sorted(set(r)) for r in (sets.tolist() if isinstance(sets, np.ndarray) else sets)]
    vw = np.maximum(1, np.round(_scaled(vweight, 1e4))).astype(np.int64).tolist()
    hg = init.create_hypergraph(ctx, E, len(edges), edges, vw, np.maximum(1, weight).astype(np.int64).tolist())
    return np.asarray(hg.partition(ctx).get_partition(), np.int64)


def plan_hypergraph(work: Workload, cluster: Cluster, num_redundant: int, seed: int = 0) -> StrategyResult:
    """Registry adapter: Mt-KaHyPar km1 partition of each layer's token hypergraph, parts -> GPUs, then
    :func:`fill_slots`. Falls back to METIS on the clique expansion when mtkahypar is unusable."""
    P, S = check_sizes(work.num_layers, work.num_experts, cluster, num_redundant)
    _, ids = work.traffic()
    W = cluster.world_size
    extra: dict = {"seed": seed}
    co = pair_graph(ids, work.num_experts)
    if _mtkahypar() is None:
        extra["fallback"] = "mtkahypar could not be imported or initialised; used METIS on the co-activation graph"
        part = np.stack([_metis_two_level(co[layer], work.load[layer], cluster, seed)
                         for layer in range(work.num_layers)])
    else:
        parts = []
        for layer in range(work.num_layers):
            sets, wt = hyperedges(ids[:, layer, :])
            load = work.load[layer]

            def split(vs: np.ndarray, k: int, sets=sets, wt=wt, load=load) -> np.ndarray:
                if k == 1 or len(vs) <= 1:
                    return np.zeros(len(vs), np.int64)
                local = np.full(work.num_experts, -1, np.int64)
                local[vs] = np.arange(len(vs))
                sub = [[int(local[v]) for v in row if local[v] >= 0] for row in sets.tolist()]
                keep = [i for i, r in enumerate(sub) if len(r) >= 2]
                if not keep:
                    return np.arange(len(vs)) % k
                return hypergraph_parts([sub[i] for i in keep], wt[keep], load[vs], k, seed)

            parts.append(two_level_parts(split, work.num_experts, cluster.num_nodes, cluster.gpus_per_node))
        part = np.stack(parts)
    return StrategyResult(fill_slots(part, work.load, W, S, affinity=co), extra=extra)
