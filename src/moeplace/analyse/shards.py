"""Analyse a trace shard by shard on an engine (:mod:`moeplace.engine`) and merge the accumulators exactly.

Shape legend: T = tokens (of a chunk), L = MoE layers, K = top-k, E = logical experts, D = domains, s = tracked
requests seen in one shard, n = decode requests of one shard.

Map (:func:`analyse_shard`, one task per range of consecutive shards, a pure function of the range): a
:class:`TokenAccumulator` over the range's rows, started at its offset in trace order so its drift windows are the
trace's windows, and tracking only the requests the range holds; plus the first and the last decode row of each of
its requests. A range is merged as one shard would be (below: "shard" = range).

Reduce (:func:`accumulate_shards`, in shard order): every statistic is an integer sum, so loads, co-activation and
inter-layer counts and the per-request vectors add up exactly. Drift windows that straddle a shard boundary are
joined from their pieces and closed where the single-process stream would close them, with the same arithmetic.
Consecutive decode tokens of a request in two shards are matched by the last decode row of each request before the
shard and the request's first row in it. That equals the single-process stream when each request's decode
positions rise in trace order and the trace has at most ``carry_requests`` decode requests (the stream's carry
never evicts); every part checks the first, the reduce the second, and where either fails the temporal sums are
recomputed by one sequential pass over the trace, so the answer is byte-identical in every case.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeplace.analyse.accumulate import TokenAccumulator
from moeplace.analyse.stats import js_divergence, shared_experts
from moeplace.engine import TASKS_PER_WORKER
from moeplace.trace.reader import iter_light_columns, iter_token_chunks, shard_files, shard_ranges, shard_token_rows
from moeplace.trace.types import DECODE, TraceError, TraceMeta


@dataclass(frozen=True)
class ShardTask:
    """A range of consecutive shards of a trace and where its first starts in trace order (token rows before it).

    One range is accumulated as if it were one shard: the parts the driver merges are one per range, not one per
    shard (each part holds the L x E x E counters, 60 MB for DeepSeek-V3, so their number is what the reduce
    costs).
    """

    path: str
    shards: tuple[int, ...]
    offset: int


@dataclass
class EdgeRows:
    """First and last decode row of each request of a shard, and whether its decode positions rose in trace order.

    Request ids sorted: ``head_*`` the first decode row of each request (rid int64 [n], pos int64 [n], ids int16
    [n, L, K]), ``tail_*`` the last one.
    """

    head_rid: np.ndarray
    head_pos: np.ndarray
    head_ids: np.ndarray
    tail_rid: np.ndarray
    tail_pos: np.ndarray
    tail_ids: np.ndarray
    ordered: bool = True


def _last_per_request(r: np.ndarray, *cols: np.ndarray) -> tuple[np.ndarray, ...]:
    """Rows of the last occurrence of each id of r (ids sorted); cols are taken at the same rows."""
    rev = r[::-1]
    u, i = np.unique(rev, return_index=True)
    j = len(r) - 1 - i
    return (u, *(c[j] for c in cols))


class _Edges:
    def __init__(self, L: int, K: int) -> None:
        z = np.zeros(0, np.int64)
        self.tail = (z, z, np.zeros((0, L, K), np.int16))
        self.heads: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.ordered = True

    def add(self, rid: np.ndarray, pos: np.ndarray, phase: np.ndarray, ids: np.ndarray) -> None:
        dec = phase == DECODE
        if not dec.any():
            return
        r, p, x = rid[dec].astype(np.int64), pos[dec].astype(np.int64), ids[dec]
        o = np.argsort(r, kind="stable")  # each request's rows together, in trace order
        rs, ps = r[o], p[o]
        same = rs[1:] == rs[:-1]
        if (ps[1:][same] <= ps[:-1][same]).any():
            self.ordered = False
        starts = np.r_[0, np.flatnonzero(~same) + 1]
        last = np.r_[starts[1:] - 1, len(rs) - 1]
        ur, fi, li = rs[starts], o[starts], o[last]
        tr, tp, tx = self.tail
        k = np.searchsorted(tr, ur)
        seen = (k < len(tr)) & (tr[np.minimum(k, max(len(tr) - 1, 0))] == ur) if len(tr) else np.zeros(len(ur), bool)
        if (tp[k[seen]] >= p[fi[seen]]).any():
            self.ordered = False
        new = ~seen
        if new.any():
            self.heads.append((ur[new], p[fi[new]], x[fi[new]]))
        self.tail = _last_per_request(np.r_[tr, ur], np.r_[tp, p[li]], np.concatenate([tx, x[li]]))

    def result(self) -> EdgeRows:
        L, K = self.tail[2].shape[1:]
        if self.heads:
            hr = np.concatenate([h[0] for h in self.heads])
            o = np.argsort(hr, kind="stable")
            hp = np.concatenate([h[1] for h in self.heads])[o]
            hx = np.concatenate([h[2] for h in self.heads])[o]
            hr = hr[o]
        else:
            hr, hp, hx = np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, L, K), np.int16)
        return EdgeRows(hr, hp, hx, *self.tail, ordered=self.ordered)


@dataclass
class ShardPart:
    """What one shard adds: an unfinished accumulator over its rows, its tracked slots and its edge rows.

    ``slots``: int [s] global slot of the accumulator's request slot i (its ``req`` is [s, 2, L, E]).
    """

    acc: TokenAccumulator
    slots: np.ndarray
    edges: EdgeRows


def _check_known(task: ShardTask, shard: int, labels, rid: np.ndarray) -> None:
    """TraceError naming the shard when a token names a request the request table lacks (as the reader would; a
    worker checks against the table it was given instead of reading every request file again)."""
    known = labels.rid_sorted
    i = np.minimum(np.searchsorted(known, rid), max(len(known) - 1, 0))
    bad = known[i] != rid if len(known) else np.ones(len(rid), bool)
    if bad.any():
        f = shard_files(task.path)[shard]
        raise TraceError(f"{f}: token rows name request_id {int(rid[bad][0])} that is not in the request table")


def analyse_shard(task: ShardTask, meta: TraceMeta, labels, params: dict) -> ShardPart:
    """Map step: accumulate one range of shards (a pure function of the shards and the request-level ``labels``,
    :class:`moeplace.analyse.summary.TokenLabels`)."""
    L, E, K = meta.num_layers, meta.num_experts, meta.top_k
    seen = [np.zeros(0, np.intp)]
    for rid, _, _ in iter_light_columns(task.path, check_requests=False, shards=list(task.shards)):
        slot = labels.of(rid)[1]
        seen.append(np.unique(slot[slot >= 0]))
    slots = np.unique(np.concatenate(seen))
    acc = TokenAccumulator(L, E, K, num_domains=len(labels.names), num_slots=len(slots),
                           window_tokens=params["window_tokens"], window_offset=task.offset)
    edges = _Edges(L, K)
    for shard in task.shards:
        for ch in iter_token_chunks(task.path, chunk_tokens=params["chunk_tokens"], columns_weights=False,
                                    check_requests=False, shards=[shard]):  # checked here against the table
            _check_known(task, shard, labels, ch.request_id)
            dom, slot = labels.of(ch.request_id)
            local = np.where(slot >= 0, np.searchsorted(slots, slot), -1)
            acc.update(ch.expert_ids, ch.request_id, ch.position, ch.phase, dom, local)
            edges.add(ch.request_id, ch.position, ch.phase, ch.expert_ids)
    return ShardPart(acc, slots, edges.result())


class _Windows:
    """Drift windows of the whole trace, joined from the shards' pieces in shard order."""

    def __init__(self, acc: TokenAccumulator) -> None:
        self.acc = acc
        self.cur = np.zeros((2, acc.L, acc.E), np.int64)
        self.prev: np.ndarray | None = None

    def _close(self, win: np.ndarray) -> None:
        cur = win.sum(0)
        self.acc.split_js.append(js_divergence(win[0], win[1]))
        if self.prev is not None:
            self.acc.drift_js.append(js_divergence(self.prev, cur))
        self.prev = cur

    def add(self, part: TokenAccumulator) -> None:
        if part.head_window is not None:  # the window that began in an earlier shard ends in this one
            self.cur += part.head_window
            self._close(self.cur)
            self.cur = np.zeros_like(self.cur)
        if part.first_window is not None:
            if self.prev is not None:
                self.acc.drift_js.append(js_divergence(self.prev, part.first_window))
            self.acc.split_js.extend(part.split_js)
            self.acc.drift_js.extend(part.drift_js)
            self.prev = part.last_window
        self.cur += part.open_window[0]


class _Temporal:
    """Consecutive decode tokens across shard boundaries, from the shards' edge rows in shard order."""

    def __init__(self, acc: TokenAccumulator) -> None:
        self.acc = acc
        self.rid = np.zeros(0, np.int64)
        self.pos = np.zeros(0, np.int64)
        self.ids = np.zeros((0, acc.L, acc.K), np.int16)
        self.ordered = True
        self.overflow = False  # more decode requests than the carry: the sums are recomputed, the rows dropped

    def add(self, part: ShardPart) -> None:
        e, acc = part.edges, self.acc
        if self.overflow:
            return
        acc.overlap_sum += part.acc.overlap_sum
        acc.overlap_pairs += part.acc.overlap_pairs
        self.ordered &= e.ordered
        if len(self.rid) and len(e.head_rid):
            k = np.minimum(np.searchsorted(self.rid, e.head_rid), len(self.rid) - 1)
            hit = self.rid[k] == e.head_rid
            before, first = self.pos[k[hit]], e.head_pos[hit]
            if (first <= before).any():
                self.ordered = False
            nxt = first == before + 1
            if nxt.any():
                acc.overlap_sum += shared_experts(self.ids[k[hit]][nxt], e.head_ids[hit][nxt]).sum(0)
                acc.overlap_pairs += int(nxt.sum())
        self.rid, self.pos, self.ids = _last_per_request(np.r_[self.rid, e.tail_rid], np.r_[self.pos, e.tail_pos],
                                                         np.concatenate([self.ids, e.tail_ids]))
        if len(self.rid) > acc.carry_requests:  # held rows stay bounded by the carry, not by the trace's requests
            self.overflow = True
            self.rid, self.pos, self.ids = self.rid[:0], self.pos[:0], self.ids[:0]

    def exact(self) -> bool:
        """Whether the merged sums equal the single-process stream's (module docstring)."""
        return self.ordered and not self.overflow


def accumulate_shards(path: str, meta: TraceMeta, labels, params: dict, engine) -> TokenAccumulator:
    """Reduce step: run :func:`analyse_shard` on every shard through ``engine`` and merge the parts in shard order
    into one finished accumulator, equal to the single-process stream's (module docstring)."""
    from moeplace.analyse.summary import new_accumulator

    rows = shard_token_rows(path)
    offsets = np.r_[0, np.cumsum(rows)[:-1]].astype(np.int64) if rows else np.zeros(0, np.int64)
    ranges = shard_ranges(rows, TASKS_PER_WORKER * max(1, int(getattr(engine, "workers", 1))))
    tasks = [ShardTask(str(path), r, int(offsets[r[0]])) for r in ranges]
    acc = new_accumulator(meta, labels, params)
    windows, temporal = _Windows(acc), _Temporal(acc)
    for part in engine.map(analyse_shard, tasks, meta, labels, params):
        p = part.acc
        acc.num_tokens += p.num_tokens
        acc.load += p.load
        if acc.coact is not None:
            acc.coact += p.coact
        if acc.inter is not None:
            acc.inter += p.inter
        if len(part.slots):
            acc.req[part.slots] += p.req
        windows.add(p)
        temporal.add(part)
    if not temporal.exact():  # out-of-order decode positions or more requests than the carry: the stream's way
        seq = TokenAccumulator(meta.num_layers, meta.num_experts, meta.top_k, coactivation=False, interlayer=False)
        for ch in iter_token_chunks(path, chunk_tokens=params["chunk_tokens"], columns_weights=False):
            seq.update(ch.expert_ids, ch.request_id, ch.position, ch.phase)
        acc.overlap_sum, acc.overlap_pairs = seq.overlap_sum, seq.overlap_pairs
    acc.finish()
    return acc
