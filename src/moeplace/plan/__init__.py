"""The planner: expert placement, replication and request grouping strategies, in a registry keyed by name.

Shape legend: L = MoE layers, E = logical experts, P = physical slots (E + R redundant), W = GPUs, S = P / W slots
per GPU, R = redundant slots per layer, Rq = requests of the planning window.

Glossary with numbers: DeepSeek-V3 has 256 logical experts per MoE layer; with 32 redundant slots there are 288
physical slots, over 32 GPUs (4 nodes x 8) = 9 slots per GPU. A strategy returns ``phy2log`` [L, P] (slot ->
expert, every expert at least once, never two replicas of one expert on one GPU) and optionally homes for the
planning window's requests plus a grouper that gives new requests a home from their prefill routing.

Every strategy has the signature ``fn(work: Workload, cluster: Cluster, num_redundant: int, **params) ->
StrategyResult`` and declares its keyword parameters (:class:`moeplace.params.Param`: name, type, range or
choices, default, help) in its registry entry; :func:`make_plan` checks the keywords against them (an unknown or
inapplicable one is a ValueError naming it and the strategy), runs it, times it and wraps the result in a
:class:`moeplace.placement.Plan`. Parameters named in :data:`moeplace.deploy.TIME_PARAMS` (hidden size, element
bytes, kernel mode, replica rule, overlap, batch sizes) are the time model's: they come from a
:class:`moeplace.deploy.Deployment` (the CLI's deployment option group); the others become ``moeplace plan`` flags.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moeplace.deploy import TIME_PARAMS, Deployment
from moeplace.params import Param, bind, check_declared
from moeplace.placement import Cluster, Placement, Plan, check_slot_count, typed_from_extra
from moeplace.placement.grouper import DEFAULT_ROUND
from moeplace.plan.activation_clusters import plan_activation_clusters
from moeplace.plan.base import StrategyResult, Workload, workload_from_tokens
from moeplace.plan.eplb import plan_eplb
from moeplace.plan.foe import plan_foe
from moeplace.plan.graph import plan_coactivation, plan_hypergraph
from moeplace.plan.joint import DEFAULT_BALANCE_FLOOR, DEFAULT_SEARCH_EVALS, PENALTY, plan_joint
from moeplace.plan.linear import plan_linear, plan_round_robin


@dataclass(frozen=True)
class Strategy:
    """One registered planning strategy."""

    name: str
    fn: Callable[..., StrategyResult]
    needs_tokens: bool  # True: needs per-token routing (a load matrix is not enough)
    groups_requests: bool  # True: chooses request homes (and gives new requests one online)
    summary: str  # one line for the CLI
    params: tuple[Param, ...] = ()  # its keyword parameters (the only ones make_plan passes)

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    @property
    def prices_time(self) -> bool:
        """True: it takes the deployment's time model (:data:`moeplace.deploy.TIME_PARAMS`)."""
        return any(p.name in TIME_PARAMS for p in self.params)


def _time_params() -> tuple[Param, ...]:
    """The deployment's time-model parameters, as a strategy that prices layer time declares them."""
    from moeplace.simulate.kernels import MODES
    from moeplace.simulate.routing import RULES

    d = Deployment.__dataclass_fields__
    return (
        Param("hidden_size", int, None, "elements per token vector (None: the window's)", lo=1),
        Param("dispatch_bytes", float, d["dispatch_bytes"].default, "bytes per element sent by dispatch", lo=0,
              hi=64, lo_open=True),
        Param("combine_bytes", float, d["combine_bytes"].default, "bytes per element returned by combine", lo=0,
              hi=64, lo_open=True),
        Param("mode", str, d["mode"].default, "dispatch/combine kernel of the time model", choices=tuple(MODES)),
        Param("rule", str, d["rule"].default, "replica choice rule", choices=tuple(RULES)),
        Param("overlap", bool, d["overlap"].default, "two-batch overlap of dispatch, compute, combine"),
        Param("decode_batch", int, d["decode_batch"].default, "requests per decode window", lo=1),
        Param("prefill_tokens", int, d["prefill_tokens"].default, "prefill micro-batch token budget", lo=1),
    )


SEED = Param("seed", int, 0, "random seed", lo=0, hi=2**32 - 1)
ROUND = Param("round_size", int, DEFAULT_ROUND, "requests admitted per scheduling round", lo=1)
FIT = Param("max_fit_requests", int, 4096, "requests the grouper is fitted on at most", lo=1)

_ALL = (
    Strategy("linear", plan_linear, False, False, "expert e on slot e (engines' default)"),
    Strategy("round_robin", plan_round_robin, False, False, "expert e on GPU e % W"),
    Strategy("eplb", plan_eplb, False, False, "DeepSeek EPLB: replicate hot experts, balanced packing",
             (Param("num_groups", int, 1, "the model's expert groups (DeepSeek-V3: 8); 1 = global policy", lo=1,
                    hi=1 << 16),)),
    Strategy("activation-clusters", plan_activation_clusters, True, True,
             "published method: K-means request clusters -> nodes, experts to the node using them most",
             (SEED, ROUND, FIT)),
    Strategy("coactivation", plan_coactivation, True, False, "METIS on the expert co-activation graph", (SEED,)),
    Strategy("hypergraph", plan_hypergraph, True, False, "Mt-KaHyPar on token expert-set hyperedges (connectivity)",
             (SEED,)),
    Strategy("joint", plan_joint, True, True,
             "ours: placement, replication and grouping together for layer time (default) or inter-node bytes "
             "under a balance floor",
             (Param("objective", str, "time", "time: predicted MoE layer time per micro-batch (never slower than "
                    "eplb on the planning window); bytes: inter-node bytes under --balance-floor",
                    choices=("time", "bytes")),
              Param("balance_floor", float, DEFAULT_BALANCE_FLOOR, "objective bytes: required balancedness on the "
                    "planning window", lo=0, hi=1, lo_open=True),
              Param("search_evals", int, DEFAULT_SEARCH_EVALS, "objective bytes: moves its local searches evaluate "
                    "per layer (counts work, so the plan is the same on any machine)", lo=0, hi=10**9),
              Param("time_limit", float, None, "objective bytes: optional wall-clock cap in seconds on its searches "
                    "(a plan that hits it records so and is no longer reproducible)", lo=0, hi=1e6, lo_open=True),
              SEED, ROUND, FIT,
              Param("iters", int, 3, "objective bytes: place/re-home alternations", lo=1, hi=1000),
              Param("sample_tokens", int, 16384, "objective bytes: traffic rows the local search measures exactly",
                    lo=1),
              Param("balance_rounds", int, 2, "objective bytes: balance correction rounds", lo=0, hi=1000),
              Param("max_rows", int, 1 << 18, "objective bytes: traffic rows learned on at most", lo=1),
              Param("max_check_requests", int, 2048, "requests the simulator check replays at most", lo=1),
              Param("folds", int, 64, "objective bytes: request folds of the robust balance term", lo=1, hi=1 << 16),
              Param("robust", float, 0.3, "objective bytes: weight of the robust balance term", lo=0, hi=1),
              Param("penalty", float, PENALTY, "objective bytes: sends one unit of load above the cap is worth",
                    lo=0, hi=1e6),
              *_time_params())),
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
        check_declared(s.params, f"strategy {name!r}")
    shared: dict[str, Param] = {}
    for s in STRATEGIES.values():  # one flag per name: strategies that share a parameter declare it alike
        for p in s.params:
            assert shared.setdefault(p.name, p) == p, f"parameter {p.name!r} declared differently by {s.name!r}"


_check_registry()


def get_strategy(name: str) -> Strategy:
    """The registered strategy ``name``; ValueError listing the known names otherwise."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}") from None


def strategy_params(strategy: str, params: dict[str, object], deployment: Deployment | None = None
                    ) -> dict[str, object]:
    """The keywords ``strategy`` runs with: ``params`` checked against its declarations (ValueError naming an
    unknown or inapplicable one and the strategy), its time-model parameters from ``deployment`` unless given,
    the rest defaulted."""
    s = get_strategy(strategy)
    given = dict(params)
    if deployment is not None:
        for k, v in deployment.time_params().items():
            if s.param(k) is not None:
                given.setdefault(k, v)
    for k in given:
        if s.param(k) is None:
            takes = ", ".join(p.name for p in s.params) or "none"
            raise ValueError(f"strategy {strategy!r} takes no parameter {k!r} (its parameters: {takes})")
    return bind(s.params, given, f"strategy {strategy!r}")


def make_plan(strategy: str, work: Workload, cluster: Cluster, num_redundant: int = 0, planned_on: str = "",
              deployment: Deployment | None = None, seed: int | None = None, **params: object) -> Plan:
    """Run one strategy on a planning window and return a validated Plan.

    ``params``: the strategy's declared parameters (``STRATEGIES[name].params``); ``deployment`` gives a strategy
    that prices time its time model (hidden size, bytes, mode, rule, overlap, batch sizes; ``params`` win).
    ``seed``: the run's seed, given to the strategies that declare one (the others are deterministic).

    ``plan_seconds`` is the time spent inside the strategy. Homes of the window's requests are recorded in
    ``plan.homes``, a grouper for new requests in ``plan.grouper``; the balance outcome, any fallback and the cost
    model go to the plan's typed fields (from the StrategyResult's fields, else from its legacy ``extra`` keys).
    """
    s = get_strategy(strategy)
    if seed is not None and s.param("seed") is not None:
        params = {"seed": seed, **params}
    kw = strategy_params(strategy, params, deployment)
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
    res = s.fn(work, cluster, num_redundant, **kw)
    dt = time.perf_counter() - t0
    placement = Placement(np.asarray(res.phy2log, np.int64), work.num_experts, cluster.world_size)
    homes: dict[int, int] = {}
    if res.homes is not None and work.request_ids is not None:
        homes = {int(r): int(g) for r, g in zip(work.request_ids.tolist(), np.asarray(res.homes).tolist(),
                                                 strict=True)}
    t = typed_from_extra(dict(res.extra), strategy, f"strategy {strategy!r}: extra")
    grouper = res.grouper.rounded() if res.grouper is not None else None  # a plan stores 5 decimals
    return Plan(placement, cluster, homes, strategy, dt, planned_on, t.extra, grouper,
                res.balance or t.balance, res.fallback or t.fallback, res.cost_model or t.cost_model,
                foe_groups=res.foe_groups)


__all__ = ["FOE_STRATEGIES", "MOE_STRATEGIES", "STRATEGIES", "Strategy", "StrategyResult", "Workload", "get_strategy",
           "make_plan", "strategy_params", "workload_from_tokens"]
