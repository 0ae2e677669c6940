"""The reference MoE model: a small Qwen3-MoE trained here on four domains (code, chat, general prose, math).

It ships in ``moeplace/data/reference`` (weights, config, tokenizer, model card, held-out prompts, corpus manifest)
and loads with plain transformers::

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(REFERENCE_DIR)
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_DIR)

:class:`ReferenceConfig` holds everything that makes the model (architecture, training, data) and
:data:`PRESETS` names the configs: ``default`` (the shipped model), ``fine-grained`` (a DeepSeek-V3-shaped second
reference model: ``DeepseekV3ForCausalLM`` with 64 routed experts in 8 groups, top-6 within the top-4 groups,
2 shared experts, one dense layer then 12 MoE layers, balanced without an auxiliary loss by a routing bias;
:mod:`moeplace.models.balancing`), and ``tiny`` / ``tiny-fine-grained`` (the same pipelines at toy size, for tests).
``moeplace train-reference`` (:mod:`moeplace.models.train`) rebuilds it from installed packages.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from moeplace.io import unique_keys

REFERENCE_DIR = Path(__file__).resolve().parent.parent / "data" / "reference"
HELDOUT_PROMPTS_FILE = "heldout_prompts.jsonl"
MANIFEST_FILE = "corpus_manifest.json"
METRICS_FILE = "train_metrics.json"
EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class ReferenceConfig:
    """Architecture, training and data settings of the reference model (one comment per field)."""

    # --- architecture (Qwen3-MoE: every decoder layer is an MoE layer; DeepSeek-V3: dense layers first)
    arch: str = "qwen3_moe"  # "qwen3_moe" (Qwen3MoeForCausalLM) or "deepseek_v3" (DeepseekV3ForCausalLM)
    vocab_size: int = 4096  # byte-level BPE vocabulary trained on the training split
    hidden_size: int = 128  # model width
    num_layers: int = 8  # decoder layers (MoE layers L = num_layers - first_k_dense)
    num_heads: int = 4  # attention heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention)
    head_dim: int = 32  # width of one head
    num_experts: int = 32  # routed experts per layer (E)
    top_k: int = 4  # experts per token per layer (K)
    moe_intermediate_size: int = 64  # hidden width of one expert's SwiGLU
    max_position_embeddings: int = 512  # longest sequence the rotary embedding is set up for
    router_aux_loss_coef: float = 0.01  # weight of the architecture's load-balancing loss (Switch style)
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1 (as Qwen3-30B-A3B)
    foe_groups: int = 1  # > 1: a Federation-of-Experts model with this many groups (moeplace.models.foe)
    # --- DeepSeek-V3 only (arch="deepseek_v3")
    first_k_dense: int = 0  # leading decoder layers with a dense MLP instead of MoE (first_k_dense_replace)
    dense_intermediate_size: int = 0  # hidden width of those dense SwiGLU MLPs
    num_shared_experts: int = 0  # shared experts, run for every token (one SwiGLU of n x moe_intermediate_size)
    expert_groups: int = 1  # routed experts form this many equal groups (n_group)
    topk_groups: int = 1  # a token's experts come from its best this-many groups (topk_group)
    routed_scaling_factor: float = 1.0  # multiplies the (renormalised) top-k weights
    kv_lora_rank: int = 0  # MLA: width of the compressed key/value latent
    qk_nope_head_dim: int = 0  # MLA: per-head query/key width without rotary embedding
    qk_rope_head_dim: int = 0  # MLA: per-head query/key width with rotary embedding (shared key part)
    v_head_dim: int = 0  # MLA: per-head value width
    bias_update_speed: float = 0.0  # gamma of the auxiliary-loss-free balancing (0 = bias never moves)
    experts_implementation: str = "eager"  # transformers experts kernel: "eager" or "grouped_mm" (faster on CPU)
    # --- training
    steps: int = 1000  # optimizer steps
    seq_len: int = 256  # tokens per training sequence
    batch_mix: tuple[tuple[str, int], ...] = (("code", 4), ("chat", 1), ("general", 5), ("math", 2))  # seqs/batch
    lr: float = 2e-3  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 40  # linear warmup
    weight_decay: float = 0.1  # on matrices, not on norms or embeddings
    grad_clip: float = 1.0  # global gradient-norm clip
    eval_every: int = 50  # held-out evaluation interval (steps); also at the last step
    eval_seqs: int = 12  # held-out sequences of seq_len per domain for the held-out loss
    threads: int = 2  # torch.set_num_threads
    subdomain_alpha: tuple[tuple[str, float], ...] = ()  # per domain, alpha < 1: a batch row picks a sub-domain
    # with weight tokens**alpha (domains not named: 1, rows drawn from the whole domain stream, by size)
    save_dtype: str = "bfloat16"  # dtype of the saved weights ("float32" or "bfloat16")
    sample_tokens: int = 40  # greedy tokens generated per domain for the samples in train_metrics.json
    # --- data
    corpus: str = "v1"  # corpus variant (moeplace.models.corpus.CORPUS_VARIANTS): "v1" or "subdomains"
    data_seed: int = 0  # seeds the math generator and the prompt cuts (the split itself is seed-free)
    math_problems: int = 40000  # generated math problems (before the split)
    heldout_fraction: tuple[tuple[str, float], ...] = (
        ("code", 0.45), ("chat", 0.36), ("general", 0.10), ("math", 0.01))  # documents held out per domain
    max_train_docs: int | None = None  # keep only this many training documents per domain (tests)
    tokenizer_bytes: int = 2_000_000  # training text per domain the tokenizer learns from
    prompts_per_domain: int = 250  # held-out prompts written per domain
    prompt_counts: tuple[tuple[str, int], ...] = ()  # per-domain prompt counts; empty: prompts_per_domain each
    prompts_per_code_doc: int = 1  # at most this many prompts (different definitions) per held-out code file
    prompt_min_tokens: int = 32  # code/general prompts: at least this many tokens
    prompt_max_tokens: int = 96  # every prompt: at most this many tokens
    extra: dict = field(default_factory=dict, compare=False)  # free-form notes written to the metrics

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "num_experts", "top_k", "moe_intermediate_size", "steps", "seq_len", "eval_every",
                     "eval_seqs", "threads", "math_problems", "prompts_per_domain", "sample_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ReferenceConfig.{name} must be a positive integer, got {v!r}")
        if not isinstance(self.foe_groups, int) or self.foe_groups < 1 or any(
                v % self.foe_groups for v in (self.num_kv_heads, self.num_experts, self.top_k)):
            raise ValueError(f"ReferenceConfig.foe_groups={self.foe_groups!r} must divide num_kv_heads, num_experts "
                             "and top_k")
        if self.top_k > self.num_experts:
            raise ValueError(f"ReferenceConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.arch not in ("qwen3_moe", "deepseek_v3"):
            raise ValueError(f"ReferenceConfig.arch must be 'qwen3_moe' or 'deepseek_v3', got {self.arch!r}")
        if self.arch == "deepseek_v3":
            self._check_deepseek()
        elif (self.first_k_dense, self.num_shared_experts, self.expert_groups, self.topk_groups,
              self.bias_update_speed) != (0, 0, 1, 1, 0.0):
            raise ValueError("ReferenceConfig: first_k_dense, num_shared_experts, expert_groups, topk_groups and "
                             "bias_update_speed apply to arch='deepseek_v3' only")
        if self.experts_implementation not in ("eager", "grouped_mm"):
            raise ValueError(f"ReferenceConfig.experts_implementation must be 'eager' or 'grouped_mm', got "
                             f"{self.experts_implementation!r}")
        from moeplace.models.corpus import CORPUS_VARIANTS, DOMAINS

        for dom, a in self.subdomain_alpha:
            if dom not in DOMAINS or not 0.0 <= a <= 1.0:
                raise ValueError(f"ReferenceConfig.subdomain_alpha: expected (domain in {DOMAINS}, alpha in [0, 1]) "
                                 f"pairs, got {self.subdomain_alpha}")
        if self.prompts_per_code_doc < 1:
            raise ValueError(f"ReferenceConfig.prompts_per_code_doc must be >= 1, got {self.prompts_per_code_doc}")
        if self.corpus not in CORPUS_VARIANTS:
            raise ValueError(f"ReferenceConfig.corpus must be one of {CORPUS_VARIANTS}, got {self.corpus!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.seq_len + 1 > self.max_position_embeddings:
            raise ValueError(f"seq_len={self.seq_len} must be below max_position_embeddings="
                             f"{self.max_position_embeddings}")
        if self.save_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"save_dtype must be 'float32' or 'bfloat16', got {self.save_dtype!r}")
        if not 0 < self.prompt_min_tokens <= self.prompt_max_tokens:
            raise ValueError(f"need 0 < prompt_min_tokens <= prompt_max_tokens, got {self.prompt_min_tokens}, "
                             f"{self.prompt_max_tokens}")
        for name in ("batch_mix", "heldout_fraction") + (("prompt_counts",) if self.prompt_counts else ()):
            keys = [k for k, _ in getattr(self, name)]
            if sorted(keys) != sorted(DOMAINS):
                raise ValueError(f"ReferenceConfig.{name} must name each of {DOMAINS} once, got {keys}")
        if any(n < 1 for _, n in self.batch_mix):
            raise ValueError(f"ReferenceConfig.batch_mix: every domain needs >= 1 sequence, got {self.batch_mix}")

    def _check_deepseek(self) -> None:
        if self.foe_groups != 1:
            raise ValueError("ReferenceConfig: foe_groups applies to arch='qwen3_moe' only")
        for name in ("dense_intermediate_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "expert_groups", "topk_groups"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ReferenceConfig.{name} must be a positive integer for arch='deepseek_v3', got {v!r}")
        if not 0 <= self.first_k_dense < self.num_layers:
            raise ValueError(f"ReferenceConfig.first_k_dense={self.first_k_dense} must be in [0, num_layers="
                             f"{self.num_layers})")
        if self.num_shared_experts < 0:
            raise ValueError(f"ReferenceConfig.num_shared_experts must be >= 0, got {self.num_shared_experts}")
        g = self.expert_groups
        if self.num_experts % g or self.num_experts // g < 2:
            raise ValueError(f"ReferenceConfig.expert_groups={g} must divide num_experts={self.num_experts} into "
                             "groups of at least 2 (a group's score is its best two experts)")
        if not 1 <= self.topk_groups <= g or self.top_k > self.topk_groups * (self.num_experts // g):
            raise ValueError(f"ReferenceConfig.topk_groups={self.topk_groups} must be in [1, {g}] and its groups "
                             f"must hold top_k={self.top_k} experts")
        if self.num_heads != self.num_kv_heads:
            raise ValueError("ReferenceConfig: multi-head latent attention has num_kv_heads == num_heads, got "
                             f"{self.num_kv_heads} and {self.num_heads}")
        if self.router_aux_loss_coef != 0.0:
            raise ValueError("ReferenceConfig.router_aux_loss_coef must be 0 for arch='deepseek_v3' (it is balanced "
                             "by bias_update_speed; DeepseekV3ForCausalLM has no auxiliary loss)")
        if self.bias_update_speed < 0:
            raise ValueError(f"ReferenceConfig.bias_update_speed must be >= 0, got {self.bias_update_speed}")

    @property
    def num_moe_layers(self) -> int:
        """MoE layers L (decoder layers after the dense ones)."""
        return self.num_layers - self.first_k_dense

    @property
    def batch_size(self) -> int:
        """Sequences per optimizer step (sum of batch_mix)."""
        return sum(n for _, n in self.batch_mix)

    def to_json(self) -> dict:
        return asdict(self)

    def model_config(self, eos_token_id: int):
        """The transformers config of this architecture (``Qwen3MoeConfig`` or ``DeepseekV3Config``)."""
        if self.arch == "deepseek_v3":
            return self.deepseek_config(eos_token_id)
        return self.qwen3_config(eos_token_id, output_router_logits=True)

    def deepseek_config(self, eos_token_id: int):
        """The transformers ``DeepseekV3Config`` of this architecture (arch="deepseek_v3").

        Multi-head latent attention without the query compression (``q_lora_rank=None``), rotary embedding not
        interleaved, tied input/output embeddings, no multi-token-prediction layer.
        """
        if self.arch != "deepseek_v3":
            raise ValueError(f"deepseek_config needs arch='deepseek_v3', got {self.arch!r}")
        from transformers import DeepseekV3Config

        return DeepseekV3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.dense_intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            n_shared_experts=self.num_shared_experts,
            n_routed_experts=self.num_experts,
            num_experts_per_tok=self.top_k,
            n_group=self.expert_groups,
            topk_group=self.topk_groups,
            first_k_dense_replace=self.first_k_dense,
            routed_scaling_factor=self.routed_scaling_factor,
            norm_topk_prob=self.norm_topk_prob,
            kv_lora_rank=self.kv_lora_rank,
            q_lora_rank=None,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            rope_interleave=False,
            max_position_embeddings=self.max_position_embeddings,
            num_nextn_predict_layers=0,
            tie_word_embeddings=True,
            experts_implementation=self.experts_implementation,
            bos_token_id=eos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )

    def qwen3_config(self, eos_token_id: int, output_router_logits: bool = True):
        """The transformers ``Qwen3MoeConfig`` of this architecture."""
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=4 * self.hidden_size,  # dense MLP width; unused since every layer is MoE
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            moe_intermediate_size=self.moe_intermediate_size,
            num_experts=self.num_experts,
            num_experts_per_tok=self.top_k,
            norm_topk_prob=self.norm_topk_prob,
            output_router_logits=output_router_logits,
            router_aux_loss_coef=self.router_aux_loss_coef,
            tie_word_embeddings=True,
            bos_token_id=eos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )


PRESETS: dict[str, ReferenceConfig] = {
    "default": ReferenceConfig(),
    # A few seconds on a laptop: the whole pipeline (corpus, tokenizer, training, saving, prompts) at toy size.
    "tiny": ReferenceConfig(
        vocab_size=384, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, num_experts=8,
        top_k=2, moe_intermediate_size=16, max_position_embeddings=128, steps=4, seq_len=32,
        batch_mix=(("code", 1), ("chat", 1), ("general", 1), ("math", 1)), warmup_steps=1, eval_every=2,
        eval_seqs=2, math_problems=800, max_train_docs=30, tokenizer_bytes=60_000, prompts_per_domain=3,
        prompt_min_tokens=8, prompt_max_tokens=24, save_dtype="float32", sample_tokens=4,
    ),
}
# The second reference model (issue 13): DeepSeek-V3's shape (group-limited routing, shared experts, dense first
# layer, auxiliary-loss-free balancing) with Instella-MoE's expert counts (64 routed, top-6, 2 shared), scaled to
# 13.4 M parameters (26.8 MB in bfloat16) so that it trains in under 90 minutes on 2 CPU cores
# (docs/REFERENCE_MODEL.md, "The fine-grained model", has the step-time measurement behind `steps`).
PRESETS["fine-grained"] = ReferenceConfig(
    arch="deepseek_v3", vocab_size=4096, hidden_size=192, num_layers=13, first_k_dense=1, dense_intermediate_size=512,
    num_heads=4, num_kv_heads=4, head_dim=32, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
    v_head_dim=32, num_experts=64, top_k=6, expert_groups=8, topk_groups=4, num_shared_experts=2,
    moe_intermediate_size=24, routed_scaling_factor=1.0, router_aux_loss_coef=0.0, bias_update_speed=0.001,
    experts_implementation="grouped_mm", max_position_embeddings=512,
    steps=1000, seq_len=256, batch_mix=(("code", 4), ("chat", 1), ("general", 4), ("math", 3)), warmup_steps=60,
    eval_every=100, subdomain_alpha=(("code", 0.5), ("general", 0.5)),
    corpus="subdomains", math_problems=60000,
    heldout_fraction=(("code", 0.45), ("chat", 0.36), ("general", 0.25), ("math", 0.06)),
    prompt_counts=(("code", 2600), ("chat", 250), ("general", 2500), ("math", 3000)), prompts_per_code_doc=6,
    prompt_min_tokens=16,
)
# The third reference model (issue 23): DeepSeek-V3's routing shape itself - 256 routed experts in 8 groups, top-4
# groups, top-8, one shared expert, the first layer dense, routed scaling 2.5, auxiliary-loss-free bias balancing -
# on 1 dense + 8 MoE layers at hidden 128 (14.2 M parameters, 28.5 MB in bfloat16). Measured before training:
# 2.0 s per step of 12 x 256 tokens on 2 cores, so 1,000 steps fit the 90-minute budget (docs/REFERENCE_MODEL.md).
# Same corpus, split and prompts as fine-grained (8,350 held-out prompts fill EP32 decode at 128 requests per GPU).
PRESETS["deepseek-v3-shape"] = replace(
    PRESETS["fine-grained"], hidden_size=128, num_layers=9, dense_intermediate_size=512, num_experts=256, top_k=8,
    num_shared_experts=1, moe_intermediate_size=16, routed_scaling_factor=2.5,
)
# The fine-grained pipeline at toy size: same routing shape (64 experts, 8 groups, top-4 groups, top-6, 2 shared),
# one dense and two MoE layers, seconds to train.
PRESETS["tiny-fine-grained"] = replace(
    PRESETS["fine-grained"], vocab_size=384, hidden_size=32, num_layers=3, dense_intermediate_size=64, num_heads=2,
    num_kv_heads=2, head_dim=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    moe_intermediate_size=8, max_position_embeddings=128, steps=4, seq_len=32,
    batch_mix=(("code", 1), ("chat", 1), ("general", 1), ("math", 1)), warmup_steps=1, eval_every=2, eval_seqs=2,
    math_problems=2000, max_train_docs=30, tokenizer_bytes=60_000, prompt_counts=(), prompts_per_domain=6,
    prompt_min_tokens=8, prompt_max_tokens=24, save_dtype="float32", sample_tokens=4, bias_update_speed=0.01,
)


def preset(name: str, **overrides) -> ReferenceConfig:
    """A named config with fields overridden, e.g. ``preset("default", steps=200)``."""
    if name not in PRESETS:
        raise ValueError(f"unknown reference config {name!r}; expected one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def load_reference(device: str = "cpu", path: str | Path | None = None, dtype: str = "float32"):
    """(model, tokenizer) of the shipped reference model (or a model ``train-reference`` wrote to ``path``).

    The model is in eval mode on ``device``; weights are stored in bfloat16 and cast to ``dtype`` (float32 is
    faster on CPUs). Nothing is downloaded.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = REFERENCE_DIR if path is None else Path(path)
    if not (d / "config.json").is_file() or not (d / "model.safetensors").is_file():
        raise FileNotFoundError(f"no reference model in {d} (expected config.json and model.safetensors; "
                                "run `moeplace train-reference`)")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    import moeplace.models.foe  # noqa: F401  (registers the FoE model type, so FoE folders load too)

    model = AutoModelForCausalLM.from_pretrained(d, dtype=getattr(torch, dtype), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(d, local_files_only=True)
    return model.to(device).eval(), tokenizer


def builtin_prompts(path: str | Path | None = None) -> list[dict]:
    """The held-out prompts: rows ``{"prompt": str, "domain": str, "doc_id": str}`` (a model trained now also
    writes ``"subdomain"``), in the order code, chat, general, math: 250 per domain for the shipped model. None of
    their documents was seen in training (see the corpus manifest)."""
    p = (REFERENCE_DIR if path is None else Path(path)) / HELDOUT_PROMPTS_FILE
    if not p.is_file():
        raise FileNotFoundError(f"held-out prompts missing: {p}")
    rows = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                row = json.loads(line, object_pairs_hook=unique_keys)
            except ValueError as e:  # not JSON, or a key given twice
                raise ValueError(f"{p}:{n}: invalid JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{p}:{n}: expected {{\"prompt\": str, \"domain\": str, ...}}")
            rows.append(row)
    return rows
