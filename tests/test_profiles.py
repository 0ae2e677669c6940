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
