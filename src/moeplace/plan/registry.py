"""The strategy registry, importable without numpy: the CLI builds ``plan`` and ``compare`` from it at start.

Each :class:`Strategy` names its function as a ``"module:function"`` reference (:attr:`Strategy.runner`) that loads
on first use (:attr:`Strategy.fn`), so listing the strategies, their needs and their declared parameters
(:class:`moeplace.params.Param`) imports no planner. :func:`moeplace.plan.make_plan` runs one
(:mod:`moeplace.plan.make`). The defaults the strategies and the CLI share live here too, each defined once: the
planner modules import them from this module.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moeplace.deploy import TIME_PARAMS, Deployment
from moeplace.params import Param, check_declared
from moeplace.placement.config import DEFAULT_ROUND
from moeplace.simulate.config import MODES, RULES

if TYPE_CHECKING:
    from moeplace.plan.base import StrategyResult

DEFAULT_PREFIX_TOKENS = 32  # a request without prefill uses its first N decode tokens as its grouping signal
DEFAULT_BALANCE_FLOOR = 0.95  # joint, objective bytes: required balancedness on the planning window
PENALTY = 4.0  # joint: sends one unit of load above the cap is worth (per layer, in sample units)
DEFAULT_EPLB_PACKING = "greedy"  # eplb: chosen by bench/eplb_next_window.py under workload changes (PLANNER.md)
DEFAULT_SEARCH_EVALS = 4_000  # joint: moves evaluated per layer over all local searches (work, not seconds)

_RUNNER = re.compile(r"moeplace(\.\w+)+:\w+")


@dataclass(frozen=True)
class Strategy:
    """One registered planning strategy."""

    name: str
    runner: str  # "module:function" of fn(work, cluster, num_redundant, **params) -> StrategyResult
    needs_tokens: bool  # True: needs per-token routing (a load matrix is not enough)
    groups_requests: bool  # True: chooses request homes (and gives new requests one online)
    summary: str  # one line for the CLI
    params: tuple[Param, ...] = ()  # its keyword parameters (the only ones make_plan passes)

    @property
    def fn(self) -> Callable[..., StrategyResult]:
        """The strategy's function (its module is imported on first use)."""
        module, name = self.runner.split(":")
        return getattr(importlib.import_module(module), name)

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    @property
    def prices_time(self) -> bool:
        """True: it takes the deployment's time model (:data:`moeplace.deploy.TIME_PARAMS`)."""
        return any(p.name in TIME_PARAMS for p in self.params)


def _time_params() -> tuple[Param, ...]:
    """The deployment's time-model parameters, as a strategy that prices layer time declares them."""
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
        Param("decode_running", int, None, "running requests per decode micro-batch, continuous batching (None: "
              "windows of decode_batch)", lo=1),
        Param("intermediate_size", int, None, "routed expert FFN width, prices expert compute and weight reads "
              "(None: the model preset's, else hidden_size)", lo=1),
    )


SEED = Param("seed", int, 0, "random seed", lo=0, hi=2**32 - 1)
ROUND = Param("round_size", int, DEFAULT_ROUND, "requests admitted per scheduling round, rounded up to a multiple "
              "of the GPU count (each node takes exactly its share of a round)", lo=1)
FIT = Param("max_fit_requests", int, 4096, "requests the grouper is fitted on at most", lo=1)

_P = "moeplace.plan"
_ALL = (
    Strategy("linear", f"{_P}.linear:plan_linear", False, False, "expert e on slot e (engines' default)"),
    Strategy("round_robin", f"{_P}.linear:plan_round_robin", False, False, "expert e on GPU e % W"),
    Strategy("eplb", f"{_P}.eplb:plan_eplb", False, False, "DeepSeek EPLB: replicate hot experts, balanced packing",
             (Param("num_groups", int, 1, "the model's expert groups (DeepSeek-V3: 8); 1 = global policy", lo=1,
                    hi=1 << 16),
              Param("packing", str, DEFAULT_EPLB_PACKING, "GPU packing: greedy (EPLB's, twin-free) or refined (then "
                    "a swap local search: better on a stationary next window, worse under a workload change)",
                    choices=("greedy", "refined")))),
    Strategy("activation-clusters", f"{_P}.activation_clusters:plan_activation_clusters", True, True,
             "published method: K-means request clusters -> nodes, experts to the node using them most",
             (SEED, ROUND, FIT,
              Param("cluster_by", str, "signal", "signal: K-means on the requests' prefill signatures (published); "
                    "usage: cluster what the planning requests go on to use (decode), route new ones by each "
                    "cluster's mean signature", choices=("signal", "usage")))),
    Strategy("coactivation", f"{_P}.graph:plan_coactivation", True, False, "METIS on the expert co-activation graph",
             (SEED,)),
    Strategy("hypergraph", f"{_P}.graph:plan_hypergraph", True, False,
             "Mt-KaHyPar on token expert-set hyperedges (connectivity)", (SEED,)),
    Strategy("joint", f"{_P}.joint:plan_joint", True, True,
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
              Param("dispatch", str, "choose", "objective time: choose the replica dispatch rule with the placement "
                    "(baselines under every engine rule) or keep the deployment's rule fixed",
                    choices=("choose", "fixed")),
              Param("cv_folds", int, 2, "objective time: cross-validation folds of the evidence (each candidate "
                    "is built on the others and timed on one)", lo=2, hi=64),
              Param("deploy", str, "rebuilt", "objective time: the grouped plan the evidence chose, rebuilt on every "
                    "planning request, or as built on the first fold's training requests", choices=("rebuilt",
                                                                                                    "as-built")),
              Param("phases", str, "both", "objective time: the phases the evidence weighs (the one a deployment "
                    "serves, or both)", choices=("both", "prefill", "decode")),
              *_time_params())),
    Strategy("foe", f"{_P}.foe:plan_foe", False, False,
             "Federation of Experts: each group's experts on its own GPUs (FoE traces only; docs/FOE.md)"),
)

STRATEGIES: dict[str, Strategy] = {s.name: s for s in _ALL}
FOE_STRATEGIES = ("foe",)  # plans for an FoE model's execution (run-ep); compare and the demo score plain MoE
MOE_STRATEGIES: tuple[str, ...] = tuple(n for n in STRATEGIES if n not in FOE_STRATEGIES)


def _check_registry() -> None:
    """What can be checked without importing the strategies; tests/test_start_time.py resolves every runner and
    checks its signature takes the declared parameters."""
    assert len(STRATEGIES) == len(_ALL), "duplicate strategy name"
    assert set(FOE_STRATEGIES) <= set(STRATEGIES), "an FoE strategy is not registered"
    for name, s in STRATEGIES.items():
        assert name and name == name.strip().lower(), f"strategy name {name!r} must be lower case"
        assert _RUNNER.fullmatch(s.runner), f"strategy {name!r}: runner {s.runner!r} is not 'moeplace.module:function'"
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
