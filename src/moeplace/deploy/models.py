"""Model presets: the routing-relevant sizes of frontier MoE models (published configurations).

Every model preset copies its numbers from the model's public ``config.json``; docs/PRESETS.md lists the source
of each. Workloads generated from these presets (:mod:`moeplace.simulate.synth`) are synthetic and labelled so.
GPU systems (links and speeds) are in :mod:`moeplace.deploy.hardware`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelPreset:
    """The routing-relevant shape of one MoE model."""

    name: str  # preset key, e.g. "deepseek-v3"
    hf_id: str  # Hugging Face repository of the published config
    num_layers: int  # L: MoE layers (dense layers not counted)
    num_experts: int  # E: routed experts per MoE layer
    top_k: int  # K: routed experts per token
    num_shared_experts: int  # always-on experts (compute only, no all-to-all)
    hidden_size: int  # elements of one token vector
    moe_intermediate_size: int  # FFN width of one routed expert
    num_model_layers: int  # transformer blocks in the model
    moe_layer_map: tuple[int, ...]  # [L]: MoE layer l -> the model's block index
    num_kv_heads: int  # KV heads (the FoE group count H of docs/MODEL.md)
    n_group: int = 1  # group-limited routing: expert groups (1 = off)
    topk_group: int = 1  # groups a token may use
    note: str = ""  # what differs from a plain top-k MoE
    expert_weight_bytes: float = 2.0  # bytes per routed-expert weight element as published (bf16 2, fp8 1)

    def to_json(self) -> dict:
        d = asdict(self)
        d["moe_layer_map"] = list(self.moe_layer_map)
        return d


def _every(start: int, stop: int, step: int = 1) -> tuple[int, ...]:
    return tuple(range(start, stop, step))


MODEL_PRESETS: dict[str, ModelPreset] = {p.name: p for p in (
    ModelPreset("deepseek-v3", "deepseek-ai/DeepSeek-V3", 58, 256, 8, 1, 7168, 2048, 61, _every(3, 61), 128,
                n_group=8, topk_group=4, note="first 3 blocks dense; sigmoid router, group-limited 8 groups / top-4; "
                "MLA (128 heads share one latent KV); fp8 weights with 128x128 block scales", expert_weight_bytes=1.0),
    ModelPreset("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", 94, 128, 8, 0, 4096, 1536, 94, _every(0, 94), 4),
    ModelPreset("llama4-maverick", "meta-llama/Llama-4-Maverick-17B-128E", 24, 128, 1, 1, 5120, 8192, 48,
                _every(1, 48, 2), 8, note="MoE every other block (interleave_moe_layer_step=2); dense blocks "
                "use intermediate_size_mlp=16384"),
    ModelPreset("gpt-oss-20b", "openai/gpt-oss-20b", 24, 32, 4, 0, 2880, 2880, 24, _every(0, 24), 8,
                note="MXFP4 expert weights (4-bit values + one 8-bit scale per 32)", expert_weight_bytes=0.53125),
    ModelPreset("gpt-oss-120b", "openai/gpt-oss-120b", 36, 128, 4, 0, 2880, 2880, 36, _every(0, 36), 8,
                note="MXFP4 expert weights (4-bit values + one 8-bit scale per 32)", expert_weight_bytes=0.53125),
    ModelPreset("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", 32, 8, 2, 0, 4096, 14336, 32, _every(0, 32), 8),
    ModelPreset("olmoe-1b-7b", "allenai/OLMoE-1B-7B-0924", 16, 64, 8, 0, 2048, 1024, 16, _every(0, 16), 16),
    ModelPreset("instella-moe-16b-a3b", "amd/Instella-MoE-16B-A3B", 26, 64, 6, 2, 2048, 1408, 27, _every(1, 27), 16,
                note="DeepSeek-V3-style; block 0 dense (first_k_dense_replace=1) so 26 of 27 blocks are MoE; "
                "FarSkip residuals; n_group=1"),
)}


def get_model(name: str) -> ModelPreset:
    """The preset named ``name`` (key or Hugging Face id, case-insensitive)."""
    p = find_model(name)
    if p is None:
        raise ValueError(f"model preset {name!r}: expected one of {sorted(MODEL_PRESETS)}")
    return p


def find_model(model: str) -> ModelPreset | None:
    """The preset a model name refers to (key, Hugging Face id, or a path/name containing either), else None."""
    m = str(model).lower()
    for p in MODEL_PRESETS.values():
        if m in (p.name, p.hf_id.lower(), p.hf_id.split("/")[-1].lower()):
            return p
    hits = [p for p in MODEL_PRESETS.values() if p.hf_id.split("/")[-1].lower() in m or p.name in m]
    return max(hits, key=lambda p: len(p.hf_id)) if hits else None


def expert_groups(model: str) -> int:
    """Expert groups of group-limited routing (DeepSeek-V3: 8) of the model a trace names: its preset's
    ``n_group``, else ``n_group`` of the ``config.json`` in the model's folder (a trained reference model such as
    ``src/moeplace/data/reference-ds``; looked up as given and under the package's data folder), else 1."""
    import json
    from pathlib import Path

    from moeplace.io import unique_keys

    p = find_model(model)
    if p is not None and p.n_group > 1:
        return p.n_group
    here = Path(__file__).resolve().parents[1] / "data"
    for d in (Path(model), here / Path(model).name):
        try:
            cfg = json.loads((d / "config.json").read_text(), object_pairs_hook=unique_keys)
        except (OSError, ValueError):
            continue
        g = cfg.get("n_group") if isinstance(cfg, dict) else None
        if isinstance(g, int) and not isinstance(g, bool) and g >= 1:
            return g
    return 1
