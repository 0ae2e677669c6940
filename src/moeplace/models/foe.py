"""Federation of Experts (FoE, arXiv 2605.06206) as a transformers model: a Qwen3-MoE with ``foe_groups = H``.

Shape legend: H = groups, B = sequences, S = tokens per sequence, T = B*S tokens, D = hidden size,
E = experts per layer, K = top-k per token (all groups together), Eg = E/H, Kg = K/H, Q = query heads,
V = key/value heads, d = head_dim.

The model has exactly the parameter tensors of :class:`transformers.Qwen3MoeForCausalLM` (same names, same
shapes), so an MoE checkpoint loads into it and the parameter counts (total and active) are equal by construction.
Only the wiring of a decoder layer differs. Group ``h`` owns

- query heads ``[h*Q/H, (h+1)*Q/H)`` and key/value heads ``[h*V/H, (h+1)*V/H)`` (rows of q/k/v_proj, columns
  of o_proj; GQA maps a query head to the KV head of its own group, so a group's attention is self-contained);
- experts ``[h*Eg, (h+1)*Eg)`` and the matching rows of the router; it routes top-``Kg`` among them only;
- a group-local residual ``r_h``.

Per layer (``h_prev`` [B, S, D] is the shared post-attention residual of the previous layer, ``m_h`` [B, S, D]
group h's MoE output of the previous layer; layer 0 has ``h_prev = embedding`` and ``m_h = 0``, i.e. every group
starts from the replicated embedding)::

    r_h = h_prev + m_h                                   # group-local residual
    a_h = o_proj_h(attention_h(input_norm(r_h)))         # group h's heads only
    h   = h_prev + SUM_h (m_h + a_h)                     # the one cross-group sum (all-reduce) per layer
    m_h = experts_h(route_h(post_norm(h)))               # group h's router over its Eg experts, top-Kg

and after the last layer the groups are summed before the final norm: ``norm(h + SUM_h m_h)``.
With H = 1 this is the Qwen3-MoE decoder layer (``tests/test_foe_model.py`` checks it to float tolerance).
The sum is :func:`cross_group_sum`: a plain sum in one process; a distributed run replaces it with an all-reduce
of one [T, D] tensor per group. docs/FOE.md lists the choices the paper leaves open and why these were made.

Load with plain transformers after ``import moeplace.models.foe`` (it registers ``model_type = "qwen3_foe"``)::

    import moeplace.models.foe
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeForCausalLM,
    Qwen3MoeModel,
    Qwen3MoeTopKRouter,
    apply_rotary_pos_emb,
    eager_attention_forward,
    load_balancing_loss_func,
)

MODEL_TYPE = "qwen3_foe"


@strict
class FoeConfig(Qwen3MoeConfig):
    """A Qwen3-MoE config plus ``foe_groups`` (H). Every decoder layer is an FoE layer."""

    model_type = MODEL_TYPE
    foe_groups: int = 1  # H: groups, each with V/H KV heads, Q/H query heads, E/H experts and top-(K/H) routing

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.check_foe()

    def check_foe(self) -> None:
        """Raise ValueError unless H divides the KV heads, the experts and top-k, and every layer is sparse."""
        h = self.foe_groups
        if not isinstance(h, int) or h < 1:
            raise ValueError(f"foe_groups must be a positive integer, got {h!r}")
        for name in ("num_key_value_heads", "num_experts", "num_experts_per_tok"):
            if getattr(self, name) % h:
                raise ValueError(f"foe_groups={h} must divide {name}={getattr(self, name)}")
        if self.attention_bias:
            raise ValueError("FoE model: attention_bias=True is not supported (expected False, as Qwen3-MoE)")
        if self.mlp_only_layers or self.decoder_sparse_step != 1:
            raise ValueError(f"FoE model: every layer must be an MoE layer (mlp_only_layers=[] and "
                             f"decoder_sparse_step=1), got {self.mlp_only_layers}, {self.decoder_sparse_step}")


def foe_config(moe_config: Qwen3MoeConfig, groups: int) -> FoeConfig:
    """The FoE config with the architecture of ``moe_config`` and ``groups`` groups (validated)."""
    d = moe_config.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "foe_groups"):
        d.pop(key, None)
    cfg = FoeConfig(**d, foe_groups=groups)
    return cfg


def cross_group_sum(parts: torch.Tensor) -> torch.Tensor:
    """The cross-group sum of one layer: [H, ...] -> [...]. One process: a plain sum; distributed: an all-reduce."""
    return parts.sum(dim=0)


@dataclass(frozen=True)
class GroupRouting:
    """One layer's routing, per group. logits: [H, T, Eg] (router logits over the group's own experts);
    expert_ids: [T, H, Kg] global expert ids (group h's lie in [h*Eg, (h+1)*Eg)); weights: [T, H, Kg]."""

    logits: torch.Tensor
    expert_ids: torch.Tensor
    weights: torch.Tensor


def route_groups(x: torch.Tensor, gate_weight: torch.Tensor, groups: int, top_k: int,
                 norm_topk_prob: bool) -> GroupRouting:
    """Each group's router over its own experts. x [T, D], gate_weight [E, D] (Qwen3-MoE's router);
    ``top_k`` is K over all groups (each group picks K/H). Softmax over the group's Eg logits, top-Kg, and the
    weights renormalised to sum to 1 per group when ``norm_topk_prob`` (as Qwen3-MoE does over all E)."""
    e = gate_weight.shape[0]
    eg, kg = e // groups, top_k // groups
    logits = torch.einsum("td,hed->hte", x, gate_weight.view(groups, eg, -1))  # [H, T, Eg]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    w, idx = torch.topk(probs, kg, dim=-1)  # [H, T, Kg]
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    idx = idx + (torch.arange(groups, device=x.device) * eg).view(groups, 1, 1)
    return GroupRouting(logits, idx.permute(1, 0, 2), w.to(logits.dtype).permute(1, 0, 2))


class FoeGroupTopKRouter(Qwen3MoeTopKRouter):
    """Qwen3-MoE's router module (the same single parameter ``weight`` [E, D]) routing per FoE group with
    :func:`route_groups`. It replaces ``mlp.gate`` of every FoE layer, so parameter names stay Qwen3-MoE's.

    ``forward(x [N, D]) -> (router_logits [N, E], topk_weights [N, K], topk_indices [N, K])``: the transformers
    router contract, so :mod:`moeplace.trace.capture` hooks it like any ``*TopKRouter``. The K columns are ordered
    group by group: columns ``[h*Kg, (h+1)*Kg)`` hold group h's experts (ids in ``[h*Eg, (h+1)*Eg)``) and weights;
    ``router_logits[:, h*Eg:(h+1)*Eg]`` are group h's logits."""

    def __init__(self, config: FoeConfig):
        super().__init__(config)
        self.groups = config.foe_groups  # H

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = hidden_states.reshape(-1, self.hidden_dim)  # [N, D]
        n = x.shape[0]
        rt = route_groups(x, self.weight, self.groups, self.top_k, self.norm_topk_prob)
        logits = rt.logits.permute(1, 0, 2).reshape(n, self.num_experts)  # [H, N, Eg] -> [N, E]
        return logits, rt.weights.reshape(n, self.top_k), rt.expert_ids.reshape(n, self.top_k)


def foe_aux_loss(router_logits: tuple[torch.Tensor, ...], groups: int, top_k: int) -> torch.Tensor:
    """Load-balancing loss of an FoE model: Qwen3-MoE's Switch-style loss computed per group over its Eg
    experts with top-Kg (pooled over layers, as Qwen3-MoE pools them), summed over groups, so that perfect balance
    gives K as in the MoE (each group's term is then Kg). router_logits: one [H, T, Eg] tensor per layer.
    With H = 1 it is Qwen3-MoE's ``aux_loss``."""
    eg, kg = router_logits[0].shape[-1], top_k // groups
    losses = [load_balancing_loss_func(tuple(lg[h] for lg in router_logits), eg, kg) for h in range(groups)]
    return torch.stack(losses).sum()


@dataclass
class FoeModelOutput(MoeModelOutputWithPast):
    """MoeModelOutputWithPast plus ``router_expert_ids``: per layer, [T, H, Kg] global expert ids."""

    router_expert_ids: tuple[torch.Tensor, ...] | None = None


@dataclass
class FoeCausalLMOutput(MoeCausalLMOutputWithPast):
    """MoeCausalLMOutputWithPast plus ``router_expert_ids``: per layer, [T, H, Kg] global expert ids."""

    router_expert_ids: tuple[torch.Tensor, ...] | None = None


class FoeModel(Qwen3MoeModel):
    """Qwen3-MoE's decoder stack with the FoE layer wiring of the module docstring."""

    config_class = FoeConfig
    config: FoeConfig

    def __init__(self, config: FoeConfig):
        config.check_foe()
        super().__init__(config)
        for layer in self.layers:  # the group router takes over the (already initialised) router weight
            router = FoeGroupTopKRouter(config)
            router.weight = layer.mlp.gate.weight
            layer.mlp.gate = router

    def _attention(self, layer, r: torch.Tensor, position_embeddings, attention_mask, past_key_values,
                   **kwargs) -> torch.Tensor:
        """Group-wise attention partials. r [H, B, S, D] group residuals -> [H, B, S, D], group h's heads only.

        Group h's q/k/v come from its own residual; the heads are then laid side by side (group h's query heads
        attend only to group h's KV heads under GQA) so one attention call and one KV-cache entry serve all."""
        attn = layer.self_attn
        hgr, b, s, dm = r.shape
        hd = attn.head_dim
        x = layer.input_layernorm(r)  # [H, B, S, D]

        def project(weight: torch.Tensor) -> torch.Tensor:  # weight [heads*d, D] -> [B, heads, S, d]
            y = torch.einsum("hbsd,hod->bsho", x, weight.view(hgr, -1, dm))  # [B, S, H, heads/H*d]
            return y.reshape(b, s, -1, hd)

        q = attn.q_norm(project(attn.q_proj.weight)).transpose(1, 2)
        k = attn.k_norm(project(attn.k_proj.weight)).transpose(1, 2)
        v = project(attn.v_proj.weight).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, attn.layer_idx)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, _ = interface(attn, q, k, v, attention_mask, dropout=0.0 if not attn.training else
                           attn.attention_dropout, scaling=attn.scaling, sliding_window=attn.sliding_window, **kwargs)
        out = out.reshape(b, s, hgr, -1)  # [B, S, H, Q/H*d]: group h's heads are contiguous
        wo = attn.o_proj.weight.view(dm, hgr, -1)  # [D, H, Q/H*d]
        return torch.einsum("bsho,dho->hbsd", out, wo)

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                output_router_logits: bool | None = None, **kwargs) -> FoeModelOutput:
        cfg = self.config
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        use_cache = cfg.use_cache if use_cache is None else use_cache
        want_router = cfg.output_router_logits if output_router_logits is None else output_router_logits
        for key in ("output_hidden_states", "output_attentions"):
            if kwargs.pop(key, False):
                raise ValueError(f"FoE model: {key}=True is not supported")
        kwargs.pop("return_dict", None)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=cfg)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + seen).unsqueeze(0)
        mask = create_causal_mask(config=cfg, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                  past_key_values=past_key_values, position_ids=position_ids)
        pos = self.rotary_emb(inputs_embeds, position_ids=position_ids)

        hgr, b, s, dm = cfg.foe_groups, *inputs_embeds.shape
        eg, kg = cfg.num_experts // hgr, cfg.num_experts_per_tok // hgr
        h = inputs_embeds  # [B, S, D] shared post-attention residual (layer 0: the replicated embedding)
        m = torch.zeros((hgr, b, s, dm), dtype=h.dtype, device=h.device)  # [H, B, S, D] groups' MoE outputs
        logits_all, ids_all = [], []
        for layer in self.layers[: cfg.num_hidden_layers]:
            a = self._attention(layer, h + m, pos, mask, past_key_values, **kwargs)  # r_h = h + m_h
            h = h + cross_group_sum(m + a)
            x = layer.post_attention_layernorm(h).reshape(-1, dm)  # [T, D], identical on every group
            logits, weights, ids = layer.mlp.gate(x)  # [T, E], [T, K], [T, K]: columns group by group
            ids, weights = ids.view(-1, hgr, kg), weights.view(-1, hgr, kg)  # [T, H, Kg]
            experts = layer.mlp.experts
            m = torch.stack([experts(x, ids[:, g], weights[:, g]) for g in range(hgr)]).view(hgr, b, s, dm)
            if want_router:
                logits_all.append(logits.view(-1, hgr, eg).transpose(0, 1))  # [H, T, Eg]
                ids_all.append(ids)
        h = self.norm(h + cross_group_sum(m))  # the groups summed before the final norm
        return FoeModelOutput(last_hidden_state=h, past_key_values=past_key_values if use_cache else None,
                              router_logits=tuple(logits_all) if want_router else None,
                              router_expert_ids=tuple(ids_all) if want_router else None)


class FoeForCausalLM(Qwen3MoeForCausalLM):
    """Causal LM head on :class:`FoeModel`; parameter names and shapes are Qwen3MoeForCausalLM's."""

    config_class = FoeConfig
    config: FoeConfig

    def __init__(self, config: FoeConfig):
        super().__init__(config)
        self.model = FoeModel(config)
        self.post_init()

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, output_router_logits: bool | None = None,
                logits_to_keep: int | torch.Tensor = 0, **kwargs) -> FoeCausalLMOutput:
        want_router = self.config.output_router_logits if output_router_logits is None else output_router_logits
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_router_logits=want_router, **kwargs)
        hs = out.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hs[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        aux = None
        if want_router:
            aux = foe_aux_loss(out.router_logits, self.config.foe_groups, self.config.num_experts_per_tok)
            if labels is not None:
                loss = loss + self.router_aux_loss_coef * aux
        return FoeCausalLMOutput(loss=loss, aux_loss=aux, logits=logits, past_key_values=out.past_key_values,
                                 router_logits=out.router_logits, router_expert_ids=out.router_expert_ids)


def active_parameters(model: torch.nn.Module, top_k: int, num_experts: int) -> int:
    """Parameters one token uses: everything except the experts it does not select (MoE and FoE alike:
    an FoE token selects K/H experts in each of H groups, K in all)."""
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return int(total - experts + experts * top_k // num_experts)


AutoConfig.register(MODEL_TYPE, FoeConfig, exist_ok=True)
AutoModelForCausalLM.register(FoeConfig, FoeForCausalLM, exist_ok=True)
