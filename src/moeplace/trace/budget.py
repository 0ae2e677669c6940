"""The memory budget of trace readers: how many bytes one may allocate at once (docs/RELIABILITY.md)."""

from __future__ import annotations

import math
import os
import resource

from moeplace.trace.types import TraceError

MEMORY_BUDGET_ENV = "MOEPLACE_MEMORY_BUDGET"  # bytes (suffixes K, M, G allowed) a reader may allocate
DEFAULT_MEMORY_BUDGET = 8 << 30


def _parse_bytes(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMGT" and t else t
    try:
        v = float(num)
    except ValueError:
        raise TraceError(f"{MEMORY_BUDGET_ENV}={text!r}: expected a number of bytes such as 4G or 512M") from None
    if not math.isfinite(v) or v <= 0:
        raise TraceError(f"{MEMORY_BUDGET_ENV}={text!r}: must be a positive number of bytes")
    return int(v * mult)


def memory_budget(budget: int | None = None) -> int:
    """Bytes a trace reader may allocate at once.

    ``budget`` if given; else the environment variable ``MOEPLACE_MEMORY_BUDGET`` (e.g. ``4G``); else the
    smallest of 8 GiB, half the physical memory and half the address-space limit (``ulimit -v``).
    """
    if budget is not None:
        if budget <= 0:
            raise TraceError(f"memory budget must be positive, got {budget}")
        return int(budget)
    env = os.environ.get(MEMORY_BUDGET_ENV)
    if env:
        return _parse_bytes(env)
    out = DEFAULT_MEMORY_BUDGET
    try:
        out = min(out, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)
    except (ValueError, OSError, AttributeError):
        pass
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        out = min(out, soft // 2)
    return max(out, 1 << 20)


def check_memory(nbytes: float, what: str, where: str | os.PathLike, budget: int | None = None) -> None:
    """Raise TraceError naming ``where`` if ``nbytes`` (what ``what`` would allocate) exceeds the memory budget."""
    b = memory_budget(budget)
    if nbytes > b:
        raise TraceError(f"{where}: {what} would need {nbytes / (1 << 30):.2f} GiB, over the memory budget of "
                         f"{b / (1 << 30):.2f} GiB (set {MEMORY_BUDGET_ENV} to raise it if this file is genuine)")
