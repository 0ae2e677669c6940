"""What a byte costs on each link class (docs/SIMULATOR.md, "Time model").

A link class c (intra-node NVLink, inter-node RDMA) in one direction costs ``alpha_c + sends_c * bytes_per_send /
B_c`` seconds, 0 when nothing crosses it. :mod:`moeplace.simulate.kernels` applies each kernel's efficiency on top.
"""

from __future__ import annotations

import math

import numpy as np


def comm_seconds(busiest: np.ndarray, alpha: float, bandwidth: float, send_bytes: float) -> np.ndarray:
    """float [...]: ``alpha + busiest * send_bytes / bandwidth`` where anything is sent, else 0 (one link class,
    one direction). busiest: [...] sends over the busiest link of that class."""
    busiest = np.asarray(busiest)
    return np.where(busiest > 0, alpha + busiest * send_bytes / bandwidth, 0.0)


def dispatch_vector_bytes(hidden: int, dispatch_bytes: float, scale_block: int) -> float:
    """Bytes of one dispatched token vector: elements, plus one fp32 scale per ``scale_block`` elements when the
    dispatch is quantized (dispatch_bytes < 2). DeepSeek-V3: 7168 + 4 * 56 = 7392."""
    scales = 4.0 * math.ceil(hidden / scale_block) if scale_block and dispatch_bytes < 2 else 0.0
    return hidden * dispatch_bytes + scales
