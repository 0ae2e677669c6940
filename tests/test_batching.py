"""Micro-batches as serving forms them (moeplace.simulate.batching): continuous batching of decode, by hand."""

from __future__ import annotations

import numpy as np
import pytest

from moeplace.placement import Cluster
from moeplace.simulate import BatchConfig, simulate
from moeplace.simulate.batching import continuous_starts, window_microbatches
from moeplace.trace.types import DECODE, PREFILL, Requests, TokenChunk, Trace, TraceMeta


def test_continuous_starts_by_hand():
    # running set of 2; decode lengths 3, 1, 2, 1 in arrival order. Steps: 0 {r0, r1}; r1 leaves after step 0 so
    # r2 joins at 1: 1 {r0, r2}, 2 {r0, r2}; both leave after step 2, r3 joins at 3: 3 {r3}
    assert continuous_starts(np.array([3, 1, 2, 1]), 2).tolist() == [0, 0, 1, 3]
    # a request with no decode step takes no place; a running set as large as the trace starts everyone at once
    assert continuous_starts(np.array([2, 0, 2]), 1).tolist() == [0, 0, 2]
    assert continuous_starts(np.array([5, 1, 4]), 8).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="capacity"):
        continuous_starts(np.array([1]), 0)


def hand_trace() -> Trace:
    """Four requests with prompts of 2 tokens and decode lengths 3, 1, 2, 1 (request ids 10, 11, 12, 13)."""
    meta = TraceMeta(model="hand-made", num_layers=1, num_experts=4, top_k=1, hidden_size=8)
    gen = [3, 1, 2, 1]
    rid, pos, ph = [], [], []
    for r, g in zip((10, 11, 12, 13), gen, strict=True):
        for p in range(2 + g):
            rid.append(r)
            pos.append(p)
            ph.append(PREFILL if p < 2 else DECODE)
    T = len(rid)
    ids = (np.arange(T) % 4).astype(np.int16).reshape(T, 1, 1)
    req = Requests(np.array([10, 11, 12, 13]), np.array(["x"] * 4, object), np.array([""] * 4, object),
                   np.array([2] * 4, np.int32), np.array(gen, np.int32))
    return Trace(meta, req, TokenChunk(np.array(rid), np.array(pos, np.int32), np.array(ph, np.int8), ids))


def test_simulator_forms_continuous_decode_steps():
    res = simulate(hand_trace(), cluster=Cluster(1, 2), batching=BatchConfig(decode_running=2, prefill_tokens=3))
    # decode steps as listed in test_continuous_starts_by_hand: 2, 2, 2, 1 tokens
    assert res.decode.microbatch_ids.tolist() == [0, 1, 2, 3]
    assert res.decode.microbatch_tokens.tolist() == [2, 2, 2, 1]
    # prefill: 8 prompt tokens end to end, chunks of 3 -> 3, 3, 2
    assert res.prefill.microbatch_tokens.tolist() == [3, 3, 2]
    # windows of 2 requests instead: window 0 (r0, r1) steps 0..2 carry 2, 1, 1; window 1 (r2, r3) 2, 1
    win = simulate(hand_trace(), cluster=Cluster(1, 2), batching=BatchConfig(decode_batch=2, prefill_tokens=3))
    assert win.decode.microbatch_tokens.tolist() == [2, 1, 1, 2, 1]


def test_window_microbatches_agrees_with_the_simulator():
    tr = hand_trace()
    r = np.searchsorted(tr.requests.request_id, tr.tokens.request_id)
    pre = tr.tokens.phase == PREFILL
    b = BatchConfig(decode_running=2, prefill_tokens=3)
    mb = window_microbatches(r, pre, np.arange(4), b)
    assert np.bincount(mb[~pre]).tolist() == [2, 2, 2, 1]
    # arrival order matters: r3 (1 step) and r1 first, then r0 (3), r2 (2): steps {r3, r1}, {r0, r2} x 2, {r0}
    mb2 = window_microbatches(r, pre, np.array([3, 1, 0, 2]), b)
    assert np.bincount(mb2[~pre]).tolist() == [2, 2, 2, 1]
    assert sorted(r[~pre][mb2[~pre] == 0].tolist()) == [1, 3]
    assert BatchConfig(decode_running=2).capacity("decode") == 2 and BatchConfig().capacity("decode") == 256
    with pytest.raises(ValueError, match="decode_running"):
        BatchConfig(decode_running=0)
