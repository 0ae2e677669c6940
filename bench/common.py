"""What every benchmark writes besides its numbers, and the one way it writes them.

A result file is written by code only, never edited by hand, so that anything in it can be traced back to the run
that produced it: the exact command, the commit (and whether the tree differed from it), the load average before
and after (absolute times on a shared machine mean little without it), library versions, CPU count, date, and the
name of the baseline the bench measured in the same run.

    run = BenchRun("simulate_speed", baseline="tests/spec_simulator.py spec_simulate (plain Python)")
    ...measure...
    run.write({"params": {...}, "excluded": "...", "results": {...}})   # bench/results/simulate_speed.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from moeplace.io import atomic_write_json

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def git_state() -> tuple[str | None, bool | None]:
    """(HEAD commit, dirty): dirty means a tracked file outside bench/results differs from that commit.

    Result files are left out of the check because one bench's output must not mark the next bench as dirty.
    (None, None) outside a git checkout.
    """
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                             ":(exclude)bench/results"], cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return head.stdout.strip(), bool(st.stdout.strip())


def versions() -> dict[str, str | None]:
    """Versions of the interpreter and the array libraries a timing depends on (None: not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version(), "numpy": np.__version__}
    for name in ("torch", "numba"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def export_src(rev: str, prefix: str = "src_") -> Path:
    """``src`` of git revision ``rev`` exported into a new temporary folder; returns that ``src`` (remove its
    parent when done). For a bench that times a command at an earlier revision in the same run."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    tar = subprocess.run(["git", "archive", rev, "src"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=tar, check=True)
    return root / "src"


class BenchRun:
    """One benchmark run: records the context at construction (start) and at :meth:`write` (end)."""

    def __init__(self, name: str, baseline: str, argv: list[str] | None = None) -> None:
        if not name.isidentifier():
            raise ValueError(f"bench name must be an identifier (it names bench/results/NAME.json), got {name!r}")
        self.name = name
        self.baseline = baseline
        argv = list(sys.argv if argv is None else argv)
        if argv and argv[0].endswith(".py"):
            p = Path(argv[0]).resolve()
            argv[0] = str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)
        self.command = "python " + " ".join(argv)
        self.loadavg_before = list(os.getloadavg())
        self.started = datetime.datetime.now(datetime.UTC)
        # the code that runs is the tree at the start (modules are imported then): its commit and dirtiness
        self.commit, self.dirty = git_state()

    def write(self, body: dict, path: str | os.PathLike | None = None) -> Path:
        """Write ``body`` plus the run context as JSON (atomically) to ``path`` (default bench/results/NAME.json).

        body: the bench's own keys (params, excluded, results, ...); it may not use the context's key names.
        """
        commit, dirty = self.commit, self.dirty
        ctx = {
            "bench": self.name,
            "baseline": self.baseline,
            "command": self.command,
            "git_commit": commit,
            "dirty": dirty,
            "date": self.started.isoformat(timespec="seconds"),
            "seconds": (datetime.datetime.now(datetime.UTC) - self.started).total_seconds(),
            "loadavg_before": self.loadavg_before,
            "loadavg_after": list(os.getloadavg()),
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            "versions": versions(),
        }
        clash = set(ctx) & set(body)
        if clash:
            raise ValueError(f"bench {self.name}: result keys {sorted(clash)} clash with the run context's")
        dest = Path(path) if path is not None else RESULTS / f"{self.name}.json"
        atomic_write_json({**ctx, **body}, dest)
        print(f"wrote {dest} (load average before {fmt_load(self.loadavg_before)}, after "
              f"{fmt_load(ctx['loadavg_after'])})")
        return dest


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse answers anything else with exit 2 and the flag's name)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def positive_ints(text: str) -> list[int]:
    """argparse type: a comma-separated list of integers >= 1 (``1,10,100``)."""
    return [positive_int(x) for x in text.split(",")]


def fmt_load(la: list[float]) -> str:
    return "/".join(f"{x:.2f}" for x in la)


def median(xs: list[float]) -> float:
    return float(np.median(np.asarray(xs, np.float64)))


def paired_ci(plan: list, base: list) -> dict | None:
    """``{"ratio", "ci95", "microbatches", "seeds", "decided"}``: sum(plan) / sum(base) with its paired two-level
    bootstrap interval (:func:`moeplace.evaluate.intervals.paired_ratio_ci`, the one implementation). plan, base:
    per seed, float [B_s] of the same units (micro-batches, windows) in the same order. None when the base sums
    to 0 (no ratio exists)."""
    from moeplace.evaluate.intervals import paired_ratio_ci

    if sum(float(np.sum(b)) for b in base) <= 0:
        return None
    ci = paired_ratio_ci(plan, base)
    return {**ci.to_json(), "decided": ci.decided}


def seed_spread(xs: list[float]) -> dict:
    """A per-seed quantity that is not a ratio of sums (no bootstrap interval): its median over seeds, the range
    and every seed's value."""
    return {"median": median(xs), "min": float(min(xs)), "max": float(max(xs)), "per_seed": [float(x) for x in xs]}
