"""Evaluation: where a plan meets held-out requests. Window splits and arrival order (:mod:`.windows`), scoring a
plan with the simulator (:mod:`.score`), comparing strategies and the bytes-vs-balance frontier (:mod:`.compare`),
and the compare answer as an HTML page (:mod:`.html`). The CLI, the demo and bench/ all go through this package.
"""

from moeplace.evaluate.compare import compare, format_table, plot_frontier, run_compare, sweep_floor
from moeplace.evaluate.score import planning_balance, score_plan, sim_metrics
from moeplace.evaluate.windows import (
    ARRIVALS,
    DEFAULT_PREFIX_TOKENS,
    Windows,
    held_out_homes,
    plan_grouper,
    reorder_requests,
    scoring_trace,
    signal_rows,
    split_windows,
    subset_trace,
)

__all__ = ["ARRIVALS", "DEFAULT_PREFIX_TOKENS", "Windows", "compare", "format_table", "held_out_homes",
           "plan_grouper", "planning_balance", "plot_frontier", "reorder_requests", "run_compare", "score_plan",
           "scoring_trace", "signal_rows", "sim_metrics", "split_windows", "subset_trace", "sweep_floor"]
