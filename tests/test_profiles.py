"""Deployment profiles: every entry names known hardware and a known model, and its derived sizes follow from the
per-GPU numbers (independent arithmetic written out here)."""

from __future__ import annotations

import pytest

from moeplace.deploy.hardware import CLUSTER_PRESETS
from moeplace.deploy.models import MODEL_PRESETS
from moeplace.deploy.profiles import PROFILES, PhaseProfile, get_profile


def test_published_deepseek_profile_is_ep32_prefill_and_ep128_decode():
    p = get_profile("deepseek-v3-published")
    assert p.world("prefill") == 32 and p.world("decode") == 128
    assert p.prefill_tokens() == 16384 * 32 and p.decode_running() == 128 * 128
    assert (p.hidden_size, p.moe_intermediate_size) == (MODEL_PRESETS["deepseek-v3"].hidden_size,
                                                         MODEL_PRESETS["deepseek-v3"].moe_intermediate_size)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_is_sourced_and_consistent(name):
    p = PROFILES[name]
    assert p.sources and all("20" in s for s in p.sources)  # each source carries a date
    for ph in ("prefill", "decode"):
        pp = p.phase(ph)
        assert pp.hardware in CLUSTER_PRESETS
        assert p.world(ph) == pp.nodes * CLUSTER_PRESETS[pp.hardware].gpus_per_node
    j = p.to_json()
    assert j["prefill_tokens_per_microbatch"] == p.prefill.per_gpu * p.world("prefill")


def test_unknown_profile_and_bad_phase_are_refused():
    with pytest.raises(ValueError, match="unknown profile"):
        get_profile("nope")
    with pytest.raises(ValueError, match="positive integer"):
        PhaseProfile(0, "h200-8", 1, "deepep-ll")


# ------------------------------------------------------------------------------------------ the CLI

def test_profiles_command_lists_and_shows(capsys):
    from moeplace.cli import main

    assert main(["profiles"]) == 0
    out = capsys.readouterr().out
    for name in PROFILES:
        assert name in out
    assert main(["profiles", "deepseek-v3-published"]) == 0
    out = capsys.readouterr().out
    assert "EP32" in out and "EP128" in out and "sources:" in out and "16,384 prompt tokens per GPU" in out
    assert main(["profiles", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown profile 'nope'" in err and err.count("\n") == 1


def test_simulate_with_a_profile_and_an_override(capsys, tmp_path):
    import json

    from moeplace.cli import main

    trace = "src/moeplace/data/reference-fg.trace"
    out = tmp_path / "s.json"
    # --cluster 2 overrides the node count only: 2 x 8 H200, decode running 128 per GPU -> 2,048
    assert main(["simulate", trace, "--profile", "vllm-gpt-oss-ep32", "--cluster", "2", "--redundant", "16",
                 "--json", str(out)]) == 0
    said = capsys.readouterr().out
    assert "on 2x8" in said and "profile vllm-gpt-oss-ep32" in said
    j = json.loads(out.read_text())
    assert j["batching"]["decode_running"] == 2048 and j["batching"]["prefill_tokens"] == 8192 * 16
    assert j["cost"]["hidden_size"] == 2880 and j["cost"]["intermediate_size"] == 2880
    # a profile whose phases run on different clusters needs a pool
    assert main(["simulate", trace, "--profile", "deepseek-v3-published", "--redundant", "8"]) == 2
    err = capsys.readouterr().err
    assert "--profile-phase" in err and err.count("\n") == 1
    assert main(["simulate", trace, "--profile-phase", "decode", "--cluster", "1x8"]) == 2
    assert "--profile-phase needs --profile" in capsys.readouterr().err


def test_operate_takes_a_profile_and_its_model_sizes(tmp_path, capsys):
    import json

    from moeplace.cli import main

    # the bundled default trace has no model preset of its own: the profile's (deepseek-v3) prices its experts
    args = ["operate", "src/moeplace/data/reference-default.trace", "--profile", "sglang-h200-ep16",
            "--redundant", "16", "--window-requests", "128", "--policy", "static", "--json", str(tmp_path / "o.json")]
    assert main(args) == 0
    j = json.loads((tmp_path / "o.json").read_text())
    assert "2x8" in json.dumps(j) and "deepseek-v3" in json.dumps(j)
    capsys.readouterr()
