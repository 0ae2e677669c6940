"""Named presets: frontier MoE models (published configurations) and GPU clusters (links and speeds).

Every model preset copies its numbers from the model's public ``config.json``; docs/PRESETS.md lists the source
of each. Workloads generated from these presets (:mod:`moeplace.synth`) are synthetic and labelled so.
Cluster presets give per-node GPU counts and per-GPU link speeds; choose the number of nodes when you use one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moeplace.placement import Cluster


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


@dataclass(frozen=True)
class ClusterPreset:
    """Per-node shape and per-GPU links of a GPU system (numbers are per direction)."""

    name: str
    gpus_per_node: int  # G
    intra_bw: float  # bytes/s per GPU inside a node (scale-up: NVLink / Infinity Fabric)
    inter_bw: float  # bytes/s per GPU between nodes (scale-out NIC per GPU)
    intra_latency: float  # seconds per message (alpha) inside a node
    inter_latency: float  # seconds per message between nodes
    expert_flops: float  # achieved FLOP/s per GPU on expert GEMMs (an assumption: about half of dense peak)
    hbm_bw: float  # bytes/s of HBM per GPU (vendor spec sheet; docs/PRESETS.md gives each source)
    note: str = ""
    compute_overhead: float = 5e-6  # seconds per expert-compute kernel (launch and tail; an assumption)

    def cluster(self, num_nodes: int) -> Cluster:
        return Cluster(num_nodes, self.gpus_per_node, self.intra_bw, self.inter_bw, self.intra_latency,
                       self.inter_latency, self.expert_flops, self.hbm_bw, self.compute_overhead)


GB = 1e9
CLUSTER_PRESETS: dict[str, ClusterPreset] = {c.name: c for c in (
    ClusterPreset("h100-8", 8, 450 * GB, 50 * GB, 3e-6, 10e-6, 400e12, 3350 * GB,
                  "DGX/HGX H100: NVLink 4 900 GB/s bidirectional; one 400 Gb/s ConnectX-7 NDR NIC per GPU"),
    ClusterPreset("h200-8", 8, 450 * GB, 50 * GB, 3e-6, 10e-6, 400e12, 4800 * GB,
                  "HGX H200: same NVLink 4 and 400 Gb/s NDR per GPU as H100; more HBM"),
    ClusterPreset("h800-8", 8, 200 * GB, 50 * GB, 3e-6, 10e-6, 400e12, 3350 * GB,
                  "H800 (DeepSeek's training cluster): NVLink 400 GB/s bidirectional, 400 Gb/s IB per GPU"),
    ClusterPreset("a100-8", 8, 300 * GB, 25 * GB, 3e-6, 10e-6, 150e12, 2039 * GB,
                  "DGX A100: NVLink 3 600 GB/s bidirectional; one 200 Gb/s HDR NIC per GPU"),
    ClusterPreset("b200-8", 8, 900 * GB, 50 * GB, 3e-6, 10e-6, 1000e12, 8000 * GB,
                  "HGX B200: NVLink 5 1.8 TB/s bidirectional; 400 Gb/s NIC per GPU (800 Gb/s with CX-8: use inter_bw)"),
    ClusterPreset("gb200-nvl72", 72, 900 * GB, 100 * GB, 3e-6, 10e-6, 1000e12, 8000 * GB,
                  "GB200 NVL72: 72 GPUs in one NVLink domain; 800 Gb/s ConnectX-8 per GPU between racks"),
    ClusterPreset("mi300x-8", 8, 448 * GB, 50 * GB, 4e-6, 10e-6, 500e12, 5300 * GB,
                  "AMD MI300X platform: 7 Infinity Fabric links x 64 GB/s per direction; 400 Gb/s NIC per GPU"),
)}


def get_cluster_preset(name: str) -> ClusterPreset:
    try:
        return CLUSTER_PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"cluster preset {name!r}: expected one of {sorted(CLUSTER_PRESETS)}") from None


def cluster_from_spec(spec: str, preset: str | None = None) -> Cluster:
    """A cluster from ``"NxG"`` (default links), a preset name (1 node), or nodes (``"4"`` / ``"4xG"``) + a preset."""
    s = str(spec).strip().lower()
    if preset is None:
        if s in CLUSTER_PRESETS:
            return CLUSTER_PRESETS[s].cluster(1)
        return Cluster.parse(s)
    cp = get_cluster_preset(preset)
    if s.isdigit():
        return cp.cluster(int(s))
    c = Cluster.parse(s)
    if c.gpus_per_node != cp.gpus_per_node:
        raise ValueError(f"cluster {spec!r}: preset {preset} has {cp.gpus_per_node} GPUs per node, not "
                         f"{c.gpus_per_node}")
    return cp.cluster(c.num_nodes)
