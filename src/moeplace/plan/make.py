"""Running a strategy: :func:`make_plan` checks the keywords against the strategy's declared parameters
(:mod:`moeplace.plan.registry`), runs it, times it and wraps the result in a :class:`moeplace.placement.Plan`."""

from __future__ import annotations

import time

import numpy as np

from moeplace.deploy import Deployment
from moeplace.params import bind
from moeplace.placement import Cluster, Placement, Plan, check_slot_count, typed_from_extra
from moeplace.plan.base import Workload
from moeplace.plan.registry import FOE_STRATEGIES, get_strategy


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
    if work.foe_groups > 1 and strategy not in FOE_STRATEGIES:
        raise ValueError(f"{planned_on or 'the planning window'}: an FoE trace (foe_groups={work.foe_groups}): its "
                         f"model runs each token's experts group by group, which a {strategy!r} placement ignores; "
                         "plan it with --strategy foe and run it with run-ep (docs/FOE.md)")
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
