"""The simulator as a package: one definition of routing, shared micro-batching, the time model, result types.

- :mod:`~moeplace.simulate.routing`: replica choice (nearest and balanced rules), the serve table, per-token sends
  under per-GPU and per-node dedup, the link-class split, balancedness. Planners and the runtime call it too.
- :mod:`~moeplace.simulate.batching`: how requests become micro-batches (arrival order stated).
- :mod:`~moeplace.simulate.links`: what a byte costs on each link class.
- :mod:`~moeplace.simulate.kernels`: one time model per dispatch/combine kernel and expert compute (one registry).
- :mod:`~moeplace.simulate.cost`: time of a micro-batch (dispatch/combine on the busiest link, padding, compute).
- :mod:`~moeplace.simulate.kernel_bench`: DeepEP's kernel benchmarks priced by the simulator (predict-kernel).
- :mod:`~moeplace.simulate.loops`: the compiled loops behind routing.
- :mod:`~moeplace.simulate.result`: :class:`SimResult`, :class:`PhaseResult` and their JSON.
- :func:`simulate`: stream a trace through all of it.
"""

from moeplace.simulate.batching import BatchConfig, Layout, build_layout, microbatch_ids, rows_of
from moeplace.simulate.cost import CostConfig
from moeplace.simulate.result import PhaseResult, SimResult
from moeplace.simulate.routing import (
    BALANCED_RULES,
    DEDUP_MODES,
    DEFAULT_RULE,
    RULES,
    ReplicaCosts,
    RouteTables,
    assign_slots,
    balancedness,
    build_route_tables,
    link_counts,
    token_sends,
    two_hop_matrix,
)
from moeplace.simulate.simulator import simulate

PHASE_NAMES = ("prefill", "decode")

__all__ = ["BALANCED_RULES", "DEDUP_MODES", "DEFAULT_RULE", "PHASE_NAMES", "RULES", "BatchConfig", "CostConfig",
           "Layout", "PhaseResult", "ReplicaCosts", "RouteTables", "SimResult", "assign_slots", "balancedness",
           "build_route_tables", "build_layout", "link_counts", "microbatch_ids", "rows_of", "simulate",
           "token_sends", "two_hop_matrix"]
