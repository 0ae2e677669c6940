"""The shipped DeepSeek-V3-shaped reference model and its trace (issue 23).

The model (``src/moeplace/data/reference-ds``) and the trace (``reference-ds.trace``) are committed data, read
directly. Independent definitions written out here: an expert's group is ``id // 32`` (256 experts in 8 groups);
a request fills EP32 decode when it has its prefill and at least 32 decode tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import load_script

from moeplace.trace import DECODE, PREFILL, read_trace

REPO = Path(__file__).resolve().parents[1]
DS_DIR = REPO / "src" / "moeplace" / "data" / "reference-ds"
DS_TRACE = REPO / "src" / "moeplace" / "data" / "reference-ds.trace"


@pytest.fixture(scope="module")
def ds_trace():
    return read_trace(DS_TRACE)


def test_shipped_model_has_deepseek_v3_routing_shape_and_size():
    cfg = json.loads((DS_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (cfg["n_routed_experts"], cfg["n_group"], cfg["topk_group"], cfg["num_experts_per_tok"]) == (256, 8, 4, 8)
    assert cfg["n_shared_experts"] == 1 and cfg["first_k_dense_replace"] == 1
    assert cfg["num_hidden_layers"] - cfg["first_k_dense_replace"] >= 8
    assert cfg["routed_scaling_factor"] == 2.5 and cfg["norm_topk_prob"] is True
    assert (DS_DIR / "model.safetensors").stat().st_size <= 30e6
    m = json.loads((DS_DIR / "train_metrics.json").read_text())
    assert m["seconds_total"] <= 90 * 60
    assert m["config"]["bias_update_speed"] > 0 and m["config"]["router_aux_loss_coef"] == 0
    assert set(m["heldout_ce_saved_weights"]) == {"code", "chat", "general", "math"}
    # balancing worked: the last 100 steps are far from the collapse of the first steps (max/mean up to E/K = 32)
    assert m["max_over_mean_last_100"] < 0.25 * max(m["history"]["max_over_mean"][:50])


def test_shipped_model_loads_generates_and_keeps_its_biases():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(DS_DIR, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(DS_DIR, local_files_only=True)
    ids = tok("def add(a, b):", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 4
    bias = [m.e_score_correction_bias for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    assert len(bias) == 8 and all(b.shape == (256,) and b.abs().max() > 0 for b in bias)


def test_trace_fills_ep32_decode_at_128_requests_per_gpu_and_fits(ds_trace):
    size = sum(p.stat().st_size for p in DS_TRACE.iterdir())
    assert size <= 25e6
    m, req, tok = ds_trace.meta, ds_trace.requests, ds_trace.tokens
    assert not m.synthetic and m.complete
    assert (m.num_layers, m.num_experts, m.top_k) == (8, 256, 8)
    n = int(req.request_id.max()) + 1
    dec = np.bincount(tok.request_id[tok.phase == DECODE], minlength=n)
    pre = np.bincount(tok.request_id[tok.phase == PREFILL], minlength=n)
    full = (dec[req.request_id] >= 32) & (pre[req.request_id] >= 1)
    assert full.sum() >= 32 * 128  # EP32 x 128 running requests per GPU
    prompts = [json.loads(line) for line in (DS_DIR / "heldout_prompts.jsonl").read_text().splitlines()]
    for r, d, s in zip(req.request_id.tolist(), req.domain.tolist(), req.source.tolist(), strict=True):
        assert (d, s) == (prompts[r]["domain"], f"{prompts[r]['domain']}/{prompts[r]['subdomain']}")


def test_every_token_layer_is_group_limited(ds_trace):
    """8 distinct experts per token-layer, in at most 4 of the 8 groups of 32; tokens do use 1-4 groups."""
    ids = ds_trace.tokens.expert_ids.astype(np.int64)
    assert ids.shape[1:] == (8, 8)
    assert (np.diff(np.sort(ids, axis=2), axis=2) != 0).all()
    groups = np.sort(ids // 32, axis=2)
    distinct = 1 + (np.diff(groups, axis=2) != 0).sum(axis=2)
    assert distinct.max() <= 4
    assert {2, 3, 4} <= set(np.unique(distinct).tolist())
    assert ds_trace.meta.extra.get("expert_groups") == 8 and ds_trace.meta.extra.get("topk_groups") == 4


def test_card_numbers_are_a_fresh_measurement_of_the_shipped_trace():
    mod = load_script("reference_structure")
    committed = json.loads((DS_DIR / "structure.json").read_text())
    s = json.loads(json.dumps(mod.structure(str(REPO / committed["trace"]))))
    assert s["groups"] == committed["groups"] and s["tokens"] == committed["tokens"]
    for path in (("load", "mean_max_over_mean"), ("domain", "softmax_regression_accuracy"),
                 ("prefill_decode", "pearson_mean"), ("temporal", "mean")):
        a, b = s, committed
        for k in path:
            a, b = a[k], b[k]
        assert a == pytest.approx(b, rel=1e-9), path
    card = (DS_DIR / "MODEL_CARD.md").read_text()
    assert f"{committed['prefill_decode']['pearson_mean']:.3f}" in card
    assert "0.55" in card and "fine-grained" in card  # the published figure and the comparison
