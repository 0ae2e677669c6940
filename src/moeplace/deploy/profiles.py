"""Deployment profiles: how real deployments run a model's MoE layers, per phase, with their sources.

A profile names, for prefill and for decode apart (disaggregated serving runs them on different GPU pools): the
cluster (nodes of a GPU system from :data:`moeplace.deploy.hardware.CLUSTER_PRESETS`), how many tokens one GPU
carries per micro-batch (prefill: the chunk of C prompt tokens per GPU; decode: B running requests per GPU, one
token each per step), the dispatch/combine kernel and the replica rule, and the model's sizes that price a byte
and a FLOP (hidden size, element bytes of dispatch and combine, routed-expert FFN width).

Numbers are copied from the named public sources (documents and engine defaults, with the date they were read);
where a source leaves a value open the profile says which assumption it makes (``assumptions``). Explicit
options override single fields (``moeplace simulate T --profile NAME --cluster 2`` keeps everything else).

Shape legend: W = N * G GPUs of a phase.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class PhaseProfile:
    """One phase of a deployment: where it runs and how big its micro-batches are."""

    nodes: int  # N nodes of the profile's GPU system
    hardware: str  # cluster preset key (moeplace.deploy.hardware.CLUSTER_PRESETS), e.g. "h800-8"
    per_gpu: int  # prefill: prompt tokens per GPU per micro-batch (chunk C); decode: running requests per GPU (B)
    mode: str  # dispatch/combine kernel: "deepep-normal" (prefill) or "deepep-ll" (decode), or "nccl"
    rule: str = "nearest-least-loaded"  # replica choice rule (moeplace.simulate.routing)

    def __post_init__(self) -> None:
        for name in ("nodes", "per_gpu"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"profile phase: {name} must be a positive integer, got {v!r}")


@dataclass(frozen=True)
class Profile:
    """A named deployment: the model's sizes and one :class:`PhaseProfile` per phase."""

    name: str  # key, e.g. "deepseek-v3-published"
    summary: str  # one line for `moeplace profiles`
    model: str  # model preset key (moeplace.deploy.models.MODEL_PRESETS)
    hidden_size: int  # elements per token vector
    moe_intermediate_size: int  # routed expert FFN width (prices expert compute)
    dispatch_bytes: float  # bytes per element sent by dispatch (fp8: 1)
    combine_bytes: float  # bytes per element returned by combine (bf16: 2)
    prefill: PhaseProfile
    decode: PhaseProfile
    sources: tuple[str, ...]  # where the numbers come from, each with the date it was read
    assumptions: tuple[str, ...] = field(default=())  # what the sources leave open and the profile assumes

    def phase(self, name: str) -> PhaseProfile:
        if name not in PHASES:
            raise ValueError(f"profile {self.name}: phase must be one of {PHASES}, got {name!r}")
        return getattr(self, name)

    def world(self, phase: str) -> int:
        """W of a phase (nodes x the preset's GPUs per node)."""
        from moeplace.deploy.hardware import get_cluster_preset

        p = self.phase(phase)
        return p.nodes * get_cluster_preset(p.hardware).gpus_per_node

    def prefill_tokens(self) -> int:
        """Prompt tokens of one prefill micro-batch over all GPUs (C x W)."""
        return self.prefill.per_gpu * self.world("prefill")

    def decode_running(self) -> int:
        """Running requests of the decode phase over all GPUs (B x W): one token each per decode step."""
        return self.decode.per_gpu * self.world("decode")

    def to_json(self) -> dict:
        d = asdict(self)
        d["sources"], d["assumptions"] = list(self.sources), list(self.assumptions)
        d["prefill_tokens_per_microbatch"] = self.prefill_tokens()
        d["decode_running_requests"] = self.decode_running()
        return d


READ_ON = "read 2026-12-02"


def _vllm_gpt_oss(nodes: int) -> Profile:
    """vLLM wide-EP with a gpt-oss-20b / Qwen3-30B-A3B class model on ``nodes`` x 8 H200 (the same defaults at
    every size; only the node count differs)."""
    ep = 8 * nodes
    return Profile(
        f"vllm-gpt-oss-ep{ep}", f"vLLM wide-EP, gpt-oss-20b / Qwen3-30B-A3B class on {nodes} x 8 H200 (EP{ep}): "
        "8,192 tokens per GPU per step, 128 running requests per GPU",
        model="gpt-oss-20b", hidden_size=2880, moe_intermediate_size=2880, dispatch_bytes=1.0, combine_bytes=2.0,
        prefill=PhaseProfile(nodes, "h200-8", 8192, "deepep-normal"),
        decode=PhaseProfile(nodes, "h200-8", 128, "deepep-ll"),
        sources=(
            "vLLM engine/arg_utils.py get_batch_defaults (" + READ_ON + "): GPUs with >= 70 GiB (not A100), "
            "OpenAI server: max_num_batched_tokens 8192, max_num_seqs 1024 per engine (DP rank)",
            "vLLM docs, 'Expert Parallel Deployment' (--enable-expert-parallel with --data-parallel-size, multi-node "
            "DP + EP; DeepEP high-throughput kernels for prefill and low-latency for decode) (" + READ_ON + ")",
        ),
        assumptions=("128 running requests per GPU, a loaded server below vLLM's 1024 cap",),
    )


PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile(
        "deepseek-v3-published", "DeepSeek-V3 as DeepSeek serves it: prefill EP32 (4 x 8 H800), 16K tokens per GPU; "
        "decode EP128 (16 x 8 H800), 128 requests per GPU",
        model="deepseek-v3", hidden_size=7168, moe_intermediate_size=2048, dispatch_bytes=1.0, combine_bytes=2.0,
        prefill=PhaseProfile(4, "h800-8", 16384, "deepep-normal"),
        decode=PhaseProfile(16, "h800-8", 128, "deepep-ll"),
        sources=(
            "DeepSeek profile-data README, github.com/deepseek-ai/profile-data (2025-02-27; " + READ_ON + "): "
            "prefill EP32 TP1, 4K prompts, 16K tokens per GPU; decode EP128 TP1, 4K prompts, 128 requests per GPU",
            "DeepSeek open-infra-index, Day 6 'DeepSeek-V3/R1 Inference System Overview' (2025-03-01): prefill "
            "EP32 over 4 nodes with 32 redundant experts (9 routed experts per GPU); decode EP144 over 18 nodes",
            "DeepSeek-V3 technical report, arXiv 2412.19437 (2024-12-27), section 3.4 (prefill 4 nodes / 32 GPUs; "
            "FP8 dispatch, BF16 combine)",
        ),
        assumptions=("H800 links as docs/PRESETS.md gives them (NVLink 200 GB/s, 50 GB/s InfiniBand per GPU)",
                     "decode EP128 (the profile-data setting) rather than the EP144 production unit"),
    ),
    Profile(
        "sglang-h200-ep16", "SGLang on 2 x 8 H200 (EP16, DP attention): 8,192-token prefill chunks per GPU, up to "
        "256 running requests per GPU",
        model="deepseek-v3", hidden_size=7168, moe_intermediate_size=2048, dispatch_bytes=1.0, combine_bytes=2.0,
        prefill=PhaseProfile(2, "h200-8", 8192, "deepep-normal"),
        decode=PhaseProfile(2, "h200-8", 256, "deepep-ll"),
        sources=(
            "SGLang docs, 'DeepSeek V3/V3.1/R1 Usage': recommended configuration 2 x 8 x H200 (" + READ_ON + ")",
            "SGLang server_args.py defaults (" + READ_ON + "): chunked_prefill_size 8192 for GPUs under 160 GB "
            "(H100, H200); cuda_graph_max_bs 256 when tp < 4 (one DP-attention rank per GPU)",
        ),
        assumptions=("the decode batch is the CUDA-graph maximum, i.e. a fully loaded server",),
    ),
    *(_vllm_gpt_oss(nodes) for nodes in (1, 4)),
)}


def get_profile(name: str) -> Profile:
    """The profile named ``name``; ValueError listing the known names otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)} (moeplace profiles)") from None


OVERRIDABLE = ("cluster", "cluster_preset", "hidden_size", "dispatch_bytes", "combine_bytes", "mode", "rule",
               "overlap", "prefill_tokens", "decode_running", "decode_batch")


def phase_deployments(profile: Profile, **overrides: object) -> dict:  # phase -> moeplace.deploy.Deployment
    """One :class:`~moeplace.deploy.Deployment` per phase of ``profile``, each with the phase's cluster, kernel,
    rule and batch sizes (prefill: C x W tokens per micro-batch; decode: B x W running requests, continuous
    batching, and windows of as many requests for planners that price windows).

    ``overrides`` (:data:`OVERRIDABLE`; None values are ignored) replace single fields in both phases: ``cluster``
    is a ``--cluster`` spec (a node count keeps the phase's hardware), ``cluster_preset`` the hardware; per-GPU batch
    sizes are kept when the cluster changes, unless ``prefill_tokens`` / ``decode_running`` give totals.
    """
    from moeplace.deploy import Deployment
    from moeplace.deploy.hardware import parse_cluster

    bad = sorted(set(overrides) - set(OVERRIDABLE))
    if bad:
        raise ValueError(f"profile {profile.name}: cannot override {', '.join(bad)}")
    o = {k: v for k, v in overrides.items() if v is not None and v is not False}
    out = {}
    for ph in PHASES:
        p = profile.phase(ph)
        hw = o.get("cluster_preset", p.hardware)
        cluster = parse_cluster(str(o.get("cluster", p.nodes)), hw)
        W = cluster.world_size
        running = int(o.get("decode_running", profile.decode.per_gpu * W))
        out[ph] = Deployment(
            cluster, hw, int(o.get("hidden_size", profile.hidden_size)),
            float(o.get("dispatch_bytes", profile.dispatch_bytes)),
            float(o.get("combine_bytes", profile.combine_bytes)),
            str(o.get("mode", p.mode)), str(o.get("rule", p.rule)), bool(o.get("overlap", False)),
            int(o.get("decode_batch", running)), int(o.get("prefill_tokens", profile.prefill.per_gpu * W)), running,
            profile.moe_intermediate_size, profile.name)
    return out


def merged_deployment(profile: Profile, deployments: dict):  # -> moeplace.deploy.Deployment
    """The one deployment of a profile whose phases run on the same cluster (kernel ``auto`` when prefill uses
    deepep-normal and decode deepep-ll); ValueError naming the two clusters when they differ (choose a phase)."""
    import dataclasses

    pre, dec = deployments["prefill"], deployments["decode"]
    if pre.cluster.spec() != dec.cluster.spec() or pre.cluster_preset != dec.cluster_preset:
        raise ValueError(f"profile {profile.name} runs prefill on {pre.cluster.spec()} and decode on "
                         f"{dec.cluster.spec()} ({pre.cluster_preset} nodes): choose one with --profile-phase "
                         "prefill|decode")
    if pre.rule != dec.rule:
        raise ValueError(f"profile {profile.name}: prefill and decode use different replica rules; choose "
                         "--profile-phase")
    modes = (pre.mode, dec.mode)
    mode = pre.mode if pre.mode == dec.mode else "auto" if modes == ("deepep-normal", "deepep-ll") else None
    if mode is None:
        raise ValueError(f"profile {profile.name}: kernels {modes} are not one mode; choose --profile-phase or "
                         "--mode")
    return dataclasses.replace(dec, mode=mode, prefill_tokens=pre.prefill_tokens)


def default_redundant(num_experts: int, world_size: int) -> int:
    """Redundant slots a profile gives by default: one per GPU (DeepSeek's 32 at EP32), plus what makes the slots
    divide evenly among GPUs: the smallest R >= W with (E + R) % W == 0."""
    return world_size + (-num_experts) % world_size


def format_profiles(profiles: list[Profile]) -> str:
    """One line per profile: name, the two pools and their micro-batch sizes, then its summary."""
    from moeplace.deploy.hardware import get_cluster_preset

    lines = [f"{'profile':<24}{'prefill':<30}{'decode':<30}model sizes"]
    for p in profiles:
        cells = []
        for ph in PHASES:
            q = p.phase(ph)
            G = get_cluster_preset(q.hardware).gpus_per_node
            unit = "tok" if ph == "prefill" else "req"
            cells.append(f"{q.nodes}x{G} {q.hardware} {q.per_gpu:,} {unit}/GPU")
        sizes = f"hidden {p.hidden_size}, expert {p.moe_intermediate_size}"
        lines.append(f"{p.name:<24}{cells[0]:<30}{cells[1]:<30}{sizes}")
    lines.append("(moeplace profiles NAME: kernels, rules, sources and assumptions)")
    return "\n".join(lines)


def format_profile(p: Profile) -> str:
    """Everything a profile says, sources and assumptions included."""
    lines = [f"{p.name}: {p.summary}", f"  model sizes ({p.model}): hidden {p.hidden_size}, routed expert FFN "
             f"{p.moe_intermediate_size}, dispatch {p.dispatch_bytes:g} B/element, combine "
             f"{p.combine_bytes:g} B/element"]
    for ph in PHASES:
        q = p.phase(ph)
        per = (f"{q.per_gpu:,} prompt tokens per GPU per micro-batch ({p.prefill_tokens():,} in all)" if ph == "prefill"
               else f"{q.per_gpu:,} running requests per GPU ({p.decode_running():,} in all, continuous batching)")
        lines.append(f"  {ph}: {q.nodes} x {q.hardware} (EP{p.world(ph)}), {per}, kernel {q.mode}, rule {q.rule}")
    lines += ["  sources:"] + [f"    - {s}" for s in p.sources]
    if p.assumptions:
        lines += ["  assumptions:"] + [f"    - {a}" for a in p.assumptions]
    return "\n".join(lines)


def _check_registry() -> None:
    from moeplace.deploy.hardware import CLUSTER_PRESETS
    from moeplace.deploy.models import MODEL_PRESETS

    for p in PROFILES.values():
        assert p.model in MODEL_PRESETS, f"profile {p.name}: unknown model {p.model}"
        assert p.sources, f"profile {p.name}: no source"
        for ph in PHASES:
            assert p.phase(ph).hardware in CLUSTER_PRESETS, f"profile {p.name}: unknown hardware"


_check_registry()

__all__ = ["OVERRIDABLE", "PHASES", "PROFILES", "PhaseProfile", "Profile", "default_redundant", "format_profile",
           "format_profiles", "get_profile", "merged_deployment", "phase_deployments"]
