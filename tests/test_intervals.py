"""The paired bootstrap interval of moeplace.evaluate.intervals against an exact enumeration of the same bootstrap.

Independent definition: for tiny inputs every resample can be listed with its probability (seeds drawn with
replacement, then each drawn copy's micro-batches drawn with replacement, the same indices for both plans), so the
bootstrap distribution of sum(plan) / sum(base) is known exactly; the sampled interval must match its quantiles.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from moeplace.evaluate.intervals import paired_ratio_ci


def _weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    order = np.argsort(values)
    v, w = values[order], weights[order]
    cdf = np.cumsum(w) / w.sum()
    return float(v[np.searchsorted(cdf, q)])


def _exact_one_seed(p, b):
    n = len(p)
    vals = [sum(p[i] for i in idx) / sum(b[i] for i in idx) for idx in itertools.product(range(n), repeat=n)]
    return np.array(vals), np.ones(len(vals))


def _exact_two_seeds(ps, bs):
    """Seeds drawn (s1, s2) uniformly from {0, 1}^2; each copy resamples its own micro-batches."""
    vals, wts = [], []
    per = [list(itertools.product(range(len(p)), repeat=len(p))) for p in ps]
    for s1, s2 in itertools.product(range(2), repeat=2):
        for i1 in per[s1]:
            for i2 in per[s2]:
                num = sum(ps[s1][i] for i in i1) + sum(ps[s2][i] for i in i2)
                den = sum(bs[s1][i] for i in i1) + sum(bs[s2][i] for i in i2)
                vals.append(num / den)
                wts.append(1.0 / (4 * len(per[s1]) * len(per[s2])))
    return np.array(vals), np.array(wts)


def test_one_seed_interval_matches_the_enumerated_bootstrap():
    p = np.array([1.0, 2.0, 4.0, 3.0])
    b = np.array([2.0, 2.0, 3.0, 5.0])
    ci = paired_ratio_ci(p, b, replicates=40_000, seed=1)
    assert ci.ratio == pytest.approx(p.sum() / b.sum())
    v, w = _exact_one_seed(p, b)
    assert ci.lo == pytest.approx(_weighted_quantile(v, w, 0.025), abs=0.02)
    assert ci.hi == pytest.approx(_weighted_quantile(v, w, 0.975), abs=0.02)
    assert ci.seeds == 1 and ci.microbatches == 4


def test_two_level_interval_matches_the_enumerated_bootstrap():
    ps = [np.array([1.0, 3.0, 2.0]), np.array([5.0, 4.0, 6.0])]
    bs = [np.array([2.0, 2.0, 2.0]), np.array([4.0, 4.0, 5.0])]
    ci = paired_ratio_ci(ps, bs, replicates=60_000, seed=2)
    v, w = _exact_two_seeds(ps, bs)
    assert ci.lo == pytest.approx(_weighted_quantile(v, w, 0.025), abs=0.02)
    assert ci.hi == pytest.approx(_weighted_quantile(v, w, 0.975), abs=0.02)
    # pairing matters: the same numbers unpaired (baseline shuffled across seeds) give another distribution
    assert ci.ratio == pytest.approx(21.0 / 19.0)


def test_identical_plans_give_a_point_interval_and_no_decision():
    t = np.array([3.0, 1.0, 2.0, 7.0])
    ci = paired_ratio_ci(t, t, replicates=500)
    assert (ci.ratio, ci.lo, ci.hi) == (1.0, 1.0, 1.0) and not ci.decided


def test_a_clear_win_is_decided_and_text_is_ratio_with_interval():
    rng = np.random.default_rng(0)
    b = rng.uniform(1, 2, 200)
    ci = paired_ratio_ci(0.8 * b + rng.normal(0, 0.01, 200), b)
    assert ci.hi < 1 and ci.decided
    assert ci.text(2).startswith("0.80 [0.7") or ci.text(2).startswith("0.80 [0.8")


def test_same_inputs_same_interval_and_bad_inputs_refused():
    p, b = np.array([1.0, 2.0, 3.0]), np.array([1.0, 1.0, 4.0])
    assert paired_ratio_ci(p, b, seed=5) == paired_ratio_ci(p, b, seed=5)
    with pytest.raises(ValueError, match="same micro-batches"):
        paired_ratio_ci(p, b[:2])
    with pytest.raises(ValueError, match="no time"):
        paired_ratio_ci(p, np.zeros(3))
    with pytest.raises(ValueError, match="non-finite"):
        paired_ratio_ci(np.array([1.0, np.nan, 1.0]), b)
