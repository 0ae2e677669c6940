"""Decode instances: a pool of decode workers that each hold every expert, each request decoded on one of them.

Shape legend: T = decode rows, L = MoE layers, K = top-k, E = experts, Rq = requests, I = instances, G = GPUs per
instance, S = steps of one instance.

The deployment shape of prefill-decode disaggregated serving (ELDR, arXiv 2607.00466): I instances x G GPUs; the
G GPUs of an instance split every expert's weights and work between them (tensor parallel inside the instance), so
an instance's decode step reads the weights of every distinct expert its batch activates, once. Each instance runs
continuous batching over the requests sent to it, in arrival order, with a running set of ``running`` requests
(:func:`moeplace.simulate.batching.window_microbatches`, the one batching rule). The MoE time of one step is, summed
over layers, the expert roofline of :func:`moeplace.simulate.kernels.expert.expert_seconds` on one GPU of the
instance: ``max(active * expert_bytes / G / hbm_bw, pairs * pair_seconds / G) + compute_overhead``, where active =
distinct experts the step's rows select in the layer and pairs = rows x K. Not modelled: attention, the
all-reduce inside the instance and the KV transfer (the same for any router at equal batch sizes), and waiting for
a free slot (instances run side by side; a router that overloads one shows as a longer busiest instance).

Routers compared on this shape (the bench ``bench/decode_instances.py`` takes their assignments from the
evaluation): the grouper's route, and :func:`least_loaded` (each request, when a slot frees, to the instance with
room that runs the fewest requests: the load-only rule of today's PD routers).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from moeplace.placement import Cluster
from moeplace.simulate.batching import window_microbatches
from moeplace.simulate.config import BatchConfig, CostConfig
from moeplace.simulate.cost import pair_flops_of, time_terms
from moeplace.simulate.kernels.expert import expert_seconds
from moeplace.trace.types import DECODE, Trace


@dataclass(frozen=True)
class InstancesResult:
    """Decode steps of every instance (steps of instance 0, then 1, ...)."""

    instance: np.ndarray  # int64 [sum S]: instance of each step
    step_seconds: np.ndarray  # float [sum S]: MoE time of the step, all layers
    active: np.ndarray  # float [sum S]: distinct active experts per layer, mean over layers
    tokens: np.ndarray  # int64 [sum S]: rows (running requests) of the step
    num_instances: int

    def busy_seconds(self) -> np.ndarray:
        """float [I]: each instance's MoE time over all its steps."""
        return np.bincount(self.instance, weights=self.step_seconds, minlength=self.num_instances)

    def to_json(self) -> dict:
        busy = self.busy_seconds()
        return {"steps": int(len(self.step_seconds)), "mean_step_seconds": float(self.step_seconds.mean()),
                "mean_active_experts": float(self.active.mean()), "mean_tokens_per_step": float(self.tokens.mean()),
                "busy_seconds": busy.tolist(), "busiest_seconds": float(busy.max())}


def least_loaded(lengths: np.ndarray, num_instances: int, running: int) -> np.ndarray:
    """int64 [Rq]: instance of each request in arrival order under least-loaded routing.

    Every request is queued at step 0 and served in order. A request starts at the first step at which some instance
    has a free slot in its running set, on the instance running the fewest requests at that step among those with
    room (ties: the lowest instance). lengths: int [Rq] decode steps of each request. Sequential by nature (a heap
    of finish steps per instance)."""
    if num_instances < 1 or running < 1:
        raise ValueError(f"least_loaded: num_instances and running must be >= 1, got {num_instances}, {running}")
    slots: list[list[int]] = [[] for _ in range(num_instances)]  # finish steps of each instance's running set
    out = np.zeros(len(lengths), np.int64)
    t = 0
    for r, n in enumerate(np.asarray(lengths, np.int64).tolist()):
        while True:
            for s in slots:
                while s and s[0] <= t:
                    heapq.heappop(s)
            room = [i for i, s in enumerate(slots) if len(s) < running]
            if room:
                break
            t = min(s[0] for s in slots)
        i = min(room, key=lambda j: (len(slots[j]), j))
        heapq.heappush(slots[i], t + max(n, 0))
        out[r] = i
    return out


def decode_lengths(trace: Trace) -> np.ndarray:
    """int64 [Rq]: decode rows of each request of ``trace``, in its table (arrival) order."""
    rid = trace.requests.request_id
    order = np.argsort(rid)
    dec = trace.tokens.phase == DECODE
    idx = order[np.searchsorted(rid, trace.tokens.request_id[dec], sorter=order)]
    return np.bincount(idx, minlength=len(rid)).astype(np.int64)


def simulate_instances(trace: Trace, instance: np.ndarray, num_instances: int, gpus_per_instance: int,
                       running: int, cost: CostConfig | None = None, cluster: Cluster | None = None
                       ) -> InstancesResult:
    """Decode of ``trace`` (its decode rows; request table = arrival order) on ``num_instances`` instances of
    ``gpus_per_instance`` GPUs, request i of the table on instance ``instance[i]`` (int [Rq]); module docstring.
    ``cluster`` gives the GPU's HBM rate, FLOP rate and kernel overhead (default: the simulator's defaults)."""
    cost = cost or CostConfig()
    gpu = cluster or Cluster(1, 1)
    meta = trace.meta
    hidden = cost.hidden_size or meta.hidden_size
    if not hidden:
        raise ValueError("decode instances: the expert size needs a hidden size (trace metadata or the cost model)")
    terms = time_terms(cost, hidden, meta.model)
    pair_s = pair_flops_of(cost, hidden, meta.model) / gpu.expert_flops
    G = int(gpus_per_instance)
    inst = np.asarray(instance, np.int64)
    rid = trace.requests.request_id
    if len(inst) != len(rid) or (len(inst) and (inst.min() < 0 or inst.max() >= num_instances)):
        raise ValueError(f"decode instances: need one instance in [0, {num_instances}) per request")
    tk = trace.tokens
    dec = np.flatnonzero(tk.phase == DECODE)
    order = np.argsort(rid)
    req = order[np.searchsorted(rid, tk.request_id[dec], sorter=order)]  # table index of each decode row
    srt = np.lexsort((tk.position[dec], req))  # rows of a request in generation order
    dec, req = dec[srt], req[srt]
    L, K, E = meta.num_layers, meta.top_k, meta.num_experts
    batching = BatchConfig(decode_running=int(running))
    parts = []
    for i in range(num_instances):
        mine = np.flatnonzero(inst == i)  # this instance's requests, in arrival order
        local = np.full(len(rid), -1, np.int64)
        local[mine] = np.arange(len(mine))
        rows = local[req] >= 0
        if not rows.any():
            continue
        step = window_microbatches(local[req[rows]], np.zeros(int(rows.sum()), bool), np.arange(len(mine)),
                                   batching)
        _, step = np.unique(step, return_inverse=True)
        S = int(step.max()) + 1
        ids = tk.expert_ids[dec[rows]].astype(np.int64)  # [T_i, L, K]
        key = (step[:, None, None] * L + np.arange(L)[None, :, None]) * E + ids
        sl = np.unique(key.ravel()) // E  # (step, layer) of every distinct (step, layer, expert)
        active = np.bincount(sl, minlength=S * L).reshape(S, L)
        ntok = np.bincount(step, minlength=S)
        flop = (ntok[:, None] * K * pair_s / G) * np.ones((1, L))
        t = expert_seconds(active / G, flop, active > 0, terms.expert_bytes, gpu)
        parts.append((np.full(S, i, np.int64), t.sum(1), active.mean(1), ntok))
    cat = [np.concatenate([p[j] for p in parts]) for j in range(4)]
    return InstancesResult(cat[0], cat[1], cat[2], cat[3].astype(np.int64), int(num_instances))
