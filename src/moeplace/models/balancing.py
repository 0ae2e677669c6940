"""Auxiliary-loss-free load balancing of a DeepSeek-V3 router (arXiv 2412.19437, section 2.1.2).

Shape legend: L = MoE layers, E = routed experts, T = tokens, K = experts per token (top-k).

Each MoE layer's router adds a per-expert bias ``b_e`` to the affinity scores ``s_{t,e}`` only to *choose* the
top-k experts (and, with group-limited routing, the top groups); the gating weights that scale the chosen experts'
outputs are the unbiased ``s_{t,e}``. After every training step, each layer's bias moves by the bias update speed
``gamma`` against the load of that step::

    b_e <- b_e + gamma * sign(mean_e'(load_e') - load_e)

so an overloaded expert becomes less likely to be chosen and an underloaded one more likely, without a loss term
that pulls on the language-modelling gradient. In transformers' ``DeepseekV3TopkRouter`` the bias is the buffer
``e_score_correction_bias`` (added to the sigmoid scores before the group and top-k choice, not to the weights);
:class:`RoutedLoadCounter` counts the routed (token, expert) pairs of a step and :func:`update_router_biases`
applies the rule to those buffers. DeepSeek-V3 also has an optional sequence-wise balance loss (weight 1e-4);
the fine-grained reference model does not use it (``router_aux_loss_coef = 0``).
"""

from __future__ import annotations

import numpy as np
import torch


def bias_update(bias: np.ndarray, load: np.ndarray, gamma: float) -> np.ndarray:
    """The biases after one step: ``bias + gamma * sign(mean(load) - load)`` per layer.

    bias: float [L, E] (or [E]); load: [L, E] (or [E]) routed (token, expert) pairs of the step; returns float64
    of bias's shape. An expert at exactly the mean load keeps its bias.
    """
    bias = np.asarray(bias, dtype=np.float64)
    load = np.asarray(load, dtype=np.float64)
    if bias.shape != load.shape:
        raise ValueError(f"bias_update: bias {bias.shape} and load {load.shape} differ in shape")
    if not gamma >= 0:
        raise ValueError(f"bias_update: gamma must be >= 0, got {gamma}")
    return bias + gamma * np.sign(load.mean(axis=-1, keepdims=True) - load)


def max_over_mean(load: np.ndarray) -> np.ndarray:
    """Load imbalance of each layer: max_e load / mean_e load. load [L, E] -> float [L] (1.0 = balanced)."""
    load = np.asarray(load, dtype=np.float64)
    return load.max(axis=-1) / np.maximum(load.mean(axis=-1), 1e-12)


def bias_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of ``model`` that carry a selection bias (``e_score_correction_bias``), in module order [L]."""
    found = [m for m in model.modules() if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor)]
    if not found:
        raise ValueError(f"{type(model).__name__}: no router with an e_score_correction_bias buffer")
    return found


class RoutedLoadCounter:
    """Counts routed (token, expert) pairs per MoE layer while it is open: ``load`` int64 [L, E].

    Hooks each router of :func:`bias_routers` and reads the top-k indices [T, K] it returns (third output of
    ``DeepseekV3TopkRouter``). ``reset()`` zeroes the counts; use it before each training forward so that
    evaluation passes are not counted.
    """

    def __init__(self, model: torch.nn.Module):
        self.routers = bias_routers(model)
        self.num_experts = int(self.routers[0].e_score_correction_bias.numel())
        self._counts = torch.zeros(len(self.routers), self.num_experts, dtype=torch.int64)
        self._handles: list = []

    def _hook(self, layer: int):
        def hook(module, args, output) -> None:
            idx = output[2]  # [T, K] chosen experts
            self._counts[layer] += torch.bincount(idx.reshape(-1).cpu(), minlength=self.num_experts)
        return hook

    def __enter__(self) -> RoutedLoadCounter:
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def reset(self) -> None:
        self._counts.zero_()

    @property
    def load(self) -> np.ndarray:
        """Routed (token, expert) pairs since the last reset: int64 [L, E]."""
        return self._counts.numpy().copy()


@torch.no_grad()
def update_router_biases(routers: list[torch.nn.Module], load: np.ndarray, gamma: float) -> None:
    """Apply :func:`bias_update` to each router's ``e_score_correction_bias`` in place. load [L, E], one row per
    router (the order of :func:`bias_routers`)."""
    if len(routers) != len(load):
        raise ValueError(f"update_router_biases: {len(routers)} routers but load has {len(load)} rows")
    bias = np.stack([r.e_score_correction_bias.detach().double().cpu().numpy() for r in routers])
    new = bias_update(bias, load, gamma)
    for r, b in zip(routers, new, strict=True):
        r.e_score_correction_bias.copy_(torch.from_numpy(b).to(r.e_score_correction_bias.dtype))
