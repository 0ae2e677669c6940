"""What the simulator returns: per-phase exact counts (:class:`PhaseResult`) and the whole answer
(:class:`SimResult`), with their JSON.

Shape legend: B = micro-batches, L = MoE layers, W = GPUs.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from moeplace.io import atomic_write_json
from moeplace.placement import Cluster
from moeplace.simulate import routing
from moeplace.simulate.batching import BatchConfig
from moeplace.simulate.cost import CostConfig
from moeplace.simulate.kernels import KERNELS
from moeplace.simulate.mbstore import MicrobatchMetrics, reduce_layers, reduce_many
from moeplace.simulate.routing import DEDUP_MODES


def layer_time_per_microbatch_s(phase_json: dict | None) -> float | None:
    """Seconds of one MoE layer on one micro-batch (the kernel time model's layer time, mean over micro-batches and
    layers) from a PhaseResult JSON; None when the phase has no micro-batches. Every command prints this quantity
    in µs and stores it as ``layer_time_us_per_microbatch`` (docs/SIMULATOR.md, "Units")."""
    if not phase_json or not phase_json["num_microbatches"]:
        return None
    L = len(phase_json["balancedness"]["per_layer"])
    return phase_json["kernel_time"]["layer_time_s"]["total"] / (phase_json["num_microbatches"] * L) if L else None


def layer_time_us_per_microbatch(phases: dict[str, dict | None]) -> dict[str, float | None]:
    """``{phase: µs}`` of :func:`layer_time_per_microbatch_s` for each PhaseResult JSON of ``phases``."""
    out = {}
    for ph, j in phases.items():
        s = layer_time_per_microbatch_s(j)
        out[ph] = None if s is None else s * 1e6
    return out


class _Stats:
    """Statistics a result's JSON asks for, computed together in one pass (:func:`reduce_many`): :meth:`want` gives a
    placeholder, :meth:`fill` replaces every placeholder in a JSON tree by its statistics."""

    def __init__(self, pm: MicrobatchMetrics) -> None:
        self.pm, self.specs = pm, []

    def want(self, keys: tuple[str, ...], fn=None, how: str = "sum") -> _Want:
        self.specs.append((keys, fn, how))
        return _Want(len(self.specs) - 1, how)

    def row_median(self, keys: tuple[str, ...], fn, divide_by: float, empty: float) -> _Want:
        """The median over micro-batches of the sum over layers of ``fn(*keys)`` / ``divide_by``; ``empty`` without
        micro-batches."""
        w = self.want(keys, fn)
        w.row_divisor, w.empty = divide_by, empty
        return w

    def fill(self, tree: dict) -> dict:
        done = reduce_many(self.pm, self.specs)
        pm = self.pm

        def visit(x):
            if isinstance(x, dict):
                return {k: visit(v) for k, v in x.items()}
            if not isinstance(x, _Want):
                return x
            per_layer, median, row = done[x.index]
            if x.row_divisor is not None:
                return float(np.median(row / x.row_divisor)) if len(row) else x.empty
            if pm.num_microbatches == 0:
                return {"total": 0.0, "per_layer": [0.0] * pm.num_layers, "median_microbatch": 0.0,
                        "median_per_layer": [0.0] * pm.num_layers}
            total = float(per_layer.sum()) if x.how == "sum" else float(per_layer.max() if len(per_layer) else 0.0)
            return {"total": total, "per_layer": per_layer.tolist(),
                    "median_microbatch": float(np.median(row)) if len(per_layer) else 0.0,
                    "median_per_layer": median.tolist()}

        return visit(tree)


@dataclass
class _Want:
    index: int
    how: str
    row_divisor: float | None = None  # a median of per-micro-batch sums (row_median), not a statistic
    empty: float = 0.0


def _scaled(k: float):
    return lambda x: x * k


def _ratio(a: np.ndarray, b: np.ndarray, empty: float) -> np.ndarray:
    a = np.asarray(a, float)
    b = np.asarray(b, float)
    return np.divide(a, b, out=np.full(np.broadcast(a, b).shape, empty), where=b > 0)


@dataclass
class PhaseResult:
    """What one phase (prefill, decode, or both) cost. Integers are exact counts; bytes derive from them."""

    phase: str  # "prefill", "decode" or "all"
    num_tokens: int
    dispatch_send_bytes: float  # bytes per dispatch send
    combine_send_bytes: float  # bytes per combine send
    microbatch_ids: np.ndarray  # int64 [B] (phase-specific id spaces; "all" lists prefill then decode)
    pairs: np.ndarray  # int64 [L] token-expert pairs
    load: np.ndarray  # int64 [L, W] pairs computed by each GPU
    local_pairs: np.ndarray  # int64 [L] pairs served on the token's home GPU
    node_local_pairs: np.ndarray  # int64 [L] pairs served on the home GPU's node
    sends: dict  # mode ("per_gpu", "two_hop") -> int64 [L, W, W] sends source -> destination (diagonal: intra-GPU)
    # name -> [B, L] (see moeplace.simulate.cost.microbatch_metrics), in microbatch_ids order; a plain dict of arrays
    # is taken as it is (moeplace.simulate.mbstore.MicrobatchMetrics holds a replay's, spilled to files when large)
    per_microbatch: MicrobatchMetrics
    microbatch_tokens: np.ndarray | None = None  # int64 [B] tokens of each micro-batch (the layout's count)

    def __post_init__(self) -> None:
        if not isinstance(self.per_microbatch, MicrobatchMetrics):
            self.per_microbatch = MicrobatchMetrics.from_arrays(self.microbatch_ids, dict(self.per_microbatch),
                                                                len(self.pairs))

    def layer_times(self, key: str = "layer_time") -> np.ndarray:
        """float [B]: mean over layers of ``per_microbatch[key]`` (the layer time per micro-batch, seconds)."""
        pm = self.per_microbatch
        L = pm.num_layers
        return reduce_layers(pm, (key,))[2] / L if L else np.zeros(pm.num_microbatches)

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatch_ids)

    @property
    def send_bytes(self) -> float:
        """Bytes one send moves across its link, dispatch plus combine."""
        return self.dispatch_send_bytes + self.combine_send_bytes

    def bytes_per_microbatch(self, mode: str = "per_gpu", where: str = "inter_node") -> np.ndarray:
        """float [B, L] bytes of one link class ("intra_gpu", "intra_node", "inter_node") per micro-batch and layer."""
        if mode not in DEDUP_MODES:
            raise ValueError(f"dedup mode {mode!r}: expected one of {DEDUP_MODES}")
        return self.per_microbatch[f"{mode}.{where}_sends"] * self.send_bytes

    def byte_matrix(self, mode: str = "per_gpu") -> np.ndarray:
        """float [L, W, W] bytes from source GPU to destination GPU: dispatch sends plus returning combines."""
        X = self.sends[mode].astype(float)
        B = X * self.dispatch_send_bytes + np.swapaxes(X, -1, -2) * self.combine_send_bytes
        idx = np.arange(X.shape[-1])
        B[..., idx, idx] = 0.0
        return B

    @property
    def balancedness_per_layer(self) -> np.ndarray:
        """[L] mean_g / max_g of the phase's load (SGLang); 1 where a layer has no load."""
        return routing.balancedness(self.load)

    @property
    def imbalance_ratio_per_layer(self) -> np.ndarray:
        """[L] (max_g - mean_g) / mean_g (TensorRT-LLM); 0 where a layer has no load."""
        return routing.imbalance_ratio(self.load)

    def to_json(self) -> dict:
        pm = self.per_microbatch
        st = _Stats(pm)
        L = len(self.pairs)
        sb = self.send_bytes
        out: dict = {"num_tokens": int(self.num_tokens), "num_microbatches": self.num_microbatches,
                     "num_pairs": int(self.pairs.sum())}
        for mode in DEDUP_MODES:
            prefix = "" if mode == "per_gpu" else "two_hop_"
            for where in ("inter_node", "intra_node"):
                out[f"{prefix}{where}_bytes"] = st.want((f"{mode}.{where}_sends",), _scaled(sb))
            out[f"{prefix}sends"] = {w: st.want((f"{mode}.{w}_sends",))
                                     for w in ("intra_gpu", "intra_node", "inter_node")}
            out[f"{prefix}max_peer_message_bytes"] = st.want((f"{mode}.max_message_sends",),
                                                           _scaled(self.dispatch_send_bytes), "max")
            for key in ("", "_padded"):
                comm = f"{mode}.comm_time{key}"
                out[f"{prefix}comm_time{key}_s"] = st.want((comm,))
                out[f"{prefix}layer_time{key}_s"] = st.want((comm, "compute_time"), np.add)
            out[f"{prefix}traffic_matrix_bytes"] = self.byte_matrix(mode).sum(0).tolist()
        out["compute_time_s"] = st.want(("compute_time",))
        # the kernel time model (moeplace.simulate.cost): the chosen kernel's layer time, and every kernel's calls
        out["kernel_time"] = {f"{k}_s": st.want((k,)) for k in (
            "layer_time", "dispatch_time", "combine_time", "expert_time", "memory_time", "bound_balanced_time",
            "bound_local_time", "bound_reachable_time")}
        for k in KERNELS:
            out["kernel_time"][k] = {f"{part}_s": st.want((f"{k}.{part}",))
                                     for part in ("dispatch_time", "combine_time")}
        bal, imb = self.balancedness_per_layer, self.imbalance_ratio_per_layer
        W = self.load.shape[-1]
        per_mean = max(L, 1)  # the mean over layers of each micro-batch, then the median over micro-batches
        out["balancedness"] = {"total": float(bal.mean()) if L else 1.0, "per_layer": bal.tolist(),
                               "median_microbatch": st.row_median(
                                   ("pairs", "max_load"), lambda p, m: routing.balancedness_of(p, m, W), per_mean, 1.0)}
        out["imbalance_ratio"] = {"total": float(imb.mean()) if L else 0.0, "per_layer": imb.tolist(),
                                  "median_microbatch": st.row_median(
                                      ("pairs", "max_load"), lambda p, m: routing.imbalance_of(p, m, W), per_mean, 0.0)}
        out["local_activation_rate"] = {"total": float(_ratio(self.local_pairs.sum(), self.pairs.sum(), 0.0)),
                                        "per_layer": _ratio(self.local_pairs, self.pairs, 0.0).tolist()}
        out["node_local_rate"] = {"total": float(_ratio(self.node_local_pairs.sum(), self.pairs.sum(), 0.0)),
                                  "per_layer": _ratio(self.node_local_pairs, self.pairs, 0.0).tolist()}
        out["load_per_gpu"] = self.load.sum(0).tolist()
        return st.fill(out)


def merge_phases(a: PhaseResult, b: PhaseResult) -> PhaseResult:
    """Both phases as one (``SimResult.all``): counts added, micro-batches listed prefill then decode."""
    return PhaseResult(
        "all", a.num_tokens + b.num_tokens, a.dispatch_send_bytes, a.combine_send_bytes,
        np.concatenate([a.microbatch_ids, b.microbatch_ids]), a.pairs + b.pairs, a.load + b.load,
        a.local_pairs + b.local_pairs, a.node_local_pairs + b.node_local_pairs,
        {m: a.sends[m] + b.sends[m] for m in DEDUP_MODES},
        MicrobatchMetrics.concat(a.per_microbatch, b.per_microbatch),
        None if a.microbatch_tokens is None or b.microbatch_tokens is None
        else np.concatenate([a.microbatch_tokens, b.microbatch_tokens]),
    )


@dataclass
class SimResult:
    """The simulator's answer: prefill and decode apart, and both together (``all``)."""

    model: str
    synthetic: bool  # True when the trace is a generated workload
    trace_source: str
    cluster: Cluster
    rule: str
    plan_strategy: str
    cost: CostConfig
    batching: BatchConfig
    hidden_size: int
    pair_seconds: float
    prefill: PhaseResult
    decode: PhaseResult

    @property
    def all(self) -> PhaseResult:
        return merge_phases(self.prefill, self.decode)

    def to_json(self) -> dict:
        allp = self.all.to_json()
        pre, dec = self.prefill.to_json(), self.decode.to_json()
        head = {"model": self.model, "synthetic": self.synthetic, "trace_source": self.trace_source,
                "cluster": self.cluster.to_json(), "num_gpus": self.cluster.world_size, "rule": self.rule,
                "plan_strategy": self.plan_strategy, "cost": asdict(self.cost), "batching": asdict(self.batching),
                "hidden_size": self.hidden_size, "pair_seconds": self.pair_seconds,
                "layer_time_us_per_microbatch": layer_time_us_per_microbatch({"prefill": pre, "decode": dec})}
        return {**head, **allp, "prefill": pre, "decode": dec}

    def save_json(self, path: str | os.PathLike) -> Path:
        return atomic_write_json(self.to_json(), path)

