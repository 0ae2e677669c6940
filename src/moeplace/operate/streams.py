"""Streams of routing for the operate loop: a trace replayed request by request, in windows, in a stated order.

Shape legend: T = token rows, L = MoE layers, K = top-k, Rq = requests.

A :class:`Stream` is a label plus an iterator of *windows*: in-memory per-token traces of ``window_requests``
consecutive requests in arrival order (request table = arrival order, so :mod:`moeplace.simulate.batching` forms
the same decode micro-batches as a replay of the whole stream when ``window_requests`` is a multiple of the decode
batch; prefill prompts restart at each window). Every stream says what it is in ``label``:

- :func:`trace_stream` ``order="table"``: a trace directory replayed in its request-table order, read lazily through
  the validating reader (a corrupt shard stops the stream where it is met). The bundled default trace's table is
  sorted by domain, so this order *is* a domain drift (code, then chat, general, math).
- :func:`trace_stream` ``order="dataset"``: requests sorted by dataset (the part of ``source`` before ``/``), e.g.
  the gpt-oss-20b data; one dataset after another is a drift of real prompts.
- :func:`drift_stream`: a seeded drift built from a trace: phases with different domain mixes, each drawing its
  requests (with replacement, fresh request ids) from the trace's domain pools.
- :func:`schedule_stream`: any :class:`moeplace.operate.workloads.MixSchedule` (phases, a daily cycle, bursts, over
  domains or datasets) applied to a trace.

The ordering itself (schedules, draws, copying a request's token rows) is defined once, in
:mod:`moeplace.operate.workloads`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moeplace.operate.workloads import (
    MixSchedule,
    Phase,
    dataset_of,
    default_phases,
    grouped_order,
    keys_of,
    request_rows,
    stream_trace,
)
from moeplace.trace.reader import iter_token_chunks, read_meta, read_requests, read_trace
from moeplace.trace.types import Requests, TokenChunk, Trace, TraceError, TraceMeta

__all__ = ["ORDERS", "Phase", "Stream", "dataset_of", "default_phases", "drift_stream", "drift_trace",
           "memory_windows", "schedule_stream", "trace_stream"]

from moeplace.operate.orders import ORDERS  # noqa: E402  (light, for the CLI)


@dataclass
class Stream:
    """Windows of routing in arrival order, with a label that says what they are."""

    label: str  # e.g. "reference-default.trace, request-table order (domain drift)"
    meta: TraceMeta
    windows: Iterator[Trace]  # in-memory traces of consecutive requests
    num_requests: int  # requests the stream will replay (when known up front)
    info: dict = field(default_factory=dict)  # JSON-able facts: order, seed, phases, source path


def _check_window(window_requests: int) -> int:
    if isinstance(window_requests, bool) or not isinstance(window_requests, (int, np.integer)) \
            or window_requests < 1:
        raise ValueError(f"window_requests must be a positive integer, got {window_requests!r}")
    return int(window_requests)


def _sub_requests(req: Requests, sl: slice | np.ndarray) -> Requests:
    return Requests(req.request_id[sl], req.domain[sl], req.source[sl], req.prompt_len[sl], req.gen_len[sl])


def memory_windows(trace: Trace, window_requests: int) -> Iterator[Trace]:
    """Windows of an in-memory trace, its request table taken as the arrival order."""
    w = _check_window(window_requests)
    if trace.tokens is None:
        raise ValueError("stream: operate needs a per-token trace; this one is counts-only")
    rows, starts = request_rows(trace)
    R = len(trace.requests)
    for s in range(0, R, w):
        e = min(R, s + w)
        yield Trace(trace.meta, _sub_requests(trace.requests, slice(s, e)),
                    trace.tokens.select(rows[starts[s]:starts[e]]), None)


def _lazy_table_windows(path: Path, meta: TraceMeta, req: Requests, window_requests: int,
                        chunk_tokens: int) -> Iterator[Trace]:
    """Windows of a trace directory in table order, reading token chunks as needed (bounded by one window of rows
    plus one chunk). Token rows must come in request-table order of windows; a row of a window already emitted
    raises TraceError."""
    w = window_requests
    R = len(req)
    order = np.argsort(req.request_id, kind="stable")
    sorted_ids = req.request_id[order]
    pending: list[TokenChunk] = []
    pending_win: list[np.ndarray] = []
    next_win = 0  # first window not yet emitted
    nwin = (R + w - 1) // w

    def emit(upto: int) -> Iterator[Trace]:
        nonlocal next_win, pending, pending_win
        while next_win < upto:
            s, e = next_win * w, min(R, next_win * w + w)
            parts = [c.select(pw == next_win) for c, pw in zip(pending, pending_win, strict=True)]
            keep = [(c.select(pw != next_win), pw[pw != next_win]) for c, pw in zip(pending, pending_win,
                                                                                      strict=True)]
            pending = [k[0] for k in keep if len(k[1])]
            pending_win = [k[1] for k in keep if len(k[1])]
            tok = _concat(parts, meta)
            yield Trace(meta, _sub_requests(req, slice(s, e)), tok, None)
            next_win += 1

    for ch in iter_token_chunks(path, chunk_tokens=chunk_tokens, columns_weights=False):
        idx = order[np.minimum(np.searchsorted(sorted_ids, ch.request_id), R - 1)]
        win = idx // w
        if len(win) and win.min() < next_win:
            raise TraceError(f"{path}: token rows are not in request-table order (a row of request "
                             f"{int(ch.request_id[np.argmin(win)])} comes after its window was replayed); "
                             "replay it with order='domain' or 'dataset', which read the whole trace first")
        pending.append(ch)
        pending_win.append(win)
        if len(win):
            yield from emit(int(win.min()))
    yield from emit(nwin)


def _concat(parts: list[TokenChunk], meta: TraceMeta) -> TokenChunk:
    K, L = meta.top_k, meta.num_layers
    if not parts:
        return TokenChunk(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int8),
                          np.zeros((0, L, K), np.int16))
    tk = TokenChunk(np.concatenate([p.request_id for p in parts]), np.concatenate([p.position for p in parts]),
                    np.concatenate([p.phase for p in parts]), np.concatenate([p.expert_ids for p in parts]))
    return tk


def _synthetic(meta: TraceMeta) -> str:
    return " [SYNTHETIC]" if meta.synthetic else ""


def trace_stream(path: str | os.PathLike, window_requests: int, order: str = "table",
                 chunk_tokens: int = 1 << 16) -> Stream:
    """A trace directory replayed as a stream (see the module docstring for ``order``)."""
    w = _check_window(window_requests)
    if order not in ORDERS:
        raise ValueError(f"stream order {order!r}: expected one of {ORDERS}")
    p = Path(path)
    meta = read_meta(p)
    if meta.kind != "tokens":
        raise TraceError(f"{p}: operate needs a per-token trace; this one is counts-only (kind='counts')")
    name = p.name
    if order == "table":
        req = read_requests(p)
        label = f"{name}, request-table order"
        doms = list(dict.fromkeys(req.domain.tolist()))
        runs = 1 + int((req.domain[1:] != req.domain[:-1]).sum()) if len(req) else 0
        if len(doms) > 1 and runs == len(doms):
            label += f" (sorted by domain: a drift {' -> '.join(doms)})"
        return Stream(label + _synthetic(meta), meta, _lazy_table_windows(p, meta, req, w, chunk_tokens), len(req),
                      {"source": str(p), "order": order})
    trace = read_trace(p)
    key = keys_of(trace.requests, order)
    firsts = list(dict.fromkeys(key.tolist()))
    perm = grouped_order(key)
    trace = Trace(trace.meta, _sub_requests(trace.requests, perm), trace.tokens, None)
    what = "dataset" if order == "dataset" else "domain"
    label = f"{name}, ordered by {what} ({len(firsts)} {what}s in first-seen order: a drift)"
    return Stream(label + _synthetic(meta), meta, memory_windows(trace, w), len(trace.requests),
                  {"source": str(p), "order": order, f"{what}s": firsts})


def drift_trace(trace: Trace, phases: list[Phase], seed: int = 0, where: str = "phases") -> Trace:
    """A seeded drift built from ``trace``: the phases in order, each arrival drawn with replacement from the
    trace's domain pools in proportion to its phase's mix (:func:`moeplace.operate.workloads.stream_trace` with
    a :class:`~moeplace.operate.workloads.MixSchedule` of these phases). Returns an in-memory trace (request table =
    arrival order, fresh request ids, token rows copied as recorded)."""
    if trace.tokens is None:
        raise ValueError("drift: needs a per-token trace; this one is counts-only")
    if not phases:
        raise ValueError("drift: give at least one phase")
    return stream_trace(trace, MixSchedule(phases=tuple(phases)), seed=seed, where=where)


def drift_stream(trace: Trace | str | os.PathLike, window_requests: int, phases: list[Phase] | None = None,
                 seed: int = 0, requests_per_phase: int = 1000, name: str | None = None) -> Stream:
    """A seeded drift (:func:`drift_trace`) as a stream. ``phases`` None: :func:`default_phases` over the trace's
    domains in table order, ``requests_per_phase`` each."""
    w = _check_window(window_requests)
    name = name or (Path(trace).name if not isinstance(trace, Trace) else trace.meta.model)
    t = trace if isinstance(trace, Trace) else read_trace(trace)
    where = "phases"
    if phases is None:
        doms = list(dict.fromkeys(t.requests.domain.tolist()))
        phases = default_phases(doms, requests_per_phase)
        where = f"requests_per_phase={requests_per_phase} (--drift-requests) x {len(doms)} domains"
    d = drift_trace(t, phases, seed, where)
    label = f"seeded drift of {name} (seed {seed}; {MixSchedule(phases=tuple(phases)).describe()})" + \
        _synthetic(d.meta)
    return Stream(label, d.meta, memory_windows(d, w), len(d.requests),
                  {"order": "drift", "seed": seed,
                   "phases": [{"requests": ph.requests, "mix": ph.mix} for ph in phases]})


def schedule_stream(trace: Trace | str | os.PathLike, window_requests: int, schedule: MixSchedule,
                    num_requests: int | None = None, seed: int = 0, key: str = "domain", replace: bool = True,
                    name: str | None = None) -> Stream:
    """A trace re-ordered by a :class:`~moeplace.operate.workloads.MixSchedule` (phases, daily cycle, bursts over its
    domains or datasets: :func:`moeplace.operate.workloads.stream_trace`) as a stream of windows."""
    w = _check_window(window_requests)
    name = name or (Path(trace).name if not isinstance(trace, Trace) else trace.meta.model)
    t = trace if isinstance(trace, Trace) else read_trace(trace)
    where = ("the schedule's phases (one pass)" if num_requests is None else
             f"num_requests={num_requests} (--stream-requests)")
    d = stream_trace(t, schedule, num_requests, seed, key, replace, where)
    what = "synthetic" if d.meta.synthetic else "real"
    label = f"seeded stream of {name} by {key} (seed {seed}; {schedule.describe()}; {what} routing re-ordered)" + \
        _synthetic(d.meta)
    return Stream(label, d.meta, memory_windows(d, w), len(d.requests),
                  {"order": "schedule", "seed": seed, "key": key, "replace": replace,
                   "schedule": schedule.to_json()})
