"""Measuring where users run (moeplace.evaluate.measure and compare's ``phases``): the strongest baseline, the gap
closed, the refusal of a trace too small for a profile, and the compare JSON's measured block, each against an
independent definition written out here."""

from __future__ import annotations

import numpy as np
import pytest

from moeplace.deploy.profiles import default_redundant, get_profile, merged_deployment, phase_deployments
from moeplace.evaluate import compare
from moeplace.evaluate.measure import PhaseSamples, baseline_variants, phase_block, strongest_baseline
from moeplace.placement import Cluster
from moeplace.simulate import BatchConfig, CostConfig
from moeplace.trace.reader import read_trace

REF = "src/moeplace/data/reference-fg.trace"


def s(layer, bal=None, loc=None) -> PhaseSamples:
    x = np.asarray(layer, float)
    return PhaseSamples(x, np.asarray(bal if bal is not None else x, float),
                        np.asarray(loc if loc is not None else x, float))


def test_strongest_baseline_is_the_lowest_mean_over_all_seeds():
    # two seeds; candidate A wins seed 0, B wins seed 1 by more: pooled means A (1+1+4+4)/4 = 2.5, B (2+2+2+2)/4 = 2
    seeds = [{"eplb/a": s([1, 1]), "eplb/b": s([2, 2]), "joint": s([0, 0])},
             {"eplb/a": s([4, 4]), "eplb/b": s([2, 2]), "joint": s([0, 0])}]
    name, means = strongest_baseline(seeds)
    assert name == "eplb/b" and means == {"eplb/a": 2.5, "eplb/b": 2.0}  # strategies are not candidates


def test_phase_block_by_hand():
    # baseline 10 us per micro-batch; the plan 8 with a balanced bound of 6: ratio 0.8, gap (10 - 8) / (10 - 6)
    seeds = [{"base": s([10, 10]), "p": s([8, 8], [6, 6], [3, 3])}]
    b = phase_block(seeds, "p", "base")
    assert b["layer_time_s"] == 8 and b["ratio_to_baseline"] == pytest.approx(0.8)
    assert b["bound_balanced_s"] == 6 and b["bound_local_s"] == 3 and b["gap_closed"] == pytest.approx(0.5)
    assert b["ci95"] == [pytest.approx(0.8), pytest.approx(0.8)] and b["decided"]  # no variation: a point
    assert b["microbatches"] == 2 and b["seeds"] == 1
    assert phase_block([{"base": s([]), "p": s([])}], "p", "base") is None  # nothing scored: absent


def test_time_split_by_hand():
    # two micro-batches: dispatch 1 and 3, expert 4 and 4, combine 2 and 2 -> means 2, 4, 2; inter-node sends of
    # the busiest GPU 6 and 2 against means per GPU 2 and 2 -> (6 + 2) / (2 + 2) = 2
    def parts(layer, d, m, c, busy, mean):
        p = s(layer)
        p.split = {"dispatch": np.asarray(d, float), "expert": np.asarray(m, float), "combine": np.asarray(c, float)}
        p.inter_busiest, p.inter_mean = np.asarray(busy, float), np.asarray(mean, float)
        return p
    seeds = [{"base": parts([7, 9], [1, 3], [4, 4], [2, 2], [6, 2], [2, 2]),
              "p": parts([6, 6], [1, 1], [4, 4], [1, 1], [2, 2], [2, 2])}]
    b = phase_block(seeds, "base", "base")
    assert b["time_split"] == {"dispatch_s": 2.0, "expert_s": 4.0, "combine_s": 2.0, "inter_imbalance": 2.0}
    assert phase_block(seeds, "p", "base")["time_split"]["inter_imbalance"] == 1.0  # every GPU moves the same
    assert phase_block(seeds, "p", "base")["baseline_time_split"] == b["time_split"]
    one = parts([1], [0], [1], [0], [0], [0])  # one node: no inter-node sends, no ratio
    assert phase_block([{"b": one}], "b", "b")["time_split"]["inter_imbalance"] is None
    assert phase_block([{"b": s([1])}], "b", "b")["time_split"] is None  # not recorded: not made up


def test_hierarchical_eplb_only_where_groups_divide_among_nodes():
    assert [n for n, _ in baseline_variants(8, Cluster(4, 8))] == ["eplb", "eplb-hierarchical"]
    assert [n for n, _ in baseline_variants(8, Cluster(3, 8))] == ["eplb"]
    assert [n for n, _ in baseline_variants(1, Cluster(4, 8))] == ["eplb"]


def test_profile_deployments_and_overrides():
    p = get_profile("deepseek-v3-published")
    d = phase_deployments(p)
    assert d["prefill"].cluster.spec() == "4x8" and d["decode"].cluster.spec() == "16x8"
    assert d["prefill"].prefill_tokens == 16384 * 32 and d["decode"].decode_running == 128 * 128
    assert (d["prefill"].mode, d["decode"].mode) == ("deepep-normal", "deepep-ll")
    with pytest.raises(ValueError, match="choose one with --profile-phase"):
        merged_deployment(p, d)
    # an explicit node count keeps the per-GPU sizes; an explicit total wins
    o = phase_deployments(p, cluster="2", prefill_tokens=1000)
    assert o["decode"].cluster.spec() == "2x8" and o["decode"].decode_running == 128 * 16
    assert o["prefill"].prefill_tokens == 1000 and o["prefill"].cluster_preset == "h800-8"
    m = merged_deployment(get_profile("sglang-h200-ep16"), phase_deployments(get_profile("sglang-h200-ep16")))
    assert m.mode == "auto" and m.prefill_tokens == 8192 * 16 and m.decode_running == 256 * 16
    assert default_redundant(64, 32) == 32 and default_redundant(256, 32) == 32 and default_redundant(64, 128) == 192


def test_too_small_trace_is_refused_with_one_line():
    tr = read_trace(REF)
    deps = phase_deployments(get_profile("vllm-gpt-oss-ep32"))  # prefill 262,144 tokens per micro-batch
    with pytest.raises(ValueError) as e:
        compare(tr, None, None, ["eplb"], phase_deployments=deps)
    msg = str(e.value)
    assert "\n" not in msg and "full micro-batches of 262,144 tokens" in msg and "--allow-few" in msg


@pytest.fixture(scope="module")
def small_profile_compare():
    """reference-fg on a profile shrunk to 1 x 8 GPUs with small batches: both phases fill >= 20 micro-batches."""
    tr = read_trace(REF)
    deps = phase_deployments(get_profile("vllm-gpt-oss-ep8"), prefill_tokens=1024, decode_running=64)
    return compare(tr, None, None, ["eplb", "round_robin"], phase_deployments=deps, split_seeds=[0, 1],
                   arrival="mixed", arrival_seed=3)


def test_compare_json_measured_block(small_profile_compare):
    r = small_profile_compare
    assert r["profile"] == "vllm-gpt-oss-ep8" and r["split_seeds"] == [0, 1] and r["arrival_seed"] == 3
    assert set(r["baseline"]) == {"prefill", "decode"}
    for ph, name in r["baseline"].items():
        cands = r["baseline_candidates"][ph]
        assert name == min(cands, key=cands.get)  # the strongest candidate
        assert len(cands) == 3 * 2  # global and hierarchical (8 groups on 1 node) x 3 dispatch rules
    for row in r["strategies"].values():
        for ph, b in row["phases"].items():
            assert set(b) >= {"layer_time_s", "ratio_to_baseline", "ci95", "microbatches", "bound_balanced_s",
                              "bound_local_s", "gap_closed"}
            assert b["ci95"][0] <= b["ratio_to_baseline"] <= b["ci95"][1]
            assert b["bound_local_s"] <= b["bound_balanced_s"] <= b["layer_time_s"]
            ts = b["time_split"]  # no overlap in this profile: a layer is dispatch + expert + combine
            assert ts["dispatch_s"] + ts["expert_s"] + ts["combine_s"] == pytest.approx(b["layer_time_s"])
            assert ts["inter_imbalance"] is None  # one node
            full = sum(r["microbatch_counts"][ph]["full"])
            assert b["microbatches"] == full >= 20  # only full micro-batches are scored, all seeds together
            base = r["baseline_candidates"][ph][r["baseline"][ph]]
            assert b["ratio_to_baseline"] == pytest.approx(b["layer_time_s"] / base)
    # eplb with the profile's rule is one of the candidates, so it is never faster than the strongest
    assert r["strategies"]["eplb"]["phases"]["prefill"]["ratio_to_baseline"] >= 1 - 1e-12


def test_a_phase_without_scored_microbatches_is_absent():
    tr = read_trace("src/moeplace/data/gpt-oss-20b-sample.trace")  # decode-only: no prefill rows
    r = compare(tr, Cluster(1, 4), 4, ["eplb"], cost=CostConfig(), batching=BatchConfig(decode_batch=8))
    assert "prefill" not in r["strategies"]["eplb"]["phases"] and "decode" in r["strategies"]["eplb"]["phases"]
    assert "prefill" not in r["baseline"]


def test_on_seed_sees_each_split_seeds_samples_with_bytes():
    """compare's ``on_seed`` hook gets every split seed's samples; their pooled layer times are what ``phases``
    reports, and their inter-node bytes add up to the simulator's total for the same plan and rows."""
    tr = read_trace("src/moeplace/data/gpt-oss-20b-sample.trace")
    seen = []
    r = compare(tr, Cluster(2, 2), 4, ["linear", "eplb"], cost=CostConfig(), batching=BatchConfig(decode_batch=8),
                split_seeds=[0, 1], phases=("decode",),
                on_seed=lambda s, win, smp, res, plans: seen.append((s, smp, res)))
    assert [s for s, _, _ in seen] == [0, 1]
    for _, smp, res in seen:
        for n in ("linear", "eplb"):
            j = res["decode"][n].decode.to_json()
            assert smp["decode"][n].inter_node_bytes.sum() == pytest.approx(j["inter_node_bytes"]["total"])
            assert len(smp["decode"][n].inter_node_bytes) == j["num_microbatches"]
    pooled = np.concatenate([smp["decode"]["eplb"].layer for _, smp, _ in seen])
    assert r["strategies"]["eplb"]["phases"]["decode"]["layer_time_s"] == pytest.approx(pooled.mean())
    # the first seed's rows still carry the simulator's bytes ratio to linear
    first = seen[0][1]["decode"]
    want = first["eplb"].inter_node_bytes.sum() / first["linear"].inter_node_bytes.sum()
    assert r["strategies"]["eplb"]["inter_node_bytes_vs_linear"] == pytest.approx(want)


def test_a_plan_is_scored_under_the_dispatch_rule_it_was_chosen_with():
    """A plan whose cost model names a replica rule (joint chooses placement and rule together) is replayed under
    that rule, not the deployment's; an explicit rule (the baseline candidates') still wins."""
    import dataclasses

    from moeplace.evaluate.measure import score_on, setup_of
    from moeplace.evaluate.windows import split_windows
    from moeplace.placement import CostModel
    from moeplace.plan import make_plan

    tr = read_trace(REF)
    dep = phase_deployments(get_profile("vllm-gpt-oss-ep8"), prefill_tokens=1024, decode_running=64)["decode"]
    st = setup_of(dep, full_only=True)
    win = split_windows(tr, 0.5, "random", 0, 32, "mixed", 3)
    plan = make_plan("eplb", win.plan_work, st.cluster, 8)
    assert plan.dispatch_rule is None and st.rule != "balanced"
    ruled = dataclasses.replace(plan, cost_model=CostModel(objective="layer_time", rule="balanced"))
    assert ruled.dispatch_rule == "balanced"
    t = {k: score_on(p, win, st, rule, ("decode",)).decode.layer_times()
         for k, p, rule in (("deployment", plan, None), ("own", ruled, None), ("balanced", plan, "balanced"),
                            ("explicit", ruled, "nearest-static"), ("static", plan, "nearest-static"))}
    np.testing.assert_array_equal(t["own"], t["balanced"])
    np.testing.assert_array_equal(t["explicit"], t["static"])
    assert not np.array_equal(t["own"], t["deployment"])
