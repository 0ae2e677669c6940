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

Sends. A token's hidden vector goes once to every GPU other than its home that serves one of its experts
(per-GPU dedup), or once per remote node (two-hop, then NVLink forwarding); a send is intra-node when both GPUs
share a node, else inter-node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeplace.placement import log2phy_table
from moeplace.simulate import kernels

RULES = ("nearest-least-loaded", "nearest-static")
DEFAULT_RULE = "nearest-least-loaded"
DEDUP_MODES = ("per_gpu", "two_hop")
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

    @property
    def num_layers(self) -> int:
        return self.cand_slot.shape[0]

    def serve_table(self, layer: int) -> np.ndarray:
        """int64 [W, E]: the GPU serving expert e for a token homed on GPU h in ``layer`` (nearest-static)."""
        E, W = self.num_experts, self.num_gpus
        return self.serve_gpu.reshape(-1, E, W)[layer].T.astype(np.int64)

    def kernel_serve(self, rule: str) -> np.ndarray:
        """int16 [L*E*W]: the serving GPU of each (layer, expert, home), -1 where ``rule`` chooses per pair."""
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
    kernels.tier_kernel(cand, cgpu, nog, ok, static, nbest)
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
    )


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
    kernels.tier_kernel(cand, g.reshape(1, 1, m), nog, ok, static, nbest)
    return g[static[0, 0]]


def assign_slots(phy2log_l: np.ndarray, slot_gpu: np.ndarray, node_of_gpu: np.ndarray, home: np.ndarray,
                 experts: np.ndarray, rule: str = DEFAULT_RULE, base_load: np.ndarray | None = None) -> np.ndarray:
    """Choose the physical slot that serves each token-expert pair of one micro-batch in one layer.

    phy2log_l: int [P] logical expert of each slot; slot_gpu: int [P] GPU of each slot; node_of_gpu: int [W];
    home: int [T] home GPU of each token; experts: int [T, K] router choices; base_load: optional int [W] pairs
    already assigned to each GPU in this micro-batch and layer (a micro-batch routed in several calls).
    Returns int64 [T, K] slots, by ``rule`` (see the module docstring).
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
    return kernels.assign_kernel(np.ascontiguousarray(ex, np.int64), np.ascontiguousarray(h), tab.kernel_serve(rule),
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
        kernels.token_sends_kernel(g, h, np.ascontiguousarray(node_of_gpu, np.int64), out)
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
        kernels.counts_and_clear(flat[i], node, gpus_per_node, none, out[i], col, own)
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
