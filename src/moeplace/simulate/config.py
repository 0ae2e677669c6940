"""What a simulation is configured by, importable without numpy: the CLI builds its options from these.

- :class:`CostConfig`: what one send and one token-expert pair cost, and which kernel time model a layer uses.
- :class:`BatchConfig`: how trace tokens form micro-batches.
- :data:`RULES`: the replica choice rules of :mod:`~moeplace.simulate.routing`; :data:`DEDUP_MODES` its send modes.
- :data:`KERNEL_NAMES`, :data:`MODES`, :data:`AUTO_MODE`: the kernel time models of
  :mod:`~moeplace.simulate.kernels` (whose registry is checked against these names at import).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

RULES = ("nearest-least-loaded", "nearest-static", "balanced-local", "balanced", "balanced-links")
BALANCED_RULES = ("balanced-local", "balanced", "balanced-links")  # chosen per micro-batch by routing.balanced_gpus
DEFAULT_RULE = "nearest-least-loaded"
# the replica dispatch choices an engine-side EPLB deployment is measured with (the strongest-baseline candidates
# of moeplace.evaluate.measure and of joint's decision): static, nearest least-loaded, per-micro-batch balanced
BASELINE_RULES = ("nearest-static", "nearest-least-loaded", "balanced")
DEDUP_MODES = ("per_gpu", "two_hop")

KERNEL_NAMES = ("nccl", "deepep-normal", "deepep-ll")  # keys of moeplace.simulate.kernels.KERNELS, in its order
AUTO_MODE = {"prefill": "deepep-normal", "decode": "deepep-ll"}  # mode "auto" per phase (SGLang's --deepep-mode)
MODES = (*KERNEL_NAMES, "auto")  # every CostConfig.mode
assert set(AUTO_MODE.values()) <= set(KERNEL_NAMES)


def describe_mode(mode: str, phase: str | None = None) -> str:
    """The kernel a mode means in words: 'deepep-normal for prefill, deepep-ll for decode (auto)' for ``auto``
    (or, given a phase, 'deepep-ll (auto for decode)'); other modes are their own name."""
    if mode != "auto":
        return mode
    if phase is not None:
        return f"{AUTO_MODE[phase]} (auto for {phase})"
    return ", ".join(f"{k} for {ph}" for ph, k in AUTO_MODE.items()) + " (auto)"


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)  # numpy integers are Integral too


@dataclass(frozen=True)
class CostConfig:
    """What one send and one token-expert pair cost, and which kernel time model a layer time uses."""

    hidden_size: int | None = None  # elements per token vector; None -> the trace's metadata
    dispatch_bytes: float = 1.0  # bytes per element sent by dispatch (1 = fp8)
    combine_bytes: float = 2.0  # bytes per element returned by combine (2 = bf16)
    pair_flops: float | None = None  # FLOPs of one token-expert pair; None -> 6 * hidden * intermediate
    intermediate_size: int | None = None  # expert FFN width for default pair_flops; None -> model preset or hidden
    mode: str = "auto"  # dispatch/combine kernel: nccl, deepep-normal, deepep-ll, auto (normal prefill, ll decode)
    overlap: bool = False  # two-batch overlap of dispatch, expert compute and combine (docs/SIMULATOR.md)
    scale_block: int = 128  # a quantized dispatch (dispatch_bytes < 2) carries one fp32 scale per block; 0: none
    weight_bytes: float | None = None  # bytes per expert weight element; None -> model preset, else 2 (bf16)

    def __post_init__(self) -> None:
        hs = self.hidden_size
        if hs is not None and (not isinstance(hs, numbers.Integral) or hs < 1):
            raise ValueError(f"cost: hidden_size must be a positive integer, got {self.hidden_size!r}")
        for name in ("dispatch_bytes", "combine_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cost: {name} must be > 0, got {getattr(self, name)!r}")
        if self.pair_flops is not None and not self.pair_flops >= 0:
            raise ValueError(f"cost: pair_flops must be >= 0, got {self.pair_flops!r}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ValueError(f"cost: intermediate_size must be >= 1, got {self.intermediate_size!r}")
        if self.mode not in MODES:
            raise ValueError(f"cost: mode {self.mode!r}: expected one of {MODES}")
        if not isinstance(self.scale_block, numbers.Integral) or self.scale_block < 0:
            raise ValueError(f"cost: scale_block must be an integer >= 0, got {self.scale_block!r}")
        if self.weight_bytes is not None and not self.weight_bytes > 0:
            raise ValueError(f"cost: weight_bytes must be > 0, got {self.weight_bytes!r}")


@dataclass(frozen=True)
class BatchConfig:
    """How trace tokens form micro-batches (one forward pass each). See docs/SIMULATOR.md."""

    decode_batch: int = 256  # requests per decode window: decode micro-batch = the i-th decode token of each
    prefill_tokens: int = 8192  # prefill token budget: prompts laid end to end in request order, cut every budget
    # continuous batching of decode (None: fixed windows of decode_batch requests): a running set of up to this
    # many requests, each one token per step until its decode ends; the next arrival joins when one leaves
    decode_running: int | None = None

    def __post_init__(self) -> None:
        for name in ("decode_batch", "prefill_tokens"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"batching: {name} must be a positive integer, got {v!r}")
        v = self.decode_running
        if v is not None and (not _is_int(v) or v < 1):
            raise ValueError(f"batching: decode_running must be a positive integer or None, got {v!r}")

    def capacity(self, phase: str) -> int:
        """Tokens of a full micro-batch of ``phase`` ("prefill" or "decode"): the prefill budget; the running-set
        size under continuous batching, else the decode window."""
        if phase == "prefill":
            return self.prefill_tokens
        return self.decode_running if self.decode_running is not None else self.decode_batch
