"""Replay a trace's routing through the expert-parallel layer in W processes and measure bytes and time.

Shape legend: T = tokens of one micro-batch (all ranks), L = MoE layers, K = top-k, E = logical experts,
P = physical slots, W = ranks, S = P / W slots per rank, H = hidden size, M = micro-batches, R = repeats.

The parent builds the micro-batches once (tokens, homes, routing and the serving slot of every (token, k) pair,
chosen by the replica rule the simulator uses), hands them to every rank, and each rank runs, for every
micro-batch and layer, its own tokens through :class:`~moeplace.run.layer.MoELayer` with a
:class:`~moeplace.run.dispatch.Dispatcher`. Bytes are what the dispatcher passed to ``all_to_all_single``.

Emulated compute (``ReplayConfig.emulate_compute``): each rank waits, in place of its expert math, the time the
simulator's kernel time model gives its own pairs in that micro-batch and layer (:func:`compute_seconds`: the
roofline of :func:`moeplace.simulate.kernels.expert_seconds` per rank), so W ranks on fewer cores do not compete for
them while the all-to-all stays real. Outputs, when asked for, then come from an untimed pass with real compute.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moeplace.placement import Cluster, Plan
from moeplace.run.dispatch import Dispatcher, TrafficRecorder
from moeplace.run.layer import ExpertView, ExpertWeights, MoELayer, reference_moe
from moeplace.run.options import DTYPE_BYTES, ReplayConfig  # noqa: F401  (re-exported)
from moeplace.simulate import (
    DEFAULT_RULE,
    BatchConfig,
    CostConfig,
    SimResult,
    build_layout,  # the simulator's own micro-batch layout, so the window is exactly its micro-batches
    link_counts,
    microbatch_ids,
    rows_of,
    simulate,
)
from moeplace.simulate import assign_slots as sim_assign_slots
from moeplace.simulate.cost import pair_flops_of, time_terms
from moeplace.simulate.kernels import expert_seconds
from moeplace.trace.types import PHASES, Trace

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
assert {k: torch.tensor([], dtype=v).element_size() for k, v in DTYPES.items()} == DTYPE_BYTES


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: the tokens that enter a MoE layer together, on all ranks."""

    request_id: np.ndarray  # int64 [T]
    home: np.ndarray  # int64 [T]: rank holding each token
    expert_ids: np.ndarray  # int64 [T, L, K]: logical experts, router order
    weights: np.ndarray  # float32 [T, L, K]: routing weights
    slots: np.ndarray  # int64 [T, L, K]: physical slot serving each (token, k) pair

    def __len__(self) -> int:
        return len(self.request_id)


# ------------------------------------------------------------------------------------------------ routing


def assign_slots(expert_ids: np.ndarray, home: np.ndarray, plan: Plan, layer: int,
                 rule: str = DEFAULT_RULE) -> np.ndarray:
    """Serving slot of every (token, k) pair of one layer: int [T, K], by the simulator's own replica rule
    (:func:`moeplace.simulate.assign_slots`), so the runtime routes exactly as the simulator counts.

    expert_ids: int [T, K] in micro-batch token order; home: int [T] home rank of each token.
    """
    pl = plan.placement
    node_of_gpu = np.arange(pl.num_gpus) // plan.cluster.gpus_per_node
    return sim_assign_slots(pl.phy2log[layer], pl.slot_gpu, node_of_gpu, home, expert_ids, rule=rule)


def make_batch(plan: Plan, request_id: np.ndarray, home: np.ndarray, expert_ids: np.ndarray,
               weights: np.ndarray | None = None, rule: str = DEFAULT_RULE) -> MicroBatch:
    """A micro-batch from token rows in micro-batch order: request_id [T], home [T] (rank of each token),
    expert_ids [T, L, K], weights [T, L, K] (None: 1/K). Serving slots come from the replica ``rule``."""
    ids = np.asarray(expert_ids, np.int64)
    T, L, K = ids.shape
    w = np.full((T, L, K), 1.0 / K, np.float32) if weights is None else np.asarray(weights, np.float32)
    home = np.asarray(home, np.int64)
    if home.shape != (T,):
        raise ValueError(f"make_batch: home has shape {home.shape}, expected [{T}]")
    slots = np.stack([assign_slots(ids[:, layer], home, plan, layer, rule) for layer in range(L)], axis=1) if T \
        else np.zeros((0, L, K), np.int64)
    return MicroBatch(np.asarray(request_id, np.int64), home, ids, w, slots)


def select_window(trace: Trace, plan: Plan, batching: BatchConfig, phase: str = "decode", num_microbatches: int = 8,
                  skip: int = 0) -> tuple[Trace, list[np.ndarray]]:
    """Pick ``num_microbatches`` whole micro-batches of one phase, as the simulator forms them (after ``skip``).

    Returns (sub-trace, rows): the sub-trace keeps the full request table (so homes and micro-batch ids are the
    ones the simulator gives the whole trace) and only the chosen tokens, in trace order; rows[b] is int64 [T_b]
    indices into the sub-trace's tokens of micro-batch b, in trace order (the simulator's token order).
    """
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r}: expected one of {PHASES}")
    if num_microbatches < 1 or skip < 0:
        raise ValueError(f"window: num_microbatches must be >= 1 and skip >= 0, got {num_microbatches}, {skip}")
    if trace.tokens is None:
        raise ValueError("run-ep needs a per-token trace, but this trace is counts-only")
    tk = trace.tokens
    lay = build_layout(trace, trace.requests, plan.home_of(trace.requests.request_id), batching)
    mb = microbatch_ids(lay, rows_of(lay, tk.request_id), tk.position, tk.phase)
    ph = PHASES.index(phase)
    ids = lay.mb_ids[ph]
    if len(ids) <= skip:
        raise ValueError(f"window: the trace has {len(ids)} {phase} micro-batches, none left after skipping {skip}")
    chosen = ids[skip:skip + num_microbatches]
    keep = np.flatnonzero((tk.phase == ph) & np.isin(mb, chosen))  # trace order
    sub = Trace(trace.meta, trace.requests, tk.select(keep), None)
    mb_sub = mb[keep]
    return sub, [np.flatnonzero(mb_sub == m) for m in chosen.tolist()]


def token_homes(sub: Trace, plan: Plan) -> np.ndarray:
    """int64 [T]: the plan's home of each token's request (``plan.home_of`` over the request table, in table
    order, as the simulator gives homes)."""
    home_table = plan.home_of(sub.requests.request_id)  # [R]
    order = np.argsort(sub.requests.request_id, kind="stable")
    return home_table[order][np.searchsorted(sub.requests.request_id[order], sub.tokens.request_id)]


def batches_from_window(sub: Trace, rows: list[np.ndarray], plan: Plan, rule: str = DEFAULT_RULE) -> list[MicroBatch]:
    """The micro-batches of :func:`select_window` with homes from the plan and slots from the replica rule."""
    tk = sub.tokens
    home = token_homes(sub, plan)  # [T] home rank of each token
    out = []
    for r in rows:
        w = None if tk.expert_weights is None else tk.expert_weights[r].astype(np.float32)
        out.append(make_batch(plan, tk.request_id[r], home[r], tk.expert_ids[r], w, rule))
    return out


def replay_cost(cfg: ReplayConfig) -> CostConfig:
    """The simulator's cost of the replayed layer: hidden ``cfg.hidden``, dispatch and combine elements of
    ``cfg.dtype``, ``4 H F`` FLOPs per pair (two GEMMs), expert weights of width F in ``cfg.dtype``, and the kernel
    the runtime's exchange resembles (``nccl``: one copy per GPU; ``deepep-normal`` for two-hop)."""
    b = cfg.bytes_per_element
    F = cfg.ffn or cfg.hidden
    return CostConfig(hidden_size=cfg.hidden, dispatch_bytes=b, combine_bytes=b, pair_flops=4.0 * cfg.hidden * F,
                      intermediate_size=F, weight_bytes=float(b), mode="deepep-normal" if cfg.two_hop else "nccl")


def predict(sub: Trace, plan: Plan, cfg: ReplayConfig, batching: BatchConfig, rule: str = DEFAULT_RULE,
            cluster: Cluster | None = None) -> SimResult:
    """The simulator on the same window, hidden size and bytes per element as the replay (:func:`replay_cost`);
    ``cluster`` (same shape as the plan's) sets the links, FLOP rate and HBM bandwidth of its time model.
    ``kernel_time.expert_time_s`` of the result is what emulated compute waits (max over ranks)."""
    if cluster is not None:
        plan = dataclasses.replace(plan, cluster=cluster)
    return simulate(sub, plan, cost=replay_cost(cfg), batching=batching, rule=rule)


def compute_seconds(plan: Plan, batches: list[MicroBatch], cfg: ReplayConfig,
                    cluster: Cluster | None = None) -> np.ndarray:
    """float [M, L, W]: the kernel time model's expert compute of each rank's own pairs per micro-batch and layer,
    ``max(active_g * expert_bytes / hbm_bw, pairs_g * pair_flops / expert_flops) + compute_overhead`` (0 for a
    rank without pairs), with :func:`replay_cost`'s constants and ``cluster``'s rates (None: the plan's).
    ``active_g``: distinct logical experts with pairs on rank g, as the simulator counts them; its max over ranks
    is the simulator's ``expert_time`` for the same micro-batch."""
    cl = cluster or plan.cluster
    W = cl.world_size
    S = plan.placement.num_slots // W
    E = int(plan.placement.num_experts)
    cost = replay_cost(cfg)
    expert_bytes = time_terms(cost, cfg.hidden, "").expert_bytes
    pair_seconds = pair_flops_of(cost, cfg.hidden, "") / cl.expert_flops
    L = plan.placement.num_layers
    out = np.zeros((len(batches), L, W))
    for b, mb in enumerate(batches):
        for layer in range(L):
            gpu = (mb.slots[:, layer] // S).ravel()  # [T*K] rank serving each pair
            pairs = np.bincount(gpu, minlength=W)  # [W]
            active = np.bincount(np.unique(gpu * E + mb.expert_ids[:, layer].ravel()) // E, minlength=W)  # [W]
            out[b, layer] = expert_seconds(active, pairs * pair_seconds, pairs > 0, expert_bytes, cl)
    return out


# ------------------------------------------------------------------------------------------------ rank side


def token_hidden(cfg: ReplayConfig, batch_index: int, T: int) -> torch.Tensor:
    """float32 [T, H]: the hidden vectors of micro-batch ``batch_index`` (the same in every process)."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + batch_index)
    return torch.randn(T, cfg.hidden, generator=g, dtype=torch.float32)  # [T, H]


def expert_table(cfg: ReplayConfig, num_experts: int) -> ExpertWeights:
    """The E experts every rank and the reference use (``cfg.weights``: random, or id-encoding)."""
    if cfg.weights == "id":
        return ExpertWeights.id_encoding(num_experts, cfg.hidden, DTYPES[cfg.dtype])
    return ExpertWeights.random(num_experts, cfg.hidden, cfg.ffn, seed=cfg.seed, dtype=DTYPES[cfg.dtype])


def replay_rank(ctx, cases: list[tuple[np.ndarray, list[MicroBatch], np.ndarray | None]], num_experts: int,
                gpus_per_node: int, cfg: ReplayConfig) -> list[dict[str, Any]]:
    """One rank's replay of one or more cases (placement ``phy2log`` int [L, P], its micro-batches, and with
    emulated compute the seconds float [M, L, W] each rank waits in place of its experts), run by
    :func:`moeplace.run.launch.launch`. Repeats are interleaved across cases (repeat -> case -> micro-batch ->
    layer), so slow phases of a shared machine hit every case alike. With emulated compute and
    ``cfg.return_outputs``, outputs come from one untimed pass with real compute before the timed repeats.

    Returns per case: ``seconds`` float [R, M, L] (this rank's layer time), ``bytes`` {stage: int64 [M, L, W]}
    sent by this rank per destination (stages dispatch, combine, meta, counts) and, if asked, ``outputs``: per
    micro-batch (token indices [T_r], outputs [T_r, L, H] float32).
    """
    rank, W = ctx.rank, ctx.world_size
    device = torch.device(ctx.device)
    dtype = DTYPES[cfg.dtype]
    full = expert_table(cfg, num_experts).to(device)  # one weight table shared by every layer and case
    recorder = TrafficRecorder(W)
    state = []
    for phy2log, batches, wait in cases:
        L, P = phy2log.shape
        S = P // W
        layers = [MoELayer(ExpertView(full, tuple(int(e) for e in phy2log[layer, rank * S:(rank + 1) * S])))
                  for layer in range(L)]
        inputs = []
        for b, mb in enumerate(batches):
            mine = np.flatnonzero(mb.home == rank)
            inputs.append((mine, token_hidden(cfg, b, len(mb))[mine].to(dtype).to(device),  # [T_r, H]
                           torch.as_tensor(mb.slots[mine], device=device),  # [T_r, L, K]
                           torch.as_tensor(mb.weights[mine], device=device)))  # [T_r, L, K]
        M = len(batches)
        state.append(dict(layers=layers, inputs=inputs,
                          disp=Dispatcher(rank, W, gpus_per_node, S, two_hop=cfg.two_hop, recorder=recorder),
                          seconds=np.zeros((cfg.repeats, M, L)),
                          sent={k: np.zeros((M, L, W), np.int64) for k in ("dispatch", "combine", "meta", "counts")},
                          outs=[[None] * L for _ in range(M)],
                          wait=None if wait is None else np.asarray(wait)[:, :, rank]))  # [M, L] this rank's wait
    emulated = cfg.emulate_compute
    if emulated and cfg.return_outputs:  # untimed pass with real compute: the outputs to check
        for st in state:
            for b, (_, x, slots, w) in enumerate(st["inputs"]):
                for layer, moe in enumerate(st["layers"]):
                    y = moe.forward(x, slots[:, layer], w[:, layer], st["disp"])
                    st["outs"][b][layer] = y.float().cpu().numpy()
                    recorder.take()
    for rep in range(cfg.repeats):
        for st in state:
            for b, (_, x, slots, w) in enumerate(st["inputs"]):
                for layer, moe in enumerate(st["layers"]):
                    wait_s = float(st["wait"][b, layer]) if emulated else None
                    dist.barrier()  # host waits for every rank: all start the layer together
                    t0 = time.perf_counter()
                    y = moe.forward(x, slots[:, layer], w[:, layer], st["disp"], wait_s)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)  # host waits for the device before reading the clock
                    st["seconds"][rep, b, layer] = time.perf_counter() - t0
                    got = recorder.take()
                    if rep == 0:
                        for k in st["sent"]:
                            st["sent"][k][b, layer] = got[k]
                        if cfg.return_outputs and not emulated:
                            st["outs"][b][layer] = y.float().cpu().numpy()
    out = []
    for st in state:
        outputs = None
        if cfg.return_outputs:
            outputs = [(inp[0], np.stack(o, axis=1) if o else np.zeros((len(inp[0]), 0, cfg.hidden), np.float32))
                       for inp, o in zip(st["inputs"], st["outs"], strict=True)]
        out.append({"seconds": st["seconds"], "bytes": st["sent"], "outputs": outputs})
    return out


# ------------------------------------------------------------------------------------------------ parent side


def reference_outputs(batch: MicroBatch, batch_index: int, num_experts: int, cfg: ReplayConfig) -> np.ndarray:
    """Single-process reference for one micro-batch: float32 [T, L, H] (same weights and inputs as the ranks)."""
    dtype = DTYPES[cfg.dtype]
    full = expert_table(cfg, num_experts)
    x = token_hidden(cfg, batch_index, len(batch)).to(dtype)
    L = batch.expert_ids.shape[1]
    return np.stack([reference_moe(full, x, torch.as_tensor(batch.expert_ids[:, layer]),
                                   torch.as_tensor(batch.weights[:, layer])).float().numpy()
                     for layer in range(L)], axis=1)


@dataclass
class ReplayResult:
    """What a replay measured. Byte matrices are [source rank, destination rank], self-sends on the diagonal."""

    dispatch_bytes: np.ndarray  # int64 [M, L, W, W] hidden-vector bytes handed to all_to_all_single by dispatch
    combine_bytes: np.ndarray  # int64 [M, L, W, W] hidden-vector bytes handed to all_to_all_single by combine
    meta_bytes: np.ndarray  # int64 [M, L, W, W] routing metadata (slot ids, weights) sent beside the rows
    layer_seconds: np.ndarray  # float [R, M, L]: slowest rank's wall time of each layer
    gpus_per_node: int
    two_hop: bool
    outputs: list | None = None  # per rank, as returned by replay_rank (tests)
    compute_seconds: np.ndarray | None = None  # float [M, L, W] emulated compute each rank waited (None: real)

    def pair_bytes(self) -> np.ndarray:
        """int64 [M, L, W, W]: dispatch + combine bytes per (source, destination)."""
        return self.dispatch_bytes + self.combine_bytes

    def link_bytes(self, m: np.ndarray) -> dict[str, np.ndarray]:
        """Byte matrices [..., W, W] summed per link class -> {"intra_gpu", "intra_node", "inter_node"}: [...]."""
        c = link_counts(m, self.gpus_per_node)  # the simulator's own link-class split
        return {"intra_gpu": c[..., 0], "intra_node": c[..., 1], "inter_node": c[..., 2]}


def replay(plan: Plan, batches: list[MicroBatch], cfg: ReplayConfig, **launch_kw) -> ReplayResult:
    """Run the micro-batches through the layer in W = plan.cluster.world_size processes and gather results.
    ``launch_kw``: netns, master_addr, socket_ifname, fail_rank, env, compute_cluster (see :func:`replay_cases`)."""
    return replay_cases([(plan, batches)], cfg, **launch_kw)[0]


def replay_cases(cases: list[tuple[Plan, list[MicroBatch]]], cfg: ReplayConfig, *,
                 netns: list[str | None] | None = None, master_addr: str = "127.0.0.1",
                 socket_ifname: str | None = None, fail_rank: int | None = None,
                 env: dict[str, str] | None = None, compute_cluster: Cluster | None = None) -> list[ReplayResult]:
    """Several plans (same cluster, same experts) measured in one run, repeats interleaved; one result each.

    netns / master_addr / socket_ifname: where ranks run (``EmulatedCluster.launch_kwargs()``); fail_rank: test
    hook, that rank dies after joining; env: extra environment for the ranks; compute_cluster: with
    ``cfg.emulate_compute``, the FLOP rate, HBM bandwidth and overhead of :func:`compute_seconds` (None: each plan's
    cluster).
    """
    from moeplace.run.launch import launch

    if not cases:
        raise ValueError("replay: no cases to run")
    cluster = cases[0][0].cluster
    E = int(cases[0][0].placement.num_experts)
    for plan, batches in cases:
        if plan.cluster.spec() != cluster.spec() or int(plan.placement.num_experts) != E:
            raise ValueError(f"replay: plan {plan.strategy!r} is for {plan.cluster.spec()} / E="
                             f"{plan.placement.num_experts}, the first for {cluster.spec()} / E={E}")
        check_batches(plan, batches)
    W = cluster.world_size
    waits = [compute_seconds(p, b, cfg, compute_cluster) if cfg.emulate_compute else None for p, b in cases]
    res = launch("moeplace.run.replay:replay_rank", W,
                 dict(cases=[(p.placement.phy2log, b, wt) for (p, b), wt in zip(cases, waits, strict=True)],
                      num_experts=E,
                      gpus_per_node=cluster.gpus_per_node, cfg=cfg),
                 netns=netns, master_addr=master_addr, socket_ifname=socket_ifname, timeout=cfg.timeout,
                 fail_rank=fail_rank, env=env)
    out = []
    for c in range(len(cases)):
        per_rank = [r[c] for r in res]
        # each rank reports [M, L, W] bytes it sent per destination: stack along the source axis -> [M, L, W, W]
        by = {k: np.stack([r["bytes"][k] for r in per_rank], axis=2) for k in ("dispatch", "combine", "meta")}
        secs = np.max(np.stack([r["seconds"] for r in per_rank]), axis=0)  # slowest rank per (rep, batch, layer)
        out.append(ReplayResult(by["dispatch"], by["combine"], by["meta"], secs, cluster.gpus_per_node,
                                cfg.two_hop, [r["outputs"] for r in per_rank] if cfg.return_outputs else None,
                                waits[c]))
    return out


def check_batches(plan: Plan, batches: list[MicroBatch]) -> None:
    """Raise ValueError unless every micro-batch fits the plan (layers, experts, slots, homes)."""
    pl = plan.placement
    W = plan.cluster.world_size
    for b, mb in enumerate(batches):
        T, L, K = mb.expert_ids.shape
        if L != pl.num_layers:
            raise ValueError(f"micro-batch {b}: {L} MoE layers but the plan places {pl.num_layers}")
        if mb.slots.shape != mb.expert_ids.shape or mb.weights.shape != mb.expert_ids.shape:
            raise ValueError(f"micro-batch {b}: slots {mb.slots.shape} / weights {mb.weights.shape} do not match "
                             f"expert_ids {mb.expert_ids.shape}")
        if T and (mb.expert_ids.max() >= pl.num_experts or mb.expert_ids.min() < 0):
            raise ValueError(f"micro-batch {b}: expert id {int(mb.expert_ids.max())} outside the plan's "
                             f"{pl.num_experts} experts")
        if T and (mb.home.min() < 0 or mb.home.max() >= W):
            raise ValueError(f"micro-batch {b}: home rank {int(mb.home.max())} outside [0, {W})")
        if T:
            served = pl.phy2log[np.arange(L)[None, :, None], mb.slots]
            if (served != mb.expert_ids).any():
                raise ValueError(f"micro-batch {b}: a slot does not hold the expert it is asked to serve")


def stat_of(x: np.ndarray) -> dict:
    """x: [M, L] per micro-batch and layer -> the simulator's statistic layout (total, per layer, median
    micro-batch)."""
    if x.shape[0] == 0:
        return {"total": 0, "per_layer": [0] * x.shape[1], "median_microbatch": 0}
    cast = int if x.dtype.kind in "iu" else float
    return {"total": cast(x.sum()), "per_layer": [cast(v) for v in x.sum(0)],
            "median_microbatch": float(np.median(x.sum(1)))}


def time_stat(x: np.ndarray) -> dict:
    """x: float [R, M, L] seconds per repeat, micro-batch and layer -> medians over repeats of the total, of each
    layer (summed over micro-batches) and of the median micro-batch (summed over layers), and the repeat count."""
    per_layer, per_mb = x.sum(axis=1), x.sum(axis=2)  # [R, L], [R, M]
    return {"total": float(np.median(per_layer.sum(1))), "per_layer": np.median(per_layer, axis=0).tolist(),
            "median_microbatch": float(np.median(np.median(per_mb, axis=0))), "repeats": int(x.shape[0])}


def summarize(result: ReplayResult) -> dict[str, Any]:
    """JSON-ready measurements under the simulator's keys (``inter_node_bytes``, ``intra_node_bytes``, each with
    ``total``, ``per_layer``, ``median_microbatch``), whichever dedup mode ran (``dedup`` says which)."""
    pair = result.link_bytes(result.pair_bytes())
    disp = result.link_bytes(result.dispatch_bytes)
    meta = result.link_bytes(result.meta_bytes)
    return {
        "dedup": "two_hop" if result.two_hop else "per_gpu",
        "inter_node_bytes": stat_of(pair["inter_node"]),
        "intra_node_bytes": stat_of(pair["intra_node"]),
        "intra_gpu_bytes": stat_of(pair["intra_gpu"]),
        "dispatch_inter_node_bytes": stat_of(disp["inter_node"]),
        "dispatch_intra_node_bytes": stat_of(disp["intra_node"]),
        "meta_inter_node_bytes": stat_of(meta["inter_node"]),
        "meta_intra_node_bytes": stat_of(meta["intra_node"]),
        "layer_time_s": time_stat(result.layer_seconds),  # medians over repeats of the slowest rank's wall time
        # [W][W] source -> destination, summed over micro-batches and layers
        "traffic_matrix_bytes": result.pair_bytes().sum((0, 1)).tolist(),
        "dispatch_matrix_bytes": result.dispatch_bytes.sum((0, 1)).tolist(),
        "combine_matrix_bytes": result.combine_bytes.sum((0, 1)).tolist(),
        "num_microbatches": int(result.dispatch_bytes.shape[0]),
        # emulated compute: the slowest rank's wait per (micro-batch, layer), summed (None: experts really ran)
        "emulated_compute_s": None if result.compute_seconds is None else stat_of(result.compute_seconds.max(-1)),
    }
