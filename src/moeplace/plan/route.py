"""The deployable request -> rank function: a plan's grouper applied to one request's prefill expert counts.

Shape legend: T = token rows, L = MoE layers of the plan, L' = the grouper's feature layers (``layers``; all L when
None), K = top-k, E = logical experts, Lm = the engine's model layers (dense ones included), P = physical slots,
Rq = requests, N = nodes (decode instances), G = GPUs per node, W = N * G.

What a request is routed by: its **prefill expert counts**, float [L', E], how often its prompt tokens selected
each expert in each feature layer (all L when the grouper uses every layer). A decode-only trace's first
``prefix_tokens`` decode rows stand for the prompt (:func:`signal_rows`), as in the evaluation. Input adapters give
those counts from the capture hooks' rows or a trace (:func:`counts_from_rows`, :func:`counts_from_topk`), an SGLang
per-token dump record (:func:`counts_from_sglang`) and vLLM's ``routed_experts`` (:func:`counts_from_vllm`).

What a request is routed to, :class:`RouteDecision`: ``rank`` = the home GPU ``node * G + local`` in [0, W) (the
plan's GPU numbering: rank r sits on node r // G), ``node`` = r // G in [0, N), ``instance`` = ``node`` (when each
node is one decode instance of G GPUs that holds every expert, the instance to send the request to).

Admission (the grouper's rounds, :func:`moeplace.placement.grouper.assign_rounds`): requests are admitted in rounds
of ``round = ceil(round_size / W) * W`` (``round_size`` rounded up to a multiple of the GPU count,
:func:`moeplace.placement.grouper.admission_round`) in arrival order; in a round each node takes at most
``cap = round / N`` requests, exactly its share; inside a node the GPUs take turns. Two forms:

- :meth:`Router.route_batch` (a whole round or more at once): exactly ``assign_rounds``. Inside a round requests
  are placed in order of decreasing regret (best score minus second best), each on its best node with room. This
  is what the evaluation gives held-out requests (:func:`trace_homes`, called by
  :func:`moeplace.evaluate.windows.held_out_homes`) and what ``POST /route_batch`` answers.
- :meth:`Router.route` (one request at a time, stateful, for a router that must answer at once): per-node counters
  ``taken[n]`` and the request's position ``k`` in the current round; the request goes to its best-scoring node
  with ``taken[n] < cap`` (ties: the lowest node index), ``taken[n] += 1``, its GPU is ``n * G + next[n] % G``
  (``next[n] += 1``, kept across rounds); after ``round`` requests ``k`` and ``taken`` reset to 0. So every
  round of ``round`` consecutive requests gives each node at most ``cap`` of them (the same bound as the batch
  form), and the answer is a function of the arrival order alone. It equals the batch form whenever no node fills
  up inside a round; where one does, the batch form reorders the round by regret and the online form cannot.
"""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

from moeplace.placement import Grouper, Plan
from moeplace.placement.grouper import admission_round, assign_rounds
from moeplace.plan.base import request_expert_counts, workload_from_tokens
from moeplace.trace.types import Trace

GROUPER_FORMAT = "moeplace-grouper"  # the export's "format"
GROUPER_VERSION = 1  # the export's "version"; a reader refuses others
DEFAULT_HOST = "127.0.0.1"  # loopback: only this machine reaches the service unless --host says otherwise
DEFAULT_PORT = 8090
MAX_BODY_BYTES = 16 << 20  # largest POST body read (a 8k-token prompt's topk_ids over 58 layers x 8 is ~10 MB)
MAX_DRAIN_BYTES = 64 << 20  # an over-long body up to this size is read and dropped before the 413 answer
MAX_BATCH = 1 << 16  # requests in one POST /route_batch

NUMBERING = {
    "rank": "home GPU in [0, world_size): node * gpus_per_node + local GPU (the plan's GPU numbering; rank r is on "
            "node r // gpus_per_node)",
    "node": "rank // gpus_per_node, in [0, num_nodes): the grouper's column",
    "instance": "equal to node: with one decode instance per node (gpus_per_node GPUs holding every expert), the "
                "instance the request goes to",
}
FEATURE = ("prefill expert counts [len(layers) or num_moe_layers][num_experts] over the MoE layers in 'layers' "
           "(null: all), flattened layer-major, divided by their L2 norm; node n's score = feature . weights[n]")
ADMISSION = ("rounds of round = ceil(round_size / world_size) * world_size requests in arrival order; a node takes "
             "at most round / num_nodes per round (exactly its share of a full round); batch form: a round's "
             "requests by decreasing regret onto their best node with room "
             "(moeplace.placement.grouper.assign_rounds); online form: each request onto its best node with room, "
             "counters reset every round requests; inside a node GPUs take turns")


# ------------------------------------------------------------------------------------------ input adapters


def signal_rows(request_id: np.ndarray, phase: np.ndarray, prefix_tokens: int) -> np.ndarray:
    """bool [T]: prefill rows, or a request's first ``prefix_tokens`` rows when it has no prefill (the rows a
    request is routed by; the evaluation never scores them)."""
    w = workload_from_tokens(request_id, phase, np.zeros((len(request_id), 1, 1), np.int16), 1, prefix_tokens)
    return w.admission_rows


def signal_counts(request_ids: np.ndarray, token_request: np.ndarray, expert_ids: np.ndarray,
                  num_experts: int) -> np.ndarray:
    """float32 [Rq, L, E]: counts of the given signal rows per request, in the order of ``request_ids`` [Rq].

    token_request: int [T] request id of each row (each one of ``request_ids``); expert_ids: int [T, L, K]."""
    rid = np.asarray(request_ids)
    order = np.argsort(rid)
    idx = order[np.searchsorted(rid, np.asarray(token_request), sorter=order)]
    return request_expert_counts(idx, expert_ids, len(rid), num_experts)


def trace_counts(trace: Trace, signal: np.ndarray) -> np.ndarray:
    """float32 [Rq, L, E]: prefill counts of every request of ``trace`` in its request-table (arrival) order, from
    its rows flagged ``signal`` (bool [T], :func:`signal_rows`)."""
    tk = trace.tokens
    return signal_counts(trace.requests.request_id, tk.request_id[signal], tk.expert_ids[signal],
                         trace.meta.num_experts)


def counts_from_rows(request_id: np.ndarray, phase: np.ndarray, expert_ids: np.ndarray, num_experts: int,
                     prefix_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(request ids [Rq] in order of first row, float32 [Rq, L, E]) from token rows as the capture hooks write
    them (:class:`moeplace.trace.capture.CapturedBatch` ``.tokens``, or a trace's rows): request_id int [T],
    phase int [T] (0 prefill, 1 decode), expert_ids int [T, L, K] logical ids."""
    rid = np.asarray(request_id, np.int64)
    uniq, first = np.unique(rid, return_index=True)
    reqs = uniq[np.argsort(first, kind="stable")]
    m = signal_rows(rid, np.asarray(phase), prefix_tokens)
    return reqs, signal_counts(reqs, rid[m], np.asarray(expert_ids)[m], num_experts)


def counts_from_topk(topk_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """float32 [L, E]: one request's counts from its prompt tokens' logical expert ids, int [T, L, K]."""
    ids = check_ids(topk_ids, num_experts, "topk_ids", 3)
    return request_expert_counts(np.zeros(len(ids), np.int64), ids, 1, num_experts)[0]


def counts_from_sglang(topk_ids_of_layer: np.ndarray, physical_to_logical_map: np.ndarray,
                       moe_layer_map: list[int] | tuple[int, ...], top_k: int, num_experts: int) -> np.ndarray:
    """float32 [L, E]: one extend sequence's counts from SGLang's expert distribution recorder (``per_token``).

    topk_ids_of_layer: int [Lm, T, K8] physical slot ids of the sequence's T tokens (a record's columns of one
    sequence, split by ``extend_seq_lens``; -1 padding beyond ``top_k``); physical_to_logical_map: int [Lm, P]
    (the dump's ``last_physical_to_logical_map``); moe_layer_map: the model layer of each of the plan's L MoE
    layers (the trace's, recorded in the plan and the export). The mapping is the SGLang importer's
    (:func:`moeplace.trace.importers.sglang.logical_ids`), so the counts equal those of the imported trace."""
    from moeplace.trace.importers.sglang import logical_ids

    ids = np.asarray(topk_ids_of_layer)
    p2l = np.asarray(physical_to_logical_map)
    if ids.ndim != 3 or p2l.ndim != 2 or ids.shape[0] != p2l.shape[0]:
        raise ValueError(f"topk_ids_of_layer [{ids.shape}] and physical_to_logical_map [{p2l.shape}] must be "
                         "[Lm, T, k] and [Lm, P] over the same model layers")
    return counts_from_topk(logical_ids(ids, p2l, np.asarray(moe_layer_map, np.int64), int(top_k)), num_experts)


def counts_from_vllm(routed_experts: np.ndarray, prompt_len: int, num_experts: int,
                     moe_layer_map: list[int] | tuple[int, ...] | None = None, prompt_start: int = 0) -> np.ndarray:
    """float32 [L, E]: one request's counts from vLLM's ``routed_experts`` (``--enable-return-routed-experts``).

    routed_experts: int [N, Lm, K] logical ids of the tokens from prompt position ``prompt_start`` on (vLLM >= 0.32:
    ``routed_experts_prompt_start``, the first position not served from the prefix cache); the rows of positions
    below ``prompt_len`` are the prefill. moe_layer_map: the model layers of the plan's MoE layers (None: all Lm
    layers are MoE layers). As in the vLLM importer, prefix-cached positions have no routing and add nothing."""
    rows = np.asarray(routed_experts)
    if rows.ndim != 3:
        raise ValueError(f"routed_experts: expected [tokens, layers, k], got shape {list(rows.shape)}")
    if not 0 <= int(prompt_start) <= int(prompt_len):
        raise ValueError(f"prompt_start {prompt_start} is outside [0, prompt_len={prompt_len}]")
    pre = rows[: int(prompt_len) - int(prompt_start)]
    if moe_layer_map is not None:
        lm = np.asarray(moe_layer_map, np.int64)
        if lm.size and (lm.min() < 0 or lm.max() >= rows.shape[1]):
            raise ValueError(f"moe_layer_map {lm.tolist()} is outside the {rows.shape[1]} layers of routed_experts")
        pre = pre[:, lm, :]
    return counts_from_topk(pre, num_experts)


def npy_array(text: str, where: str) -> np.ndarray:
    """The array of a base64-encoded ``.npy`` (what vLLM's OpenAI server returns as ``routed_experts``), its header
    checked against the bytes present before anything is allocated; ValueError naming ``where`` otherwise."""
    import base64
    import binascii
    import io

    try:
        raw = base64.b64decode(text, validate=True)
        f = io.BytesIO(raw)
        version = np.lib.format.read_magic(f)
        shape, fortran, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                                 else np.lib.format.read_array_header_2_0(f))
        if dtype.hasobject or int(np.prod(shape, dtype=object)) * dtype.itemsize > len(raw) - f.tell():
            raise ValueError("the header claims more data than the string holds, or objects")
        f.seek(0)
        return np.load(f, allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError, TypeError) as e:
        raise ValueError(f"{where}: not a base64-encoded .npy array ({' '.join(str(e).split())})") from None


def check_ids(a: object, num_experts: int, where: str, ndim: int) -> np.ndarray:
    """int64 array of ``ndim`` dimensions with every id in [0, num_experts); ValueError naming ``where``."""
    try:
        arr = np.asarray(a)
    except (ValueError, RecursionError):
        raise ValueError(f"{where}: not a rectangular array") from None
    if arr.ndim != ndim:
        raise ValueError(f"{where}: expected {ndim} dimensions, got shape {list(arr.shape)}")
    if arr.size and arr.dtype.kind not in "iu":
        if arr.dtype.kind != "f" or not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise ValueError(f"{where}: expected integer expert ids")
    arr = arr.astype(np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= num_experts):
        bad = int(arr.min()) if arr.min() < 0 else int(arr.max())
        raise ValueError(f"{where}: expert id {bad} is outside [0, {num_experts})")
    return arr


# ------------------------------------------------------------------------------------------ the router


@dataclass(frozen=True)
class RouteDecision:
    """Where one request goes (numbering: :data:`NUMBERING`)."""

    rank: int  # home GPU in [0, W)
    node: int  # rank // G
    instance: int  # == node: the decode instance when each node is one

    def to_json(self) -> dict:
        return {"rank": self.rank, "node": self.node, "instance": self.instance}


class Router:
    """A grouper ready to route requests, from a plan (:meth:`from_plan`) or its export (:meth:`load`).

    ``route_batch`` is pure; ``route`` keeps the online admission state (module docstring) behind a lock, so one
    Router may serve several threads; the order in which calls take the lock is the arrival order."""

    def __init__(self, grouper: Grouper, num_experts: int, num_moe_layers: int,
                 moe_layer_map: tuple[int, ...] | None = None, num_decoder_layers: int | None = None,
                 strategy: str = "", planned_on: str = "") -> None:
        L, E = int(num_moe_layers), int(num_experts)
        layers = grouper.layers
        if layers is not None and (any(not 0 <= x < L for x in layers) or list(layers) != sorted(set(layers))):
            raise ValueError(f"grouper layers {list(layers)}: expected increasing MoE layers in [0, {L})")
        D = (L if layers is None else len(layers)) * E
        if grouper.weights.shape[1] != D:
            raise ValueError(f"grouper weights have {grouper.weights.shape[1]} columns, expected {D} (feature layers "
                             f"x {E} experts)")
        if moe_layer_map is not None and len(moe_layer_map) != L:
            raise ValueError(f"moe_layer_map has {len(moe_layer_map)} entries for {L} MoE layers")
        self.grouper = grouper
        self.num_experts, self.num_moe_layers = E, L
        self.moe_layer_map = None if moe_layer_map is None else tuple(int(x) for x in moe_layer_map)
        self.num_decoder_layers = num_decoder_layers
        self.strategy, self.planned_on = strategy, planned_on
        self.feature_layers = tuple(range(L)) if layers is None else tuple(layers)
        N, G = grouper.num_nodes, grouper.gpus_per_node
        self.round = admission_round(grouper.round_size, N * G)  # requests per round (a multiple of W)
        self.cap = self.round // N  # requests per node per round: exactly its share
        self._lock = threading.Lock()
        self.reset()

    # -- construction
    @classmethod
    def from_plan(cls, plan: Plan) -> Router:
        """The router of a plan's grouper; ValueError when the plan has none (it routes round-robin)."""
        if plan.grouper is None:
            raise ValueError(f"plan ({plan.strategy}) has no grouper: its requests go round-robin, there is nothing "
                             "to route by (plan with a grouping strategy such as activation-clusters)")
        ml = plan.model_layers
        return cls(plan.grouper, plan.placement.num_experts, plan.placement.num_layers,
                   None if ml is None else ml.moe_layer_map, None if ml is None else ml.num_decoder_layers,
                   plan.strategy, plan.planned_on)

    def fresh(self) -> Router:
        """The same router with a fresh online admission state (this one's is left as it is)."""
        return Router(self.grouper, self.num_experts, self.num_moe_layers, self.moe_layer_map,
                      self.num_decoder_layers, self.strategy, self.planned_on)

    @classmethod
    def from_export(cls, d: object, where: str = "grouper file") -> Router:
        """From the JSON :meth:`to_export` writes (``moeplace export --format grouper``), validated."""
        from moeplace import schema

        m = schema.validate(schema.GrouperExportJSON, d, where)
        try:
            g = Grouper(np.asarray(m.weights, np.float32).reshape(len(m.weights), -1), m.gpus_per_node,
                        m.round_size, m.kind, None if m.layers is None else tuple(m.layers))
            if g.num_nodes != m.num_nodes or m.world_size != m.num_nodes * m.gpus_per_node:
                raise ValueError(f"weights have {g.num_nodes} rows for num_nodes={m.num_nodes}, world_size="
                                 f"{m.world_size} (expected num_nodes * gpus_per_node)")
            if m.feature_size != g.weights.shape[1]:
                raise ValueError(f"feature_size={m.feature_size} but weights have {g.weights.shape[1]} columns")
            return cls(g, m.num_experts, m.num_moe_layers, None if m.moe_layer_map is None else tuple(m.moe_layer_map),
                       m.num_decoder_layers, m.strategy, m.planned_on)
        except ValueError as e:
            raise schema.SchemaError(f"{where}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> Router:
        """Read and validate a grouper export file."""
        from moeplace import schema

        return cls.from_export(schema.read_json_file(path, "grouper file"), str(path))

    def to_export(self) -> dict:
        """The self-contained grouper JSON (schema: :class:`moeplace.schema.GrouperExportJSON`)."""
        g = self.grouper
        return {
            "format": GROUPER_FORMAT, "version": GROUPER_VERSION,
            "strategy": self.strategy, "planned_on": self.planned_on, "kind": g.kind,
            "num_nodes": int(g.num_nodes), "gpus_per_node": int(g.gpus_per_node),
            "world_size": int(g.num_nodes * g.gpus_per_node), "round_size": int(g.round_size),
            "num_experts": self.num_experts, "num_moe_layers": self.num_moe_layers,
            "layers": None if g.layers is None else list(g.layers),
            "moe_layer_map": None if self.moe_layer_map is None else list(self.moe_layer_map),
            "num_decoder_layers": self.num_decoder_layers,
            "feature_size": int(g.weights.shape[1]),
            "feature": FEATURE, "admission": ADMISSION, "numbering": dict(NUMBERING),
            "weights": g.weights.tolist(),
        }

    # -- features
    @property
    def world_size(self) -> int:
        return self.grouper.num_nodes * self.grouper.gpus_per_node

    def feature_counts(self, counts: object, where: str = "prefill_expert_counts") -> np.ndarray:
        """float32 [Rq, L', E] from counts [Rq, L, E] or [Rq, L', E] (finite, >= 0)."""
        try:
            c = np.asarray(counts)
        except (ValueError, TypeError, RecursionError):
            raise ValueError(f"{where}: not a rectangular array of numbers") from None
        L, Lf, E = self.num_moe_layers, len(self.feature_layers), self.num_experts
        if c.dtype.kind not in "iuf" and c.size:
            raise ValueError(f"{where}: expected numbers, got {c.dtype.kind!r} values")
        if c.ndim != 3 or c.shape[2] != E or c.shape[1] not in (L, Lf):
            want = f"[{L}, {E}]" + ("" if L == Lf else f" or [{Lf}, {E}] (the grouper's layers)")
            raise ValueError(f"{where}: expected {want} per request, got shape {list(c.shape[1:])}")
        if c.shape[1] == L and Lf != L:
            c = c[:, list(self.feature_layers), :]
        c = c.astype(np.float32, copy=False)
        if not np.isfinite(c).all() or (c < 0).any():
            raise ValueError(f"{where}: counts must be finite and >= 0")
        return c

    def scores(self, counts: object) -> np.ndarray:
        """float32 [Rq, N]: each request's score for each node (:meth:`Grouper.node_scores` of its feature).
        counts: [Rq, L or L', E]."""
        c = self.feature_counts(counts)
        return self.grouper.node_scores(c.reshape(len(c), -1))

    def topk_counts(self, topk_ids: object) -> np.ndarray:
        """float32 [L or L', E]: one request's counts from its prompt tokens' logical ids [T, L or L', K]."""
        ids = check_ids(topk_ids, self.num_experts, "topk_ids", 3)
        if ids.shape[1] not in (self.num_moe_layers, len(self.feature_layers)):
            raise ValueError(f"topk_ids: expected [tokens, {self.num_moe_layers}, k] (or the grouper's "
                             f"{len(self.feature_layers)} layers), got shape {list(ids.shape)}")
        return counts_from_topk(ids, self.num_experts)

    def decision(self, rank: int) -> RouteDecision:
        n = int(rank) // self.grouper.gpus_per_node
        return RouteDecision(int(rank), n, n)

    # -- routing
    def route_batch(self, counts: object) -> np.ndarray:
        """int64 [Rq]: ranks of requests arriving in this order, admitted in rounds from a fresh start: exactly
        :func:`assign_rounds` (what the evaluation gives held-out requests). counts: [Rq, L or L', E]."""
        g = self.grouper
        return assign_rounds(self.scores(counts), g.gpus_per_node, g.round_size)

    def reset(self) -> None:
        """Forget the online admission state: the next request starts a round."""
        with self._lock:
            N = self.grouper.num_nodes
            self.admitted = 0  # requests routed by route() since the start (or reset)
            self.taken = np.zeros(N, np.int64)  # requests each node took in the current round
            self.next_gpu = np.zeros(N, np.int64)  # next GPU inside each node (round-robin across rounds)

    def route(self, counts: object) -> RouteDecision:
        """Route one request online (module docstring). counts: [L, E] or [L', E]."""
        s = self.scores([counts])[0]
        pref = np.argsort(-s, kind="stable")
        G = self.grouper.gpus_per_node
        with self._lock:
            n = int(next(x for x in pref if self.taken[x] < self.cap))
            rank = n * G + int(self.next_gpu[n] % G)
            self.taken[n] += 1
            self.next_gpu[n] += 1
            self.admitted += 1
            if self.admitted % self.round == 0:
                self.taken[:] = 0
        return self.decision(rank)

    @property
    def round_position(self) -> int:
        """Requests routed online in the current round."""
        return self.admitted % self.round


ADMISSIONS = ("batch", "online")  # Router.route_batch, or Router.route one request at a time from a fresh state


def trace_homes(router: Router, trace: Trace, signal: np.ndarray, admission: str = "batch") -> dict[int, int]:
    """{request id: rank} for every request of ``trace`` in its table (arrival) order, routed by its ``signal``
    rows: with :meth:`Router.route_batch` (``batch``, the evaluation's default) or one by one through
    :meth:`Router.route` of a fresh copy of ``router`` (``online``, what ``POST /route`` answers a new service)."""
    if admission not in ADMISSIONS:
        raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
    rid, tk = trace.requests.request_id, trace.tokens
    ids = tk.expert_ids[signal][:, list(router.feature_layers), :]  # only the feature layers are counted
    counts = signal_counts(rid, tk.request_id[signal], ids, trace.meta.num_experts)
    if admission == "batch":
        homes = router.route_batch(counts).tolist()
    else:
        fresh = router.fresh()
        homes = [fresh.route(c).rank for c in counts]
    return {int(r): int(h) for r, h in zip(rid.tolist(), homes, strict=True)}


# ------------------------------------------------------------------------------------------ HTTP service


INPUTS = ("prefill_expert_counts", "topk_ids", "routed_experts")  # what a request object may carry (one)


def request_counts(router: Router, body: object, where: str = "request") -> np.ndarray:
    """float [L or L', E] of one request object (docs/ROUTE.md): {"prefill_expert_counts": [layers][experts]},
    {"topk_ids": [tokens][layers][k]} (logical ids of the prompt tokens), or vLLM's output {"routed_experts": base64
    .npy or [rows][model layers][k], "prompt_len": P, "routed_experts_prompt_start": s (default 0)}."""
    if not isinstance(body, dict):
        raise ValueError(f"{where}: expected a JSON object with one of {', '.join(INPUTS)}")
    keys = set(INPUTS) & set(body)
    if len(keys) != 1:
        raise ValueError(f"{where}: give exactly one of prefill_expert_counts [layers][experts], topk_ids "
                         "[tokens][layers][k] or routed_experts (vLLM) with prompt_len")
    if "topk_ids" in body:
        return router.topk_counts(body["topk_ids"])
    if "prefill_expert_counts" in body:
        return router.feature_counts([body["prefill_expert_counts"]])[0]
    from moeplace.trace.importers.vllm import routing_array

    re_ = body["routed_experts"]
    rows = routing_array(npy_array(re_, f"{where}: routed_experts") if isinstance(re_, str) else re_,
                         f"{where}: routed_experts")
    p, s = body.get("prompt_len"), body.get("routed_experts_prompt_start", 0)
    for name, v in (("prompt_len", p), ("routed_experts_prompt_start", s)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{where}: {name} must be an integer >= 0 (vLLM's prompt length and "
                             f"routed_experts_prompt_start), got {v!r}")
    lm = router.moe_layer_map
    if lm is None and rows.shape[1] != router.num_moe_layers:
        raise ValueError(f"{where}: routed_experts has {rows.shape[1]} model layers, the plan {router.num_moe_layers} "
                         "MoE layers and no layer map (plan from a trace that records moe_layer_map)")
    return counts_from_vllm(rows, p, router.num_experts, lm, s)


class _RouteHandler(BaseHTTPRequestHandler):
    router: Router  # set on the subclass made by RouteServer
    max_body: int
    protocol_version = "HTTP/1.1"
    timeout = 30  # seconds a connection may stall (a client that claims a body and never sends it)

    def _send(self, code: int, obj: dict) -> None:
        body = (json.dumps(obj) + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        if code >= 400:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def _error(self, code: int, message: str) -> None:
        self._send(code, {"error": " ".join(str(message).split())})

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0]
        if path == "/health":
            r, g = self.router, self.router.grouper
            self._send(200, {"status": "ok", "format": GROUPER_FORMAT, "version": GROUPER_VERSION,
                             "num_nodes": g.num_nodes, "gpus_per_node": g.gpus_per_node, "round_size": g.round_size,
                             "num_experts": r.num_experts, "num_moe_layers": r.num_moe_layers,
                             "layers": list(r.feature_layers), "admitted": r.admitted,
                             "round_position": r.round_position})
        elif path in ("/route", "/route_batch"):
            self._error(405, f"{path} takes POST with a JSON body")
        else:
            self._error(404, "not found: POST /route, POST /route_batch or GET /health")

    def do_POST(self) -> None:  # noqa: N802
        from moeplace import schema

        path = self.path.split("?", 1)[0]
        if path not in ("/route", "/route_batch"):
            self._error(404, "not found: POST /route, POST /route_batch or GET /health")
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.strip().isdigit():
            self._error(411, "a Content-Length header is required")
            return
        n = int(length)
        if n > self.max_body:
            if n <= MAX_DRAIN_BYTES:  # read it away, so that the client sees the answer rather than a reset
                left = n
                while left > 0:
                    got = len(self.rfile.read(min(1 << 16, left)))
                    if not got:
                        break
                    left -= got
            self._error(413, f"body of {n} bytes is over the {self.max_body} accepted")
            return
        raw = self.rfile.read(n)
        try:
            body = schema.parse_json(raw, "body")
            if path == "/route":
                self._send(200, self.router.route(request_counts(self.router, body)).to_json())
                return
            reqs = body.get("requests") if isinstance(body, dict) else None
            if not isinstance(reqs, list) or not 0 < len(reqs) <= MAX_BATCH:
                raise ValueError(f"body: expected {{\"requests\": [1..{MAX_BATCH} request objects]}}")
            counts = [self.router.feature_counts(request_counts(self.router, q, f"requests[{i}]")[None])[0]
                      for i, q in enumerate(reqs)]  # each on the grouper's layers
            ranks = self.router.route_batch(np.stack(counts))
            self._send(200, {"decisions": [self.router.decision(r).to_json() for r in ranks.tolist()]})
        except (ValueError, MemoryError, RecursionError) as e:
            self._error(400, str(e) or type(e).__name__)
        except Exception as e:  # noqa: BLE001 - the service answers one line, never a traceback
            self._error(500, f"internal error ({type(e).__name__})")

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's signature)
        pass


class _Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class RouteServer:
    """``POST /route`` (one request, online admission), ``POST /route_batch`` (a batch from a fresh round, the
    evaluation's function) and ``GET /health`` on ``host``:``port`` (port 0: a free one), served in a daemon
    thread. ValueError naming --host / --port when it cannot listen there."""

    def __init__(self, router: Router, port: int = DEFAULT_PORT, host: str = DEFAULT_HOST,
                 max_body: int = MAX_BODY_BYTES) -> None:
        if not host:
            raise ValueError("--host: empty; give an address (0.0.0.0 or :: listens on every interface)")
        handler = type("RouteHandler", (_RouteHandler,), {"router": router, "max_body": int(max_body)})
        cls = _Server6 if ":" in host else ThreadingHTTPServer
        try:
            self.httpd = cls((host, port), handler)
        except (OSError, OverflowError, UnicodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise ValueError(f"--host {host} --port {port}: cannot listen there ({why})") from None
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="moeplace-route", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://[{self.host}]:{self.port}" if ":" in self.host else f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
