"""activation-clusters with ``cluster_by="usage"``: groups fitted on what requests go on to use, routed by signal.

The workload is planted: every request's prompt (signal) is dominated by one of two "topic" experts that says nothing
about its decode, and carries a weak hint (one prompt token in eight) of its decode group; its decode uses only its
group's four experts. K-means on the signal splits by topic; clustering by usage splits by decode group, and the
mean signal of each group still carries the hint. The test checks the routes of new requests against the planted
decode groups, an independent definition of the right answer.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeplace.placement import Cluster
from moeplace.plan import make_plan
from moeplace.plan.base import request_expert_counts, workload_from_tokens
from moeplace.plan.grouping import capped_kmeans
from moeplace.plan.route import Router

E, PROMPT, DECODE_ROWS = 16, 16, 24


def planted(num: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(request_id [T], phase [T], expert_ids [T, 1, 2], decode group [num]) of ``num`` planted requests."""
    rng = np.random.default_rng(seed)
    group = rng.integers(0, 2, num)
    topic = rng.integers(0, 2, num)
    rid, phase, ids = [], [], []
    for r in range(num):
        for t in range(PROMPT):  # prompt: the topic expert, a noise expert; every 8th token the group's hint expert
            second = 2 + group[r] if t % 8 == 0 else rng.integers(4, 8)
            rid.append(r), phase.append(0), ids.append((topic[r], second))
        for _ in range(DECODE_ROWS):  # decode: two of the group's four experts
            a, b = rng.choice(4, 2, replace=False)
            rid.append(r), phase.append(1), ids.append((8 + 4 * group[r] + a, 8 + 4 * group[r] + b))
    return (np.array(rid, np.int64), np.array(phase, np.int8), np.array(ids, np.int16).reshape(-1, 1, 2), group)


def agreement(homes: np.ndarray, truth: np.ndarray) -> float:
    """Share of requests whose home matches the planted group, under the better of the two labelings."""
    same = float(np.mean(homes == truth))
    return max(same, 1.0 - same)


def test_usage_clusters_route_new_requests_by_their_decode_group_where_signal_clusters_do_not() -> None:
    work = workload_from_tokens(*planted(400, seed=1)[:3], E)
    rid, phase, ids, truth = planted(200, seed=2)  # new requests: only their prompts are known on arrival
    pre = phase == 0
    counts = request_expert_counts(rid[pre], ids[pre], len(truth), E)
    got = {}
    for by in ("signal", "usage"):
        plan = make_plan("activation-clusters", work, Cluster(2, 1), 0, seed=0, cluster_by=by)
        got[by] = agreement(plan.grouper.assign(counts), truth)
    assert plan.grouper.kind == "usage-ridge"
    # what an engine deploys: the plan's export, read back by the route service, gives the same homes
    stored = make_plan("activation-clusters", work, Cluster(2, 1), 0, seed=0, cluster_by="usage")
    router = Router.from_export(json.loads(json.dumps(Router.from_plan(stored).to_export())))
    assert router.grouper.kind == "usage-ridge"
    assert np.array_equal(router.route_batch(counts), stored.grouper.assign(counts))
    assert got["usage"] >= 0.95, got
    assert got["signal"] <= 0.75, got  # the published method splits by topic, which decode does not follow


def test_cluster_by_signal_is_the_published_default() -> None:
    work = workload_from_tokens(*planted(120, seed=3)[:3], E)
    a = make_plan("activation-clusters", work, Cluster(2, 2), 4, seed=5)
    b = make_plan("activation-clusters", work, Cluster(2, 2), 4, seed=5, cluster_by="signal")
    assert a.to_json() == b.to_json()
    with pytest.raises(ValueError, match="cluster_by"):
        make_plan("activation-clusters", work, Cluster(2, 2), 4, cluster_by="decode")


def test_capped_kmeans_respects_the_cap_and_finds_planted_clusters() -> None:
    rng = np.random.default_rng(0)
    centres = np.eye(6, dtype=np.float32)[:3]
    truth = np.repeat(np.arange(3), [50, 40, 30])
    x = centres[truth] + 0.05 * rng.standard_normal((len(truth), 6)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    g = capped_kmeans(x, 3)
    assert np.bincount(g, minlength=3).max() <= 40  # ceil(120 / 3)
    # each planted cluster keeps a label of its own; the two under the cap keep >= 90% of their rows (the greedy
    # capped assignment moves a few to make room for the 10 rows over the cap of the largest)
    major = [int(np.bincount(g[truth == t], minlength=3).argmax()) for t in range(3)]
    assert sorted(major) == [0, 1, 2]
    for t in (1, 2):
        assert np.mean(g[truth == t] == major[t]) >= 0.9
    assert np.array_equal(capped_kmeans(x, 3), g)


def test_joint_times_usage_grouped_candidates_where_decode_is_weighed_and_deploys_one_when_it_pays() -> None:
    """On the planted workload decode follows the hidden group, not the topic: joint's usage-grouped candidates
    keep each group's decode on its own node, and the evidence sees it; a prefill-only plan does not time them
    (a prefill's traffic is its prompt)."""
    work = workload_from_tokens(*planted(512, seed=4)[:3], E)
    plan = make_plan("joint", work, Cluster(2, 2), 4, hidden_size=7168, phases="decode")
    d = plan.extra["decision"]
    assert any(c.startswith("usage-") for c in d["candidates"])
    assert d["deployed"] == "candidate" and d["chosen"].startswith("usage-"), (d["chosen"], d["reason"])
    assert plan.grouper is not None and plan.grouper.kind == "usage-ridge"
    rid, phase, ids, truth = planted(200, seed=5)
    counts = request_expert_counts(rid[phase == 0], ids[phase == 0], len(truth), E)
    assert agreement(plan.grouper.assign(counts) // 2, truth) >= 0.95  # node = rank // gpus_per_node
    pre = make_plan("joint", work, Cluster(2, 2), 4, hidden_size=7168, phases="prefill")
    assert not any(c.startswith("usage-") for c in pre.extra["decision"]["candidates"])


def test_ridge_solves_the_penalised_least_squares_on_either_side_of_square():
    """_ridge's Gram-matrix forms against the normal equations (x^T x + lam I) W = x^T y, solved directly."""
    from moeplace.plan.activation_clusters import _ridge

    rng = np.random.default_rng(3)
    for rows, dims in ((40, 70), (70, 40)):
        x, y = rng.normal(size=(rows, dims)), rng.normal(size=(rows, 3))
        lams = (0.1, 1.0, 100.0)
        for lam, w in zip(lams, _ridge(x, y, lams), strict=True):
            ref = np.linalg.solve(x.T @ x + lam * np.eye(dims), x.T @ y)
            assert w.shape == (dims, 3)
            assert np.allclose(w, ref, rtol=1e-8, atol=1e-10)
