"""The one definition of what a token costs: replica choice, sends under per-GPU and per-node dedup, the split by
link class, and balancedness. The simulator, the planners and the runtime all call these functions; nothing else
re-implements them (docs/MODEL.md gives the definitions, ``tests/spec_simulator.py`` an independent spec).

Shape legend: T = tokens, L = MoE layers, K = top-k, E = logical experts, P = physical slots, W = GPUs,
M = max replicas of one expert, N_n = nodes, G = GPUs per node.

Replica rule. Both variants start from the *nearest tier* of an expert for a token: its replicas on the token's
home GPU if any, else those on the home node, else all of them.

- ``nearest-least-loaded`` (default): pairs are taken in token order, then k order; each picks, within its
  nearest tier, the replica whose GPU has the fewest pairs already assigned in this micro-batch and layer (every
  pair counts, single-replica ones too); ties go to the lowest slot.
- ``nearest-static`` (like SGLang's static dispatch): within the nearest tier, candidate number
  ``home % tier_size`` in slot order. It depends only on (layer, expert, home): the *serve table*.

- ``balanced-local``: per micro-batch and layer, every pair goes to one replica of its expert (any GPU holding it)
  so as to minimise ``max_g load_g + sum over pairs of locality cost``: a pair served on its token's home GPU costs
  0, elsewhere on the home node ``intra_cost``, on another node ``inter_cost`` (:class:`ReplicaCosts`, in pairs;
  load counts every pair, single-replica ones and ``base_load`` too). Solved exactly over groups (home, expert):
  a min-cost flow per cap on the load, the cap lowered one pair at a time while that adds at most one pair of
  locality cost (the objective is convex in the cap; equal objectives take the lower cap). Pairs of a group fill
  its replica GPUs in slot order, in token order then k order; a GPU holding two slots of the expert serves from
  the first. :func:`moeplace.simulate.loops.balance_kernel` states the tie-breaks.
- ``balanced``: the least max load alone (like SGLang's LP load balancer, which ignores locality); among
  assignments with that max load, the least locality cost by the same costs (a tie-break only).
- ``balanced-links``: ``balanced``, then the busiest GPU's inter-node pairs (the larger of what it receives from
  and sends to other nodes, the per-pair count DeepEP's low-latency kernel moves) lowered by single-pair moves
  between replicas under a few load caps, keeping the assignment with the least ``max load + inter x max
  inter-node pairs`` (weights :class:`LinkWeights`: the same defaults in the simulator, the planners' route_load
  and the runtime's assign_slots, so all three route alike).
  Never above ``balanced`` on that objective (:func:`moeplace.simulate.loops.link_refine` states the search).

Sends. A token's hidden vector goes once to every GPU other than its home that serves one of its experts
(per-GPU dedup), or once per remote node (two-hop, then NVLink forwarding); a send is intra-node when both GPUs
share a node, else inter-node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeplace.placement import log2phy_table
from moeplace.simulate import loops
from moeplace.simulate.config import BALANCED_RULES, DEDUP_MODES, DEFAULT_RULE, RULES  # noqa: F401  (re-exported)

COST_UNIT = 10**6  # locality costs are taken to 1e-6 of a pair (integer arithmetic keeps the solver exact)
# last axis of :func:`link_counts`
COUNT_NAMES = ("intra_gpu_sends", "intra_node_sends", "inter_node_sends", "max_message_sends", "busiest_intra",
               "busiest_inter")
# last axis of :func:`token_sends`
TOKEN_SEND_NAMES = ("intra_node", "inter_node", "two_hop_inter_node")


def check_rule(rule: str) -> str:
    """``rule`` if it is a known replica rule, else ValueError listing them."""
    if rule not in RULES:
        raise ValueError(f"replica rule {rule!r}: expected one of {RULES}")
    return rule


@dataclass(frozen=True)
class ReplicaCosts:
    """Locality costs of the ``balanced-local`` rule, in token-expert pairs of load on the busiest GPU.

    Defaults: one pair of compute is ~0.2 us at DeepSeek-V3 shape (88 MFLOP at 400 TFLOP/s); one inter-node send
    of a 7168-wide vector out (fp8) and back (bf16) is ~0.4 us at 50 GB/s, but it lands on one of W links, so it
    adds ~1/W of that to the busiest one: about 0.25 of a pair at W = 8. NVLink is ~10-20x faster: 0.02.
    """

    intra_cost: float = 0.02  # a pair served on another GPU of its home node
    inter_cost: float = 0.25  # a pair served on another node

    def __post_init__(self) -> None:
        for name in ("intra_cost", "inter_cost"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not 0 <= v < 1e6:
                raise ValueError(f"replica costs: {name} must be a number in [0, 1e6), got {v!r}")

    def matrix(self, node_of_gpu: np.ndarray) -> np.ndarray:
        """int64 [W, W]: cost of a pair homed on h served on g, in 1/COST_UNIT of a pair."""
        nog = np.asarray(node_of_gpu, np.int64)
        same = nog[:, None] == nog[None, :]
        c = np.where(same, round(self.intra_cost * COST_UNIT), round(self.inter_cost * COST_UNIT)).astype(np.int64)
        np.fill_diagonal(c, 0)
        return c


@dataclass(frozen=True)
class LinkWeights:
    """What the ``balanced-links`` rule weighs, in pairs of compute on the busiest GPU.

    Defaults: one inter-node pair out (fp8 7168-wide, ~7.4 kB) and back (bf16, ~14.3 kB) at ~40 GB/s achieved is
    ~0.55 us on the busiest GPU's link against ~0.2 us of compute per pair at DeepSeek-V3 shape: about 3 pairs.
    ``memory``: the weight reads of one active expert (DeepSeek-V3: 44 MB at ~3.3 TB/s, ~13 us, about 60 pairs);
    0 treats every pair of load as costing time.
    """

    inter: float = 3.0  # one pair more on the busiest GPU's inter-node link
    memory: float = 0.0  # one active expert's weight reads

    def __post_init__(self) -> None:
        for name in ("inter", "memory"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not 0 <= v < 1e6:
                raise ValueError(f"link weights: {name} must be a number in [0, 1e6), got {v!r}")

    def vector(self) -> np.ndarray:
        """int64 [3]: (one pair of load, one inter-node pair, one active expert) in 1/COST_UNIT of a pair; the
        inter weight is at least 1/COST_UNIT, so the rule always refines."""
        return np.array([COST_UNIT, max(1, round(self.inter * COST_UNIT)), round(self.memory * COST_UNIT)],
                        np.int64)


def writable_arrays(state: dict) -> dict:
    """``state`` with every read-only numpy array replaced by a writable copy (the others as they are).

    For ``__setstate__`` of objects that travel to worker processes: Ray (pickle protocol 5) hands arrays back
    as read-only views of its object store, and numba compiles a separate copy of each kernel for every
    read-only argument type (about 40 s per worker process for the simulator's kernels, on 2 cores). The tables
    are small next to the work a task does with them."""
    return {k: v.copy() if isinstance(v, np.ndarray) and not v.flags.writeable else v for k, v in state.items()}


@dataclass(frozen=True)
class RouteTables:
    """Replica candidates of every (layer, expert, home GPU), precomputed from a placement.

    The serve table (``serve_slot``/``serve_gpu``) is the nearest-static choice; ``ambiguous`` marks where the
    least-loaded rule must choose between several replicas of the nearest tier.
    """

    num_experts: int  # E
    num_gpus: int  # W
    slot_gpu: np.ndarray  # int64 [P]: GPU of each slot
    cand_slot: np.ndarray  # int64 [L, E, M]: log2phy, slots holding each expert, ascending, padded with -1
    cand_gpu: np.ndarray  # int64 [L, E, M]: their GPUs (0 where padded)
    cand_ok: np.ndarray  # bool [L*E*W, M]: candidate is in the nearest tier of (layer, expert, home)
    serve_slot: np.ndarray  # int64 [L*E*W]: the nearest-static choice (flat index (l*E + e)*W + h)
    serve_gpu: np.ndarray  # int16 [L*E*W]: GPU of serve_slot
    ambiguous: np.ndarray  # bool [L*E*W]: nearest tier holds >= 2 candidates (least-loaded must choose)
    node_of_gpu: np.ndarray  # int64 [W]
    rep_gpu: np.ndarray  # int64 [L, E, M]: distinct GPUs holding each expert, in slot order, -1 padded
    rep_slot: np.ndarray  # int64 [L, E, M]: the expert's first slot on each of them
    rep_n: np.ndarray  # int64 [L, E]: how many distinct GPUs

    @property
    def num_layers(self) -> int:
        return self.cand_slot.shape[0]

    def __setstate__(self, state: dict) -> None:
        object.__setattr__(self, "__dict__", writable_arrays(state))

    def serve_table(self, layer: int) -> np.ndarray:
        """int64 [W, E]: the GPU serving expert e for a token homed on GPU h in ``layer`` (nearest-static)."""
        E, W = self.num_experts, self.num_gpus
        return self.serve_gpu.reshape(-1, E, W)[layer].T.astype(np.int64)

    def kernel_serve(self, rule: str) -> np.ndarray:
        """int16 [L*E*W]: the serving GPU of each (layer, expert, home), -1 where ``rule`` chooses per pair (the
        balanced rules choose before the kernel: :func:`balanced_gpus`; their table is unused)."""
        if check_rule(rule) == "nearest-least-loaded":
            return np.where(self.ambiguous, np.int16(-1), self.serve_gpu).astype(np.int16)
        return self.serve_gpu


def build_route_tables(phy2log: np.ndarray, slot_gpu: np.ndarray, node_of_gpu: np.ndarray,
                       num_experts: int | None = None) -> RouteTables:
    """Candidate tables for :func:`assign_slots`, the simulator and the planners.

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
    cand = log2phy_table(p2l, E)
    if L and (cand[:, :, 0] < 0).any():
        layer, e = np.argwhere(cand[:, :, 0] < 0)[0]
        raise ValueError(f"phy2log: expert {e} has no slot in layer {layer}")
    M = cand.shape[2]
    cgpu = np.where(cand >= 0, sg[np.maximum(cand, 0)], 0)
    ok = np.zeros((L, E, W, M), bool)
    static = np.zeros((L, E, W), np.int64)
    nbest = np.zeros((L, E, W), np.int64)
    loops.tier_kernel(cand, cgpu, nog, ok, static, nbest)
    rep_gpu = np.full((L, E, M), -1, np.int64)
    rep_slot = np.full((L, E, M), -1, np.int64)
    rep_n = np.zeros((L, E), np.int64)
    loops.distinct_kernel(cand, cgpu, rep_gpu, rep_slot, rep_n)
    return RouteTables(
        num_experts=E,
        num_gpus=W,
        slot_gpu=sg,
        cand_slot=cand,
        cand_gpu=cgpu,
        cand_ok=ok.reshape(L * E * W, M),
        serve_slot=static.reshape(-1),
        serve_gpu=sg[static].reshape(-1).astype(np.int16),
        ambiguous=(nbest >= 2).reshape(-1),
        node_of_gpu=nog,
        rep_gpu=rep_gpu,
        rep_slot=rep_slot,
        rep_n=rep_n,
    )


def balanced_gpus(ids: np.ndarray, rows: np.ndarray, home: np.ndarray, starts: np.ndarray, tab: RouteTables,
                  rule: str, costs: ReplicaCosts | None = None, base_load: np.ndarray | None = None,
                  weights: LinkWeights | None = None, start: np.ndarray | None = None) -> np.ndarray:
    """int16 [n, L, K]: the serving GPU of every pair under a balanced rule (see the module docstring).

    ids: int16 [T, L, K] routing; rows: int64 [n] rows of ids grouped by micro-batch (token order inside),
    micro-batch b being rows[starts[b]:starts[b+1]]; home: int64 [n] home GPU of each of those rows; base_load:
    optional int [W] pairs already on each GPU (every micro-batch and layer); weights: the ``balanced-links``
    rule's (default :class:`LinkWeights`); start: for ``balanced-links``, the ``balanced`` rule's answer for the
    same arguments when the caller has it (it is where the rule starts; recomputed when None). Layers run in
    parallel threads.
    """
    if check_rule(rule) not in BALANCED_RULES:
        raise ValueError(f"balanced_gpus: rule {rule!r} is not one of {BALANCED_RULES}")
    ids = np.ascontiguousarray(ids, np.int16)
    L, K = ids.shape[1], ids.shape[2]
    W = tab.num_gpus
    cc = (costs or ReplicaCosts()).matrix(tab.node_of_gpu)
    base = np.zeros(W, np.int64) if base_load is None else np.array(base_load, np.int64).reshape(W)
    rows = np.ascontiguousarray(rows, np.int64)
    home = np.ascontiguousarray(home, np.int64)
    starts = np.ascontiguousarray(starts, np.int64)
    if rule == "balanced-links" and start is not None:
        pick = np.ascontiguousarray(start, np.int16)
        if pick.shape != (len(rows), L, K):
            raise ValueError(f"balanced_gpus: start has shape {pick.shape}, expected {(len(rows), L, K)}")
    else:
        pick = np.zeros((len(rows), L, K), np.int16)
        bad = loops.by_ranges(loops.balance_kernel, L, ids, rows, home, starts, tab.rep_gpu, tab.rep_n, cc,
                              np.int64(COST_UNIT), rule != "balanced-local", base, pick)
        if max(bad) >= 0:
            raise ValueError(f"a token row has an expert id out of range [0, {tab.num_experts})")
    node = np.ascontiguousarray(tab.node_of_gpu, np.int64)
    if rule != "balanced-links" or node.size == 0 or node.min() == node.max():  # one node: nothing to lower
        return pick
    out = np.zeros_like(pick)
    bad = loops.by_ranges(loops.links_kernel, L, ids, rows, home, starts, tab.rep_gpu, tab.rep_n, base, node,
                          (weights or LinkWeights()).vector(), pick, out)
    if max(bad) >= 0:
        raise ValueError(f"a token row has an expert id out of range [0, {tab.num_experts})")
    return out


def serve_column(replica_gpus: np.ndarray, node_of_gpu: np.ndarray) -> np.ndarray:
    """int64 [W]: the GPU serving one expert for every home GPU under the nearest-static rule.

    replica_gpus: int [m] GPU of each of the expert's slots, in slot order (ascending slots). Same kernel as
    :func:`build_route_tables`, for a planner that moves one expert's replicas at a time.
    """
    g = np.asarray(replica_gpus, np.int64)
    nog = np.asarray(node_of_gpu, np.int64)
    m, W = len(g), len(nog)
    if m == 0:
        raise ValueError("serve_column: the expert has no replica")
    cand = np.arange(m, dtype=np.int64).reshape(1, 1, m)
    ok = np.zeros((1, 1, W, m), bool)
    static = np.zeros((1, 1, W), np.int64)
    nbest = np.zeros((1, 1, W), np.int64)
    loops.tier_kernel(cand, g.reshape(1, 1, m), nog, ok, static, nbest)
    return g[static[0, 0]]


def assign_slots(phy2log_l: np.ndarray, slot_gpu: np.ndarray, node_of_gpu: np.ndarray, home: np.ndarray,
                 experts: np.ndarray, rule: str = DEFAULT_RULE, base_load: np.ndarray | None = None,
                 costs: ReplicaCosts | None = None, weights: LinkWeights | None = None) -> np.ndarray:
    """Choose the physical slot that serves each token-expert pair of one micro-batch in one layer.

    phy2log_l: int [P] logical expert of each slot; slot_gpu: int [P] GPU of each slot; node_of_gpu: int [W];
    home: int [T] home GPU of each token; experts: int [T, K] router choices; base_load: optional int [W] pairs
    already assigned to each GPU in this micro-batch and layer (a micro-batch routed in several calls; the
    balanced rules see it as fixed load, so for them two calls are not one); costs: the balanced-local rule's
    locality costs (default :class:`ReplicaCosts`); weights: the balanced-links rule's (default
    :class:`LinkWeights`). Returns int64 [T, K] slots, by ``rule`` (module docstring).
    """
    check_rule(rule)
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
    if rule in BALANCED_RULES:
        T = ex.shape[0]
        gpu = balanced_gpus(ex.astype(np.int16)[:, None, :], np.arange(T), h, np.array([0, T]), tab, rule, costs,
                            load, weights)[:, 0, :].astype(np.int64)
        return tab.rep_slot[0][ex, np.argmax(tab.rep_gpu[0][ex] == gpu[:, :, None], axis=-1)] if T else \
            np.zeros(ex.shape, np.int64)
    return loops.assign_kernel(np.ascontiguousarray(ex, np.int64), np.ascontiguousarray(h), tab.kernel_serve(rule),
                                 tab.serve_slot, tab.cand_slot, tab.cand_gpu, tab.cand_ok, tab.slot_gpu, W, load)


def token_sends(gpu: np.ndarray, home: np.ndarray, node_of_gpu: np.ndarray) -> np.ndarray:
    """int64 [T, 3]: sends of each token in one layer (columns :data:`TOKEN_SEND_NAMES`).

    gpu: int [T, K] serving GPU of each of the token's pairs; home: int [T]; node_of_gpu: int [W]. Columns:
    per-GPU dedup sends inside the home node, per-GPU dedup sends to other nodes, two-hop inter-node sends.
    """
    g = np.ascontiguousarray(gpu, np.int64)
    h = np.ascontiguousarray(home, np.int64)
    if g.ndim != 2 or h.shape != (g.shape[0],):
        raise ValueError(f"token_sends: gpu [T, K] and home [T] expected, got {g.shape} and {h.shape}")
    out = np.zeros((g.shape[0], 3), np.int64)
    if g.size:
        loops.token_sends_kernel(g, h, np.ascontiguousarray(node_of_gpu, np.int64), out)
    return out


def link_counts(X: np.ndarray, gpus_per_node: int) -> np.ndarray:
    """int64 [..., 6]: counts of send (or byte) matrices X int [..., W, W] (source -> destination), columns
    :data:`COUNT_NAMES`: intra-GPU (diagonal), intra-node and inter-node totals, the largest off-diagonal entry,
    and the busiest GPU's max(sent, received) over intra-node and over inter-node links."""
    X = np.asarray(X)
    W = X.shape[-1]
    if X.shape[-2] != W or W % gpus_per_node:
        raise ValueError(f"link_counts: expected [..., W, W] with W a multiple of {gpus_per_node}, got {X.shape}")
    lead = X.shape[:-2]
    flat = np.array(X, np.int64).reshape(-1, W, W)  # a copy: the kernel clears its input
    out = np.zeros((len(flat), 6), np.int64)
    node = np.arange(W, dtype=np.int64) // gpus_per_node
    none = np.zeros((0, W), np.int64)
    col, own = np.zeros(W, np.int64), np.zeros(W, np.int64)
    for i in range(len(flat)):
        loops.counts_and_clear(flat[i], node, gpus_per_node, none, out[i], col, own)
    return out.reshape(*lead, 6)


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


def balancedness_of(pairs: np.ndarray, max_load: np.ndarray, num_gpus: int) -> np.ndarray:
    """float [...]: mean_g / max_g from the total pairs and the busiest GPU's pairs (SGLang's balancedness);
    1 where there is no load."""
    mean = np.asarray(pairs, np.float64) / num_gpus
    mx = np.asarray(max_load, np.float64)
    return np.divide(mean, mx, out=np.ones(np.broadcast(mean, mx).shape), where=mx > 0)


def imbalance_of(pairs: np.ndarray, max_load: np.ndarray, num_gpus: int) -> np.ndarray:
    """float [...]: (max_g - mean_g) / mean_g from the total and the busiest GPU's pairs (TensorRT-LLM's
    imbalance ratio); 0 where there is no load."""
    mean = np.asarray(pairs, np.float64) / num_gpus
    mx = np.asarray(max_load, np.float64)
    return np.divide(mx - mean, mean, out=np.zeros(np.broadcast(mean, mx).shape), where=mean > 0)


def balancedness(load: np.ndarray) -> np.ndarray:
    """float [...]: mean_g / max_g of load [..., W]; 1 where there is no load."""
    x = np.asarray(load, np.float64)
    W = x.shape[-1]
    return balancedness_of(x.sum(-1), x.max(-1) if W else np.zeros(x.shape[:-1]), max(W, 1))


def imbalance_ratio(load: np.ndarray) -> np.ndarray:
    """float [...]: (max_g - mean_g) / mean_g of load [..., W]; 0 where there is no load."""
    x = np.asarray(load, np.float64)
    W = x.shape[-1]
    return imbalance_of(x.sum(-1), x.max(-1) if W else np.zeros(x.shape[:-1]), max(W, 1))


def mean_balancedness(gpu_load: np.ndarray) -> float:
    """Balancedness per layer averaged over layers (the headline figure). gpu_load: float [L, W]."""
    per = balancedness(gpu_load)
    return float(per.mean()) if per.size else 1.0
