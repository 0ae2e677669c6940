"""Operate: the live loop. A stream of routing -> counters -> metrics endpoint, alerts and dashboard ->
rebalance policy -> migration plan and engine exports (docs/OPERATE.md).

- :mod:`.workloads`: mix schedules (phases, a daily cycle, bursts) that order a request pool into seeded streams.
- :mod:`.streams`: traces replayed as streams in a stated order, and seeded drifts built from them.
- :mod:`.counters`: sampled per-domain expert counts per window (and capacity drops, with a capacity factor).
- :mod:`.migration`: minimal-move matching, migration plans and their cost.
- :mod:`.policies`: the rebalancer policies in a registry whose entries declare their parameters.
- :mod:`.loop`: :func:`operate`, the loop itself.
- :mod:`.metrics`: Prometheus metrics, the HTTP endpoint and the live dashboard.
"""

from moeplace.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "loop": ("OperateConfig", "OperateError", "OperateResult", "WindowReport", "operate"),
    "policies": ("POLICIES", "SGLANG_REBALANCE_STEPS", "make_policy"),
    "streams": ("Phase", "Stream", "default_phases", "drift_stream", "drift_trace", "trace_stream"),
})
