"""The engines' default placements: baselines every other strategy is measured against.

Shape legend: L = MoE layers, E = logical experts, P = physical slots (E + R), W = GPUs.
"""

from __future__ import annotations

import numpy as np

from moeplace.placement import Cluster, linear_phy2log
from moeplace.plan.base import StrategyResult, Workload, check_sizes


def round_robin_phy2log(num_layers: int, num_experts: int, num_slots: int, num_gpus: int) -> np.ndarray:
    """int [L, P]: expert e on GPU e % W (consecutive experts on different GPUs).

    Physical item i (i < P) holds expert i % E, and goes to GPU i % W at rank i // W. When W divides E the replica
    items would land on the GPU of their original, so the c-th copy round (items cE .. cE + E - 1) is shifted by c:
    item i holds expert (i + i // E) % E, and copy c of an expert sits c GPUs before copy 0.
    """
    P, W = num_slots, num_gpus
    S = P // W
    item = np.arange(P)
    expert = item % num_experts
    if num_experts % W == 0 and P > num_experts:
        expert = (item + item // num_experts) % num_experts
    row = np.empty(P, np.int64)
    row[(item % W) * S + item // W] = expert
    return np.tile(row, (num_layers, 1))


def plan_linear(work: Workload, cluster: Cluster, num_redundant: int) -> StrategyResult:
    """Registry adapter for :func:`moeplace.placement.linear_phy2log`; homes round-robin."""
    P, _S = check_sizes(work.num_layers, work.num_experts, cluster, num_redundant)
    return StrategyResult(linear_phy2log(work.num_layers, work.num_experts, P))


def plan_round_robin(work: Workload, cluster: Cluster, num_redundant: int) -> StrategyResult:
    """Registry adapter for :func:`round_robin_phy2log`; homes round-robin."""
    P, _S = check_sizes(work.num_layers, work.num_experts, cluster, num_redundant)
    return StrategyResult(round_robin_phy2log(work.num_layers, work.num_experts, P, cluster.world_size))
