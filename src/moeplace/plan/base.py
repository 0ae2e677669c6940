"""What every strategy plans from and returns, and the helpers they share.

Shape legend: L = MoE layers, E = logical experts, K = top-k, P = physical slots (E + R redundant), W = GPUs,
N = nodes, G = GPUs per node, S = P / W slots per GPU, T = token rows, Rq = requests of the planning window.

A strategy sees one planning window (:class:`Workload`): the expert load ``[L, E]`` always, and for per-token
traces the routing of every token row of the window. Rows flagged ``admission_rows`` are what a scheduler knows when the
request arrives (its prefill routing; for decode-only traces, the first few decode tokens, see
:func:`workload_from_tokens`); the grouping of new requests uses only those. All other rows are the traffic the
placement is planned for (decode).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import numpy as np

from moeplace.placement import BalanceOutcome, Cluster, CostModel, Fallback, check_slot_count
from moeplace.plan.registry import DEFAULT_PREFIX_TOKENS


@dataclass(frozen=True)
class Workload:
    """One planning window.

    ``load`` is always set; the token fields are None for counts-only inputs (a bare load matrix).
    """

    load: np.ndarray  # float64 [L, E]: token-expert selections per expert in the traffic rows
    request_ids: np.ndarray | None = None  # int64 [Rq]: requests of the window (trace ids)
    token_request: np.ndarray | None = None  # int64 [T]: index into request_ids of each token row
    expert_ids: np.ndarray | None = None  # int16 [T, L, K]: routed experts, router order
    admission_rows: np.ndarray | None = None  # bool [T]: rows known when a request is admitted (its prefill,
    # or its first decode rows when it has none): what grouping may use; the other rows are traffic
    prefill_rows: np.ndarray | None = None  # bool [T]: rows of the prompt (prefill phase); None: unknown
    model: str = ""  # the model the rows come from (a preset name fixes expert sizes for time objectives)
    hidden_size: int | None = None  # elements per token vector (for time objectives); None: unknown
    foe_groups: int = 1  # H of a Federation-of-Experts model's trace (1: plain MoE)

    def __post_init__(self) -> None:
        load = np.asarray(self.load, np.float64)
        if load.ndim != 2:
            raise ValueError(f"load: expected shape [L, E], got {load.shape}")
        if load.size and (not np.isfinite(load).all() or load.min() < 0):
            raise ValueError("load: entries must be finite and >= 0")
        object.__setattr__(self, "load", load)
        if self.expert_ids is not None:
            T = len(self.expert_ids)
            if self.expert_ids.ndim != 3 or self.expert_ids.shape[1] != load.shape[0]:
                raise ValueError(f"expert_ids: expected shape [T, {load.shape[0]}, K], got {self.expert_ids.shape}")
            for name in ("token_request", "admission_rows"):
                a = getattr(self, name)
                if a is None or len(a) != T:
                    raise ValueError(f"{name}: expected {T} entries (one per token row)")

    @property
    def num_layers(self) -> int:
        return self.load.shape[0]

    @property
    def num_experts(self) -> int:
        return self.load.shape[1]

    @property
    def has_tokens(self) -> bool:
        return self.expert_ids is not None

    @property
    def num_requests(self) -> int:
        return 0 if self.request_ids is None else len(self.request_ids)

    def traffic_rows(self) -> np.ndarray:
        """bool [T]: the rows ``load`` counts and placements are built from: the traffic rows (not admission rows),
        or every row when the window has none (a prefill-only window: its prompts are its traffic)."""
        self._need_tokens("traffic_rows")
        m = ~self.admission_rows
        return m if m.any() else np.ones_like(m)

    def phase_rows(self, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(prefill, decode) bool [n] of the rows selected by bool [T] ``sel``: prefill is the prompt's rows (the
        admission rows when the phases are unknown); decode the other rows, less a decode-only request's stand-in
        admission rows."""
        self._need_tokens("phase_rows")
        pre = (self.prefill_rows if self.prefill_rows is not None else self.admission_rows)[sel]
        return pre, ~self.admission_rows[sel] & ~pre

    def traffic(self) -> tuple[np.ndarray, np.ndarray]:
        """(token_request [Tt], expert_ids [Tt, L, K]) of :meth:`traffic_rows`."""
        m = self.traffic_rows()
        return self.token_request[m], self.expert_ids[m]

    def request_counts(self, rows: str = "admission") -> np.ndarray:
        """float32 [Rq, L, E]: per-request expert counts over ``rows`` ("admission", "traffic" or "all")."""
        self._need_tokens("request_counts")
        if rows == "admission":
            m = self.admission_rows
        elif rows == "traffic":
            m = ~self.admission_rows if (~self.admission_rows).any() else np.ones_like(self.admission_rows)
        elif rows == "all":
            m = np.ones_like(self.admission_rows)
        else:
            raise ValueError(f"rows: expected 'admission', 'traffic' or 'all', got {rows!r}")
        return request_expert_counts(self.token_request[m], self.expert_ids[m], self.num_requests, self.num_experts)

    def _need_tokens(self, what: str) -> None:
        if not self.has_tokens:
            raise ValueError(f"{what} needs per-token routing, but this workload is a bare load matrix")


@dataclass
class StrategyResult:
    """What a strategy returns. :func:`moeplace.plan.make_plan` turns it into a Plan; the typed outcome fields go
    to the plan's fields of the same name. Strategies that still report ``fallback``, ``balance_floor`` +
    ``planning_balancedness`` or ``cost_model`` in ``extra`` are mapped by
    :func:`moeplace.placement.typed_from_extra`."""

    phy2log: np.ndarray  # int64 [L, P]
    homes: np.ndarray | None = None  # int64 [Rq]: home GPU of each planning-window request (None: round-robin)
    grouper: object | None = None  # a moeplace.placement.Grouper for new requests (None: round-robin)
    extra: dict = field(default_factory=dict)  # free-form parameters and diagnostics (JSON-serialisable)
    balance: BalanceOutcome | None = None  # the floor and what the strategy reached (strategies with a floor)
    fallback: Fallback | None = None  # set when the strategy used another method's result
    cost_model: CostModel | None = None  # the cost it minimised, when it used one
    foe_groups: int = 1  # > 1: an FoE plan (strategy foe)


def request_expert_counts(token_request: np.ndarray, expert_ids: np.ndarray, num_requests: int,
                          num_experts: int) -> np.ndarray:
    """float32 [Rq, L, E]: how often each request's tokens selected each expert, per layer.

    token_request: int [T] request index per row; expert_ids: int [T, L, K].
    """
    from moeplace.analyse.loops import add_request_counts

    T, L, K = expert_ids.shape
    out = np.zeros((num_requests, L, num_experts), np.float32)
    if T == 0:
        return out
    tr = np.asarray(token_request)
    if tr.shape != (T,):
        raise ValueError(f"token_request: expected shape [{T}], got {tr.shape}")
    bad = add_request_counts(tr, np.asarray(expert_ids), out)  # a compiled scatter: no [T, L, K] int64 temporaries
    if bad >= 0:
        raise ValueError(f"row {bad}: request index or expert id out of range ({num_requests} requests, "
                         f"{num_experts} experts)")
    return out


def load_from_tokens(expert_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """float64 [L, E]: token-expert selections per layer and expert. expert_ids: int [T, L, K]."""
    T, L, K = expert_ids.shape
    out = np.zeros((L, num_experts))
    for layer in range(L):  # one layer at a time bounds the temporaries
        out[layer] = np.bincount(expert_ids[:, layer, :].ravel().astype(np.int64), minlength=num_experts)
    return out


def workload_from_tokens(request_id: np.ndarray, phase: np.ndarray, expert_ids: np.ndarray, num_experts: int,
                         prefix_tokens: int = DEFAULT_PREFIX_TOKENS) -> Workload:
    """Build a Workload from token rows (request_id [T], phase [T] 0 prefill / 1 decode, expert_ids [T, L, K]).

    Signal rows are the prefill rows. A request with no prefill rows (decode-only traces such as gpt-oss-20b)
    uses its first ``prefix_tokens`` decode rows (in row order) as its admission rows instead; those rows then stand for
    the prompt and are not traffic. Rows are assumed to be in generation order within each request.
    """
    rid = np.asarray(request_id, np.int64)
    phase = np.asarray(phase)
    if prefix_tokens < 0:
        raise ValueError(f"prefix_tokens must be >= 0, got {prefix_tokens}")
    uniq, inv = np.unique(rid, return_inverse=True)
    signal = phase == 0
    has_prefill = np.bincount(inv, weights=signal, minlength=len(uniq)) > 0
    if prefix_tokens and not has_prefill.all():
        order = np.argsort(inv, kind="stable")
        starts = np.concatenate([[0], np.cumsum(np.bincount(inv, minlength=len(uniq)))[:-1]])
        rank = np.empty(len(rid), np.int64)
        rank[order] = np.arange(len(rid)) - starts[inv[order]]
        signal = signal | ((~has_prefill[inv]) & (rank < prefix_tokens))
    traffic = ~signal
    load = load_from_tokens(expert_ids[traffic] if traffic.any() else expert_ids, num_experts)
    return Workload(load, uniq, inv.astype(np.int64), np.asarray(expert_ids), signal,
                    prefill_rows=np.asarray(phase) == 0)


def check_sizes(num_layers: int, num_experts: int, cluster: Cluster, num_redundant: int) -> tuple[int, int]:
    """Validate (E, R) against the cluster (:func:`moeplace.placement.check_slot_count`, then whole slots per GPU);
    returns (P, S)."""
    W = cluster.world_size
    check_slot_count(num_experts, num_redundant, W, num_layers)
    P = num_experts + num_redundant
    if P % W:
        raise ValueError(
            f"num_redundant={num_redundant}: {num_experts} experts + {num_redundant} redundant slots = {P} slots are "
            f"not divisible by {W} GPUs (cluster {cluster.spec()}); pick R so that E + R is a multiple of {W}"
        )
    return P, P // W


def ideal_gpu_load(phy2log: np.ndarray, load: np.ndarray, num_gpus: int) -> np.ndarray:
    """float [L, W]: GPU load if every expert's load splits evenly over its replicas (EPLB's own model).

    phy2log: int [L, P]; load: float [L, E].
    """
    L, P = phy2log.shape
    E = load.shape[1]
    cnt = np.zeros((L, E))
    np.add.at(cnt, (np.arange(L)[:, None], phy2log), 1)
    per_slot = np.take_along_axis(load / np.maximum(cnt, 1), phy2log, axis=1)  # [L, P]
    return per_slot.reshape(L, num_gpus, P // num_gpus).sum(axis=2)


def workload_from_trace(trace: str | os.PathLike, prefix_tokens: int = DEFAULT_PREFIX_TOKENS) -> tuple[Workload, dict]:
    """(workload, {"moe_layer_map", "model"}) of a trace directory: per-token rows when it has them, else the
    counts-only load."""
    from moeplace.trace.reader import read_trace

    t = read_trace(trace)
    info = {"moe_layer_map": t.meta.moe_layer_map, "model": t.meta.model}
    if t.tokens is None:
        return Workload(t.counts.counts.sum(axis=0), foe_groups=t.meta.foe_groups), info
    tk = t.tokens
    work = workload_from_tokens(tk.request_id, tk.phase, tk.expert_ids, t.meta.num_experts, prefix_tokens)
    return dataclasses.replace(work, model=t.meta.model, hidden_size=t.meta.hidden_size,
                               foe_groups=t.meta.foe_groups), info
