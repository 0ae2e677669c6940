"""The synthetic workload generator: asked statistics come back when measured, output is labelled synthetic."""

from __future__ import annotations

import numpy as np
import pytest

from moeplace.cli import main
from moeplace.deploy import MODEL_PRESETS, find_model, get_model, parse_cluster
from moeplace.simulate.synth import SynthConfig, generate_batches
from moeplace.trace.reader import read_meta, read_trace


def collect(preset, cfg):
    meta, it = generate_batches(preset, cfg)
    parts = [b for _, b in it]
    return meta, [np.concatenate([p[i] for p in parts]) for i in range(4)]


# independent measures (the test does not reuse the generator's own)
def skew(ids, E):
    out = []
    for j in range(ids.shape[1]):
        load = np.bincount(ids[:, j].ravel(), minlength=E)
        out.append(load.max() / load.mean())
    return float(np.mean(out))


def overlap(ids, rid, pos, ph):
    vals = []
    for t in range(1, len(rid)):
        if rid[t] == rid[t - 1] and ph[t] == 1 and ph[t - 1] == 1 and pos[t] == pos[t - 1] + 1:
            for j in range(ids.shape[1]):
                vals.append(len(set(ids[t, j].tolist()) & set(ids[t - 1, j].tolist())) / ids.shape[2])
    return float(np.mean(vals))


def pd_corr(ids, rid, ph, E):
    vals = []
    for r in np.unique(rid):
        for j in range(ids.shape[1]):
            a = np.bincount(ids[(rid == r) & (ph == 0), j].ravel(), minlength=E)
            b = np.bincount(ids[(rid == r) & (ph == 1), j].ravel(), minlength=E)
            if a.std() > 0 and b.std() > 0:
                vals.append(np.corrcoef(a, b)[0, 1])
    return float(np.mean(vals))


def test_asked_values_come_back():
    cfg = SynthConfig(num_requests=120, prompt_len=64, gen_len=40, load_skew=2.5, prefill_decode_corr=0.6,
                      temporal_overlap=0.5, seed=3)
    meta, (rid, pos, ph, ids) = collect("olmoe-1b-7b", cfg)
    assert meta.synthetic and "synthetic" in meta.source
    assert ids.shape[1:] == (16, 8)
    assert (np.sort(ids, -1)[..., 1:] != np.sort(ids, -1)[..., :-1]).all()  # distinct experts per token-layer
    assert skew(ids, 64) == pytest.approx(2.5, abs=0.25)
    assert overlap(ids[::1], rid, pos, ph) == pytest.approx(0.5, abs=0.06)
    assert pd_corr(ids, rid, ph, 64) == pytest.approx(0.6, abs=0.1)


def test_foe_structure_and_cli(tmp_path):
    out = tmp_path / "s.trace"
    rc = main(["synth", "--preset", "gpt-oss-20b", "--requests", "6", "--prompt-len", "8", "--gen-len", "5",
               "--foe-groups", "4", "--seed", "1", "--quiet", str(out)])
    assert rc == 0
    meta = read_meta(out)
    assert meta.synthetic and meta.source.startswith("synthetic") and meta.model == "openai/gpt-oss-20b"
    assert (meta.num_layers, meta.num_experts, meta.top_k, meta.hidden_size) == (24, 32, 4, 2880)
    tr = read_trace(out)
    grp = tr.tokens.expert_ids // 8  # 4 groups of 8 experts, one expert of each per token
    assert (np.sort(grp, -1) == np.arange(4)).all()
    assert set(tr.requests.domain.tolist()) <= {"code", "math", "chat", "general"}


def test_presets_match_published_configs():
    ds = get_model("deepseek-ai/DeepSeek-V3")
    assert (ds.num_layers, ds.num_experts, ds.top_k, ds.hidden_size, ds.n_group, ds.topk_group) == \
        (58, 256, 8, 7168, 8, 4)
    assert ds.moe_layer_map[0] == 3 and len(ds.moe_layer_map) == 58
    assert get_model("llama4-maverick").moe_layer_map == tuple(range(1, 48, 2))
    for p in MODEL_PRESETS.values():
        assert len(p.moe_layer_map) == p.num_layers and max(p.moe_layer_map) < p.num_model_layers
    assert find_model("/models/openai/gpt-oss-120b").name == "gpt-oss-120b"
    assert find_model("unknown-model") is None
    c = parse_cluster("4", "h200-8")
    assert (c.world_size, c.intra_bw, c.inter_bw) == (32, 450e9, 50e9)
    with pytest.raises(ValueError, match="preset"):
        get_model("nope")
