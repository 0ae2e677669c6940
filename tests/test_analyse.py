"""Activation-pattern statistics: hand-made traces with known answers, vectorised vs plain-loop references,
counts-only traces, the CLI and the JSON contract, and real routing from ../shared/data (skipped when absent)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import make_tokens, shared_data
from scipy.spatial.distance import jensenshannon
from scipy.stats import pearsonr, spearmanr

from moeplace.analyse import (
    TokenAccumulator,
    analyse_trace,
    coactivation_counts,
    coactivation_lift,
    gini,
    interlayer_counts,
    interlayer_lift,
    js_divergence,
    load_stats,
    pairwise_js,
    prefill_decode_correlation,
    softmax_regression_accuracy,
    stratified_split,
    top_n_overlap,
)
from moeplace.analyse.reference import decode_overlap_loop, gini_loop, interlayer_loop, load_coactivation_loop
from moeplace.cli import main
from moeplace.trace import TraceMeta, TraceWriter

REQUIRED_KEYS = [
    ("meta", "model"), ("meta", "synthetic"), ("meta", "num_layers"), ("meta", "num_experts"), ("meta", "top_k"),
    ("meta", "num_tokens"), ("imbalance", "max_over_mean"), ("imbalance", "gini"), ("imbalance", "cv"),
    ("imbalance", "top10_share"), ("imbalance", "by_phase"), ("imbalance", "by_domain"), ("domain", "order"),
    ("domain", "js_divergence"), ("domain", "classification_accuracy"), ("prefill_decode", "pearson"),
    ("prefill_decode", "pearson_mean"), ("prefill_decode", "spearman"), ("prefill_decode", "top_n_overlap"),
    ("coactivation", "top_pairs"), ("interlayer", "top_pairs"), ("temporal", "decode_overlap"), ("drift", "js"),
]


def write_tokens(path, arr, L, E, K, domains=None, synthetic=True, shard_tokens=1 << 18):
    meta = TraceMeta(model="hand-made", num_layers=L, num_experts=E, top_k=K, synthetic=synthetic, source="tests")
    rids = np.unique(arr["request_id"])
    with TraceWriter(path, meta, shard_tokens=shard_tokens) as w:
        w.add_requests(rids, domain=domains)
        w.add_tokens(arr["request_id"], arr["position"], arr["phase"], arr["expert_ids"])
    return path


def tokens(rid, pos, phase, ids):
    return dict(request_id=np.asarray(rid), position=np.asarray(pos), phase=np.asarray(phase, np.int8),
                expert_ids=np.asarray(ids, np.int16))


def check_json(res):
    text = json.dumps(res, allow_nan=False)  # raises on NaN / inf
    back = json.loads(text)
    for sec, key in REQUIRED_KEYS:
        assert key in back[sec], f"{sec}.{key} missing"
    return back


# --------------------------------------------------------------------------------------------- pure functions


def test_load_stats_uniform_and_one_hot():
    st = load_stats(np.full((2, 20), 7.0))
    assert np.allclose(st["max_over_mean"], 1) and np.allclose(st["gini"], 0) and np.allclose(st["cv"], 0)
    assert np.allclose(st["top10_share"], 2 / 20)  # ceil(0.1 * 20) = 2 experts
    one = np.zeros((1, 8))
    one[0, 3] = 5
    st = load_stats(one)
    assert st["max_over_mean"][0] == pytest.approx(8) and st["gini"][0] == pytest.approx(7 / 8)
    assert st["top10_share"][0] == pytest.approx(1)
    assert np.isnan(load_stats(np.zeros((1, 4)))["gini"][0])


def test_gini_matches_definition():
    rng = np.random.default_rng(1)
    x = rng.random((5, 13)) * 10
    assert np.allclose(gini(x), [gini_loop(r) for r in x])


def test_js_divergence_bounds_and_scipy():
    p = np.array([1.0, 0, 0, 0])
    assert js_divergence(p, p) == pytest.approx(0)
    assert js_divergence(p, np.array([0, 1.0, 0, 0])) == pytest.approx(1)  # bits: disjoint -> 1
    rng = np.random.default_rng(2)
    a, b = rng.random(10), rng.random(10)
    assert js_divergence(a, b) == pytest.approx(jensenshannon(a, b, base=2) ** 2)
    js = pairwise_js(rng.random((3, 2, 10)))
    assert js.shape == (2, 3, 3) and np.allclose(js, js.transpose(0, 2, 1)) and np.allclose(js[:, [0, 1, 2],
                                                                                              [0, 1, 2]], 0)


def test_two_experts_always_together_lift():
    # E=4, K=2: half the tokens pick {0, 1}, half {2, 3}. Random pairing with these loads would pair each expert
    # with each of its 3 possible partners equally often, so the lift of an always-together pair is 3.
    ids = np.array([[[0, 1]], [[3, 2]]] * 50)
    c = coactivation_counts(ids, 4)
    assert c[0, 0, 1] == c[0, 1, 0] == 50 and c[0, 0, 2] == 0 and np.all(np.diagonal(c[0]) == 0)
    load = np.array([np.bincount(ids[:, 0].ravel(), minlength=4)])
    lift = coactivation_lift(c, load)
    assert lift[0, 0, 1] == pytest.approx(3) and lift[0, 2, 3] == pytest.approx(3) and lift[0, 0, 2] == 0


def test_random_pairs_have_lift_near_one():
    rng = np.random.default_rng(3)
    ids = np.stack([rng.choice(8, 3, replace=False) for _ in range(20000)])[:, None, :]
    c = coactivation_counts(ids, 8)
    lift = coactivation_lift(c, np.bincount(ids.ravel(), minlength=8)[None])
    off = ~np.eye(8, dtype=bool)
    assert np.allclose(lift[0][off], 1, atol=0.06)


def test_vectorised_matches_loops():
    rng = np.random.default_rng(4)
    arr = make_tokens(rng, 4, L=3, E=9, K=3)
    ids = arr["expert_ids"]
    load_ref, co_ref = load_coactivation_loop(ids, 9)
    assert np.array_equal(coactivation_counts(ids, 9), co_ref)
    assert np.array_equal(interlayer_counts(ids, 9), interlayer_loop(ids, 9))
    acc = TokenAccumulator(3, 9, 3)
    for s in range(0, len(ids), 5):  # odd chunk sizes
        sl = slice(s, s + 5)
        acc.update(ids[sl], arr["request_id"][sl], arr["position"][sl], arr["phase"][sl])
    acc.finish()
    assert np.array_equal(acc.load.sum((0, 1)), load_ref)
    assert np.array_equal(acc.coact, co_ref)
    assert np.array_equal(acc.inter, interlayer_loop(ids, 9))


def test_interlayer_lift_known():
    # Expert e at layer 0 is always followed by expert e at layer 1 (E=4, K=1): lift 4, others 0.
    ids = np.array([[[e], [e]] for e in range(4)] * 10)
    c = interlayer_counts(ids, 4)
    load = np.stack([np.bincount(ids[:, lyr, 0], minlength=4) for lyr in range(2)])
    lift = interlayer_lift(c, load, len(ids))
    assert np.allclose(np.diagonal(lift[0]), 4) and lift[0, 0, 1] == 0


def test_correlations_match_scipy():
    rng = np.random.default_rng(5)
    pre = rng.integers(0, 9, (6, 2, 10)).astype(float)
    dec = rng.integers(0, 9, (6, 2, 10)).astype(float)
    pd = prefill_decode_correlation(pre, dec, top_n=3)
    for r in range(6):
        for lyr in range(2):
            assert pd["pearson"][r, lyr] == pytest.approx(pearsonr(pre[r, lyr], dec[r, lyr])[0])
            assert pd["spearman"][r, lyr] == pytest.approx(spearmanr(pre[r, lyr], dec[r, lyr])[0])
    same = prefill_decode_correlation(pre, pre * 2, top_n=3)
    assert np.allclose(same["pearson"], 1) and np.allclose(same["spearman"], 1) and np.allclose(
        same["top_n_overlap"], 1)
    assert top_n_overlap(np.array([[3, 2, 1, 0.0]]), np.array([[0, 1, 2, 3.0]]), 2)[0] == 0
    dec[2] = 0  # a request without decode tokens is dropped
    assert 2 not in prefill_decode_correlation(pre, dec, 3)["requests"]


def test_split_and_classifier():
    y = np.array([0] * 10 + [1] * 5 + [2])
    tr, te = stratified_split(y, 0.3, seed=0)
    assert set(tr) | set(te) == set(range(15)) and not set(tr) & set(te)  # the lone class-2 sample is left out
    assert (y[te] == 0).sum() == 3 and (y[te] == 1).sum() == 2
    assert np.array_equal(stratified_split(y, 0.3, 0)[1], te)  # seeded
    rng = np.random.default_rng(6)
    X = np.vstack([rng.normal(0, 1, (30, 5)), rng.normal(3, 1, (30, 5))])
    lab = np.repeat([0, 1], 30)
    res = softmax_regression_accuracy(X, lab, 2, seed=0)
    assert res["accuracy"] == 1.0 and res["confusion"].sum() == res["num_test"] == 18
    assert softmax_regression_accuracy(X, np.zeros(60, int), 2) is None
    with pytest.raises(ValueError, match="labels"):
        softmax_regression_accuracy(X, lab + 5, 2)


def test_bad_input_raises():
    with pytest.raises(ValueError, match="expert_ids"):
        coactivation_counts(np.array([[[0, 9]]]), 4)
    with pytest.raises(ValueError, match="non-negative"):
        load_stats(-np.ones((1, 3)))
    with pytest.raises(ValueError, match=r"\[L, E\]"):
        load_stats(np.ones(3))
    with pytest.raises(ValueError, match="top_n_overlap"):
        top_n_overlap(np.ones((1, 3)), np.ones((1, 3)), 5)


# --------------------------------------------------------------------------------------------- whole traces


def test_trace_known_answers(tmp_path):
    """Decode copies prefill routing, two domains use disjoint experts, two experts always together."""
    L, E, K = 2, 8, 2
    rid, pos, ph, ids, doms = [], [], [], [], []
    for r in range(12):
        base = 0 if r % 2 == 0 else 4  # domain a: experts 0-3, domain b: 4-7
        seq = [[base + (t % 2) * 2, base + (t % 2) * 2 + 1] for t in range(4)]  # pairs {0,1},{2,3} alternate
        for t in range(8):
            rid.append(r)
            pos.append(t)
            ph.append(0 if t < 4 else 1)
            ids.append([seq[t % 4]] * L)
        doms.append("a" if r % 2 == 0 else "b")
    arr = tokens(rid, pos, ph, ids)
    res = check_json(analyse_trace(write_tokens(tmp_path / "t", arr, L, E, K, doms), window_tokens=16))
    assert res["meta"]["num_tokens"] == {"total": 96, "prefill": 48, "decode": 48}
    assert res["imbalance"]["max_over_mean"] == [1.0, 1.0] and res["imbalance"]["gini"] == [0.0, 0.0]
    assert res["prefill_decode"]["pearson"] == [1.0, 1.0] and res["prefill_decode"]["pearson_mean"] == 1.0
    assert res["prefill_decode"]["num_requests"] == 12
    assert res["domain"]["order"] == ["a", "b"]
    assert res["domain"]["js_divergence"] == [[0.0, 1.0], [1.0, 0.0]]
    assert res["domain"]["classification_accuracy"] == 1.0
    # {0,1} always together; lift = 7 (7 possible partners with equal loads, but only one ever seen)
    top = res["coactivation"]["top_pairs"][0]
    assert top["count"] == 24 and top["lift"] == pytest.approx(7)
    assert res["coactivation"]["counts"][0][1] == 24 and res["coactivation"]["layer"] == 1
    # decode alternates {0,1} -> {2,3}: consecutive tokens share nothing
    assert res["temporal"]["decode_overlap"] == [0.0, 0.0] and res["temporal"]["num_pairs"] == 36
    # each expert at layer 0 is followed by itself at layer 1 and its partner
    assert res["interlayer"]["follow_share"] == [1.0]
    assert res["drift"]["num_windows"] == 6 and res["unavailable"] == {}


def test_lift_needs_min_support(tmp_path):
    """A pair seen in one token of 400 (0.25%) has by far the highest lift but must not head the lift ranking,
    the text summary or the report: lifts rank only pairs seen in >= MIN_PAIR_SUPPORT of the tokens."""
    from moeplace.analyse.report import render_report
    from moeplace.analyse.summary import MIN_PAIR_SUPPORT, format_summary

    rng = np.random.default_rng(0)
    T, E = 400, 8
    common = [sorted(rng.choice(6, 2, replace=False).tolist()) for _ in range(T - 1)]  # experts 0-5
    ids = [[p] for p in common] + [[[6, 7]]]  # the rare pair {6, 7}, once
    arr = tokens(np.arange(T) // 4, np.arange(T) % 4, [0] * T, ids)
    res = check_json(analyse_trace(write_tokens(tmp_path / "t", arr, 1, E, 2), window_tokens=100))
    co = res["coactivation"]
    lift = np.asarray(co["lift"], dtype=float)
    rare = lift[6, 7]
    assert co["min_count"] == math.ceil(MIN_PAIR_SUPPORT * T) == 4
    assert rare > 10 * max(p["lift"] for p in co["top_lift_pairs"])  # it would win without the support rule
    assert all(p["count"] >= co["min_count"] for p in co["top_lift_pairs"])
    assert [6, 7] not in [p["experts"] for p in co["top_lift_pairs"]]
    assert co["max_lift"][0] == pytest.approx(co["top_lift_pairs"][0]["lift"]) and co["max_lift"][0] < rare
    text = format_summary(res)
    assert "6+7" not in text and "pairs in >= 1% of tokens" in text
    page = render_report(res)
    assert "at least 1% of the tokens rank by lift" in page and f"{rare:.2f}" not in page


def test_drift_detects_a_shift(tmp_path):
    ids = np.zeros((40, 1, 1), np.int16)
    ids[20:] = 1  # second half of the trace uses another expert
    arr = tokens(np.arange(40) // 10, np.arange(40) % 10, np.ones(40), ids)
    res = check_json(analyse_trace(write_tokens(tmp_path / "t", arr, 1, 2, 1), window_tokens=10))
    assert res["drift"]["num_windows"] == 4
    assert res["drift"]["js_series"] == [0.0, 1.0, 0.0] and res["drift"]["js"] == [pytest.approx(1 / 3)]
    assert res["coactivation"]["top_pairs"] is None and "coactivation" in res["unavailable"]  # k = 1
    assert "interlayer" in res["unavailable"] and res["temporal"]["decode_overlap"] == [1.0]


def test_streaming_matches_loops_and_is_chunk_invariant(tmp_path):
    rng = np.random.default_rng(7)
    arr = make_tokens(rng, 9, L=3, E=6, K=2, prompt=4, gen=7)
    perm = np.argsort(arr["position"] * 100 + arr["request_id"], kind="stable")  # interleave requests (batching)
    arr = {k: v[perm] for k, v in arr.items()}
    path = write_tokens(tmp_path / "t", arr, 3, 6, 2, ["x", "y", "z"] * 3, shard_tokens=17)
    a = analyse_trace(path, chunk_tokens=5, window_tokens=13)
    b = analyse_trace(path, chunk_tokens=100000, window_tokens=13)
    a["params"]["chunk_tokens"] = b["params"]["chunk_tokens"]
    assert a == b
    load_ref, co_ref = load_coactivation_loop(arr["expert_ids"], 6)
    assert np.array_equal(a["load"]["counts"], load_ref)
    assert np.array_equal(a["coactivation"]["counts"], co_ref[1])
    ov, pairs = decode_overlap_loop(arr["expert_ids"], arr["request_id"], arr["position"], arr["phase"])
    assert a["temporal"]["num_pairs"] == pairs == 9 * 6 and np.allclose(a["temporal"]["decode_overlap"], ov)
    # per-request prefill/decode vectors against a direct count
    pre = np.zeros((9, 3, 6))
    dec = np.zeros((9, 3, 6))
    for t in range(len(arr["phase"])):
        tgt = pre if arr["phase"][t] == 0 else dec
        for lyr in range(3):
            for e in arr["expert_ids"][t, lyr]:
                tgt[arr["request_id"][t], lyr, e] += 1
    want = prefill_decode_correlation(pre, dec, 2)
    assert np.allclose(a["prefill_decode"]["pearson"], np.nanmean(want["pearson"], 0))
    # carry limited to one request: interleaved pairs across chunks are partly lost, never invented
    acc = TokenAccumulator(3, 6, 2, carry_requests=1)
    for s in range(0, len(perm), 5):
        sl = slice(s, s + 5)
        acc.update(arr["expert_ids"][sl], arr["request_id"][sl], arr["position"][sl], arr["phase"][sl])
    assert acc.overlap_pairs < pairs


def test_tracked_request_subset(tmp_path, small_trace):
    path, arr, meta = small_trace
    per_request = 2 * meta.num_layers * meta.num_experts * 4
    res = analyse_trace(path, max_request_bytes=3 * per_request)
    assert res["params"]["tracked_requests"] == 3 and res["prefill_decode"]["num_requests"] == 3
    full = analyse_trace(path)
    assert full["params"]["tracked_requests"] == 6 and full["imbalance"] == res["imbalance"]


def test_decode_only_and_unknown_domain(tmp_path):
    rng = np.random.default_rng(8)
    arr = make_tokens(rng, 3, L=2, E=4, K=2, prompt=0, gen=5)
    res = check_json(analyse_trace(write_tokens(tmp_path / "t", arr, 2, 4, 2)))
    assert res["prefill_decode"]["pearson"] is None and res["prefill_decode"]["pearson_mean"] is None
    assert "no prefill" in res["unavailable"]["prefill_decode"]
    assert res["imbalance"]["by_phase"]["prefill"] is None and res["imbalance"]["by_phase"]["decode"] is not None
    assert res["domain"]["js_divergence"] is None and "domain" in res["unavailable"]
    assert res["drift"]["js"] is None and "window" in res["unavailable"]["drift"]


def test_bad_parameters(small_trace):
    path = small_trace[0]
    for kw, msg in (({"chunk_tokens": 0}, "chunk_tokens"), ({"coactivation_layer": 3}, "layer"),
                    ({"test_fraction": 1.0}, "test_fraction"), ({"top_n": 99}, "top_n")):
        with pytest.raises(ValueError, match=msg):
            analyse_trace(path, **kw)


def write_counts(path, names, counts, K, phase=None, domains=None, model="counts-model", layer_map=None):
    G, L, E = counts.shape
    meta = TraceMeta(model=model, num_layers=L, num_experts=E, top_k=K, kind="counts", moe_layer_map=layer_map,
                     source="tests")
    with TraceWriter(path, meta) as w:
        w.add_counts(names, domains or names, np.full(G, -1, np.int8) if phase is None else phase,
                     counts.sum((1, 2)) / (L * K), counts)
    return path


def test_counts_only_trace(tmp_path):
    rng = np.random.default_rng(9)
    c = rng.integers(1, 50, (8, 2, 6)).astype(float)
    c[4:, :, :3] *= 20  # domain "b" groups favour experts 0-2
    doms = ["a"] * 4 + ["b"] * 4
    res = check_json(analyse_trace(write_counts(tmp_path / "c", [f"g{i}" for i in range(8)], c, 2,
                                                phase=np.array([0, 1] * 4, np.int8), domains=doms)))
    assert res["meta"]["kind"] == "counts" and res["meta"]["num_count_groups"] == 8
    st = load_stats(c.sum(0))
    assert np.allclose(res["imbalance"]["gini"], st["gini"])
    assert np.allclose(res["imbalance"]["by_phase"]["prefill"]["max_over_mean"],
                       load_stats(c[::2].sum(0))["max_over_mean"])
    assert res["domain"]["js_divergence"][0][1] > 0.1 and res["domain"]["classification_accuracy"] == 1.0
    assert res["domain"]["classification"]["samples"] == "count groups"
    assert len(res["groups"]["max_over_mean"]) == 8
    for sec in ("prefill_decode", "coactivation", "interlayer", "temporal", "drift"):
        assert sec in res["unavailable"]
    assert res["prefill_decode"]["pearson"] is None and res["coactivation"]["top_pairs"] is None


def test_cli_analyze(tmp_path, small_trace, capsys):
    path = small_trace[0]
    out_json, out_html = tmp_path / "a.json", tmp_path / "r" / "a.html"
    rc = main(["analyze", str(path), "--json", str(out_json), "--html", str(out_html), "--layer", "2",
               "--chunk-tokens", "7", "--window-tokens", "10", "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "[SYNTHETIC]" in out and "max/mean expert load" in out and "wrote html" in out
    res = json.loads(out_json.read_text())
    assert res["coactivation"]["layer"] == 2 and res["params"]["chunk_tokens"] == 7
    assert "SYNTHETIC" in out_html.read_text()
    assert main(["analyze", str(path), "--layer", "9", "--no-progress"]) == 2
    assert "layer must be in" in capsys.readouterr().err
    assert main(["analyze", "--help"]) == 0
    assert "example:" in capsys.readouterr().out


def test_docs_list_every_json_key(small_trace):
    """docs/ANALYSIS.md documents every top-level key and every key of each section."""
    from conftest import REPO

    doc = (REPO / "docs" / "ANALYSIS.md").read_text()
    res = analyse_trace(small_trace[0])
    for sec, val in res.items():
        assert f"`{sec}`" in doc, sec
        if isinstance(val, dict) and sec not in ("unavailable",):
            for key in val:
                assert f"`{sec}.{key}`" in doc, f"{sec}.{key}"


# --------------------------------------------------------------------------------------------- real data


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    z = np.load(shared_data("gpt-oss-20b", "decode_routing.npz"), allow_pickle=False)
    ids, off, pos = z["expert_ids"], z["example_offsets"], z["token_position"]
    rid = np.repeat(np.arange(len(off) - 1), np.diff(off))
    arr = tokens(rid, pos, np.ones(len(ids)), ids)
    lines = shared_data("gpt-oss-20b", "decode_routing_meta.jsonl").read_text().splitlines()
    family = [json.loads(x)["dataset"] for x in lines]  # mmlu_test -> mmlu, mmlu_pro_test -> mmlu_pro, gpqa_main...
    family = ["mmlu_pro" if d.startswith("mmlu_pro") else d.split("_")[0] for d in family]
    path = write_tokens(tmp_path_factory.mktemp("gptoss") / "t", arr, 24, 32, 4, family, synthetic=False)
    return path, arr


@pytest.mark.shared_data
def test_gpt_oss_decode_routing(gpt_oss):
    path, arr = gpt_oss
    res = check_json(analyse_trace(path))
    ids = arr["expert_ids"]
    # independent computation over all tokens: bincount per layer
    load = np.stack([np.bincount(ids[:, lyr].ravel(), minlength=32) for lyr in range(24)])
    mom = np.array(res["imbalance"]["max_over_mean"])
    assert np.allclose(mom, load.max(1) / load.mean(1))
    assert mom.min() > 1.9 and mom.max() < 3.8  # data README: 2.0-3.8 (this copy: 1.95 at layer 8, 3.70 at 22-23)
    ov = np.array(res["temporal"]["decode_overlap"])
    assert 0.5 < ov[10:14].mean() < 0.65 and 0.5 < ov[23] < 0.6  # "about 55% in middle and late layers"
    assert ov[:2].max() < 0.3  # early layers change experts more
    # plain loop on a subset (first 3 generations) against the streamed numbers of that subset
    n3 = int(np.searchsorted(arr["request_id"], 3))
    ref, pairs = decode_overlap_loop(ids[:n3], arr["request_id"][:n3], arr["position"][:n3], arr["phase"][:n3])
    acc = TokenAccumulator(24, 32, 4)
    acc.update(ids[:n3], arr["request_id"][:n3], arr["position"][:n3], arr["phase"][:n3])
    acc.finish()
    assert acc.overlap_pairs == pairs and np.allclose(acc.overlap_sum / (pairs * 4), ref)
    load_ref, co_ref = load_coactivation_loop(ids[:500], 32)
    assert np.array_equal(coactivation_counts(ids[:500], 32), co_ref)
    assert res["prefill_decode"]["pearson"] is None and res["meta"]["synthetic"] is False
    # the dataset family shows in the routing: held-out accuracy 0.82 against a majority baseline of 0.61
    cl = res["domain"]
    assert cl["order"] == ["Polyglot-or-Not", "gpqa", "mmlu", "mmlu_pro", "sorry", "tulu3"]
    assert cl["classification_accuracy"] > cl["classification"]["chance"] + 0.1


def olmoe_counts(name):
    z = np.load(shared_data("olmoe-mixtral", f"{name}.npz"), allow_pickle=False)
    doms = sorted(k.split("__")[1] for k in z.files if k.startswith("expert_counts__"))
    return doms, np.stack([z[f"expert_counts__{d}"] for d in doms]).astype(np.float64)


@pytest.mark.shared_data
def test_olmoe_vs_mixtral_domain_divergence(tmp_path):
    js = {}
    for name, K in (("olmoe", 8), ("mistral", 2)):
        doms, c = olmoe_counts(name)
        res = check_json(analyse_trace(write_counts(tmp_path / name, doms, c, K, layer_map=[0, 7, 15])))
        got = np.array(res["domain"]["js_divergence"])
        assert res["domain"]["order"] == doms
        # independent: scipy's JS distance (base 2) squared, per layer, averaged over the 3 stored layers
        want = np.mean([[[jensenshannon(c[i, lyr], c[j, lyr], base=2) ** 2 for j in range(len(doms))]
                         for i in range(len(doms))] for lyr in range(3)], axis=0)
        assert np.allclose(got, want, atol=1e-9)
        assert res["domain"]["classification_accuracy"] is None  # one group per domain: nothing to hold out
        assert "2 or more count groups" in res["unavailable"]["domain.classification_accuracy"]
        js[name] = res["domain"]["js_divergence_mean"]
    assert js["olmoe"] > 0.1 and js["mistral"] < 0.01 and js["olmoe"] > 20 * js["mistral"]
    assert math.isclose(js["olmoe"], 0.1772, abs_tol=1e-3) and math.isclose(js["mistral"], 0.0033, abs_tol=2e-4)


def test_row_average_ranks_are_scipys_rankdata():
    """moeplace's tie-averaged ranks against scipy.stats.rankdata (the library it replaces in analyze's import path),
    on continuous rows and on rows full of ties."""
    from scipy.stats import rankdata

    from moeplace.analyse.stats import row_average_ranks

    rng = np.random.default_rng(7)
    for t in range(200):
        N, E = int(rng.integers(1, 6)), int(rng.integers(1, 40))
        x = rng.integers(0, int(rng.integers(1, 8)), (N, E)) if t % 2 else rng.standard_normal((N, E))
        np.testing.assert_array_equal(row_average_ranks(x), rankdata(x, axis=1))
    assert row_average_ranks(np.zeros((3, 0))).shape == (3, 0)
