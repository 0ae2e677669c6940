"""``moeplace predict-kernel`` and ``kernel_bench.predict_kernel``: benchmark routing, DeepEP's byte counts, the JSON
rows, and the low-latency rows that are cheap to price against DeepEP's published numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moeplace.simulate.kernel_bench import benchmark_routing, predict_kernel

PUBLISHED = Path(__file__).resolve().parents[1] / "bench" / "results" / "deepep_published.json"


def test_benchmark_routing_draws_distinct_experts_within_node_groups():
    rng = np.random.default_rng(0)
    ids = benchmark_routing(rng, 2000, 256, 8, num_nodes=8, node_groups=4)
    assert ids.shape == (2000, 8)
    assert all(len(set(row)) == 8 for row in ids.tolist())
    nodes = ids // 32
    assert max(len(set(row)) for row in nodes.tolist()) <= 4
    free = benchmark_routing(rng, 20000, 256, 8, num_nodes=8)
    counts = np.bincount(free.ravel(), minlength=256)
    assert counts.min() > 0.8 * counts.mean() and counts.max() < 1.2 * counts.mean()  # uniform
    assert max(len(set(row)) for row in (free // 32).tolist()) > 4


def test_cli_writes_rows_with_deepep_byte_counts(tmp_path):
    out = tmp_path / "ll.json"
    p = subprocess.run([sys.executable, "-m", "moeplace", "predict-kernel", "--model", "deepseek-v3",
                        "--cluster-preset", "h800-8", "--ep", "8,16", "--mode", "deepep-ll", "--tokens-per-rank",
                        "128", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["ep"] for r in rows] == [8, 16]
    for r in rows:
        assert {"ep", "dispatch_us", "combine_us", "dispatch_bytes", "combine_bytes"} <= set(r)
        # DeepEP's test_low_latency.py: every selection, (7168 + 7168 / 128 * 4 + 16) B fp8, 7168 * 2 B bf16
        assert r["dispatch_bytes"] == 128 * 8 * (7168 + 224 + 16)
        assert r["combine_bytes"] == 128 * 8 * 7168 * 2
        assert r["dispatch_us"] > 0 and r["combine_us"] > r["dispatch_us"]  # combine moves twice the bytes


def test_low_latency_within_25_percent_of_published():
    pub = {r["ep"]: r for r in json.loads(PUBLISHED.read_text())["low_latency"]["rows"]}
    for r in predict_kernel("deepseek-v3", "h800-8", [16, 64], "deepep-ll", 128):
        for part in ("dispatch", "combine"):
            assert r[f"{part}_us"] == pytest.approx(pub[r["ep"]][f"{part}_us"], rel=0.25), (r["ep"], part)


def test_normal_single_node_counts_received_tokens():
    (r,) = predict_kernel("deepseek-v3", "h800-8", [8], "deepep-normal", 512)
    # one node: bytes = tokens each rank receives (itself included) x 7392; a token reaches 8 * (1 - C(224, 8) /
    # C(256, 8)) ranks on average, about 5.2 -> per rank 512 * 5.2 tokens
    expect = 512 * 8 * (1 - np.prod([(224 - i) / (256 - i) for i in range(8)])) * 7392
    assert r["dispatch_bytes"] == pytest.approx(expect, rel=0.02)
    assert r["combine_bytes"] == pytest.approx(r["dispatch_bytes"] * 14336 / 7392)


def test_refuses_bad_ep_and_mode():
    with pytest.raises(ValueError, match="EP size 12"):
        predict_kernel("deepseek-v3", "h800-8", [12], "deepep-ll", 8)
    with pytest.raises(ValueError, match="mode"):
        predict_kernel("deepseek-v3", "h800-8", [8], "auto", 8)
