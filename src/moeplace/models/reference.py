"""The reference MoE model: a small Qwen3-MoE trained here on four domains (code, chat, general prose, math).

It ships in ``moeplace/data/reference`` (weights, config, tokenizer, model card, held-out prompts, corpus manifest)
and loads with plain transformers::

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(REFERENCE_DIR)
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_DIR)

:class:`ReferenceConfig` holds everything that makes the model (architecture, training, data) and
:data:`PRESETS` names the two configs: ``default`` (the shipped model) and ``tiny`` (for tests).
``moeplace train-reference`` (:mod:`moeplace.models.train`) rebuilds it from installed packages.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

REFERENCE_DIR = Path(__file__).resolve().parent.parent / "data" / "reference"
HELDOUT_PROMPTS_FILE = "heldout_prompts.jsonl"
MANIFEST_FILE = "corpus_manifest.json"
METRICS_FILE = "train_metrics.json"
EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class ReferenceConfig:
    """Architecture, training and data settings of the reference model (one comment per field)."""

    # --- architecture (Qwen3-MoE; every decoder layer is an MoE layer)
    vocab_size: int = 4096  # byte-level BPE vocabulary trained on the training split
    hidden_size: int = 128  # model width
    num_layers: int = 8  # decoder layers = MoE layers (L)
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
    save_dtype: str = "bfloat16"  # dtype of the saved weights ("float32" or "bfloat16")
    sample_tokens: int = 40  # greedy tokens generated per domain for the samples in train_metrics.json
    # --- data
    data_seed: int = 0  # seeds the math generator and the prompt cuts (the split itself is seed-free)
    math_problems: int = 40000  # generated math problems (before the split)
    heldout_fraction: tuple[tuple[str, float], ...] = (
        ("code", 0.45), ("chat", 0.36), ("general", 0.10), ("math", 0.01))  # documents held out per domain
    max_train_docs: int | None = None  # keep only this many training documents per domain (tests)
    tokenizer_bytes: int = 2_000_000  # training text per domain the tokenizer learns from
    prompts_per_domain: int = 250  # held-out prompts written per domain
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
        from moeplace.models.corpus import DOMAINS

        for name in ("batch_mix", "heldout_fraction"):
            keys = [k for k, _ in getattr(self, name)]
            if sorted(keys) != sorted(DOMAINS):
                raise ValueError(f"ReferenceConfig.{name} must name each of {DOMAINS} once, got {keys}")
        if any(n < 1 for _, n in self.batch_mix):
            raise ValueError(f"ReferenceConfig.batch_mix: every domain needs >= 1 sequence, got {self.batch_mix}")

    @property
    def batch_size(self) -> int:
        """Sequences per optimizer step (sum of batch_mix)."""
        return sum(n for _, n in self.batch_mix)

    def to_json(self) -> dict:
        return asdict(self)

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
    """The held-out prompts: rows ``{"prompt": str, "domain": str, "doc_id": str}``, 250 per domain in the
    order code, chat, general, math. None of their documents was seen in training (see the corpus manifest)."""
    p = (REFERENCE_DIR if path is None else Path(path)) / HELDOUT_PROMPTS_FILE
    if not p.is_file():
        raise FileNotFoundError(f"held-out prompts missing: {p}")
    rows = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{p}:{n}: expected {{\"prompt\": str, \"domain\": str, ...}}")
            rows.append(row)
    return rows
