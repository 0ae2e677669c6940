"""Paired confidence intervals for time ratios: the definitions live in :mod:`moeplace.intervals` (shared by the
evaluation, the planners' decisions and the rebalancer); this module keeps the evaluation's import path."""

from moeplace.intervals import DEFAULT_REPLICATES, MAX_REPLICATE_CELLS, RatioCI, paired_ratio_ci

__all__ = ["DEFAULT_REPLICATES", "MAX_REPLICATE_CELLS", "RatioCI", "paired_ratio_ci"]
