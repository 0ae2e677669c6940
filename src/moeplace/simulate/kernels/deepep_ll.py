"""DeepEP's low-latency kernel: one copy per (token, expert) pair, no dedup (intra-node pairs over NVLink,
inter-node pairs over RDMA, as DeepEP does since its PR #173)."""

from __future__ import annotations

from moeplace.simulate.kernels.base import KernelModel
from moeplace.simulate.kernels.deepep_normal import DEEPEP_NVLINK_EFF, DEEPEP_RDMA_EFF

DEEPEP_LL_ALPHA = 5e-6  # fixed cost of one low-latency kernel call beyond the link latency (fitted: LL EP32 dispatch)

KERNEL = KernelModel("deepep-ll", "DeepEP low-latency: one copy per (token, expert) pair, no dedup", "per_pair",
                     DEEPEP_LL_ALPHA, DEEPEP_NVLINK_EFF, DEEPEP_RDMA_EFF, 16.0,
                     "kernel alpha fitted on DeepEP's H800 low-latency table; 16 B per message as in DeepEP's "
                     "test_low_latency.py byte count")
