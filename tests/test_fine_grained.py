"""The fine-grained reference model (issue 13): DeepSeek-V3 shape, bias balancing, sub-domain corpus, capture.

The full model is not trained here; its config is checked for shape and size, and the whole pipeline runs at toy
size (``tiny-fine-grained``: the same 64 experts in 8 groups, top-4 groups, top-6, 2 shared experts).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moeplace.models import corpus as C
from moeplace.models.balancing import bias_routers, bias_update, max_over_mean, update_router_biases
from moeplace.models.reference import HELDOUT_PROMPTS_FILE, MANIFEST_FILE, REFERENCE_DIR, builtin_prompts, preset

SUBDOMAIN_OF_ID_PREFIX = {"code:c/": "c", "code:cpp/": "cpp", "code:cython/": "cython", "general:pydoc/": "python-docs",
                          "general:fortunes/": "fortunes"}


def _expected_params(cfg) -> int:
    """Parameters of the DeepSeek-V3 config counted by hand from its dimensions (tied embeddings, MLA without
    query compression, SwiGLU MLPs; the routing biases are buffers, not parameters)."""
    h, heads = cfg.hidden_size, cfg.num_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    attn = (h * heads * qk  # q_proj
            + h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank  # kv_a_proj_with_mqa, kv_a_layernorm
            + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # kv_b_proj
            + heads * cfg.v_head_dim * h)  # o_proj
    norms = 2 * h
    dense_mlp = 3 * h * cfg.dense_intermediate_size
    moe = (cfg.num_experts * 3 * h * cfg.moe_intermediate_size  # routed experts (gate, up, down)
           + 3 * h * cfg.moe_intermediate_size * cfg.num_shared_experts  # shared experts as one wider SwiGLU
           + cfg.num_experts * h)  # router
    layers = cfg.first_k_dense * (attn + norms + dense_mlp) + cfg.num_moe_layers * (attn + norms + moe)
    return cfg.vocab_size * h + layers + h  # embeddings (tied with the output head), layers, final norm


def test_fine_grained_config_has_the_issue_shape_and_fits_30_mb():
    from transformers import DeepseekV3ForCausalLM

    cfg = preset("fine-grained")
    assert (cfg.arch, cfg.num_moe_layers, cfg.first_k_dense) == ("deepseek_v3", 12, 1)
    assert (cfg.num_experts, cfg.expert_groups, cfg.topk_groups, cfg.top_k, cfg.num_shared_experts) == (64, 8, 4, 6, 2)
    assert cfg.hidden_size >= 192 and cfg.router_aux_loss_coef == 0 and cfg.bias_update_speed == 0.001
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg.deepseek_config(eos_token_id=0))
    n = sum(p.numel() for p in model.parameters())
    assert n == _expected_params(cfg)
    n_bias = sum(r.e_score_correction_bias.numel() for r in bias_routers(model))
    assert n_bias == 12 * 64
    assert 2 * n + 4 * n_bias <= 30e6  # bfloat16 weights + float32 routing biases
    assert type(model.model.layers[0].mlp).__name__ == "DeepseekV3MLP"
    assert all(type(layer.mlp).__name__ == "DeepseekV3MoE" for layer in model.model.layers[1:])


def test_deepseek_fields_are_checked():
    with pytest.raises(ValueError, match="expert_groups"):
        preset("fine-grained", expert_groups=5)
    with pytest.raises(ValueError, match="topk_groups"):
        preset("fine-grained", topk_groups=9)
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        preset("fine-grained", router_aux_loss_coef=0.01)
    with pytest.raises(ValueError, match="deepseek_v3' only"):
        preset("default", num_shared_experts=2)


# ------------------------------------------------------------------------------------------------ balancing


def test_bias_update_hand_example():
    """mean load 2: the overloaded expert 0 loses gamma, the underloaded expert 1 gains it, the rest keep theirs."""
    new = bias_update(np.zeros((2, 4)), np.array([[3, 1, 2, 2], [0, 0, 0, 8]]), gamma=0.1)
    np.testing.assert_allclose(new, [[-0.1, 0.1, 0.0, 0.0], [0.1, 0.1, 0.1, -0.1]])
    np.testing.assert_allclose(max_over_mean(np.array([[3, 1, 2, 2], [2, 2, 2, 2]])), [1.5, 1.0])


def _toy_router():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = preset("tiny-fine-grained").deepseek_config(eos_token_id=0)
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a skewed router: a few experts have large positive affinity for every token
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.3)
        router.weight[:5] += 1.0
    x = torch.randn(512, cfg.hidden_size, generator=g) + 0.5
    return router, x


@pytest.mark.parametrize("gamma", [0.0, 0.01])
def test_bias_update_balances_a_toy_router(gamma):
    """The real DeepSeek-V3 router on a fixed skewed batch: with the update on, max/mean load falls steeply; off,
    it stays where it began. The bias never changes the gating weights of the chosen experts."""
    router, x = _toy_router()
    first = None
    for _ in range(300):
        with torch.no_grad():
            logits, weights, idx = router(x)
        load = np.bincount(idx.reshape(-1).numpy(), minlength=64)[None]
        first = max_over_mean(load)[0] if first is None else first
        update_router_biases([router], load, gamma)
    last = max_over_mean(load)[0]
    assert first > 3.0
    if gamma == 0:
        assert last == first
    else:
        assert last < 0.5 * first
        assert router.e_score_correction_bias.abs().max() > 0
    # gating weights are the unbiased sigmoid scores of the chosen experts, renormalised to sum to 1
    s = torch.sigmoid(logits).gather(1, idx)
    torch.testing.assert_close(weights, s / s.sum(dim=1, keepdim=True) * router.routed_scaling_factor)


def test_sample_windows_weights_subdomains_by_size_to_the_alpha():
    """Sub-domain streams of 100, 400 and 1600 tokens (each token its stream's id): alpha 1 picks them 1:4:16,
    alpha 0.5 picks them 1:2:4, alpha 0 evenly."""
    from moeplace.models.train import sample_windows

    streams = {"a": np.zeros(100, np.int64), "b": np.ones(400, np.int64), "c": np.full(1600, 2, np.int64)}
    for alpha, want in ((1.0, [1, 4, 16]), (0.5, [1, 2, 4]), (0.0, [1, 1, 1])):
        rows = sample_windows(streams, 21000, 8, alpha, np.random.default_rng(0))
        assert all(len(r) == 8 and len(set(r)) == 1 for r in rows)
        share = np.bincount([int(r[0]) for r in rows], minlength=3) / len(rows)
        np.testing.assert_allclose(share, np.array(want) / sum(want), atol=0.015)


# ------------------------------------------------------------------------------------------------ corpus


def test_default_corpus_is_the_first_models_corpus_with_subdomain_labels():
    """The v1 corpus rebuilt now has exactly the document ids of the committed model's manifest, every document
    labelled."""
    cfg = preset("default")
    corpus = C.build_corpus(dict(cfg.heldout_fraction), cfg.math_problems, cfg.data_seed, variant=cfg.corpus)
    committed = json.loads((REFERENCE_DIR / MANIFEST_FILE).read_text())["domains"]
    for dom in C.DOMAINS:
        assert C.compress_ids(d.doc_id for d in corpus.train[dom]) == committed[dom]["train_ids"], dom
        assert C.compress_ids(d.doc_id for d in corpus.heldout[dom]) == committed[dom]["heldout_ids"], dom
        assert all(d.subdomain for d in corpus.train[dom] + corpus.heldout[dom]), dom
    assert {d.subdomain for d in corpus.train["code"]} == {"python"}
    assert {d.subdomain for d in corpus.train["math"]} == set(C.MATH_SUBDOMAINS)


@pytest.fixture(scope="module")
def fg_corpus():
    cfg = preset("fine-grained")
    return cfg, C.build_corpus(dict(cfg.heldout_fraction), cfg.math_problems, cfg.data_seed, variant=cfg.corpus)


def test_fine_grained_corpus_subdomains_and_licenses(fg_corpus):
    cfg, corpus = fg_corpus
    manifest = C.corpus_manifest(corpus)
    subs = {dom: set(manifest["domains"][dom]["subdomains"]) for dom in C.DOMAINS}
    assert subs["code"] == {"python", "c", "cpp", "cython"}
    assert subs["general"] == {"fortunes", "python-docs"}
    assert subs["math"] == set(C.MATH_SUBDOMAINS) and len(subs["math"]) >= 3
    assert len(subs["chat"]) >= 10  # chatterbot topics
    for dom in C.DOMAINS:
        for src in manifest["domains"][dom]["sources"]:
            assert src["license"] in {"PSF-2.0", "BSD-3-Clause", "Apache-2.0"} and src["documents"] > 0, src
        for sub, row in manifest["domains"][dom]["subdomains"].items():  # chat topics may be a document or two
            assert row["train_documents"] > 0 and (row["heldout_documents"] > 0 or dom == "chat"), (dom, sub)
    for dom in ("code", "general"):  # the label agrees with where the document came from
        for d in corpus.train[dom] + corpus.heldout[dom]:
            want = next((s for p, s in SUBDOMAIN_OF_ID_PREFIX.items() if d.doc_id.startswith(p)), "python")
            assert d.subdomain == want, d.doc_id
    ids = [d.doc_id for dom in C.DOMAINS for d in corpus.train[dom] + corpus.heldout[dom]]
    assert len(ids) == len(set(ids))
    assert "code:pydoc_data/topics.py" not in ids  # its prose is general/python-docs, not code


def test_fine_grained_prompt_pool_reaches_8000(fg_corpus):
    """With a vocabulary-4096 byte-level BPE (the first model's, a stand-in for the one training will learn), the
    held-out documents give the configured counts, >= 8,000 prompts, every one from a held-out document."""
    from transformers import AutoTokenizer

    cfg, corpus = fg_corpus
    tok = AutoTokenizer.from_pretrained(REFERENCE_DIR, local_files_only=True)
    counts = dict(cfg.prompt_counts)
    assert sum(counts.values()) >= 8000
    rows = C.heldout_prompts(corpus, tok, counts, cfg.prompt_min_tokens, cfg.prompt_max_tokens, cfg.data_seed,
                             per_code_doc=cfg.prompts_per_code_doc)
    assert len(rows) == sum(counts.values())
    held = {d.doc_id: d.subdomain for dom in C.DOMAINS for d in corpus.heldout[dom]}
    assert all(held[r["doc_id"]] == r["subdomain"] for r in rows)
    assert {r["subdomain"] for r in rows if r["domain"] == "code"} == {"python", "c", "cpp", "cython"}
    assert len({(r["doc_id"], r["prompt"]) for r in rows}) == len(rows)


# ------------------------------------------------------------------------------------------------ tiny pipeline


@pytest.fixture(scope="module")
def tiny_fg(tmp_path_factory):
    from moeplace.models.train import train_reference

    out = tmp_path_factory.mktemp("fg-tiny")
    metrics = train_reference(preset("tiny-fine-grained"), out, seed=0, progress=False, log=lambda _: None)
    return out, metrics


def test_tiny_fine_grained_trains_saves_and_loads(tiny_fg):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, metrics = tiny_fg
    cfg = preset("tiny-fine-grained")
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert (model.config.n_group, model.config.topk_group, model.config.n_shared_experts) == (8, 4, 2)
    ids = tok("def add(a, b):", return_tensors="pt")
    assert model.generate(**ids, max_new_tokens=3, do_sample=False).shape[1] > ids["input_ids"].shape[1]
    assert len(metrics["history"]["max_over_mean"]) == cfg.steps and metrics["history"]["aux_loss"] is None
    assert metrics["moe_layers"] == 2 and all(np.isfinite(v) for v in metrics["heldout_ce_saved_weights"].values())
    # the biases moved during training (gamma * steps at most), were saved in float32 and load back
    bias = np.array(metrics["router_bias"])
    assert bias.shape == (2, 64) and 0 < np.abs(bias).max() <= cfg.bias_update_speed * cfg.steps + 1e-6
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = [k for k in f.keys() if k.endswith("e_score_correction_bias")]
        assert len(keys) == 2 and all(f.get_tensor(k).dtype == torch.float32 for k in keys)
    loaded = np.stack([r.e_score_correction_bias.numpy() for r in bias_routers(model)])
    np.testing.assert_allclose(loaded, bias, atol=1e-5)
    # every file of the folder has the mode the user's umask gives (the weights are not left 0600)
    from moeplace.io import file_mode

    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()} == {f.name: file_mode() for f in out.iterdir()}


def test_tiny_fine_grained_prompts_carry_subdomains(tiny_fg):
    out, _ = tiny_fg
    rows = builtin_prompts(out)
    assert len(rows) == 4 * preset("tiny-fine-grained").prompts_per_domain
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    for r in rows:
        assert r["subdomain"] in manifest["domains"][r["domain"]]["subdomains"], r
        assert r["doc_id"] in set(C.expand_ids(manifest["domains"][r["domain"]]["heldout_ids"]))


def test_tiny_fine_grained_trace_is_group_limited(tiny_fg, tmp_path):
    """`moeplace trace record` on the trained tiny model: shared experts in the metadata, the sub-domain in every
    request's source, and every token's 6 experts in at most 4 of the 8 groups (group = expert // 8)."""
    from moeplace.cli import main
    from moeplace.trace import read_trace

    out, _ = tiny_fg
    trace = tmp_path / "fg.trace"
    assert main(["trace", "record", "--model", str(out), "--prompts", str(out / HELDOUT_PROMPTS_FILE),
                 "--max-new-tokens", "4", "--min-new-tokens", "4", "--no-weights", "--batch-size", "8",
                 str(trace)]) == 0
    tr = read_trace(trace)
    m = tr.meta
    assert (m.num_layers, m.num_experts, m.top_k, m.num_shared_experts, list(m.moe_layer_map)) == (2, 64, 6, 2, [1, 2])
    assert not m.has_weights and tr.tokens.expert_weights is None  # --no-weights: ids only
    assert (m.extra["expert_groups"], m.extra["topk_groups"]) == (8, 4)  # the router's rule, for checks on the trace
    # --min-new-tokens 4 masks EOS: every request feeds 3 decode tokens (the 4th generated one is never fed)
    dec = np.bincount(tr.tokens.request_id[tr.tokens.phase == 1])
    assert (dec[tr.requests.request_id] == 3).all()
    rows = builtin_prompts(out)
    assert sorted(tr.requests.source.tolist()) == sorted(f"{r['domain']}/{r['subdomain']}" for r in rows)
    ids = tr.tokens.expert_ids.astype(np.int64)  # [T, L, K]
    groups = ids // (64 // 8)
    per_token = np.array([[len(set(g)) for g in layer] for layer in groups.transpose(1, 0, 2)])  # [L, T]
    assert per_token.max() <= 4
    assert (per_token > 1).any()  # the check is not vacuous: tokens do spread over several groups
    assert all(len(set(row)) == 6 for row in ids.reshape(-1, 6))  # 6 distinct experts per token and layer


def test_heldout_ce_by_subdomain_on_the_tiny_model(tiny_fg):
    """Per-sub-domain held-out loss of the saved tiny model: one finite CE per sub-domain with a window of text
    (chat pooled), and the pooled domains' keys are the domains themselves."""
    from moeplace.models.train import heldout_ce_by_subdomain

    out, metrics = tiny_fg
    r = heldout_ce_by_subdomain(out, preset("tiny-fine-grained"))
    keys = set(r["heldout_ce"])
    assert {"code/python", "code/c", "general/fortunes", "chat"} <= keys
    assert not any(k.startswith("chat/") for k in keys)
    assert all(np.isfinite(v) and v > 0 for v in r["heldout_ce"].values())
    assert all(1 <= n <= preset("tiny-fine-grained").eval_seqs for n in r["windows"].values())
