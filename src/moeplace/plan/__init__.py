"""The planner: expert placement, replication and request grouping strategies, in a registry keyed by name.

Shape legend: L = MoE layers, E = logical experts, P = physical slots (E + R redundant), W = GPUs, S = P / W slots
per GPU, R = redundant slots per layer, Rq = requests of the planning window.

Glossary with numbers: DeepSeek-V3 has 256 logical experts per MoE layer; with 32 redundant slots there are 288
physical slots, over 32 GPUs (4 nodes x 8) = 9 slots per GPU. A strategy returns ``phy2log`` [L, P] (slot ->
expert, every expert at least once, never two replicas of one expert on one GPU) and optionally homes for the
planning window's requests plus a grouper that gives new requests a home from their prefill routing.

Every strategy has the signature ``fn(work: Workload, cluster: Cluster, num_redundant: int, **params) ->
StrategyResult`` and declares its keyword parameters (:class:`moeplace.params.Param`: name, type, range or
choices, default, help) in its registry entry (:mod:`.registry`, importable without numpy: the CLI lists it at
start, and a strategy's module loads when it runs); :func:`make_plan` (:mod:`.make`) checks the keywords against
them (an unknown or inapplicable one is a ValueError naming it and the strategy), runs it, times it and wraps the
result in a :class:`moeplace.placement.Plan`. Parameters named in :data:`moeplace.deploy.TIME_PARAMS` (hidden
size, element bytes, kernel mode, replica rule, overlap, batch sizes) are the time model's: they come from a
:class:`moeplace.deploy.Deployment` (the CLI's deployment option group); the others become ``moeplace plan`` flags.
"""

from moeplace.lazy import lazy_exports

# Names load on first use (:mod:`moeplace.lazy`): importing the registry costs no numpy.
__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "base": ("StrategyResult", "Workload", "workload_from_tokens"),
    "make": ("make_plan", "strategy_params"),
    "registry": ("FOE_STRATEGIES", "MOE_STRATEGIES", "STRATEGIES", "Strategy", "get_strategy"),
})
