"""Windows of requests: split a trace into a planning and a held-out window, and state the arrival order.

Shape legend: T = token rows, L = MoE layers, K = top-k, E = experts, Rq = requests.

- Split (``holdout`` fraction): ``random`` with a seed, or ``ordered`` (the last requests of the table are held out).
- Signal rows: a request's prefill rows; a request without prefill (decode-only traces such as gpt-oss-20b) uses its
  first ``prefix_tokens`` decode rows instead, which then stand for the prompt. Signal rows are never scored.
- Arrival order of the held-out window (what shares a micro-batch, :mod:`moeplace.simulate.batching`): ``table``
  keeps the trace's request order (a trace sorted by domain puts one domain in each micro-batch); ``mixed`` is a
  seeded shuffle, as a serving engine mixes requests of all kinds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from moeplace.placement import Grouper, Plan
from moeplace.plan.base import Workload, workload_from_tokens
from moeplace.plan.registry import DEFAULT_PREFIX_TOKENS  # noqa: F401  (re-exported; one definition)
from moeplace.plan.route import Router, signal_rows, trace_homes
from moeplace.trace.types import DECODE, PREFILL, Requests, Trace

ARRIVALS = ("table", "mixed")


@dataclass
class Windows:
    """A trace split into a planning and a held-out window (in memory)."""

    plan: Trace  # all rows of the planning requests
    held: Trace  # all rows of the held-out requests
    plan_work: Workload  # planning window as strategies see it
    held_signal: np.ndarray  # bool [T_held]: signal rows of the held-out window


def subset_trace(trace: Trace, request_ids: np.ndarray) -> Trace:
    """In-memory trace of the given requests (request-table order kept)."""
    req = trace.requests
    keep = np.isin(req.request_id, request_ids)
    r = Requests(req.request_id[keep], req.domain[keep], req.source[keep], req.prompt_len[keep], req.gen_len[keep])
    tok = trace.tokens.select(np.isin(trace.tokens.request_id, request_ids))
    return Trace(trace.meta, r, tok, None)


def reorder_requests(trace: Trace, order: np.ndarray) -> Trace:
    """The same trace with its request table in ``order`` (int [Rq], a permutation): the arrival order that
    decides micro-batches. Token rows are unchanged."""
    req = trace.requests
    o = np.asarray(order, np.int64)
    if sorted(o.tolist()) != list(range(len(req))):
        raise ValueError("reorder_requests: order must be a permutation of the request table")
    r = Requests(req.request_id[o], req.domain[o], req.source[o], req.prompt_len[o], req.gen_len[o])
    return Trace(trace.meta, r, trace.tokens, trace.counts)


def split_windows(trace: Trace, holdout: float = 0.25, split: str = "random", seed: int = 0,
                  prefix_tokens: int = DEFAULT_PREFIX_TOKENS, arrival: str = "table",
                  arrival_seed: int | None = None) -> Windows:
    """Split a per-token trace into planning and held-out windows (see the module docstring); the held-out
    request table is put in ``arrival`` order. ``seed`` draws the split, ``arrival_seed`` (default: ``seed``) the
    mixed arrival order."""
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}, got {arrival!r}")
    if trace.tokens is None:
        raise ValueError("compare needs a per-token trace; this trace is counts-only (plan it with "
                         "'moeplace plan --strategy eplb' instead)")
    if not 0.0 < holdout < 1.0:
        raise ValueError(f"holdout must be in (0, 1), got {holdout}")
    rid = trace.requests.request_id
    present = np.isin(rid, np.unique(trace.tokens.request_id))
    rid = rid[present]
    n_held = int(round(len(rid) * holdout))
    if n_held < 1 or n_held >= len(rid):
        raise ValueError(f"holdout {holdout} leaves no requests in one window ({len(rid)} requests)")
    if split == "random":
        held_ids = np.random.default_rng(seed).choice(rid, n_held, replace=False)
    elif split == "ordered":
        held_ids = rid[-n_held:]
    else:
        raise ValueError(f"split must be 'random' or 'ordered', got {split!r}")
    plan_ids = np.setdiff1d(rid, held_ids)
    pt, ht = subset_trace(trace, plan_ids), subset_trace(trace, held_ids)
    if arrival == "mixed":
        a = seed if arrival_seed is None else arrival_seed
        ht = reorder_requests(ht, np.random.default_rng([a, 1]).permutation(len(ht.requests)))
    work = workload_from_tokens(pt.tokens.request_id, pt.tokens.phase, pt.tokens.expert_ids,
                                trace.meta.num_experts, prefix_tokens)
    work = dataclasses.replace(work, model=trace.meta.model, hidden_size=trace.meta.hidden_size)
    hs = signal_rows(ht.tokens.request_id, ht.tokens.phase, prefix_tokens)
    return Windows(pt, ht, work, hs)


def scoring_trace(held: Trace, signal: np.ndarray) -> Trace:
    """The held-out rows that are scored: prefill rows, and decode rows that are not signal (a decode-only trace's
    first decode rows stand for its prompt and are scored as neither)."""
    m = (held.tokens.phase == PREFILL) | ((~signal) & (held.tokens.phase == DECODE))
    return Trace(held.meta, held.requests, held.tokens.select(m), None)


def plan_grouper(plan: Plan) -> Grouper | None:
    """The grouper a plan carries for new requests, or None."""
    return plan.grouper


def held_out_homes(plan: Plan, held: Trace, signal: np.ndarray, admission: str = "batch") -> dict[int, int]:
    """Homes of the held-out requests: the plan's grouper on their signal rows in table (arrival) order through
    the deployable route (:func:`moeplace.plan.route.trace_homes`: ``batch``, what ``moeplace route serve``
    answers for ``POST /route_batch``; ``online``, for ``POST /route`` one request at a time), else {}
    (round-robin)."""
    if plan_grouper(plan) is None:
        return {}
    return trace_homes(Router.from_plan(plan), held, signal, admission)


def hindsight_groups(scored: Trace, num_groups: int, restarts: int = 4) -> np.ndarray:
    """int64 [Rq]: a group (decode instance) per request of ``scored``'s request table, chosen with hindsight.

    Not deployable: a bound on what routing by a request's signature could reach. Each request is described by
    its own decode routing (expert counts over all its decode rows, [L * E], L2-normalised), which no router knows
    when the request arrives, and clustered by :func:`moeplace.plan.grouping.capped_kmeans` (spherical K-means into
    ``num_groups`` clusters from ``restarts`` seeds, at most ceil(Rq / num_groups) requests each: the same per-group
    cap as the grouper's rounds over the whole window). Deterministic. ``scored``: decode rows only, as
    :func:`scoring_trace` gives."""
    from moeplace.placement.grouper import normalise_rows
    from moeplace.plan.base import request_expert_counts
    from moeplace.plan.grouping import capped_kmeans

    rid = scored.requests.request_id
    R = len(rid)
    if num_groups < 1 or restarts < 1:
        raise ValueError(f"hindsight_groups: num_groups and restarts must be >= 1, got {num_groups}, {restarts}")
    if R < num_groups:
        raise ValueError(f"hindsight_groups: {R} requests cannot fill {num_groups} groups")
    tk = scored.tokens
    dec = tk.phase == DECODE
    order = np.argsort(rid)
    idx = order[np.searchsorted(rid, tk.request_id[dec], sorter=order)]
    x = normalise_rows(request_expert_counts(idx, tk.expert_ids[dec], R, scored.meta.num_experts))
    return capped_kmeans(x, num_groups, restarts)
