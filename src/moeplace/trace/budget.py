"""The memory budget of trace readers (:mod:`moeplace.budget`, docs/RELIABILITY.md): the same budget, with the
readers' error type, :class:`~moeplace.trace.types.TraceError`."""

from __future__ import annotations

import os

from moeplace.budget import DEFAULT_MEMORY_BUDGET, MEMORY_BUDGET_ENV, BudgetError, memory_budget, over_budget
from moeplace.trace.types import TraceError

__all__ = ["DEFAULT_MEMORY_BUDGET", "MEMORY_BUDGET_ENV", "check_memory", "memory_budget"]


def check_memory(nbytes: float, what: str, where: str | os.PathLike, budget: int | None = None) -> None:
    """Raise TraceError naming ``where`` if ``nbytes`` (what ``what`` would allocate) exceeds the memory budget."""
    try:
        problem = over_budget(nbytes, what, where, budget)
    except BudgetError as e:  # an unreadable MOEPLACE_MEMORY_BUDGET
        raise TraceError(str(e)) from None
    if problem:
        raise TraceError(problem)
