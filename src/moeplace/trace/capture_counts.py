"""Counts-only capture (``moeplace trace record --counts-only WINDOW``): per-window, per-layer, per-expert counts
instead of per-token routing, so the trace never holds a token's routing, a request's id or its length.

Shape legend: T = token rows, L = MoE layers, K = top-k, E = logical experts, R = requests.

:class:`CountsSink` stands where :func:`moeplace.trace.capture.record_generate` and
:func:`~moeplace.trace.capture.record_prefill` expect a :class:`~moeplace.trace.writer.TraceWriter`: it takes the
same ``add_requests`` / ``add_tokens`` / ``flush`` calls, keeps the rows of the open windows in memory as counts,
and hands each finished window to a counts-kind writer as one group per phase (``add_counts``). Requests are
numbered in the order they arrive (their request-id order: both recorders hand requests over sorted by id); window
w holds arrivals ``[w * WINDOW, (w + 1) * WINDOW)`` (the last window may hold fewer). No request row is written.
Like SGLang's ``stat`` recorder mode, but per window of requests rather than per forward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from moeplace.trace.format import as_1d, check_expert_ids, check_phase
from moeplace.trace.types import DECODE, PREFILL, TraceError, TraceMeta
from moeplace.trace.writer import TraceWriter

MIXED_DOMAIN = "mixed"  # the domain of a window whose requests have different domains


def counts_meta(meta: TraceMeta, window_requests: int) -> TraceMeta:
    """``meta`` (a capture's per-token metadata) for a counts-only trace of windows of ``window_requests``
    requests: kind "counts", no weights, the window recorded in ``extra``."""
    if isinstance(window_requests, bool) or not isinstance(window_requests, int) or window_requests < 1:
        raise ValueError(f"window_requests must be a positive integer, got {window_requests!r}")
    extra = {**meta.extra, "counts_window_requests": window_requests,
             "counts_only": f"per-window counts: each window of {window_requests} consecutive recorded requests is "
                            "one group per phase (group 'window<w>', domain the requests' common domain or "
                            f"'{MIXED_DOMAIN}'); no token rows, no request rows (docs/PRIVACY.md)"}
    extra.pop("expert_weights", None)
    return dataclasses.replace(meta, kind="counts", has_weights=False, extra=extra)


@dataclass
class _Window:
    """What one window has gathered so far."""

    requests: int = 0
    domains: set[str] = field(default_factory=set)
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(2, np.int64))  # [2] per phase
    counts: np.ndarray | None = None  # int64 [2, L * E] per phase, layer-major


class CountsSink:
    """A writer stand-in that turns token rows into per-window expert counts (module docstring).

    ``writer``: a counts-kind :class:`TraceWriter` (:func:`counts_meta`); ``window_requests``: requests per window.
    Call :meth:`close` after the last batch (the last, partial window is written then); the writer itself is
    closed by its owner. A window is written once all its requests have arrived and the next requests (or a
    flush) come, so at most the open window is lost to a kill.
    """

    def __init__(self, writer: TraceWriter, window_requests: int) -> None:
        if writer.meta.kind != "counts":
            raise TraceError("CountsSink: the writer must be counts-only (kind='counts'; see counts_meta)")
        if isinstance(window_requests, bool) or not isinstance(window_requests, int) or window_requests < 1:
            raise ValueError(f"window_requests must be a positive integer, got {window_requests!r}")
        self.writer = writer
        self.meta = writer.meta
        self.window_requests = window_requests
        self._arrived = 0
        self._window_of: dict[int, int] = {}  # request id -> window, for requests of windows not written yet
        self._open: dict[int, _Window] = {}
        self.windows_written = 0

    def add_requests(self, request_id: Sequence[int] | np.ndarray, domain: Sequence[str] | None = None,
                     source: Sequence[str] | None = None, prompt_len: Sequence[int] | np.ndarray | None = None,
                     gen_len: Sequence[int] | np.ndarray | None = None) -> None:
        """Requests [R] arrive (in request-id order); only their window and domain are kept."""
        self._write_full()
        rid = as_1d("request_id", request_id, np.int64)
        dom = ["unknown"] * len(rid) if domain is None else [str(d) for d in domain]
        if len(dom) != len(rid):
            raise TraceError(f"add_requests: domain must have {len(rid)} entries like request_id")
        for r, d in zip(rid.tolist(), dom, strict=True):
            if r in self._window_of:
                raise TraceError(f"add_requests: request {r} arrived twice")
            w = self._arrived // self.window_requests
            self._arrived += 1
            self._window_of[r] = w
            win = self._open.setdefault(w, _Window())
            win.requests += 1
            win.domains.add(d)

    def add_tokens(self, request_id: np.ndarray, position: np.ndarray, phase: np.ndarray, expert_ids: np.ndarray,
                   expert_weights: np.ndarray | None = None) -> None:
        """Token rows (request_id, position, phase [T]; expert_ids [T, L, K]) are counted into their requests'
        windows; positions and weights are dropped."""
        ids = check_expert_ids(expert_ids, self.meta)
        t = ids.shape[0]
        rid = as_1d("request_id", request_id, np.int64, t)
        as_1d("position", position, np.int32, t)
        ph = as_1d("phase", phase, np.int8, t)
        check_phase(ph, "add_tokens")
        if not t:
            return
        try:
            win = np.fromiter((self._window_of[r] for r in rid.tolist()), np.int64, t)
        except KeyError as e:
            raise TraceError(f"add_tokens: request {e.args[0]} has no request row in an open window (add_requests "
                             "first; its window may already be written)") from None
        L, E = self.meta.num_layers, self.meta.num_experts
        flat = (np.arange(L, dtype=np.int64)[None, :, None] * E + ids).reshape(t, -1)  # [T, L*K] in [0, L*E)
        for w in np.unique(win).tolist():
            cur = self._open[w]
            if cur.counts is None:
                cur.counts = np.zeros((2, L * E), np.int64)
            for p in (PREFILL, DECODE):
                m = (win == w) & (ph == p)
                n = int(m.sum())
                if n:
                    cur.tokens[p] += n
                    cur.counts[p] += np.bincount(flat[m].ravel(), minlength=L * E)

    def flush(self) -> None:
        """Write the windows whose requests have all arrived, then flush the writer (a kill keeps them)."""
        self._write_full()
        self.writer.flush()

    def close(self) -> None:
        """Write every open window, the last, partial one included."""
        self._write(sorted(self._open))
        self.writer.flush()

    def _write_full(self) -> None:
        self._write([w for w in sorted(self._open) if self._open[w].requests >= self.window_requests])

    def _write(self, windows: list[int]) -> None:
        if not windows:
            return
        L, E = self.meta.num_layers, self.meta.num_experts
        groups, doms, phases, ntok, counts = [], [], [], [], []
        for w in windows:
            cur = self._open.pop(w)
            d = next(iter(cur.domains)) if len(cur.domains) == 1 else MIXED_DOMAIN
            for p in (PREFILL, DECODE):
                if cur.tokens[p]:
                    groups.append(f"window{w}")
                    doms.append(d)
                    phases.append(p)
                    ntok.append(float(cur.tokens[p]))
                    counts.append(cur.counts[p].reshape(L, E))
        done = set(windows)
        self._window_of = {r: w for r, w in self._window_of.items() if w not in done}
        self.windows_written += len(windows)
        if groups:
            self.writer.add_counts(groups, doms, np.asarray(phases, np.int8), np.asarray(ntok),
                                   np.stack(counts).astype(np.float64))
