"""FoE closed forms, and the simulator's counts on FoE and plain MoE traces agreeing with them."""

from __future__ import annotations

import numpy as np
import pytest

from moeplace.placement import Cluster, Placement, Plan
from moeplace.placement.foe import (
    foe_all_reduce_vectors,
    foe_all_to_all_vectors,
    foe_plan,
    lar_foe,
    lar_moe,
    moe_all_to_all_vectors,
    moe_foe_time_ratio,
)
from moeplace.simulate import simulate
from moeplace.simulate.foe import foe_split
from moeplace.simulate.synth import SynthConfig, generate_batches
from moeplace.trace.types import Requests, TokenChunk, Trace


def test_closed_forms():
    assert moe_foe_time_ratio(8, 8, 20) == pytest.approx(6.27, abs=0.005)
    assert moe_foe_time_ratio(8, 8, 20, W=4096, n=8) == pytest.approx(6.27, abs=0.05)  # tends to the limit
    assert lar_moe(32) == 1 / 32 and lar_foe(8, 32) == 0.25 and lar_foe(8, 4) == 1.0
    assert moe_all_to_all_vectors(8, 32, 8) == (2 * 8 * 31 / 32, 2 * 8 * 24 / 32)
    assert foe_all_to_all_vectors(8, 8, 32) == 2 * 8 * 24 / 32 and foe_all_to_all_vectors(8, 8, 4) == 0
    assert foe_all_reduce_vectors(8, 32) == 2 * 7 / 8 and foe_all_reduce_vectors(8, 2) == 1.0
    with pytest.raises(ValueError):
        lar_foe(0, 4)


def uniform_trace(T, L, E, K, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((T, L, E)), -1)[..., :K].astype(np.int16)
    n_req = T // 4
    from moeplace.trace.types import TraceMeta

    meta = TraceMeta(model="uniform", num_layers=L, num_experts=E, top_k=K, hidden_size=8, synthetic=True)
    req = Requests(np.arange(n_req), np.array(["x"] * n_req, object), np.array([""] * n_req, object),
                   np.full(n_req, 4, np.int32), np.zeros(n_req, np.int32))
    return Trace(meta, req, TokenChunk(np.repeat(np.arange(n_req), 4), np.tile(np.arange(4, dtype=np.int32), n_req),
                                       np.zeros(T, np.int8), ids))


def pair_vectors(res):
    """Vectors per token per layer at pair level (dispatch + combine), total and inter-node, plus LAR."""
    p = res.all
    tl = p.num_tokens * len(p.pairs)
    return 2 * (p.pairs.sum() - p.local_pairs.sum()) / tl, 2 * (p.pairs.sum() - p.node_local_pairs.sum()) / tl, \
        p.local_pairs.sum() / p.pairs.sum()


def test_simulator_matches_moe_closed_form():
    k, W, n = 4, 16, 8
    tr = uniform_trace(4000, 2, 64, k)
    res = simulate(tr, Plan(Placement.linear(2, 64, W), Cluster(W // n, n)))
    total, inter, lar = pair_vectors(res)
    t_ref, i_ref = moe_all_to_all_vectors(k, W, n)
    assert lar == pytest.approx(lar_moe(W), abs=0.01)
    assert total == pytest.approx(t_ref, rel=0.02) and inter == pytest.approx(i_ref, rel=0.03)


def test_simulator_matches_foe_closed_form():
    H, W, n = 4, 16, 8  # gpt-oss-20b: E=32, k=4 -> one expert per group; group h on GPUs 4h..4h+3 (one node)
    cfg = SynthConfig(num_requests=40, prompt_len=24, gen_len=8, load_skew=1.0, foe_groups=H, seed=2,
                      calibrate=False, temporal_overlap=0.0, layer_affinity=0.0, request_spread=0.0)
    meta, it = generate_batches("gpt-oss-20b", cfg)
    batches = list(it)
    rid, pos, ph, ids = (np.concatenate([b[1][i] for b in batches]) for i in range(4))
    pl, gl = (np.concatenate([b[0][k] for b in batches]).astype(np.int32) for k in ("prompt_len", "gen_len"))
    nr = len(pl)
    req = Requests(np.arange(nr), np.array(["x"] * nr, object), np.array([""] * nr, object), pl, gl)
    tr = Trace(meta, req, TokenChunk(rid, pos, ph, ids))
    sub = foe_split(tr, H)
    plan = foe_plan(Cluster(W // n, n), meta.num_layers, meta.num_experts, H, sub.requests.request_id)
    res = simulate(sub, plan)
    total, inter, lar = pair_vectors(res)
    total *= H  # per original token: H sub-tokens
    assert lar == pytest.approx(lar_foe(H, W), abs=0.02)
    assert total == pytest.approx(foe_all_to_all_vectors(meta.top_k, H, W), rel=0.03)
    assert inter == 0.0  # each group's GPUs sit in one node: FoE all-to-all is intra-node only
