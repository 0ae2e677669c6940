"""``moeplace plan``, ``compare`` and ``export`` end to end on tiny inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeplace.cli import main
from moeplace.evaluate.compare import frontier_figure
from moeplace.placement import Plan
from moeplace.plan import STRATEGIES
from moeplace.trace import TraceMeta, TraceWriter


def test_list_shows_exactly_the_registry(capsys):
    assert main(["plan", "--list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    names = [line.split()[0] for line in lines if not line.startswith(" ")]
    assert names == list(STRATEGIES)
    # under each strategy, one indented line per declared parameter that has a flag (the time model's come from
    # the deployment group, named on one line)
    joint = lines[lines.index(next(x for x in lines if x.startswith("joint "))) + 1:]
    joint = joint[:next((i for i, x in enumerate(joint) if not x.startswith(" ")), len(joint))]
    assert any("--balance-floor" in x for x in joint) and any("(deployment group)" in x for x in joint)


def test_plan_from_load_json_and_logical_count(tmp_path):
    load = np.random.default_rng(0).integers(1, 100, (3, 8)).tolist()
    (tmp_path / "a.json").write_text(json.dumps(load))
    (tmp_path / "b.json").write_text(json.dumps({"logical_count": [load, load]}))
    for name in ("a", "b"):
        out = tmp_path / f"{name}.plan.json"
        assert main(["plan", "--load", str(tmp_path / f"{name}.json"), "--strategy", "eplb", "--cluster", "2x2",
                     "--redundant", "4", "--out", str(out)]) == 0
        plan = Plan.load(out)
        assert plan.placement.phy2log.shape == (3, 12) and plan.strategy == "eplb"


def test_plan_errors_are_clear(tmp_path, capsys):
    (tmp_path / "l.json").write_text(json.dumps([[1, 2, 3, 4]]))
    rc = main(["plan", "--load", str(tmp_path / "l.json"), "--strategy", "joint", "--cluster", "2x1",
               "--out", str(tmp_path / "p.json")])
    assert rc == 2 and "needs per-token routing" in capsys.readouterr().err
    rc = main(["plan", "--load", str(tmp_path / "l.json"), "--strategy", "eplb", "--cluster", "2x1",
               "--redundant", "1", "--out", str(tmp_path / "p.json")])
    assert rc == 2 and "num_redundant=1" in capsys.readouterr().err


def test_counts_only_trace_plans_with_eplb(tmp_path):
    meta = TraceMeta(model="m", num_layers=2, num_experts=4, top_k=1, kind="counts")
    with TraceWriter(tmp_path / "c.trace", meta) as w:
        w.add_counts(["g"], domain=["chat"], phase=[1], num_tokens=[10.0], counts=np.ones((1, 2, 4)))
    assert main(["plan", str(tmp_path / "c.trace"), "--strategy", "eplb", "--cluster", "2x1",
                 "--out", str(tmp_path / "p.json")]) == 0


def test_compare_and_export(small_trace, tmp_path, capsys):
    path, _, _ = small_trace
    out = tmp_path / "cmp.json"
    rc = main(["compare", str(path), "--cluster", "2x1", "--redundant", "0", "--holdout", "0.5", "--quiet",
               "--strategies", "linear,eplb,activation-clusters,joint", "--search-evals", "300",
               "--prefix-tokens", "0", "--sweep-floor", "0.5,0.9", "--plot", str(tmp_path / "f.png"),
               "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    res = json.loads(out.read_text())
    for name in ("linear", "eplb", "activation-clusters", "joint"):
        row = res["strategies"][name]
        for key in ("inter_node_bytes_vs_linear", "balancedness", "imbalance_ratio", "max_per_peer_bytes",
                    "layer_time_s", "plan_seconds"):
            assert key in row
        # the key simulate and run-ep use for the same quantity: one layer on one micro-batch, µs, per phase
        us = row["layer_time_us_per_microbatch"]
        assert set(us) == {"prefill", "decode"}
        for ph in ("prefill", "decode"):
            sec = row[f"{ph}_layer_time_s"]
            assert us[ph] is None if sec is None else us[ph] == pytest.approx(sec * 1e6)
    assert abs(res["strategies"]["linear"]["inter_node_bytes_vs_linear"] - 1.0) < 1e-9
    assert len(res["frontier"]["joint"]) == 3 and (tmp_path / "f.png").exists()
    assert f"wrote {tmp_path / 'f.png'} (frontier plot)" in capsys.readouterr().out
    fig = frontier_figure(res["frontier"], "Balance-floor frontier: t")
    ax = fig.axes[0]
    assert ax.get_title() == "Balance-floor frontier: t" and "lower is better" in ax.get_ylabel()
    assert "higher is better" in ax.get_xlabel() and [t.get_text() for t in ax.texts] == ["better: lower right"]
    # one entry per strategy (its compare row) and one for joint's floor sweep, drawn dashed
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [*res["frontier"], "joint at floors 0.5, 0.9"]
    plan = tmp_path / "plan.json"
    assert main(["plan", str(path), "--strategy", "eplb", "--cluster", "2x1", "--out", str(plan)]) == 0
    # this trace records no moe_layer_map: the row count is unknown until the user says every layer is MoE
    assert main(["export", str(plan), "--format", "sglang", "--trace", str(path), "--out",
                 str(tmp_path / "s.json")]) == 2
    assert "--num-decoder-layers 3" in capsys.readouterr().err and not (tmp_path / "s.json").exists()
    assert main(["export", str(plan), "--format", "sglang", "--trace", str(path), "--num-decoder-layers", "3",
                 "--out", str(tmp_path / "s.json")]) == 0
    assert len(json.loads((tmp_path / "s.json").read_text())["physical_to_logical_map"]) == 3
