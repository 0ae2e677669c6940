"""EPLB for the next window (bench/eplb_next_window.py): the replica cap of ``moeplace.plan.eplb.rebalance``, the
numba greedy packing against a plain-loop reference, next-window balancedness against a plain-loop definition,
and plan time at DeepSeek-V3 scale."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moeplace.placement import Placement
from moeplace.plan.eplb import balanced_packing, rebalance

REPO = Path(__file__).resolve().parents[1]


def bench_module():
    """bench/eplb_next_window.py imported from its file (bench/ is on the path, as when it runs)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("eplb_next_window", REPO / "bench" / "eplb_next_window.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules.setdefault("eplb_next_window", mod)  # dataclasses look their module up while it loads
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(REPO / "bench"))


def packing_loop(w: np.ndarray, packs: int, key: np.ndarray) -> np.ndarray:
    """One row: items by decreasing weight (stable), each into the lightest pack with room without its key (lowest
    index on ties), else the lightest pack with room."""
    n = len(w)
    per = n // packs
    load, size = [0.0] * packs, [0] * packs
    held: list[set] = [set() for _ in range(packs)]
    out = [-1] * n
    for i in sorted(range(n), key=lambda j: -w[j]):
        room = [q for q in range(packs) if size[q] < per]
        free = [q for q in room if key[i] not in held[q]] or room
        q = min(free, key=lambda p: (load[p], p))
        out[i] = q
        load[q] += w[i]
        size[q] += 1
        held[q].add(key[i])
    return np.array(out)


def test_greedy_packing_equals_the_plain_loop_with_replicas():
    rng = np.random.default_rng(3)
    for _ in range(30):
        packs = int(rng.choice([2, 3, 4, 8]))
        per = int(rng.integers(1, 5))
        n = packs * per
        key = rng.integers(0, max(n // 2, 1), n)  # repeated keys: replicas of one expert
        w = np.round(rng.pareto(1.0, n) * 10, 1)  # rounded: ties happen
        pack, rank = balanced_packing(w[None], packs, key=key[None])
        ref = packing_loop(w, packs, key)
        stuck = any(len(set(key[ref == q])) < (ref == q).sum() for q in range(packs))
        if not stuck:  # rows the loop leaves with a duplicate are repaired afterwards, by design
            np.testing.assert_array_equal(pack[0], ref)
        assert (np.bincount(pack[0], minlength=packs) == per).all()
        for q in range(packs):
            assert sorted(rank[0][pack[0] == q].tolist()) == list(range(per))


@pytest.mark.parametrize(("groups", "nodes", "gpus"), [(1, 4, 8), (8, 4, 8), (1, 2, 4)])
def test_replica_cap_is_respected_and_checked(groups, nodes, gpus):
    rng = np.random.default_rng(groups + gpus)
    E, L = 64, 6
    load = rng.pareto(0.7, (L, E)) * 100
    load[:, 3] *= 1e4  # one expert wants every replica it can get
    P = E + 2 * gpus * nodes
    G = gpus if groups > 1 else gpus * nodes  # GPUs one expert may spread over
    for cap in (2, 3, 4):
        p2l = rebalance(load, P, groups, nodes, nodes * gpus, max_replicas=cap)
        cnt = Placement(p2l, E, nodes * gpus).replica_count
        assert cnt.max() <= cap and cnt.min() >= 1 and (cnt.sum(1) == P).all()
    free = Placement(rebalance(load, P, groups, nodes, nodes * gpus), E, nodes * gpus).replica_count
    assert free[:, 3].min() > 4  # without the cap the hot expert takes more than 4 replicas
    with pytest.raises(ValueError, match=rf"max_replicas must be in \[1, {G}\]"):
        rebalance(load, P, groups, nodes, nodes * gpus, max_replicas=G + 1)
    with pytest.raises(ValueError, match="slots need more than 1 replicas per expert"):
        rebalance(load, P, groups, nodes, nodes * gpus, max_replicas=1)


def test_next_window_balancedness_against_plain_loops():
    """The bench's score: plan on window 0, score on window 1, each expert's load split evenly over its replicas."""
    mod = bench_module()
    rng = np.random.default_rng(5)
    E, L, W, N, R = 32, 3, 8, 2, 8
    loads = rng.pareto(1.0, (4, L, E)) * 50
    ds = mod.Dataset("hand-made", "4 random windows (synthetic)", loads)
    cell = mod.run_cell(ds, N, W // N, R, 1)
    assert cell["pairs"] == 3 and set(cell["variants"]) >= {"published", "greedy", "refined"}
    p2l = rebalance(loads[0], E + R, 1, N, W, refine=True)
    S = (E + R) // W
    per_layer = []
    for li in range(L):
        reps = {e: list(p2l[li]).count(e) for e in range(E)}
        gpu = [sum(loads[1, li, e] / reps[e] for e in p2l[li, g * S:(g + 1) * S]) for g in range(W)]
        per_layer.append(np.mean(gpu) / max(gpu))
    assert cell["variants"]["refined"]["next_per_pair"][0] == pytest.approx(float(np.mean(per_layer)), rel=1e-12)


def test_plan_time_at_deepseek_v3_scale():
    """58 x 256 experts, 288 slots, 4 x 8 GPUs, both policies: the bench measures the 20 ms target on a quiet
    machine; here the best of 5 calls must stay under 40 ms on shared cores with the eplb strategy's default
    (greedy) packing, and under 80 ms with the refined one."""
    load = np.random.default_rng(0).pareto(1.5, (58, 256)) * 1000
    for groups in (8, 1):
        for refine, limit in ((False, 0.040), (True, 0.080)):
            rebalance(load, 288, groups, 4, 32, refine=refine)
            best = np.inf
            for _ in range(5):
                t = time.perf_counter()
                rebalance(load, 288, groups, 4, 32, refine=refine)
                best = min(best, time.perf_counter() - t)
            assert best < limit, f"EPLB ({groups} groups, refine={refine}) took {best * 1e3:.1f} ms"


def test_eplb_strategy_packing_default_and_choice(tmp_path):
    """The eplb strategy's default packing is the twin-free greedy (the bench's decision under a workload change);
    ``packing="refined"`` adds the swap local search; the evaluation's baselines keep the refined packing."""
    from moeplace.evaluate.measure import baseline_variants
    from moeplace.placement import Cluster
    from moeplace.plan.base import Workload
    from moeplace.plan.eplb import plan_eplb
    from moeplace.plan.registry import DEFAULT_EPLB_PACKING, STRATEGIES

    assert DEFAULT_EPLB_PACKING == "greedy" and STRATEGIES["eplb"].param("packing").default == "greedy"
    load = np.random.default_rng(1).pareto(1.2, (4, 32)) * 100
    work = Workload(load=load)
    cl = Cluster(2, 4)
    got = plan_eplb(work, cl, 8)
    assert np.array_equal(got.phy2log, rebalance(load, 40, 1, 2, 8, refine=False))
    assert got.extra["packing"] == "greedy"
    ref = plan_eplb(work, cl, 8, packing="refined")
    assert np.array_equal(ref.phy2log, rebalance(load, 40, 1, 2, 8, refine=True))
    with pytest.raises(ValueError, match="packing"):
        plan_eplb(work, cl, 8, packing="best")
    assert all(p["packing"] == "refined" for _, p in baseline_variants(8, Cluster(2, 4)))


def test_cli_packing_flag(tmp_path):
    """``plan --strategy eplb --packing refined`` reaches the strategy; a packing that does not exist exits 2."""
    import json
    import subprocess

    lf = tmp_path / "load.json"
    lf.write_text(json.dumps((np.random.default_rng(2).pareto(1.2, (2, 16)) * 100).round().tolist()))
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "moeplace", "plan", "--load", str(lf), "--strategy", "eplb", "--cluster", "2x4",
           "--redundant", "8"]
    p = subprocess.run([*cmd, "--packing", "refined", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "refined" in out.read_text()
    bad = subprocess.run([*cmd, "--packing", "best", "--out", str(tmp_path / "b.json")], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "packing" in bad.stderr and "Traceback" not in bad.stderr


def test_deepseek_shaped_datasets_and_the_change_rule():
    """The DeepSeek-V3-shaped windows: 256 experts, every ordered pair of distinct domains, the SYNTHETIC 58-layer
    set labelled so; the decision keeps the greedy packing when refinement lowers balancedness under a change."""
    B = bench_module()
    ds = B.deepseek_shaped_datasets()
    syn = [d for d in ds if "SYNTHETIC" in d.name]
    assert len(syn) == 1 and syn[0].loads.shape[1:] == (58, 256) and "SYNTHETIC" in syn[0].what
    dom = [d for d in ds if d.name.endswith("domains")]
    if (B.DATA / "reference-ds.trace").exists():
        assert len(dom) == 2 and all(d.loads.shape[2] == 256 and d.change == "domain" for d in dom)
        assert sorted(dom[0].pair_list()) == [(a, b) for a in range(3) for b in range(3) if a != b]
        # each domain's load counts exactly the decode (or prefill) selections of that domain's tokens
        assert dom[0].loads.sum() + dom[1].loads.sum() <= 284414 * 8 * 8
    up = {"ratio": 1.01, "ci95": [1.0, 1.02]}
    down = {"ratio": 0.99, "ci95": [0.98, 1.0]}
    comps = {"refined_vs_greedy": {"next_window": up}, "refined_vs_greedy_under_change": {"next_window": down}}
    assert B.decide(comps)["packing"] == "greedy"
    comps["refined_vs_greedy_under_change"] = {"next_window": up}
    assert B.decide(comps)["packing"] == "refined"


def test_default_packing_is_the_committed_bench_decision():
    """The eplb strategy's default packing is what bench/results/eplb_next_window.json decided (rerun the bench
    and this test tells when the decision moved)."""
    import json

    from moeplace.plan.registry import DEFAULT_EPLB_PACKING

    res = json.loads((REPO / "bench" / "results" / "eplb_next_window.json").read_text())
    assert res["results"]["defaults"]["packing"] == DEFAULT_EPLB_PACKING
    assert {"vllm", "sglang"} <= set(res["engines"]) and all("version" in res["engines"][e] for e in ("vllm", "sglang"))
