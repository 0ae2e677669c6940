"""Counters of one window of routing: sampled per-domain expert counts and capacity drops per micro-batch.

Shape legend: T = token rows, L = MoE layers, K = top-k, E = logical experts, D = domains, B = micro-batches.

- **Expert counts** are sampled 1-in-n: the token rows whose running index (over the whole stream) is a multiple of
  ``sample_every`` are counted, split by the request's domain, and the estimate is ``n x`` the sampled counts (what
  a recorder with a sampling rate reports; it keeps the per-token work of the counters at 1/n).
- **Drops** exist only with a capacity factor (None, the default, is dropless, as SGLang and vLLM serve: no
  pair is dropped and no drop is counted). With one, as token-dropping engines do, in each micro-batch and layer
  an expert takes at most ``C = floor(capacity_factor x pairs / E)`` pairs; the pairs above C are dropped. Drops
  are counted on every row (the dispatch kernel of an engine sees them all), never sampled. They depend on routing
  only, not on the placement (a replica does not raise a logical expert's capacity in this definition).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeplace.simulate.batching import BatchConfig, build_layout, microbatch_ids, rows_of
from moeplace.trace.types import Trace


@dataclass(frozen=True)
class WindowCounts:
    """What the counters saw in one window."""

    domains: tuple[str, ...]  # D domain names, in first-seen order of this window
    sampled: np.ndarray  # int64 [D, L, E]: sampled token-expert selections per domain
    sample_every: int  # n of 1-in-n sampling
    tokens: np.ndarray  # int64 [D]: token rows per domain (all rows, not sampled)
    pairs: int  # token-expert pairs routed (all rows, summed over layers: T x L x K)
    dropped: int | None  # pairs above capacity (all rows); None: dropless (no capacity factor)
    steps: int  # micro-batches (forward passes) of the window, prefill and decode

    @property
    def load(self) -> np.ndarray:
        """float64 [L, E]: estimated selections per expert (sampled counts x n, all domains)."""
        return self.sampled.sum(0).astype(np.float64) * self.sample_every

    @property
    def drop_ratio(self) -> float | None:
        """Dropped / routed pairs; None when dropless."""
        if self.dropped is None:
            return None
        return self.dropped / self.pairs if self.pairs else 0.0

    def top_expert_share(self) -> np.ndarray:
        """float [L]: share of the hottest expert in each layer's (sampled) selections; 0 where none."""
        x = self.sampled.sum(0).astype(np.float64)
        tot = x.sum(1)
        return np.divide(x.max(1), tot, out=np.zeros(len(tot)), where=tot > 0)


def count_window(window: Trace, home: np.ndarray, batching: BatchConfig, sample_every: int = 16,
                 capacity_factor: float | None = None, first_row: int = 0) -> WindowCounts:
    """Counters of one window (an in-memory per-token trace).

    home: int [Rq] home GPU of each request (table order) -- it fixes micro-batches only through the layout;
    first_row: running index of the window's first token row in the stream (keeps 1-in-n sampling aligned across
    windows); capacity_factor: None (dropless) or the factor of the module docstring's drops.
    """
    if sample_every < 1:
        raise ValueError(f"sample_every must be >= 1, got {sample_every}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    tk, req, meta = window.tokens, window.requests, window.meta
    L, E, K = meta.num_layers, meta.num_experts, meta.top_k
    lay = build_layout(window, req, home, batching)
    r = rows_of(lay, tk.request_id)
    doms = tuple(dict.fromkeys(req.domain.tolist()))
    dom_index = {d: i for i, d in enumerate(doms)}
    d_of_req = np.array([dom_index[d] for d in req.domain.tolist()], np.int64)
    d_of_row = d_of_req[r] if len(r) else np.zeros(0, np.int64)
    ids = np.asarray(tk.expert_ids, np.int64)  # [T, L, K]
    T = len(ids)
    keep = (first_row + np.arange(T)) % sample_every == 0
    sampled = np.zeros((len(doms), L, E), np.int64)
    if keep.any():
        flat = (d_of_row[keep][:, None, None] * L + np.arange(L)[None, :, None]) * E + ids[keep]
        sampled = np.bincount(flat.ravel(), minlength=len(doms) * L * E).reshape(len(doms), L, E)
    tokens = np.bincount(d_of_row, minlength=len(doms)).astype(np.int64)
    # drops: per micro-batch (phase-separate id spaces) and layer, pairs above capacity_factor x pairs / E
    mb = microbatch_ids(lay, r, tk.position, tk.phase)
    key = np.stack([np.asarray(tk.phase, np.int64), mb], 1)
    _, b = np.unique(key, axis=0, return_inverse=True) if T else (None, np.zeros(0, np.int64))
    b = np.asarray(b).ravel()
    B = int(b.max()) + 1 if T else 0
    dropped = None if capacity_factor is None else 0
    if T and capacity_factor is not None:
        cnt = np.bincount(((b[:, None, None] * L + np.arange(L)[None, :, None]) * E + ids).ravel(),
                          minlength=B * L * E).reshape(B, L, E)
        cap = np.floor(capacity_factor * cnt.sum(2, keepdims=True) / E).astype(np.int64)
        dropped = int(np.maximum(cnt - cap, 0).sum())
    return WindowCounts(doms, sampled, int(sample_every), tokens, int(T * L * K), dropped, B)
