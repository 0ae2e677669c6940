"""The MoE layer math: routed experts run grouped per slot, outputs summed with the routing weights.

Shape legend: T = tokens, H = hidden size, F = expert intermediate size, E = logical experts, K = top-k,
S = slots on this GPU, N = rows received by this GPU (one per token and destination), M = (row, slot) pairs.

The layer knows nothing of placement or processes: a dispatcher (``moeplace.run.dispatch``) hands it rows of
hidden vectors with, per row, up to K local slot indices and routing weights; the layer returns one partial sum
per row, ``sum_j w[row, j] * expert(slot[row, j])(x[row])``, and the dispatcher sends it back. Applying the
weights where the experts run keeps the combine at one vector per (token, GPU), the count MODEL.md charges.

With ``compute_seconds`` (emulated compute, ``run-ep --emulate-compute``) the layer sleeps that long instead of
running its experts and returns zero partial sums: the received rows and the combine's bytes are unchanged, only
the expert math is replaced by a wait that costs no CPU, so ranks sharing few cores do not slow each other down.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

ACTIVATIONS = ("silu", "gelu", "identity")


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return torch.nn.functional.silu(x)
    if name == "gelu":
        return torch.nn.functional.gelu(x)
    return x


@dataclass(frozen=True)
class ExpertWeights:
    """Weights of a set of experts: ``y = act(x @ w_in[e]) @ w_out[e] + bias[e]``.

    Index 0..n-1 of the tensors is whatever the holder calls an expert: logical experts for the full model,
    local slots for one GPU (see :meth:`select`).
    """

    w_in: torch.Tensor  # [n, H, F]
    w_out: torch.Tensor  # [n, F, H]
    bias: torch.Tensor  # [n, H]
    activation: str = "silu"  # one of ACTIVATIONS

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"expert activation {self.activation!r}: expected one of {ACTIVATIONS}")
        n, H, F = self.w_in.shape
        if self.w_out.shape != (n, F, H) or self.bias.shape != (n, H):
            raise ValueError(f"expert weights: w_in {tuple(self.w_in.shape)}, w_out {tuple(self.w_out.shape)} and "
                             f"bias {tuple(self.bias.shape)} disagree (expected [n,H,F], [n,F,H], [n,H])")

    @property
    def num(self) -> int:
        return self.w_in.shape[0]

    @property
    def hidden(self) -> int:
        """H."""
        return self.w_in.shape[1]

    @classmethod
    def random(cls, num_experts: int, hidden: int, ffn: int | None = None, seed: int = 0,
               dtype: torch.dtype = torch.float32, activation: str = "silu") -> ExpertWeights:
        """Deterministic random experts (same ``seed`` -> same weights in every process)."""
        F = hidden if ffn is None else ffn
        g = torch.Generator().manual_seed(seed)
        w_in = torch.randn(num_experts, hidden, F, generator=g, dtype=torch.float32) / hidden ** 0.5
        w_out = torch.randn(num_experts, F, hidden, generator=g, dtype=torch.float32) / F ** 0.5
        bias = torch.randn(num_experts, hidden, generator=g, dtype=torch.float32) * 0.01
        return cls(w_in.to(dtype), w_out.to(dtype), bias.to(dtype), activation)

    @classmethod
    def id_encoding(cls, num_experts: int, hidden: int, dtype: torch.dtype = torch.float32) -> ExpertWeights:
        """Experts that encode their id, so a wrong route shows as a wrong number:
        expert ``e`` computes ``(e + 1) * x + e * onehot(e % H)``."""
        eye = torch.eye(hidden, dtype=dtype)
        scale = torch.arange(1, num_experts + 1, dtype=dtype)[:, None, None]
        w_in = eye.expand(num_experts, hidden, hidden) * scale  # [E, H, H]
        w_out = eye.expand(num_experts, hidden, hidden).clone()
        bias = torch.zeros(num_experts, hidden, dtype=dtype)
        bias[torch.arange(num_experts), torch.arange(num_experts) % hidden] = torch.arange(num_experts, dtype=dtype)
        return cls(w_in.contiguous(), w_out, bias, "identity")

    def select(self, ids: np.ndarray | list[int]) -> ExpertWeights:
        """The experts ``ids`` in that order, e.g. ``phy2log[l, g*S:(g+1)*S]``: the S slots GPU g holds."""
        idx = torch.as_tensor(np.asarray(ids, dtype=np.int64))
        return ExpertWeights(self.w_in[idx], self.w_out[idx], self.bias[idx], self.activation)

    def to(self, device: torch.device | str) -> ExpertWeights:
        return ExpertWeights(self.w_in.to(device), self.w_out.to(device), self.bias.to(device), self.activation)

    def apply(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``i`` on rows ``x`` [n, H] -> [n, H]."""
        return _act(self.activation, x @ self.w_in[i]) @ self.w_out[i] + self.bias[i]


@dataclass(frozen=True)
class ExpertView:
    """Experts ``ids`` of a shared :class:`ExpertWeights`, without copying: index i runs ``base`` expert ids[i].

    Lets many layers (or many placements) share one weight table, e.g. local slots ``phy2log[l, g*S:(g+1)*S]``.
    """

    base: ExpertWeights
    ids: tuple[int, ...]  # [n] index into base of each expert of the view

    @property
    def num(self) -> int:
        return len(self.ids)

    @property
    def hidden(self) -> int:
        return self.base.hidden

    def apply(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.base.apply(self.ids[i], x)


def run_experts(experts: ExpertWeights | ExpertView, x: torch.Tensor, slot: torch.Tensor,
                weight: torch.Tensor) -> torch.Tensor:
    """Run the local experts on received rows, grouped per slot, and sum them per row with the routing weights.

    x: [N, H] received hidden vectors; slot: int [N, K] local slot index per entry, -1 where the entry is not
    served here; weight: [N, K] routing weights (ignored where slot is -1). Returns [N, H]:
    ``out[n] = sum_{j: slot[n,j] >= 0} weight[n,j] * experts.apply(slot[n,j], x[n])``.
    """
    N, H = x.shape
    out = torch.zeros(N, H, dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    row, j = torch.nonzero(slot >= 0, as_tuple=True)  # [M] (row, k) pairs served here
    pair_slot = slot[row, j]
    order = torch.argsort(pair_slot, stable=True)  # group pairs by slot: one GEMM per slot
    row, pair_slot, pair_w = row[order], pair_slot[order], weight[row[order], j[order]]
    # host waits for the device here: the group sizes decide the slices below
    bounds = torch.bincount(pair_slot, minlength=experts.num).cumsum(0).tolist()
    start = 0
    for s, end in enumerate(bounds):
        if end > start:
            r = row[start:end]
            y = experts.apply(s, x[r])  # [n_s, H]
            out.index_add_(0, r, y * pair_w[start:end, None].to(y.dtype))
        start = end
    return out


def run_experts_loop(experts: ExpertWeights | ExpertView, x: torch.Tensor, slot: torch.Tensor,
                     weight: torch.Tensor) -> torch.Tensor:
    """Plain for-loop reference of :func:`run_experts` (same arguments and result)."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(slot.shape[1]):
            s = int(slot[n, j])
            if s >= 0:
                out[n] += weight[n, j].to(x.dtype) * experts.apply(s, x[n:n + 1])[0]
    return out


def reference_moe(experts: ExpertWeights, x: torch.Tensor, expert_ids: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """Single-process reference MoE: x [T, H], expert_ids int [T, K] (logical), weights [T, K] -> [T, H]."""
    return run_experts_loop(experts, x, expert_ids.long(), weights)


def wait_seconds(seconds: float) -> None:
    """Block for ``seconds`` (wall clock) without using the CPU: ``time.sleep`` until the deadline, so an
    interrupted or early-woken sleep resumes. Overshoots by the scheduler's wake-up latency (tens of us)."""
    end = time.perf_counter() + seconds
    while (left := end - time.perf_counter()) > 0:
        time.sleep(left)


class MoELayer:
    """One GPU's share of a routed-expert layer: the experts of its S slots, run on what a dispatcher delivers.

    ``forward(x, route, dispatcher)`` = dispatch -> :func:`run_experts` -> combine. The dispatcher decides where
    rows go and returns frozen metadata that combine consumes; the layer holds only weights.
    """

    def __init__(self, local_experts: ExpertWeights | ExpertView) -> None:
        self.experts = local_experts  # [S] experts, index = local slot

    def forward(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, dispatcher,
                compute_seconds: float | None = None) -> torch.Tensor:
        """x: [T, H] this GPU's tokens; slots: int [T, K] physical slot serving each (token, k) pair;
        weights: [T, K] routing weights. Returns [T, H].

        compute_seconds: emulated compute: wait this long instead of running the experts, and combine zero
        partial sums (same shapes and bytes as the real ones; the result is then not the layer's output)."""
        recv = dispatcher.dispatch(x, slots, weights)
        if compute_seconds is None:
            y = run_experts(self.experts, recv.x, recv.local_slot, recv.weight)
        else:
            wait_seconds(compute_seconds)
            y = torch.zeros_like(recv.x)
        return dispatcher.combine(y, recv.meta)
