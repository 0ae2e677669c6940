"""The grouper a plan holds: a request's home GPU from the routing known when it arrives (prefill).

Shape legend: Rq = requests, L = MoE layers, E = logical experts, D = L * E feature size, N = nodes, G = GPUs per
node, W = N * G GPUs, C = columns (nodes).

A request's feature is its prefill expert-count vector over the grouper's MoE layers, flattened to [D] and
L2-normalised. A :class:`Grouper` scores each request against one weight row per node and admits requests in rounds
(:func:`assign_rounds`). Fitting one is the planner's job (:mod:`moeplace.plan.grouping`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeplace.placement.config import DEFAULT_ROUND  # requests admitted per scheduling round


def normalise_rows(x: np.ndarray) -> np.ndarray:
    """float32 [Rq, D]: rows scaled to unit L2 norm (zero rows stay zero)."""
    x = np.asarray(x, np.float32).reshape(len(x), -1)
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(n > 0, n, 1.0)


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


@dataclass(frozen=True, eq=False)
class Grouper:
    """Online home assignment from prefill routing: one linear scorer row per node (a plan holds one; its JSON is
    the plan file's ``grouper`` object)."""

    weights: np.ndarray  # float32 [N, D]: node n's score for a request is feature . weights[n]
    gpus_per_node: int  # G
    round_size: int = DEFAULT_ROUND  # requests per admission round
    kind: str = "centroids"  # what the rows are (K-means centroids, or centroids of cost-optimal labels)
    layers: tuple[int, ...] | None = None  # MoE layers the feature uses (None: all), so D = len(layers) * E

    def __post_init__(self) -> None:
        w = np.asarray(self.weights, np.float32)
        if w.ndim != 2 or not np.isfinite(w).all():
            raise ValueError(f"grouper: weights must be a finite [N, D] matrix, got shape {w.shape}")
        object.__setattr__(self, "weights", w)
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        if self.gpus_per_node < 1 or self.round_size < 1:
            raise ValueError(f"grouper: gpus_per_node and round_size must be >= 1, got {self.gpus_per_node}, "
                             f"{self.round_size}")

    @property
    def num_nodes(self) -> int:
        return self.weights.shape[0]

    def rounded(self, decimals: int = 5) -> Grouper:
        """The same grouper with weights rounded to ``decimals`` (what a plan stores)."""
        return Grouper(np.round(self.weights, decimals), self.gpus_per_node, self.round_size, self.kind, self.layers)

    def node_scores(self, counts: np.ndarray) -> np.ndarray:
        """float [Rq, N]: cosine-style score of each request for each node. counts: [Rq, L, E] (restricted to
        ``layers`` here) or [Rq, D]."""
        c = np.asarray(counts)
        if self.layers is not None and c.ndim == 3:
            c = c[:, list(self.layers), :]
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
                "layers": None if self.layers is None else list(self.layers), "weights": self.weights.tolist()}

    @classmethod
    def from_json(cls, d: dict) -> Grouper:
        """From a plan file's grouper object (schema.GrouperJSON's fields, validated) or :meth:`to_json`."""
        try:
            layers = d.get("layers")
            return cls(np.asarray(d["weights"], np.float32), int(d["gpus_per_node"]), int(d["round_size"]),
                       str(d.get("kind", "centroids")), None if layers is None else tuple(int(x) for x in layers))
        except (KeyError, TypeError) as e:
            raise ValueError(f"grouper: malformed JSON ({e})") from None


def admission_round(round_size: int, world_size: int) -> int:
    """Requests per admission round: ``round_size`` rounded up to a multiple of the GPU count ``world_size``, so that
    a full round gives every node exactly its share (``round / N``) and every GPU ``round / W``. Where W does not
    divide ``round_size`` (64 at 3 x 8 GPUs) a node would otherwise take more than its share: an attention load
    the MoE layer time does not price (docs/ROUTE.md, "Admission")."""
    if round_size < 1 or world_size < 1:
        raise ValueError(f"admission_round: round_size and world_size must be >= 1, got {round_size}, {world_size}")
    return -(-int(round_size) // int(world_size)) * int(world_size)


def assign_rounds(node_score: np.ndarray, gpus_per_node: int, round_size: int = DEFAULT_ROUND) -> np.ndarray:
    """int64 [Rq]: homes for requests in arrival order, admitted in rounds of :func:`admission_round` (``round_size``
    rounded up to a multiple of W).

    node_score: float [Rq, N]. In each round every GPU takes at most ceil(len(round) / W) requests (node capacity is
    G times that: exactly its share of a full round); inside a node, GPUs take turns (round-robin across rounds), so
    their home counts differ by at most one.
    """
    R, N = node_score.shape
    G = gpus_per_node
    W = N * G
    step = admission_round(round_size, W)
    homes = np.empty(R, np.int64)
    nxt = np.zeros(N, np.int64)  # next GPU inside each node (round-robin across rounds)
    for s in range(0, R, step):
        sc = node_score[s:s + step]
        per_gpu = -(-len(sc) // W)
        node = balanced_assign(sc, np.full(N, per_gpu * G))
        for n in range(N):
            idx = np.flatnonzero(node == n)
            homes[s + idx] = n * G + (nxt[n] + np.arange(len(idx))) % G
            nxt[n] += len(idx)
    return homes
