"""The shared core's plan types: clusters, placements, plans (:mod:`~moeplace.placement.types`), the grouper a
plan holds (:mod:`~moeplace.placement.grouper`) and the Federation-of-Experts layout
(:mod:`~moeplace.placement.foe`). Nothing here imports a pipeline stage.

Example: 256 logical + 32 redundant = 288 slots over 32 GPUs = 9 slots per GPU.
"""

from moeplace.placement.foe import FoeLayout
from moeplace.placement.grouper import Grouper
from moeplace.placement.types import (
    LEGACY_FALLBACK_USED,
    MAX_DERIVED_CELLS,
    MAX_NODES,
    MAX_PLACEMENT_CELLS,
    MAX_WORLD,
    PLAN_FORMAT_VERSION,
    BalanceOutcome,
    Cluster,
    CostModel,
    Fallback,
    ModelLayers,
    Placement,
    Plan,
    TypedOutcome,
    check_slot_count,
    linear_phy2log,
    log2phy_table,
    replica_counts,
    typed_from_extra,
)

__all__ = ["LEGACY_FALLBACK_USED", "MAX_DERIVED_CELLS", "MAX_NODES", "MAX_PLACEMENT_CELLS", "MAX_WORLD",
           "PLAN_FORMAT_VERSION", "BalanceOutcome", "Cluster", "CostModel", "Fallback", "FoeLayout", "Grouper",
           "ModelLayers", "Placement", "Plan", "TypedOutcome", "check_slot_count", "linear_phy2log", "log2phy_table",
           "replica_counts", "typed_from_extra"]
