"""The knobs of a synthetic workload (:mod:`moeplace.simulate.synth`), importable without numpy: ``moeplace synth``
shows their defaults in its help."""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from moeplace.budget import over_budget


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
        if self.domain_mix is not None and (len(self.domain_mix) != self.num_domains
                                            or not all(math.isfinite(x) and x >= 0 for x in self.domain_mix)
                                            or not 0 < sum(self.domain_mix) < math.inf):
            raise ValueError(f"synth: domain_mix must hold {self.num_domains} finite non-negative shares with a "
                             f"positive sum, got {self.domain_mix}")


SYNTH_BATCH_REQUESTS = 64  # requests generated at once (moeplace.simulate.synth.generate_batches' default)
SYNTH_AHEAD = 2  # batches generated ahead of the writer (int16 [T, L, K] each), in a background thread
PILOT_REQUESTS_MAX = 256  # calibration measures skew on at most this many requests (4 layers at once)
STORED_FRACTION = 0.2  # compressed shard bytes per raw routing byte, at least (measured: 0.3 on presets)
# The estimate ``moeplace synth`` prints before it writes (docs/PRESETS.md, "Sizes and time"): measured on the
# 2-core reference machine, deepseek-v3 preset: 20,000 one-token requests 60 s and 80,000 187 s (the per-request
# work dominates short requests), 200 requests of 320 tokens (29.7 M routing entries) 6.6 s with start-up.
SYNTH_SECONDS_PER_REQUEST = 2.4e-3
SYNTH_ENTRIES_PER_SECOND = 6e6  # token x layer x top-k routing entries generated per second
SYNTH_STORED_MEASURED = 0.3  # compressed bytes per raw routing byte, as measured on the presets
DEFAULT_MAX_REQUESTS = 1 << 20  # synth --max-requests: more requests need the flag raised on purpose


def synth_budget_problem(cfg: SynthConfig, num_layers: int, num_experts: int, top_k: int,
                         dest: str | os.PathLike | None = None, budget: int | None = None) -> str | None:
    """Why ``cfg`` cannot be generated for a model of ``num_layers`` x ``num_experts`` (top-``top_k``), or None:
    one batch of :data:`SYNTH_BATCH_REQUESTS` requests of the longest length (routing [R, T, L, K], the
    per-layer [R, T, K] work arrays, and :data:`SYNTH_AHEAD` finished batches waiting for the writer) or the
    calibration pilot over the memory budget (:mod:`moeplace.budget`), or the trace (at least
    :data:`STORED_FRACTION` of its raw routing bytes) larger than the free space at ``dest``.
    The message names the options (``--requests``, ``--prompt-len``, ``--gen-len``)."""
    L, E, K = num_layers, num_experts, top_k
    longest = math.ceil((cfg.prompt_len + cfg.gen_len) * (1 + cfg.length_jitter)) + 1
    where = f"synth --prompt-len {cfg.prompt_len} --gen-len {cfg.gen_len}"
    batch = min(SYNTH_BATCH_REQUESTS, cfg.num_requests)
    need = batch * longest * (L * K * (4 + 2 * SYNTH_AHEAD) + K * 64) + batch * E * 64
    problem = over_budget(need, f"a batch of {batch} requests of up to {longest} tokens", where, budget)
    pilot = min(PILOT_REQUESTS_MAX, max(cfg.num_requests, 40)) if cfg.calibrate else 0
    problem = problem or over_budget(pilot * longest * (4 * K * 4 + K * 64), f"calibrating on {pilot} requests of "
                                     f"up to {longest} tokens", where, budget)
    if problem or dest is None:
        return problem
    tokens = cfg.num_requests * (cfg.prompt_len + cfg.gen_len)
    stored = tokens * L * K * 2 * STORED_FRACTION
    anc = next((a for a in [Path(dest), *Path(dest).parents] if a.exists()), None)
    free = shutil.disk_usage(anc).free if anc is not None else None
    if free is not None and stored > free:
        return (f"synth --requests {cfg.num_requests} --prompt-len {cfg.prompt_len} --gen-len {cfg.gen_len}: about "
                f"{tokens:,} tokens, at least {stored / 1e9:.1f} GB on disk, more than the {free / 1e9:.1f} GB free "
                f"at {anc}")
    return None


def synth_estimate(cfg: SynthConfig, num_layers: int, top_k: int) -> tuple[int, float, float]:
    """(tokens, bytes on disk, seconds) that ``cfg`` is expected to take for a model of ``num_layers`` x top-
    ``top_k``: an estimate from measured rates (the constants above), said before anything is written."""
    tokens = cfg.num_requests * (cfg.prompt_len + cfg.gen_len)
    entries = tokens * num_layers * top_k
    seconds = cfg.num_requests * SYNTH_SECONDS_PER_REQUEST + entries / SYNTH_ENTRIES_PER_SECOND
    return tokens, entries * 2 * SYNTH_STORED_MEASURED, seconds


def format_duration(seconds: float) -> str:
    """``42 s``, ``3.5 min`` or ``2.1 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
