"""The ``foe`` strategy: a Federation-of-Experts model's groups placed as the paper places them.

Shape legend: L = MoE layers, E = logical experts, W = GPUs, G = GPUs per node, H = FoE groups, Rq = requests.

Placement (:class:`moeplace.placement.foe.FoeLayout`): expert e on slot e (group h's E/H experts are contiguous), so
with W <= H every GPU holds H/W whole groups and with W > H group h spans the W/H GPUs of block h, inside one node. No
replicas: a replica on another block would pull the group's all-to-all out of it. The request "home" of an FoE
plan is its *ring index*: the GPU index inside every block that holds the request's tokens (0 when W <= H, where
every GPU holds every token); requests are spread over ring indices by token count (largest first, to the index
with the fewest tokens so far), new requests go round-robin.
"""

from __future__ import annotations

import numpy as np

from moeplace.placement import Cluster
from moeplace.placement.foe import FoeLayout
from moeplace.plan.base import StrategyResult, Workload


def balance_rings(tokens: np.ndarray, rings: int) -> np.ndarray:
    """int64 [Rq]: ring index of each request, largest token count first to the ring with the fewest tokens so
    far (ties: lower request index, lower ring). tokens: int [Rq] token rows per request."""
    t = np.asarray(tokens, np.int64)
    out = np.zeros(len(t), np.int64)
    load = np.zeros(rings, np.int64)
    for r in np.lexsort((np.arange(len(t)), -t)):  # largest first; stable by index
        i = int(np.argmin(load))
        out[r] = i
        load[i] += t[r]
    return out


def plan_foe(work: Workload, cluster: Cluster, num_redundant: int) -> StrategyResult:
    """FoE placement and ring indices for ``work`` (a trace of an FoE model: ``work.foe_groups`` > 1)."""
    H = int(work.foe_groups)
    if H <= 1:
        raise ValueError("strategy 'foe' places a Federation-of-Experts model's groups, but this trace is of a plain "
                         "MoE (its metadata has no foe_groups > 1); record an FoE model (docs/FOE.md) or pick "
                         "another strategy")
    if num_redundant:
        raise ValueError(f"strategy 'foe' keeps each group's experts on its own GPUs, without replicas; got "
                         f"--redundant {num_redundant}, use 0")
    layout = FoeLayout(H, cluster.world_size, cluster.gpus_per_node)
    E, W = work.num_experts, cluster.world_size
    if E % W:
        raise ValueError(f"strategy 'foe': {E} experts do not split evenly over {W} GPUs")
    phy2log = np.tile(np.arange(E, dtype=np.int64), (work.num_layers, 1))
    homes = None
    if work.has_tokens:
        tokens = np.bincount(work.token_request, minlength=work.num_requests)
        homes = balance_rings(tokens, layout.block_size)
    extra = {"foe_groups": H, "block_size": layout.block_size, "ring_size": layout.ring_size,
             "groups_per_gpu": layout.groups_per_gpu}
    return StrategyResult(phy2log, homes, extra=extra, foe_groups=H)
