"""moeplace.operate: streams, counters, migration, policies and the loop, each against an independent definition
(plain loops, brute force, the simulator on the whole trace), and the CLI's contract (JSON keys, exit 2 on a bad
source with the last plan kept)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import make_tokens
from prometheus_client.parser import text_string_to_metric_families

from moeplace.deploy import parse_cluster
from moeplace.operate import OperateConfig, Phase, drift_trace, operate, trace_stream
from moeplace.operate.counters import count_window
from moeplace.operate.metrics import MetricsServer, OperateMetrics
from moeplace.operate.migration import match_gpus, migration_plan, preserve_slots, transfer_seconds
from moeplace.operate.policies import replicate_first
from moeplace.operate.streams import memory_windows
from moeplace.placement import Cluster, Plan
from moeplace.plan.eplb import replicate_experts
from moeplace.simulate import BatchConfig, CostConfig, simulate
from moeplace.trace import TraceMeta, TraceWriter, read_trace

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "src" / "moeplace" / "data" / "reference-default.trace"
GPT_OSS_SAMPLE = REPO / "src" / "moeplace" / "data" / "gpt-oss-20b-sample.trace"
BENCH_KEYS = {"total_time_s", "layer_time_s", "migration_time_s", "migration_bytes", "mean_balancedness",
              "rebalances"}


def small_trace(path: Path, n_req: int = 24, shard_tokens: int = 1 << 16, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    L, E, K = 2, 8, 2
    arr = make_tokens(rng, n_req, L, E, K, prompt=3, gen=4)
    meta = TraceMeta(model="synthetic-small", num_layers=L, num_experts=E, top_k=K, hidden_size=32, synthetic=True,
                     source="tests/test_operate.py")
    with TraceWriter(path, meta, shard_tokens=shard_tokens) as w:
        w.add_requests(np.arange(n_req), domain=["code", "math", "chat"] * (n_req // 3), prompt_len=[3] * n_req,
                       gen_len=[4] * n_req)
        w.add_tokens(arr["request_id"], arr["position"], arr["phase"], arr["expert_ids"])
    return path


# ------------------------------------------------------------------------------------------------ migration


def moved_experts(old: np.ndarray, new: np.ndarray, W: int) -> int:
    """Experts that arrive on a GPU that did not hold them (plain loops)."""
    L, P = old.shape
    S = P // W
    n = 0
    for li in range(L):
        for g in range(W):
            before = set(old[li, g * S:(g + 1) * S].tolist())
            n += sum(1 for e in new[li, g * S:(g + 1) * S].tolist() if e not in before)
    return n


def test_match_gpus_moves_as_few_experts_as_any_gpu_relabelling():
    rng = np.random.default_rng(1)
    W, S, E = 4, 3, 10
    for _ in range(20):
        old = np.stack([rng.permutation(np.r_[np.arange(E), rng.choice(E, W * S - E, replace=False)])])
        new = np.stack([rng.permutation(np.r_[np.arange(E), rng.choice(E, W * S - E, replace=False)])])
        got = match_gpus(old, new, W)
        brute = min(moved_experts(old, np.concatenate([new[:, g * S:(g + 1) * S] for g in perm], 1), W)
                    for perm in itertools.permutations(range(W)))
        assert moved_experts(old, got, W) == brute
        # same multiset of experts on some GPU relabelling: per-GPU contents of new, reordered
        assert sorted(tuple(sorted(got[0, g * S:(g + 1) * S])) for g in range(W)) == \
            sorted(tuple(sorted(new[0, g * S:(g + 1) * S])) for g in range(W))


def test_preserve_slots_keeps_staying_experts_in_place():
    old = np.array([[0, 1, 2, 3, 4, 5]])
    new = np.array([[2, 0, 5, 9, 3, 1]])  # GPU 0 keeps 0 and 2, GPU 1 keeps 3
    got = preserve_slots(old, new, 2)
    assert got.tolist() == [[0, 5, 2, 3, 9, 1]] or got.tolist() == [[0, 5, 2, 3, 1, 9]]
    assert got[0, 0] == 0 and got[0, 2] == 2 and got[0, 3] == 3


def test_migration_plan_bytes_links_and_time():
    c = Cluster(2, 2, intra_bw=100.0, inter_bw=10.0, intra_latency=0.0, inter_latency=0.0)
    # 4 GPUs x 2 slots; layer 0: expert 4 moves from GPU 0 slot 1 ... into GPU 1 (same node) and GPU 3 (other node)
    old = np.array([[0, 4, 1, 5, 2, 6, 3, 7]])
    new = np.array([[0, 4, 1, 4, 2, 6, 3, 4]])
    mp = migration_plan(old, new, c, expert_size=50.0)
    links = sorted((m.slot, m.src_gpu, m.dst_gpu, m.link) for m in mp.moves)
    assert links == [(3, 0, 1, "intra_node"), (7, 0, 3, "inter_node")]
    assert mp.bytes == 100.0
    # GPU 0 sends 50 B over NVLink (0.5 s) and 50 B over the inter-node link (5 s): they overlap
    assert mp.seconds == pytest.approx(5.0)
    assert transfer_seconds(mp.link_bytes, c) == pytest.approx(5.0)
    local = migration_plan(old, np.array([[4, 0, 1, 5, 2, 6, 3, 7]]), c, 50.0)
    assert local.bytes == 0.0 and {m.link for m in local.moves} == {"local"}


@pytest.mark.parametrize("hot", [6, 1])
def test_replicate_first_reaches_eplb_counts_moving_little(hot):
    rng = np.random.default_rng(2)
    L, E, W, R = 3, 8, 4, 4
    P = E + R
    S = P // W
    cur = np.tile(np.arange(P) % E, (L, 1))  # redundant slots 8..11 hold experts 0..3
    load = rng.random((L, E)) * 100
    load[:, hot] += 500
    got = replicate_first(cur, load, W)
    _, _, target = replicate_experts(load, P, max_replicas=W)
    for li in range(L):
        counts = np.bincount(got[li], minlength=E)
        assert (counts == target[li]).all()
        added = int(np.maximum(target[li] - np.bincount(cur[li], minlength=E), 0).sum())
        changed = int((got[li] != cur[li]).sum())
        # each new replica takes a freed redundant slot, plus at most one shifted expert to make room
        assert added <= changed <= 2 * added
        for g in range(W):
            assert len(set(got[li, g * S:(g + 1) * S].tolist())) == S, "a GPU holds an expert twice"
    # experts that neither gained nor lost replicas keep their slots, unless shifted to make room (bounded above)
    keep = [e for e in range(E) if target[0][e] == np.sum(cur[0] == e)]
    assert sum(int((got[0] == e).sum() != (cur[0] == e).sum() or ((got[0] == e) != (cur[0] == e)).any())
               for e in keep) <= int(np.maximum(target[0] - np.bincount(cur[0], minlength=E), 0).sum())


# ------------------------------------------------------------------------------------------------ counters


def test_counters_against_plain_loops(tmp_path):
    tr = read_trace(small_trace(tmp_path / "t", n_req=12))
    window = next(memory_windows(tr, 12))
    batching = BatchConfig(decode_batch=4, prefill_tokens=8)
    home = np.arange(12) % 4
    wc = count_window(window, home, batching, sample_every=3, capacity_factor=1.0, first_row=1)
    tk = window.tokens
    L, E = 2, 8
    want = np.zeros((3, L, E), int)
    doms = list(wc.domains)
    dom_of = dict(zip(window.requests.request_id.tolist(), window.requests.domain.tolist(), strict=True))
    for t in range(len(tk)):
        if (1 + t) % 3 == 0:
            for li in range(L):
                for e in tk.expert_ids[t, li]:
                    want[doms.index(dom_of[int(tk.request_id[t])]), li, e] += 1
    assert (wc.sampled == want).all()
    # drops: micro-batches by hand (prompts end to end cut every 8 tokens; decode step i of each 4-request group)
    req_index = {int(r): i for i, r in enumerate(window.requests.request_id)}
    start = np.cumsum([0] + [3] * 12)
    groups: dict = {}
    for t in range(len(tk)):
        r = req_index[int(tk.request_id[t])]
        p = int(tk.position[t])
        key = ("pre", (start[r] + p) // 8) if tk.phase[t] == 0 else ("dec", r // 4, p - 3)
        groups.setdefault(key, []).append(t)
    dropped = 0
    for rows in groups.values():
        for li in range(L):
            c = np.bincount(tk.expert_ids[rows, li].ravel(), minlength=E)
            cap = int(np.floor(1.0 * c.sum() / E))
            dropped += sum(max(0, int(x) - cap) for x in c)
    assert wc.steps == len(groups) and wc.dropped == dropped and wc.pairs == len(tk) * L * 2


# ------------------------------------------------------------------------------------------------ streams


def test_lazy_table_windows_equal_in_memory_windows(tmp_path):
    path = small_trace(tmp_path / "t", n_req=24, shard_tokens=30)
    lazy = list(trace_stream(path, 5).windows)
    mem = list(memory_windows(read_trace(path), 5))
    assert [len(w.requests) for w in lazy] == [5, 5, 5, 5, 4]
    for a, b in zip(lazy, mem, strict=True):
        assert (a.requests.request_id == b.requests.request_id).all()
        ka = np.lexsort((a.tokens.position, a.tokens.request_id))
        kb = np.lexsort((b.tokens.position, b.tokens.request_id))
        assert (a.tokens.expert_ids[ka] == b.tokens.expert_ids[kb]).all()


def test_reference_table_order_is_labelled_a_domain_drift():
    s = trace_stream(REFERENCE, 250)
    assert "sorted by domain: a drift code -> chat -> general -> math" in s.label
    assert [set(w.requests.domain.tolist()) for w in s.windows] == [{"code"}, {"chat"}, {"general"}, {"math"}]


def test_drift_phases_follow_their_mix():
    tr = read_trace(REFERENCE)
    phases = [Phase(400, {"code": 1.0}), Phase(400, {"math": 0.5, "chat": 0.5})]
    d = drift_trace(tr, phases, seed=3)
    dom = d.requests.domain
    assert (dom[:400] == "code").all()
    assert set(dom[400:].tolist()) == {"math", "chat"} and 150 < (dom[400:] == "math").sum() < 250
    # every token row copied from the drawn request, renumbered in arrival order
    assert (np.unique(d.tokens.request_id) == np.arange(800)).all()
    again = drift_trace(tr, phases, seed=3)
    assert (again.tokens.expert_ids == d.tokens.expert_ids).all()
    with pytest.raises(ValueError, match="domains \\['legal'\\]"):
        drift_trace(tr, [Phase(5, {"legal": 1.0})])


# ------------------------------------------------------------------------------------------------ loop


def test_static_loop_time_equals_the_simulator_on_the_whole_stream():
    """gpt-oss-20b sample (decode only): windows of whole decode batches form the same micro-batches as one
    replay of the trace, so the loop's summed layer time must equal the simulator's."""
    c = parse_cluster("2", "h200-8")
    cfg = OperateConfig(c, num_redundant=16, window_requests=16, batching=BatchConfig(decode_batch=8))
    res = operate(trace_stream(GPT_OSS_SAMPLE, 16), cfg, "static")
    assert res.rebalances == 0 and res.migration_bytes == 0 and res.total_time_s == res.layer_time_s
    sim = simulate(GPT_OSS_SAMPLE, cluster=c, num_redundant=16, batching=BatchConfig(decode_batch=8),
                   cost=CostConfig(hidden_size=2880, intermediate_size=2880)).all
    pm = sim.per_microbatch
    assert res.layer_time_s == pytest.approx(float((pm["per_gpu.comm_time"] + pm["compute_time"]).sum()), rel=1e-9)
    assert sum(w.steps - (res.windows[i - 1].steps if i else 0) for i, w in enumerate(res.windows)) == \
        sim.num_microbatches


def test_policies_change_plans_and_account_migrations(tmp_path):
    c = parse_cluster("2", "h200-8")
    cfg = OperateConfig(c, num_redundant=16, window_requests=16, batching=BatchConfig(decode_batch=8))
    out = {}
    runs = (("periodic", {"period_steps": 400}), ("moeplace", {"horizon_steps": 10**6}),
            ("threshold", {"threshold": 0.99, "horizon_steps": 10**6}))
    for pol, kw in runs:
        res = operate(trace_stream(GPT_OSS_SAMPLE, 16), cfg, pol, out=tmp_path / pol, **kw)
        out[pol] = res
        assert res.rebalances >= 1
        assert res.total_time_s == pytest.approx(res.layer_time_s + res.migration_time_s)
        mig = [w.migration for w in res.windows if w.migration]
        assert len(mig) == res.rebalances and sum(m["bytes"] for m in mig) == pytest.approx(res.migration_bytes)
        last = Plan.load(tmp_path / pol / "plan.json")
        hist = Plan.load(tmp_path / pol / "changes" / f"{res.rebalances:04d}" / "plan.json")
        assert (last.placement.phy2log == hist.placement.phy2log).all()
        m = json.loads((tmp_path / pol / "migration.json").read_text())
        assert m["version"] == res.rebalances and m["bytes"] == mig[-1]["bytes"]
        assert {"physical_to_logical_map"} == set(json.loads((tmp_path / pol / "sglang.json").read_text()))
        assert json.loads((tmp_path / pol / "vllm.json").read_text())["format"] == "vllm-eplb-state"
    # moeplace changes at most a quarter of the 24 layers per decision
    assert all(len(w.migration["layers"]) <= 6 for w in out["moeplace"].windows if w.migration)


# ------------------------------------------------------------------------------------------------ metrics


def test_metrics_endpoint_names_and_values():
    c = parse_cluster("2", "h200-8")
    cfg = OperateConfig(c, num_redundant=16, window_requests=16, batching=BatchConfig(decode_batch=8))
    m = OperateMetrics()
    srv = MetricsServer(m, 0)
    try:
        res = operate(trace_stream(GPT_OSS_SAMPLE, 16), cfg, "periodic", sink=m.update, period_steps=400)
        with urllib.request.urlopen(f"{srv.url}/metrics", timeout=5) as r:
            text = r.read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        val = {s.name + str(sorted(s.labels.items())): s.value for f in fams.values() for s in f.samples}
        last = res.windows[-1]
        assert val["moeplace_balancedness_ratio[]"] == pytest.approx(last.balancedness)
        assert val["moeplace_migrations_total[]"] == res.rebalances
        assert val["moeplace_migration_bytes_total[]"] == pytest.approx(res.migration_bytes)
        assert val["moeplace_steps_total[]"] == last.steps
        assert val["moeplace_predicted_layer_seconds_total[]"] == pytest.approx(res.layer_time_s)
        assert sum(v for k, v in val.items() if k.startswith("moeplace_tokens_total")) == 17855
        assert val["moeplace_gpu_load_pairs[('gpu', '15')]"] == last.gpu_load[15]
        for f in fams.values():
            if f.name.startswith("moeplace_"):
                assert f.type != "counter" or all(s.name.endswith(("_total", "_created")) for s in f.samples)
        with urllib.request.urlopen(f"{srv.url}/api/state", timeout=5) as r:
            st = json.loads(r.read())
        assert st["windows"] == len(res.windows) and st["latest"]["steps"] == last.steps
    finally:
        srv.close()


# ------------------------------------------------------------------------------------------------ CLI


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeplace", "operate", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_json_keys_and_bad_source_keeps_last_plan(tmp_path):
    out = cli(str(GPT_OSS_SAMPLE), "--cluster", "2", "--cluster-preset", "h200-8", "--redundant", "16",
              "--window-requests", "16", "--decode-batch", "8", "--policy", "moeplace", "--json",
              str(tmp_path / "o.json"))
    assert out.returncode == 0, out.stderr
    j = json.loads((tmp_path / "o.json").read_text())
    assert BENCH_KEYS <= set(j) and j["total_time_s"] == pytest.approx(j["layer_time_s"] + j["migration_time_s"])
    # a trace whose last shard is corrupt: the loop plans from the first windows, then stops on the bad shard
    path = small_trace(tmp_path / "bad.trace", n_req=30, shard_tokens=70)
    shards = sorted(path.glob("part-*.tokens.parquet"))
    assert len(shards) >= 3
    data = bytearray(shards[-1].read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = b"\xff" * 64
    shards[-1].write_bytes(bytes(data))
    out = cli(str(path), "--cluster", "2x2", "--redundant", "4", "--window-requests", "5", "--decode-batch", "5",
              "--model-preset", "gpt-oss-20b", "--model-sizes-meant", "--policy", "static-eplb", "--out",
              str(tmp_path / "plans"))
    assert out.returncode == 2
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moeplace operate: error: stream stopped at window ")
    assert "last plan kept in" in err[0]
    kept = Plan.load(tmp_path / "plans" / "plan.json")
    first = Plan.load(tmp_path / "plans" / "changes" / "0001" / "plan.json")
    assert (kept.placement.phy2log == first.placement.phy2log).all() and kept.extra["operate_version"] == 1
    assert not list((tmp_path / "plans").glob(".*tmp*")), "a temporary file was left behind"
