"""Plan every strategy on one window of requests and score all of them with the simulator on a disjoint one.

Shape legend: T = token rows, L = MoE layers, K = top-k, E = experts, Rq = requests.

Protocol (``moeplace compare``):

1. Split the trace's requests into a planning window and a held-out window (``holdout`` fraction; ``random``
   split with a seed, or ``ordered``: the last requests of the table are held out).
2. Each request's *signal* rows are its prefill rows; a request without prefill (decode-only traces such as
   gpt-oss-20b) uses its first ``prefix_tokens`` decode rows instead, which then stand for the prompt. Signal
   rows are never scored.
3. Every strategy plans on the planning window (:func:`moeplace.plan.make_plan`). Held-out requests get homes
   from the plan's grouper (their signal rows, admitted in table order) when the strategy groups requests, else
   round-robin in table order.
4. The simulator replays the held-out window's decode rows (default replica rule, per-GPU dedup) for every plan;
   ``inter_node_bytes_vs_linear`` divides by the linear placement (same redundant slots, round-robin homes) on
   the same rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from moeplace.placement import Cluster, Placement, Plan
from moeplace.plan import STRATEGIES, get_strategy, make_plan
from moeplace.plan.base import Workload, request_expert_counts, workload_from_tokens
from moeplace.plan.grouping import Grouper
from moeplace.trace.store import DECODE, Requests, Trace, TraceMeta

DEFAULT_PREFIX_TOKENS = 32


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


def signal_rows(request_id: np.ndarray, phase: np.ndarray, prefix_tokens: int) -> np.ndarray:
    """bool [T]: prefill rows, or a request's first ``prefix_tokens`` rows when it has no prefill."""
    w = workload_from_tokens(request_id, phase, np.zeros((len(request_id), 1, 1), np.int16), 1, prefix_tokens)
    return w.signal


def split_windows(trace: Trace, holdout: float = 0.25, split: str = "random", seed: int = 0,
                  prefix_tokens: int = DEFAULT_PREFIX_TOKENS) -> Windows:
    """Split a per-token trace into planning and held-out windows (see the module docstring)."""
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
    work = workload_from_tokens(pt.tokens.request_id, pt.tokens.phase, pt.tokens.expert_ids,
                                trace.meta.num_experts, prefix_tokens)
    hs = signal_rows(ht.tokens.request_id, ht.tokens.phase, prefix_tokens)
    return Windows(pt, ht, work, hs)


def scoring_trace(held: Trace, signal: np.ndarray) -> Trace:
    """The held-out rows that are scored: decode rows that are not signal."""
    m = (~signal) & (held.tokens.phase == DECODE)
    return Trace(held.meta, held.requests, held.tokens.select(m), None)


def held_out_homes(plan: Plan, held: Trace, signal: np.ndarray) -> dict[int, int]:
    """Homes of the held-out requests: the plan's grouper on their signal rows (table order), else {} (round-robin)."""
    if plan.grouper is None:
        return {}
    grouper = Grouper.from_json(plan.grouper.to_json())
    rid = held.requests.request_id
    tk = held.tokens
    pos = np.searchsorted(rid, tk.request_id[signal], sorter=np.argsort(rid))
    order = np.argsort(rid)
    idx = order[pos]
    counts = request_expert_counts(idx, tk.expert_ids[signal], len(rid), held.meta.num_experts)
    homes = grouper.assign(counts)
    return {int(r): int(h) for r, h in zip(rid.tolist(), homes.tolist(), strict=True)}


def sim_metrics(res_json: dict, base_bytes: float | None) -> dict:
    """The compare row from a simulator PhaseResult JSON (decode phase)."""
    inter = res_json["inter_node_bytes"]["total"]
    L = len(res_json["balancedness"]["per_layer"])
    B = max(res_json["num_microbatches"], 1)
    return {
        "inter_node_bytes": inter,
        "inter_node_bytes_vs_linear": (inter / base_bytes) if base_bytes else float("nan"),
        "median_microbatch_inter_node_bytes": res_json["inter_node_bytes"]["median_microbatch"],
        "balancedness": res_json["balancedness"]["total"],
        "balancedness_median_microbatch": res_json["balancedness"]["median_microbatch"],
        "imbalance_ratio": res_json["imbalance_ratio"]["total"],
        "max_per_peer_bytes": res_json["max_peer_message_bytes"]["total"],
        "median_max_per_peer_bytes": res_json["max_peer_message_bytes"]["median_microbatch"],
        "layer_time_s": res_json["layer_time_s"]["total"] / (B * L),
        "layer_time_padded_s": res_json["layer_time_padded_s"]["total"] / (B * L),
        "local_activation_rate": res_json["local_activation_rate"]["total"],
        "node_local_rate": res_json["node_local_rate"]["total"],
        "two_hop_inter_node_bytes": res_json["two_hop_inter_node_bytes"]["total"],
    }


def score_plan(plan: Plan, windows: Windows) -> dict:
    """Simulate ``plan`` on the held-out window's scored rows (decode phase); returns the decode PhaseResult JSON."""
    from moeplace.simulate import simulate

    homes = held_out_homes(plan, windows.held, windows.held_signal)
    ev = Plan(plan.placement, plan.cluster, homes, plan.strategy, plan.plan_seconds, plan.planned_on, {})
    return simulate(scoring_trace(windows.held, windows.held_signal), ev).decode.to_json()


def planning_balance(plan: Plan, windows: Windows) -> float:
    """Balancedness of ``plan`` replayed by the simulator on the planning window's traffic rows, with its homes."""
    from moeplace.simulate import simulate

    tr = scoring_trace(windows.plan, windows.plan_work.signal)
    ev = Plan(plan.placement, plan.cluster, plan.homes, plan.strategy)
    return simulate(tr, ev).decode.to_json()["balancedness"]["total"]


def compare(trace: Trace, cluster: Cluster, num_redundant: int, strategies: list[str] | None = None,
            holdout: float = 0.25, split: str = "random", seed: int = 0,
            prefix_tokens: int = DEFAULT_PREFIX_TOKENS, balance_floor: float | None = None,
            params: dict | None = None, progress=None) -> dict:
    """Plan each strategy on the planning window and score it on the held-out one. Returns the compare JSON."""
    names = list(strategies or STRATEGIES)
    for n in names:
        get_strategy(n)
    win = split_windows(trace, holdout, split, seed, prefix_tokens)
    meta: TraceMeta = trace.meta
    base_plan = Plan(Placement.linear(meta.num_layers, meta.num_experts, cluster.world_size, num_redundant), cluster,
                     strategy="linear")
    base = score_plan(base_plan, win)
    base_bytes = base["inter_node_bytes"]["total"]
    out: dict = {"trace": meta.model, "synthetic": bool(meta.synthetic), "cluster": cluster.spec(),
                 "num_redundant": num_redundant, "holdout": holdout, "split": split, "seed": seed,
                 "prefix_tokens": prefix_tokens, "planning_requests": int(win.plan_work.num_requests),
                 "held_out_requests": int(len(win.held.requests)),
                 "scored_tokens": int(base["num_tokens"]), "strategies": {}}
    for n in names:
        kw = dict(params or {})
        kw.setdefault("seed", seed)
        if n == "joint" and balance_floor is not None:
            kw["balance_floor"] = balance_floor
        if progress:
            progress(f"planning {n}")
        t0 = time.perf_counter()
        plan = make_plan(n, win.plan_work, cluster, num_redundant, planned_on=f"{meta.model} planning window", **kw)
        row = sim_metrics(score_plan(plan, win), base_bytes)
        row["plan_seconds"] = plan.plan_seconds
        row["planning_balancedness"] = planning_balance(plan, win)
        row["wall_seconds"] = time.perf_counter() - t0
        out["strategies"][n] = row
    return out
