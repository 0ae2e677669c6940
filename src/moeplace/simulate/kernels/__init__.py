"""One time model per dispatch/combine kernel, and expert compute (docs/SIMULATOR.md, "Time model").

- :mod:`~moeplace.simulate.kernels.nccl`, :mod:`~moeplace.simulate.kernels.deepep_normal`,
  :mod:`~moeplace.simulate.kernels.deepep_ll`: one :class:`KernelModel` each (``KERNEL``), collected in
  :data:`KERNELS`, the one registry of kernel modes (its keys are the ``CostConfig.mode`` values besides "auto").
- :mod:`~moeplace.simulate.kernels.expert`: the expert-compute roofline and the two-batch-overlap layer time.

Adding a kernel is one module with a ``KERNEL`` and one entry in :data:`KERNELS` (its name also in
:data:`moeplace.simulate.config.KERNEL_NAMES`, which the CLI reads without importing numpy).
"""

from __future__ import annotations

from moeplace.simulate.config import AUTO_MODE, KERNEL_NAMES, MODES
from moeplace.simulate.kernels import deepep_ll, deepep_normal, nccl
from moeplace.simulate.kernels.base import KernelModel, kernel_seconds
from moeplace.simulate.kernels.deepep_ll import DEEPEP_LL_ALPHA
from moeplace.simulate.kernels.deepep_normal import DEEPEP_NVLINK_EFF, DEEPEP_RDMA_EFF
from moeplace.simulate.kernels.expert import expert_seconds, overlapped_seconds

KERNELS: dict[str, KernelModel] = {k.name: k for k in (nccl.KERNEL, deepep_normal.KERNEL, deepep_ll.KERNEL)}
assert tuple(KERNELS) == KERNEL_NAMES, "simulate.config.KERNEL_NAMES must list the kernels in KERNELS' order"

__all__ = ["AUTO_MODE", "DEEPEP_LL_ALPHA", "DEEPEP_NVLINK_EFF", "DEEPEP_RDMA_EFF", "KERNELS", "MODES",
           "KernelModel", "expert_seconds", "kernel_seconds", "overlapped_seconds"]
