"""Plan and scoring speed as a user runs them: the whole ``moeplace plan --strategy joint`` command and one
held-out scoring run (``moeplace simulate --plan ... --rule balanced``, the exact balanced dispatch every joint
decision times) at this checkout against the same commands at an earlier revision (its ``src`` exported from git),
on the same trace, in the same run.

Each side gets a warm-up run of both commands first (numba's compile cache is per source tree), then the two sides
alternate ``--reps`` times. The plan JSONs and the simulate JSONs of both sides are compared byte for byte: a
speed-up that changes a plan is not a speed-up. Targets (issue 24): <= 10 s per joint plan and <= 1 s per scoring
run at reference-fg 4x8 (R = 32, the fine-grained model's 64 experts and 32 redundant slots: 3 slots per GPU).

    python bench/plan_speed.py [--previous REV] [--trace PATH] [--cluster 4x8] [--redundant 32] [--reps 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import REPO, BenchRun, export_src, positive_int

SRC = REPO / "src"
DEFAULT_TRACE = REPO / "src" / "moeplace" / "data" / "reference-fg.trace"
TARGETS = {"plan_seconds": 10.0, "score_seconds": 1.0}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def timed(args: list, src: Path, cwd: Path) -> tuple[dict, str]:
    """Run ``python -m moeplace ARGS`` with the package under ``src``: (wall seconds and load average, stdout)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "moeplace", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"moeplace {' '.join(map(str, args))} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {"wall_seconds": wall, "loadavg_at_start": load}, proc.stdout


def one_side(src: Path, trace: Path, cluster: str, redundant: int, work: Path, name: str) -> dict:
    """Plan, then score the plan: wall seconds of both commands, the strategy's own 'planned in' seconds (without
    Python start-up and trace reading), and the digests of what they wrote."""
    plan = work / f"plan_{name}.json"
    sim = work / f"sim_{name}.json"
    for f in (plan, sim):
        f.unlink(missing_ok=True)
    p, out = timed(["plan", trace, "--strategy", "joint", "--cluster", cluster, "--redundant", redundant,
                    "--out", plan], src, work)
    m = re.search(r"planned in ([0-9.]+) s", out)
    if not m:
        raise RuntimeError(f"no 'planned in' line in: {out[-500:]}")
    p["planned_seconds"] = float(m.group(1))
    s, _ = timed(["simulate", trace, "--plan", plan, "--rule", "balanced", "--json", sim], src, work)
    return {"plan": p, "score": s, "plan_digest": digest(plan), "score_digest": digest(sim)}


INPROC = """
import json, sys, time
from moeplace.placement import Plan
from moeplace.simulate import simulate
from moeplace.trace import read_trace
tr, plan, reps = read_trace(sys.argv[1]), Plan.load(sys.argv[2]), int(sys.argv[3])
out = {}
for rule in ("balanced", "nearest-least-loaded"):
    simulate(tr, plan, rule=rule)  # compiled code loaded, caches warm
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        simulate(tr, plan, rule=rule)
        ts.append(time.perf_counter() - t)
    out[rule] = sorted(ts)[len(ts) // 2]
print(json.dumps(out))
"""


def score_in_process(src: Path, trace: Path, plan: Path, reps: int = 3) -> dict[str, float]:
    """Median seconds of ``simulate(trace, plan, rule=...)`` in one process, the trace already in memory (the
    scoring run a planner or ``compare`` makes), under the balanced rule and the default rule."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.run([sys.executable, "-c", INPROC, str(trace), str(plan), str(reps)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"in-process scoring failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--previous", default=None, help="git revision to compare against (default: this checkout "
                    "only, no ratio)")
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--cluster", default="4x8")
    ap.add_argument("--redundant", type=int, default=32)
    ap.add_argument("--reps", type=positive_int, default=3, help="alternated runs of each side")
    ap.add_argument("--json", help="write here instead of bench/results/plan_speed.json")
    args = ap.parse_args()
    trace = Path(args.trace).resolve()
    if not trace.is_dir():
        ap.error(f"--trace {args.trace}: no trace folder there")
    if args.json and Path(args.json).resolve().is_relative_to(trace):
        ap.error(f"--json {args.json}: inside the trace folder {args.trace}, this bench's input; write elsewhere")
    if args.previous and subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{args.previous}^{{commit}}"],
                                        cwd=REPO, capture_output=True).returncode != 0:
        ap.error(f"--previous {args.previous}: not a commit of this repository")
    run = BenchRun("plan_speed", baseline=f"the same commands at {args.previous}" if args.previous
                   else "none: absolute times at this checkout")
    work = Path(tempfile.mkdtemp(prefix="plan_speed_work_"))
    sides = {"current": SRC}
    if args.previous:
        sides["previous"] = export_src(args.previous, prefix="plan_speed_")
    try:
        for name, src in sides.items():  # warm-up: each source tree compiles its numba cache once
            one_side(src, trace, args.cluster, args.redundant, work, f"warm_{name}")
        runs: dict[str, list[dict]] = {k: [] for k in sides}
        for i in range(args.reps):
            for name, src in sides.items():
                r = one_side(src, trace, args.cluster, args.redundant, work, name)
                runs[name].append(r)
                print(f"rep {i + 1}/{args.reps} {name}: plan {r['plan']['wall_seconds']:.2f} s "
                      f"(planned in {r['plan']['planned_seconds']:.2f} s), "
                      f"score {r['score']['wall_seconds']:.2f} s", flush=True)
        inproc = {}
        for name, src in sides.items():  # the same plan file for both sides: the current side's
            inproc[name] = score_in_process(src, trace, work / "plan_current.json")
            print(f"{name}: in-process scoring {inproc[name]}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.previous:
            shutil.rmtree(sides["previous"].parent, ignore_errors=True)
    res: dict = {}
    for name, rs in runs.items():
        res[name] = {"plan_wall_median_s": float(np.median([r["plan"]["wall_seconds"] for r in rs])),
                     "planned_median_s": float(np.median([r["plan"]["planned_seconds"] for r in rs])),
                     "score_wall_median_s": float(np.median([r["score"]["wall_seconds"] for r in rs])),
                     "plan_digests": sorted({r["plan_digest"] for r in rs}),
                     "score_digests": sorted({r["score_digest"] for r in rs}), "runs": rs,
                     "score_in_process_s": inproc[name]}
    if args.previous:
        c, p = res["current"], res["previous"]
        res["speedup"] = {"plan_wall": p["plan_wall_median_s"] / c["plan_wall_median_s"],
                          "planned": p["planned_median_s"] / c["planned_median_s"],
                          "score_wall": p["score_wall_median_s"] / c["score_wall_median_s"],
                          "score_in_process_balanced": p["score_in_process_s"]["balanced"]
                          / c["score_in_process_s"]["balanced"]}
        res["identical_plan"] = c["plan_digests"] == p["plan_digests"] and len(c["plan_digests"]) == 1
        res["identical_score"] = c["score_digests"] == p["score_digests"] and len(c["score_digests"]) == 1
    res["targets"] = {"plan_seconds": TARGETS["plan_seconds"], "score_seconds": TARGETS["score_seconds"],
                      "plan_met": res["current"]["plan_wall_median_s"] <= TARGETS["plan_seconds"],
                      "score_met": res["current"]["score_in_process_s"]["balanced"] <= TARGETS["score_seconds"]}
    shown = trace.relative_to(REPO) if trace.is_relative_to(REPO) else trace
    run.write({"params": {"trace": str(shown), "cluster": args.cluster, "redundant": args.redundant,
                          "reps": args.reps, "previous": args.previous},
               "measured": "wall seconds of the whole command (Python start-up, trace reading and writing "
                           "included); planned_*: the strategy's own 'planned in' time; score_in_process_s: "
                           "simulate() of the whole trace with the trace in memory, median of 3 (the score target "
                           "is read from its balanced entry)",
               "results": res}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
