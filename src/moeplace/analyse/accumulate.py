"""Streaming accumulation of activation statistics over token chunks, in bounded memory.

Shape legend: T = tokens (of one chunk), L = MoE layers, K = top-k, E = logical experts, D = domains,
S = tracked requests (slots).

Every statistic is a sum over tokens, so a chunk adds its counts with one ``np.bincount`` over flattened indices
(``((group * L + l) * E + e)`` for load, ``(l * E + e1) * E + e2`` for pairs) and the chunks can arrive in any size.
Memory held, whatever the trace length:

- load by phase and domain: 2 x D x L x E int64;
- co-activation L x E x E and inter-layer (L-1) x E x E int64;
- per-request counts S x 2 x L x E float32 for the S tracked requests (the caller bounds S);
- temporal locality: the last decode token of at most ``carry_requests`` requests (L x K int16 each);
- drift: two windows' load (2 x L x E) and two floats per layer per closed window.
"""

from __future__ import annotations

import numpy as np

from moeplace.analyse.loops import pair_counts
from moeplace.analyse.stats import js_divergence, shared_experts, symmetrise
from moeplace.trace.types import DECODE

DEFAULT_CARRY_REQUESTS = 1 << 16


class TokenAccumulator:
    """Sums the activation statistics of token chunks.

    Feed chunks in trace order with :meth:`update`; read the sums from the attributes (``load``, ``coact``,
    ``inter``, ``req``, ``overlap_sum`` / ``overlap_pairs``, ``drift_js`` / ``split_js``) after :meth:`finish`.
    Switch statistics off with the flags to measure or save the cost of the others.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        top_k: int,
        num_domains: int = 1,
        num_slots: int = 0,
        window_tokens: int = 0,
        coactivation: bool = True,
        interlayer: bool = True,
        temporal: bool = True,
        carry_requests: int = DEFAULT_CARRY_REQUESTS,
        window_offset: int = 0,
    ) -> None:
        for name, v in (("num_layers", num_layers), ("num_experts", num_experts), ("top_k", top_k),
                        ("num_domains", num_domains)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if num_slots < 0 or window_tokens < 0 or carry_requests < 1 or window_offset < 0:
            raise ValueError("num_slots and window_tokens must be >= 0 and carry_requests >= 1, got "
                             f"{num_slots}, {window_tokens}, {carry_requests}")
        L, E = num_layers, num_experts
        self.L, self.E, self.K, self.D = L, E, top_k, num_domains
        self.num_tokens = 0
        self.load = np.zeros((2, num_domains, L, E), np.int64)  # [phase, domain, L, E]
        self.coact = np.zeros((L, E * E), np.int64) if coactivation else None  # router slot a < b; see finish()
        self.inter = np.zeros((max(L - 1, 0), E * E), np.int64) if interlayer else None
        self.req = np.zeros((num_slots, 2, L, E), np.float32)  # [S, phase, L, E]
        self.temporal = temporal
        self.overlap_sum = np.zeros(L, np.int64)  # shared experts summed over consecutive decode pairs
        self.overlap_pairs = 0
        self.carry_requests = carry_requests
        self._carry: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # rid, pos, ids of last decode rows
        self.window_tokens = window_tokens
        self._win = np.zeros((2, L, E), np.int64)  # current window's load, split by request-id parity
        self._win_n = window_offset % window_tokens if window_tokens else 0
        self._prev_win: np.ndarray | None = None
        self.drift_js: list[np.ndarray] = []  # [L] per consecutive window pair
        self.split_js: list[np.ndarray] = []  # [L] per closed window: even vs odd request ids
        # Trace pieces (window_offset > 0: the first token is not at a window boundary) for an exact merge of
        # accumulators over consecutive pieces (moeplace.analyse.shards): the first window's tokens seen here, by
        # request-id parity, when it began before this piece (it closes here without a JS value), and the first
        # full window's load; ``last_window`` and ``open_window`` give the last full and the unfinished one.
        self.head_window: np.ndarray | None = None  # int64 [2, L, E]
        self.first_window: np.ndarray | None = None  # int64 [L, E]
        self._partial_head = self._win_n > 0
        self.window_offset_in_open = self._win_n  # tokens of the open window seen before this piece
        self._le = (np.arange(L) * E)[None, :, None]
        # Tokens per vectorised step: small enough that the [T, L, K] temporaries stay in cache, large enough that
        # each layer's pair bincount fills its E x E counters several times over (bench/analyse_speed.py).
        self.block_tokens = max(256, (1 << 19) // (L * top_k), 8 * E * E // max(top_k * (top_k - 1), 1))

    def update(
        self,
        expert_ids: np.ndarray,
        request_id: np.ndarray,
        position: np.ndarray,
        phase: np.ndarray,
        domain: np.ndarray | None = None,
        slot: np.ndarray | None = None,
    ) -> None:
        """Add one chunk in trace order.

        expert_ids: [T, L, K] (validated ids); request_id, position, phase: [T]; domain: [T] ints in [0, D)
        (None: all 0); slot: [T] tracked-request slot in [0, S) or -1 (None: no request tracked).
        """
        if expert_ids.ndim != 3 or expert_ids.shape[1:] != (self.L, self.K):
            raise ValueError(f"expert_ids: expected [T, {self.L}, {self.K}], got {expert_ids.shape}")
        step = self.block_tokens
        for s in range(0, expert_ids.shape[0], step):
            sl = slice(s, s + step)
            self._update_block(expert_ids[sl], request_id[sl], position[sl], phase[sl],
                               None if domain is None else domain[sl], None if slot is None else slot[sl])

    def _update_block(self, expert_ids, request_id, position, phase, domain, slot) -> None:
        T = expert_ids.shape[0]
        idx = expert_ids.astype(np.intp, copy=False)
        le = idx + self._le  # [T, L, K]: l * E + e
        ph = np.asarray(phase, dtype=np.intp)
        dom = np.zeros(T, np.intp) if domain is None else np.asarray(domain, dtype=np.intp)
        rid = np.asarray(request_id)
        self._add_load(le, ph, dom, rid)
        if self.coact is not None or self.inter is not None:
            ids_lkt = np.ascontiguousarray(idx.transpose(1, 2, 0))  # [L, K, T]
            if self.coact is not None:
                pair_counts(ids_lkt, self.E, False, out=self.coact)
            if self.inter is not None:
                pair_counts(ids_lkt, self.E, True, out=self.inter)
        if slot is not None and len(self.req):
            self._add_requests(le, ph, np.asarray(slot, dtype=np.intp))
        if self.temporal:
            self._add_temporal(expert_ids, rid, np.asarray(position), ph)
        self.num_tokens += T

    def _add_load(self, le: np.ndarray, ph: np.ndarray, dom: np.ndarray, rid: np.ndarray) -> None:
        LE = self.L * self.E
        group = ((rid & 1).astype(np.intp) * 2 + ph) * self.D + dom  # [T]: (parity, phase, domain)
        W = self.window_tokens
        T = len(group)
        start = 0
        while start < T:  # pieces that never cross a drift-window boundary
            end = T if W == 0 else min(T, start + W - self._win_n)
            g = group[start:end]
            flat = (g[:, None, None] * LE + le[start:end]).ravel()
            c = np.bincount(flat, minlength=2 * 2 * self.D * LE).reshape(2, 2, self.D, self.L, self.E)
            self.load += c.sum(0)
            if W:
                self._win += c.sum((1, 2))
                self._win_n += end - start
                if self._win_n == W:
                    self._close_window()
            start = end

    def _close_window(self) -> None:
        if self._partial_head:  # the rest of a window that began before this piece: the merge closes it
            self.head_window, self._partial_head = self._win, False
            self._win = np.zeros_like(self._win)
            self._win_n = 0
            return
        cur = self._win.sum(0)
        self.split_js.append(js_divergence(self._win[0], self._win[1]))
        if self._prev_win is not None:
            self.drift_js.append(js_divergence(self._prev_win, cur))
        else:
            self.first_window = cur
        self._prev_win = cur
        self._win = np.zeros_like(self._win)
        self._win_n = 0

    @property
    def last_window(self) -> np.ndarray | None:
        """int64 [L, E]: load of the last full window closed here (None: none closed)."""
        return self._prev_win

    @property
    def open_window(self) -> tuple[np.ndarray, int]:
        """(int64 [2, L, E] load by request-id parity, tokens) of the window still open: after the last boundary,
        or since the first token when no boundary was crossed (then it continues a window that began before a
        piece started at ``window_offset`` > 0)."""
        return self._win, self._win_n - (self.window_offset_in_open if self._partial_head else 0)

    def _add_requests(self, le: np.ndarray, ph: np.ndarray, slot: np.ndarray) -> None:
        keep = slot >= 0
        if not keep.any():
            return
        le, ph, slot = le[keep], ph[keep], slot[keep]
        LE = self.L * self.E
        uniq, inv = np.unique(slot, return_inverse=True)
        n_flat = le.size
        if len(uniq) * 2 * LE <= 4 * n_flat + (1 << 20):  # dense local bincount is cheap
            flat = ((inv * 2 + ph)[:, None, None] * LE + le).ravel()
            c = np.bincount(flat, minlength=len(uniq) * 2 * LE).reshape(len(uniq), 2, self.L, self.E)
            self.req[uniq] += c
        else:  # many requests interleaved in one chunk: count only the indices that occur
            flat = ((slot * 2 + ph)[:, None, None] * LE + le).ravel()
            u, c = np.unique(flat, return_counts=True)
            self.req.reshape(-1)[u] += c

    def _add_temporal(self, ids: np.ndarray, rid: np.ndarray, pos: np.ndarray, ph: np.ndarray) -> None:
        dec = ph == DECODE
        if not dec.any():
            return
        r, p, x = rid[dec], pos[dec], ids[dec]
        n_new = len(r)
        if self._carry is not None:
            cr, cp, cx = self._carry
            r, p, x = np.concatenate([cr, r]), np.concatenate([cp, p]), np.concatenate([cx, x])
        age = np.r_[np.zeros(len(r) - n_new, np.int8), np.ones(n_new, np.int8)]
        order = np.lexsort((p, r))
        r, p, x, age = r[order], p[order], x[order], age[order]
        nxt = np.flatnonzero((r[1:] == r[:-1]) & (p[1:] == p[:-1] + 1))
        if len(nxt):
            self.overlap_sum += shared_experts(x[nxt], x[nxt + 1]).sum(0)
            self.overlap_pairs += len(nxt)
        last = np.flatnonzero(np.r_[r[1:] != r[:-1], True])  # last decode row of each request
        if len(last) > self.carry_requests:  # keep the requests seen in this chunk first
            last = last[np.argsort(-age[last], kind="stable")[: self.carry_requests]]
        self._carry = (r[last], p[last], x[last])

    def finish(self) -> None:
        """Symmetrise the co-activation counts. Call once, after the last chunk (a partial last window is dropped)."""
        if self.coact is not None and self.coact.ndim == 2:
            self.coact = symmetrise(self.coact, self.E)
        if self.inter is not None and self.inter.ndim == 2:
            self.inter = self.inter.reshape(-1, self.E, self.E)
