"""moeplace.operate.workloads: mix schedules (phases, daily cycle, bursts) and streams drawn from a request pool.

Expectations come from definitions written here (the mix formula per arrival in a plain loop, binomial bounds on
counts, a request's token rows read back from the original trace), not from the module's own code."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import shared_data

from moeplace.operate.streams import drift_stream, schedule_stream
from moeplace.operate.workloads import (
    Burst,
    DailyCycle,
    MixSchedule,
    Phase,
    dataset_of,
    order_pool,
    stream_trace,
)
from moeplace.trace import read_trace
from moeplace.trace.importers import import_gpt_oss_npz

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "src" / "moeplace" / "data" / "reference-default.trace"
GPT_OSS_SAMPLE = REPO / "src" / "moeplace" / "data" / "gpt-oss-20b-sample.trace"
POOL = np.array(["code"] * 300 + ["chat"] * 200 + ["math"] * 100 + ["general"] * 400, dtype=object)


def within_binomial(count: int, n: int, p: float, z: float = 5.0) -> bool:
    """count of n Bernoulli(p) draws within z standard deviations (plus one for p at 0 or 1)."""
    return abs(count - n * p) <= z * math.sqrt(n * p * (1 - p)) + 1


def reference_mix(schedule_json: dict, keys: list[str], i: int) -> dict[str, float]:
    """The mix at arrival i, written from the documented definition one arrival at a time (no arrays)."""
    phases = schedule_json["phases"]
    if phases:
        total = sum(ph["requests"] for ph in phases)
        t, acc = i % total, 0
        for ph in phases:
            acc += ph["requests"]
            if t < acc:
                w = {k: ph["mix"].get(k, 0.0) for k in keys}
                break
    else:
        base = schedule_json["base"]
        w = {k: (1.0 if base is None else base.get(k, 0.0)) for k in keys}
    s = sum(w.values())
    w = {k: v / s for k, v in w.items()}
    cyc = schedule_json["cycle"]
    if cyc:
        w = {k: max(0.0, v * (1 + cyc["amplitude"].get(k, 0.0) *
                              math.sin(2 * math.pi * (i / cyc["period"] + cyc["offset"].get(k, 0.0)))))
             for k, v in w.items()}
        s = sum(w.values())
        w = {k: v / s for k, v in w.items()}
    for b in schedule_json["bursts"]:
        if b["start"] <= i < b["start"] + b["length"]:
            others = {k: v for k, v in w.items() if k != b["key"]}
            s = sum(others.values())
            n_other = len(keys) - 1
            w = {k: b["share"] if k == b["key"] else (1 - b["share"]) * (others[k] / s if s > 0 else 1 / n_other)
                 for k in keys}
    return w


# ------------------------------------------------------------------------------------------------ schedule


def test_probabilities_equal_the_definition_arrival_by_arrival():
    s = MixSchedule(phases=(Phase(300, {"code": 0.8, "chat": 0.2}), Phase(200, {"chat": 1.0, "math": 3.0})),
                    cycle=DailyCycle(170, {"code": 0.5, "math": 1.6}, {"math": 0.25}),
                    bursts=(Burst(250, 100, "general", 0.9), Burst(320, 10, "chat", 0.5)))
    keys = ["chat", "code", "general", "math"]
    t = np.arange(1100)  # past one pass: the phases repeat
    p = s.probabilities(keys, t)
    assert p.shape == (1100, 4)
    ref = np.array([[reference_mix(s.to_json(), keys, i)[k] for k in keys] for i in t.tolist()])
    np.testing.assert_allclose(p, ref, rtol=1e-12, atol=1e-12)
    # the worked example of the module docstring
    ex = MixSchedule(phases=(Phase(1000, {"code": 0.8, "chat": 0.2}),), cycle=DailyCycle(500, {"code": 0.5}))
    assert ex.probabilities(["chat", "code"], np.array([125]))[0, 1] == pytest.approx(1.2 / 1.4)


def test_schedule_json_round_trip():
    s = MixSchedule(phases=(Phase(10, {"code": 1.0}), Phase(5, {"chat": 0.5, "math": 0.5})),
                    cycle=DailyCycle.from_hours(24, 500, {"code": 0.3}, {"code": 0.25}),
                    bursts=(Burst(3, 4, "math", 0.75),))
    assert s.cycle.period == 12000 and "24 h at 500 requests/h" in s.describe()
    back = MixSchedule.from_json(json.loads(json.dumps(s.to_json())))
    assert back == s and back.to_json() == s.to_json()
    plain = MixSchedule(base={"a": 2.0, "b": 1.0})
    assert MixSchedule.from_json(json.loads(json.dumps(plain.to_json()))) == plain


@pytest.mark.parametrize("make, field", [
    (lambda: Phase(0, {"code": 1.0}), "Phase.requests"),
    (lambda: Phase(5, {"code": -1.0}), "Phase.mix\\['code'\\]"),
    (lambda: Phase(5, {"code": 0.0}), "Phase.mix"),
    (lambda: DailyCycle(0, {"code": 0.5}), "DailyCycle.period"),
    (lambda: DailyCycle(10, {"code": -0.5}), "DailyCycle.amplitude\\['code'\\]"),
    (lambda: DailyCycle.from_hours(0, 100, {"code": 0.5}), "DailyCycle hours"),
    (lambda: Burst(-1, 5, "code", 0.5), "Burst.start"),
    (lambda: Burst(0, 0, "code", 0.5), "Burst.length"),
    (lambda: Burst(0, 5, "code", 1.5), "Burst.share"),
    (lambda: MixSchedule.from_json({"phases": [{"requests": 5, "mix": {"a": 1}, "mixx": 1}]}), "mixx"),
    (lambda: MixSchedule.from_json({"format": "other"}), "format"),
])
def test_bad_schedules_name_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_bad_pools_name_the_field():
    with pytest.raises(ValueError, match=r"phases\[1\]\.mix names domains \['legal'\]"):
        order_pool(POOL, MixSchedule(phases=(Phase(5, {"code": 1}), Phase(5, {"legal": 1}))))
    with pytest.raises(ValueError, match=r"bursts\[0\].* outside the stream of 100"):
        order_pool(POOL, MixSchedule(bursts=(Burst(90, 20, "code", 0.5),)), 100)
    with pytest.raises(ValueError, match=r"cycle.amplitude names domains \['legal'\]"):
        order_pool(POOL, MixSchedule(cycle=DailyCycle(10, {"legal": 0.5})), 100)
    with pytest.raises(ValueError, match="num_requests"):
        order_pool(POOL, MixSchedule())  # no phases: the length must be given
    with pytest.raises(ValueError, match="zero for every key at arrival"):
        order_pool(np.array(["a"]), MixSchedule(cycle=DailyCycle(4, {"a": 2.0})), 8)


# ------------------------------------------------------------------------------------------------ draws


def test_each_phase_follows_its_mix():
    mixes = [{"code": 0.7, "chat": 0.1, "math": 0.1, "general": 0.1}, {"chat": 0.6, "math": 0.4},
             {"general": 1.0}]
    n = 3000
    idx = order_pool(POOL, MixSchedule(phases=tuple(Phase(n, m) for m in mixes)), seed=5)
    assert idx.shape == (3 * n,) and idx.dtype == np.int64 and 0 <= idx.min() and idx.max() < len(POOL)
    dom = POOL[idx]
    for i, mix in enumerate(mixes):
        part = dom[i * n:(i + 1) * n]
        total = sum(mix.values())
        for d in ("code", "chat", "math", "general"):
            assert within_binomial(int((part == d).sum()), n, mix.get(d, 0.0) / total), (i, d)
    # inside a key the requests are uniform over its pool: code's 300 pool indices all drawn in phase 0
    assert len(set(idx[:n][dom[:n] == "code"].tolist())) > 290


def test_daily_cycle_share_follows_the_sine():
    P, periods, N = 2000, 5, 10000
    cyc = DailyCycle(P, {"code": 0.8, "chat": 0.8}, {"chat": 0.5})
    idx = order_pool(POOL, MixSchedule(base={"code": 1.0, "chat": 1.0}, cycle=cyc), N, seed=11)
    dom = POOL[idx]
    assert set(dom.tolist()) == {"code", "chat"} and N == P * periods
    bins = 100
    t = np.arange(N).reshape(bins, -1)
    got = (dom == "code").reshape(bins, -1).mean(axis=1)
    wa = 1 + 0.8 * np.sin(2 * np.pi * t / P)
    wb = 1 + 0.8 * np.sin(2 * np.pi * (t / P + 0.5))
    want = (wa / (wa + wb)).mean(axis=1)
    assert np.corrcoef(got, want)[0, 1] > 0.9
    assert np.abs(got - want).max() < 0.2


def test_a_burst_has_its_share_and_leaves_the_rest_alone():
    s = MixSchedule(phases=(Phase(6000, {"code": 0.5, "chat": 0.5}),), bursts=(Burst(2000, 2000, "math", 0.8),))
    dom = POOL[order_pool(POOL, s, seed=2)]
    burst = dom[2000:4000]
    assert within_binomial(int((burst == "math").sum()), 2000, 0.8)
    assert within_binomial(int((burst == "code").sum()), 2000, 0.1)
    outside = np.concatenate([dom[:2000], dom[4000:]])
    assert not (outside == "math").any() and within_binomial(int((outside == "code").sum()), 4000, 0.5)


def test_seeds_and_replacement():
    s = MixSchedule(phases=(Phase(500, {"code": 1, "math": 1}), Phase(500, {"chat": 1})))
    a, b, c = order_pool(POOL, s, seed=1), order_pool(POOL, s, seed=1), order_pool(POOL, s, seed=2)
    assert (a == b).all() and (a != c).mean() > 0.5
    # without replacement: no request repeats before its key's pool is used up, then every one has come once
    d = order_pool(POOL, s, seed=1, replace=False)
    dom = POOL[d]
    for key, size in (("code", 300), ("math", 100), ("chat", 200)):
        seq = d[dom == key]
        k = min(len(seq), size)
        assert len(set(seq[:k].tolist())) == k, key
        if len(seq) >= size:
            assert set(seq[:size].tolist()) == set(np.flatnonzero(POOL == key).tolist())
    assert (dom == "chat").sum() == 500 and (d[dom == "chat"][:200] != d[dom == "chat"][200:400]).any()


def test_draws_are_pinned():
    """The same seed gives the same stream on any machine and NumPy version that keeps PCG64's stream: if this
    fails after an upgrade, every seeded stream (and the benchmarks built on them) has changed."""
    s = MixSchedule(phases=(Phase(12, {"code": 0.5, "chat": 0.3, "math": 0.2}),))
    assert order_pool(POOL, s, seed=0).tolist() == [257, 306, 445, 335, 586, 554, 89, 126, 8, 512, 567, 429]


# ------------------------------------------------------------------------------------------------ traces


def rows_of(trace, request_id):
    """expert_ids [n, L, K] of one request, in position order, read straight from the trace arrays."""
    m = trace.tokens.request_id == request_id
    order = np.argsort(trace.tokens.position[m], kind="stable")
    return trace.tokens.expert_ids[m][order], trace.tokens.phase[m][order]


def test_stream_trace_copies_real_routing_and_says_so():
    tr = read_trace(REFERENCE)
    s = MixSchedule(phases=(Phase(60, {"code": 1.0}), Phase(60, {"math": 1.0})), bursts=(Burst(70, 20, "chat", 1),))
    d = stream_trace(tr, s, seed=7)
    assert d.requests.request_id.tolist() == list(range(120))
    assert (d.requests.domain[:60] == "code").all() and (d.requests.domain[70:90] == "chat").all()
    assert not d.meta.synthetic and not tr.meta.synthetic
    assert d.meta.source.startswith(f"stream of {tr.meta.source} (seed 7; by domain")
    assert d.meta.source.endswith("real routing re-ordered") and "bursts chat 100% at 70..89" in d.meta.source
    assert MixSchedule.from_json(d.meta.extra["stream"]["schedule"]) == s
    orig = {int(r): i for i, r in enumerate(tr.requests.request_id.tolist())}
    for new in (0, 59, 75, 119):
        src = d.requests.source[new]
        old = int(src.rsplit("drawn from request ", 1)[1].rstrip(")"))
        assert d.requests.domain[new] == tr.requests.domain[orig[old]]
        assert src.startswith(tr.requests.source[orig[old]])
        ids_new, ph_new = rows_of(d, new)
        ids_old, ph_old = rows_of(tr, old)
        assert (ids_new == ids_old).all() and (ph_new == ph_old).all()
        assert len(ids_new) == tr.requests.prompt_len[orig[old]] + tr.requests.gen_len[orig[old]]


def test_synthetic_flag_is_carried(small_trace):
    path, _, meta = small_trace
    assert meta.synthetic
    d = stream_trace(read_trace(path), MixSchedule(), 10, seed=0)
    assert d.meta.synthetic and d.meta.source.endswith("synthetic routing re-ordered")
    assert d.meta.has_weights and d.tokens.expert_weights is not None


def test_gpt_oss_sample_ordered_by_dataset_in_phases():
    tr = read_trace(GPT_OSS_SAMPLE)
    ds = dataset_of(tr.requests.source)
    s = MixSchedule(phases=(Phase(40, {"mmlu_test": 1.0}), Phase(40, {"gpqa_main": 0.5, "sorry_bench_base": 0.5})))
    d = stream_trace(tr, s, seed=3, key="dataset")
    got = dataset_of(d.requests.source)
    assert (got[:40] == "mmlu_test").all()
    assert set(got[40:].tolist()) == {"gpqa_main", "sorry_bench_base"}
    assert "by dataset" in d.meta.source and "real routing re-ordered" in d.meta.source
    assert (ds == "mmlu_test").sum() < 40  # drawn with replacement from a small pool
    st = schedule_stream(tr, 16, s, seed=3, key="dataset", name="gpt-oss-20b-sample.trace")
    assert "by dataset" in st.label and "real routing re-ordered" in st.label and st.num_requests == 80
    assert [len(w.requests) for w in st.windows] == [16] * 5


@pytest.mark.shared_data
def test_shared_gpt_oss_by_dataset_without_replacement(tmp_path):
    src = shared_data("gpt-oss-20b")
    rows = [json.loads(x) for x in (src / "decode_routing_meta.jsonl").read_text().splitlines()]
    want = ("mmlu_test", "sorry_bench_base", "gpqa_main")
    pick = [i for i, r in enumerate(rows) if r["dataset"] in want]
    tr = read_trace(import_gpt_oss_npz(src, tmp_path / "g.trace", select=pick))
    sizes = {w: sum(r["dataset"] == w for r in rows) for w in want}
    s = MixSchedule(phases=(Phase(sizes["mmlu_test"], {"mmlu_test": 1}), Phase(40, {"gpqa_main": 1}),
                            Phase(60, {"sorry_bench_base": 1})))
    d = stream_trace(tr, s, seed=0, key="dataset", replace=False)
    got = dataset_of(d.requests.source)
    n = sizes["mmlu_test"]
    assert (got[:n] == "mmlu_test").all() and (got[n:n + 40] == "gpqa_main").all()
    # one pass over mmlu_test's pool: every request exactly once
    firsts = [int(x.rsplit("drawn from request ", 1)[1].rstrip(")")) for x in d.requests.source[:n].tolist()]
    assert sorted(firsts) == sorted(r["example_index"] for r in rows if r["dataset"] == "mmlu_test")


def test_drift_stream_is_a_phase_schedule():
    tr = read_trace(REFERENCE)
    st = drift_stream(tr, 100, seed=4, requests_per_phase=100, name="ref")
    assert st.label.startswith("seeded drift of ref (seed 4; phases code:0.7/chat:0.1/general:0.1/math:0.1 x100")
    d = stream_trace(tr, MixSchedule(phases=tuple(
        Phase(100, {k: (0.7 if k == top else 0.1) for k in ("code", "chat", "general", "math")})
        for top in ("code", "chat", "general", "math"))), seed=4)
    got = np.concatenate([w.requests.source for w in st.windows])
    assert got.tolist() == d.requests.source.tolist()


def test_operate_cli_replays_a_schedule_file(tmp_path, capsys):
    from moeplace.cli import main

    sched = MixSchedule(phases=(Phase(32, {"mmlu_test": 1}), Phase(32, {"gpqa_main": 1})),
                        bursts=(Burst(40, 8, "mmlu_dev", 1.0),))
    f = tmp_path / "s.json"
    f.write_text(json.dumps(sched.to_json()))
    common = [str(GPT_OSS_SAMPLE), "--cluster", "2", "--cluster-preset", "h200-8", "--window-requests", "16",
              "--decode-batch", "8", "--policy", "static"]
    assert main(["operate", *common, "--order", "schedule", "--schedule", str(f), "--stream-key", "dataset",
                 "--json", str(tmp_path / "o.json")]) == 0
    out = capsys.readouterr().out
    assert "stream: seeded stream of gpt-oss-20b-sample.trace by dataset (seed 0; phases mmlu_test:1 x32" in out
    assert "over 4 windows" in out
    assert main(["operate", *common, "--order", "schedule", "--schedule", str(f)]) == 2  # keys are datasets
    assert "names domains ['mmlu_test'] that the pool lacks" in capsys.readouterr().err
    assert main(["operate", *common, "--order", "schedule"]) == 2


def test_docs_example_is_the_plotted_schedule():
    """docs/WORKLOADS.md's code block builds the same schedule that scripts/plot_workload.py plots."""
    import importlib.util
    import re

    text = (REPO / "docs" / "WORKLOADS.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    head = block.split("trace = read_trace")[0]  # the schedule only; the stream itself is tested above
    scope: dict = {}
    exec(head, scope)  # noqa: S102 - our own documentation
    spec = importlib.util.spec_from_file_location("plot_workload", REPO / "scripts" / "plot_workload.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert scope["schedule"] == mod.example_schedule(scope["rate"])
    assert "(docs/WORKLOADS.md)" in (REPO / "README.md").read_text()
