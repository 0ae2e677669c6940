"""Placement, cluster and plan types: derived arrays, validation errors, JSON round trip."""

import numpy as np
import pytest

from moeplace.placement import Cluster, Placement, Plan


def test_linear_and_derived():
    pl = Placement.linear(2, 8, 4, num_redundant=4)
    assert pl.num_slots == 12 and pl.slots_per_gpu == 3
    assert pl.slot_gpu.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert pl.replica_count[0].tolist() == [2, 2, 2, 2, 1, 1, 1, 1]
    l2p = pl.log2phy
    assert l2p.shape == (2, 8, 2)
    assert l2p[0, 0].tolist() == [0, 8] and l2p[0, 5].tolist() == [5, -1]
    for layer in range(2):
        for e in range(8):
            for p in l2p[layer, e]:
                if p >= 0:
                    assert pl.phy2log[layer, p] == e
    m = pl.expert_gpu_mask()
    assert m[0, 0].tolist() == [True, False, True, False]


def test_placement_errors():
    with pytest.raises(ValueError, match="not divisible by 3 GPUs"):
        Placement(np.arange(8)[None], 8, 3)
    with pytest.raises(ValueError, match="expert 7 has no slot in layer 0"):
        Placement(np.array([[0, 1, 2, 3, 4, 5, 6, 6]]), 8, 2)
    with pytest.raises(ValueError, match=r"expert id 9 out of range \[0, 8\)"):
        Placement(np.array([[0, 1, 2, 3, 4, 5, 6, 9]]), 8, 2)
    with pytest.raises(ValueError, match="two replicas on GPU 0"):
        Placement(np.array([[0, 0, 1, 2, 3, 4]]), 5, 2)


def test_cluster_parse():
    c = Cluster.parse("4x2")
    assert c.world_size == 8 and c.node_of(5) == 2 and c.spec() == "4x2"
    with pytest.raises(ValueError, match="expected NODESxGPUS"):
        Cluster.parse("four")


def test_plan_json_round_trip(tmp_path):
    c = Cluster.parse("2x2")
    plan = Plan(Placement.linear(3, 8, 4), c, homes={10: 3, 11: 0}, strategy="linear", plan_seconds=0.5)
    f = plan.save(tmp_path / "p.json")
    back = Plan.load(f)
    np.testing.assert_array_equal(back.placement.phy2log, plan.placement.phy2log)
    assert back.homes == {10: 3, 11: 0} and back.cluster == c
    # unlisted requests go round-robin by first appearance
    assert back.home_of(np.array([10, 5, 5, 7, 11, 9])).tolist() == [3, 1, 1, 2, 0, 0]
    with pytest.raises(ValueError, match="placement is for 4 GPUs but cluster 4x2 has 8"):
        Plan(Placement.linear(1, 8, 4), Cluster.parse("4x2"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        Plan.load(tmp_path / "bad.json")
