"""The simulator: hand-checked cases, the replica rule, and exact agreement with the spec (tests/spec_simulator.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spec_compare import assert_matches_spec, balanced_kwargs
from spec_simulator import spec_simulate

from moeplace.cli import main
from moeplace.placement import Cluster, Placement, Plan
from moeplace.simulate import (
    RULES,
    BatchConfig,
    CostConfig,
    assign_slots,
    simulate,
)
from moeplace.trace.types import Requests, TokenChunk, Trace, TraceMeta
from moeplace.trace.writer import write_trace


def make_trace(rng, n_req, L, E, K, prompt, gen, shuffle=True, hidden=4) -> Trace:
    rid, pos, ph = [], [], []
    for r in range(n_req):
        rid += [10 * r + 3] * (prompt + gen)
        pos += list(range(prompt + gen))
        ph += [0] * prompt + [1] * gen
    T = len(rid)
    order = rng.permutation(T) if shuffle else np.arange(T)
    ids = np.argsort(rng.random((T, L, E)), axis=-1)[:, :, :K].astype(np.int16)
    meta = TraceMeta(model="hand-made", num_layers=L, num_experts=E, top_k=K, hidden_size=hidden, synthetic=True)
    req = Requests(np.arange(n_req, dtype=np.int64) * 10 + 3, np.array(["x"] * n_req, object),
                   np.array([""] * n_req, object), np.full(n_req, prompt, np.int32), np.full(n_req, gen, np.int32))
    tk = TokenChunk(np.array(rid, np.int64)[order], np.array(pos, np.int32)[order], np.array(ph, np.int8)[order],
                    ids[order])
    return Trace(meta, req, tk)


def default_cost_spec(tr: Trace, plan: Plan, batching: BatchConfig, rule: str = RULES[0]) -> dict:
    """The spec under CostConfig()'s defaults: the trace's hidden size, fp8 dispatch, bf16 combine, and
    6 * hidden * hidden FLOPs per pair (no model preset for "hand-made", so the expert width is the hidden size)."""
    h = tr.meta.hidden_size
    return spec_simulate(tr, plan, rule=rule, hidden=h, dispatch_bytes=1, combine_bytes=2,
                         pair_seconds=6.0 * h * h / plan.cluster.expert_flops, decode_batch=batching.decode_batch,
                         prefill_tokens=batching.prefill_tokens, **balanced_kwargs(plan, rule))


def one_token_trace(experts, L=1, E=4, hidden=4) -> Trace:
    ids = np.array(experts, np.int16).reshape(1, L, -1)
    meta = TraceMeta(model="hand-made", num_layers=L, num_experts=E, top_k=ids.shape[-1], hidden_size=hidden)
    req = Requests(np.array([5]), np.array(["x"], object), np.array([""], object), np.array([1], np.int32),
                   np.array([0], np.int32))
    return Trace(meta, req, TokenChunk(np.array([5]), np.array([0], np.int32), np.array([0], np.int8), ids))


def test_hand_checked_two_hop():
    # 2 nodes x 2 GPUs, expert e on GPU e; the token lives on GPU 0 and picks experts 2 and 3 (both on node 1).
    plan = Plan(Placement.linear(1, 4, 4), Cluster(2, 2), homes={5: 0})
    cost = CostConfig(dispatch_bytes=1, combine_bytes=2)  # 4 elements -> 12 bytes per send (dispatch + combine)
    res = simulate(one_token_trace([2, 3]), plan, cost=cost)
    j = res.to_json()
    assert j["inter_node_bytes"]["total"] == 24  # per-GPU dedup: 0->2 and 0->3 cross the network
    assert j["intra_node_bytes"]["total"] == 0
    assert j["two_hop_inter_node_bytes"]["total"] == 12  # one send to node 1 (lands on GPU 2) ...
    assert j["two_hop_intra_node_bytes"]["total"] == 12  # ... forwarded 2->3 over NVLink
    assert j["local_activation_rate"]["total"] == 0.0
    assert j["node_local_rate"]["total"] == 0.0
    assert res.prefill.load.tolist() == [[0, 0, 1, 1]]
    assert res.prefill.sends["two_hop"][0, 2, 3] == 1 and res.prefill.sends["two_hop"][0, 0, 2] == 1
    bm = res.prefill.byte_matrix("per_gpu")[0]
    assert bm[0, 2] == 4 and bm[2, 0] == 8  # dispatch fp8 out, combine bf16 back
    assert j["max_peer_message_bytes"]["total"] == 4
    assert j["balancedness"]["per_layer"] == [0.5]  # mean 0.5 / max 1
    assert j["imbalance_ratio"]["per_layer"] == [1.0]
    # alpha-beta: GPU 0's NIC is the busiest link: 2 sends of 4 B out (dispatch), 2 x 8 B back (combine)
    cl = plan.cluster
    comm = (cl.inter_latency + 8 / cl.inter_bw) + (cl.inter_latency + 16 / cl.inter_bw)
    assert j["comm_time_s"]["total"] == pytest.approx(comm)
    assert j["compute_time_s"]["total"] == pytest.approx(res.pair_seconds)
    assert j["synthetic"] is False


def test_local_and_dedup():
    # token on GPU 0 picks expert 0 (own GPU) and 1 (same node): LAR 1/2, node-local 1
    plan = Plan(Placement.linear(1, 4, 4), Cluster(2, 2), homes={5: 0})
    j = simulate(one_token_trace([0, 1]), plan).to_json()
    assert j["local_activation_rate"]["total"] == 0.5
    assert j["node_local_rate"]["total"] == 1.0
    assert j["sends"]["intra_gpu"]["total"] == 1 and j["sends"]["intra_node"]["total"] == 1
    assert j["inter_node_bytes"]["total"] == 0


def test_assign_slots_rules():
    # experts 0..3; expert 0 replicated on slots 0 (GPU 0) and 4 (GPU 2); 2 nodes x 2 GPUs, 2 slots per GPU
    p2l = np.array([0, 1, 2, 3, 0, 1, 2, 3])
    slot_gpu = np.arange(8) // 2
    node = np.arange(4) // 2
    # home 0 -> same GPU slot 0; home 3 -> same node slot 4 (GPU 2)
    s = assign_slots(p2l, slot_gpu, node, np.array([0, 3]), np.array([[0], [0]]))
    assert s.tolist() == [[0], [4]]
    # all replicas remote: expert 0 lives on GPUs 0 and 2 only; replicate on both nodes' other GPUs
    p2l = np.array([1, 0, 2, 3, 1, 0, 2, 3])  # expert 0 at slots 1 (GPU 0) and 5 (GPU 2)
    homes = np.array([1, 1, 1])  # GPU 1 (node 0): nearest tier = slot 1 on GPU 0 (same node)
    assert assign_slots(p2l, slot_gpu, node, homes, np.array([[0], [0], [0]])).ravel().tolist() == [1, 1, 1]
    # two replicas of expert 1 in the same tier (remote for home GPU 3? no: slots 0 (GPU0) and 4 (GPU2))
    # home 1: tier same-node -> slot 0 only. Use a flat 1x4 cluster so that all are same-node: least-loaded spreads.
    node1 = np.zeros(4, np.int64)
    p2l = np.array([0, 1, 2, 3, 0, 1, 2, 3])
    got = assign_slots(p2l, slot_gpu, node1, np.array([1, 1, 1, 1]), np.array([[0], [0], [0], [0]]))
    assert got.ravel().tolist() == [0, 4, 0, 4]  # ties to lowest slot, then alternate by GPU load
    static = assign_slots(p2l, slot_gpu, node1, np.array([1, 1, 3, 3]), np.array([[0], [0], [0], [0]]),
                          rule="nearest-static")
    assert static.ravel().tolist() == [4, 4, 4, 4]  # candidate home % 2 = 1 -> the second slot
    with pytest.raises(ValueError, match="rule"):
        assign_slots(p2l, slot_gpu, node1, np.array([0]), np.array([[0]]), rule="nope")


def test_plan_mismatch_errors():
    tr = one_token_trace([0, 1])
    with pytest.raises(ValueError, match="does not fit the trace"):
        simulate(tr, Plan(Placement.linear(2, 4, 4), Cluster(2, 2)))
    with pytest.raises(ValueError, match="does not fit the trace"):
        simulate(tr, Plan(Placement.linear(1, 8, 4), Cluster(2, 2)))
    with pytest.raises(ValueError, match="differs"):
        simulate(tr, Plan(Placement.linear(1, 4, 4), Cluster(2, 2)), cluster=Cluster(1, 4))
    with pytest.raises(ValueError, match="plan or a cluster"):
        simulate(tr)


@st.composite
def cases(draw):
    L = draw(st.integers(1, 3))
    E = draw(st.integers(2, 9))
    K = draw(st.integers(1, min(E, 4)))
    N = draw(st.integers(1, 3))
    G = draw(st.integers(1, 3))
    W = N * G
    R = draw(st.integers(0, 2 * W + 2))
    if (E + R) % W:
        R += W - (E + R) % W
    seed = draw(st.integers(0, 2**31 - 1))
    return L, E, K, N, G, R, seed, draw(st.sampled_from(RULES)), draw(st.integers(1, 7)), draw(st.integers(1, 9))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_simulate_equals_spec_on_random_cases(case):
    L, E, K, N, G, R, seed, rule, decode_batch, budget = case
    rng = np.random.default_rng(seed)
    W = N * G
    n_req = int(rng.integers(1, 6))
    tr = make_trace(rng, n_req, L, E, K, int(rng.integers(1, 5)), int(rng.integers(0, 4)))
    p2l = np.stack([np.r_[rng.permutation(E), rng.integers(0, E, R)][rng.permutation(E + R)] for _ in range(L)])
    plan = Plan(Placement(p2l, E, W, allow_colocated_replicas=True), Cluster(N, G),
                homes={int(r): int(rng.integers(0, W)) for r in tr.requests.request_id if rng.random() < 0.5})
    b = BatchConfig(decode_batch=decode_batch, prefill_tokens=budget)
    fast = simulate(tr, plan, rule=rule, batching=b, chunk_tokens=int(rng.integers(1, 20)))
    assert_matches_spec(fast, default_cost_spec(tr, plan, b, rule))


def test_assign_slots_matches_simulator_routing():
    """The runtime's function and the simulator's internal choice agree: one micro-batch, one layer."""
    rng = np.random.default_rng(3)
    E, W = 6, 4
    p2l = np.r_[rng.permutation(E), rng.integers(0, E, 6)][rng.permutation(12)]
    plan = Plan(Placement(p2l[None], E, W, allow_colocated_replicas=True), Cluster(2, 2))
    tr = make_trace(rng, 1, 1, E, 2, 12, 0, shuffle=False)
    home = plan.home_of(tr.requests.request_id)[0]
    slots = assign_slots(p2l, plan.placement.slot_gpu, np.arange(W) // 2, np.full(12, home), tr.tokens.expert_ids[:, 0])
    res = simulate(tr, plan, batching=BatchConfig(prefill_tokens=100))
    load = np.bincount(plan.placement.slot_gpu[slots].ravel(), minlength=W)
    assert res.prefill.load[0].tolist() == load.tolist()


def test_streaming_from_disk_and_cli(tmp_path):
    rng = np.random.default_rng(7)
    tr = make_trace(rng, 9, 2, 8, 2, 5, 6, shuffle=False)
    path = write_trace(tmp_path / "t.trace", tr, shard_tokens=13)
    cluster = Cluster(2, 2)
    plan = Plan(Placement.linear(2, 8, 4, num_redundant=4), cluster)
    b = BatchConfig(decode_batch=4, prefill_tokens=7)
    disk = simulate(path, plan, batching=b, chunk_tokens=5)
    mem = simulate(tr, plan, batching=b, chunk_tokens=len(tr.tokens.request_id))
    assert disk.to_json() == mem.to_json()
    assert_matches_spec(disk, default_cost_spec(tr, plan, b))
    assert disk.decode.num_microbatches == 3 * 6  # windows of 4 requests: 3 windows x 6 decode steps
    assert disk.prefill.num_microbatches == -(-9 * 5 // 7)
    plan_path = tmp_path / "plan.json"
    plan.save(plan_path)
    out = tmp_path / "sim.json"
    rc = main(["simulate", str(path), "--plan", str(plan_path), "--json", str(out), "--decode-batch", "4",
               "--prefill-tokens", "7"])
    assert rc == 0
    j = json.loads(out.read_text())
    for key in ("inter_node_bytes", "intra_node_bytes", "balancedness", "imbalance_ratio", "local_activation_rate"):
        assert set(j[key]) >= {"total", "per_layer"} and len(j[key]["per_layer"]) == 2
        assert key in j["prefill"] and key in j["decode"]
    assert j == json.loads(json.dumps(disk.to_json()))
    rc = main(["simulate", str(path), "--cluster", "2x2", "--redundant", "4", "--json", str(out),
               "--decode-batch", "4", "--prefill-tokens", "7"])
    assert rc == 0 and json.loads(out.read_text())["inter_node_bytes"] == j["inter_node_bytes"]
    assert main(["simulate", str(path), "--cluster", "2x3", "--json", str(out)]) == 2  # 8 experts on 6 GPUs


def test_cli_text_is_us_per_layer_per_microbatch_and_names_the_kernel(tmp_path, capsys):
    """simulate prints one layer on one micro-batch in µs (the unit compare and run-ep print) and says in words which
    kernel priced it; the JSON holds the same numbers under layer_time_us_per_microbatch."""
    rng = np.random.default_rng(3)
    path = write_trace(tmp_path / "t.trace", make_trace(rng, 9, 2, 8, 2, 5, 6, shuffle=False), shard_tokens=13)
    out = tmp_path / "sim.json"
    assert main(["simulate", str(path), "--cluster", "2x2", "--json", str(out), "--decode-batch", "4",
                 "--prefill-tokens", "7"]) == 0
    text = capsys.readouterr().out
    j = json.loads(out.read_text())
    assert "kernel: deepep-normal for prefill, deepep-ll for decode (auto)" in text
    assert " ms" not in text and "LAR" not in text and "local activation rate" in text
    us = j["layer_time_us_per_microbatch"]
    for ph, kernel in (("prefill", "deepep-normal"), ("decode", "deepep-ll")):
        p = j[ph]
        want = p["kernel_time"]["layer_time_s"]["total"] / (p["num_microbatches"] * 2) * 1e6
        assert us[ph] == pytest.approx(want)
        line = next(x for x in text.splitlines() if x.strip().startswith(ph))
        assert f"layer time {us[ph]:,.1f} µs ({kernel} kernel model" in line
    assert main(["simulate", str(path), "--cluster", "2x2", "--mode", "nccl", "--overlap"]) == 0
    assert "kernel: nccl, two-batch overlap" in capsys.readouterr().out


def test_assign_slots_in_parts_equals_whole():
    """base_load carries a micro-batch routed in several calls: two halves give the same slots as one call."""
    rng = np.random.default_rng(11)
    E, W = 5, 4
    p2l = np.r_[rng.permutation(E), rng.integers(0, E, 7)]
    slot_gpu = np.arange(12) // 3
    node = np.zeros(W, np.int64)  # one node: every replica is in the nearest tier, least-loaded always chooses
    home = rng.integers(0, W, 30)
    ex = np.argsort(rng.random((30, E)), 1)[:, :3]
    whole = assign_slots(p2l, slot_gpu, node, home, ex)
    first = assign_slots(p2l, slot_gpu, node, home[:13], ex[:13])
    base = np.bincount(slot_gpu[first].ravel(), minlength=W)
    second = assign_slots(p2l, slot_gpu, node, home[13:], ex[13:], base_load=base)
    assert np.array_equal(whole, np.r_[first, second])


def test_threads_do_not_change_results(monkeypatch):
    rng = np.random.default_rng(5)
    tr = make_trace(rng, 5, 7, 12, 3, 6, 4)
    plan = Plan(Placement.linear(7, 12, 4, num_redundant=4), Cluster(2, 2))
    b = BatchConfig(decode_batch=2, prefill_tokens=5)
    out = []
    for n in ("1", "3"):
        monkeypatch.setenv("MOEPLACE_SIM_THREADS", n)
        out.append(simulate(tr, plan, batching=b, chunk_tokens=7).to_json())
    assert out[0] == out[1]
    monkeypatch.setenv("MOEPLACE_SIM_THREADS", "3")
    assert_matches_spec(simulate(tr, plan, batching=b, chunk_tokens=7), default_cost_spec(tr, plan, b))


def test_bad_expert_id_is_refused():
    tr = one_token_trace([0, 1])
    tr.tokens.expert_ids[0, 0, 1] = 9  # E = 4
    with pytest.raises(ValueError, match="expert id out of range"):
        simulate(tr, Plan(Placement.linear(1, 4, 4), Cluster(2, 2)))
