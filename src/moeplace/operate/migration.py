"""Moving from one placement to another: minimal-move matching, the migration plan, and what it costs.

Shape legend: L = MoE layers, E = logical experts, P = physical slots, W = GPUs, S = P / W slots per GPU.

- :func:`match_gpus`: a new placement's GPUs are interchangeable bins (EPLB's output is one arbitrary labelling);
  ``scipy.optimize.linear_sum_assignment`` relabels them so that the fewest experts change GPU, then every expert
  that stays on a GPU keeps its old slot (:func:`preserve_slots`, what vLLM does).
- :func:`migration_plan`: each changed slot ``(l, p)`` receives expert ``new[l, p]`` from a GPU that held it in the
  old placement of layer l: its own GPU when it already holds it (a local copy, no link), else a GPU of the same
  node (NVLink), else another node; ties go to the source that has sent the least so far.
- Cost: ``expert_bytes`` per changed slot on its link. Transfers run in parallel over all links, intra-node and
  inter-node at once, so the time is ``max(max_g intra_g / B_intra, max_g inter_g / B_inter)``, where ``x_g`` is
  the larger of the bytes GPU g sends and receives over that link class (plus one latency per class used).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from moeplace.deploy import ModelPreset
from moeplace.placement import Cluster


def expert_bytes(preset: ModelPreset, weight_bytes: float = 2.0) -> float:
    """Bytes of one routed expert's weights: gate, up and down projections, ``3 x hidden x intermediate``
    parameters at ``weight_bytes`` each (2 = bf16)."""
    if not weight_bytes > 0:
        raise ValueError(f"weight_bytes must be > 0, got {weight_bytes}")
    return 3.0 * preset.hidden_size * preset.moe_intermediate_size * weight_bytes


def _gpu_sets(p2l_l: np.ndarray, W: int, E: int) -> np.ndarray:
    """bool [W, E]: which experts each GPU holds in one layer. p2l_l: int [P]."""
    S = len(p2l_l) // W
    m = np.zeros((W, E), bool)
    m[np.arange(len(p2l_l)) // S, p2l_l] = True
    return m


def preserve_slots(old: np.ndarray, new: np.ndarray, num_gpus: int) -> np.ndarray:
    """int64 [L, P]: ``new`` with each GPU's slots reordered so that experts the GPU already held keep their old
    slot (vLLM's slot preservation). GPUs keep their labels; only slots inside a GPU move.

    old, new: int [L, P]."""
    old = np.asarray(old, np.int64)
    new = np.asarray(new, np.int64)
    L, P = new.shape
    S = P // num_gpus
    out = new.copy()
    for li in range(L):
        for g in range(num_gpus):
            sl = slice(g * S, (g + 1) * S)
            o, n = old[li, sl], new[li, sl]
            row = np.full(S, -1, np.int64)
            rest = list(n)
            for i, e in enumerate(o.tolist()):
                if e in rest:
                    row[i] = e
                    rest.remove(e)
            free = np.flatnonzero(row < 0)
            row[free] = rest
            out[li, sl] = row
    return out


def match_gpus(old: np.ndarray, new: np.ndarray, num_gpus: int) -> np.ndarray:
    """int64 [L, P]: ``new`` with its GPUs relabelled per layer so that the fewest experts change GPU
    (``linear_sum_assignment`` on the W x W count of experts each new GPU lacks on each old GPU), then slots
    preserved inside each GPU (:func:`preserve_slots`). Loads per GPU are unchanged: only labels move.

    old, new: int [L, P]."""
    old = np.asarray(old, np.int64)
    new = np.asarray(new, np.int64)
    L, P = new.shape
    W = num_gpus
    S = P // W
    E = int(max(old.max(), new.max())) + 1
    out = np.empty_like(new)
    for li in range(L):
        mo, mn = _gpu_sets(old[li], W, E), _gpu_sets(new[li], W, E)
        cost = (mn[None, :, :] & ~mo[:, None, :]).sum(2)  # [old gpu, new gpu]: experts to bring in
        rows, cols = linear_sum_assignment(cost)
        for g_old, g_new in zip(rows.tolist(), cols.tolist(), strict=True):
            out[li, g_old * S:(g_old + 1) * S] = new[li, g_new * S:(g_new + 1) * S]
    return preserve_slots(old, out, W)


@dataclass(frozen=True)
class Move:
    """One changed slot."""

    layer: int
    slot: int
    expert: int  # the expert the slot receives
    old_expert: int  # the expert it held
    src_gpu: int  # where the weights come from (== dst_gpu: a local copy)
    dst_gpu: int
    link: str  # "local", "intra_node" or "inter_node"
    bytes: float  # bytes over the link (0 for a local copy)

    def to_json(self) -> dict:
        return {"layer": self.layer, "slot": self.slot, "expert": self.expert, "old_expert": self.old_expert,
                "from_gpu": self.src_gpu, "to_gpu": self.dst_gpu, "link": self.link, "bytes": self.bytes}


@dataclass(frozen=True)
class MigrationPlan:
    """Which slot gets which expert, from where, and the bytes per link."""

    moves: tuple[Move, ...]
    link_bytes: np.ndarray  # float64 [W, W]: bytes from GPU a to GPU b (diagonal 0)
    expert_bytes: float
    seconds: float  # predicted transfer time (module docstring)

    @property
    def bytes(self) -> float:
        """Bytes over links (local copies excluded)."""
        return float(self.link_bytes.sum())

    @property
    def layers(self) -> list[int]:
        return sorted({m.layer for m in self.moves})

    def to_json(self) -> dict:
        nz = np.argwhere(self.link_bytes > 0)
        return {"moves": [m.to_json() for m in self.moves], "num_moves": len(self.moves), "layers": self.layers,
                "expert_bytes": self.expert_bytes, "bytes": self.bytes, "seconds": self.seconds,
                "link_bytes": [{"from_gpu": int(a), "to_gpu": int(b), "bytes": float(self.link_bytes[a, b])}
                               for a, b in nz.tolist()]}


def transfer_seconds(link_bytes: np.ndarray, cluster: Cluster) -> float:
    """Seconds to move ``link_bytes`` float [W, W] when all links run at once (module docstring)."""
    X = np.asarray(link_bytes, np.float64)
    W, G = cluster.world_size, cluster.gpus_per_node
    node = np.arange(W) // G
    same = node[:, None] == node[None, :]
    out = 0.0
    for mask, bw, alpha in ((same, cluster.intra_bw, cluster.intra_latency),
                            (~same, cluster.inter_bw, cluster.inter_latency)):
        Y = np.where(mask, X, 0.0)
        np.fill_diagonal(Y, 0.0)
        busiest = max(Y.sum(1).max(), Y.sum(0).max()) if W else 0.0
        if busiest > 0:
            out = max(out, alpha + busiest / bw)
    return float(out)


def migration_plan(old: np.ndarray, new: np.ndarray, cluster: Cluster, expert_size: float) -> MigrationPlan:
    """The moves from placement ``old`` to ``new`` (int [L, P] each) and their cost (module docstring)."""
    old = np.asarray(old, np.int64)
    new = np.asarray(new, np.int64)
    if old.shape != new.shape:
        raise ValueError(f"migration: old placement {old.shape} and new {new.shape} differ in shape")
    W, G = cluster.world_size, cluster.gpus_per_node
    L, P = new.shape
    S = P // W
    sent = np.zeros(W)
    X = np.zeros((W, W))
    moves = []
    for li, p in np.argwhere(old != new).tolist():
        e, dst = int(new[li, p]), p // S
        holders = np.flatnonzero(old[li] == e) // S
        if len(holders) == 0:
            raise ValueError(f"migration: expert {e} has no replica in layer {li} of the old placement")
        if dst in holders:
            src, link, nbytes = dst, "local", 0.0
        else:
            near = holders[holders // G == dst // G]
            pool = near if len(near) else holders
            src = int(pool[np.argmin(sent[pool])])
            link = "intra_node" if len(near) else "inter_node"
            nbytes = float(expert_size)
            sent[src] += nbytes
            X[src, dst] += nbytes
        moves.append(Move(int(li), int(p), e, int(old[li, p]), int(src), int(dst), link, nbytes))
    return MigrationPlan(tuple(moves), X, float(expert_size), transfer_seconds(X, cluster))
