"""compare with an engine: every strategy x split seed is one task, and the answer is the sequential one (all but
the measured seconds)."""

from __future__ import annotations

import json

from moeplace.data import DATA_DIR
from moeplace.engine import LocalEngine
from moeplace.evaluate import run_compare
from moeplace.evaluate.measure import seed_jobs
from moeplace.placement import Cluster
from moeplace.trace import read_trace

TIMINGS = ("plan_seconds", "wall_seconds")  # measured seconds: the only fields allowed to differ


def without_timings(o):
    if isinstance(o, dict):
        return {k: without_timings(v) for k, v in o.items() if k not in TIMINGS}
    if isinstance(o, list):
        return [without_timings(v) for v in o]
    return o


def compare_both(engine, **kw) -> tuple[str, str]:
    tr = read_trace(DATA_DIR / "reference-fg.trace")
    args = (tr, Cluster(2, 4), 8)
    kw = {"strategies": ["eplb", "linear"], "split_seeds": [0, 1], "allow_few": True, **kw}
    a = run_compare(*args, **kw)
    b = run_compare(*args, engine=engine, **kw)
    return json.dumps(without_timings(a), sort_keys=True), json.dumps(without_timings(b), sort_keys=True)


def test_compare_on_local_engine_is_the_sequential_answer():
    a, b = compare_both(LocalEngine())
    assert a == b and '"eplb/balanced"' in a


def test_jobs_are_baselines_then_strategies_per_seed():
    from moeplace.evaluate.measure import PhaseSetup
    from moeplace.simulate import BatchConfig, CostConfig

    one = PhaseSetup(Cluster(2, 4), CostConfig(), BatchConfig(), "nearest-static")
    jobs = seed_jobs(1, ["linear", "eplb"], {"prefill": one, "decode": one}, 1)
    assert [(j.seed_index, j.name, j.baseline, j.group) for j in jobs] == [
        (1, "eplb", True, ("prefill", "decode")), (1, "linear", False, ("prefill", "decode")),
        (1, "eplb", False, ("prefill", "decode"))]
