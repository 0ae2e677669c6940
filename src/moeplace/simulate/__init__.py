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
- :mod:`~moeplace.simulate.config`: :class:`CostConfig`, :class:`BatchConfig`, rule and kernel names (no numpy).
- :func:`simulate`: stream a trace through all of it.

Names load on first use (:mod:`moeplace.lazy`): importing the package, or its config, costs no numpy.
"""

from moeplace.lazy import lazy_exports

PHASE_NAMES = ("prefill", "decode")

__getattr__, __dir__, _names = lazy_exports(__name__, {
    "batching": ("Layout", "build_layout", "microbatch_ids", "rows_of"),
    "config": ("BALANCED_RULES", "DEDUP_MODES", "DEFAULT_RULE", "RULES", "BatchConfig", "CostConfig"),
    "result": ("PhaseResult", "SimResult"),
    "routing": ("LinkWeights", "ReplicaCosts", "RouteTables", "assign_slots", "balancedness", "build_route_tables",
                "link_counts", "token_sends", "two_hop_matrix"),
    "simulator": ("simulate",),
})
__all__ = ["PHASE_NAMES", *_names]
