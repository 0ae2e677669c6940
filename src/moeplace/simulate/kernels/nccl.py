"""NCCL all-to-allv: one copy per destination GPU (per-GPU dedup) at the link rate."""

from __future__ import annotations

from moeplace.simulate.kernels.base import KernelModel

KERNEL = KernelModel("nccl", "all-to-allv, one copy per destination GPU at the link rate", "per_gpu", 0.0, 1.0, 1.0,
                     0.0, "not validated: all-to-allv at the link rate, the cluster's per-message latencies only")
