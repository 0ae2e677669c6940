"""Joint planner speed: wall time of ``moeplace.plan.make_plan("joint", ...)`` with the strategy's own default
parameters (its work budget), on the bundled default trace (the reference MoE's routing, 1,000 requests).

The strategy's default parameters are read from its signature and written with the result, so a change of budget
shows in the JSON. There is no baseline: this is an absolute time on the machine named in the JSON.

    python bench/joint_speed.py [--trace PATH] [--cluster 4x2] [--redundant 8] [--repeat 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import inspect
import time
from pathlib import Path

from common import REPO, BenchRun, median

from moeplace.data import default_trace_path
from moeplace.placement import Cluster
from moeplace.plan import get_strategy, make_plan, workload_from_tokens
from moeplace.trace import read_trace


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", help="trace directory (default: the bundled default trace)")
    ap.add_argument("--cluster", default="4x2")
    ap.add_argument("--redundant", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=1, help="plans made (median wall time)")
    ap.add_argument("--json", help="write here instead of bench/results/joint_speed.json")
    args = ap.parse_args()
    run = BenchRun("joint_speed", baseline="none: absolute wall time of joint with its default work budget")
    path = Path(args.trace).resolve() if args.trace else default_trace_path()
    t = time.perf_counter()
    tr = read_trace(path)
    tk = tr.tokens
    work = workload_from_tokens(tk.request_id, tk.phase, tk.expert_ids, tr.meta.num_experts)
    read_s = time.perf_counter() - t
    cluster = Cluster.parse(args.cluster)
    defaults = {k: p.default for k, p in inspect.signature(get_strategy("joint").fn).parameters.items()
                if p.default is not inspect.Parameter.empty}
    walls, inside = [], []
    for _ in range(args.repeat):
        t = time.perf_counter()
        plan = make_plan("joint", work, cluster, args.redundant)
        walls.append(time.perf_counter() - t)
        inside.append(plan.plan_seconds)
        print(f"joint on {work.num_requests:,} requests ({len(tk):,} tokens), {cluster.spec()}, "
              f"R={args.redundant}: {walls[-1]:.1f} s wall ({plan.plan_seconds:.1f} s inside the strategy)",
              flush=True)
    shown = path.relative_to(REPO) if path.resolve().is_relative_to(REPO) else path
    run.write({"params": {"trace": str(shown), "model": tr.meta.model, "synthetic": bool(tr.meta.synthetic),
                          "requests": int(work.num_requests), "tokens": int(len(tk)), "cluster": cluster.spec(),
                          "redundant": args.redundant, "repeat": args.repeat, "joint_defaults": defaults},
               "excluded": "reading the trace and building the workload (read_s)",
               "results": {"read_s": read_s, "wall_s": walls, "plan_seconds": inside,
                           "median_wall_s": median(walls)}}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
