"""``moeplace.simulate.simulate`` held to its independent specification (tests/spec_simulator.py).

Small traces with skewed routing (so the replicated hot experts are busy), request tables in an order that is not
the id order, prompt_len 0 in the table, shuffled token rows, clusters 1x4, 2x2, 4x2 and 2x4, experts with 2 and 3
replicas (on one node, across nodes, and sometimes twice on one GPU), planned and round-robin homes, both replica
rules, both phases, and stream chunks that split micro-batches. Integers must be equal, floats allclose. Then a
hand-computed two-token case for the cost terms, and a check that the spec does not borrow from the code.
"""

from __future__ import annotations

import ast
import time
from pathlib import Path

import numpy as np
import pytest
from spec_compare import assert_matches_spec, balanced_kwargs
from spec_simulator import spec_simulate

from moeplace.placement import Cluster, Placement, Plan
from moeplace.simulate import RULES, BatchConfig, CostConfig, simulate
from moeplace.trace.types import Requests, TokenChunk, Trace, TraceMeta
from moeplace.trace.writer import write_trace

SPEC_FILE = Path(__file__).with_name("spec_simulator.py")
PAIR_FLOPS = 8e8  # CostConfig.pair_flops in these tests; pair seconds = PAIR_FLOPS / cluster.expert_flops


def skewed_trace(rng: np.random.Generator, prompts: list[int], gens: list[int], L: int, E: int, K: int,
                 zero_prompt: set[int], hidden: int = 6) -> Trace:
    """Requests r with prompts[r] prefill and gens[r] decode tokens, rows shuffled; request ids are not in table
    order; requests in ``zero_prompt`` have prompt_len 0 in the table (the simulator infers it)."""
    R = len(prompts)
    rids = rng.permutation(np.arange(100, 100 + 7 * R, 7))
    p = 1.0 / (np.arange(E) + 1.0) ** 1.3  # skewed: low expert ids are hot
    p /= p.sum()
    rid, pos, ph = [], [], []
    for r in range(R):
        n = prompts[r] + gens[r]
        rid += [int(rids[r])] * n
        pos += list(range(n))
        ph += [0] * prompts[r] + [1] * gens[r]
    T = len(rid)
    ids = np.array([[rng.choice(E, K, replace=False, p=p) for _ in range(L)] for _ in range(T)], np.int16)
    order = rng.permutation(T)
    meta = TraceMeta(model="hand-made", num_layers=L, num_experts=E, top_k=K, hidden_size=hidden, synthetic=True)
    table_prompt = [0 if r in zero_prompt else prompts[r] for r in range(R)]
    req = Requests(rids.astype(np.int64), np.array(["x"] * R, object), np.array([""] * R, object),
                   np.array(table_prompt, np.int32), np.array(gens, np.int32))
    tk = TokenChunk(np.array(rid, np.int64)[order], np.array(pos, np.int32)[order], np.array(ph, np.int8)[order],
                    ids.reshape(T, L, K)[order])
    return Trace(meta, req, tk)


def replicated_placement(rng: np.random.Generator, L: int, E: int, W: int, extra: list[int]) -> Placement:
    """Every expert once plus the ``extra`` replicas (e.g. [0, 0, 1, 2]: expert 0 three times), slots shuffled."""
    rows = [np.r_[np.arange(E), extra][rng.permutation(E + len(extra))] for _ in range(L)]
    return Placement(np.stack(rows), E, W, allow_colocated_replicas=True)


def spec_for(trace: Trace, plan: Plan, rule: str, batching: BatchConfig, cost: CostConfig) -> dict:
    return spec_simulate(trace, plan, rule=rule, hidden=cost.hidden_size or trace.meta.hidden_size,
                         dispatch_bytes=cost.dispatch_bytes, combine_bytes=cost.combine_bytes,
                         pair_seconds=cost.pair_flops / plan.cluster.expert_flops, decode_batch=batching.decode_batch,
                         prefill_tokens=batching.prefill_tokens, **balanced_kwargs(plan, rule))


CLUSTERS = [(1, 4), (2, 2), (4, 2), (2, 4)]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("nodes,gpus", CLUSTERS)
def test_simulate_equals_spec(nodes, gpus, rule):
    rng = np.random.default_rng(1000 * nodes + 10 * gpus + RULES.index(rule))
    L, E, K = 3, 12, 3
    cluster = Cluster(nodes, gpus)
    W = cluster.world_size
    extra = [0, 0, 1, 2]  # expert 0: 3 replicas, experts 1 and 2: 2; P = 16 fills 4 or 8 GPUs
    placement = replicated_placement(rng, L, E, W, extra)
    # the shuffled slots put replicas on one node and on different nodes somewhere in these layers
    node_of_slot = placement.slot_gpu // gpus
    spread = {len(set(node_of_slot[placement.phy2log[layer] == e])) for layer in range(L) for e in (0, 1, 2)}
    assert max(spread) >= min(2, nodes)
    prompts = [5, 3, 1, 6, 4, 2, 7]
    gens = [4, 0, 5, 3, 2, 6, 1]
    tr = skewed_trace(rng, prompts, gens, L, E, K, zero_prompt={1, 4})
    homes = {int(r): int(rng.integers(0, W)) for r in tr.requests.request_id[::2]}  # the rest round-robin
    plan = Plan(placement, cluster, homes=homes)
    cost = CostConfig(dispatch_bytes=1, combine_bytes=2, pair_flops=PAIR_FLOPS)
    for batching, chunk in ((BatchConfig(decode_batch=3, prefill_tokens=5), 4),
                            (BatchConfig(decode_batch=7, prefill_tokens=64), 11)):
        res = simulate(tr, plan, cost=cost, batching=batching, rule=rule, chunk_tokens=chunk)
        assert res.pair_seconds == pytest.approx(PAIR_FLOPS / cluster.expert_flops)
        assert res.prefill.num_microbatches > 1 or batching.prefill_tokens > sum(prompts)
        assert_matches_spec(res, spec_for(tr, plan, rule, batching, cost))


def test_rules_differ_and_both_match_spec():
    """A case where the two rules route differently, so the comparison would catch a swapped rule."""
    rng = np.random.default_rng(5)
    cluster = Cluster(1, 4)
    placement = replicated_placement(rng, 2, 6, 4, [0, 0, 1, 1, 2, 3])
    tr = skewed_trace(rng, [8, 8, 8, 8], [3, 3, 3, 3], 2, 6, 2, zero_prompt=set())
    plan = Plan(placement, cluster)
    cost = CostConfig(pair_flops=PAIR_FLOPS)
    b = BatchConfig(decode_batch=4, prefill_tokens=16)
    loads = []
    for rule in RULES:
        res = simulate(tr, plan, cost=cost, batching=b, rule=rule, chunk_tokens=6)
        assert_matches_spec(res, spec_for(tr, plan, rule, b, cost))
        loads.append(res.prefill.load)
    assert not np.array_equal(loads[0], loads[1])


def test_from_disk_in_small_shards_equals_spec(tmp_path):
    rng = np.random.default_rng(9)
    tr = skewed_trace(rng, [4, 0, 6, 3, 5], [3, 4, 0, 5, 2], 2, 8, 2, zero_prompt={2})
    path = write_trace(tmp_path / "t.trace", tr, shard_tokens=7)
    cluster = Cluster(2, 2)
    plan = Plan(replicated_placement(rng, 2, 8, 4, [0, 0, 1, 3, 4, 5, 6, 7]), cluster)
    cost = CostConfig(hidden_size=16, dispatch_bytes=2, combine_bytes=2, pair_flops=PAIR_FLOPS)
    b = BatchConfig(decode_batch=2, prefill_tokens=6)
    for rule in RULES:
        res = simulate(path, plan, cost=cost, batching=b, rule=rule, chunk_tokens=3)
        assert_matches_spec(res, spec_for(tr, plan, rule, b, cost))


def test_hand_computed_costs():
    """Two prefill tokens, one layer, 2 nodes x 2 GPUs, every number worked out by hand.

    Slots (S = 2): GPU 0 holds experts [1, 2], GPU 1 [2, 1], GPU 2 [0, 3], GPU 3 [3, 1]. So expert 0 lives only on
    GPU 2, expert 3 on GPUs 2 and 3 (slots 5 and 6), expert 2 on GPUs 0 and 1, expert 1 on GPUs 0, 1 and 3.
    Token A (home GPU 0) picks experts [3, 2]; token B (home GPU 1) picks [3, 0]; both in one micro-batch.

    A, expert 3: no replica on node 0, tier = slots {5, 6}, both GPUs empty -> lowest slot 5 (GPU 2).
    A, expert 2: a replica on the home GPU -> slot 1 (GPU 0), local.
    B, expert 3: tier {5, 6}; GPU 2 has 1 pair, GPU 3 none -> slot 6 (GPU 3) (static: 1 % 2 = 1 -> slot 6 too).
    B, expert 0: slot 4 (GPU 2).
    Load [1, 0, 2, 1]: balancedness 1 / 2, LAR 1/4, node-local 1/4.

    Per-GPU dedup sends: 0->0 (intra-GPU), 0->2, 1->3, 1->2 (inter-node).
    Two-hop: 0->0; 0->2 lands on GPU 2 (node 1, local rank 0), a target; B's sends to node 1 land on GPU 3 (local
    rank 1): 1->3, then forwarding 3->2 over NVLink. Inter-node 2, intra-node 1, intra-GPU 1.

    Links: intra alpha 1 s, 2 B/s; inter alpha 5 s, 10 B/s. hidden 10, fp8 dispatch (10 B per send), bf16
    combine (20 B). Compute: 6 FLOPs per pair / 2 FLOP/s = 3 s per pair.

    per-GPU, unpadded: busiest inter link = 2 sends (GPU 1 sends 2, GPU 2 receives 2), no intra-node sends.
      dispatch 5 + 2*10/10 = 7, combine 5 + 2*20/10 = 9 -> 16.
    per-GPU, padded: max message 1; intra: G-1 = 1 peer x 1 -> dispatch 1 + 10/2 = 6, combine 1 + 20/2 = 11;
      inter: W-G = 2 peers x 1 -> 7 and 9. dispatch max(6, 7) = 7, combine max(11, 9) = 11 -> 18.
    two-hop, unpadded: busiest intra 1 (3->2), inter 1: dispatch max(1 + 10/2, 5 + 10/10) = max(6, 6) = 6,
      combine max(1 + 20/2, 5 + 20/10) = max(11, 7) = 11 -> 17.
    two-hop, padded: max message 1 -> as per-GPU padded: 18.
    compute: busiest GPU 2 pairs x 3 s = 6; layer time per-GPU 16 + 6 = 22.
    bytes: per-GPU inter-node 3 sends x 30 B = 90; two-hop inter 2 x 30 = 60, intra 1 x 30 = 30.
    """
    p2l = np.array([[1, 2, 2, 1, 0, 3, 3, 1]])
    cluster = Cluster(2, 2, intra_bw=2.0, inter_bw=10.0, intra_latency=1.0, inter_latency=5.0, expert_flops=2.0)
    plan = Plan(Placement(p2l, 4, 4), cluster, homes={50: 0, 60: 1})
    meta = TraceMeta(model="hand-made", num_layers=1, num_experts=4, top_k=2, hidden_size=10)
    req = Requests(np.array([50, 60]), np.array(["x", "x"], object), np.array(["", ""], object),
                   np.array([1, 0], np.int32), np.array([0, 0], np.int32))  # B's prompt_len 0 -> 1 from its token
    tk = TokenChunk(np.array([50, 60]), np.array([0, 0], np.int32), np.array([0, 0], np.int8),
                    np.array([[[3, 2]], [[3, 0]]], np.int16))
    tr = Trace(meta, req, tk)
    cost = CostConfig(dispatch_bytes=1, combine_bytes=2, pair_flops=6.0)
    b = BatchConfig(prefill_tokens=2)
    for rule in ("nearest-least-loaded", "nearest-static"):  # the balanced rules: tests/test_routing_rules.py
        res = simulate(tr, plan, cost=cost, batching=b, rule=rule)
        full_spec = spec_for(tr, plan, rule, b, cost)
        spec = full_spec["prefill"]
        for got in (res.prefill, None):
            pm = spec["per_microbatch"] if got is None else got.per_microbatch
            load = spec["load"] if got is None else got.load
            sends = spec["sends"] if got is None else got.sends
            assert load.tolist() == [[1, 0, 2, 1]]
            assert sends["per_gpu"][0].tolist() == [[1, 0, 1, 0], [0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]]
            assert sends["two_hop"][0].tolist() == [[1, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 1, 0]]
            assert pm["per_gpu.comm_time"].tolist() == [[16.0]]
            assert pm["per_gpu.comm_time_padded"].tolist() == [[18.0]]
            assert pm["two_hop.comm_time"].tolist() == [[17.0]]
            assert pm["two_hop.comm_time_padded"].tolist() == [[18.0]]
            assert pm["compute_time"].tolist() == [[6.0]]
            assert pm["two_hop.inter_node_sends"].tolist() == [[2]] and pm["two_hop.intra_node_sends"].tolist() == [[1]]
            assert pm["per_gpu.max_message_sends"].tolist() == [[1]]
        j = res.to_json()
        assert j["inter_node_bytes"]["total"] == 90
        assert j["two_hop_inter_node_bytes"]["total"] == 60 and j["two_hop_intra_node_bytes"]["total"] == 30
        assert j["layer_time_s"]["total"] == pytest.approx(22.0)
        assert j["balancedness"]["total"] == 0.5
        assert j["local_activation_rate"]["total"] == 0.25 and j["node_local_rate"]["total"] == 0.25
        assert_matches_spec(res, full_spec)


def test_spec_imports_nothing_from_the_simulator():
    tree = ast.parse(SPEC_FILE.read_text())
    allowed = {"moeplace.placement", "moeplace.trace.types"}
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            used |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            used.add(node.module or "")
            if node.module == "moeplace":
                used |= {f"moeplace.{a.name}" for a in node.names}
    ours = {m for m in used if m == "moeplace" or m.startswith("moeplace.")}
    assert not {m for m in ours if m.startswith("moeplace.simulate")}, ours
    assert ours <= allowed, f"spec_simulator.py may only import {sorted(allowed)} from moeplace, imports {ours}"


def test_spec_speed():
    """The spec is a loop, but 10k tokens x 8 layers must stay well under a minute."""
    rng = np.random.default_rng(2)
    L, E, K = 8, 32, 4
    T = 10_240
    meta = TraceMeta(model="hand-made", num_layers=L, num_experts=E, top_k=K, hidden_size=64)
    R = 40  # 40 requests x (192 prompt + 64 decode)
    rid = np.repeat(np.arange(R), 256)
    pos = np.tile(np.arange(256), R).astype(np.int32)
    ph = (pos >= 192).astype(np.int8)
    ids = np.argsort(rng.random((T, L, E)), -1)[:, :, :K].astype(np.int16)
    req = Requests(np.arange(R), np.array(["x"] * R, object), np.array([""] * R, object),
                   np.full(R, 192, np.int32), np.full(R, 64, np.int32))
    tr = Trace(meta, req, TokenChunk(rid, pos, ph, ids))
    plan = Plan(Placement.linear(L, E, 8, num_redundant=8), Cluster(2, 4))
    t0 = time.perf_counter()
    spec_simulate(tr, plan, rule="nearest-least-loaded", hidden=64, dispatch_bytes=1, combine_bytes=2,
                  pair_seconds=1e-9, decode_batch=16, prefill_tokens=2048)
    assert time.perf_counter() - t0 < 45.0
