"""Request grouping: choose the home GPU of each request from the routing known when it arrives (prefill).

Shape legend: Rq = requests, L = MoE layers, E = logical experts, D = L * E feature size, N = nodes, G = GPUs per
node, W = N * G GPUs, C = clusters.

A request's feature is its prefill expert-count vector over all MoE layers, flattened to [D] and L2-normalised. A
:class:`moeplace.placement.grouper.Grouper` (the plan's; fitted here) scores each request against one weight row per
node (K-means centroids, or the placement's local-expert indicator) and admits requests in rounds: inside a round,
requests are placed by decreasing confidence on their best node that still has room, each GPU taking at most ceil(round
/ W) requests, so per-GPU batch sizes stay balanced; inside a node, the GPU with the fewest homes this round takes it.
"""

from __future__ import annotations

import numpy as np

from moeplace.placement.grouper import balanced_assign


def kmeans(x: np.ndarray, k: int, iters: int = 25, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Spherical K-means (cosine similarity) with k-means++ seeding.

    x: float [Rq, D] unit rows. Returns (centroids float32 [k, D] unit rows, labels int64 [Rq]).
    """
    x = np.asarray(x, np.float32)
    n = len(x)
    if k < 1:
        raise ValueError(f"kmeans: k must be >= 1, got {k}")
    if n < k:
        raise ValueError(f"kmeans: {n} requests cannot form {k} clusters")
    rng = np.random.default_rng(seed)
    cent = [x[rng.integers(n)]]
    d2 = np.maximum(0.0, 2.0 - 2.0 * (x @ cent[0]))
    for _ in range(1, k):
        p = d2 / d2.sum() if d2.sum() > 0 else np.full(n, 1.0 / n)
        c = x[rng.choice(n, p=p)]
        cent.append(c)
        d2 = np.minimum(d2, np.maximum(0.0, 2.0 - 2.0 * (x @ c)))
    C = np.stack(cent)
    labels = np.full(n, -1, np.int64)
    for _ in range(iters):
        new = np.argmax(x @ C.T, axis=1)
        if np.array_equal(new, labels):
            break
        labels = new
        for c in range(k):
            m = labels == c
            v = x[m].sum(axis=0) if m.any() else x[rng.integers(n)]
            C[c] = v / max(float(np.linalg.norm(v)), 1e-12)
    return C.astype(np.float32), labels


def capped_kmeans(x: np.ndarray, k: int, restarts: int = 4, seed: int = 0) -> np.ndarray:
    """int64 [Rq]: a cluster in [0, k) per row of ``x`` (float [Rq, D] unit rows), at most ceil(Rq / k) rows each.

    Spherical K-means (:func:`kmeans`) from seeds ``seed .. seed + restarts - 1``; each seed's centroids take the rows
    under the cap (:func:`moeplace.placement.grouper.balanced_assign`, the per-group cap of the grouper's rounds over
    a whole window), and the seed whose rows sit closest to their centroids (sum of cosines) is kept. Deterministic.
    """
    x = np.asarray(x, np.float32)
    R = len(x)
    if k < 1 or restarts < 1:
        raise ValueError(f"capped_kmeans: k and restarts must be >= 1, got {k}, {restarts}")
    if R < k:
        raise ValueError(f"capped_kmeans: {R} rows cannot fill {k} clusters")
    cap = np.full(k, -(-R // k), np.int64)
    best: tuple[float, np.ndarray] | None = None
    for s in range(seed, seed + restarts):
        cent, _ = kmeans(x, k, seed=s)
        score = x @ cent.T
        group = balanced_assign(score, cap)
        cohesion = float(score[np.arange(R), group].sum())
        if best is None or cohesion > best[0]:
            best = (cohesion, group)
    assert best is not None
    return best[1]
