"""The deployment option group: one declaration on every command that prices time, one --cluster parser, declared
strategy parameters refused when inapplicable, and the plan's cost_model recording what it was optimised for."""

from __future__ import annotations

import json
import re

import pytest

from moeplace.cli import build_parser, main
from moeplace.cli.options import DEPLOYMENT_FLAGS
from moeplace.deploy import Deployment, parse_cluster
from moeplace.placement import CostModel, Plan
from moeplace.plan import make_plan
from moeplace.plan.base import workload_from_trace
from moeplace.simulate import BatchConfig, CostConfig

TRACE = "src/moeplace/data/reference-default.trace"
COMMANDS = ("plan", "compare", "simulate", "operate", "demo")  # run-ep: see the report


def _flags(cmd: str) -> dict[str, tuple]:
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[cmd]
    return {o: (a.default, tuple(a.choices or ())) for a in sub._actions for o in a.option_strings
            if o in DEPLOYMENT_FLAGS}


@pytest.mark.parametrize("cmd", COMMANDS)
def test_group_identical_on_every_command(cmd):
    assert set(_flags(cmd)) == set(DEPLOYMENT_FLAGS)
    got, want = _flags(cmd), _flags("plan")
    if cmd == "demo":  # the demo runs without flags: its cluster defaults to 4x2, every other default is shared
        assert got.pop("--cluster")[0] == "4x2"
        want.pop("--cluster")
    assert got == want


def test_defaults_are_the_library_defaults():
    d, c, b = Deployment(parse_cluster("1x1")), CostConfig(), BatchConfig()
    assert (d.dispatch_bytes, d.combine_bytes, d.mode, d.overlap) == (c.dispatch_bytes, c.combine_bytes, c.mode,
                                                                       c.overlap)
    assert (d.decode_batch, d.prefill_tokens) == (b.decode_batch, b.prefill_tokens)


def test_cluster_forms():
    assert parse_cluster("4x2").spec() == "4x2"
    h = parse_cluster("h200-8")
    assert h.spec() == "1x8" and h.hbm_bw == 4800e9
    assert parse_cluster("4", "h200-8") == parse_cluster("4x8", "h200-8")
    for bad in ("４x２", "4x２", "4"):
        with pytest.raises(ValueError, match="ASCII"):
            parse_cluster(bad)


def test_full_width_refused_on_the_cli(capsys):
    assert main(["plan", TRACE, "--strategy", "eplb", "--cluster", "４x２", "--out", "/tmp/never.json"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_inapplicable_strategy_flag_is_one_line(capsys, tmp_path):
    rc = main(["plan", TRACE, "--strategy", "eplb", "--balance-floor", "0.9", "--cluster", "4x2",
               "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--balance-floor" in err[0] and "eplb" in err[0]


def test_make_plan_refuses_unknown_parameter():
    work, _ = workload_from_trace(TRACE, 8)
    with pytest.raises(ValueError, match=r"'eplb'.*'balance_floor'|'balance_floor'.*'eplb'"):
        make_plan("eplb", work, parse_cluster("4x2"), 8, balance_floor=0.9)
    with pytest.raises(ValueError, match="bogus"):
        make_plan("joint", work, parse_cluster("4x2"), 8, bogus=1)


def test_cost_model_round_trips():
    cm = CostModel("layer_time", "balanced", "auto", 7168, 1.0, 2.0, overlap=True, decode_batch=64,
                   prefill_tokens=4096)
    plan_json = {"objective": "layer_time"}
    assert CostModel(**{**CostModel("x").__dict__, **plan_json}).to_json()["objective"] == "layer_time"
    from moeplace import schema

    back = CostModel(**schema.validate(schema.CostModelJSON, json.loads(json.dumps(cm.to_json())), "cm").model_dump())
    assert back == cm
    default = CostModel("layer_time", hidden_size=128)
    assert "decode_batch" not in default.to_json()  # plans made with the defaults read as before


def test_plan_records_hidden_size_from_the_command_line(tmp_path, capsys):
    out = {}
    for h in (128, 4096):
        p = tmp_path / f"p{h}.json"
        assert main(["plan", TRACE, "--strategy", "joint", "--cluster", "4", "--cluster-preset", "h200-8",
                     "--redundant", "0", "--hidden-size", str(h), "--decode-batch", "64", "--out", str(p)]) == 0
        assert "cost model:" in capsys.readouterr().out
        out[h] = Plan.load(p)
    a, b = out[128].cost_model, out[4096].cost_model
    assert (a.hidden_size, b.hidden_size, a.decode_batch) == (128, 4096, 64)
    assert out[128].cluster == parse_cluster("4", "h200-8")


def test_sweep_floor_refused_without_a_floor(capsys):
    rc = main(["compare", TRACE, "--cluster", "4x2", "--strategies", "linear,eplb", "--sweep-floor", "0.9,0.95"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--sweep-floor" in err[0]


def test_sweep_floor_points_differ_and_are_drawn(tmp_path, capsys):
    """--sweep-floor re-plans joint under the bytes objective at each floor: the points differ in the JSON, and the
    HTML draws the dashed sweep its caption names (through the re-planned points only)."""
    js, page = tmp_path / "c.json", tmp_path / "c.html"
    assert main(["compare", TRACE, "--cluster", "4x2", "--redundant", "8", "--strategies", "eplb,joint",
                 "--sweep-floor", "0.85,0.97", "--search-evals", "200", "--quiet", "--json", str(js),
                 "--html", str(page)]) == 0
    capsys.readouterr()
    pts = json.loads(js.read_text())["frontier"]["joint"]
    assert [p["balance_floor"] for p in pts] == [None, 0.85, 0.97]
    assert all(p["objective"] == "bytes" for p in pts[1:])
    seen = {(round(p["balancedness"], 6), round(p["inter_node_bytes_vs_linear"], 6)) for p in pts}
    assert len(seen) == 3, pts
    text = page.read_text()
    sweep = re.findall(r'<g class="sweep" data-strategy="joint">(.*?)</g>', text, flags=re.S)
    assert len(sweep) == 1 and sweep[0].count("<polyline") == 1 and 'stroke-dasharray="4 3"' in sweep[0]
    assert sweep[0].count('class="sweep-point"') == 2  # the floors, not joint's compare row
    assert "joint re-planned at balance floors 0.85, 0.97" in text

    from moeplace.evaluate.html import render_compare_html

    no_sweep = render_compare_html({k: v for k, v in json.loads(js.read_text()).items() if k != "frontier"})
    assert 'class="sweep"' not in no_sweep and "re-planned at balance floors" not in no_sweep
