"""Activation-pattern statistics as pure numpy functions over arrays (definitions: docs/MODEL.md, docs/ANALYSIS.md).

Shape legend: T = tokens, L = MoE layers, K = top-k, E = logical experts, R = requests, D = domains,
N = samples (requests or count groups), P = token pairs.

Every function takes and returns arrays; none reads a trace. Undefined values (a layer without load, a constant
count vector) come back as NaN; the JSON layer turns them into null.
"""

from __future__ import annotations

import numpy as np

TOP_SHARE_FRACTION = 0.10  # "share of the top 10% experts": the ceil(0.1 * E) most-loaded experts


def _check_last_axis(name: str, a: np.ndarray, ndim_min: int = 1) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    if a.ndim < ndim_min or a.shape[-1] == 0:
        raise ValueError(f"{name}: expected an array with a non-empty last (expert) axis, got shape {a.shape}")
    if np.any(a < 0):
        raise ValueError(f"{name}: loads and counts must be non-negative")
    return a


def gini(load: np.ndarray) -> np.ndarray:
    """Gini coefficient along the last axis: 0 = all experts equal, (E-1)/E = one expert takes everything.

    load: [..., E] non-negative. Returns [...]; NaN where the load sums to 0.
    """
    x = np.sort(_check_last_axis("gini", load), axis=-1)
    e = x.shape[-1]
    total = x.sum(-1)
    i = np.arange(1, e + 1, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        g = 2.0 * (x * i).sum(-1) / (e * total) - (e + 1.0) / e
    return np.where(total > 0, g, np.nan)


def load_stats(load: np.ndarray) -> dict[str, np.ndarray]:
    """Per-layer expert-load distribution statistics.

    load: [L, E] token-expert selections per layer and expert (any non-negative weights).
    Returns a dict of [L] float arrays (NaN for a layer with no load):
      ``max_over_mean`` max_e / mean_e; ``cv`` std_e / mean_e (population std); ``gini`` (see :func:`gini`);
      ``top10_share`` share of the layer's load on its ceil(0.1 * E) most-loaded experts.
    """
    if np.ndim(load) != 2:
        raise ValueError(f"load: expected shape [L, E], got {np.shape(load)}")
    x = _check_last_axis("load", load)
    e = x.shape[1]
    mean = x.mean(1)
    n_top = max(1, int(np.ceil(TOP_SHARE_FRACTION * e)))
    top = -np.sort(-x, axis=1)[:, :n_top].sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = {
            "max_over_mean": x.max(1) / mean,
            "cv": x.std(1) / mean,
            "gini": gini(x),
            "top10_share": top / x.sum(1),
        }
    ok = mean > 0
    return {k: np.where(ok, v, np.nan) for k, v in out.items()}


def normalise(counts: np.ndarray) -> np.ndarray:
    """L1-normalise along the last axis: [..., E] -> frequencies summing to 1 (all-zero rows stay zero)."""
    c = np.asarray(counts, dtype=np.float64)
    s = c.sum(-1, keepdims=True)
    return np.divide(c, s, out=np.zeros_like(c), where=s > 0)


def js_divergence(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Jensen-Shannon divergence in bits (log base 2, so in [0, 1]) along the last axis.

    p, q: [..., E] non-negative (normalised here). Returns [...]; NaN where either side has no mass.
    """
    p = _check_last_axis("p", p)
    q = _check_last_axis("q", q)
    if p.shape[-1] != q.shape[-1]:
        raise ValueError(f"js_divergence: expert axes differ ({p.shape[-1]} vs {q.shape[-1]})")
    empty = (p.sum(-1) <= 0) | (q.sum(-1) <= 0)
    p, q = normalise(p), normalise(q)
    m = 0.5 * (p + q)

    def kl(a: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            t = np.where(a > 0, a * np.log2(a / m), 0.0)
        return t.sum(-1)

    js = 0.5 * kl(p) + 0.5 * kl(q)
    return np.where(empty, np.nan, np.clip(js, 0.0, 1.0))


def pairwise_js(freq: np.ndarray) -> np.ndarray:
    """Pairwise JS divergence (bits) between D distributions per layer.

    freq: [D, L, E] counts or frequencies. Returns [L, D, D], symmetric, zero diagonal (NaN for empty rows).
    """
    f = _check_last_axis("freq", freq, ndim_min=3)
    if f.ndim != 3:
        raise ValueError(f"freq: expected shape [D, L, E], got {f.shape}")
    js = js_divergence(f[:, None], f[None, :])  # [D, D, L]
    return np.transpose(js, (2, 0, 1))


# --------------------------------------------------------------------------------------------- co-activation


def _ids_intp(ids: np.ndarray, num_experts: int) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 3:
        raise ValueError(f"expert_ids: expected shape [T, L, K], got {ids.shape}")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"expert_ids: expected integers, got dtype {ids.dtype}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise ValueError(f"expert_ids: ids must lie in [0, {num_experts}), got [{ids.min()}, {ids.max()}]")
    return ids.astype(np.intp, copy=False)


def layer_major(expert_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """expert_ids [T, L, K] -> validated intp [L, K, T], the layout the pair counters stream through."""
    return np.ascontiguousarray(_ids_intp(expert_ids, num_experts).transpose(1, 2, 0))


def pair_bincount(ids_LKT: np.ndarray, num_experts: int, interlayer: bool = False) -> np.ndarray:
    """Unsymmetrised pair counts: int64 [L, E * E] (within a layer, router slots a < b) or [L-1, E * E] (layer l
    slot a, layer l+1 slot b). ids_LKT: [L, K, T] from :func:`layer_major`.

    One layer at a time, so the E * E counters stay in cache while the compiled loop
    (:mod:`moeplace.analyse.loops`) adds each pair.
    """
    from moeplace.analyse.loops import pair_counts  # compiled (numba): imported where pairs are counted

    if ids_LKT.ndim != 3:
        raise ValueError(f"ids_LKT: expected shape [L, K, T], got {ids_LKT.shape}")
    return pair_counts(ids_LKT, num_experts, interlayer)


def symmetrise(pairs: np.ndarray, num_experts: int) -> np.ndarray:
    """[L, E * E] counts of ordered slot pairs -> symmetric [L, E, E] (diagonal counted once)."""
    E = num_experts
    c = pairs.reshape(-1, E, E)
    return c + c.transpose(0, 2, 1) - np.einsum("lii->li", c)[:, :, None] * np.eye(E, dtype=np.int64)


def coactivation_counts(expert_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Expert pairs selected together in one token's top-k, per layer.

    expert_ids: [T, L, K]. Returns int64 [L, E, E], symmetric: ``C[l, i, j]`` = tokens that selected both
    i and j in layer l (i != j); the diagonal counts an expert listed twice in one top-k (normally 0).
    """
    return symmetrise(pair_bincount(layer_major(expert_ids, num_experts), num_experts), num_experts)


def interlayer_counts(expert_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Inter-layer affinity counts: expert i at layer l and expert j at layer l+1 for the same token.

    expert_ids: [T, L, K]. Returns int64 [L-1, E, E]; each token adds K*K pairs per layer pair.
    """
    c = pair_bincount(layer_major(expert_ids, num_experts), num_experts, interlayer=True)
    return c.reshape(-1, num_experts, num_experts)


def coactivation_lift(counts: np.ndarray, load: np.ndarray) -> np.ndarray:
    """Lift of within-layer pairs over independence: observed / expected from the marginals.

    counts: [L, E, E] symmetric pair counts (:func:`coactivation_counts`); load: [L, E] selections per expert.
    Expected ``X[i, j] = S * m_i * m_j / sum_{a != b} m_a * m_b`` (i != j), with S the layer's observed off-diagonal
    total: random pairing that keeps each expert's load and never pairs an expert with itself (lift 1). Returns
    float [L, E, E], NaN on the diagonal and where an expert has no load.
    """
    c = np.asarray(counts, dtype=np.float64)
    m = np.asarray(load, dtype=np.float64)
    if c.ndim != 3 or m.shape != c.shape[:2] or c.shape[1] != c.shape[2]:
        raise ValueError(f"coactivation_lift: counts [L, E, E] and load [L, E] disagree: {c.shape} vs {m.shape}")
    E = c.shape[1]
    off = ~np.eye(E, dtype=bool)
    s = (c * off).sum((1, 2))
    norm = m.sum(1) ** 2 - (m**2).sum(1)  # sum_{a != b} m_a m_b
    with np.errstate(invalid="ignore", divide="ignore"):
        expected = (s / norm)[:, None, None] * m[:, :, None] * m[:, None, :]
        lift = c / expected
    lift[:, ~off] = np.nan
    return np.where(expected > 0, lift, np.nan)


def interlayer_lift(counts: np.ndarray, load: np.ndarray, num_tokens: float) -> np.ndarray:
    """Lift of inter-layer pairs: observed / (m_l[i] * m_{l+1}[j] / T) (independent choices in the two layers).

    counts: [L-1, E, E] (:func:`interlayer_counts`); load: [L, E]; num_tokens: T. Returns float [L-1, E, E].
    """
    c = np.asarray(counts, dtype=np.float64)
    m = np.asarray(load, dtype=np.float64)
    if m.ndim != 2 or c.shape != (m.shape[0] - 1, m.shape[1], m.shape[1]):
        raise ValueError(f"interlayer_lift: counts {c.shape} do not match load {m.shape} (expected [L-1, E, E])")
    if num_tokens <= 0:
        return np.full(c.shape, np.nan)
    expected = m[:-1, :, None] * m[1:, None, :] / float(num_tokens)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(expected > 0, c / expected, np.nan)


def follow_share(counts: np.ndarray, k: int) -> np.ndarray:
    """Share of layer-l -> l+1 transitions that go to each expert's k most frequent successors.

    counts: [L-1, E, E] inter-layer counts. Returns [L-1]: ``sum_i top_k_j C[i, j] / sum C`` (k/E if random).
    It says how much next-layer traffic could stay local if each expert's k favourite successors sat beside it.
    """
    c = np.asarray(counts, dtype=np.float64)
    top = -np.sort(-c, axis=2)[:, :, :k].sum((1, 2))
    tot = c.sum((1, 2))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(tot > 0, top / tot, np.nan)


def top_pairs(
    counts: np.ndarray, lift: np.ndarray, n: int, by: str = "count", min_count: float = 0, symmetric: bool = True,
) -> list[dict]:
    """The n strongest expert pairs over all layers.

    counts, lift: [L', E, E]. ``by`` is "count" or "lift" (pairs with count < min_count are ignored for lift).
    symmetric: count each unordered pair once (within-layer co-activation). Returns dicts
    ``{"layer", "experts": [i, j], "count", "lift"}``, strongest first.
    """
    if by not in ("count", "lift"):
        raise ValueError(f"top_pairs: by must be 'count' or 'lift', got {by!r}")
    c = np.asarray(counts, dtype=np.float64)
    lf = np.asarray(lift, dtype=np.float64)
    ok = (c > 0) & (c >= min_count)
    if symmetric:
        ok &= np.triu(np.ones(c.shape[1:], bool), 1)[None]
    score = np.where(ok, c if by == "count" else np.nan_to_num(lf, nan=-np.inf), -np.inf)
    flat = score.ravel()
    n = min(n, int(np.isfinite(flat).sum()))
    best = np.argsort(-flat, kind="stable")[:n]
    out = []
    for f in best:
        lyr, i, j = np.unravel_index(f, c.shape)
        lv = lf[lyr, i, j]
        out.append({"layer": int(lyr), "experts": [int(i), int(j)], "count": float(c[lyr, i, j]),
                    "lift": None if not np.isfinite(lv) else float(lv)})
    return out


# --------------------------------------------------------------------------------------------- correlation


def row_pearson(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pearson correlation of matching rows. a, b: [N, E]. Returns [N]; NaN where a row is constant."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"row_pearson: expected two [N, E] arrays of one shape, got {a.shape} and {b.shape}")
    a = a - a.mean(1, keepdims=True)
    b = b - b.mean(1, keepdims=True)
    den = np.sqrt((a * a).sum(1) * (b * b).sum(1))
    with np.errstate(invalid="ignore", divide="ignore"):
        r = (a * b).sum(1) / den
    return np.where(den > 0, np.clip(r, -1.0, 1.0), np.nan)


def row_average_ranks(x: np.ndarray) -> np.ndarray:
    """float64 [N, E]: 1-based ranks of each row of x [N, E], ties given the mean of the ranks they span (what
    ``scipy.stats.rankdata(x, axis=1)`` gives, which tests/test_analyse.py checks). Written out because importing
    scipy.stats costs 1.4-2.3 s, which every ``moeplace analyze`` paid for this one function."""
    x = np.asarray(x)
    N, E = x.shape
    if E == 0:
        return np.zeros((N, 0))
    order = np.argsort(x, axis=1, kind="stable")
    xs = np.take_along_axis(x, order, axis=1)
    idx = np.broadcast_to(np.arange(E), (N, E))
    starts = np.ones((N, E), bool)
    starts[:, 1:] = xs[:, 1:] != xs[:, :-1]
    ends = np.ones((N, E), bool)
    ends[:, :-1] = starts[:, 1:]
    first = np.maximum.accumulate(np.where(starts, idx, 0), axis=1)  # where each element's tie group starts
    last = np.minimum.accumulate(np.where(ends, idx, E)[:, ::-1], axis=1)[:, ::-1]  # and ends
    out = np.empty((N, E))
    np.put_along_axis(out, order, (first + last) / 2.0 + 1.0, axis=1)
    return out


def row_spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman rank correlation of matching rows (ties get average ranks). a, b: [N, E] -> [N]."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"row_spearman: expected two [N, E] arrays of one shape, got {a.shape} and {b.shape}")
    if a.shape[0] == 0:
        return np.zeros(0)
    return row_pearson(row_average_ranks(a), row_average_ranks(b))


def top_n_overlap(a: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    """|top-n(a) & top-n(b)| / n for matching rows; ties broken towards the lower expert id.

    a, b: [N, E]. Returns [N] in [0, 1].
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"top_n_overlap: expected two [N, E] arrays of one shape, got {a.shape} and {b.shape}")
    if not 1 <= n <= a.shape[1]:
        raise ValueError(f"top_n_overlap: n must be in [1, {a.shape[1]}], got {n}")
    ta = np.argsort(-a, axis=1, kind="stable")[:, :n]
    tb = np.argsort(-b, axis=1, kind="stable")[:, :n]
    hit = (ta[:, :, None] == tb[:, None, :]).any(2).sum(1)
    return hit / n


def prefill_decode_correlation(prefill: np.ndarray, decode: np.ndarray, top_n: int) -> dict[str, np.ndarray]:
    """Per request and layer, correlation of the prefill and decode expert-count vectors.

    prefill, decode: [R, L, E] counts of each request. Requests without tokens in one of the phases are dropped.
    Returns ``pearson``, ``spearman``, ``top_n_overlap`` as [R', L] (R' = requests with both phases) and
    ``requests`` [R'] (their row indices). Rows where one side is constant give NaN correlations.
    """
    pre = np.asarray(prefill, dtype=np.float64)
    dec = np.asarray(decode, dtype=np.float64)
    if pre.shape != dec.shape or pre.ndim != 3:
        raise ValueError(f"prefill/decode: expected two [R, L, E] arrays of one shape, got {pre.shape}, {dec.shape}")
    both = (pre.sum((1, 2)) > 0) & (dec.sum((1, 2)) > 0)
    R, L, E = pre[both].shape
    a = pre[both].reshape(R * L, E)
    b = dec[both].reshape(R * L, E)
    return {
        "pearson": row_pearson(a, b).reshape(R, L),
        "spearman": row_spearman(a, b).reshape(R, L),
        "top_n_overlap": top_n_overlap(a, b, top_n).reshape(R, L) if R else np.zeros((0, L)),
        "requests": np.flatnonzero(both),
    }


# --------------------------------------------------------------------------------------------- locality


def shared_experts(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Experts shared by two tokens' top-k sets, per layer. a, b: [P, L, K] -> int [P, L] in [0, K]."""
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape != b.shape or a.ndim != 3:
        raise ValueError(f"shared_experts: expected two [P, L, K] arrays of one shape, got {a.shape}, {b.shape}")
    out = np.zeros(a.shape[:2], np.int64)
    for j in range(a.shape[2]):
        out += (b == a[:, :, j : j + 1]).any(2)
    return out


# --------------------------------------------------------------------------------------------- classification


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split of sample indices into (train, test), per class.

    labels: [N] int. Each class with n >= 2 samples puts round(test_fraction * n) of them (at least 1, at most
    n - 1) in the test set; classes with fewer than 2 samples are left out of both.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    y = np.asarray(labels)
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        if len(idx) < 2:
            continue
        n_test = min(len(idx) - 1, max(1, int(round(test_fraction * len(idx)))))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    cat = lambda parts: np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)  # noqa: E731
    return cat(train), cat(test)


def softmax_regression_accuracy(
    features: np.ndarray, labels: np.ndarray, num_classes: int, test_fraction: float = 0.3, seed: int = 0,
    l2: float = 1e-2, iters: int = 300,
) -> dict | None:
    """Held-out accuracy of multinomial logistic regression (softmax), fitted in plain numpy.

    features: [N, F] (e.g. per-layer L1-normalised expert counts, flattened); labels: [N] ints in
    [0, num_classes). Split with :func:`stratified_split`; features are standardised with the training mean and
    std; weights fitted by Nesterov gradient descent (``iters`` steps, step 1 / Lipschitz bound) on the mean
    cross-entropy plus ``l2 / 2 * |W|^2``. Returns None when fewer than 2 classes have 2 samples, else
    ``accuracy``, ``chance`` (share of the test set's most common class), ``num_train``, ``num_test`` and
    ``confusion`` [C, C] (rows: true class, columns: predicted).
    """
    X = np.asarray(features, dtype=np.float64)
    y = np.asarray(labels)
    if X.ndim != 2 or y.shape != (X.shape[0],):
        raise ValueError(f"features [N, F] and labels [N] disagree: {X.shape} vs {y.shape}")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got [{y.min()}, {y.max()}]")
    if l2 <= 0 or iters < 1:
        raise ValueError(f"l2 must be > 0 and iters >= 1, got {l2}, {iters}")
    train, test = stratified_split(y, test_fraction, seed)
    classes = np.unique(y[train])
    if len(classes) < 2:
        return None
    mu = X[train].mean(0)
    sd = X[train].std(0)
    sd = np.where(sd > 0, sd, 1.0)
    Z = np.hstack([(X - mu) / sd, np.ones((len(X), 1))])  # [N, F + 1], last column: bias
    Zt = Z[train]
    n = len(train)
    Y = (y[train][:, None] == classes[None, :]).astype(np.float64)  # [n, C']
    # Gradient descent from W = 0 keeps W = Zt^T A in the span of the training rows, so iterate on A [n, C'] with
    # the Gram matrix: the same steps for n x n x C' work instead of n x F x C' (F = L * E can be large).
    G = Zt @ Zt.T  # [n, n]
    v = np.random.default_rng(seed).standard_normal(n)
    for _ in range(30):  # power iteration: largest eigenvalue of Zt^T Zt / n (= that of G / n)
        v = G @ v
        v /= np.linalg.norm(v) or 1.0
    lam = float(v @ G @ v) / n
    step = 1.0 / (0.5 * lam + l2)
    A = A_prev = np.zeros((n, len(classes)))
    for i in range(1, iters + 1):
        V = A + (i - 1) / (i + 2) * (A - A_prev)
        S = G @ V
        P = np.exp(S - S.max(1, keepdims=True))
        P /= P.sum(1, keepdims=True)
        A_prev, A = A, V - step * ((P - Y) / n + l2 * V)
    pred = classes[np.argmax(Z[test] @ (Zt.T @ A), axis=1)]
    conf = np.zeros((num_classes, num_classes), np.int64)
    np.add.at(conf, (y[test], pred), 1)
    return {
        "accuracy": float((pred == y[test]).mean()),
        "chance": float(np.bincount(y[test], minlength=num_classes).max() / len(test)),
        "num_train": len(train),
        "num_test": len(test),
        "confusion": conf,
    }
