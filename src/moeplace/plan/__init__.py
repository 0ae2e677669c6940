"""The planner: expert placement, replication and request grouping strategies, in a registry keyed by name.

Shape legend: L = MoE layers, E = logical experts, P = physical slots (E + R redundant), W = GPUs, S = P / W slots
per GPU, R = redundant slots per layer, Rq = requests of the planning window.

Glossary with numbers: DeepSeek-V3 has 256 logical experts per MoE layer; with 32 redundant slots there are 288
physical slots, over 32 GPUs (4 nodes x 8) = 9 slots per GPU. A strategy returns ``phy2log`` [L, P] (slot ->
expert, every expert at least once, never two replicas of one expert on one GPU) and optionally homes for the
planning window's requests plus a grouper that gives new requests a home from their prefill routing.

Every strategy has the signature ``fn(work: Workload, cluster: Cluster, num_redundant: int, **params) ->
StrategyResult``; :func:`make_plan` runs one, times it and wraps the result in a :class:`moeplace.placement.Plan`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moeplace.placement import Cluster, GrouperSpec, Placement, Plan, check_slot_count, typed_from_extra
from moeplace.plan.activation_clusters import plan_activation_clusters
from moeplace.plan.base import StrategyResult, Workload, workload_from_tokens
from moeplace.plan.eplb import plan_eplb
from moeplace.plan.foe import plan_foe
from moeplace.plan.graph import plan_coactivation, plan_hypergraph
from moeplace.plan.joint import plan_joint
from moeplace.plan.linear import plan_linear, plan_round_robin


@dataclass(frozen=True)
class Strategy:
    """One registered planning strategy."""

    name: str
    fn: Callable[..., StrategyResult]
    needs_tokens: bool  # True: needs per-token routing (a load matrix is not enough)
    groups_requests: bool  # True: chooses request homes (and gives new requests one online)
    summary: str  # one line for the CLI


_ALL = (
    Strategy("linear", plan_linear, False, False, "expert e on slot e (engines' default)"),
    Strategy("round_robin", plan_round_robin, False, False, "expert e on GPU e % W"),
    Strategy("eplb", plan_eplb, False, False, "DeepSeek EPLB: replicate hot experts, balanced packing"),
    Strategy("activation-clusters", plan_activation_clusters, True, True,
             "published method: K-means request clusters -> nodes, experts to the node using them most"),
    Strategy("coactivation", plan_coactivation, True, False, "METIS on the expert co-activation graph"),
    Strategy("hypergraph", plan_hypergraph, True, False, "Mt-KaHyPar on token expert-set hyperedges (connectivity)"),
    Strategy("joint", plan_joint, True, True,
             "ours: placement, replication and grouping together for inter-node bytes under a balance floor"),
    Strategy("foe", plan_foe, False, False,
             "Federation of Experts: each group's experts on its own GPUs (FoE traces only; docs/FOE.md)"),
)

STRATEGIES: dict[str, Strategy] = {s.name: s for s in _ALL}
FOE_STRATEGIES = ("foe",)  # plans for an FoE model's execution (run-ep); compare and the demo score plain MoE
MOE_STRATEGIES: tuple[str, ...] = tuple(n for n in STRATEGIES if n not in FOE_STRATEGIES)


def _check_registry() -> None:
    assert len(STRATEGIES) == len(_ALL), "duplicate strategy name"
    for name, s in STRATEGIES.items():
        assert name and name == name.strip().lower(), f"strategy name {name!r} must be lower case"
        assert callable(s.fn), f"strategy {name!r} has no callable"
        assert s.summary, f"strategy {name!r} has no summary"


_check_registry()


def get_strategy(name: str) -> Strategy:
    """The registered strategy ``name``; ValueError listing the known names otherwise."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}") from None


def make_plan(strategy: str, work: Workload, cluster: Cluster, num_redundant: int = 0, planned_on: str = "",
              **params: object) -> Plan:
    """Run one strategy on a planning window and return a validated Plan.

    ``plan_seconds`` is the time spent inside the strategy. Homes of the window's requests are recorded in
    ``plan.homes``, a grouper for new requests in ``plan.grouper``; the balance outcome, any fallback and the cost
    model go to the plan's typed fields (from the StrategyResult's fields, else from its legacy ``extra`` keys).
    """
    s = get_strategy(strategy)
    if not work.load.sum() > 0:
        raise ValueError(f"{planned_on or 'the planning window'}: no routed tokens to plan from (an empty trace, or "
                         "one a killed import left behind); record or import routing first")
    check_slot_count(work.num_experts, num_redundant, cluster.world_size, work.num_layers)
    if s.needs_tokens and not work.has_tokens:
        raise ValueError(
            f"strategy {strategy!r} needs per-token routing (it uses which experts each token selects together "
            "or each request's activations); this input is a load matrix or a counts-only trace. "
            "Use linear, round_robin or eplb, or record/import a per-token trace"
        )
    t0 = time.perf_counter()
    res = s.fn(work, cluster, num_redundant, **params)
    dt = time.perf_counter() - t0
    placement = Placement(np.asarray(res.phy2log, np.int64), work.num_experts, cluster.world_size)
    homes: dict[int, int] = {}
    if res.homes is not None and work.request_ids is not None:
        homes = {int(r): int(g) for r, g in zip(work.request_ids.tolist(), np.asarray(res.homes).tolist(),
                                                 strict=True)}
    t = typed_from_extra(dict(res.extra), strategy, f"strategy {strategy!r}: extra")
    grouper = GrouperSpec.from_json(res.grouper.to_json()) if res.grouper is not None else None
    return Plan(placement, cluster, homes, strategy, dt, planned_on, t.extra, grouper,
                res.balance or t.balance, res.fallback or t.fallback, res.cost_model or t.cost_model,
                foe_groups=res.foe_groups)


__all__ = ["FOE_STRATEGIES", "MOE_STRATEGIES", "STRATEGIES", "Strategy", "StrategyResult", "Workload", "get_strategy",
           "make_plan", "workload_from_tokens"]
