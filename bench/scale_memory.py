"""Where single-process ``analyze``'s (``--command simulate``: ``simulate``'s) peak memory goes as the trace grows
(issue 26, "peak RSS flat"): the kernel's exact peak RSS of each run, repeated on the same trace, and the peak of
what Python and numpy allocate (``tracemalloc``), at 1x, 10x and 100x a base trace (0.2, 2 and 20 GB by default).

``bench/scale.py`` samples RSS every 0.1 s; a short peak (the summary at the end) can fall between samples, and the
resident size of a process also holds what the allocators keep after a free (glibc's arenas, Arrow's pool) and the
library pages it touched. This bench separates the two:

- ``maxrss_bytes``: ``ru_maxrss`` of the ``python -m moeplace analyze`` (or ``simulate``) process itself (exact,
  read at exit), for ``--reps`` runs of each trace: the spread between runs of the same input is the noise a growth
  must exceed;
- ``tracemalloc_peak_bytes``: one more run with ``tracemalloc`` on (slower; up to ``--traced-max``): the largest
  total of live Python and numpy allocations, which is what the code's own data structures need.

The baseline is the 1x trace in the same run: each size's figures are also given as a ratio to 1x's.

    python bench/scale_memory.py [--base-requests 600] [--sizes 1,10,100] [--reps 3] [--large-reps 1]
                                 [--traced-max 10] [--command analyze|simulate] [--work DIR] [--json PATH]

Traces are labelled SYNTHETIC (``moeplace synth --preset deepseek-v3``, tiled as in ``bench/scale.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import REPO, BenchRun, positive_int, positive_ints
from scale import MAX_REQUEST_BYTES, run_measured, tiled_trace, trace_bytes

from moeplace.trace.reader import num_token_rows

SRC = REPO / "src"

# runs the CLI in this process and prints its peak RSS (and tracemalloc's peak) as the last line on stderr
_WRAP = """
import atexit, json, os, resource, runpy, sys, tracemalloc
trace = os.environ.get("MOEPLACE_BENCH_TRACEMALLOC") == "1"
if trace:
    tracemalloc.start(1)
def report():
    out = {"maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if trace:
        out["tracemalloc_peak_bytes"] = tracemalloc.get_traced_memory()[1]
    sys.stderr.write("\\nMEMORY " + json.dumps(out) + "\\n")
atexit.register(report)
sys.argv = ["moeplace", *sys.argv[1:]]
runpy.run_module("moeplace", run_name="__main__")
"""


COMMANDS = {  # the single-process command measured, as bench/scale.py runs it
    "analyze": lambda tr, out: ["analyze", str(tr), "--json", str(out), "--no-progress",
                                "--max-request-bytes", str(MAX_REQUEST_BYTES)],
    "simulate": lambda tr, out: ["simulate", str(tr), "--cluster", "4x8", "--json", str(out)],
}


def analyze_peak(trace: Path, out: Path, tracemalloc: bool, command: str = "analyze") -> dict:
    """One run of ``command`` (analyze or simulate) on ``trace``: wall seconds and the process's own peak figures."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "MOEPLACE_BENCH_TRACEMALLOC": "1" if tracemalloc else "0"}
    t0 = time.perf_counter()
    if out.exists():
        out.unlink()
    load = os.getloadavg()[0]
    p = subprocess.run([sys.executable, "-c", _WRAP, *COMMANDS[command](trace, out)], env=env, capture_output=True,
                       text=True, timeout=7200)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{command} {trace} failed ({p.returncode}): {p.stderr[-2000:]}")
    line = [x for x in p.stderr.splitlines() if x.startswith("MEMORY ")][-1]
    return {"wall_seconds": wall, "loadavg_at_start": load, **json.loads(line[len("MEMORY "):])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-requests", type=positive_int, default=600)
    ap.add_argument("--sizes", default="1,10,100")
    ap.add_argument("--reps", type=positive_int, default=3, help="runs of each trace below 25x")
    ap.add_argument("--large-reps", type=positive_int, default=1,
                    help="runs of each trace of 25x and more (20 min at 100x)")
    ap.add_argument("--traced-max", type=positive_int, default=10,
                    help="the tracemalloc run only up to this size (2x slower)")
    ap.add_argument("--work", default=None)
    ap.add_argument("--command", choices=sorted(COMMANDS), default="analyze",
                    help="the single-process command measured (simulate: on a 4x8 cluster, as bench/scale.py)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        sizes = positive_ints(args.sizes)
    except argparse.ArgumentTypeError as e:
        ap.error(f"--sizes: {e}")
    if args.work and Path(args.work).exists() and not Path(args.work).is_dir():
        ap.error(f"--work {args.work}: exists and is not a folder")
    run = BenchRun("scale_memory", baseline="the 1x trace, same run")
    work = Path(args.work or tempfile.mkdtemp(prefix="moeplace-scale-mem-"))
    work.mkdir(parents=True, exist_ok=True)
    base = work / "base.trace"
    if not base.exists():
        run_measured(["synth", "--preset", "deepseek-v3", "--requests", args.base_requests, base, "--quiet"], work)
    res: list[dict] = []
    body = {"params": vars(args), "complete": False, "results": {"sizes": res}}
    for n in sizes:
        tr = base if n == 1 else tiled_trace(base, work / f"x{n}.trace", n)
        cell = {"size": n, "trace_gb": trace_bytes(tr) / 1e9, "tokens": num_token_rows(tr), "runs": []}
        res.append(cell)
        for _ in range(args.reps if n < 25 else args.large_reps):
            cell["runs"].append(analyze_peak(tr, work / "a.json", tracemalloc=False, command=args.command))
            print(f"{n}x: maxrss {cell['runs'][-1]['maxrss_bytes'] / 1e9:.3f} GB", flush=True)
        if n <= args.traced_max:
            cell["traced"] = analyze_peak(tr, work / "a.json", tracemalloc=True, command=args.command)
            cell["tracemalloc_peak_bytes"] = cell["traced"]["tracemalloc_peak_bytes"]
            print(f"{n}x: tracemalloc peak {cell['tracemalloc_peak_bytes'] / 1e9:.3f} GB", flush=True)
        m = [r["maxrss_bytes"] for r in cell["runs"]]
        cell.update(maxrss_median_bytes=float(np.median(m)), maxrss_min_bytes=min(m), maxrss_max_bytes=max(m),
                    maxrss_spread=(max(m) - min(m)) / float(np.median(m)))
        one = res[0]
        cell["maxrss_median_vs_1x"] = cell["maxrss_median_bytes"] / one["maxrss_median_bytes"]
        cell["maxrss_max_vs_1x_min"] = cell["maxrss_max_bytes"] / one["maxrss_min_bytes"]
        if "tracemalloc_peak_bytes" in cell and "tracemalloc_peak_bytes" in one:
            cell["tracemalloc_peak_vs_1x"] = cell["tracemalloc_peak_bytes"] / one["tracemalloc_peak_bytes"]
        if args.json:
            run.write(body, args.json)
        if n != 1:
            shutil.rmtree(tr, ignore_errors=True)
    body["complete"] = True
    run.write(body, args.json)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
