"""Clusters, placements and plans: the types shared by the planner, the simulator and the runtime.

Shape legend: L = MoE layers, E = logical experts, P = physical slots (E + R redundant), W = GPUs (ranks),
S = P / W slots per GPU, R_req = requests, M = max replicas of one expert.

Conventions (docs/MODEL.md): slot ``p`` lives on GPU ``p // S``; GPU ``g`` on node ``g // G``;
``phy2log[l, p]`` is the logical expert held by slot ``p`` in layer ``l`` (DeepSeek EPLB / SGLang convention).

Example: 256 logical + 32 redundant = 288 slots over 32 GPUs = 9 slots per GPU.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moeplace.io import atomic_write_json

PLAN_FORMAT_VERSION = 1


def replica_counts(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 [L, E]: slots holding each expert. phy2log: int [L, P] (ids assumed in [0, E))."""
    p2l = np.atleast_2d(np.asarray(phy2log, np.int64))
    L, P = p2l.shape
    flat = (np.arange(L)[:, None] * num_experts + p2l).ravel()
    return np.bincount(flat, minlength=L * num_experts).reshape(L, num_experts)


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

    def __post_init__(self) -> None:
        for name in ("num_nodes", "gpus_per_node"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"cluster: {name} must be a positive integer, got {v!r}")
        for name in ("intra_bw", "inter_bw", "expert_flops"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cluster: {name} must be > 0, got {getattr(self, name)!r}")
        for name in ("intra_latency", "inter_latency"):
            if getattr(self, name) < 0:
                raise ValueError(f"cluster: {name} must be >= 0, got {getattr(self, name)!r}")

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
    def from_json(cls, d: dict) -> Cluster:
        if not isinstance(d, dict):
            raise ValueError(f"cluster: expected a JSON object, got {type(d).__name__}")
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"cluster: unknown keys {sorted(unknown)}")
        return cls(**d)


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
        cnt = self.replica_count
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
        P = num_experts + num_redundant
        if P % num_gpus:
            raise ValueError(f"linear placement: {num_experts} experts + {num_redundant} redundant slots are not "
                             f"divisible by {num_gpus} GPUs")
        row = np.arange(P) % num_experts
        return cls(np.tile(row, (num_layers, 1)), num_experts, num_gpus)


@dataclass
class Plan:
    """A placement plus request homes on a cluster: what ``moeplace plan`` writes and the simulator replays."""

    placement: Placement
    cluster: Cluster
    homes: dict[int, int] = field(default_factory=dict)  # request_id -> home GPU; unlisted -> round-robin
    strategy: str = "linear"
    plan_seconds: float = 0.0  # seconds spent inside the strategy (in memory only: a plan's JSON is a function of
    # its inputs, so timings are never written into it)
    planned_on: str = ""  # the trace or load file the plan was made from
    extra: dict = field(default_factory=dict)  # strategy parameters and diagnostics

    def __post_init__(self) -> None:
        W = self.cluster.world_size
        if self.placement.num_gpus != W:
            raise ValueError(
                f"plan: placement is for {self.placement.num_gpus} GPUs but cluster {self.cluster.spec()} has {W}"
            )
        for rid, g in self.homes.items():
            if not 0 <= int(g) < W:
                raise ValueError(f"plan: request {rid} has home GPU {g}, outside [0, {W})")

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
            "phy2log": self.placement.phy2log.tolist(),
            "homes": {str(k): int(v) for k, v in sorted(self.homes.items())},
            "planned_on": self.planned_on,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, d: dict, where: str = "plan") -> Plan:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a JSON object")
        v = d.get("format_version")
        if not isinstance(v, int) or v > PLAN_FORMAT_VERSION:
            raise ValueError(f"{where}: unsupported or missing format_version {v!r} (this moeplace reads "
                             f"<= {PLAN_FORMAT_VERSION})")
        for k in ("cluster", "phy2log", "num_experts"):
            if k not in d:
                raise ValueError(f"{where}: missing key {k!r}")
        cluster = Cluster.from_json(d["cluster"])
        try:
            p2l = np.asarray(d["phy2log"], dtype=np.int64)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: phy2log must be a rectangular [L][P] list of integers") from None
        try:
            placement = Placement(p2l, int(d["num_experts"]), cluster.world_size,
                                  allow_colocated_replicas=bool(d.get("extra", {}).get("allow_colocated", False)))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        try:
            homes = {int(k): int(v) for k, v in d.get("homes", {}).items()}
        except (TypeError, ValueError, AttributeError):
            raise ValueError(f"{where}: homes must map request ids to GPU ids") from None
        return cls(placement, cluster, homes, d.get("strategy", ""), float(d.get("plan_seconds", 0.0)),
                   d.get("planned_on", ""), d.get("extra", {}))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the plan JSON atomically."""
        p = Path(path)
        return atomic_write_json(self.to_json(), p, indent=None)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such plan file")
        try:
            d = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{p}: not valid JSON ({e})") from None
        return cls.from_json(d, where=str(p))
