"""DeepSeek's EPLB in plain torch, written for bench/eplb_speed.py as the baseline a user would otherwise run.

Written from the published description of the algorithm (https://github.com/deepseek-ai/EPLB, README:
"hierarchical load balancing" and "global load balancing"), not from its code:

- Hierarchical policy, when the expert groups divide evenly among the nodes: (1) pack the expert groups onto the
  nodes so that node loads are balanced; (2) inside each node, replicate experts: each redundant slot goes to the
  expert with the largest load per replica; (3) pack each node's physical experts onto its GPUs, balancing GPU load.
- Global policy, otherwise: replicate over all experts, then pack all physical experts onto all GPUs.
- Balanced packing: items heaviest first, each into the lightest pack that still has room, every pack getting the
  same number of items. Like the published version it loops over rows (layers) in Python and may place two
  replicas of one expert on one GPU.

Shape legend: L = MoE layers, E = logical experts, P = physical slots, N = nodes, W = GPUs, X = independent rows.
"""

from __future__ import annotations

import torch


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: float [X, n]. Returns (pack [X, n], rank [X, n]): each item's pack and its place inside it."""
    X, n = weight.shape
    per = n // num_packs
    if per == 1:
        return torch.arange(n).expand(X, n).clone(), torch.zeros(X, n, dtype=torch.int64)
    order = torch.argsort(weight, dim=-1, descending=True).tolist()
    w = weight.tolist()
    pack = torch.empty(X, n, dtype=torch.int64)
    rank = torch.empty(X, n, dtype=torch.int64)
    for x in range(X):
        load = [0.0] * num_packs
        count = [0] * num_packs
        pk, rk = [0] * n, [0] * n
        for item in order[x]:
            p = min((q for q in range(num_packs) if count[q] < per), key=load.__getitem__)
            pk[item], rk[item] = p, count[p]
            load[p] += w[x][item]
            count[p] += 1
        pack[x] = torch.tensor(pk)
        rank[x] = torch.tensor(rk)
    return pack, rank


def replicate(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: float [X, n] -> (phy2log [X, num_phy], count [X, n]): slot i < n holds expert i; every further slot
    goes to the expert with the largest weight per replica so far."""
    X, n = weight.shape
    phy2log = torch.arange(num_phy).repeat(X, 1)
    count = torch.ones(X, n, dtype=torch.int64)
    rows = torch.arange(X)
    for i in range(n, num_phy):
        hot = (weight / count).argmax(dim=-1)
        phy2log[:, i] = hot
        count[rows, hot] += 1
    return phy2log, count


def inverse(perm: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of permutations perm [X, n]."""
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1]).expand_as(perm).contiguous())
    return inv


def rebalance_hierarchical(load: torch.Tensor, num_slots: int, num_groups: int, num_nodes: int,
                           num_gpus: int) -> torch.Tensor:
    """load: float [L, E] -> phy2log int64 [L, P]; slot p on GPU p // (P / W), GPU g on node g // (W / N)."""
    L, E = load.shape
    N, W, P = num_nodes, num_gpus, num_slots
    gsize, per_node = E // num_groups, num_groups // N
    # 1. groups -> nodes; relabel experts node-major ("node expert" m = node * E/N + place in node)
    gpack, grank = balanced_packing(load.view(L, num_groups, gsize).sum(-1), N)
    log2m = ((gpack * per_node + grank) * gsize).unsqueeze(-1) + torch.arange(gsize)
    m2log = inverse(log2m.flatten(-2))
    # 2. replicate inside each node: one row per (layer, node)
    w_m = load.gather(-1, m2log).view(L * N, E // N)
    phy2m, count = replicate(w_m, P // N)
    # 3. the node's physical experts -> its GPUs
    w_phy = (w_m / count).gather(-1, phy2m)
    pack, rank = balanced_packing(w_phy, W // N)
    slot_of_phy = pack * (P // W) + rank
    slot2m = phy2m.gather(-1, inverse(slot_of_phy))
    slot2m = (slot2m.view(L, N, P // N) + (torch.arange(N) * (E // N)).view(1, N, 1)).flatten(-2)
    return m2log.gather(-1, slot2m)


def rebalance(load: torch.Tensor, num_slots: int, num_groups: int, num_nodes: int, num_gpus: int) -> torch.Tensor:
    """Hierarchical policy when ``num_groups % num_nodes == 0``, else the global one. load: float [L, E]."""
    load = load.float().cpu()
    if num_groups % num_nodes == 0:
        return rebalance_hierarchical(load, num_slots, num_groups, num_nodes, num_gpus)
    return rebalance_hierarchical(load, num_slots, 1, 1, num_gpus)
