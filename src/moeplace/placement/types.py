"""Clusters, placements and plans: the types shared by the planner, the simulator and the runtime.

Shape legend: L = MoE layers, E = logical experts, P = physical slots (E + R redundant), W = GPUs (ranks),
S = P / W slots per GPU, R_req = requests, M = max replicas of one expert.

Conventions (docs/MODEL.md): slot ``p`` lives on GPU ``p // S``; GPU ``g`` on node ``g // G``;
``phy2log[l, p]`` is the logical expert held by slot ``p`` in layer ``l`` (DeepSeek EPLB / SGLang convention).

Example: 256 logical + 32 redundant = 288 slots over 32 GPUs = 9 slots per GPU.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moeplace.budget import check_memory
from moeplace.io import atomic_write_json
from moeplace.placement.grouper import Grouper

PLAN_FORMAT_VERSION = 2  # 2: grouper, balance outcome, fallback and cost model are typed fields (1: in ``extra``)
MAX_NODES = 1 << 12  # N: bounds every [W]-sized allocation made from a cluster spec or a plan file
MAX_WORLD = 1 << 16  # W = N * G
MAX_PLACEMENT_CELLS = 1 << 26  # L * P of one placement (512 MiB of int64)
MAX_DERIVED_CELLS = 1 << 27  # L * E * max(W, M): the log2phy and expert-GPU tables derived from a placement
PLACEMENT_BYTES_PER_CELL = 64  # peak bytes per L * max(P, E * W) cell of a placement, its tables and the simulator's


def check_slot_count(num_experts: int, num_redundant: int, num_gpus: int, num_layers: int = 1) -> None:
    """ValueError unless E + R slots fit on W GPUs with each GPU holding an expert at most once (S = P / W <= E),
    the [L, P] table stays under :data:`MAX_PLACEMENT_CELLS`, the [L, E, W] tables under :data:`MAX_DERIVED_CELLS`
    and all of them (:data:`PLACEMENT_BYTES_PER_CELL`) within the memory budget. Checked before anything is
    allocated."""
    E, R, W = int(num_experts), int(num_redundant), int(num_gpus)
    if R < 0:
        raise ValueError(f"num_redundant must be >= 0, got {R}")
    if E < 1 or W < 1:
        raise ValueError(f"placement: num_experts and num_gpus must be >= 1, got {E}, {W}")
    if E + R > E * W:
        raise ValueError(f"num_redundant={R}: {E} experts + {R} redundant slots put more than {E} slots on each of "
                         f"{W} GPUs, so some GPU would hold an expert twice; at most {E * (W - 1)} redundant slots")
    if num_layers * (E + R) > MAX_PLACEMENT_CELLS:
        raise ValueError(f"num_redundant={R}: {num_layers} layers x {E + R} slots is more than "
                         f"{MAX_PLACEMENT_CELLS} cells")
    L = int(num_layers)
    if L * E * W > MAX_DERIVED_CELLS:  # the expert x GPU tables derived from it (checked again on the placement)
        raise ValueError(f"placement: {L} layers x {E} experts x {W} GPUs is more than {MAX_DERIVED_CELLS} cells (its "
                         "derived tables would not fit)")
    check_memory(PLACEMENT_BYTES_PER_CELL * L * max(E + R, E * W), f"the placement tables of {L} layers x {E} "
                 f"experts on {W} GPUs", "placement")


def replica_counts(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 [L, E]: slots holding each expert. phy2log: int [L, P] (ids assumed in [0, E))."""
    p2l = np.atleast_2d(np.asarray(phy2log, np.int64))
    L, P = p2l.shape
    flat = (np.arange(L)[:, None] * num_experts + p2l).ravel()
    return np.bincount(flat, minlength=L * num_experts).reshape(L, num_experts)


def linear_phy2log(num_layers: int, num_experts: int, num_slots: int) -> np.ndarray:
    """int [L, P]: expert e on slot e; redundant slot E + j holds expert j (SGLang's and vLLM's initial map)."""
    return np.tile(np.arange(num_slots) % num_experts, (num_layers, 1)).astype(np.int64)


def log2phy_table(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 [L, E, M]: the slots of each expert in increasing order, padded with -1 (M = max replicas).

    phy2log: int [L, P]. The one construction of ``log2phy`` (EPLB's and SGLang's convention); the simulator's
    replica candidates are this table.
    """
    p2l = np.atleast_2d(np.asarray(phy2log, np.int64))
    L, P = p2l.shape
    cnt = replica_counts(p2l, num_experts)
    M = max(int(cnt.max()), 1) if cnt.size else 1
    order = np.argsort(p2l, axis=1, kind="stable")  # slots grouped by expert, ascending within
    srt = np.take_along_axis(p2l, order, 1)
    start = np.cumsum(cnt, 1) - cnt
    rank = np.arange(P)[None, :] - np.take_along_axis(start, srt, 1)
    out = np.full((L, num_experts, M), -1, np.int64)
    out[np.arange(L)[:, None], srt, rank] = order
    return out


@dataclass(frozen=True)
class Cluster:
    """An expert-parallel cluster of ``num_nodes`` x ``gpus_per_node`` GPUs and its links (alpha-beta model)."""

    num_nodes: int  # N
    gpus_per_node: int  # G
    intra_bw: float = 450e9  # bytes/s per GPU inside a node (NVLink 4 on H100: 450 GB/s per direction)
    inter_bw: float = 50e9  # bytes/s per GPU between nodes (400 Gb/s InfiniBand NDR: 50 GB/s)
    intra_latency: float = 3e-6  # seconds per message inside a node (alpha)
    inter_latency: float = 10e-6  # seconds per message between nodes (alpha)
    expert_flops: float = 400e12  # achieved FLOP/s per GPU for expert GEMMs (compute time model)
    hbm_bw: float = 3.35e12  # bytes/s of HBM per GPU (H100 SXM: 3.35 TB/s): the roofline's memory term
    compute_overhead: float = 0.0  # seconds per expert-compute kernel of a micro-batch and layer (presets set it)

    def __post_init__(self) -> None:
        for name in ("num_nodes", "gpus_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"cluster: {name} must be a positive integer, got {v!r}")
        if self.num_nodes > MAX_NODES or self.num_nodes * self.gpus_per_node > MAX_WORLD:
            raise ValueError(f"cluster {self.num_nodes}x{self.gpus_per_node}: at most {MAX_NODES} nodes and "
                             f"{MAX_WORLD} GPUs in all")
        for name in ("intra_bw", "inter_bw", "expert_flops", "hbm_bw"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not 0 < v < float("inf"):
                raise ValueError(f"cluster: {name} must be a finite number > 0, got {v!r}")
        for name in ("intra_latency", "inter_latency", "compute_overhead"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not 0 <= v < float("inf"):
                raise ValueError(f"cluster: {name} must be a finite number >= 0, got {v!r}")

    @property
    def world_size(self) -> int:
        """W = N * G expert-parallel ranks."""
        return self.num_nodes * self.gpus_per_node

    @property
    def bw_ratio(self) -> float:
        """r = B_intra / B_inter."""
        return self.intra_bw / self.inter_bw

    def node_of(self, gpu: np.ndarray | int) -> np.ndarray | int:
        """Node of each GPU id (same shape as ``gpu``)."""
        return np.asarray(gpu) // self.gpus_per_node if not isinstance(gpu, int) else gpu // self.gpus_per_node

    @classmethod
    def parse(cls, spec: str, **kw) -> Cluster:
        """``"4x2"`` -> 4 nodes x 2 GPUs per node (keyword arguments set the links)."""
        m = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", str(spec))
        if not m:
            raise ValueError(f"cluster spec {spec!r}: expected NODESxGPUS, e.g. '4x2'")
        return cls(int(m.group(1)), int(m.group(2)), **kw)

    def spec(self) -> str:
        return f"{self.num_nodes}x{self.gpus_per_node}"

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_json(cls, d: object, where: str = "cluster") -> Cluster:
        """A cluster from its JSON object (validated: ``where`` names the file or field in errors)."""
        from moeplace import schema

        m = schema.validate(schema.ClusterJSON, d, where)
        try:
            return cls(**{k: v for k, v in m.model_dump().items() if v is not None})
        except ValueError as e:
            raise schema.SchemaError(f"{where}: {e}") from None


@dataclass
class Placement:
    """Which logical expert each physical slot holds, per layer. Validated on construction."""

    phy2log: np.ndarray  # int64 [L, P]
    num_experts: int  # E
    num_gpus: int  # W; P must be divisible by W
    allow_colocated_replicas: bool = False  # two slots of one expert on one GPU is wasted memory; refused by default

    def __post_init__(self) -> None:
        p2l = np.asarray(self.phy2log)
        if p2l.ndim != 2:
            raise ValueError(f"phy2log: expected shape [L, P], got {p2l.shape}")
        if p2l.size and p2l.dtype.kind not in "iu":
            raise ValueError(f"phy2log: expected integer expert ids, got dtype {p2l.dtype}")
        self.phy2log = p2l.astype(np.int64)
        L, P = self.phy2log.shape
        E, W = int(self.num_experts), int(self.num_gpus)
        if E < 1 or W < 1:
            raise ValueError(f"placement: num_experts and num_gpus must be >= 1, got {E}, {W}")
        if P % W:
            raise ValueError(f"placement: {P} slots per layer are not divisible by {W} GPUs")
        if P < E:
            raise ValueError(f"placement: {P} slots cannot hold {E} experts")
        if p2l.size and (self.phy2log.min() < 0 or self.phy2log.max() >= E):
            bad = int(self.phy2log.min()) if self.phy2log.min() < 0 else int(self.phy2log.max())
            raise ValueError(f"phy2log: expert id {bad} out of range [0, {E})")
        if L * P > MAX_PLACEMENT_CELLS:
            raise ValueError(f"placement: {L} layers x {P} slots is more than {MAX_PLACEMENT_CELLS} cells")
        cnt = self.replica_count
        if L * E * max(W, int(cnt.max(initial=1))) > MAX_DERIVED_CELLS:
            raise ValueError(f"placement: {L} layers x {E} experts x {max(W, int(cnt.max(initial=1)))} GPUs or "
                             f"replicas is more than {MAX_DERIVED_CELLS} cells (its derived tables would not fit)")
        missing = np.argwhere(cnt == 0)
        if len(missing):
            layer, e = missing[0]
            raise ValueError(f"placement: expert {e} has no slot in layer {layer} (every expert must be placed)")
        if not self.allow_colocated_replicas and L:
            S = P // W
            gpu_expert = self.phy2log.reshape(L, W, S)
            srt = np.sort(gpu_expert, axis=2)
            dup = np.argwhere(srt[:, :, 1:] == srt[:, :, :-1])
            if len(dup):
                layer, g, j = dup[0]
                raise ValueError(
                    f"placement: expert {srt[layer, g, j]} has two replicas on GPU {g} in layer {layer}"
                )

    # -- derived
    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_slots(self) -> int:
        """P = E + R."""
        return self.phy2log.shape[1]

    @property
    def slots_per_gpu(self) -> int:
        """S = P / W."""
        return self.num_slots // self.num_gpus

    @property
    def slot_gpu(self) -> np.ndarray:
        """int [P]: GPU of each slot."""
        return np.arange(self.num_slots) // self.slots_per_gpu

    @property
    def replica_count(self) -> np.ndarray:
        """int [L, E]: slots holding each expert."""
        return replica_counts(self.phy2log, int(self.num_experts))

    @property
    def log2phy(self) -> np.ndarray:
        """int [L, E, M]: slots of each expert in increasing order, padded with -1 (M = max replicas)."""
        return log2phy_table(self.phy2log, int(self.num_experts))

    def expert_gpu_mask(self) -> np.ndarray:
        """bool [L, E, W]: whether GPU w holds a replica of expert e in layer l."""
        L, P = self.phy2log.shape
        m = np.zeros((L, int(self.num_experts), self.num_gpus), bool)
        gpus = np.broadcast_to(self.slot_gpu, (L, P))
        layers = np.broadcast_to(np.arange(L)[:, None], (L, P))
        m[layers, self.phy2log, gpus] = True
        return m

    # -- named constructors
    @classmethod
    def linear(cls, num_layers: int, num_experts: int, num_gpus: int, num_redundant: int = 0) -> Placement:
        """Engines' default: expert e on slot e; redundant slot E + j holds expert j (j < R)."""
        check_slot_count(num_experts, num_redundant, num_gpus, num_layers)
        P = num_experts + num_redundant
        if P % num_gpus:
            raise ValueError(f"linear placement: {num_experts} experts + {num_redundant} redundant slots are not "
                             f"divisible by {num_gpus} GPUs")
        return cls(linear_phy2log(num_layers, num_experts, P), num_experts, num_gpus)


@dataclass(frozen=True)
class BalanceOutcome:
    """Whether a strategy with a balance floor met it on its planning window."""

    floor: float  # required balancedness (mean/max GPU load per layer, averaged), in (0, 1]
    achieved: float | None  # balancedness of the final placement as the strategy measured it (None: not measured)

    def __post_init__(self) -> None:
        if not 0 < self.floor <= 1:
            raise ValueError(f"balance: floor must be in (0, 1], got {self.floor!r}")
        if self.achieved is not None and not 0 <= self.achieved < float("inf"):
            raise ValueError(f"balance: achieved must be a finite number >= 0, got {self.achieved!r}")

    @property
    def met(self) -> bool:
        return self.achieved is not None and self.achieved >= self.floor

    def to_json(self) -> dict:
        return {"floor": float(self.floor), "achieved": None if self.achieved is None else float(self.achieved),
                "met": self.met}


@dataclass(frozen=True)
class Fallback:
    """The strategy could not do its own job and used another method's result instead."""

    used: str  # what produced the placement instead ("eplb": EPLB's placement; "coactivation": METIS)
    reason: str  # why, in the strategy's words

    def to_json(self) -> dict:
        return {"used": self.used, "reason": self.reason}


@dataclass(frozen=True)
class CostModel:
    """The cost a strategy minimised, when it used one (names as in ``moeplace.simulate.CostConfig`` and the
    deployment option group, ``moeplace.deploy.Deployment``). The cluster it priced (topology and links) is the
    plan's ``cluster``.

    JSON: the first eight keys are always written; the batch and overlap keys (added later) only when they differ
    from the library defaults, so a plan made with the defaults reads the same as before them; reading fills the
    defaults back in, so a cost model round-trips.
    """

    objective: str  # what was minimised, e.g. "layer_time" or "inter_node_bytes"
    rule: str | None = None  # replica choice rule (moeplace.simulate.RULES)
    dedup: str | None = None  # comm mode: "per_gpu" / "two_hop"; for "layer_time" the kernel mode (nccl, ..., auto)
    hidden_size: int | None = None  # elements per token vector
    dispatch_bytes: float | None = None  # bytes per element sent by dispatch
    combine_bytes: float | None = None  # bytes per element returned by combine
    intermediate_size: int | None = None  # expert FFN width
    pair_flops: float | None = None  # FLOPs of one token-expert pair
    overlap: bool = False  # two-batch overlap of dispatch, expert compute and combine
    decode_batch: int = 256  # requests per decode window of the micro-batches it priced
    prefill_tokens: int = 8192  # prefill micro-batch token budget

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for k, f in self.__dataclass_fields__.items():
            if k in COST_MODEL_DEFAULTED and d[k] == f.default:
                del d[k]
        return d


COST_MODEL_DEFAULTED = ("overlap", "decode_batch", "prefill_tokens")  # written only when not the default


@dataclass(frozen=True)
class ModelLayers:
    """Where a plan's MoE layers sit among the model's decoder layers (engines index their maps by the latter).

    DeepSeek-V3: 61 decoder layers, the first 3 dense, so ``moe_layer_map = (3, ..., 60)`` and
    ``num_decoder_layers = 61``; MoE layer l of the plan is the model's layer ``moe_layer_map[l]``.
    """

    moe_layer_map: tuple[int, ...]  # [L] model layer id of each MoE layer, distinct
    num_decoder_layers: int  # D: the model's decoder layers, dense ones included (> every mapped id)

    def __post_init__(self) -> None:
        lm = tuple(int(x) for x in self.moe_layer_map)
        object.__setattr__(self, "moe_layer_map", lm)
        if not lm or min(lm) < 0 or len(set(lm)) != len(lm):
            raise ValueError(f"model_layers: moe_layer_map must be distinct layer ids >= 0, got {list(lm)}")
        if not max(lm) < int(self.num_decoder_layers):
            raise ValueError(f"model_layers: num_decoder_layers={self.num_decoder_layers} but MoE layer id {max(lm)} "
                             "needs more")

    def to_json(self) -> dict:
        return {"moe_layer_map": list(self.moe_layer_map), "num_decoder_layers": int(self.num_decoder_layers)}


# Version-1 plans and strategies that still report in ``extra`` say "fallback" without saying to what.
LEGACY_FALLBACK_USED = {"joint": "eplb", "hypergraph": "coactivation"}


@dataclass(frozen=True)
class TypedOutcome:
    """The typed fields found among legacy ``extra`` keys, and the free-form rest."""

    extra: dict
    grouper: Grouper | None = None
    balance: BalanceOutcome | None = None
    fallback: Fallback | None = None
    cost_model: CostModel | None = None
    allow_colocated: bool = False


def typed_from_extra(extra: dict, strategy: str, where: str = "extra") -> TypedOutcome:
    """Split a version-1 plan's ``extra`` (or a strategy's ``StrategyResult.extra``) into typed fields.

    Keys mapped: ``grouper``, ``allow_colocated``, ``fallback`` (a reason string: :data:`LEGACY_FALLBACK_USED`
    says to what), ``balance_floor`` with the last of ``planning_balancedness``, ``cost_model``; ``num_redundant``
    is dropped (it is ``num_slots - num_experts``). Everything else stays in ``extra``.
    """
    from moeplace import schema

    m = schema.validate(schema.LegacyExtra, extra, where)
    rest = {k: v for k, v in extra.items() if k not in ("grouper", "allow_colocated", "fallback", "balance_floor",
                                                        "num_redundant", "cost_model")}
    grouper = Grouper.from_json(m.grouper.model_dump()) if m.grouper is not None else None
    balance = None
    if m.balance_floor is not None:
        hist = m.planning_balancedness
        balance = BalanceOutcome(m.balance_floor, hist[-1] if hist else None)
    fallback = Fallback(LEGACY_FALLBACK_USED.get(strategy, "unknown"), m.fallback) if m.fallback else None
    cost = CostModel(**m.cost_model.model_dump()) if m.cost_model is not None else None
    return TypedOutcome(rest, grouper, balance, fallback, cost, m.allow_colocated)


@dataclass
class Plan:
    """A placement plus request homes on a cluster: what ``moeplace plan`` writes and the simulator replays.

    Plan JSON (format version 2) holds every field below; ``extra`` is free-form (strategy parameters and
    diagnostics) and nothing reads it back. Version-1 plans load too (:func:`typed_from_extra`).
    """

    placement: Placement
    cluster: Cluster
    homes: dict[int, int] = field(default_factory=dict)  # request_id -> home GPU; unlisted -> round-robin
    strategy: str = "linear"
    plan_seconds: float = 0.0  # seconds spent inside the strategy (in memory only: a plan's JSON is a function of
    # its inputs, so timings are never written into it)
    planned_on: str = ""  # the trace or load file the plan was made from
    extra: dict = field(default_factory=dict)  # free-form: strategy parameters and diagnostics (JSON-serialisable)
    grouper: Grouper | None = None  # homes for new requests from their prefill routing (None: round-robin)
    balance: BalanceOutcome | None = None  # the balance floor and whether it was met (strategies with a floor)
    fallback: Fallback | None = None  # set when the strategy used another method's result
    cost_model: CostModel | None = None  # the cost the strategy minimised, when it used one
    model_layers: ModelLayers | None = None  # the model's layer layout (from the trace); None: not known
    foe_groups: int = 1  # > 1: a Federation-of-Experts plan for H groups (placement.foe.FoeLayout; homes = ring index)

    @property
    def dispatch_rule(self) -> str | None:
        """The replica dispatch rule the plan was chosen for (its cost model's rule when it priced layer time), or
        None: the deployment's rule applies. The evaluation and ``simulate`` score a plan under this rule."""
        cm = self.cost_model
        return cm.rule if cm is not None and cm.objective == "layer_time" else None

    def __post_init__(self) -> None:
        W = self.cluster.world_size
        if isinstance(self.foe_groups, bool) or not isinstance(self.foe_groups, int) or self.foe_groups < 1:
            raise ValueError(f"plan: foe_groups must be an integer >= 1, got {self.foe_groups!r}")
        if self.foe_groups > 1:
            from moeplace.placement.foe import FoeLayout

            FoeLayout(self.foe_groups, W, self.cluster.gpus_per_node)
            pl = self.placement
            if pl.num_slots != pl.num_experts or pl.num_experts % self.foe_groups \
                    or not (pl.phy2log == np.arange(pl.num_experts)[None, :]).all():
                raise ValueError(f"plan: an FoE plan (foe_groups={self.foe_groups}) keeps expert e on slot e, "
                                 "without replicas, so that each group's experts stay on its GPUs")
        if self.model_layers is not None and len(self.model_layers.moe_layer_map) != self.placement.num_layers:
            raise ValueError(f"plan: model_layers maps {len(self.model_layers.moe_layer_map)} MoE layers but the "
                             f"placement has {self.placement.num_layers}")
        if self.placement.num_gpus != W:
            raise ValueError(
                f"plan: placement is for {self.placement.num_gpus} GPUs but cluster {self.cluster.spec()} has {W}"
            )
        for rid, g in self.homes.items():
            if not 0 <= int(g) < W:
                raise ValueError(f"plan: request {rid} has home GPU {g}, outside [0, {W})")
        if not isinstance(self.extra, dict):
            raise ValueError(f"plan: extra must be a dict, got {type(self.extra).__name__}")
        g = self.grouper
        if g is not None:
            L, E = self.placement.num_layers, self.placement.num_experts
            if g.gpus_per_node != self.cluster.gpus_per_node or g.num_nodes != self.cluster.num_nodes:
                raise ValueError(f"plan: grouper is for {g.num_nodes}x{g.gpus_per_node} GPUs but the cluster is "
                                 f"{self.cluster.spec()}")
            if g.layers is not None and any(not 0 <= x < L for x in g.layers):
                raise ValueError(f"plan: grouper layers {list(g.layers)} outside [0, {L})")
            D = (L if g.layers is None else len(g.layers)) * E
            if g.weights.shape[1] != D:
                raise ValueError(f"plan: grouper weights have {g.weights.shape[1]} columns, expected {D} "
                                 f"(feature layers x {E} experts)")

    def home_of(self, request_ids: np.ndarray) -> np.ndarray:
        """int [R_req]: home GPU of each request id; ids without a planned home go round-robin by first
        appearance order in ``request_ids`` (index % W), the engines' default."""
        rid = np.asarray(request_ids, np.int64)
        uniq, first = np.unique(rid, return_index=True)
        order = np.argsort(first, kind="stable")  # requests in order of first appearance
        rr = np.empty(len(uniq), np.int64)
        rr[order] = np.arange(len(uniq)) % self.cluster.world_size
        if self.homes:
            planned = np.array([self.homes.get(int(r), -1) for r in uniq], np.int64)
            rr = np.where(planned >= 0, planned, rr)
        return rr[np.searchsorted(uniq, rid)]

    # -- JSON
    def to_json(self) -> dict:
        return {
            "format_version": PLAN_FORMAT_VERSION,
            "strategy": self.strategy,
            "cluster": self.cluster.to_json(),
            "num_experts": int(self.placement.num_experts),
            "num_layers": self.placement.num_layers,
            "num_slots": self.placement.num_slots,
            "allow_colocated_replicas": bool(self.placement.allow_colocated_replicas),
            "phy2log": self.placement.phy2log.tolist(),
            "homes": {str(k): int(v) for k, v in sorted(self.homes.items())},
            "grouper": None if self.grouper is None else self.grouper.to_json(),
            "balance": None if self.balance is None else self.balance.to_json(),
            "fallback": None if self.fallback is None else self.fallback.to_json(),
            "cost_model": None if self.cost_model is None else self.cost_model.to_json(),
            "model_layers": None if self.model_layers is None else self.model_layers.to_json(),
            **({"foe_groups": self.foe_groups} if self.foe_groups > 1 else {}),
            "planned_on": self.planned_on,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, d: object, where: str = "plan") -> Plan:
        """A plan from its JSON (format version 1 or 2), validated: errors name ``where``, the field and the
        problem."""
        from moeplace import schema

        m = schema.plan_model(d, where)
        shape = (len(m.phy2log), len(m.phy2log[0]) if m.phy2log else 0)
        if len({len(row) for row in m.phy2log}) > 1:
            raise schema.SchemaError(f"{where}: phy2log: rows have different lengths (expected [L][P])")
        for name, want, got in (("num_layers", m.num_layers, shape[0]), ("num_slots", m.num_slots, shape[1])):
            if want is not None and want != got:
                raise schema.SchemaError(f"{where}: {name}: says {want} but phy2log is {shape[0]} x {shape[1]}")
        cluster = Cluster.from_json(m.cluster.model_dump(), f"{where}: cluster")
        try:
            if m.format_version == 1:
                t = typed_from_extra(m.extra, m.strategy, f"{where}: extra")
                typed = (t.grouper, t.balance, t.fallback, t.cost_model)
                extra, colocated, layers = t.extra, t.allow_colocated, None
            else:
                typed = (Grouper.from_json(m.grouper.model_dump()) if m.grouper else None,
                         BalanceOutcome(m.balance.floor, m.balance.achieved) if m.balance else None,
                         Fallback(m.fallback.used, m.fallback.reason) if m.fallback else None,
                         CostModel(**m.cost_model.model_dump()) if m.cost_model else None)
                extra, colocated = m.extra, m.allow_colocated_replicas
                layers = ModelLayers(tuple(m.model_layers.moe_layer_map), m.model_layers.num_decoder_layers) \
                    if m.model_layers else None
                if m.balance is not None and m.balance.met != typed[1].met:
                    raise ValueError(f"balance.met: says {m.balance.met} but achieved {m.balance.achieved} vs "
                                     f"floor {m.balance.floor} says {typed[1].met}")
            placement = Placement(np.asarray(m.phy2log, np.int64).reshape(shape), m.num_experts,
                                  cluster.world_size, allow_colocated_replicas=colocated)
            homes = {int(k): v for k, v in m.homes.items()}
            return cls(placement, cluster, homes, m.strategy, m.plan_seconds, m.planned_on, dict(extra), *typed,
                       model_layers=layers, foe_groups=getattr(m, "foe_groups", 1))
        except schema.SchemaError:
            raise
        except ValueError as e:
            raise schema.SchemaError(f"{where}: {e}") from None

    def save(self, path: str | os.PathLike) -> Path:
        """Write the plan JSON atomically."""
        p = Path(path)
        return atomic_write_json(self.to_json(), p, indent=None, allow_nan=False)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """Read and validate a plan file (see :meth:`from_json`)."""
        from moeplace import schema

        d = schema.read_json_file(path, "plan file")
        return cls.from_json(d, where=str(path))
