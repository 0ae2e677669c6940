"""Replay a trace's routing through the expert-parallel layer in W processes and measure bytes and time.

Shape legend: T = tokens of one micro-batch (all ranks), L = MoE layers, K = top-k, E = logical experts,
P = physical slots, W = ranks, S = P / W slots per rank, H = hidden size, M = micro-batches, R = repeats.

The parent builds the micro-batches once (tokens, homes, routing and the serving slot of every (token, k) pair,
chosen by the replica rule the simulator uses), hands them to every rank, and each rank runs, for every
micro-batch and layer, its own tokens through :class:`~moeplace.run.layer.MoELayer` with a
:class:`~moeplace.run.dispatch.Dispatcher`. Bytes are what the dispatcher passed to ``all_to_all_single``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moeplace.placement import Plan
from moeplace.run.dispatch import Dispatcher, TrafficRecorder
from moeplace.run.layer import ExpertWeights, MoELayer, reference_moe

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


@dataclass(frozen=True)
class ReplayConfig:
    """How to replay: the layer's size and precision, and how often to repeat for timing."""

    hidden: int = 256  # H: hidden size of the emulated layer
    ffn: int | None = None  # expert intermediate size (None: = hidden)
    dtype: str = "float32"  # element type of hidden vectors; sets bytes per element
    two_hop: bool = False  # per-node dedup with intra-node forwarding (else per-GPU dedup)
    repeats: int = 3  # R: timed repetitions of every (micro-batch, layer)
    weights: str = "random"  # "random" experts, or "id" experts that encode their id (tests)
    seed: int = 0  # expert weights and token hidden vectors
    return_outputs: bool = False  # ranks return their outputs (tests compare them with the reference)
    timeout: float = 600.0  # seconds before the run is stopped

    def __post_init__(self) -> None:
        if self.hidden < 1:
            raise ValueError(f"replay: hidden must be >= 1, got {self.hidden}")
        if self.dtype not in DTYPES:
            raise ValueError(f"replay: dtype {self.dtype!r}: expected one of {sorted(DTYPES)}")
        if self.repeats < 1:
            raise ValueError(f"replay: repeats must be >= 1, got {self.repeats}")
        if self.weights not in ("random", "id"):
            raise ValueError(f"replay: weights {self.weights!r}: expected 'random' or 'id'")

    @property
    def bytes_per_element(self) -> int:
        return torch.tensor([], dtype=DTYPES[self.dtype]).element_size()


# ------------------------------------------------------------------------------------------------ replica choice


def _assign_slots_placeholder(expert_ids: np.ndarray, home: np.ndarray, phy2log: np.ndarray, slots_per_gpu: int,
                              gpus_per_node: int) -> np.ndarray:
    """Replica choice for one layer: same GPU, else same node, else the least-loaded replica (pairs so far).

    expert_ids: int [T, K]; home: int [T]; phy2log: int [P]. Returns int [T, K] slots.
    """
    T, K = expert_ids.shape
    load = np.zeros(len(phy2log), np.int64)
    slot_gpu = np.arange(len(phy2log)) // slots_per_gpu
    out = np.empty((T, K), np.int64)
    for t in range(T):
        for j in range(K):
            cand = np.flatnonzero(phy2log == expert_ids[t, j])
            same = cand[slot_gpu[cand] == home[t]]
            if not len(same):
                same = cand[slot_gpu[cand] // gpus_per_node == home[t] // gpus_per_node]
            pool = same if len(same) else cand
            p = pool[np.argmin(load[pool])]
            load[p] += 1
            out[t, j] = p
    return out


def assign_slots(expert_ids: np.ndarray, home: np.ndarray, plan: Plan, layer: int) -> np.ndarray:
    """Serving slot of every (token, k) pair of one layer: int [T, K] (the simulator's replica rule)."""
    pl = plan.placement
    return _assign_slots_placeholder(expert_ids, home, pl.phy2log[layer], pl.slots_per_gpu,
                                     plan.cluster.gpus_per_node)


def make_batch(plan: Plan, request_id: np.ndarray, expert_ids: np.ndarray,
               weights: np.ndarray | None = None) -> MicroBatch:
    """A micro-batch from token rows: request_id [T], expert_ids [T, L, K], weights [T, L, K] (None: 1/K)."""
    ids = np.asarray(expert_ids, np.int64)
    T, L, K = ids.shape
    w = np.full((T, L, K), 1.0 / K, np.float32) if weights is None else np.asarray(weights, np.float32)
    home = plan.home_of(request_id) if T else np.zeros(0, np.int64)
    slots = np.stack([assign_slots(ids[:, layer], home, plan, layer) for layer in range(L)], axis=1) if T else \
        np.zeros((0, L, K), np.int64)
    return MicroBatch(np.asarray(request_id, np.int64), home, ids, w, slots)


# ------------------------------------------------------------------------------------------------ rank side


def _hidden(cfg: ReplayConfig, batch_index: int, T: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + batch_index)
    return torch.randn(T, cfg.hidden, generator=g, dtype=torch.float32)  # [T, H]


def _experts(cfg: ReplayConfig, num_experts: int) -> ExpertWeights:
    if cfg.weights == "id":
        return ExpertWeights.id_encoding(num_experts, cfg.hidden, DTYPES[cfg.dtype])
    return ExpertWeights.random(num_experts, cfg.hidden, cfg.ffn, seed=cfg.seed, dtype=DTYPES[cfg.dtype])


def replay_rank(ctx, batches: list[MicroBatch], phy2log: np.ndarray, num_experts: int, gpus_per_node: int,
                cfg: ReplayConfig) -> dict[str, Any]:
    """One rank's replay (run by :func:`moeplace.run.launch.launch`).

    Returns ``seconds`` float [R, M, L] (this rank's layer time), ``bytes`` {stage: int64 [M, L, W]} sent by
    this rank per destination (stages dispatch, combine, meta, counts) and, if asked, ``outputs``: per batch
    (token indices [T_r], outputs [T_r, H] float32).
    """
    rank, W = ctx.rank, ctx.world_size
    device = torch.device(ctx.device)
    L, P = phy2log.shape
    S = P // W
    full = _experts(cfg, num_experts)
    layers = [MoELayer(full.select(phy2log[layer, rank * S:(rank + 1) * S]).to(device)) for layer in range(L)]
    recorder = TrafficRecorder(W)
    disp = Dispatcher(rank, W, gpus_per_node, S, two_hop=cfg.two_hop, recorder=recorder)
    M = len(batches)
    seconds = np.zeros((cfg.repeats, M, L))
    sent = {k: np.zeros((M, L, W), np.int64) for k in ("dispatch", "combine", "meta", "counts")}
    outputs = []
    dtype = DTYPES[cfg.dtype]
    for b, mb in enumerate(batches):
        mine = np.flatnonzero(mb.home == rank)
        x = _hidden(cfg, b, len(mb))[mine].to(dtype).to(device)  # [T_r, H]
        slots = torch.as_tensor(mb.slots[mine], device=device)  # [T_r, L, K]
        w = torch.as_tensor(mb.weights[mine], device=device)  # [T_r, L, K]
        outs = []
        for rep in range(cfg.repeats):
            for layer in range(L):
                dist.barrier()  # host waits for every rank: all start the layer together
                t0 = time.perf_counter()
                y = layers[layer].forward(x, slots[:, layer], w[:, layer], disp)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # host waits for the device before reading the clock
                seconds[rep, b, layer] = time.perf_counter() - t0
                got = recorder.take()
                if rep == 0:
                    for k in sent:
                        sent[k][b, layer] = got[k]
                    if cfg.return_outputs:
                        outs.append(y.float().cpu().numpy())
        if cfg.return_outputs:
            outputs.append((mine, np.stack(outs, axis=1) if outs else np.zeros((len(mine), L, cfg.hidden))))
    return {"seconds": seconds, "bytes": sent, "outputs": outputs if cfg.return_outputs else None}


# ------------------------------------------------------------------------------------------------ parent side


def reference_outputs(batch: MicroBatch, batch_index: int, num_experts: int, cfg: ReplayConfig) -> np.ndarray:
    """Single-process reference for one micro-batch: float32 [T, L, H] (same weights and inputs as the ranks)."""
    dtype = DTYPES[cfg.dtype]
    full = _experts(cfg, num_experts)
    x = _hidden(cfg, batch_index, len(batch)).to(dtype)
    L = batch.expert_ids.shape[1]
    return np.stack([reference_moe(full, x, torch.as_tensor(batch.expert_ids[:, layer]),
                                   torch.as_tensor(batch.weights[:, layer])).float().numpy()
                     for layer in range(L)], axis=1)


@dataclass
class ReplayResult:
    """What a replay measured. Byte matrices are [source rank, destination rank], self-sends on the diagonal."""

    dispatch_bytes: np.ndarray  # int64 [L, W, W] hidden-vector bytes of the dispatch, summed over micro-batches
    combine_bytes: np.ndarray  # int64 [L, W, W] hidden-vector bytes of the combine
    meta_bytes: np.ndarray  # int64 [L, W, W] routing metadata (slot ids, weights) sent beside the rows
    layer_seconds: np.ndarray  # float [R, M, L]: max over ranks of each layer's wall time
    gpus_per_node: int
    outputs: list | None = None  # per rank, as returned by replay_rank (tests)
    extra: dict = field(default_factory=dict)

    def pair_bytes(self) -> np.ndarray:
        """int64 [L, W, W]: dispatch + combine bytes per (source, destination)."""
        return self.dispatch_bytes + self.combine_bytes

    def split_bytes(self, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(inter-node, intra-node) totals of [L, W, W] byte matrices per layer -> int64 [L] each (self excluded)."""
        W = m.shape[-1]
        node = np.arange(W) // self.gpus_per_node
        inter = node[:, None] != node[None, :]
        intra = ~inter & ~np.eye(W, dtype=bool)
        return (m * inter).sum(axis=(1, 2)), (m * intra).sum(axis=(1, 2))


def replay(plan: Plan, batches: list[MicroBatch], cfg: ReplayConfig, *, netns: list[str | None] | None = None,
           master_addr: str = "127.0.0.1", socket_ifname: str | None = None, fail_rank: int | None = None,
           env: dict[str, str] | None = None) -> ReplayResult:
    """Run the micro-batches through the layer in W = plan.cluster.world_size processes and gather results."""
    from moeplace.run.launch import launch

    W = plan.cluster.world_size
    pl = plan.placement
    check_batches(plan, batches)
    res = launch("moeplace.run.replay:replay_rank", W,
                 dict(batches=batches, phy2log=pl.phy2log, num_experts=int(pl.num_experts),
                      gpus_per_node=plan.cluster.gpus_per_node, cfg=cfg),
                 netns=netns, master_addr=master_addr, socket_ifname=socket_ifname, timeout=cfg.timeout,
                 fail_rank=fail_rank, env=env)
    by = {k: np.stack([r["bytes"][k].sum(axis=0) for r in res], axis=1) for k in ("dispatch", "combine", "meta")}
    secs = np.max(np.stack([r["seconds"] for r in res]), axis=0)  # slowest rank per (repeat, batch, layer)
    return ReplayResult(by["dispatch"], by["combine"], by["meta"], secs, plan.cluster.gpus_per_node,
                        [r["outputs"] for r in res] if cfg.return_outputs else None,
                        {"config": asdict(cfg)})


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


def summarize(result: ReplayResult) -> dict[str, Any]:
    """JSON-ready report with the simulator's keys (``inter_node_bytes``, ``intra_node_bytes``)."""
    pair = result.pair_bytes()
    inter, intra = result.split_bytes(pair)
    d_inter, d_intra = result.split_bytes(result.dispatch_bytes)
    m_inter, m_intra = result.split_bytes(result.meta_bytes)
    per_mb = result.layer_seconds.sum(axis=1)  # [R, L] seconds per layer summed over micro-batches
    layer_med = np.median(per_mb, axis=0)  # [L]
    L = pair.shape[0]
    return {
        "per_layer": [
            {"layer": layer, "inter_node_bytes": int(inter[layer]), "intra_node_bytes": int(intra[layer]),
             "dispatch_inter_node_bytes": int(d_inter[layer]), "dispatch_intra_node_bytes": int(d_intra[layer]),
             "meta_inter_node_bytes": int(m_inter[layer]), "meta_intra_node_bytes": int(m_intra[layer]),
             "layer_seconds": float(layer_med[layer])}
            for layer in range(L)
        ],
        "total": {"inter_node_bytes": int(inter.sum()), "intra_node_bytes": int(intra.sum()),
                  "meta_inter_node_bytes": int(m_inter.sum()), "meta_intra_node_bytes": int(m_intra.sum()),
                  "layer_seconds": float(median(per_mb.sum(axis=1).tolist()))},
        "pair_bytes": pair.sum(axis=0).tolist(),  # [W][W] source -> destination, dispatch + combine
        "dispatch_pair_bytes": result.dispatch_bytes.sum(axis=0).tolist(),
        "combine_pair_bytes": result.combine_bytes.sum(axis=0).tolist(),
    }
