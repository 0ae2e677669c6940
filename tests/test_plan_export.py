"""Engine exports round-trip: SGLang init-expert-location (all decoder layers) and vLLM's EPLB state."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeplace.placement import Cluster, Placement, Plan
from moeplace.plan.eplb import rebalance
from moeplace.plan.export import export_plan, from_sglang, from_vllm, to_sglang, to_vllm


@pytest.fixture
def placement() -> Placement:
    rng = np.random.default_rng(0)
    return Placement(rebalance(rng.pareto(1.0, (4, 16)) * 10, 24, 1, 2, 4), 16, 4)


def test_sglang_covers_dense_layers_and_round_trips(placement, tmp_path):
    lm = [1, 2, 4, 5]  # decoder layers 0 and 3 are dense
    d = to_sglang(placement, lm, num_decoder_layers=7)
    assert list(d) == ["physical_to_logical_map"]  # SGLang passes the object as keyword arguments
    rows = np.asarray(d["physical_to_logical_map"])
    assert rows.shape == (7, 24)
    np.testing.assert_array_equal(rows[[0, 3, 6]], np.tile(np.arange(24) % 16, (3, 1)))
    back = from_sglang(json.loads(json.dumps(d)), 16, 4, lm)
    np.testing.assert_array_equal(back.phy2log, placement.phy2log)
    with pytest.raises(ValueError, match="moe_layer_map has 3 entries"):
        to_sglang(placement, [0, 1, 2])


def test_vllm_round_trip_and_consistency(placement):
    d = json.loads(json.dumps(to_vllm(placement)))
    assert np.asarray(d["logical_to_physical_map"]).shape == (4, 16, 9)  # R + 1 = 9 columns
    back = from_vllm(d)
    np.testing.assert_array_equal(back.phy2log, placement.phy2log)
    d["logical_replica_count"][0][0] += 1
    with pytest.raises(ValueError, match="logical_replica_count disagrees"):
        from_vllm(d)


def test_export_plan_files(placement, tmp_path):
    plan = Plan(placement, Cluster(2, 2), strategy="eplb")
    for fmt in ("sglang", "vllm"):
        p = export_plan(plan, fmt, tmp_path / f"{fmt}.json")
        assert json.loads(p.read_text())["physical_to_logical_map"]
    with pytest.raises(ValueError, match="export format 'x'"):
        export_plan(plan, "x", tmp_path / "x.json")
