"""The expert-parallel layer: math against loops, then W=4 processes (gloo, 2x2) against the single-process
reference with experts that encode their id, and the bytes each rank handed to all_to_all_single against the
simulator's counts for the same micro-batches, plan and replica rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tokens

from moeplace.placement import Cluster, Placement, Plan
from moeplace.run.dispatch import plan_rows, plan_rows_loop
from moeplace.run.layer import ExpertView, ExpertWeights, reference_moe, run_experts, run_experts_loop
from moeplace.run.netns import check_support, emulated_cluster
from moeplace.run.replay import (
    ReplayConfig,
    batches_from_window,
    check_batches,
    compute_seconds,
    predict,
    reference_outputs,
    replay,
    replay_cases,
    select_window,
    summarize,
)
from moeplace.simulate import BatchConfig
from moeplace.trace import TraceMeta, TraceWriter, read_trace

E, L, K, H = 8, 2, 3, 16
# 12 slots over 2x2 GPUs (S = 3): every layer has replicas on the same node and across nodes
PHY2LOG = np.array([[0, 1, 2, 3, 4, 0, 5, 6, 1, 7, 2, 3],
                    [7, 6, 5, 4, 3, 7, 2, 1, 0, 6, 5, 4]])
BATCHING = BatchConfig(decode_batch=6, prefill_tokens=10)


# ------------------------------------------------------------------------------------------------ single process


def test_id_experts_encode_their_id():
    w = ExpertWeights.id_encoding(5, 4)
    x = torch.ones(1, 4)
    for e in range(5):
        want = (e + 1) * x[0] + e * torch.nn.functional.one_hot(torch.tensor(e % 4), 4)
        assert torch.equal(w.apply(e, x)[0], want)


def test_grouped_experts_match_the_loop():
    g = torch.Generator().manual_seed(0)
    w = ExpertWeights.random(6, 8, 12, seed=3)
    x = torch.randn(20, 8, generator=g)
    slot = torch.randint(-1, 6, (20, 4), generator=g)
    weight = torch.rand(20, 4, generator=g)
    torch.testing.assert_close(run_experts(w, x, slot, weight), run_experts_loop(w, x, slot, weight))
    ids = [5, 0, 3]
    sub = slot.clamp(max=2)
    torch.testing.assert_close(run_experts(ExpertView(w, tuple(ids)), x, sub, weight),
                               run_experts(w.select(ids), x, sub, weight))
    empty = run_experts(w, x[:0], slot[:0], weight[:0])
    assert empty.shape == (0, 8)


def test_plan_rows_matches_the_loop():
    rng = np.random.default_rng(0)
    dest = rng.integers(-1, 5, size=(30, 4))
    row_token, row_dest, entry_row, splits = plan_rows(torch.as_tensor(dest), 5)
    t_ref, d_ref, s_ref = plan_rows_loop(dest, 5)
    assert row_token.tolist() == t_ref.tolist() and row_dest.tolist() == d_ref.tolist() and splits == s_ref
    for t in range(30):
        for j in range(4):
            r = int(entry_row[t, j])
            assert (r < 0) == (dest[t, j] < 0)
            if r >= 0:
                assert (int(row_token[r]), int(row_dest[r])) == (t, dest[t, j])


# ------------------------------------------------------------------------------------------------ W = 4 processes


@pytest.fixture(scope="module")
def trace_and_plan(tmp_path_factory):
    rng = np.random.default_rng(1)
    meta = TraceMeta(model="hand-made", num_layers=L, num_experts=E, top_k=K, hidden_size=H, has_weights=True,
                     synthetic=True, source="tests")
    arr = make_tokens(rng, 12, L, E, K, prompt=3, gen=5)
    path = tmp_path_factory.mktemp("run") / "t.trace"
    with TraceWriter(path, meta) as w:
        w.add_requests(np.arange(12), domain=["code"] * 12, prompt_len=[3] * 12, gen_len=[5] * 12)
        w.add_tokens(arr["request_id"], arr["position"], arr["phase"], arr["expert_ids"], arr["expert_weights"])
    plan = Plan(Placement(PHY2LOG, E, 4), Cluster(2, 2), homes={0: 3, 1: 3, 2: 1, 5: 0})
    return read_trace(path), plan


@pytest.fixture(scope="module", params=[("per_gpu", "decode", "loopback"), ("two_hop", "prefill", "netns")],
                ids=lambda p: "-".join(p))
def replayed(request, trace_and_plan):
    """One W=4 replay per dedup mode (two-hop on emulated nodes when this machine allows namespaces)."""
    mode, phase, where = request.param
    trace, plan = trace_and_plan
    sub, rows = select_window(trace, plan, BATCHING, phase, num_microbatches=3)
    batches = batches_from_window(sub, rows, plan)
    check_batches(plan, batches)
    cfg = ReplayConfig(hidden=H, two_hop=mode == "two_hop", weights="id", repeats=1, return_outputs=True,
                       timeout=120)
    if where == "netns" and check_support() is None:
        with emulated_cluster(2, 2, inter_gbit=1.0) as emu:
            res = replay(plan, batches, cfg, **emu.launch_kwargs())
        return mode, sub, batches, cfg, plan, res, None
    # two plans measured in one run (repeats interleaved): the second is linear with 4 redundant slots
    lin = Plan(Placement.linear(L, E, 4, 4), Cluster(2, 2))
    lsub, lrows = select_window(trace, lin, BATCHING, phase, num_microbatches=2, skip=1)
    res, lres = replay_cases([(plan, batches), (lin, batches_from_window(lsub, lrows, lin))], cfg)
    return mode, sub, batches, cfg, plan, res, (lin, lsub, lres)


def test_outputs_equal_the_single_process_reference(replayed):
    mode, sub, batches, cfg, plan, res, second = replayed
    assert len(batches) == 3 and all(len(b) for b in batches)
    for b, mb in enumerate(batches):
        ref = reference_outputs(mb, b, E, cfg)  # [T, L, H]
        got = np.full_like(ref, np.nan)
        for rank_out in res.outputs:
            idx, out = rank_out[b]
            got[idx] = out
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4, err_msg=f"{mode} micro-batch {b}")


def test_a_wrong_route_would_show(trace_and_plan):
    """The id-encoding experts make every expert's output distinct, so a misrouted pair changes the number."""
    trace, plan = trace_and_plan
    cfg = ReplayConfig(hidden=H, weights="id")
    sub, rows = select_window(trace, plan, BATCHING, "decode", 1)
    mb = batches_from_window(sub, rows, plan)[0]
    ref = reference_outputs(mb, 0, E, cfg)
    wrong = mb.expert_ids.copy()
    wrong[0, 0, 0] = (wrong[0, 0, 0] + 1) % E
    x = torch.randn(len(mb), H, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003))
    bad = reference_moe(ExpertWeights.id_encoding(E, H), x, torch.as_tensor(wrong[:, 0]),
                        torch.as_tensor(mb.weights[:, 0]))
    assert not np.allclose(bad.numpy()[0], ref[0, 0])


def test_bytes_equal_the_simulator(replayed):
    mode, sub, batches, cfg, plan, res, second = replayed
    sim = predict(sub, plan, cfg, BATCHING).all
    send_bytes = H * cfg.bytes_per_element  # float32 both ways: 4 bytes per element for dispatch and combine
    X = sim.sends[mode]  # [L, W, W] sends source -> destination, diagonal = intra-GPU
    assert np.array_equal(res.dispatch_bytes.sum(0), X * send_bytes)
    assert np.array_equal(res.combine_bytes.sum(0), np.swapaxes(X, 1, 2) * send_bytes)
    measured = summarize(res)
    prefix = "" if mode == "per_gpu" else "two_hop_"
    sim_json = sim.to_json()
    for key in ("inter_node_bytes", "intra_node_bytes"):
        assert measured[key]["total"] == sim_json[prefix + key]["total"], key
        assert measured[key]["per_layer"] == sim_json[prefix + key]["per_layer"], key
    # per micro-batch and layer, in the simulator's micro-batch order
    for where in ("inter_node", "intra_node"):
        want = sim.bytes_per_microbatch(mode, where)  # [B, L]
        got = res.link_bytes(res.pair_bytes())[where]  # [M, L]
        assert np.array_equal(got, want), where
    assert measured["inter_node_bytes"]["total"] > 0
    assert res.layer_seconds.shape == (1, 3, L) and (res.layer_seconds > 0).all()
    if second is not None:  # the other plan of the same run
        lin, lsub, lres = second
        X = predict(lsub, lin, cfg, BATCHING).all.sends[mode]
        assert np.array_equal(lres.dispatch_bytes.sum(0), X * send_bytes)
        assert lres.layer_seconds.shape == (1, 2, L)


def test_balanced_links_runs_as_the_simulator_routes(trace_and_plan):
    """moeplace's own balanced-links dispatch in a real W=4 run: the slots come from the runtime's assign_slots,
    and every rank's bytes equal the simulator's under the same rule (the plan has replicas on both nodes)."""
    trace, plan = trace_and_plan
    sub, rows = select_window(trace, plan, BATCHING, "decode", num_microbatches=2)
    batches = batches_from_window(sub, rows, plan, rule="balanced-links")
    check_batches(plan, batches)
    cfg = ReplayConfig(hidden=H, weights="id", repeats=1, timeout=120)
    res = replay(plan, batches, cfg)
    X = predict(sub, plan, cfg, BATCHING, rule="balanced-links").all.sends["per_gpu"]
    assert np.array_equal(res.dispatch_bytes.sum(0), X * H * cfg.bytes_per_element)
    assert res.dispatch_bytes.sum() > 0


# ------------------------------------------------------------------------------------------------ emulated compute

# a virtual device slow enough that waits are milliseconds, both roofline terms and the overhead in play
SLOW = Cluster(2, 2, expert_flops=2e6, hbm_bw=4e6, compute_overhead=1e-3)


def test_emulated_compute_is_the_simulators_expert_time(trace_and_plan):
    trace, plan = trace_and_plan
    cfg = ReplayConfig(hidden=H, ffn=4)
    sub, rows = select_window(trace, plan, BATCHING, "decode", 3)
    batches = batches_from_window(sub, rows, plan)
    waits = compute_seconds(plan, batches, cfg, SLOW)  # [M, L, W]
    sim = predict(sub, plan, cfg, BATCHING, cluster=SLOW).decode.per_microbatch["expert_time"]  # [B, L]
    np.testing.assert_allclose(waits.max(-1), sim, rtol=1e-12)
    # per rank, from the definition: pairs and distinct experts served by that rank's slots (S = 3)
    expert_bytes, pair_s = 3 * H * 4 * 4, 4 * H * 4 / SLOW.expert_flops
    for b, mb in enumerate(batches):
        for layer in range(L):
            for g in range(4):
                mine = mb.slots[:, layer] // 3 == g  # [T, K]
                n, act = int(mine.sum()), len(set(mb.expert_ids[:, layer][mine].tolist()))
                want = max(act * expert_bytes / SLOW.hbm_bw, n * pair_s) + SLOW.compute_overhead if n else 0.0
                assert waits[b, layer, g] == pytest.approx(want, rel=1e-12)
    assert (waits.max(-1) > 0).all() and (waits.min(-1) < waits.max(-1)).any()


def test_emulated_compute_waits_inside_the_timed_layer_and_keeps_outputs(trace_and_plan):
    trace, plan = trace_and_plan
    sub, rows = select_window(trace, plan, BATCHING, "decode", 2)
    batches = batches_from_window(sub, rows, plan)
    cfg = ReplayConfig(hidden=H, weights="id", repeats=2, return_outputs=True, emulate_compute=True, timeout=120)
    res = replay(plan, batches, cfg, compute_cluster=SLOW)
    waits = compute_seconds(plan, batches, cfg, SLOW)
    assert np.array_equal(res.compute_seconds, waits)
    # every layer call took at least the slowest rank's wait (the wait is inside the timed region)
    assert (res.layer_seconds >= waits.max(-1)[None] - 1e-4).all()
    assert summarize(res)["emulated_compute_s"]["total"] == pytest.approx(waits.max(-1).sum())
    for b, mb in enumerate(batches):  # outputs of the untimed real pass
        ref = reference_outputs(mb, b, E, cfg)
        got = np.full_like(ref, np.nan)
        for rank_out in res.outputs:
            idx, out = rank_out[b]
            got[idx] = out
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    X = predict(sub, plan, cfg, BATCHING).all.sends["per_gpu"]  # bytes unchanged by the emulation
    assert np.array_equal(res.dispatch_bytes.sum(0), X * H * cfg.bytes_per_element)
