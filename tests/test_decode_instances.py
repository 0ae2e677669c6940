"""Decode instances (moeplace.simulate.instances) against plain loops: steps of continuous batching per instance,
distinct experts per step and layer, the roofline time, and least-loaded routing. Hand-made synthetic routing."""

from __future__ import annotations

import heapq

import numpy as np
import pytest

from moeplace.placement import Cluster
from moeplace.simulate import CostConfig
from moeplace.simulate.cost import pair_flops_of, time_terms
from moeplace.simulate.instances import decode_lengths, least_loaded, simulate_instances
from moeplace.trace.types import DECODE, Requests, TokenChunk, Trace, TraceMeta

L, E, K = 2, 8, 2


def synthetic_trace(lengths: list[int], seed: int = 0) -> Trace:
    """Decode-only requests with the given decode lengths (synthetic routing); rows shuffled on purpose."""
    rng = np.random.default_rng(seed)
    meta = TraceMeta(model="hand-made", num_layers=L, num_experts=E, top_k=K, hidden_size=64, synthetic=True,
                     source="tests")
    rid = np.arange(len(lengths)) * 10 + 3  # ids that are not table indices
    req = Requests(rid, np.array(["general"] * len(rid), object), np.array([""] * len(rid), object),
                   np.full(len(rid), 4, np.int32), np.asarray(lengths, np.int32))
    rows = [(r, 4 + j) for r, n in zip(rid, lengths, strict=True) for j in range(n)]
    perm = rng.permutation(len(rows))
    ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in rows]).astype(np.int16)
    tok = TokenChunk(np.array([rows[i][0] for i in perm], np.int64), np.array([rows[i][1] for i in perm], np.int32),
                     np.full(len(rows), DECODE, np.int8), ids[perm])
    return Trace(meta, req, tok, None)


def reference(trace: Trace, instance: list[int], n_inst: int, running: int, cost: CostConfig, gpu: Cluster):
    """(instance, seconds) of every step, by loops: per instance a running set filled in arrival order."""
    terms = time_terms(cost, 64, "hand-made")
    pair_s = pair_flops_of(cost, 64, "hand-made") / gpu.expert_flops
    rid = trace.requests.request_id.tolist()
    tk = trace.tokens
    out = []
    for i in range(n_inst):
        mine = [r for r, a in zip(rid, instance, strict=True) if a == i]
        heap, start = [], {}
        for r in mine:
            n = int((tk.request_id == r).sum())
            s = 0 if len(heap) < running else heapq.heappop(heap)
            start[r] = s
            heapq.heappush(heap, s + n)
        steps: dict[int, list[int]] = {}
        for t in range(len(tk)):
            r = int(tk.request_id[t])
            if r in start:
                j = sorted(tk.position[tk.request_id == r].tolist()).index(int(tk.position[t]))
                steps.setdefault(start[r] + j, []).append(t)
        for s in sorted(steps):
            secs = 0.0
            for layer in range(L):
                active = len({int(e) for t in steps[s] for e in tk.expert_ids[t, layer]})
                mem = active * terms.expert_bytes / gpu.hbm_bw
                secs += max(mem, len(steps[s]) * K * pair_s) + gpu.compute_overhead
            out.append((i, secs))
    return out


def test_instances_match_the_loops():
    lengths = [3, 5, 1, 4, 6, 2, 2, 7, 3]
    tr = synthetic_trace(lengths)
    cost = CostConfig(hidden_size=64, intermediate_size=32)
    gpu = Cluster(1, 1, compute_overhead=1e-6)
    inst = [0, 1, 0, 2, 1, 0, 2, 2, 1]
    res = simulate_instances(tr, np.array(inst), 3, 1, 2, cost, gpu)
    want = reference(tr, inst, 3, 2, cost, gpu)
    assert res.instance.tolist() == [i for i, _ in want]
    np.testing.assert_allclose(res.step_seconds, [s for _, s in want], rtol=1e-12)
    assert res.tokens.sum() == sum(lengths)
    np.testing.assert_allclose(res.busy_seconds().sum(), res.step_seconds.sum())
    assert decode_lengths(tr).tolist() == lengths


def test_gpus_split_the_weights():
    tr = synthetic_trace([4, 4, 4])
    cost = CostConfig(hidden_size=64, intermediate_size=32)
    one = simulate_instances(tr, np.zeros(3, np.int64), 1, 1, 8, cost)
    two = simulate_instances(tr, np.zeros(3, np.int64), 1, 2, 8, cost)
    np.testing.assert_allclose(two.step_seconds, one.step_seconds / 2)  # no overhead: both terms halve


def test_least_loaded_is_fewest_running_when_a_slot_frees():
    """A plain step-by-step loop: at each step, finished requests leave; queued requests take a slot on the
    instance with room that runs the fewest (ties: the lowest)."""
    lengths = [5, 1, 1, 3, 2, 8, 1, 1, 4, 2, 6]
    want, running = [], [[], [], []]  # finish steps of each instance's requests
    queue, t = list(enumerate(lengths)), 0
    while queue:
        running = [[f for f in fs if f > t] for fs in running]
        while queue:
            room = [i for i in range(3) if len(running[i]) < 2]
            if not room:
                break
            i = min(room, key=lambda j: (len(running[j]), j))
            _, n = queue.pop(0)
            running[i].append(t + n)
            want.append(i)
        t += 1
    got = least_loaded(np.array(lengths), 3, 2).tolist()
    assert got == want
    assert got[:6] == [0, 1, 2, 0, 1, 2]  # an idle pool spreads requests evenly
    assert least_loaded(np.ones(5, np.int64), 8, 64).tolist() == [0, 1, 2, 3, 4]


def test_bad_assignment_is_refused():
    tr = synthetic_trace([1, 2])
    with pytest.raises(ValueError, match="one instance in"):
        simulate_instances(tr, np.array([0, 3]), 2, 1, 4)
    with pytest.raises(ValueError, match=">= 1"):
        least_loaded(np.array([1]), 0, 1)


def planted_trace(groups: list[int], seed: int = 1) -> Trace:
    """Decode-only requests; request i's rows select only experts of block groups[i] (E / 4 experts per block)."""
    rng = np.random.default_rng(seed)
    meta = TraceMeta(model="hand-made", num_layers=L, num_experts=E, top_k=K, hidden_size=64, synthetic=True,
                     source="tests")
    rid = np.arange(len(groups)) * 7 + 2
    req = Requests(rid, np.array(["general"] * len(rid), object), np.array([""] * len(rid), object),
                   np.full(len(rid), 4, np.int32), np.full(len(rid), 5, np.int32))
    blk = E // 4
    ids = np.stack([np.stack([g * blk + rng.choice(blk, K, replace=False) for _ in range(L)])
                    for g in groups for _ in range(5)]).astype(np.int16)
    tok = TokenChunk(np.repeat(rid, 5).astype(np.int64), np.tile(np.arange(4, 9), len(rid)).astype(np.int32),
                     np.full(len(ids), DECODE, np.int8), ids)
    return Trace(meta, req, tok, None)


def test_hindsight_groups_recover_planted_groups_within_the_cap():
    from moeplace.evaluate.windows import hindsight_groups

    planted = np.random.default_rng(3).permutation(np.repeat(np.arange(4), 6)).tolist()  # 4 groups of 6
    got = hindsight_groups(planted_trace(planted), 4)
    # the same partition up to the groups' names: requests share a group exactly when they share a planted block
    same_got = got[:, None] == got[None, :]
    same_planted = np.array(planted)[:, None] == np.array(planted)[None, :]
    assert (same_got == same_planted).all()
    assert np.bincount(got, minlength=4).max() <= 6
    # more groups than blocks: still at most ceil(24 / 5) = 5 requests each, and deterministic
    five = hindsight_groups(planted_trace(planted), 5)
    assert np.bincount(five, minlength=5).max() <= 5
    assert (five == hindsight_groups(planted_trace(planted), 5)).all()
    with pytest.raises(ValueError, match="cannot fill"):
        hindsight_groups(planted_trace(planted[:3]), 4)
