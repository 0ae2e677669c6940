"""The README's main job: ``moeplace demo`` runs end to end on the bundled default trace."""

from __future__ import annotations

import json

import pytest

from moeplace.cli import main
from moeplace.data import default_trace_path
from moeplace.placement import Plan
from moeplace.trace import trace_info


def test_default_trace_is_the_reference_model_with_four_domains():
    info = trace_info(default_trace_path())
    assert not info["synthetic"] and info["complete"]
    assert set(info["domains"]) == {"code", "math", "chat", "general"}
    assert info["num_tokens"]["prefill"] > 0 and info["num_tokens"]["decode"] > 0


def test_demo_writes_every_report(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = main(["demo", "--out", str(out), "--strategies", "linear,eplb,activation-clusters",
               "--export-strategy", "eplb", "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "[4/4]" in printed and "activation-clusters" in printed
    analysis = json.loads((out / "analysis.json").read_text())
    assert len(analysis["imbalance"]["max_over_mean"]) == 8
    cmp = json.loads((out / "compare.json").read_text())
    assert set(cmp["strategies"]) == {"linear", "eplb", "activation-clusters"}
    assert cmp["strategies"]["linear"]["inter_node_bytes_vs_linear"] == 1.0
    assert (out / "report.html").read_text().startswith("<!DOCTYPE html>")
    plan = Plan.load(out / "eplb.plan.json")
    assert plan.cluster.spec() == "4x2" and plan.placement.num_slots == 40
    sglang = json.loads((out / "eplb.sglang.json").read_text())
    assert len(sglang["physical_to_logical_map"]) == 8


def test_demo_bad_flag_is_a_clear_error(tmp_path, capsys):
    rc = main(["demo", "--out", str(tmp_path), "--cluster", "four", "--quiet"])
    assert rc == 2
    assert "expected NODESxGPUS" in capsys.readouterr().err


def test_every_command_help_has_an_example(capsys):
    import argparse

    from moeplace.cli import build_parser

    def walk(parser: argparse.ArgumentParser, path: list[str]):
        yield path, parser
        for act in parser._actions:
            if isinstance(act, argparse._SubParsersAction):
                for name, sub in act.choices.items():
                    yield from walk(sub, path + [name])

    seen = 0
    for path, _parser in walk(build_parser(), []):
        assert main(path + ["--help"]) == 0
        text = capsys.readouterr().out
        assert "example" in text.lower(), f"'moeplace {' '.join(path)} --help' shows no example"
        seen += 1
    assert seen >= 15


def test_demo_takes_the_deployment_group(tmp_path, capsys):
    """The demo's cluster, hardware, hidden size and batch sizes come from the deployment option group."""
    from moeplace.deploy import parse_cluster
    from moeplace.evaluate import compare
    from moeplace.trace import read_trace

    out = tmp_path / "demo"
    rc = main(["demo", "--out", str(out), "--strategies", "linear,eplb", "--export-strategy", "eplb", "--quiet",
               "--cluster", "2", "--cluster-preset", "h200-8", "--redundant", "16", "--hidden-size", "256",
               "--decode-batch", "64"])
    assert rc == 0
    assert "(2x8, 16 redundant slots per layer)" in capsys.readouterr().out
    cluster = parse_cluster("2", "h200-8")
    cmp = json.loads((out / "compare.json").read_text())
    assert cmp["cluster_hardware"] == cluster.to_json()
    assert Plan.load(out / "eplb.plan.json").cluster == cluster
    base = compare(read_trace(default_trace_path()), cluster, 16, ["linear"], arrival="mixed")  # the trace's 128
    got, ref = cmp["strategies"]["linear"]["inter_node_bytes"], base["strategies"]["linear"]["inter_node_bytes"]
    assert got == pytest.approx(2 * ref, rel=0.02)


def test_headline_sentence_says_when_noise_decides():
    from moeplace.demo import in_users_terms

    cmp = {"strategies": {"joint": {"phases": {
        "prefill": {"ratio_to_baseline": 0.95, "ci95": [0.93, 0.97], "decided": True},
        "decode": {"ratio_to_baseline": 1.001, "ci95": [0.99, 1.01], "decided": False}}}},
        "baseline": {"prefill": "eplb/balanced", "decode": "eplb/balanced"}, "split_seeds": [0, 1, 2, 3, 4],
        "held_out_requests": 250, "arrival": "mixed"}
    s = in_users_terms(cmp, 2, 8, "links", 128)
    assert "5.0% faster for prefill (0.950x [0.930, 0.970])" in s
    assert "not told apart from it for decode" in s and "strongest EPLB (eplb/balanced)" in s and "5 random" in s
