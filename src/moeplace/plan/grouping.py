"""Request grouping: choose the home GPU of each request from the routing known when it arrives (prefill).

Shape legend: Rq = requests, L = MoE layers, E = logical experts, D = L * E feature size, N = nodes, G = GPUs per
node, W = N * G GPUs, C = clusters.

A request's feature is its prefill expert-count vector over all MoE layers, flattened to [D] and L2-normalised.
A :class:`Grouper` scores each request against one weight row per node (K-means centroids, or the placement's
local-expert indicator) and admits requests in rounds: inside a round, requests are placed by decreasing
confidence on their best node that still has room, each GPU taking at most ceil(round / W) requests, so per-GPU
batch sizes stay balanced; inside a node, the GPU with the fewest homes this round takes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_ROUND = 64  # requests admitted per scheduling round


def normalise_rows(x: np.ndarray) -> np.ndarray:
    """float32 [Rq, D]: rows scaled to unit L2 norm (zero rows stay zero)."""
    x = np.asarray(x, np.float32).reshape(len(x), -1)
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(n > 0, n, 1.0)


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


def balanced_assign(score: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Assign each row to a column maximising score, column c taking at most capacity[c] rows.

    score: float [Rq, C]; capacity: int [C] with sum >= Rq. Greedy by decreasing regret (best minus second best):
    the rows that lose most by moving go first. Returns int64 [Rq].
    """
    score = np.asarray(score, np.float64)
    R, C = score.shape
    cap = np.asarray(capacity, np.int64).copy()
    if cap.sum() < R:
        raise ValueError(f"balanced_assign: capacity {int(cap.sum())} is below {R} rows")
    out = np.full(R, -1, np.int64)
    if C == 1:
        out[:] = 0
        return out
    srt = np.sort(score, axis=1)
    order = np.argsort(-(srt[:, -1] - srt[:, -2]), kind="stable")
    pref = np.argsort(-score, axis=1, kind="stable")
    for r in order:
        for c in pref[r]:
            if cap[c] > 0:
                out[r] = c
                cap[c] -= 1
                break
    return out


@dataclass
class Grouper:
    """Online home assignment from prefill routing: one linear scorer row per node."""

    weights: np.ndarray  # float32 [N, D]: node n's score for a request is feature . weights[n]
    gpus_per_node: int  # G
    round_size: int = DEFAULT_ROUND  # requests per admission round
    kind: str = "centroids"  # what the rows are (K-means centroids, or centroids of cost-optimal labels)
    layers: list[int] | None = None  # MoE layers the feature uses (None: all), so D = len(layers) * E

    def __post_init__(self) -> None:
        self.weights = np.asarray(self.weights, np.float32)
        if self.weights.ndim != 2:
            raise ValueError(f"grouper weights: expected shape [N, D], got {self.weights.shape}")
        if self.gpus_per_node < 1 or self.round_size < 1:
            raise ValueError(f"grouper: gpus_per_node and round_size must be >= 1, got {self.gpus_per_node}, "
                             f"{self.round_size}")

    @property
    def num_nodes(self) -> int:
        return self.weights.shape[0]

    def node_scores(self, counts: np.ndarray) -> np.ndarray:
        """float [Rq, N]: cosine-style score of each request for each node. counts: [Rq, L, E] (restricted to
        ``layers`` here) or [Rq, D]."""
        c = np.asarray(counts)
        if self.layers is not None and c.ndim == 3:
            c = c[:, self.layers, :]
        x = normalise_rows(c.reshape(len(c), -1))
        if x.shape[1] != self.weights.shape[1]:
            raise ValueError(f"grouper: request features have {x.shape[1]} entries, the plan expects "
                             f"{self.weights.shape[1]} (L * E)")
        return x @ self.weights.T

    def assign(self, counts: np.ndarray) -> np.ndarray:
        """int64 [Rq]: home GPU of each request, in arrival order. counts: float [Rq, L, E] prefill counts."""
        return assign_rounds(self.node_scores(counts), self.gpus_per_node, self.round_size)

    def assign_features(self, feats: np.ndarray) -> np.ndarray:
        """int64 [Rq]: like :meth:`assign` for features already normalised and restricted to ``layers``."""
        return assign_rounds(np.asarray(feats) @ self.weights.T, self.gpus_per_node, self.round_size)

    def to_json(self) -> dict:
        return {"kind": self.kind, "gpus_per_node": int(self.gpus_per_node), "round_size": int(self.round_size),
                "layers": self.layers, "weights": np.round(self.weights, 5).tolist()}

    @classmethod
    def from_json(cls, d: dict) -> Grouper:
        try:
            layers = d.get("layers")
            return cls(np.asarray(d["weights"], np.float32), int(d["gpus_per_node"]), int(d["round_size"]),
                       str(d.get("kind", "centroids")), None if layers is None else [int(x) for x in layers])
        except (KeyError, TypeError) as e:
            raise ValueError(f"grouper: malformed JSON ({e})") from None


def assign_rounds(node_score: np.ndarray, gpus_per_node: int, round_size: int = DEFAULT_ROUND) -> np.ndarray:
    """int64 [Rq]: homes for requests in arrival order, admitted in rounds of ``round_size``.

    node_score: float [Rq, N]. In each round every GPU takes at most ceil(round / W) requests (node capacity is G
    times that); inside a node, GPUs take turns (round-robin across rounds), so their home counts differ by at most one.
    """
    R, N = node_score.shape
    G = gpus_per_node
    W = N * G
    homes = np.empty(R, np.int64)
    nxt = np.zeros(N, np.int64)  # next GPU inside each node (round-robin across rounds)
    for s in range(0, R, round_size):
        sc = node_score[s:s + round_size]
        per_gpu = -(-len(sc) // W)
        node = balanced_assign(sc, np.full(N, per_gpu * G))
        for n in range(N):
            idx = np.flatnonzero(node == n)
            homes[s + idx] = n * G + (nxt[n] + np.arange(len(idx))) % G
            nxt[n] += len(idx)
    return homes
