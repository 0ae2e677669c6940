"""Federation of Experts (FoE): closed forms of docs/MODEL.md and the mapping that lets the simulator replay FoE.

FoE: ``H`` groups (one per KV head), each owning ``E/H`` experts and routing ``k/H`` of them per token; the groups
sum their residuals with one cross-group all-reduce per layer. ``W`` GPUs, ``n`` per node, ``r = B_intra / B_inter``.
Volumes are in token vectors per token per layer (dispatch + combine, pair level: no dedup).

To replay an FoE model, :func:`moeplace.simulate.foe.foe_split` turns each token into ``H`` sub-tokens, one per group,
each starting on its group's GPUs (where that group's attention head lives) and selecting only its group's ``k/H``
experts; :func:`foe_plan` puts group ``h``'s experts on GPU block ``h``. The simulator's pair counts then match the
closed forms (``tests/test_foe.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeplace.placement.types import Cluster, Placement, Plan


def _check(**kw) -> None:
    for name, v in kw.items():
        if not v >= 1:
            raise ValueError(f"FoE: {name} must be >= 1, got {v!r}")


def lar_moe(W: int) -> float:
    """Local activation rate of plain MoE with uniform routing: 1/W."""
    _check(W=W)
    return 1.0 / W


def lar_foe(H: int, W: int) -> float:
    """Local activation rate of FoE: min(H/W, 1)."""
    _check(H=H, W=W)
    return min(H / W, 1.0)


def moe_all_to_all_vectors(k: int, W: int, n: int) -> tuple[float, float]:
    """(total, inter-node) vectors per token per layer of plain MoE: 2k(W-1)/W and 2k(W-n)/W."""
    _check(k=k, W=W, n=n)
    return 2 * k * (W - 1) / W, 2 * k * max(W - n, 0) / W


def foe_all_to_all_vectors(k: int, H: int, W: int) -> float:
    """FoE all-to-all vectors per token per layer: 2k(W-H)/W (0 once H >= W), intra-node when W/H <= n."""
    _check(k=k, H=H, W=W)
    return 2 * k * max(W - H, 0) / W


def foe_all_reduce_vectors(H: int, W: int) -> float:
    """FoE cross-group all-reduce vectors per token per layer: 2(p-1)/p with p = min(W, H)."""
    _check(H=H, W=W)
    p = min(W, H)
    return 2 * (p - 1) / p


def moe_foe_time_ratio(k: int, H: int, r: float, W: int | None = None, n: int | None = None) -> float:
    """T_moe / T_foe in the bandwidth model (time in units of one vector over NVLink).

    T_moe = 2k(W-n)/W * r + 2k(n-1)/W;  T_foe = 2k(W-H)/W + 2(p-1)/p * r (the all-reduce crosses nodes).
    With W None (the large-cluster limit) this is k*H*r / (k*H + r*(H-1)); k=8, H=8, r=20 gives 6.27.
    """
    _check(k=k, H=H, r=r)
    if W is None:
        return k * H * r / (k * H + r * (H - 1))
    if n is None:
        raise ValueError("moe_foe_time_ratio: give n (GPUs per node) with W")
    total, inter = moe_all_to_all_vectors(k, W, n)
    t_moe = inter * r + (total - inter)
    t_foe = foe_all_to_all_vectors(k, H, W) + foe_all_reduce_vectors(H, W) * r
    return t_moe / t_foe


@dataclass(frozen=True)
class FoeLayout:
    """Where FoE's H groups live on W GPUs (G per node), as the paper places them (docs/FOE.md, "Execution").

    W <= H: GPU g holds the H/W whole groups ``[g*H/W, (g+1)*H/W)``; every GPU holds every token (all ranks form
    one ring of the all-reduce, p = W). W > H: group h spans the ``W/H`` GPUs of block h, ``[h*W/H, (h+1)*W/H)``,
    all inside one node; a token lives on the GPU with the same index i (its *ring index*) in every block, and
    those H GPUs form its all-reduce ring (p = H). Group h's experts sit on its block (linear placement:
    expert e on GPU e // (E/W)), so the all-to-all stays inside the block.
    """

    groups: int  # H
    world_size: int  # W
    gpus_per_node: int  # G

    def __post_init__(self) -> None:
        H, W, G = self.groups, self.world_size, self.gpus_per_node
        _check(H=H, W=W, G=G)
        if W % H and H % W:
            raise ValueError(f"FoE: {W} GPUs and H={H} groups: one must divide the other")
        if W > H and (W // H > G or G % (W // H)):
            raise ValueError(f"FoE: with H={H} groups on {W} GPUs a group spans {W // H} GPUs, which must lie in "
                             f"one node, but a node has {G} GPUs; use a cluster with at least {W // H} GPUs per "
                             f"node (a multiple of {W // H}), or a model with more groups")

    @property
    def block_size(self) -> int:
        """GPUs one group spans (1 when W <= H)."""
        return max(self.world_size // self.groups, 1)

    @property
    def groups_per_gpu(self) -> int:
        return max(self.groups // self.world_size, 1)

    @property
    def ring_size(self) -> int:
        """p = min(W, H): participants of each all-reduce."""
        return min(self.world_size, self.groups)

    def gpu_groups(self, gpu: int) -> list[int]:
        """The groups GPU ``gpu`` holds."""
        if self.world_size >= self.groups:
            return [gpu // self.block_size]
        return list(range(gpu * self.groups_per_gpu, (gpu + 1) * self.groups_per_gpu))

    def block(self, gpu: int) -> list[int]:
        """The GPUs sharing ``gpu``'s groups (its all-to-all group), in rank order."""
        b = self.block_size
        return list(range(gpu // b * b, gpu // b * b + b))

    def ring(self, gpu: int) -> list[int]:
        """The GPUs holding the same tokens as ``gpu`` (its all-reduce ring), in group order."""
        if self.world_size <= self.groups:
            return list(range(self.world_size))
        b = self.block_size
        return [h * b + gpu % b for h in range(self.groups)]

    def ring_index(self, gpu):
        """Which tokens ``gpu`` holds: those with this ring index (0 when W <= H: all). ``gpu``: an int, or an
        int array (e.g. the plan homes of requests) -> the ring index of each."""
        return gpu % self.block_size  # block_size is 1 when W <= H

    def blocks(self) -> list[list[int]]:
        return [self.block(g) for g in range(0, self.world_size, self.block_size)]

    def rings(self) -> list[list[int]]:
        return [self.ring(i) for i in range(self.block_size)]  # one ring per ring index


def ring_chunks(rows: int, p: int) -> np.ndarray:
    """int64 [p]: rows of each chunk when a ring all-reduce of ``rows`` rows on p ranks splits it (the first
    ``rows % p`` chunks one row longer)."""
    _check(p=p)
    return np.array([rows // p + (c < rows % p) for c in range(p)], np.int64)


def ring_steps(p: int) -> list[tuple[str, np.ndarray]]:
    """The ring all-reduce schedule: 2(p-1) steps ``(stage, chunk)``; at each step ring position j sends chunk
    ``chunk[j]`` to position (j+1) % p, which adds it to its own ("reduce", the reduce-scatter) or stores it
    ("gather", the all-gather). After the p-1 reduce steps position j holds the sum of chunk (j+1) % p."""
    _check(p=p)
    j = np.arange(p)
    return [("reduce", (j - s) % p) for s in range(p - 1)] + [("gather", (j + 1 - s) % p) for s in range(p - 1)]


def ring_send_rows(rows: int, p: int) -> np.ndarray:
    """int64 [p]: rows ring position j sends to position (j+1) % p over a whole all-reduce of ``rows`` rows.

    Each position sends 2(p-1) chunks; summed over positions that is 2(p-1) * rows, i.e. 2(p-1)/p rows per row
    held per participant, the closed form of :func:`foe_all_reduce_vectors`."""
    chunks = ring_chunks(rows, p)
    return np.sum([chunks[c] for _, c in ring_steps(p)], axis=0).astype(np.int64) if p > 1 \
        else np.zeros(1, np.int64)


def allreduce_bytes(rows_per_ring: np.ndarray, layout: FoeLayout, row_bytes: int) -> np.ndarray:
    """int64 [W, W]: bytes each GPU sends to each other GPU in one layer's cross-group all-reduce, when ring i
    (``layout.rings()[i]``) reduces ``rows_per_ring[i]`` rows of ``row_bytes`` bytes."""
    W = layout.world_size
    out = np.zeros((W, W), np.int64)
    for ring, rows in zip(layout.rings(), np.asarray(rows_per_ring, np.int64).tolist(), strict=True):
        p = len(ring)
        if p < 2:
            continue
        sent = ring_send_rows(rows, p)
        for j in range(p):
            out[ring[j], ring[(j + 1) % p]] += sent[j] * row_bytes
    return out


def expert_group(expert_ids: np.ndarray, num_experts: int, num_groups: int) -> np.ndarray:
    """FoE group of each expert id: contiguous blocks of E/H experts."""
    if num_experts % num_groups:
        raise ValueError(f"FoE: {num_experts} experts do not split into {num_groups} equal groups")
    return np.asarray(expert_ids) // (num_experts // num_groups)


def foe_plan(cluster: Cluster, num_layers: int, num_experts: int, num_groups: int, request_ids: np.ndarray,
             ring_index: np.ndarray | None = None) -> Plan:
    """The plan of :func:`moeplace.simulate.foe.foe_split`'s sub-requests: group h's experts on GPU block h
    (linear placement of contiguous groups); sub-request r*H + h homed on the GPU of block h with ring index
    ``ring_index[r]`` (W > H; default r % (W/H)) or on the GPU holding group h (W <= H).

    request_ids: int [R] sub-request ids r*H + h; ring_index: int [R] ring index of each sub-request's original
    request r (None: r % block size)."""
    W, H = cluster.world_size, int(num_groups)
    if W % H and H % W:
        raise ValueError(f"FoE: {W} GPUs and H={H} groups: one must divide the other")
    placement = Placement.linear(num_layers, num_experts, W)
    rid = np.asarray(request_ids, np.int64)
    h, r = rid % H, rid // H
    if W >= H:
        per = W // H
        ring = r % per if ring_index is None else np.asarray(ring_index, np.int64)
        home = h * per + ring
    else:
        home = h // (H // W)
    return Plan(placement, cluster, {int(a): int(b) for a, b in zip(rid, home, strict=True)}, strategy=f"foe-H{H}")


def foe_per_gpu_vectors(k: int, H: int, W: int, n: int) -> dict[str, float]:
    """What the busiest GPU of FoE's placement (:class:`FoeLayout`) sends per layer, in vectors per ``T/W`` tokens
    (the tokens one GPU holds in plain MoE), next to the closed form's per-token count.

    With W >= H a GPU holds ``H*T/W`` rows (its share of every token of its group); its ring all-reduce (p ranks)
    sends ``2(p-1)/p`` of them, i.e. ``2(p-1)`` vectors per ``T/W`` tokens (W < H: it holds all T rows, p = W,
    the same ``2(p-1)``), where :func:`foe_all_reduce_vectors` counts ``2(p-1)/p`` per token. Its all-to-all is
    the closed form's ``2k(W-H)/W``, inside its node.

    Returns ``alltoall`` (intra-node vectors), ``allreduce`` (vectors), ``allreduce_inter_node`` (1.0 when some
    ring hop crosses nodes: a ring moves in lock step, so its slowest hop sets every step's time, else 0.0) and
    ``allreduce_closed_form`` (:func:`foe_all_reduce_vectors`). ValueError where :class:`FoeLayout` refuses.
    """
    _check(k=k)
    lay = FoeLayout(H, W, n)
    p = lay.ring_size
    crosses = any(ring[j] // n != ring[(j + 1) % p] // n for ring in lay.rings() for j in range(p)) if p > 1 \
        else False
    return {"alltoall": foe_all_to_all_vectors(k, H, W), "allreduce": float(2 * (p - 1)),
            "allreduce_inter_node": 1.0 if crosses else 0.0, "allreduce_closed_form": foe_all_reduce_vectors(H, W)}


def moe_foe_time_ratio_per_gpu(k: int, H: int, r: float, W: int, n: int) -> float:
    """T_moe / T_foe per GPU in the bandwidth model (time in units of one vector over the intra-node link):
    T_moe as :func:`moe_foe_time_ratio` (a GPU's ``T/W`` tokens, pair level), T_foe from
    :func:`foe_per_gpu_vectors`: ``2k(W-H)/W + 2(p-1) * (r if a ring hop crosses nodes else 1)``.

    2x2 (W=4, n=2), k=4: H=2 gives (4r + 2) / (4 + 2r); H=4 gives (4r + 2) / (6r). 4x1, H=4: 6r / 6r = 1."""
    _check(r=r)
    total, inter = moe_all_to_all_vectors(k, W, n)
    t_moe = inter * r + (total - inter)
    f = foe_per_gpu_vectors(k, H, W, n)
    t_foe = f["alltoall"] + f["allreduce"] * (r if f["allreduce_inter_node"] else 1.0)
    return t_moe / t_foe


def bandwidth_seconds(sent: np.ndarray, gpus_per_node: int, intra_bytes_per_s: float, inter_bytes_per_s: float,
                      node_link: bool = False) -> float:
    """Time to move measured bytes at given link rates: the sum over (micro-batch, layer) of the busiest GPU's
    ``intra-node bytes sent / intra rate + inter-node bytes sent / inter rate`` (no fixed per-call cost).

    sent: int [M, L, W, W] bytes [source, destination] (W x W for one step); inter_bytes_per_s: one GPU's rate to
    another node when all G GPUs of its node send at once. node_link: the node's link is one shared pipe (tc
    shapes each node's link, not each GPU): a GPU's inter-node term is its node's inter-node bytes over G times
    the per-GPU rate, so a GPU that sends alone on its node's link gets all of it."""
    x = np.asarray(sent, np.float64)
    if x.ndim == 2:
        x = x[None, None]
    W = x.shape[-1]
    G = int(gpus_per_node)
    if W % G:
        raise ValueError(f"bandwidth_seconds: {W} ranks are not a multiple of {G} GPUs per node")
    node = np.arange(W) // G
    cross = node[:, None] != node[None, :]
    inter = (x * cross).sum(-1)  # [M, L, W]
    intra = (x * (~cross & ~np.eye(W, dtype=bool))).sum(-1)
    if node_link:
        per_node = inter.reshape(*inter.shape[:-1], W // G, G).sum(-1)  # [M, L, N]
        inter_t = np.repeat(per_node, G, axis=-1) / (G * inter_bytes_per_s)
    else:
        inter_t = inter / inter_bytes_per_s
    t = intra / intra_bytes_per_s + inter_t  # [M, L, W]
    return float(t.max(-1).sum())
