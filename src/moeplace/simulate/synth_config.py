"""The knobs of a synthetic workload (:mod:`moeplace.simulate.synth`), importable without numpy: ``moeplace synth``
shows their defaults in its help."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SynthConfig:
    """Knobs of a synthetic workload (asked values are measured back within tolerance; see tests/test_synth.py)."""

    num_requests: int = 1000  # R
    prompt_len: int = 512  # mean prompt tokens
    gen_len: int = 256  # mean generated tokens
    length_jitter: float = 0.5  # lengths uniform in [1 - j, 1 + j] x mean (at least 1)
    load_skew: float = 2.0  # asked per-layer max/mean expert load (1 = uniform), averaged over layers
    num_domains: int = 4  # domains (names from DOMAINS, then domain-N)
    domain_mix: tuple[float, ...] | None = None  # request share of each domain; None -> equal
    domain_strength: float = 0.5  # share of a request's routing preference shared with its domain, in [0, 1]
    request_spread: float = 1.0  # std of request-level logit offsets (specialisation of one request)
    prefill_decode_corr: float = 0.6  # asked mean Pearson of prefill vs decode expert counts per request and layer
    temporal_overlap: float = 0.5  # asked mean share of top-k kept by consecutive decode tokens
    layer_affinity: float = 0.3  # probability a switching slot follows its previous-layer partner expert
    foe_groups: int = 0  # H > 0: FoE structure, k/H experts inside each of H contiguous expert groups
    seed: int = 0
    calibrate: bool = True  # False: use the asked values as raw parameters (s = load_skew - 1, tau, c)

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"synth: num_requests must be >= 1, got {self.num_requests}")
        if self.prompt_len < 1 or self.gen_len < 0:
            raise ValueError(f"synth: prompt_len must be >= 1 and gen_len >= 0, got {self.prompt_len}, "
                             f"{self.gen_len}")
        if not 0 <= self.length_jitter < 1:
            raise ValueError(f"synth: length_jitter must be in [0, 1), got {self.length_jitter}")
        if self.load_skew < 1:
            raise ValueError(f"synth: load_skew (max/mean) must be >= 1, got {self.load_skew}")
        for name in ("domain_strength", "temporal_overlap", "layer_affinity"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"synth: {name} must be in [0, 1], got {getattr(self, name)}")
        if not -1 <= self.prefill_decode_corr <= 1:
            raise ValueError(f"synth: prefill_decode_corr must be in [-1, 1], got {self.prefill_decode_corr}")
        if self.num_domains < 1:
            raise ValueError(f"synth: num_domains must be >= 1, got {self.num_domains}")
        if self.domain_mix is not None and (len(self.domain_mix) != self.num_domains or min(self.domain_mix) < 0
                                            or sum(self.domain_mix) <= 0):
            raise ValueError(f"synth: domain_mix must hold {self.num_domains} non-negative shares, got "
                             f"{self.domain_mix}")
