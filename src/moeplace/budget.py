"""The memory budget: how many bytes one step of moeplace may allocate at once (docs/RELIABILITY.md).

Every size that comes from a file or an option (a trace's row groups, a JSON input, a stream's length, a kernel
benchmark's routing, a synthetic batch) is checked with :func:`check_memory` before it is allocated, so an absurd
size is one line naming the file or option and the budget, not an out-of-memory crash. Standard library only:
the shared core (moeplace.schema) and every stage use it.
"""

from __future__ import annotations

import functools
import math
import os
import resource
import sys

MEMORY_BUDGET_ENV = "MOEPLACE_MEMORY_BUDGET"  # bytes (suffixes K, M, G, T allowed) one step may allocate
DEFAULT_MEMORY_BUDGET = 8 << 30


class BudgetError(ValueError):
    """A size over the memory budget (or an unreadable budget); the message names what asked for it."""


def parse_bytes(text: str) -> int:
    """``4G``, ``512M``, ``1.5T``, ``300`` -> bytes; BudgetError naming :data:`MEMORY_BUDGET_ENV` otherwise."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMGT" and t else t
    try:
        v = float(num)
    except ValueError:
        raise BudgetError(f"{MEMORY_BUDGET_ENV}={text!r}: expected a number of bytes such as 4G or 512M") from None
    if not math.isfinite(v) or v <= 0:
        raise BudgetError(f"{MEMORY_BUDGET_ENV}={text!r}: must be a positive number of bytes")
    return int(v * mult)


def memory_budget(budget: int | None = None) -> int:
    """Bytes one step may allocate at once.

    ``budget`` if given; else the environment variable ``MOEPLACE_MEMORY_BUDGET`` (e.g. ``4G``); else the
    smallest of 8 GiB, half the physical memory and half the address-space limit (``ulimit -v``).
    """
    if budget is not None:
        if budget <= 0:
            raise BudgetError(f"memory budget must be positive, got {budget}")
        return int(budget)
    env = os.environ.get(MEMORY_BUDGET_ENV)
    if env:
        return parse_bytes(env)
    out = DEFAULT_MEMORY_BUDGET
    try:
        out = min(out, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)
    except (ValueError, OSError, AttributeError):
        pass
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        out = min(out, soft // 2)
    return max(out, 1 << 20)


def over_budget(nbytes: float, what: str, where: str | os.PathLike, budget: int | None = None) -> str | None:
    """``"WHERE: WHAT would need X GiB, over the memory budget of Y GiB (...)"`` when ``nbytes`` exceeds the
    budget, else None. ``where`` names the file or option the size came from."""
    b = memory_budget(budget)
    if nbytes <= b:
        return None
    return (f"{os.fspath(where)}: {what} would need {nbytes / (1 << 30):.2f} GiB, over the memory budget of "
            f"{b / (1 << 30):.2f} GiB (set {MEMORY_BUDGET_ENV} to raise it if this is genuine)")


def check_memory(nbytes: float, what: str, where: str | os.PathLike, budget: int | None = None) -> None:
    """BudgetError (see :func:`over_budget`) if ``nbytes``, what ``what`` would allocate, exceeds the budget."""
    problem = over_budget(nbytes, what, where, budget)
    if problem:
        raise BudgetError(problem)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
MMAP_THRESHOLD = 128 << 10  # glibc's initial value, kept fixed


@functools.cache
def fix_mmap_threshold() -> bool:
    """Keep glibc's mmap threshold at its initial 128 KiB, so every larger block (numpy's per-chunk arrays) is its
    own mapping and goes back to the system when freed.

    By default glibc raises the threshold to the size of each mapped block that is freed (up to 32 MiB), after which
    such blocks come from the heap, whose holes are kept: a long streaming replay's RSS then creeps up with the
    trace's length (bench/results/scale_memory_simulate*.json, docs/SCALE.md). Setting the threshold explicitly
    turns that adjustment off (mallopt(3)). Returns whether it was set; False off glibc (nothing changes there).
    Done once per process (every engine task calls it).
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


ARROW_POOL_ENV = "ARROW_DEFAULT_MEMORY_POOL"  # Arrow's own switch of its default memory pool


@functools.cache
def use_system_arrow_pool() -> str:
    """Arrow's buffers (the decoded row groups of a trace) from the system allocator, unless the user chose a pool
    in ``ARROW_DEFAULT_MEMORY_POOL``. Returns the pool in use ("system" or the user's choice).

    Arrow's default pool (mimalloc in the pinned pyarrow) keeps pages it freed and fragments over a long read:
    with it a streaming replay's peak RSS rose 0.625 -> 0.680 GB from a 0.2 GB to a 2 GB trace, and with the system
    pool 0.576 -> 0.597 GB, a little faster too (docs/SCALE.md). With :func:`fix_mmap_threshold` each large buffer
    is its own mapping and goes back to the system when freed. Arrow reads the variable when it loads, so the CLI
    calls this before anything imports pyarrow; the variable also reaches the processes started from here (a local
    Ray cluster's workers; on an existing cluster, :class:`moeplace.engine.RayEngine` passes it in the job's
    runtime environment). If pyarrow was imported before, only its Python-level default pool can still be switched
    (Arrow's C++ internals keep theirs: a 2 GB replay then peaked 0.65 GB instead of 0.55 GB). Done once per process.
    """
    chosen = os.environ.get(ARROW_POOL_ENV)
    if chosen:
        return chosen  # the user's choice
    os.environ[ARROW_POOL_ENV] = "system"
    if "pyarrow" in sys.modules:
        import pyarrow as pa

        pa.set_memory_pool(pa.system_memory_pool())
    return "system"


def fix_allocators() -> None:
    """What a streaming command calls first: :func:`fix_mmap_threshold` and :func:`use_system_arrow_pool`."""
    fix_mmap_threshold()
    use_system_arrow_pool()
