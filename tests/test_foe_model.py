"""The FoE model (moeplace.models.foe): H = 1 is the Qwen3-MoE model, H = 2/4 match a plain loop reference written
here from the layer equations of docs/FOE.md, parameter counts equal the MoE's, routing stays inside each group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from moeplace.models.foe import FoeForCausalLM, active_parameters, foe_config  # noqa: E402

# D=32, L=2, Q=8 query heads, V=4 KV heads, d=8, E=8, K=4, FF=16 (expert width): H in {1, 2, 4} divides V, E and K.
D, L, Q, V, HD, E, K, FF, VOCAB = 32, 2, 8, 4, 8, 8, 4, 16, 97


def moe_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=64, num_hidden_layers=L,
                          num_attention_heads=Q, num_key_value_heads=V, head_dim=HD, max_position_embeddings=64,
                          decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=FF, num_experts=E,
                          num_experts_per_tok=K, norm_topk_prob=True, router_aux_loss_coef=0.01,
                          tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)


@pytest.fixture(scope="module")
def moe():
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(moe_config()).eval()
    with torch.no_grad():  # norms away from 1 so that a norm applied to the wrong tensor shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif ".gate." in name:
                p.mul_(20)  # confident routers: top-k ties cannot flip between implementations
    return model


def foe_from(moe, groups: int) -> FoeForCausalLM:
    foe = FoeForCausalLM(foe_config(moe.config, groups)).eval()
    res = foe.load_state_dict(moe.state_dict())
    assert not res.missing_keys and not res.unexpected_keys
    return foe


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------------------------------ loop reference


def _rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta=10000.0):  # x [S, d]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)
    f = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
    rot = torch.cat([-x[:, d // 2:], x[:, : d // 2]], -1)
    return x * cos + rot * sin


def loop_reference(sd: dict, ids: torch.Tensor, groups: int) -> tuple[torch.Tensor, float]:
    """FoE forward of one batch, group by group and head by head, from the raw weights. -> (logits, aux loss)."""
    eg, kg, qg = E // groups, K // groups, Q // groups
    out = []
    counts = torch.zeros(groups, eg)
    probs_sum = torch.zeros(groups, eg)
    for seq in ids:
        s = len(seq)
        pos = torch.arange(s)
        causal = torch.ones(s, s).tril().bool()
        h = sd["model.embed_tokens.weight"][seq]  # [S, D]
        m = [torch.zeros(s, D) for _ in range(groups)]
        for layer in range(L):
            p = f"model.layers.{layer}."
            wq, wk, wv, wo = (sd[p + f"self_attn.{n}_proj.weight"] for n in "qkvo")
            update = torch.zeros(s, D)
            for g in range(groups):
                x = _rms(h + m[g], sd[p + "input_layernorm.weight"])  # group g's own residual
                a = torch.zeros(s, D)
                for qh in range(g * qg, (g + 1) * qg):
                    kv = qh // (Q // V)
                    assert g * (V // groups) <= kv < (g + 1) * (V // groups)
                    q = _rope(_rms(x @ wq[qh * HD:(qh + 1) * HD].T, sd[p + "self_attn.q_norm.weight"]), pos)
                    k = _rope(_rms(x @ wk[kv * HD:(kv + 1) * HD].T, sd[p + "self_attn.k_norm.weight"]), pos)
                    v = x @ wv[kv * HD:(kv + 1) * HD].T
                    att = (q @ k.T / HD ** 0.5).masked_fill(~causal, float("-inf")).softmax(-1)
                    a = a + (att @ v) @ wo[:, qh * HD:(qh + 1) * HD].T
                update = update + m[g] + a
            h = h + update
            x = _rms(h, sd[p + "post_attention_layernorm.weight"])
            gu, dn = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]
            gate = sd[p + "mlp.gate.weight"]
            for g in range(groups):
                m[g] = torch.zeros(s, D)
                pr = (x @ gate[g * eg:(g + 1) * eg].T).softmax(-1)  # [S, Eg]
                for t in range(s):
                    top = torch.topk(pr[t], kg).indices
                    w = pr[t, top] / pr[t, top].sum()
                    for j, le in enumerate(top.tolist()):
                        e = g * eg + le
                        gt, up = (gu[e] @ x[t]).chunk(2)
                        m[g][t] += w[j] * (dn[e] @ (F.silu(gt) * up))
                        counts[g, le] += 1
                probs_sum[g] += pr.sum(0)
        out.append(_rms(h + sum(m), sd["model.norm.weight"]) @ sd["model.embed_tokens.weight"].T)
    rows = L * ids.numel()  # token rows of all layers: Qwen3-MoE pools its loss over layers
    aux = sum(eg * float((counts[g] / rows * probs_sum[g] / rows).sum()) for g in range(groups))
    return torch.stack(out), aux


# ------------------------------------------------------------------------------------------------ tests


def test_one_group_is_the_moe_model(moe, ids):
    foe = foe_from(moe, 1)
    with torch.no_grad():
        a = moe(input_ids=ids, labels=ids, output_router_logits=True)
        b = foe(input_ids=ids, labels=ids, output_router_logits=True)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.aux_loss, a.aux_loss)
    torch.testing.assert_close(b.loss, a.loss)
    ga = moe.generate(ids[:1], max_new_tokens=6, do_sample=False)
    gb = foe.generate(ids[:1], max_new_tokens=6, do_sample=False)
    assert gb.tolist() == ga.tolist()


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_matches_loop_reference(moe, ids, groups):
    foe = foe_from(moe, groups)
    with torch.no_grad():
        out = foe(input_ids=ids, output_router_logits=True)
        want, aux = loop_reference({k: v.float() for k, v in moe.state_dict().items()}, ids, groups)
    torch.testing.assert_close(out.logits, want, rtol=1e-4, atol=1e-4)
    assert out.aux_loss.item() == pytest.approx(aux, rel=1e-5)


def test_groups_change_the_function(moe, ids):
    with torch.no_grad():
        l1, l2 = (foe_from(moe, h)(input_ids=ids).logits for h in (1, 2))
    assert (l1 - l2).abs().max() > 1e-2


@pytest.mark.parametrize("groups", [2, 4])
def test_shapes_and_group_local_routing(moe, ids, groups):
    foe = foe_from(moe, groups)
    with torch.no_grad():
        out = foe(input_ids=ids, output_router_logits=True)
    b, s = ids.shape
    assert out.logits.shape == (b, s, VOCAB)
    assert len(out.router_expert_ids) == len(out.router_logits) == L
    for eid, lg in zip(out.router_expert_ids, out.router_logits, strict=True):
        assert eid.shape == (b * s, groups, K // groups)
        assert lg.shape == (groups, b * s, E // groups)
        for g in range(groups):
            own = eid[:, g]
            assert ((own >= g * E // groups) & (own < (g + 1) * E // groups)).all()
            assert (own.sort(-1).values.diff(dim=-1) > 0).all()  # distinct experts per token


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_parameter_counts_equal_moe(moe, groups):
    foe = foe_from(moe, groups)
    total = sum(p.numel() for p in foe.parameters())
    assert total == sum(p.numel() for p in moe.parameters())
    expert = 3 * D * FF  # gate, up, down of one SwiGLU expert
    assert sum(p.numel() for n, p in foe.named_parameters() if ".experts." in n) == L * E * expert
    # active: all but the experts, plus K experts per layer (K/H in each of H groups)
    assert active_parameters(foe, K, E) == total - L * E * expert + L * (groups * (K // groups)) * expert
    assert active_parameters(foe, K, E) == active_parameters(moe, K, E)


def test_kv_cache_decoding_matches_full_forward(moe, ids):
    foe = foe_from(moe, 2)
    with torch.no_grad():
        full = foe(input_ids=ids, use_cache=False).logits
        step = foe(input_ids=ids[:, :6], use_cache=True)
        got = [step.logits]
        cache = step.past_key_values
        for t in range(6, ids.shape[1]):
            step = foe(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            got.append(step.logits)
    torch.testing.assert_close(torch.cat(got, dim=1), full, rtol=1e-4, atol=1e-4)


def test_save_and_load_with_transformers(moe, ids, tmp_path):
    foe = foe_from(moe, 2)
    foe.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    assert isinstance(back, FoeForCausalLM) and back.config.foe_groups == 2
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, foe(input_ids=ids).logits)


@pytest.mark.parametrize("groups", [3, 8, 0])
def test_bad_group_count_is_rejected(groups):
    with pytest.raises(ValueError, match="foe_groups"):
        foe_config(moe_config(), groups)


def test_train_reference_trains_and_reloads_an_foe_model(tmp_path):
    """train-reference with foe_groups=2 (tiny preset): it trains, saves, reloads as FoE, same parameter count as
    the MoE with the same architecture."""
    from moeplace.models.foe import FoeForCausalLM
    from moeplace.models.reference import load_reference, preset
    from moeplace.models.train import train_reference

    counts = {}
    for h in (1, 2):
        cfg = preset("tiny", num_kv_heads=2, foe_groups=h, steps=2)
        m = train_reference(cfg, tmp_path / f"h{h}", progress=False, log=lambda s: None)
        counts[h] = m["parameters"]
        assert all(torch.isfinite(torch.tensor(v)) for v in m["heldout_ce_saved_weights"].values())
    assert counts[1] == counts[2]
    model, _ = load_reference(path=tmp_path / "h2")
    assert isinstance(model, FoeForCausalLM) and model.config.foe_groups == 2


def test_foe_groups_must_divide_heads_experts_and_top_k():
    from moeplace.models.reference import preset

    with pytest.raises(ValueError, match="foe_groups"):
        preset("tiny", foe_groups=2)  # the tiny preset has one KV head
