"""Decisions with evidence: a planner deploys a plan other than the baseline only when cross-validation says, with
a paired 95% interval, that it is faster on requests it was not built on; otherwise the plan *is* the baseline.

Shape legend: T = token rows, Rq = requests, F = folds, B_f = scored micro-batches of fold f.

The evidence is a set of candidates, each a (placement builder, replica rule) pair, built on one fold of the
planning requests and timed on the other fold's micro-batches (out of sample), per phase. Some candidates are
*baselines* (EPLB as engines run it, with the dispatch rules engines offer): per phase the baseline is the one with
the lowest mean time, as the evaluation's strongest baseline is chosen (:mod:`moeplace.evaluate.measure`). A
non-baseline candidate is *eligible* when, in every phase that has scored micro-batches, the upper end of the paired
95% interval of its time ratio to that phase's baseline (:func:`moeplace.intervals.paired_ratio_ci`, folds as the
outer level, micro-batches as the inner one) is below 1. The eligible candidate with the smallest worst-phase ratio
is deployed; with none eligible, a default baseline (the planner's: EPLB with the balanced dispatch engines offer)
unless another baseline is faster than it beyond the noise (exactly EPLB, with its dispatch rule). Baselines that
the evidence cannot tell apart are not switched between: on reference-ds 3x8 decode the evidence ranked static
dispatch first by 0.1% in a split where it was 4% slower on held-out requests.

Micro-batches of the evidence. A planning window is a fraction of what a deployment serves at once (a decode
running set of 128 requests per GPU on 24 GPUs is 3,072 requests; prefill chunks of 16K tokens per GPU). The
evidence forms micro-batches of the deployment's size where the fold's rows allow it, else of the largest size
that still gives ``min_microbatches`` per fold (4; a candidate needs 8 per phase in all to be deployed): prefill
rows laid end to end in arrival order and cut into chunks;
decode rows, under continuous batching (a running set of the deployment's size), ordered by (decode step, arrival)
and cut into chunks, so a chunk holds one step of as many requests as there are and several consecutive steps of
each when the fold has fewer requests than the running set. Partial chunks are not scored. Under decode *windows*
(``decode_windows``: the deployment serves windows of up to ``decode_batch`` consecutive requests, micro-batch
``(w, j)`` the j-th decode step of window w's requests) the evidence's decode micro-batches are the serving rule's
(:func:`moeplace.simulate.batching.window_microbatches`) over the test fold in its arrival order, tails included,
as a held-out window is scored. The chunks of mixed steps had said 0.90-0.94 of the baseline where the same plans
were 0.975 held out (gpt-oss-20b, 4x8, windows of 256) and deployed plans that were 1.007 held out at 4x2: a chunk
of several steps of fewer requests is not what serving runs. :func:`evidence_microbatches` returns the sizes used
(under windows, decode's is the requests of the first window); the decision records them.

Evidence from shrunk micro-batches decides nothing. Which placement is faster depends on the micro-batch size (a
small chunk is mostly fixed per-call latency, a full one mostly imbalance and transfer): on the fine-grained
model's 2x8 prefill the evidence from 37,500-token chunks of a 300k-token window chose plans that were 1.024x
[0.992, 1.059] the baseline on full 131,072-token chunks of held-out requests. So a phase whose evidence is below
the deployment's size (``undersized``) makes every candidate ineligible and switches no baseline: the default
baseline is deployed, and the decision says why.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from moeplace.intervals import paired_ratio_ci
from moeplace.simulate.batching import rank_within, window_microbatches
from moeplace.simulate.config import BatchConfig

PHASES = ("prefill", "decode")
MIN_EVIDENCE_MICROBATCHES = 4  # micro-batches per fold and phase below which the evidence shrinks them
MIN_DECIDING_MICROBATCHES = 8  # a candidate needs at least this many per phase (all folds) to be deployed


def evidence_microbatches(token_request: np.ndarray, prefill: np.ndarray, decode: np.ndarray, arrival: np.ndarray,
                          prefill_tokens: int, decode_rows: int,
                          min_microbatches: int = MIN_EVIDENCE_MICROBATCHES,
                          decode_windows: bool = False) -> tuple[np.ndarray, dict[str, int]]:
    """(int64 [T] micro-batch id of every row, -1 where not scored; {phase: rows per micro-batch used}).

    token_request: int [T] request index of each row (rows in generation order within a request); prefill, decode:
    bool [T] the rows of each phase (a row in neither is not scored); arrival: int [Rq] request indices in arrival
    order; prefill_tokens, decode_rows: the deployment's rows per micro-batch (decode: the running set, or with
    ``decode_windows`` the window's requests). A phase's size is ``min(deployment size, rows // min_microbatches)``
    (at least 1); with ``decode_windows`` decode's micro-batches are the serving windows' (module docstring), ids
    0.. in (window, step) order, and its size the first window's requests. Prefill and decode ids are separate
    spaces.
    """
    tr = np.asarray(token_request, np.int64)
    arr = np.asarray(arrival, np.int64)
    pos = np.empty(len(arr), np.int64)
    pos[arr] = np.arange(len(arr))
    out = np.full(len(tr), -1, np.int64)
    sizes: dict[str, int] = {}
    for phase, mask, full in (("prefill", prefill, prefill_tokens), ("decode", decode, decode_rows)):
        rows = np.flatnonzero(np.asarray(mask, bool))
        if len(rows) == 0:
            continue
        if phase == "decode" and decode_windows:  # the serving rule itself: windows of up to ``full`` requests
            ids = window_microbatches(tr[rows], np.zeros(len(rows), bool), arr,
                                      BatchConfig(decode_batch=int(full), prefill_tokens=max(1, int(prefill_tokens))))
            out[rows] = np.unique(ids, return_inverse=True)[1]
            sizes[phase] = int(min(int(full), len(np.unique(tr[rows]))))
            continue
        size = max(1, min(int(full), len(rows) // max(1, min_microbatches)))
        step = rank_within(tr[rows])  # the row's rank among its request's rows of this phase
        if phase == "prefill":
            key = np.lexsort((step, pos[tr[rows]]))  # prompts end to end in arrival order
        else:  # one decode step of every request, then the next; steps dealt round-robin over the micro-batches
            n_mb = max(1, len(rows) // size)  # (a micro-batch takes steps far apart: less correlated than adjacent)
            key = np.lexsort((pos[tr[rows]], step, step % n_mb))
        order = np.empty(len(rows), np.int64)
        order[key] = np.arange(len(rows))
        mb = order // size
        n_full = len(rows) // size
        mb[mb >= n_full] = -1  # the partial last chunk is not scored
        out[rows] = mb
        sizes[phase] = size
    return out, sizes


def decide(times: dict[str, dict[str, Sequence[np.ndarray]]], baselines: Sequence[str],
           level: float = 0.95, seed: int = 0, default: str | None = None,
           min_microbatches: int = MIN_DECIDING_MICROBATCHES, undersized: Collection[str] = ()) -> dict:
    """The decision over candidates (see the module docstring).

    times: phase -> candidate name -> per fold float [B_f] time of each scored micro-batch (the same micro-batches,
    in the same order, for every candidate of a phase); baselines: the names that are baselines (at least one, in
    every phase); default: the baseline deployed when no candidate is eligible, unless another baseline is faster
    than it beyond the noise (upper end below 1 in every phase; None: the first baseline); min_microbatches: the
    scored micro-batches a phase needs (all folds together) before a candidate can be deployed on its evidence
    (fewer: too little evidence, the baseline stays); undersized: the phases whose evidence micro-batches are
    smaller than the deployment's (then nothing is switched: the default baseline). Returns the ``decision``
    record: ``chosen``, ``deployed`` ("candidate" or "baseline"), ``baseline`` (phase -> name), ``candidates``
    (name -> phase -> ratio, ci95, microbatches, eligible), ``reason``.
    """
    phases = [ph for ph in PHASES if ph in times and sum(len(x) for x in next(iter(times[ph].values()))) > 0]
    if not phases:
        raise ValueError("decide: no phase has scored micro-batches")
    names = list(times[phases[0]])
    base_names = [b for b in names if b in set(baselines)]
    if not base_names:
        raise ValueError(f"decide: none of the baselines {list(baselines)} is a candidate")
    best_base: dict[str, str] = {}
    for ph in phases:
        mean = {b: float(sum(x.sum() for x in times[ph][b])) for b in base_names}
        best_base[ph] = min(base_names, key=lambda b: mean[b])  # ties: the first baseline (the engines' default)
    small = [ph for ph in phases if ph in set(undersized)]
    record: dict[str, dict] = {}
    worst: dict[str, float] = {}
    eligible: list[str] = []
    for n in names:
        per = {}
        for ph in phases:
            ci = paired_ratio_ci(list(times[ph][n]), list(times[ph][best_base[ph]]), level=level, seed=seed)
            per[ph] = {"ratio": ci.ratio, "ci95": [ci.lo, ci.hi], "microbatches": ci.microbatches}
        worst[n] = max(p["ratio"] for p in per.values())
        ok = n not in base_names and not small and all(p["ci95"][1] < 1.0 and p["microbatches"] >= min_microbatches
                                                       for p in per.values())
        for p in per.values():
            p["eligible"] = ok
        record[n] = per
        if ok:
            eligible.append(n)
    txt = "; ".join(f"{ph}: {best_base[ph]}" for ph in phases)

    def said(n: str) -> str:  # "prefill 0.912 [0.881, 0.948], decode ..." of candidate n
        return ", ".join(f"{ph} {record[n][ph]['ratio']:.3f} [{record[n][ph]['ci95'][0]:.3f}, "
                         f"{record[n][ph]['ci95'][1]:.3f}]" for ph in phases)

    if eligible:
        chosen = min(eligible, key=lambda n: (worst[n], names.index(n)))
        reason = (f"{chosen} is faster than the best baseline ({txt}) out of sample, the 95% interval's upper end "
                  f"below 1 in every phase: {said(chosen)}")
        deployed = "candidate"
    else:
        dflt = default if default in base_names else base_names[0]
        better = []  # baselines faster than the default beyond the noise, in every phase
        for b in base_names if not small else ():
            cis = [paired_ratio_ci(list(times[ph][b]), list(times[ph][dflt]), level=level, seed=seed)
                   for ph in phases]
            if b != dflt and all(ci.hi < 1.0 for ci in cis):
                better.append((max(ci.ratio for ci in cis), names.index(b), b))
        chosen = min(better)[2] if better else dflt
        others = [n for n in names if n not in base_names]
        if small:
            reason = (f"the evidence's {' and '.join(small)} micro-batches are smaller than the deployment's, and "
                      f"which plan is faster changes with the size: nothing is switched on it; deployed the default "
                      f"baseline {chosen}")
        elif others:
            top = min(others, key=lambda n: (worst[n], names.index(n)))
            reason = (f"no candidate is faster than the best baseline ({txt}) beyond the noise (best: {top}, "
                      f"{said(top)}); deployed the baseline {chosen}")
        else:
            reason = f"only baselines were candidates; deployed {chosen}"
        deployed = "baseline"
    return {"chosen": chosen, "deployed": deployed, "baseline": best_base, "candidates": record,
            "reason": reason, "level": level, "undersized": small}


__all__ = ["MIN_DECIDING_MICROBATCHES", "MIN_EVIDENCE_MICROBATCHES", "PHASES", "decide", "evidence_microbatches"]
