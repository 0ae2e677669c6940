"""What a ``run-ep`` run is configured by, importable without torch or numpy (the CLI builds its options from
these): :class:`ReplayConfig` (the emulated layer and how to time it), :class:`RunEpOptions` (what to replay, on
what, where the report goes) and :data:`LIMITS` (the accepted range of each numeric option)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moeplace.simulate import PHASE_NAMES
from moeplace.simulate.config import DEFAULT_RULE, RULES

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # element types of hidden vectors (torch's, in replay.py)


@dataclass(frozen=True)
class ReplayConfig:
    """How to replay: the layer's size and precision, and how often to repeat for timing."""

    hidden: int = 256  # H: hidden size of the emulated layer
    ffn: int | None = None  # expert intermediate size (None: = hidden)
    dtype: str = "float32"  # element type of hidden vectors; sets bytes per element
    two_hop: bool = False  # per-node dedup with intra-node forwarding (else per-GPU dedup)
    repeats: int = 3  # R: timed repetitions of every (micro-batch, layer)
    weights: str = "random"  # "random" experts, or "id" experts that encode their id (tests)
    seed: int = 0  # expert weights and token hidden vectors
    return_outputs: bool = False  # ranks return their outputs (tests compare them with the reference)
    emulate_compute: bool = False  # wait the predicted expert time instead of computing (module docstring)
    timeout: float = 600.0  # seconds before the run is stopped

    def __post_init__(self) -> None:
        if self.hidden < 1:
            raise ValueError(f"replay: hidden must be >= 1, got {self.hidden}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"replay: dtype {self.dtype!r}: expected one of {sorted(DTYPE_BYTES)}")
        if self.repeats < 1:
            raise ValueError(f"replay: repeats must be >= 1, got {self.repeats}")
        if self.weights not in ("random", "id"):
            raise ValueError(f"replay: weights {self.weights!r}: expected 'random' or 'id'")

    @property
    def bytes_per_element(self) -> int:
        return DTYPE_BYTES[self.dtype]



# Accepted range of each numeric option, inclusive: (low, high). The CLI's argument types use the same table.
LIMITS: dict[str, tuple[float, float]] = {
    "hidden": (1, 65536),  # H: the largest published models use 7168-16384
    "ffn": (1, 65536),  # F
    "batch_tokens": (1, 1 << 20),
    "decode_batch": (1, 1 << 20),
    "prefill_tokens": (1, 1 << 30),
    "microbatches": (1, 100_000),
    "skip": (0, 10_000_000),
    "repeats": (1, 1000),
    "timeout": (1e-3, 7 * 86400.0),  # seconds
    "inter_gbit": (1e-3, 400.0),  # Gbit/s per node link
    "inter_delay_ms": (1e-3, 10_000.0),
    "compute_flops": (1e3, 1e18),  # FLOP/s of the emulated device per rank
    "compute_hbm_gbps": (1e-6, 1e6),  # GB/s of its weight memory
}

_DEFAULTS = ReplayConfig()


@dataclass(frozen=True)
class RunEpOptions:
    """What to replay, on what, and where the report goes; checked on construction (ranges in :data:`LIMITS`)."""

    trace: Path  # per-token trace directory
    plan: Path  # plan JSON
    cluster: str  # --cluster (NxG, a preset name, or N with cluster_preset); its shape must be the plan's
    hidden: int = _DEFAULTS.hidden  # H of the emulated layer
    ffn: int | None = _DEFAULTS.ffn  # F (None: = hidden)
    dtype: str = _DEFAULTS.dtype  # element type of hidden vectors
    decode_batch: int = 256  # requests per decode window, as the simulator forms them
    prefill_tokens: int = 8192  # prefill micro-batch token budget, as the simulator forms them
    batch_tokens: int | None = None  # shorthand: both decode_batch and prefill_tokens (None: those two)
    cluster_preset: str | None = None  # links and GPU speed of the prediction (None: the plan cluster's)
    phase: str = "decode"  # which micro-batches
    microbatches: int = 8  # how many whole micro-batches to replay
    skip: int = 0  # micro-batches of the phase skipped first
    repeats: int = _DEFAULTS.repeats  # timed repeats
    two_hop: bool = _DEFAULTS.two_hop  # per-node dedup with forwarding inside the node
    rule: str = DEFAULT_RULE  # replica rule
    timeout: float = _DEFAULTS.timeout  # seconds before the ranks are stopped
    emulate: bool = False  # run on a private emulated cluster (one network namespace per node)
    inter_gbit: float | None = None  # with emulate: each node's link rate, Gbit/s
    inter_delay_ms: float | None = None  # with emulate: one-way inter-node delay, ms
    netns: str | None = None  # run on the cluster `moeplace cluster up --name NETNS` brought up
    json_out: Path | None = None  # write the report here (None: the caller prints it)
    fail_rank: int | None = None  # test hook: that rank exits right after joining the group
    emulate_compute: bool = False  # wait the time model's expert compute of each rank instead of computing
    compute_flops: float | None = None  # with emulate_compute: FLOP/s per rank (None: the plan cluster's)
    compute_hbm_gbps: float | None = None  # with emulate_compute: weight-memory GB/s (None: the plan cluster's)

    @property
    def batch_sizes(self) -> tuple[int, int]:
        """(decode requests per window, prefill token budget) of the replayed micro-batches."""
        if self.batch_tokens is not None:
            return self.batch_tokens, self.batch_tokens
        return self.decode_batch, self.prefill_tokens

    def __post_init__(self) -> None:
        for name, (lo, hi) in LIMITS.items():
            v = getattr(self, name)
            if v is None:
                continue
            integral = isinstance(lo, int) and isinstance(hi, int)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (integral and not isinstance(v, int)) \
                    or not lo <= v <= hi:
                kind = "an integer" if integral else "a number"
                raise ValueError(f"{name} must be {kind} in [{lo:g}, {hi:g}], got {v!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r}: expected one of {sorted(DTYPE_BYTES)}")
        if self.phase not in PHASE_NAMES:
            raise ValueError(f"phase {self.phase!r}: expected one of {PHASE_NAMES}")
        if self.rule not in RULES:
            raise ValueError(f"replica rule {self.rule!r}: expected one of {RULES}")
        if self.emulate and self.netns:
            raise ValueError("--emulate builds a private cluster and --netns uses an existing one; "
                             "give one of them")
        for flag, v in (("--inter-gbit", self.inter_gbit), ("--inter-delay-ms", self.inter_delay_ms)):
            if v is not None and not self.emulate:
                raise ValueError(f"{flag} shapes the private cluster of --emulate and does nothing without "
                                 f"it (a --netns cluster is shaped by 'moeplace cluster up {flag}')")
        for flag, v in (("--compute-flops", self.compute_flops), ("--compute-hbm-gbps", self.compute_hbm_gbps)):
            if v is not None and not self.emulate_compute:
                raise ValueError(f"{flag} sets the emulated device of --emulate-compute and does nothing without it")


