"""The kernel time model (moeplace.simulate.cost), term by term, against numbers worked out by hand.

The hand case is the two-token, 2 nodes x 2 GPUs case of tests/test_simulate_spec.py::test_hand_computed_costs:
token A (home GPU 0) is served on GPUs 2 and 0, token B (home GPU 1) on GPUs 3 and 2. So:
- per-GPU dedup: busiest inter-node link 2 sends, no intra-node sends;
- two-hop: busiest intra-node 1 (forward 3 -> 2), inter-node 1;
- per pair (DeepEP low-latency): inter-node pairs sent 0: 1, 1: 2; received 2: 2, 3: 1 -> busiest 2; intra 0;
- active experts: GPU 0 {2}, GPU 2 {3, 0}, GPU 3 {3} -> busiest GPU holds 2 active experts; loads [1, 0, 2, 1].
Links: intra alpha 1 s, 2 B/s; inter alpha 5 s, 10 B/s. hidden 10: fp8 vector 10 B + one fp32 scale (10 <= 128
elements) = 14 B; deepep-ll adds 16 B -> 30 B; combine bf16 20 B. Pair: 6 FLOPs / 2 FLOP/s = 3 s; busiest load 2
-> flop time 6 s. Expert weights: 3 * 10 * 10 (expert width = hidden for this unknown model) * 1 B = 300 B.
"""

from __future__ import annotations

import numpy as np
import pytest

from moeplace.placement import Cluster, Placement, Plan
from moeplace.simulate import BatchConfig, CostConfig, simulate
from moeplace.simulate.cost import time_terms
from moeplace.simulate.kernels import (
    DEEPEP_LL_ALPHA,
    DEEPEP_NVLINK_EFF,
    DEEPEP_RDMA_EFF,
    expert_seconds,
    overlapped_seconds,
)
from moeplace.simulate.links import dispatch_vector_bytes
from moeplace.trace.types import Requests, TokenChunk, Trace, TraceMeta


def hand_trace(phase: int = 0) -> Trace:
    """The two tokens as prefill (phase 0) or as one decode step (phase 1)."""
    meta = TraceMeta(model="hand-made", num_layers=1, num_experts=4, top_k=2, hidden_size=10)
    req = Requests(np.array([50, 60]), np.array(["x", "x"], object), np.array(["", ""], object),
                   np.array([1, 1] if phase == 0 else [0, 0], np.int32), np.array([0, 0] if phase == 0 else [1, 1],
                                                                                  np.int32))
    tk = TokenChunk(np.array([50, 60]), np.array([0, 0], np.int32), np.array([phase, phase], np.int8),
                    np.array([[[3, 2]], [[3, 0]]], np.int16))
    return Trace(meta, req, tk)


def run(hbm_bw: float, mode: str = "auto", overlap: bool = False, phase: int = 0, overhead: float = 0.5):
    tr = hand_trace(phase)
    cluster = Cluster(2, 2, intra_bw=2.0, inter_bw=10.0, intra_latency=1.0, inter_latency=5.0, expert_flops=2.0,
                      hbm_bw=hbm_bw, compute_overhead=overhead)
    plan = Plan(Placement(np.array([[1, 2, 2, 1, 0, 3, 3, 1]]), 4, 4), cluster, homes={50: 0, 60: 1})
    cost = CostConfig(pair_flops=6.0, weight_bytes=1.0, mode=mode, overlap=overlap)
    res = simulate(tr, plan, cost=cost, batching=BatchConfig(prefill_tokens=2, decode_batch=2))
    ph = res.prefill if phase == 0 else res.decode
    return {k: v.tolist() for k, v in ph.per_microbatch.items()}


def test_element_sizes():
    assert dispatch_vector_bytes(7168, 1.0, 128) == 7168 + 4 * 56 == 7392  # DeepEP's fp8 + per-128 scales
    assert dispatch_vector_bytes(7168, 2.0, 128) == 14336  # bf16 dispatch carries no scales
    assert dispatch_vector_bytes(7168, 1.0, 0) == 7168
    assert dispatch_vector_bytes(10, 1.0, 128) == 14  # one scale for a partial block
    t = time_terms(CostConfig(), 7168, "deepseek-v3")
    assert t.dispatch_send_bytes == {"nccl": 7392, "deepep-normal": 7392, "deepep-ll": 7408}  # LL: +16 B header
    assert t.combine_send_bytes == 14336
    assert t.expert_bytes == 3 * 7168 * 2048 * 1.0  # fp8 weights of the preset
    assert time_terms(CostConfig(), 2880, "gpt-oss-20b").expert_bytes == 3 * 2880 * 2880 * 0.53125  # MXFP4


def test_roofline_memory_vs_flop_bound():
    # memory-bound: 2 active experts x 300 B / 50 B/s = 12 s > 6 s of FLOPs; + 0.5 s overhead
    m = run(hbm_bw=50.0)
    assert m["max_active"] == [[2]] and m["memory_time"] == [[12.0]] and m["compute_time"] == [[6.0]]
    assert m["expert_time"] == [[12.5]]
    # FLOP-bound: 2 x 300 / 200 = 3 s < 6 s
    m = run(hbm_bw=200.0)
    assert m["memory_time"] == [[3.0]] and m["expert_time"] == [[6.5]]
    # the helper on its own: no pairs -> 0, overhead included otherwise
    got = expert_seconds(np.array([4, 4, 0]), np.array([1.0, 9.0, 0.0]), np.array([True, True, False]), 100.0,
                         Cluster(1, 2, hbm_bw=200.0, compute_overhead=0.25))
    assert got.tolist() == [2.25, 9.25, 0.0]


def test_each_kernel_mode_by_hand():
    m = run(hbm_bw=200.0)
    nv, ib = 2.0 * DEEPEP_NVLINK_EFF, 10.0 * DEEPEP_RDMA_EFF
    # nccl: per-GPU dedup, busiest inter link 2 sends, link rates as given
    assert m["nccl.dispatch_time"] == [[pytest.approx(5 + 2 * 14 / 10)]]
    assert m["nccl.combine_time"] == [[pytest.approx(5 + 2 * 20 / 10)]]
    # deepep-normal: two-hop, busiest intra 1 (NVLink forward), inter 1; achieved fractions of the links
    assert m["deepep-normal.dispatch_time"] == [[pytest.approx(max(1 + 14 / nv, 5 + 14 / ib))]]
    assert m["deepep-normal.combine_time"] == [[pytest.approx(max(1 + 20 / nv, 5 + 20 / ib))]]
    # deepep-ll: one send per pair: busiest inter 2 pairs, none intra; 30 B per dispatch message; kernel alpha
    assert m["per_pair.busiest_inter"] == [[2]] and m["per_pair.busiest_intra"] == [[0]]
    assert m["per_pair.inter_node_sends"] == [[3]] and m["per_pair.intra_node_sends"] == [[0]]
    assert m["deepep-ll.dispatch_time"] == [[pytest.approx(DEEPEP_LL_ALPHA + 5 + 2 * 30 / ib)]]
    assert m["deepep-ll.combine_time"] == [[pytest.approx(DEEPEP_LL_ALPHA + 5 + 2 * 20 / ib)]]
    # auto on a prefill micro-batch = deepep-normal; layer time = dispatch + expert + combine
    assert m["dispatch_time"] == m["deepep-normal.dispatch_time"]
    assert m["layer_time"] == [[pytest.approx(1 + 14 / nv + 6.5 + 1 + 20 / nv)]]
    # the same tokens as a decode step: auto = deepep-ll
    d = run(hbm_bw=200.0, phase=1)
    assert d["layer_time"] == [[pytest.approx(2 * DEEPEP_LL_ALPHA + 10 + 2 * 30 / ib + 6.5 + 2 * 20 / ib)]]
    # the chosen kernel's inter-node sends: busiest GPU and mean per GPU (total / W, W = 4)
    assert m["busiest_inter_sends"] == [[1]] and m["mean_inter_sends"] == [[pytest.approx(2 / 4)]]  # two-hop
    assert d["busiest_inter_sends"] == [[2]] and d["mean_inter_sends"] == [[pytest.approx(3 / 4)]]  # per pair
    # an explicit mode wins over auto
    assert run(hbm_bw=200.0, mode="nccl")["layer_time"] == [[pytest.approx(7.8 + 6.5 + 9.0)]]


def test_overlap_by_hand():
    # formula: d + max(m, d) + max(c, m) + c; comm-bound -> d + c twice over halves; compute-bound -> m twice
    assert overlapped_seconds(np.array(2.0), np.array(1.0), np.array(3.0)) == 2 + 2 + 3 + 3
    assert overlapped_seconds(np.array(1.0), np.array(5.0), np.array(2.0)) == 1 + 5 + 5 + 2
    # nccl, memory-bound: halves send 1 inter message each: d 5 + 14/10 = 6.4, c 5 + 20/10 = 7; each half reads
    # the weights again: m 0.5 + max(12, 6 / 2) = 12.5 -> 6.4 + 12.5 + 12.5 + 7 = 38.4 (worse than 7.8 + 12.5 + 9)
    m = run(hbm_bw=50.0, mode="nccl", overlap=True)
    assert m["layer_time"] == [[pytest.approx(38.4)]]
    assert run(hbm_bw=50.0, mode="nccl")["layer_time"] == [[pytest.approx(29.3)]]
    # FLOP-bound with cheap links: compute halves (0 overhead, max(0.06, 3) = 3) hide under the other half's comm
    fast = run(hbm_bw=1e4, mode="nccl", overlap=True, overhead=0.0)
    assert fast["layer_time"] == [[pytest.approx(6.4 + 6.4 + 7 + 7)]]


def test_cost_config_refuses_bad_values():
    with pytest.raises(ValueError, match="mode"):
        CostConfig(mode="alltoall")
    with pytest.raises(ValueError, match="scale_block"):
        CostConfig(scale_block=-1)
    with pytest.raises(ValueError, match="weight_bytes"):
        CostConfig(weight_bytes=0)
    with pytest.raises(ValueError, match="hbm_bw"):
        Cluster(1, 2, hbm_bw=0)


def test_ideal_bounds_by_hand():
    # balanced: every busiest quantity replaced by its mean over the 4 GPUs. nccl (per-GPU dedup): inter-node
    # sends 0->2, 1->3, 1->2 = 3 in all, 0.75 per GPU; none intra. Loads [1, 0, 2, 1] -> mean 1 pair -> 3 s of
    # FLOPs; active experts [1, 0, 2, 1] -> mean 1 x 300 B / 50 B/s = 6 s -> expert 0.5 + max(6, 3) = 6.5 s.
    # dispatch 5 + 0.75 * 14 / 10 = 6.05, combine 5 + 0.75 * 20 / 10 = 6.5 -> 19.05 s (the plan itself: 29.3 s).
    m = run(hbm_bw=50.0, mode="nccl")
    assert m["bound_balanced_time"] == [[pytest.approx(6.05 + 6.5 + 6.5)]]
    # balanced and local: no inter-node sends and none intra -> no communication at all, only the mean expert
    assert m["bound_local_time"] == [[pytest.approx(6.5)]]
    # deepep-ll: 3 inter pairs / 4 GPUs; with overlap the halves send half of it
    ib = 10.0 * DEEPEP_RDMA_EFF
    ll = run(hbm_bw=50.0, mode="deepep-ll")
    assert ll["bound_balanced_time"] == [[pytest.approx(2 * DEEPEP_LL_ALPHA + 10 + 0.75 * (30 + 20) / ib + 6.5)]]
    ov = run(hbm_bw=50.0, mode="nccl", overlap=True)
    d, c, mh = 5 + 0.375 * 14 / 10, 5 + 0.375 * 20 / 10, 0.5 + max(6.0, 1.5)
    assert ov["bound_balanced_time"] == [[pytest.approx(d + max(mh, d) + max(c, mh) + c)]]
    for x in (m, ll, ov):  # a bound never exceeds the plan's own time
        assert x["bound_local_time"][0][0] <= x["bound_balanced_time"][0][0] <= x["layer_time"][0][0]
