"""Issue 41's loose ends: a cluster preset's links on any GPUs per node (said), synth's estimate and its
--max-requests guard, and operate's refusal of a model preset of another shape than the trace."""

from __future__ import annotations

import pytest

from moeplace.cli import main
from moeplace.deploy import cluster_note, get_cluster_preset, parse_cluster

TRACE = "src/moeplace/data/reference-default.trace"  # 32 experts, top-4


def test_preset_links_on_any_gpus_per_node():
    h200 = get_cluster_preset("h200-8")
    c = parse_cluster("4x2", "h200-8")
    assert (c.num_nodes, c.gpus_per_node) == (4, 2)
    assert (c.intra_bw, c.inter_bw, c.hbm_bw) == (h200.hardware.intra_bw, h200.hardware.inter_bw,
                                                  h200.hardware.hbm_bw)
    assert parse_cluster("2x8", "h200-8") == h200.cluster(2)
    assert cluster_note("2x8", "h200-8") is None and cluster_note("4", "h200-8") is None
    note = cluster_note("4x2", "h200-8")
    assert "4 nodes of 2 GPUs" in note and "h200-8" in note and "8 GPUs per node" in note


def test_preset_shape_is_said_in_the_output(capsys):
    assert main(["simulate", TRACE, "--cluster", "4x2", "--cluster-preset", "h200-8"]) == 0
    err = capsys.readouterr().err
    assert "note: --cluster 4x2 --cluster-preset h200-8: 4 nodes of 2 GPUs with h200-8's links" in err


def test_synth_says_its_size_before_writing(tmp_path, capsys):
    assert main(["synth", "--preset", "gpt-oss-20b", "--requests", "8", "--prompt-len", "16", "--gen-len", "4",
                 "--quiet", str(tmp_path / "s.trace")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("synth: 8 requests, about 160 tokens,") and "to write" in out[0]
    assert out[1].startswith("wrote SYNTHETIC workload")


@pytest.mark.parametrize("argv,mention", [
    (["--requests", "4194304", "--prompt-len", "1", "--gen-len", "0"], "more than --max-requests 1,048,576"),
    (["--requests", "9", "--max-requests", "8"], "more than --max-requests 8"),
])
def test_synth_refuses_more_than_max_requests_before_any_work(tmp_path, capsys, argv, mention):
    out = tmp_path / "big.trace"
    assert main(["synth", "--preset", "deepseek-v3", *argv, str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and mention in err[0] and "on disk" in err[0] and "to write" in err[0]
    assert not out.exists()


def test_operate_refuses_a_model_preset_of_another_expert_count(capsys):
    assert main(["operate", TRACE, "--cluster", "2x2", "--model-preset", "deepseek-v3", "--policy", "static"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "256 experts" in err[0] and "32 experts" in err[0] and TRACE in err[0]


def test_operate_prices_another_shape_when_meant(capsys):
    assert main(["operate", TRACE, "--cluster", "2x2", "--model-preset", "deepseek-v3", "--model-sizes-meant",
                 "--policy", "static"]) == 0
    assert capsys.readouterr().out.startswith("note: --model-preset deepseek-v3 has 256 experts")
