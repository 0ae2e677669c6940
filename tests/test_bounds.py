"""The reachable bound (moeplace.simulate.bounds) against brute force: on instances small enough to enumerate every
placement within the slots, every balanced grouping of tokens to GPUs and every replica dispatch, the bound is
never above the least layer time any of them gives, and the local-pair bound is exact where it should be.

The brute force counts loads, active experts and sends here, from the definitions in docs/MODEL.md (one copy per
pair for DeepEP low-latency, one per destination GPU for NCCL), not with the simulator's kernels; it prices them
with the time model's formulas (kernel_seconds, expert_seconds), which are the model, not the bound."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from moeplace.placement import Cluster
from moeplace.simulate.bounds import expert_demand, local_pairs_curve, local_pairs_upper, reachable_seconds
from moeplace.simulate.config import CostConfig
from moeplace.simulate.cost import time_terms
from moeplace.simulate.kernels import KERNELS, expert_seconds, kernel_seconds, overlapped_seconds

PAIR_SECONDS = 2e-7


def placements(E: int, P: int):
    """Every phy2log row of P slots holding each of E experts at least once."""
    for row in itertools.product(range(E), repeat=P):
        if len(set(row)) == E:
            yield np.array(row)


def groupings(T: int, W: int):
    """Every assignment of T tokens to W GPUs with T / W tokens each (balanced rounds)."""
    per = T // W
    for perm in set(itertools.permutations(np.repeat(np.arange(W), per).tolist())):
        yield np.array(perm)


def brute_min_time(ids: np.ndarray, W: int, G: int, E: int, P: int, cluster: Cluster, terms, phase: str) -> float:
    """The least layer time over every placement, grouping and dispatch of one micro-batch (ids int [T, K])."""
    T, K = ids.shape
    k = terms.kernel_mode(phase)
    km = KERNELS[k]
    S = P // W
    best = np.inf
    for row in placements(E, P):
        gpus_of = [np.flatnonzero(row == e) // S for e in range(E)]
        gpus_of = [np.unique(g) for g in gpus_of]
        for home in groupings(T, W):
            choices = [gpus_of[e] for e in ids.ravel()]
            for pick in itertools.product(*choices):
                serve = np.array(pick).reshape(T, K)
                load = np.bincount(serve.ravel(), minlength=W)
                active = np.array([len(set(ids[serve == g].tolist())) for g in range(W)])
                sent = np.zeros((2, W))  # [intra, inter] sends out of each GPU
                recv = np.zeros((2, W))
                for t in range(T):
                    dests = serve[t] if km.sends == "per_pair" else np.unique(serve[t])
                    for g in dests:
                        if g == home[t]:
                            continue
                        c = int(g // G != home[t] // G)
                        sent[c, home[t]] += 1
                        recv[c, g] += 1
                busy = np.maximum(sent, recv).max(1)
                any_pairs = np.array(True)

                def one(busy_i, busy_e, nbytes, any_pairs=any_pairs):
                    return kernel_seconds(km, np.array(busy_i), np.array(busy_e), any_pairs, cluster, nbytes)

                if terms.overlap:
                    d = one(busy[0] / 2, busy[1] / 2, terms.dispatch_send_bytes[k])
                    c = one(busy[0] / 2, busy[1] / 2, terms.combine_send_bytes)
                    m = expert_seconds(active.max(), load.max() * PAIR_SECONDS / 2, any_pairs, terms.expert_bytes,
                                       cluster)
                    t_layer = float(overlapped_seconds(d, m, c))
                else:
                    t_layer = float(one(busy[0], busy[1], terms.dispatch_send_bytes[k])
                                    + expert_seconds(active.max(), load.max() * PAIR_SECONDS, any_pairs,
                                                     terms.expert_bytes, cluster)
                                    + one(busy[0], busy[1], terms.combine_send_bytes))
                best = min(best, t_layer)
    return best


def brute_max_node_local(ids: np.ndarray, N: int, E: int, P: int) -> int:
    """The most pairs served on their token's own node over every placement (P slots over N nodes) and grouping."""
    T, _ = ids.shape
    S = P // N
    best = 0
    for row in placements(E, P):
        held = [set(row[n * S:(n + 1) * S].tolist()) for n in range(N)]
        for home in groupings(T, N):
            best = max(best, sum(int(e in held[home[t]]) for t in range(T) for e in ids[t]))
    return best


def random_ids(rng, T: int, K: int, E: int, hot: float) -> np.ndarray:
    p = np.full(E, (1 - hot) / (E - 1))
    p[0] = hot
    return np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(T)])


@pytest.mark.parametrize("mode,overlap", [("deepep-ll", False), ("nccl", False), ("deepep-ll", True)])
@pytest.mark.parametrize("N,G", [(2, 1), (2, 2)])
def test_reachable_bound_is_below_every_placement_grouping_and_dispatch(mode, overlap, N, G):
    W = N * G
    E, P, K, T = 3, 4, 2, 4  # 3 experts, 1 replica slot: 4 slots (2 per GPU on 2x1, 1 per GPU on 2x2)
    # slow inter-node links and heavy experts, so that both sends and compute matter
    cluster = Cluster(N, G, intra_bw=50e9, inter_bw=5e9, intra_latency=1e-6, inter_latency=4e-6, hbm_bw=1e12)
    terms = time_terms(CostConfig(hidden_size=1024, mode=mode, overlap=overlap), 1024, "")
    rng = np.random.default_rng(7)
    for trial in range(4):
        ids = random_ids(rng, T, K, E, hot=0.6 if trial % 2 else 0.34)
        demand = expert_demand(ids[:, None, :], np.arange(T), np.array([0, T]), E)  # [1, 1, E]
        reach = float(reachable_seconds(demand, np.array([T]), K, P, cluster, terms, "decode", PAIR_SECONDS)[0, 0])
        brute = brute_min_time(ids, W, G, E, P, cluster, terms, "decode")
        assert 0 < reach <= brute * (1 + 1e-12), (ids.tolist(), reach, brute)


def test_local_pairs_bound_against_brute_force():
    rng = np.random.default_rng(3)
    for N, E, P, T, K in ((2, 3, 4, 4, 2), (2, 4, 4, 4, 2), (3, 3, 6, 6, 2), (2, 4, 6, 4, 2)):
        for hot in (0.3, 0.7):
            ids = random_ids(rng, T, K, E, hot)
            d = np.bincount(ids.ravel(), minlength=E)
            bound = local_pairs_upper(d, -(-T // N), N, P - E)
            brute = brute_max_node_local(ids, N, E, P)
            assert brute <= bound, (ids.tolist(), brute, bound)


def test_local_pairs_bound_is_exact_when_one_expert_is_wanted_by_all():
    # every token wants expert 0: with no spare slot it lives on one node, whose T/N tokens are the only local
    # ones; each spare slot adds a node of local tokens. Brute force agrees on the small case.
    ids = np.array([[0, 1], [0, 2], [0, 1], [0, 2]])
    d = np.bincount(ids.ravel(), minlength=3)
    assert local_pairs_upper(d, 2, 2, 0) == 2 + 2 + 2  # e0: 2 of 4; e1, e2: 2 each (fit one node)
    assert brute_max_node_local(ids, 2, 3, 4) <= local_pairs_upper(d, 2, 2, 1)
    assert local_pairs_upper(d, 2, 2, 1) == 8  # a second copy of expert 0: everything can be local
    # with 4 nodes of 1 token and one spare slot: expert 0 reaches 2 of the 4 tokens at most
    assert local_pairs_upper(np.array([4, 0, 0, 0]), 1, 4, 1) == 2


def test_reachable_bound_on_the_bundled_trace_is_below_every_plans_layer_and_balanced_bound():
    # micro-batch by micro-batch, under two plans and two rules: the bound does not depend on the plan and is
    # never above what a plan gives, nor above that plan's own balanced bound
    from moeplace.data import default_trace_path
    from moeplace.placement import Placement, Plan
    from moeplace.simulate import simulate
    from moeplace.trace import read_trace

    tr = read_trace(default_trace_path())
    cl = Cluster(2, 2)
    E, L = tr.meta.num_experts, tr.meta.num_layers
    rng = np.random.default_rng(0)
    lin = Placement.linear(L, E, 4, 4)
    shuffled = Placement(np.stack([rng.permutation(E)[r] for r in lin.phy2log]), E, 4)
    seen = []
    for pl, rule in ((lin, "nearest-least-loaded"), (shuffled, "nearest-static")):
        res = simulate(tr, Plan(pl, cl), rule=rule).decode
        reach = res.layer_times("bound_reachable_time")
        assert np.all(reach <= res.layer_times("bound_balanced_time") * (1 + 1e-9))
        assert np.all(reach <= res.layer_times() * (1 + 1e-9))
        seen.append(reach)
    np.testing.assert_array_equal(seen[0], seen[1])


def test_expert_demand_counts_pairs_per_microbatch():
    ids = np.array([[[0, 1]], [[1, 2]], [[2, 2 - 2]]])  # [T=3, L=1, K=2]
    d = expert_demand(ids, np.array([2, 0, 1]), np.array([0, 1, 3]), 3)
    assert d.tolist() == [[[1, 0, 1]], [[1, 2, 1]]]


def test_local_pairs_curve_takes_the_largest_gains_first():
    # gains of a second copy: expert 2 (4 pairs, cap 2) gains 2; nothing else gains
    d = np.array([2, 2, 4])
    np.testing.assert_array_equal(local_pairs_curve(d, 2, 2, 2), [6, 8, 8])
    # three units of cap 1: expert 0 (3 pairs) gains 1 and 1, expert 1 (2 pairs) gains 1
    np.testing.assert_array_equal(local_pairs_curve(np.array([3, 2, 0]), 1, 3, 4), [2, 3, 4, 5, 5])


def test_a_planner_can_leave_the_bound_out_and_gets_the_same_times():
    # simulate_rows(bound=False), what joint scores its candidates with, drops only the bound's column
    from moeplace.simulate.simulator import simulate_rows

    rng = np.random.default_rng(5)
    T, L, K, E = 96, 2, 2, 6
    ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(T)])
    home, mb = rng.integers(0, 4, T), np.arange(T) // 16
    p2l = np.stack([rng.permutation(np.r_[np.arange(E), rng.choice(E, 2, replace=False)]) for _ in range(L)])
    cost = CostConfig(hidden_size=1024)
    for rule in ("nearest-least-loaded", "balanced"):
        umb, full = simulate_rows(ids, home, mb, "decode", p2l, Cluster(2, 2), cost, rule=rule, num_experts=E)
        umb2, lean = simulate_rows(ids, home, mb, "decode", p2l, Cluster(2, 2), cost, rule=rule, num_experts=E,
                                   bound=False)
        assert "bound_reachable_time" in full and "bound_reachable_time" not in lean
        assert set(full) - set(lean) == {"bound_reachable_time"}
        np.testing.assert_array_equal(umb, umb2)
        for k in lean:
            np.testing.assert_array_equal(full[k], lean[k])
        assert (full["bound_reachable_time"] > 0).all()
