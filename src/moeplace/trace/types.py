"""Trace types: metadata (:class:`TraceMeta`), requests, token chunks, count groups, a whole trace, and the error
every trace reader and writer raises (:class:`TraceError`), with the limits checked before anything is allocated.

Shape legend: T = tokens, L = MoE layers, K = top-k, E = logical experts, R = requests, G = count groups.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

import numpy as np

FORMAT_VERSION = 1
PHASES = ("prefill", "decode")
PREFILL, DECODE = 0, 1
KINDS = ("tokens", "counts")
META_FILE = "meta.json"
WRITTEN_BY = "moeplace"  # meta.json "written_by": marks a folder --overwrite may replace

# Limits checked before anything is allocated (docs/RELIABILITY.md).
META_MAX_BYTES = 1 << 20  # meta.json larger than this is refused unread
MAX_LAYERS = 4096  # L
MAX_EXPERTS = int(np.iinfo(np.int16).max)  # E: expert ids are int16
MAX_TOP_K = 1024  # K
MAX_SHARED_EXPERTS = 4096
MAX_HIDDEN_SIZE = 1 << 20
MAX_LAYER_INDEX = 1 << 20  # entries of moe_layer_map


class TraceError(ValueError):
    """A trace that cannot be read or written as asked; the message names the file and the problem."""


def _int_value(name: str, v, lo: int, hi: int) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TraceError(f"{name} must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise TraceError(f"{name} must be in [{lo}, {hi}], got {v}")
    return int(v)


def _of_type(name: str, v, types: tuple, what: str):
    if not isinstance(v, types) or (isinstance(v, (bool, np.bool_)) and bool not in types):
        raise TraceError(f"{name} must be {what}, got {v!r}")
    return v


@dataclass
class TraceMeta:
    """What a trace records. Field names follow docs/MODEL.md."""

    model: str  # model name or path, e.g. "openai/gpt-oss-20b"
    num_layers: int  # L: MoE layers (dense layers not counted)
    num_experts: int  # E: routed (logical) experts per layer
    top_k: int  # K: experts each token selects per layer
    num_shared_experts: int = 0  # experts every token runs on its own GPU (no all-to-all)
    hidden_size: int | None = None  # model hidden size (bytes per token sent = hidden_size * bytes/elem)
    moe_layer_map: list[int] | None = None  # [L]: MoE layer l -> the model's own layer index
    sampling_rate: float = 1.0  # fraction of requests recorded (record 1 in n -> 1/n)
    kind: str = "tokens"  # "tokens" (per-token routing) or "counts" (aggregate counts only)
    has_weights: bool = False  # whether token files carry expert_weights
    synthetic: bool = False  # True for generated workloads; never pass synthetic data off as real
    source: str = ""  # where the routing came from (capture, importer and file, generator)
    complete: bool = False  # set when the writer closed cleanly
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)  # free-form provenance (licenses, dataset names, ...)
    written_by: str = ""  # "moeplace" when TraceWriter made the folder: only then may --overwrite replace it
    foe_groups: int = 1  # H: Federation-of-Experts groups (1 = plain MoE); H > 1: ids ordered group by group

    def __post_init__(self) -> None:
        try:
            self._validate()
        except TraceError as e:
            raise TraceError(f"trace metadata: {e}") from None

    def _validate(self) -> None:
        _of_type("model", self.model, (str,), "a string")
        self.num_layers = _int_value("num_layers", self.num_layers, 1, MAX_LAYERS)
        self.num_experts = _int_value("num_experts", self.num_experts, 1, MAX_EXPERTS)
        if not isinstance(self.top_k, bool) and isinstance(self.top_k, (int, np.integer)) \
                and self.top_k > self.num_experts:
            raise TraceError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        self.top_k = _int_value("top_k", self.top_k, 1, min(MAX_TOP_K, self.num_experts))
        self.num_shared_experts = _int_value("num_shared_experts", self.num_shared_experts, 0, MAX_SHARED_EXPERTS)
        if self.hidden_size is not None:
            self.hidden_size = _int_value("hidden_size", self.hidden_size, 1, MAX_HIDDEN_SIZE)
        if self.moe_layer_map is not None:
            lm = _of_type("moe_layer_map", self.moe_layer_map, (list, tuple), "a list of layer indices")
            if len(lm) != self.num_layers:
                raise TraceError(f"moe_layer_map has {len(lm)} entries, expected {self.num_layers}")
            self.moe_layer_map = [_int_value("moe_layer_map entry", v, 0, MAX_LAYER_INDEX) for v in lm]
        sr = _of_type("sampling_rate", self.sampling_rate, (int, float, np.floating, np.integer), "a number")
        if not (math.isfinite(float(sr)) and 0.0 < float(sr) <= 1.0):
            raise TraceError(f"sampling_rate must be in (0, 1], got {sr!r}")
        self.sampling_rate = float(sr)
        if not isinstance(self.kind, str) or self.kind not in KINDS:
            raise TraceError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("has_weights", "synthetic", "complete"):
            setattr(self, name, bool(_of_type(name, getattr(self, name), (bool, np.bool_), "true or false")))
        _of_type("source", self.source, (str,), "a string")
        _of_type("written_by", self.written_by, (str,), "a string")
        _of_type("extra", self.extra, (dict,), "a JSON object")
        self.format_version = _int_value("format_version", self.format_version, 1, FORMAT_VERSION)
        self.foe_groups = _int_value("foe_groups", self.foe_groups, 1, MAX_TOP_K)
        if self.num_experts % self.foe_groups or self.top_k % self.foe_groups:
            raise TraceError(f"foe_groups={self.foe_groups} must divide num_experts={self.num_experts} and "
                             f"top_k={self.top_k} (each group owns E/H experts and routes K/H of them)")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict, where: str = "meta.json") -> TraceMeta:
        if not isinstance(d, dict):
            raise TraceError(f"{where}: expected a JSON object")
        version = d.get("format_version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise TraceError(f"{where}: missing or invalid format_version {version!r} (expected a positive integer)")
        if version > FORMAT_VERSION:
            raise TraceError(
                f"{where}: format_version {version} is newer than this moeplace reads ({FORMAT_VERSION}); "
                "upgrade moeplace"
            )
        known = {f.name for f in fields(cls)}
        missing = [k for k in ("model", "num_layers", "num_experts", "top_k") if k not in d]
        if missing:
            raise TraceError(f"{where}: missing required keys {missing}")
        try:
            return cls(**{k: v for k, v in d.items() if k in known})
        except TraceError as e:
            raise TraceError(f"{where}: {e}") from None


@dataclass
class Requests:
    """Request table. All arrays have shape [R]."""

    request_id: np.ndarray  # int64 [R]
    domain: np.ndarray  # object (str) [R]
    source: np.ndarray  # object (str) [R]
    prompt_len: np.ndarray  # int32 [R]
    gen_len: np.ndarray  # int32 [R]

    def __len__(self) -> int:
        return len(self.request_id)

    def domain_of(self) -> dict[int, str]:
        return dict(zip(self.request_id.tolist(), self.domain.tolist(), strict=True))


@dataclass
class TokenChunk:
    """A batch of token rows. Routing is layer-major: ``expert_ids[t, l, j]`` is token t's j-th expert in layer l."""

    request_id: np.ndarray  # int64 [T]
    position: np.ndarray  # int32 [T]
    phase: np.ndarray  # int8 [T], 0 = prefill, 1 = decode
    expert_ids: np.ndarray  # int16 [T, L, K]
    expert_weights: np.ndarray | None = None  # float16 [T, L, K]

    def __len__(self) -> int:
        return len(self.request_id)

    def select(self, mask_or_index: np.ndarray) -> TokenChunk:
        w = None if self.expert_weights is None else self.expert_weights[mask_or_index]
        return TokenChunk(
            self.request_id[mask_or_index],
            self.position[mask_or_index],
            self.phase[mask_or_index],
            self.expert_ids[mask_or_index],
            w,
        )


@dataclass
class Counts:
    """Counts-only rows: token-expert selections aggregated over a group of tokens."""

    group: np.ndarray  # object (str) [G]: a name for the group (dataset/category, forward pass, ...)
    domain: np.ndarray  # object (str) [G]
    phase: np.ndarray  # int8 [G]: 0 prefill, 1 decode, -1 both or unknown
    num_tokens: np.ndarray  # float64 [G]: tokens aggregated (NaN if unknown)
    counts: np.ndarray  # float64 [G, L, E]

    def __len__(self) -> int:
        return len(self.group)


@dataclass
class Trace:
    """A whole trace in memory (small traces; large ones: :func:`moeplace.trace.reader.iter_token_chunks`)."""

    meta: TraceMeta
    requests: Requests
    tokens: TokenChunk | None  # None for counts-only traces
    counts: Counts | None = None  # None for per-token traces
