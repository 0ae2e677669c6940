"""Decisions with evidence (moeplace.plan.decide): the evidence's micro-batches by a loop over the rules, and the
decision on hand-made fold times whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from moeplace.plan.decide import decide, evidence_microbatches


def fold_rows(seed: int, rows: int, requests: int, prompt_share: int):
    """(token_request [rows] sorted, prefill [rows]: the first 1/prompt_share of each request's rows, decode: the
    others, arrival: a permutation of the requests)."""
    rng = np.random.default_rng(seed)
    tr = np.sort(rng.integers(0, requests, rows))
    pre = np.zeros(rows, bool)
    for r in range(requests):
        at = np.flatnonzero(tr == r)
        pre[at[: len(at) // prompt_share]] = True
    return tr, pre, ~pre, rng.permutation(requests)


def test_evidence_microbatches_follow_the_rules_by_loops():
    tr, pre, dec, arrival = fold_rows(3, 200, 7, 4)
    got, sizes = evidence_microbatches(tr, pre, dec, arrival, prefill_tokens=1000, decode_rows=9, min_microbatches=4)
    n_pre, n_dec = int(pre.sum()), int(dec.sum())
    assert sizes == {"prefill": min(1000, n_pre // 4), "decode": 9}
    # prefill: prompts end to end in arrival order, cut every size rows; the partial last chunk is not scored
    order = [t for r in arrival for t in range(200) if tr[t] == r and pre[t]]
    for i, t in enumerate(order):
        want = i // sizes["prefill"]
        assert got[t] == (want if want < n_pre // sizes["prefill"] else -1)
    # decode: step j of every request (in arrival order), then step j + 1, the steps dealt round-robin over the
    # n_dec // 9 micro-batches (step j to micro-batch j mod that), cut every 9 rows
    step = {}
    seq = []
    for t in range(200):
        if dec[t]:
            step[t] = sum(1 for u in range(t) if dec[u] and tr[u] == tr[t])
    rank = {int(r): i for i, r in enumerate(arrival)}
    n_mb = n_dec // 9
    seq = sorted(step, key=lambda t: (step[t] % n_mb, step[t], rank[int(tr[t])]))
    for i, t in enumerate(seq):
        want = i // 9
        assert got[t] == (want if want < n_dec // 9 else -1)


def test_under_decode_windows_the_evidence_batches_as_serving_does_by_loops():
    """Windows of up to decode_rows consecutive requests in arrival order; micro-batch (w, j) is the j-th decode
    row of every request of window w, tails included; ids dense in (window, step) order; prefill unchanged."""
    tr, pre, dec, arrival = fold_rows(5, 300, 11, 3)
    got, sizes = evidence_microbatches(tr, pre, dec, arrival, prefill_tokens=20, decode_rows=4, decode_windows=True)
    old, _ = evidence_microbatches(tr, pre, dec, arrival, prefill_tokens=20, decode_rows=4)
    assert (got[pre] == old[pre]).all()
    assert sizes["decode"] == 4
    rank = {int(r): i for i, r in enumerate(arrival)}
    key = {}
    for t in range(300):
        if dec[t]:
            j = sum(1 for u in range(t) if dec[u] and tr[u] == tr[t])
            key[t] = (rank[int(tr[t])] // 4, j)
    dense = {k: i for i, k in enumerate(sorted(set(key.values())))}
    for t, k in key.items():
        assert got[t] == dense[k]
    # a fold with fewer requests than a window forms one window of all of them
    _, few = evidence_microbatches(tr, pre, dec, arrival, prefill_tokens=20, decode_rows=64, decode_windows=True)
    assert few["decode"] == 11


def folds(rng, mean, sd, n=(12, 12)):
    return [np.maximum(mean + sd * rng.standard_normal(k), 1e-6) for k in n]


def test_a_clear_win_is_deployed_and_noise_is_not():
    rng = np.random.default_rng(0)
    base = [10 + rng.standard_normal(12) for _ in range(2)]  # per fold micro-batch times of the best baseline
    slow_base = [b * 1.05 for b in base]
    win = [b * 0.9 + 0.05 * rng.standard_normal(12) for b in base]  # 10% faster, paired, little noise
    noisy = [b * (0.99 + 0.2 * rng.standard_normal(12)) for b in base]  # 1% faster on average, much noise
    times = {"decode": {"eplb/static": slow_base, "eplb/balanced": base, "grouped/balanced": win,
                        "other/balanced": noisy}}
    d = decide(times, ["eplb/static", "eplb/balanced"])
    assert d["baseline"] == {"decode": "eplb/balanced"}
    assert d["deployed"] == "candidate" and d["chosen"] == "grouped/balanced"
    assert d["candidates"]["grouped/balanced"]["decode"]["ci95"][1] < 1.0
    assert not d["candidates"]["other/balanced"]["decode"]["eligible"]
    # without the clear win, the noisy candidate does not make it: the plan is the best baseline
    del times["decode"]["grouped/balanced"]
    d = decide(times, ["eplb/static", "eplb/balanced"])
    assert d["deployed"] == "baseline" and d["chosen"] == "eplb/balanced"
    lo, hi = d["candidates"]["other/balanced"]["decode"]["ci95"]
    assert lo < 1.0 < hi


def test_every_weighed_phase_must_be_won():
    rng = np.random.default_rng(1)
    b_pre = [5 + rng.random(10) for _ in range(2)]
    b_dec = [3 + rng.random(10) for _ in range(2)]
    times = {"prefill": {"eplb/x": b_pre, "g/x": [b * 0.8 for b in b_pre]},
             "decode": {"eplb/x": b_dec, "g/x": [b * 1.02 for b in b_dec]}}
    d = decide(times, ["eplb/x"])
    assert d["deployed"] == "baseline" and d["chosen"] == "eplb/x"
    assert d["candidates"]["g/x"]["prefill"]["ci95"][1] < 1.0 < d["candidates"]["g/x"]["decode"]["ci95"][0]
    assert decide({"prefill": times["prefill"]}, ["eplb/x"])["chosen"] == "g/x"  # prefill alone: a win


def test_no_baseline_or_no_microbatch_is_refused():
    with pytest.raises(ValueError, match="baselines"):
        decide({"decode": {"a": [np.ones(3)]}}, ["eplb"])
    with pytest.raises(ValueError, match="no phase"):
        decide({"decode": {"eplb": [np.zeros(0)]}}, ["eplb"])


def test_the_default_baseline_is_kept_unless_another_is_faster_beyond_the_noise():
    rng = np.random.default_rng(2)
    base = [10 + rng.standard_normal(12) for _ in range(2)]
    tied = [b * (1.0 + 0.05 * rng.standard_normal(12)) for b in base]  # not told apart from the default
    times = {"decode": {"eplb/static": tied, "eplb/balanced": base}}
    d = decide(times, ["eplb/static", "eplb/balanced"], default="eplb/balanced")
    assert d["deployed"] == "baseline" and d["chosen"] == "eplb/balanced"
    faster = [b * 0.95 for b in base]  # 5% faster in every micro-batch: beyond the noise
    d = decide({"decode": {"eplb/static": faster, "eplb/balanced": base}}, ["eplb/static", "eplb/balanced"],
               default="eplb/balanced")
    assert d["chosen"] == "eplb/static"


def test_evidence_below_the_deployment_size_switches_nothing():
    """A clear win and a faster baseline, both on shrunk micro-batches of the phase: the default baseline stays,
    and the decision names the phase. The same evidence at deployment size deploys the candidate."""
    rng = np.random.default_rng(3)
    base = [10 + rng.standard_normal(12) for _ in range(2)]
    times = {"prefill": {"eplb/static": [b * 0.95 for b in base], "eplb/balanced": base,
                         "grouped/balanced": [b * 0.8 for b in base]}}
    kw = {"default": "eplb/balanced"}
    assert decide(times, ["eplb/static", "eplb/balanced"], **kw)["chosen"] == "grouped/balanced"
    d = decide(times, ["eplb/static", "eplb/balanced"], undersized={"prefill"}, **kw)
    assert d["deployed"] == "baseline" and d["chosen"] == "eplb/balanced"
    assert d["undersized"] == ["prefill"] and "smaller than the deployment's" in d["reason"]
    assert not d["candidates"]["grouped/balanced"]["prefill"]["eligible"]
    # a phase that is not weighed does not count
    d = decide(times, ["eplb/static", "eplb/balanced"], undersized={"decode"}, **kw)
    assert d["chosen"] == "grouped/balanced"


def test_prefill_only_window_builds_its_baselines_from_the_prompts():
    """A window without decode rows (a prefill-scale trace): its prompts are its traffic, so the load joint builds
    its EPLB baselines from on a fold is those prompts' selections, as the deployed baseline's (work.load) is on
    the whole window, never an empty load."""
    from moeplace.data import default_trace_path
    from moeplace.plan.base import workload_from_tokens
    from moeplace.plan.joint_time import requests_load
    from moeplace.trace import read_trace

    tr = read_trace(default_trace_path())
    tk = tr.tokens.select(tr.tokens.phase == 0)  # prompts only
    work = workload_from_tokens(tk.request_id, tk.phase, tk.expert_ids, tr.meta.num_experts)
    assert work.traffic_rows().all() and work.admission_rows.all()
    requests = np.arange(0, work.num_requests, 2)
    rows = np.isin(work.token_request, requests)
    load = np.zeros((tr.meta.num_layers, tr.meta.num_experts))  # by hand: selections of those requests' prompts
    for layer in range(tr.meta.num_layers):
        load[layer] = np.bincount(work.expert_ids[rows, layer].ravel(), minlength=tr.meta.num_experts)
    assert load.sum() > 0
    assert np.array_equal(requests_load(work, requests), load)
    assert np.array_equal(requests_load(work, np.arange(work.num_requests)), work.load)
    both = workload_from_tokens(tr.tokens.request_id, tr.tokens.phase, tr.tokens.expert_ids, tr.meta.num_experts)
    assert np.array_equal(both.traffic_rows(), ~both.admission_rows)  # with decode rows: the decode rows
    assert np.array_equal(requests_load(both, np.arange(both.num_requests)), both.load)


def test_prefill_only_window_has_no_usage_candidates():
    """Grouping by what requests go on to use needs rows after admission: a prefill-only window times only the
    signal-grouped candidates (with decode weighed too), and its decision names no usage candidate."""
    from moeplace.data import default_trace_path
    from moeplace.placement import Cluster
    from moeplace.plan.base import workload_from_tokens
    from moeplace.plan.joint_time import plan_joint_time
    from moeplace.trace import read_trace

    tr = read_trace(default_trace_path())
    tk = tr.tokens.select(tr.tokens.phase == 0)
    work = workload_from_tokens(tk.request_id, tk.phase, tk.expert_ids, tr.meta.num_experts)
    res = plan_joint_time(work, Cluster(2, 2), 4, hidden_size=128, prefill_tokens=512, phases="both")
    names = list(res.extra["decision"]["candidates"])
    assert any(n.startswith("node-affinity/") for n in names)
    assert not any(n.startswith("usage-") for n in names)
