"""How requests become micro-batches: the public layout that the simulator and the runtime share.

Shape legend: T = tokens, R = requests, B = micro-batches.

Arrival order is the request table's order: prefill prompts are laid end to end in that order and cut every
``prefill_tokens``. Decode has two rules:

- *windows* (``decode_running`` None, the default): windows hold ``decode_batch`` consecutive requests, and decode
  micro-batch ``(w, i)`` is the i-th decode token of every request of window ``w``;
- *continuous batching* (``decode_running`` = B x W, as serving engines run a loaded server): a running set of up
  to ``decode_running`` requests; each contributes one token per step until its decode ends, and the next request
  in arrival order joins at the step a running one leaves (:func:`continuous_starts`). Decode micro-batch ``s`` is
  step ``s``: request r's j-th decode token is in micro-batch ``start[r] + j``.

A trace sorted by domain therefore puts one domain in each micro-batch; shuffle the request table
(``moeplace.evaluate``) to state a mixed order. Micro-batch ids depend only on a token row and the request-level
facts of the layout, so streaming never splits a micro-batch incorrectly (docs/SIMULATOR.md).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from moeplace.simulate.config import BatchConfig
from moeplace.trace.reader import iter_light_columns
from moeplace.trace.types import DECODE, PREFILL, Requests, Trace

DECODE_WINDOW_SHIFT = 32  # decode micro-batch id = window << 32 | step


@dataclass
class Layout:
    """Request-level facts fixed before the token pass, so micro-batch ids are exact under any chunking."""

    req_sorted: np.ndarray  # int64 [R]: request ids, sorted
    req_index: np.ndarray  # int64 [R]: table index of req_sorted[i]
    home: np.ndarray  # int64 [R]: home GPU (table order)
    prompt: np.ndarray  # int64 [R]: prompt length (table order; see docs/SIMULATOR.md)
    prefill_start: np.ndarray  # int64 [R]: exclusive cumsum of prompt (prompts laid end to end)
    decode_batch: int
    prefill_tokens: int
    decode_running: int | None = None  # continuous batching's running set (None: decode windows)
    decode_first: np.ndarray | None = None  # int64 [R]: first decode step (pos - prompt) seen (table order)
    decode_start: np.ndarray | None = None  # int64 [R]: step the request joins the running set (continuous only)
    mb_ids: dict = field(default_factory=dict)  # phase -> int64 [B] sorted micro-batch ids
    mb_tokens: dict = field(default_factory=dict)  # phase -> int64 [B] tokens of each


def rows_of(lay: Layout, rid: np.ndarray) -> np.ndarray:
    """Table index of each token's request; unknown ids raise ValueError."""
    rid = np.asarray(rid, np.int64)
    i = np.searchsorted(lay.req_sorted, rid)
    i = np.minimum(i, max(len(lay.req_sorted) - 1, 0))
    bad = (lay.req_sorted[i] != rid) if len(lay.req_sorted) else np.ones(len(rid), bool)
    if bad.any():
        raise ValueError(f"token rows name request_id {int(rid[bad][0])} that is not in the request table")
    return lay.req_index[i]


def microbatch_ids(lay: Layout, r: np.ndarray, position: np.ndarray, phase: np.ndarray) -> np.ndarray:
    """int64 [T] micro-batch id of each token (ids of the two phases are separate spaces).

    Prefill: prompts laid end to end in request-table order, token (r, pos) at offset prefill_start[r] + pos,
    micro-batch = offset // prefill_tokens. Decode: window w = r // decode_batch, step i = pos - prompt[r],
    micro-batch = w << 32 | i (the i-th decode token of every request of the window).
    """
    pos = np.asarray(position, np.int64)
    out = np.empty(len(r), np.int64)
    pre = np.asarray(phase) == PREFILL
    if pre.any():
        rp, pp = r[pre], pos[pre]
        badp = (pp < 0) | (pp >= lay.prompt[rp])
        if badp.any():
            j = np.flatnonzero(badp)[0]
            raise ValueError(f"prefill token at position {int(pp[j])} lies outside its request's prompt "
                             f"(prompt length {int(lay.prompt[rp[j]])}, request index {int(rp[j])})")
        out[pre] = (lay.prefill_start[rp] + pp) // lay.prefill_tokens
    dec = ~pre
    if dec.any():
        rd = r[dec]
        step = pos[dec] - lay.prompt[rd]
        if (step < 0).any():
            j = np.flatnonzero(step < 0)[0]
            raise ValueError(f"decode token at position {int(pos[dec][j])} lies inside its request's prompt "
                             f"(prompt length {int(lay.prompt[rd[j]])})")
        if (step >= 1 << DECODE_WINDOW_SHIFT).any():
            raise ValueError("decode step beyond 2**32")
        if lay.decode_running is None:
            out[dec] = ((rd // lay.decode_batch) << DECODE_WINDOW_SHIFT) | step
        else:
            out[dec] = lay.decode_start[rd] + step - lay.decode_first[rd]
    return out


def continuous_starts(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """int64 [R]: the decode step at which each request joins a continuous batch.

    lengths: int [R] decode steps of each request, in arrival order; capacity: the running set's size. The first
    ``capacity`` requests start at step 0; every later one starts at the step the earliest-finishing running request
    leaves (a request that starts at s with n steps leaves at s + n). A request with no decode step takes no place.
    Sequential by nature (a heap of finish steps); O(R log capacity).
    """
    if isinstance(capacity, bool) or int(capacity) < 1:
        raise ValueError(f"continuous batching: capacity must be >= 1, got {capacity!r}")
    n = np.asarray(lengths, np.int64)
    out = np.zeros(len(n), np.int64)
    heap: list[int] = []
    for i, ln in enumerate(n.tolist()):
        if ln <= 0:
            continue
        s = 0 if len(heap) < capacity else heapq.heappop(heap)
        out[i] = s
        heapq.heappush(heap, s + ln)
    return out


def light_columns(source: Trace | str) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(request_id int64 [n], position [n], phase [n]) of every token of an in-memory trace or a trace directory,
    without the routing columns, through the one validating reader
    (:func:`moeplace.trace.reader.iter_light_columns`)."""
    yield from iter_light_columns(source)


def build_layout(source: Trace | str, requests: Requests, home: np.ndarray, batching: BatchConfig) -> Layout:
    """The micro-batch layout of a trace (first, light pass): homes int [R] in request-table order."""
    R = len(requests)
    order = np.argsort(requests.request_id, kind="stable")
    prompt = np.asarray(requests.prompt_len, np.int64).copy()
    lay = Layout(requests.request_id[order].astype(np.int64), order.astype(np.int64), np.asarray(home, np.int64),
                  prompt, np.zeros(R, np.int64), batching.decode_batch, batching.prefill_tokens,
                  batching.decode_running)
    if (prompt <= 0).any():  # unknown prompt length: 1 + the largest prefill position seen
        seen = np.zeros(R, np.int64)
        for rid, pos, ph in light_columns(source):
            pre = ph == PREFILL
            np.maximum.at(seen, rows_of(lay, rid[pre]), pos[pre].astype(np.int64) + 1)
        lay.prompt = np.where(prompt > 0, prompt, seen)
    lay.prefill_start = np.cumsum(lay.prompt) - lay.prompt
    if batching.decode_running is not None:  # each request's decode steps, then when it joins the running set
        first = np.full(R, np.iinfo(np.int64).max, np.int64)
        last = np.full(R, -1, np.int64)
        for rid, pos, ph in light_columns(source):
            dec = ph == DECODE
            r = rows_of(lay, rid[dec])
            step = pos[dec].astype(np.int64) - lay.prompt[r]
            np.minimum.at(first, r, step)
            np.maximum.at(last, r, step)
        length = np.where(last >= 0, last - first + 1, 0)
        lay.decode_first = np.where(last >= 0, first, 0)
        lay.decode_start = continuous_starts(length, batching.decode_running)
    ids: dict[int, list] = {PREFILL: [], DECODE: []}
    for rid, pos, ph in light_columns(source):
        mb = microbatch_ids(lay, rows_of(lay, rid), pos, ph)
        for p in (PREFILL, DECODE):
            u, c = np.unique(mb[ph == p], return_counts=True)
            ids[p].append((u, c))
    for p in (PREFILL, DECODE):
        if ids[p]:
            u = np.concatenate([a for a, _ in ids[p]])
            c = np.concatenate([b for _, b in ids[p]])
            uu, inv = np.unique(u, return_inverse=True)
            lay.mb_ids[p], lay.mb_tokens[p] = uu, np.bincount(inv, weights=c, minlength=len(uu)).astype(np.int64)
        else:
            lay.mb_ids[p], lay.mb_tokens[p] = np.zeros(0, np.int64), np.zeros(0, np.int64)
    return lay


def rank_within(group: np.ndarray) -> np.ndarray:
    """int64 [T]: the rank of each row among the rows of its group, in row order. group: int [T]."""
    g = np.asarray(group, np.int64)
    order = np.argsort(g, kind="stable")
    sg = g[order]
    first = np.r_[0, np.flatnonzero(sg[1:] != sg[:-1]) + 1] if len(sg) else np.zeros(0, np.int64)
    start = np.zeros(len(sg), np.int64)
    if len(sg):
        start[first] = first
        start = np.maximum.accumulate(start)
    out = np.empty(len(g), np.int64)
    out[order] = np.arange(len(g)) - start
    return out


def window_microbatches(token_request: np.ndarray, prefill: np.ndarray, arrival: np.ndarray,
                        batching: BatchConfig) -> np.ndarray:
    """int64 [T]: micro-batch id of every row of a window given as arrays, as serving forms them.

    token_request: int [T] request index of each row (rows in generation order within a request); prefill: bool [T]
    rows of the prompt; arrival: int [Rq] request indices in arrival order. The rules of this module: prompts laid
    end to end in arrival order and cut every ``prefill_tokens``; decode step j = the row's rank among its
    request's decode rows, micro-batch = (arrival rank // decode_batch, j) with windows, or start + j under
    continuous batching (:func:`continuous_starts` over arrival order). Prefill and decode ids are separate spaces.
    """
    tr = np.asarray(token_request, np.int64)
    pre = np.asarray(prefill, bool)
    arr = np.asarray(arrival, np.int64)
    Rq = len(arr)
    pos = np.empty(Rq, np.int64)
    pos[arr] = np.arange(Rq)
    out = np.empty(len(tr), np.int64)
    if pre.any():
        n_pre = np.bincount(tr[pre], minlength=Rq)
        start = np.zeros(Rq, np.int64)
        start[arr] = np.cumsum(n_pre[arr]) - n_pre[arr]  # prompts end to end in arrival order
        out[pre] = (start[tr[pre]] + rank_within(tr[pre])) // batching.prefill_tokens
    dec = ~pre
    if dec.any():
        step = rank_within(tr[dec])
        if batching.decode_running is None:
            out[dec] = ((pos[tr[dec]] // batching.decode_batch) << DECODE_WINDOW_SHIFT) | step
        else:
            length = np.bincount(tr[dec], minlength=Rq)
            start = np.empty(Rq, np.int64)
            start[arr] = continuous_starts(length[arr], batching.decode_running)
            out[dec] = start[tr[dec]] + step
    return out
