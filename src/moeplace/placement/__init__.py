"""The shared core's plan types: clusters, placements, plans (:mod:`~moeplace.placement.types`), the grouper a
plan holds (:mod:`~moeplace.placement.grouper`) and the Federation-of-Experts layout
(:mod:`~moeplace.placement.foe`). Nothing here imports a pipeline stage.

Example: 256 logical + 32 redundant = 288 slots over 32 GPUs = 9 slots per GPU.

Names load on first use (:mod:`moeplace.lazy`): importing the package costs no numpy.
"""

from moeplace.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "foe": ("FoeLayout",),
    "grouper": ("Grouper",),
    "types": ("LEGACY_FALLBACK_USED", "MAX_DERIVED_CELLS", "MAX_NODES", "MAX_PLACEMENT_CELLS", "MAX_WORLD",
              "PLAN_FORMAT_VERSION", "BalanceOutcome", "Cluster", "CostModel", "Fallback", "ModelLayers",
              "Placement", "Plan", "TypedOutcome", "check_slot_count", "linear_phy2log", "log2phy_table",
              "replica_counts", "typed_from_extra"),
})
