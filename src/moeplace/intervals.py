"""Paired confidence intervals for time ratios: how sure is "plan A is x times plan B"?

Shape legend: S = split seeds (independent planning/held-out splits), B_s = scored micro-batches of seed s,
N = bootstrap replicates.

A ratio compares two plans on the *same* micro-batches (paired), so their common variation (a heavy micro-batch
is heavy for both) cancels. The statistic is the ratio of mean layer times over the scored micro-batches of all
seeds, ``sum(plan) / sum(baseline)``. Its interval is a two-level (hierarchical) percentile bootstrap:
each replicate draws S seeds with replacement and, inside each drawn seed, B_s micro-batch indices with
replacement, the same indices for both plans. With one seed only the micro-batch level remains. The generator is
seeded, so the interval is a function of its inputs (byte-identical on any machine).

Reference: Efron & Tibshirani, *An Introduction to the Bootstrap* (1993), ch. 13 (percentile intervals) and the
two-stage bootstrap for clustered data (Davison & Hinkley, *Bootstrap Methods and their Application*, 1997, 2.4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_REPLICATES = 2000  # bootstrap replicates: the interval ends move by < 0.002 between seeds at this count
MAX_REPLICATE_CELLS = 1 << 26  # replicates x micro-batches drawn: bounds the index arrays (512 MiB of int64)


@dataclass(frozen=True)
class RatioCI:
    """A paired time ratio with its percentile interval."""

    ratio: float  # sum(plan) / sum(baseline) over every scored micro-batch of every seed
    lo: float  # lower end of the interval
    hi: float  # upper end
    level: float  # 0.95
    microbatches: int  # scored micro-batches, all seeds together
    seeds: int  # S

    def to_json(self) -> dict:
        return {"ratio": self.ratio, "ci95" if self.level == 0.95 else f"ci{self.level:g}": [self.lo, self.hi],
                "microbatches": self.microbatches, "seeds": self.seeds}

    def text(self, digits: int = 3) -> str:
        """``0.912 [0.881, 0.948]``."""
        return f"{self.ratio:.{digits}f} [{self.lo:.{digits}f}, {self.hi:.{digits}f}]"

    @property
    def decided(self) -> bool:
        """True when the interval excludes 1 (the two plans differ beyond the resampling noise)."""
        return self.hi < 1.0 or self.lo > 1.0


def _as_pairs(plan: Sequence[np.ndarray] | np.ndarray, base: Sequence[np.ndarray] | np.ndarray
              ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    if isinstance(plan, np.ndarray) and plan.ndim == 1:
        plan, base = [plan], [base]
    ps = [np.asarray(p, np.float64).ravel() for p in plan]
    bs = [np.asarray(b, np.float64).ravel() for b in base]
    if len(ps) != len(bs) or not ps:
        raise ValueError(f"paired ratio: expected the same number (>= 1) of seeds for both plans, got {len(ps)} and "
                         f"{len(bs)}")
    for s, (p, b) in enumerate(zip(ps, bs, strict=True)):
        if len(p) != len(b):
            raise ValueError(f"paired ratio: seed {s} has {len(p)} plan and {len(b)} baseline micro-batches; a paired "
                             "ratio needs the same micro-batches for both")
        if not (np.isfinite(p).all() and np.isfinite(b).all()) or (p < 0).any() or (b < 0).any():
            raise ValueError(f"paired ratio: seed {s} has negative or non-finite times")
    if sum(b.sum() for b in bs) <= 0:
        raise ValueError("paired ratio: the baseline's scored micro-batches take no time (nothing was scored)")
    return ps, bs


def paired_ratio_ci(plan: Sequence[np.ndarray] | np.ndarray, base: Sequence[np.ndarray] | np.ndarray,
                    replicates: int = DEFAULT_REPLICATES, level: float = 0.95, seed: int = 0) -> RatioCI:
    """The ratio ``sum(plan) / sum(base)`` with its paired two-level bootstrap interval.

    plan, base: per seed, float [B_s] layer time of each scored micro-batch (the same micro-batches in the same
    order for both); one array stands for one seed. Seeds with no micro-batch are dropped. ``replicates`` N;
    ``level`` the interval's coverage; ``seed`` the bootstrap generator's seed.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if isinstance(replicates, bool) or not isinstance(replicates, int) or replicates < 1:
        raise ValueError(f"replicates must be a positive integer, got {replicates!r}")
    ps, bs = _as_pairs(plan, base)
    keep = [i for i, p in enumerate(ps) if len(p)]
    ps, bs = [ps[i] for i in keep], [bs[i] for i in keep]
    S = len(ps)
    n_mb = int(sum(len(p) for p in ps))
    if replicates * max((len(p) for p in ps), default=0) > MAX_REPLICATE_CELLS:
        raise ValueError(f"paired ratio: {replicates} replicates x {max(len(p) for p in ps)} micro-batches exceeds "
                         f"{MAX_REPLICATE_CELLS} draws; lower the replicates")
    ratio = float(sum(p.sum() for p in ps) / sum(b.sum() for b in bs))
    rng = np.random.default_rng(seed)
    num = np.zeros(replicates)
    den = np.zeros(replicates)
    # Level 1: how often each seed is drawn in each replicate ([N, S] counts of a multinomial draw of S seeds).
    seed_counts = rng.multinomial(S, np.full(S, 1.0 / S), size=replicates) if S > 1 else np.ones((replicates, 1))
    for s in range(S):
        p, b = ps[s], bs[s]
        n = len(p)
        for copy in range(int(seed_counts[:, s].max())):
            # Level 2: each drawn copy of seed s resamples its n micro-batches with replacement on its own, the
            # same indices for both plans (paired).
            idx = rng.integers(0, n, size=(replicates, n))
            used = seed_counts[:, s] > copy
            num += used * p[idx].sum(axis=1)
            den += used * b[idx].sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)
    r = r[np.isfinite(r)]
    a = (1.0 - level) / 2.0
    lo, hi = (float(np.quantile(r, a)), float(np.quantile(r, 1.0 - a))) if len(r) else (ratio, ratio)
    return RatioCI(ratio, lo, hi, level, n_mb, S)


__all__ = ["DEFAULT_REPLICATES", "RatioCI", "paired_ratio_ci"]
