"""Engine exports round-trip: SGLang init-expert-location (all decoder layers, rows known from the plan's model
layout or refused) and vLLM's EPLB mapping; plans carry the model layout through their JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from moeplace.cli import main
from moeplace.placement import Cluster, ModelLayers, Placement, Plan
from moeplace.plan.eplb import rebalance
from moeplace.plan.export import (
    EXPORTERS,
    export_all,
    export_plan,
    from_sglang,
    from_vllm,
    resolve_layers,
    to_sglang,
    to_vllm,
)
from moeplace.schema import SchemaError


@pytest.fixture
def placement() -> Placement:
    rng = np.random.default_rng(0)
    return Placement(rebalance(rng.pareto(1.0, (4, 16)) * 10, 24, 1, 2, 4), 16, 4)


def test_sglang_covers_dense_layers_and_round_trips(placement, tmp_path):
    lm = [1, 2, 4, 5]  # decoder layers 0 and 3 are dense
    d = to_sglang(placement, ModelLayers(tuple(lm), 7))
    assert list(d) == ["physical_to_logical_map"]  # SGLang passes the object as keyword arguments
    rows = np.asarray(d["physical_to_logical_map"])
    assert rows.shape == (7, 24)
    np.testing.assert_array_equal(rows[[0, 3, 6]], np.tile(np.arange(24) % 16, (3, 1)))
    back = from_sglang(json.loads(json.dumps(d)), 16, 4, lm)
    np.testing.assert_array_equal(back.phy2log, placement.phy2log)
    with pytest.raises(ValueError, match="moe_layer_map has 3 entries"):
        to_sglang(placement, ModelLayers((0, 1, 2), 3))


def test_vllm_export_is_the_physical_map_and_shape_facts(placement):
    d = json.loads(json.dumps(to_vllm(placement)))
    assert set(d) == {"format", "num_moe_layers", "num_logical_experts", "num_redundant_experts", "ep_size",
                      "physical_to_logical_map"}
    assert (d["num_moe_layers"], d["num_logical_experts"], d["num_redundant_experts"], d["ep_size"]) == (4, 16, 8, 4)
    np.testing.assert_array_equal(from_vllm(d).phy2log, placement.phy2log)
    with pytest.raises(SchemaError, match="num_moe_layers=5 but physical_to_logical_map has 4 rows"):
        from_vllm(dict(d, num_moe_layers=5))


def test_vllm_older_export_with_derived_maps_is_checked(placement):
    """Exports from before this change also carry logical_to_physical_map [L][E][R+1] and logical_replica_count."""
    E, P = 16, 24
    d = to_vllm(placement)
    del d["num_logical_experts"], d["num_moe_layers"]
    l2p = [[[p for p in range(P) if row[p] == e] for e in range(E)] for row in d["physical_to_logical_map"]]
    d["logical_to_physical_map"] = [[r + [-1] * (P - E + 1 - len(r)) for r in layer] for layer in l2p]
    d["logical_replica_count"] = [[len(r) for r in layer] for layer in l2p]
    np.testing.assert_array_equal(from_vllm(json.loads(json.dumps(d))).phy2log, placement.phy2log)
    d["logical_replica_count"][0][0] += 1
    with pytest.raises(ValueError, match="logical_replica_count disagrees"):
        from_vllm(d)


def test_export_plan_files(placement, tmp_path):
    plan = Plan(placement, Cluster(2, 2), strategy="eplb", model_layers=ModelLayers((0, 1, 2, 3), 4))
    for fmt in ("sglang", "vllm"):
        p = export_plan(plan, fmt, tmp_path / f"{fmt}.json")
        assert json.loads(p.read_text())["physical_to_logical_map"]
    with pytest.raises(ValueError, match="export format 'x'"):
        export_plan(plan, "x", tmp_path / "x.json")


def test_sglang_rows_come_from_the_plan_deepseek_v3(tmp_path):
    """DeepSeek-V3: 61 decoder layers, the first 3 dense -> 58 MoE layers; SGLang indexes rows by layer id."""
    rng = np.random.default_rng(3)
    E, W, R = 32, 8, 8
    pl = Placement(rebalance(rng.pareto(1.0, (58, E)) * 10, E + R, 1, 1, W), E, W)
    plan = Plan(pl, Cluster(2, 4), strategy="eplb", model_layers=ModelLayers(tuple(range(3, 61)), 61))
    again = Plan.load(plan.save(tmp_path / "plan.json"))
    assert again.model_layers == plan.model_layers
    rows = np.asarray(json.loads(export_plan(again, "sglang", tmp_path / "s.json").read_text())
                      ["physical_to_logical_map"])
    assert rows.shape == (61, E + R)
    np.testing.assert_array_equal(rows[3:], pl.phy2log)  # row = the model's own layer id
    np.testing.assert_array_equal(rows[:3], np.tile(np.arange(E + R) % E, (3, 1)))


def test_export_without_a_known_layout_is_refused(placement, tmp_path):
    plan = Plan(placement, Cluster(2, 2), strategy="eplb")  # e.g. planned from a load file
    assert plan.to_json()["model_layers"] is None
    with pytest.raises(ValueError, match="pass the trace .*--num-decoder-layers 4"):
        export_plan(plan, "sglang", tmp_path / "s.json")
    assert not (tmp_path / "s.json").exists()
    d = json.loads(export_plan(plan, "sglang", tmp_path / "s.json", num_decoder_layers=4).read_text())
    np.testing.assert_array_equal(d["physical_to_logical_map"], placement.phy2log)  # all 4 layers are MoE
    with pytest.raises(ValueError, match="not known"):
        export_plan(plan, "sglang", tmp_path / "s.json", num_decoder_layers=6)
    # a recorded layout wins, and a contradicting count is refused
    lay = ModelLayers((1, 2, 4, 5), 7)
    assert resolve_layers(4, recorded=lay) == lay
    with pytest.raises(ValueError, match="records 7 decoder layers"):
        resolve_layers(4, num_decoder_layers=6, recorded=lay)


def test_model_layers_validation_and_json(placement):
    with pytest.raises(ValueError, match="needs more"):
        ModelLayers((0, 5), 5)
    with pytest.raises(ValueError, match="distinct"):
        ModelLayers((1, 1), 5)
    with pytest.raises(ValueError, match="maps 3 MoE layers but the placement has 4"):
        Plan(placement, Cluster(2, 2), model_layers=ModelLayers((0, 1, 2), 3))
    d = Plan(placement, Cluster(2, 2), model_layers=ModelLayers((1, 2, 4, 5), 7)).to_json()
    assert d["model_layers"] == {"moe_layer_map": [1, 2, 4, 5], "num_decoder_layers": 7}
    bad = json.loads(json.dumps(d))
    bad["model_layers"]["num_decoder_layers"] = 5
    with pytest.raises(SchemaError, match="plan: model_layers: num_decoder_layers=5"):
        Plan.from_json(bad)
    del bad["model_layers"]  # v2 plans written before the field existed still load
    assert Plan.from_json(bad).model_layers is None


def test_cli_plan_records_the_trace_layout_and_export_needs_no_trace(tmp_path, capsys):
    from test_importers import _vllm_requests, _write_vllm_jsonl

    from moeplace.trace.importers import import_vllm_routed

    trace = import_vllm_routed(_write_vllm_jsonl(tmp_path / "r.jsonl", _vllm_requests()), tmp_path / "t.trace",
                               num_experts=6)  # 3 model layers, layer 0 dense
    assert main(["plan", str(trace), "--strategy", "linear", "--cluster", "1x2", "--out",
                 str(tmp_path / "plan.json")]) == 0
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.model_layers == ModelLayers((1, 2), 3)
    assert main(["export", str(tmp_path / "plan.json"), "--format", "sglang", "--out", str(tmp_path / "s.json")]) == 0
    rows = json.loads((tmp_path / "s.json").read_text())["physical_to_logical_map"]
    assert len(rows) == 3 and rows[1:] == plan.placement.phy2log.tolist()
    capsys.readouterr()


# ------------------------------------------------------------------------------------------------ registry


def test_exporters_registry_declares_parameters_and_refuses_others(placement, tmp_path):
    assert set(EXPORTERS) == {"sglang", "vllm", "grouper"}
    assert {p.name for p in EXPORTERS["sglang"].params} == {"moe_layer_map", "num_decoder_layers"}
    assert not EXPORTERS["grouper"].in_all  # only grouped plans have one: export_all leaves it out
    assert EXPORTERS["vllm"].params == ()
    assert all(callable(e.build) for e in EXPORTERS.values())  # each "module:function" resolves
    plan = Plan(placement, Cluster(2, 2), strategy="eplb", model_layers=ModelLayers((0, 1, 2, 3), 4))
    with pytest.raises(ValueError, match="export format 'vllm' has no parameter 'num_decoder_layers'"):
        export_plan(plan, "vllm", tmp_path / "v.json", num_decoder_layers=4)
    with pytest.raises(ValueError, match="parameter 'num_decoder_layers': expected an integer"):
        export_plan(plan, "sglang", tmp_path / "s.json", num_decoder_layers="4")
    # every format into one folder, each given only the facts it declares
    files = export_all(plan, tmp_path / "all", "p.", {"moe_layer_map": [0, 1, 2, 3]})
    assert [f.name for f in files] == ["p.sglang.json", "p.vllm.json"]
    for f, fmt in zip(files, ("sglang", "vllm"), strict=True):
        assert f.read_bytes() == export_plan(plan, fmt, tmp_path / f"{fmt}.json").read_bytes()


def export_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeplace", "export", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_export_refuses_a_flag_the_format_does_not_take(placement, tmp_path):
    plan = Plan(placement, Cluster(2, 2), strategy="eplb", model_layers=ModelLayers((0, 1, 2, 3), 4))
    p = str(plan.save(tmp_path / "plan.json"))
    for flag, value in (("--trace", str(tmp_path / "t.trace")), ("--num-decoder-layers", "4")):
        out = export_cli(p, "--format", "vllm", flag, value, "--out", str(tmp_path / "v.json"))
        assert out.returncode == 2, out.stderr
        err = out.stderr.strip().splitlines()
        assert len(err) == 1 and flag in err[0] and "--format vllm" in err[0], err
        assert not (tmp_path / "v.json").exists()
    out = export_cli(p, "--format", "sglang", "--num-decoder-layers", "4", "--out", str(tmp_path / "s.json"))
    assert out.returncode == 0, out.stderr
    assert len(json.loads((tmp_path / "s.json").read_text())["physical_to_logical_map"]) == 4
