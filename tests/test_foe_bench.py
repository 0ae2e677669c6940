"""The prediction helpers of bench/foe_ep.py (moeplace.placement.foe): per-GPU FoE vectors, the per-GPU time ratio and
the time of measured bytes, against numbers worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from moeplace.placement.foe import (
    bandwidth_seconds,
    foe_per_gpu_vectors,
    moe_foe_time_ratio,
    moe_foe_time_ratio_per_gpu,
)


def test_per_gpu_vectors_by_hand():
    # 2x2, H=2: rings {0,2} and {1,3} cross nodes; a GPU holds 2T/4 rows, sends half of them (p=2) = T/W x 2
    assert foe_per_gpu_vectors(4, 2, 4, 2) == {"alltoall": 4.0, "allreduce": 2.0, "allreduce_inter_node": 1.0,
                                               "allreduce_closed_form": 1.0}
    # 2x2, H=4: one ring 0-1-2-3, hops 1->2 and 3->0 cross nodes; a GPU holds all T rows, sends 6/4 of them
    assert foe_per_gpu_vectors(4, 4, 4, 2)["allreduce"] == 6.0
    assert foe_per_gpu_vectors(4, 4, 4, 2)["allreduce_inter_node"] == 1.0
    # 1x4, H=2: both rings inside the node
    assert foe_per_gpu_vectors(4, 2, 4, 4)["allreduce_inter_node"] == 0.0
    with pytest.raises(ValueError, match="one node"):
        foe_per_gpu_vectors(4, 2, 4, 1)  # 4x1, H=2: a group would span two nodes


@pytest.mark.parametrize("r", [1.0, 10.0, 17.0])
def test_per_gpu_ratio_by_hand(r):
    # T_moe (2x2, k=4): 2k(W-n)/W r + 2k(n-1)/W = 4r + 2
    assert moe_foe_time_ratio_per_gpu(4, 2, r, 4, 2) == pytest.approx((4 * r + 2) / (4 + 2 * r))
    assert moe_foe_time_ratio_per_gpu(4, 4, r, 4, 2) == pytest.approx((4 * r + 2) / (6 * r))
    assert moe_foe_time_ratio_per_gpu(4, 4, r, 4, 1) == pytest.approx(1.0)  # 4x1: 6r / 6r
    # the closed form counts 2(p-1)/p all-reduce vectors per token: (4r + 2) / (4 + r) and (4r + 2) / (1.5 r)
    assert moe_foe_time_ratio(4, 2, r, W=4, n=2) == pytest.approx((4 * r + 2) / (4 + r))
    assert moe_foe_time_ratio(4, 4, r, W=4, n=2) == pytest.approx((4 * r + 2) / (1.5 * r))


def test_bandwidth_seconds_by_hand():
    sent = np.zeros((2, 1, 4, 4))
    sent[..., np.arange(4), np.arange(4)] = 999  # to itself: never on a link
    sent[0, 0, 0, 1] = 100  # intra-node
    sent[0, 0, 0, 2] = 200  # inter-node
    sent[0, 0, 1, 3] = 50  # inter-node
    sent[1, 0, 2, 0] = 30  # inter-node
    # per GPU, intra 100 B/s, inter 10 B/s: step 0 GPU 0 = 1 + 20 = 21, step 1 GPU 2 = 3
    assert bandwidth_seconds(sent, 2, 100.0, 10.0) == pytest.approx(24.0)
    # node link (2 x 10 B/s shared): step 0 node 0 carries 250 B -> 12.5, GPU 0 adds its 1 s intra; step 1: 1.5
    assert bandwidth_seconds(sent, 2, 100.0, 10.0, node_link=True) == pytest.approx(15.0)
    assert bandwidth_seconds(sent[0, 0], 2, 100.0, 10.0) == pytest.approx(21.0)  # one [W, W] step
    with pytest.raises(ValueError, match="multiple"):
        bandwidth_seconds(np.zeros((3, 3)), 2, 1.0, 1.0)
