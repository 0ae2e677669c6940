"""The simulator: what a placement and a grouping cost, replayed token by token on a routing trace.

Shape legend: T = tokens, L = MoE layers, K = top-k, E = logical experts, P = physical slots, W = GPUs,
B = micro-batches, N_n = nodes, G = GPUs per node.

Pipeline of one micro-batch and layer (docs/SIMULATOR.md has the full definitions):

1. every token starts at its request's home GPU (micro-batches from :mod:`moeplace.simulate.batching`);
2. each of its K experts is served by one replica, chosen by the rule of :mod:`moeplace.simulate.routing`
   (the runtime calls the same functions, so simulator and runtime route identically);
3. sends per destination GPU (per-GPU dedup) or per remote node (two-hop), split by link class;
4. time per micro-batch from :mod:`moeplace.simulate.cost`.

:func:`simulate` streams: memory is bounded by the open micro-batches; each micro-batch, once all its tokens were
seen, goes through one compiled kernel call (:mod:`moeplace.simulate.loops`) on disjoint layer ranges in
threads. ``tests/spec_simulator.py`` is an independent, loop-by-loop spec that it must match exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeplace.budget import BudgetError
from moeplace.engine import TASKS_PER_WORKER
from moeplace.placement import Cluster, Placement, Plan
from moeplace.simulate import loops
from moeplace.simulate.batching import BatchConfig, Layout, build_layout, microbatch_ids, rows_of
from moeplace.simulate.bounds import expert_demand, reachable_seconds
from moeplace.simulate.cost import CostConfig, TimeTerms, microbatch_metrics, pair_flops_of, time_terms
from moeplace.simulate.mbstore import COLUMN_ELEMENTS, SPILL_BYTES, MicrobatchMetrics
from moeplace.simulate.result import PhaseResult, SimResult
from moeplace.simulate.routing import (
    BALANCED_RULES,
    DEDUP_MODES,
    DEFAULT_RULE,
    ReplicaCosts,
    RouteTables,
    balanced_gpus,
    build_route_tables,
    check_rule,
    two_hop_matrix,
    writable_arrays,
)
from moeplace.trace.budget import check_memory, memory_budget
from moeplace.trace.reader import (
    iter_light_columns,
    iter_token_chunks,
    read_meta,
    read_requests,
    shard_ranges,
    shard_token_rows,
)
from moeplace.trace.types import DECODE, PREFILL, Requests, TokenChunk, Trace, TraceError, TraceMeta

# --------------------------------------------------------------------------------------------------- context


@dataclass
class _Ctx:
    meta: TraceMeta
    placement: Placement
    cluster: Cluster
    tab: RouteTables
    rule: str
    hidden: int
    dispatch_send_bytes: float  # bytes of one dispatch send (hidden * dispatch_bytes)
    combine_send_bytes: float
    pair_seconds: float  # compute seconds of one token-expert pair on one GPU
    cost: CostConfig
    batching: BatchConfig
    plan: Plan
    terms: TimeTerms  # the kernel time model's constants (moeplace.simulate.cost.time_terms)
    serve: np.ndarray | None = None  # int16 [L*E*W] the kernels' table for ``rule`` (RouteTables.kernel_serve)
    node: np.ndarray | None = None  # int64 [W] node of each GPU
    replica_costs: ReplicaCosts | None = None  # locality costs of the balanced-local rule (None: defaults)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(writable_arrays(state))  # arrays from Ray's object store are read-only

    def pick(self, ids: np.ndarray, rows: np.ndarray, home: np.ndarray, starts: np.ndarray,
             start: np.ndarray | None = None) -> np.ndarray:
        """int16 [n, L, K] serving GPU of each pair under a balanced rule, else an empty [0, L, K] (the kernel
        then chooses by the serve table). Arguments as :func:`moeplace.simulate.routing.balanced_gpus`."""
        if self.rule in BALANCED_RULES:
            return balanced_gpus(ids, rows, home, starts, self.tab, self.rule, self.replica_costs, start=start)
        return np.zeros((0, ids.shape[1], ids.shape[2]), np.int16)

    def metrics(self, counts: dict[str, np.ndarray], load: np.ndarray, active: np.ndarray,
                pair_counts: np.ndarray, phase: str, demand: np.ndarray | None = None,
                tokens: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Per-micro-batch metrics of the time model (:func:`moeplace.simulate.cost.microbatch_metrics`) and the
        reachable bound (:func:`moeplace.simulate.bounds.reachable_seconds`) from ``demand`` int [B, L, E] and
        ``tokens`` int [B] (None: no micro-batches, an empty [0, L] column)."""
        out = microbatch_metrics(counts, load, self.cluster, self.dispatch_send_bytes, self.combine_send_bytes,
                                 self.pair_seconds, active, pair_counts, self.terms, phase)
        if demand is None:
            out["bound_reachable_time"] = np.zeros(load.shape[:-1])
        else:
            out["bound_reachable_time"] = reachable_seconds(demand, tokens, self.meta.top_k, self.placement.num_slots,
                                                            self.cluster, self.terms, phase, self.pair_seconds)
        return out

    @property
    def W(self) -> int:
        return self.cluster.world_size

    @property
    def G(self) -> int:
        return self.cluster.gpus_per_node

    @property
    def num_nodes(self) -> int:
        return self.cluster.num_nodes


def _make_ctx(meta: TraceMeta, plan: Plan | None, cluster: Cluster | None, cost: CostConfig | None,
              batching: BatchConfig | None, rule: str, num_redundant: int,
              replica_costs: ReplicaCosts | None = None, where: object = "trace") -> _Ctx:
    check_rule(rule)
    if meta.kind != "tokens":
        raise ValueError("simulate needs a per-token trace, but this trace is counts-only (kind='counts')")
    if meta.foe_groups > 1:
        raise ValueError(f"{where}: an FoE trace (foe_groups={meta.foe_groups}): simulate replays plain MoE "
                         "execution; run-ep reports an FoE run next to the simulator's FoE replay (docs/FOE.md)")
    cost = cost or CostConfig()
    batching = batching or BatchConfig()
    if plan is None:
        if cluster is None:
            raise ValueError("simulate: give a plan or a cluster (for the default linear placement)")
        try:  # sizes from the trace: say so
            placement = Placement.linear(meta.num_layers, meta.num_experts, cluster.world_size, num_redundant)
        except ValueError as e:
            raise ValueError(f"{where}: L={meta.num_layers}, E={meta.num_experts} on {cluster.spec()}: {e}") from None
        plan = Plan(placement, cluster, strategy="linear" if not num_redundant else f"linear+{num_redundant}")
    elif cluster is not None and cluster.spec() != plan.cluster.spec():
        raise ValueError(f"simulate: cluster {cluster.spec()} differs from the plan's cluster {plan.cluster.spec()}")
    elif cluster is None:
        cluster = plan.cluster
    pl = plan.placement
    if pl.num_layers != meta.num_layers or pl.num_experts != meta.num_experts:
        raise ValueError(f"plan does not fit the trace: plan has L={pl.num_layers} layers and E={pl.num_experts} "
                         f"experts, the trace has L={meta.num_layers} and E={meta.num_experts}")
    if pl.num_gpus != cluster.world_size:
        raise ValueError(f"plan is for {pl.num_gpus} GPUs but cluster {cluster.spec()} has {cluster.world_size}")
    hidden = cost.hidden_size or meta.hidden_size
    if not hidden:
        raise ValueError("hidden size unknown: the trace metadata has no hidden_size; give CostConfig.hidden_size "
                         "(CLI: --hidden-size)")
    pair_flops = pair_flops_of(cost, int(hidden), meta.model)
    W = cluster.world_size
    tab = build_route_tables(pl.phy2log, pl.slot_gpu, np.arange(W) // cluster.gpus_per_node, meta.num_experts)
    return _Ctx(meta, pl, cluster, tab, rule, int(hidden), hidden * cost.dispatch_bytes, hidden * cost.combine_bytes,
                pair_flops / cluster.expert_flops, cost, batching, plan, time_terms(cost, int(hidden), meta.model),
                tab.kernel_serve(rule),
                np.arange(W, dtype=np.int64) // cluster.gpus_per_node, replica_costs)



def route_microbatches(ctx: _Ctx, ids: np.ndarray, rows: np.ndarray, home: np.ndarray, mb: np.ndarray,
                       phase: str, sends_pg: np.ndarray | None = None, node_sends: np.ndarray | None = None,
                       local: np.ndarray | None = None, node_local: np.ndarray | None = None,
                       bound: bool = True, picks: dict | None = None
                       ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Route complete micro-batches through the compiled kernel and the time model.

    ids: int [T, L, K]; rows: int [n] rows of ids to route (trace order); home, mb: int [n] their home GPU and
    micro-batch. Totals are added into sends_pg int64 [L, W, W], node_sends [L, W, N_n], local and node_local [L]
    when given. Returns (micro-batch ids [B] sorted, loads int64 [B, L, W], metrics name -> [B, L]); with
    ``bound=False`` the metrics leave out ``bound_reachable_time`` (a planner scoring candidates does not read it,
    and it was a fifth of joint's plan time). ``picks``: a dict a caller shares between calls on the very same
    rows, homes and placement under different rules: the ``balanced`` rule leaves its per-pair GPUs there and
    ``balanced-links``, which starts from them, reuses them (the same answer, one balanced solve fewer).
    """
    L = ctx.meta.num_layers
    order = np.argsort(mb, kind="stable")  # micro-batches together, trace order inside
    umb, cnt = np.unique(mb, return_counts=True)
    starts = np.r_[0, np.cumsum(cnt)].astype(np.int64)
    nb = len(umb)
    loads = np.zeros((nb, L, ctx.W), np.int64)
    counts = {m: np.zeros((nb, L, 6), np.int64) for m in DEDUP_MODES}
    active = np.zeros((nb, L, ctx.W), np.int64)  # distinct experts with pairs per GPU (roofline memory term)
    pair_counts = np.zeros((nb, L, 4), np.int64)  # sends without dedup (DeepEP low-latency)
    if sends_pg is None:
        sends_pg = np.zeros((L, ctx.W, ctx.W), np.int64)
    if node_sends is None:
        node_sends = np.zeros((L, ctx.W, ctx.num_nodes), np.int64)
    local = np.zeros(L, np.int64) if local is None else local
    node_local = np.zeros(L, np.int64) if node_local is None else node_local
    ids = np.ascontiguousarray(ids, np.int16)
    rows_o = np.ascontiguousarray(np.asarray(rows)[order], np.int64)
    home_o = np.ascontiguousarray(np.asarray(home)[order], np.int64)
    start = picks.get("balanced") if picks is not None and ctx.rule == "balanced-links" else None
    pick = ctx.pick(ids, rows_o, home_o, starts, start)
    if picks is not None and ctx.rule == "balanced":
        picks["balanced"] = pick
    bad = loops.by_ranges(loops.microbatch_kernel, L, ids, rows_o, home_o,
                            starts, ctx.serve, ctx.tab.cand_gpu, ctx.tab.cand_ok, pick, ctx.node, ctx.G, loads,
                            counts["per_gpu"], counts["two_hop"], sends_pg, node_sends, local, node_local,
                            active, pair_counts)
    if max(bad) >= 0:
        raise ValueError(f"a token row has an expert id out of range [0, {ctx.meta.num_experts})")
    demand = expert_demand(ids, rows_o, starts, ctx.meta.num_experts) if bound else None
    out = ctx.metrics(counts, loads, active, pair_counts, phase, demand, cnt)
    if not bound:
        del out["bound_reachable_time"]
    return umb, loads, out


def simulate_rows(expert_ids: np.ndarray, home: np.ndarray, microbatch: np.ndarray, phase: str,
                  phy2log: np.ndarray, cluster: Cluster, cost: CostConfig, model: str = "",
                  rule: str = DEFAULT_RULE, num_experts: int | None = None,
                  replica_costs: ReplicaCosts | None = None, bound: bool = True, picks: dict | None = None
                  ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The simulator on array rows of one phase, for a planner scoring candidate placements on its window.

    expert_ids: int [T, L, K]; home: int [T] home GPU of each row; microbatch: int [T] its micro-batch (rows of one
    micro-batch are routed in row order); phase: "prefill" or "decode" (the kernel ``auto`` picks per phase);
    phy2log: int [L, P]; cost: needs ``hidden_size``. Returns (micro-batch ids [B], metrics name -> [B, L]) with
    the same names as :attr:`PhaseResult.per_microbatch` (``layer_time`` is the kernel time model's), less
    ``bound_reachable_time`` when ``bound`` is False. picks: see :func:`route_microbatches`.
    """
    if not cost.hidden_size:
        raise ValueError("simulate_rows: CostConfig.hidden_size is required")
    umb, _, metrics = _route_rows(expert_ids, home, microbatch, phase, phy2log, cluster, cost, model, rule,
                                  num_experts, replica_costs, bound, picks)
    return umb, metrics


def _route_rows(expert_ids: np.ndarray, home: np.ndarray, microbatch: np.ndarray, phase: str,
                phy2log: np.ndarray, cluster: Cluster, cost: CostConfig, model: str, rule: str,
                num_experts: int | None, replica_costs: ReplicaCosts | None, bound: bool = True,
                picks: dict | None = None) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """:func:`route_microbatches` on array rows (all rows, in row order): the context from the arrays' shapes."""
    ids = np.asarray(expert_ids)
    T, L, K = ids.shape
    p2l = np.asarray(phy2log, np.int64)
    E = int(num_experts) if num_experts is not None else max(int(ids.max()) + 1 if ids.size else 1,
                                                            int(p2l.max()) + 1)
    meta = TraceMeta(model=model, num_layers=L, num_experts=E, top_k=K, hidden_size=int(cost.hidden_size))
    plan = Plan(Placement(p2l, E, cluster.world_size), cluster)
    ctx = _make_ctx(meta, plan, cluster, cost, None, rule, 0, replica_costs)
    return route_microbatches(ctx, ids, np.arange(T), np.asarray(home, np.int64), np.asarray(microbatch, np.int64),
                              phase, bound=bound, picks=picks)


# --------------------------------------------------------------------------------------------------- accumulation


ROUTE_ROWS = 1 << 14  # token rows routed in one kernel call at most (whole micro-batches; one larger goes alone)


def route_groups(mb: np.ndarray, max_rows: int) -> list[np.ndarray]:
    """Split rows into groups of whole micro-batches, in micro-batch id order, each of at most ``max_rows`` rows
    (a micro-batch with more rows is a group alone).

    mb: int [n] micro-batch id of each row. Returns int64 index arrays into mb; each group's rows keep their order
    in mb (trace order inside a micro-batch), and the groups together hold every row once. Micro-batches are
    routed independently and every total is an integer sum, so routing group by group gives the same result as
    routing all rows at once.
    """
    mb = np.asarray(mb)
    if len(mb) <= max_rows:
        return [np.arange(len(mb))]
    order = np.argsort(mb, kind="stable")
    _, cnt = np.unique(mb, return_counts=True)
    ends = np.cumsum(cnt)
    groups, start, rows = [], 0, 0
    for i, c in enumerate(cnt.tolist()):
        if rows and rows + c > max_rows:  # close the group before micro-batch i
            end = int(ends[i - 1])
            groups.append(order[start:end])
            start, rows = end, 0
        rows += c
    groups.append(order[start:])
    return groups


class _PhaseAcc:
    """Accumulators of one phase: totals, finished per-micro-batch metrics, and the token rows of open micro-batches.

    A micro-batch is routed only once all its tokens were seen: rows of open micro-batches wait in ``pending``
    (copies of their routing, 2 bytes per token, layer and k: much less than open [L, W, W] matrices), so the
    kernel routes each micro-batch with its matrices hot in cache and reduces them at once.
    """

    def __init__(self, ctx: _Ctx, lay: Layout, phase: int, spill: bool = True) -> None:
        L, W = ctx.meta.num_layers, ctx.W
        self.ctx, self.phase = ctx, phase
        self.name = "prefill" if phase == PREFILL else "decode"
        self.expect_ids, self.expect_n = lay.mb_ids[phase], lay.mb_tokens[phase]
        self.tokens = 0
        self.pairs = np.zeros(L, np.int64)
        self.local = np.zeros(L, np.int64)
        self.node_local = np.zeros(L, np.int64)
        self.load = np.zeros((L, W), np.int64)
        self.sends = {m: np.zeros((L, W, W), np.int64) for m in DEDUP_MODES}
        self.done = MicrobatchMetrics(L, spill_bytes() if spill else None)  # finished metrics (spilled when large)
        self.seen: dict[int, int] = {}  # open micro-batch id -> tokens seen so far
        self.pending: list[list] = []  # [ids int16 [n, L, K], home [n], mb [n], alive bool [n]] in trace order
        self.node_sends: np.ndarray | None = None  # int64 [L, W, N_n] once the kernel routed (two-hop totals)

    def add(self, ids: np.ndarray, rows: np.ndarray, home: np.ndarray, mb: np.ndarray) -> None:
        """Take the rows ``rows`` of ids int16 [T, L, K] (one phase, trace order; home, mb: int [n]) and route
        every micro-batch that is now complete."""
        n = len(rows)
        if n == 0:
            return
        self.tokens += n
        self.pairs += np.int64(ids.shape[2] * n)
        umb, cnt = np.unique(mb, return_counts=True)
        pos = np.searchsorted(self.expect_ids, umb)
        complete = []
        from_pending = False  # a complete micro-batch has rows waiting from earlier chunks
        for m, c, i in zip(umb.tolist(), cnt.tolist(), pos.tolist(), strict=True):
            before = self.seen.pop(m, 0)
            if i < len(self.expect_ids) and self.expect_ids[i] == m and before + c >= self.expect_n[i]:
                complete.append(m)
                from_pending |= before > 0
            else:
                self.seen[m] = before + c
        now = np.isin(mb, complete) if len(complete) < len(umb) else np.ones(n, bool)
        if from_pending:  # rows of the complete micro-batches from earlier chunks, then from this one
            srcs: list[tuple] = []
            for p in self.pending:
                take = p[3] & np.isin(p[2], complete)
                if take.any():
                    srcs.append((p[0], np.flatnonzero(take), p[1][take], p[2][take]))
                    p[3] &= ~take
            self.pending = [p for p in self.pending if p[3].any()]
            srcs.append((ids, rows[now], home[now], mb[now]))
            self._route_from(srcs)
        elif complete:
            self._route(ids, rows[now], home[now], mb[now])
        if not now.all():
            keep = ~now
            self.pending.append([ids[rows[keep]], home[keep], mb[keep], np.ones(int(keep.sum()), bool)])

    def _route(self, ids: np.ndarray, rows: np.ndarray, home: np.ndarray, mb: np.ndarray) -> None:
        """Route complete micro-batches: rows of ids in trace order, mb their micro-batch ids."""
        self._route_from([(ids, rows, home, mb)])

    def _route_from(self, srcs: list[tuple]) -> None:
        """Route complete micro-batches whose rows lie in several arrays: srcs is a list of (ids int16 [T_s, L, K],
        rows [n_s], home [n_s], mb [n_s]) in trace order. In groups of whole micro-batches of at most ROUTE_ROWS
        rows (:func:`route_groups`): a group from one array is routed from it, one from several is gathered into
        a buffer of its rows only. So the kernel's and the time model's arrays, and the copies, stay bounded when
        many micro-batches complete at once (a decode window's steps complete together when its last request is
        read)."""
        ctx = self.ctx
        if self.node_sends is None:
            self.node_sends = np.zeros((ctx.meta.num_layers, ctx.W, ctx.num_nodes), np.int64)
        src = np.concatenate([np.full(len(x[1]), i, np.int32) for i, x in enumerate(srcs)])
        rows, home, mb = (np.concatenate([np.asarray(x[j], np.int64) for x in srcs]) for j in (1, 2, 3))
        for g in route_groups(mb, ROUTE_ROWS):
            s = np.unique(src[g]).tolist()
            if len(s) == 1:  # every row in one array (always so without waiting rows): no copy
                ids, r = srcs[s[0]][0], rows[g]
            else:
                ids = np.empty((len(g),) + srcs[s[0]][0].shape[1:], np.int16)
                for i in s:
                    at = np.flatnonzero(src[g] == i)
                    ids[at] = srcs[i][0][rows[g[at]]]
                r = np.arange(len(g))
            umb, loads, metrics = route_microbatches(ctx, ids, r, home[g], mb[g], self.name, self.sends["per_gpu"],
                                                     self.node_sends, self.local, self.node_local)
            self.load += loads.sum(0)
            self.done.append(umb.astype(np.int64), metrics)

    def route_open(self) -> None:
        """Route the micro-batches still open, from the rows seen (the layout expected more: a changed trace)."""
        ps = [p for p in self.pending if p[3].any()]
        self.pending = []
        if ps:
            self._route_from([(p[0], np.flatnonzero(p[3]), p[1][p[3]], p[2][p[3]]) for p in ps])

    def result(self, name: str) -> PhaseResult:
        self.route_open()
        if self.node_sends is not None:
            self.sends["two_hop"] = two_hop_matrix(self.sends["per_gpu"], self.node_sends, self.ctx.G)
            self.node_sends = None
        L = self.ctx.meta.num_layers
        if not len(self.done):  # no micro-batch: the metrics' names with no rows
            z = np.zeros((0, L, 6), np.int64)
            zw = np.zeros((0, L, self.ctx.W), np.int64)
            self.done.append(np.zeros(0, np.int64), self.ctx.metrics({m: z for m in DEDUP_MODES}, zw, zw,
                                                                     np.zeros((0, L, 4), np.int64), self.name))
        pm = self.done.freeze()
        ids = pm.ids
        j = np.minimum(np.searchsorted(self.expect_ids, ids), max(len(self.expect_ids) - 1, 0))
        mb_tokens = self.expect_n[j].astype(np.int64) if len(ids) else np.zeros(0, np.int64)
        return PhaseResult(name, self.tokens, self.ctx.dispatch_send_bytes, self.ctx.combine_send_bytes, ids,
                           self.pairs, self.load, self.local, self.node_local, self.sends, pm, mb_tokens)


# --------------------------------------------------------------------------------------------------- entry points


def _open_source(trace) -> tuple[TraceMeta, Requests, object]:
    if isinstance(trace, Trace):
        if trace.tokens is None:
            raise ValueError("simulate needs a per-token trace, but this trace is counts-only")
        return trace.meta, trace.requests, trace
    p = Path(trace)
    return read_meta(p), read_requests(p), p


def _chunks(source, chunk_tokens: int) -> Iterator[TokenChunk]:
    if isinstance(source, Trace):
        tk = source.tokens
        for s in range(0, len(tk), chunk_tokens):
            yield tk.select(slice(s, s + chunk_tokens))
    else:
        yield from iter_token_chunks(source, chunk_tokens=chunk_tokens, columns_weights=False)


def _result(ctx: _Ctx, accs: dict[int, _PhaseAcc]) -> SimResult:
    m = ctx.meta
    return SimResult(m.model, bool(m.synthetic), m.source, ctx.cluster, ctx.rule, ctx.plan.strategy, ctx.cost,
                     ctx.batching, ctx.hidden, ctx.pair_seconds, accs[PREFILL].result("prefill"),
                     accs[DECODE].result("decode"))


def simulate(trace, plan: Plan | None = None, cluster: Cluster | None = None, cost: CostConfig | None = None,
             batching: BatchConfig | None = None, rule: str = DEFAULT_RULE, num_redundant: int = 0,
             chunk_tokens: int = 16384, progress: bool = False, replica_costs: ReplicaCosts | None = None,
             engine=None) -> SimResult:
    """Replay a per-token trace on a plan; vectorised and streaming (memory bounded by open micro-batches).

    trace: a trace directory or an in-memory :class:`Trace`. plan: placement + homes; None -> linear placement
    with ``num_redundant`` redundant slots on ``cluster`` and round-robin homes in request-table order.
    replica_costs: locality costs of the ``balanced-local`` rule (None: :class:`ReplicaCosts` defaults).
    engine (:mod:`moeplace.engine`, trace directories only): replay ranges of shards as separate tasks; each
    routes the micro-batches whose first row lies in its range, reading on into the next shards for those that
    straddle its end. Micro-batches are independent and every total is an integer sum, so the answer is
    byte-identical to the single-process stream (:func:`simulate_parts`).
    """
    meta, requests, source = _open_source(trace)
    ctx = _make_ctx(meta, plan, cluster, cost, batching, rule, num_redundant, replica_costs,
                    source if not isinstance(source, Trace) else "trace")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    lay = build_layout(source, requests, ctx.plan.home_of(requests.request_id), ctx.batching)
    if len(lay.home) and (lay.home.min() < 0 or lay.home.max() >= ctx.W):
        raise ValueError(f"plan: a request's home GPU is out of range [0, {ctx.W})")
    _check_result_memory(ctx, lay, source)
    if engine is not None and not isinstance(source, Trace):
        return simulate_parts(ctx, lay, str(source), chunk_tokens, engine)
    accs = {p: _PhaseAcc(ctx, lay, p) for p in (PREFILL, DECODE)}
    total = int(sum(lay.mb_tokens[p].sum() for p in (PREFILL, DECODE)))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="tok", desc="simulate")
    for ch in _chunks(source, chunk_tokens):
        r = rows_of(lay, ch.request_id)
        mb = microbatch_ids(lay, r, ch.position, ch.phase)
        home = lay.home[r]
        ids = np.ascontiguousarray(ch.expert_ids, np.int16)
        for p in (PREFILL, DECODE):
            sel = np.flatnonzero(ch.phase == p)
            accs[p].add(ids, sel, home[sel], mb[sel])
        if bar is not None:
            bar.update(len(ch))
    if bar is not None:
        bar.close()
    return _result(ctx, accs)


def _check_result_memory(ctx: _Ctx, lay: Layout, source) -> None:
    """What a result holds in memory whatever the trace's size must fit the memory budget: the finished metrics kept
    before a spill (:func:`spill_bytes`), a few per-micro-batch vectors (ids, order, one value each: 8 bytes x B),
    and the layer blocks its statistics read (COLUMN_ELEMENTS values of a few metrics at once). Known from the
    layout before any routing."""
    B = sum(len(lay.mb_ids[p]) for p in (PREFILL, DECODE))
    where = source if not isinstance(source, Trace) else "simulate"
    need = spill_bytes() + 8 * (4 * B + 6 * min(COLUMN_ELEMENTS, max(B, 1) * ctx.meta.num_layers))
    check_memory(need, f"the per-micro-batch metrics of {B:,} micro-batches (their in-memory part)", where)


def spill_bytes() -> int:
    """Finished metrics a replay keeps in memory before it writes them to a spill file (moeplace.simulate.mbstore):
    SPILL_BYTES, or an eighth of the memory budget where that is less (the answer does not depend on it)."""
    try:
        return int(min(SPILL_BYTES, memory_budget() // 8))
    except BudgetError as e:
        raise TraceError(str(e)) from None


# --------------------------------------------------------------------------------------------------- parts on an engine


@dataclass(frozen=True)
class SimPart:
    """A range of consecutive shards of a trace (indices into its shard files), replayed by one task.

    ``owned`` (phase -> sorted int64 micro-batch ids) are the micro-batches whose first row lies in the range: the
    task routes exactly these, reading on into later shards (up to ``read_to``) for those that straddle its end;
    empty until :func:`own_microbatches` filled them."""

    path: str
    shards: tuple[int, ...]
    owned: tuple[np.ndarray, np.ndarray] | None = None  # (prefill ids, decode ids)
    read_to: int = -1  # the last shard a task reads (>= the range's last)


PART_ROWS = 1 << 20  # token rows of one task at most (a task holds its finished metrics until it returns)


def plan_parts(path: str, tasks: int) -> list[SimPart]:
    """About ``tasks`` ranges of consecutive shards with similar token counts (from the footers), more where a
    range would hold over PART_ROWS rows (a shard is never split)."""
    rows = shard_token_rows(path)
    tasks = max(tasks, -(-sum(rows) // PART_ROWS))
    return [SimPart(path, r) for r in shard_ranges(rows, tasks)]


def part_microbatches(part: SimPart, lay: Layout) -> list[tuple[np.ndarray, np.ndarray]]:
    """Map step 1 (light columns only): per shard of the range, the sorted ids of the prefill and of the decode
    micro-batches it holds rows of."""
    out = []
    for s in part.shards:
        ids: dict[int, list] = {PREFILL: [], DECODE: []}
        for rid, pos, ph in iter_light_columns(part.path, check_requests=False, shards=[s]):
            mb = microbatch_ids(lay, rows_of(lay, rid), pos, ph)
            for p in (PREFILL, DECODE):
                ids[p].append(np.unique(mb[ph == p]))
        out.append(tuple(np.unique(np.concatenate(ids[p])) if ids[p] else np.zeros(0, np.int64)
                         for p in (PREFILL, DECODE)))
    return out


def own_microbatches(parts: list[SimPart], lay: Layout, per_shard: list[tuple[np.ndarray, np.ndarray]]
                     ) -> list[SimPart]:
    """Each micro-batch to the part holding its first row (in trace order), with the last shard that part must
    read: ``per_shard`` is :func:`part_microbatches`'s answer for every shard in order. Every micro-batch of the
    layout has exactly one owner, so every row is routed once, by a task that sees all of its micro-batch's rows
    in trace order."""
    first, last = {}, {}
    for p in (PREFILL, DECODE):
        n = len(lay.mb_ids[p])
        first[p], last[p] = np.full(n, len(per_shard), np.int64), np.full(n, -1, np.int64)
        for s, ids in enumerate(per_shard):
            j = np.searchsorted(lay.mb_ids[p], ids[p])
            np.minimum.at(first[p], j, s)
            np.maximum.at(last[p], j, s)
        if n and last[p].min() < 0:  # the light pass saw what the layout did: a changed trace
            raise TraceError(f"{parts[0].path}: a shard changed while it was read (micro-batches without rows)")
    out = []
    for part in parts:
        a, b = part.shards[0], part.shards[-1]
        owned, read_to = [], b
        for p in (PREFILL, DECODE):
            mine = (first[p] >= a) & (first[p] <= b)
            owned.append(lay.mb_ids[p][mine])
            if mine.any():
                read_to = max(read_to, int(last[p][mine].max()))
        out.append(SimPart(part.path, part.shards, (owned[0], owned[1]), read_to))
    return out


def _phase_sums(acc: _PhaseAcc) -> dict:
    """The integer sums of a part's phase accumulator (what the driver adds to its own)."""
    return {"tokens": acc.tokens, "pairs": acc.pairs, "local": acc.local, "node_local": acc.node_local,
            "load": acc.load, "per_gpu": acc.sends["per_gpu"], "node_sends": acc.node_sends}


def _member(mb: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """bool [n]: which of ``mb`` int64 [n] are in ``ids`` (sorted int64)."""
    if not len(ids):
        return np.zeros(len(mb), bool)
    j = np.minimum(np.searchsorted(ids, mb), len(ids) - 1)
    return ids[j] == mb


def simulate_part(part: SimPart, ctx: _Ctx, lay: Layout, chunk_tokens: int) -> Iterator:
    """Map step 2 (a generator): route the micro-batches the part owns (:func:`own_microbatches`), from its first
    shard on, and stop as soon as every row of them was read (at most up to ``read_to``). Yields ``(phase, ids
    int64 [b], metrics name -> [b, L])`` blocks of finished micro-batches whenever a phase holds SPILL_BYTES of
    them, and last ``{phase: sums}``; so a task never holds its part's whole result."""
    owned = dict(zip((PREFILL, DECODE), part.owned, strict=True))
    need = sum(int(lay.mb_tokens[p][np.searchsorted(lay.mb_ids[p], owned[p])].sum()) for p in (PREFILL, DECODE))
    accs = {p: _PhaseAcc(ctx, lay, p, spill=False) for p in (PREFILL, DECODE)}  # the driver may be elsewhere
    got = 0
    if need:
        for ch in iter_token_chunks(part.path, chunk_tokens=chunk_tokens, columns_weights=False,
                                    check_requests=False, shards=list(range(part.shards[0], part.read_to + 1))):
            r = rows_of(lay, ch.request_id)
            mb = microbatch_ids(lay, r, ch.position, ch.phase)
            home = lay.home[r]
            ids = np.ascontiguousarray(ch.expert_ids, np.int16)
            for p in (PREFILL, DECODE):
                sel = np.flatnonzero(ch.phase == p)
                sel = sel[_member(mb[sel], owned[p])]
                accs[p].add(ids, sel, home[sel], mb[sel])
                got += len(sel)
                if accs[p].done.buffered_bytes >= SPILL_BYTES:
                    for b_ids, metrics in accs[p].done.take():
                        yield p, b_ids, metrics
            if got >= need:  # the rest of these shards belongs to later parts
                break
    for p in (PREFILL, DECODE):
        accs[p].route_open()  # what the layout expected more rows of (a changed trace), as one process does
        for b_ids, metrics in accs[p].done.take():
            yield p, b_ids, metrics
    yield {p: _phase_sums(accs[p]) for p in (PREFILL, DECODE)}


def simulate_parts(ctx: _Ctx, lay: Layout, path: str, chunk_tokens: int, engine) -> SimResult:
    """Reduce step: find each micro-batch's owner (:func:`part_microbatches` on every range, then
    :func:`own_microbatches`), run :func:`simulate_part` over the ranges through ``engine`` and merge in range
    order: integer sums add, finished micro-batches are kept as their blocks arrive (the result sorts them by id).
    Nothing is routed here, and no token row travels between processes."""
    accs = {p: _PhaseAcc(ctx, lay, p) for p in (PREFILL, DECODE)}
    parts = plan_parts(path, TASKS_PER_WORKER * max(1, int(getattr(engine, "workers", 1))))
    per_shard = [s for out in engine.map(part_microbatches, parts, lay) for s in out]
    for _, piece in engine.map_pieces(simulate_part, own_microbatches(parts, lay, per_shard), ctx, lay, chunk_tokens):
        if not isinstance(piece, dict):
            p, ids, metrics = piece
            accs[p].done.append(ids, metrics)
            continue
        for p in (PREFILL, DECODE):
            st, acc = piece[p], accs[p]
            acc.tokens += st["tokens"]
            acc.pairs += st["pairs"]
            acc.local += st["local"]
            acc.node_local += st["node_local"]
            acc.load += st["load"]
            acc.sends["per_gpu"] += st["per_gpu"]
            if st["node_sends"] is not None:
                if acc.node_sends is None:
                    acc.node_sends = np.zeros_like(st["node_sends"])
                acc.node_sends += st["node_sends"]
    return _result(ctx, accs)


def route_load(expert_ids: np.ndarray, home: np.ndarray, microbatch: np.ndarray, phy2log: np.ndarray,
               cluster: Cluster, rule: str = DEFAULT_RULE, replica_costs: ReplicaCosts | None = None) -> np.ndarray:
    """int64 [L, W]: pairs each GPU computes when token rows are routed micro-batch by micro-batch by ``rule``.

    expert_ids: int [T, L, K]; home: int [T] home GPU; microbatch: int [T] micro-batch of each row (rows of one
    micro-batch are routed in row order); phy2log: int [L, P]. The same compiled routing as :func:`simulate`,
    for a planner that checks a candidate placement on array rows without building a trace.
    """
    _, loads, _ = _route_rows(expert_ids, home, microbatch, "decode", phy2log, cluster, CostConfig(hidden_size=1),
                              "", rule, None, replica_costs, bound=False)
    return loads.sum(0)
