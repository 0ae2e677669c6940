"""DeepEP's normal (high-throughput) kernel: one copy per remote node, forwarded over NVLink (two-hop).

Calibrated on DeepEP's published H800 numbers (bench/results/deepep_published.json; docs/SIMULATOR.md, "Kernel
validation" lists which rows fitted which constant and the error on every row). The two link efficiencies are
shared with the low-latency kernel (:mod:`moeplace.simulate.kernels.deepep_ll`).
"""

from __future__ import annotations

from moeplace.simulate.kernels.base import KernelModel

DEEPEP_NVLINK_EFF = 0.68  # achieved fraction of the NVLink rate (fitted: normal kernel, intranode EP8 dispatch)
DEEPEP_RDMA_EFF = 0.88  # achieved fraction of the NIC rate (fitted: normal kernel, internode EP32 dispatch)

KERNEL = KernelModel("deepep-normal", "DeepEP normal: one copy per remote node, forwarded over NVLink (two-hop)",
                     "two_hop", 0.0, DEEPEP_NVLINK_EFF, DEEPEP_RDMA_EFF, 0.0,
                     "link efficiencies fitted on DeepEP's H800 normal-kernel table (docs/SIMULATOR.md)")
