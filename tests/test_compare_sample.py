"""``compare --sample-requests``: a seeded sample of requests streamed shard by shard, so that compare runs on
traces larger than the memory budget. Checked against the whole trace read into memory and filtered (an
independent definition of the same rows), and through the CLI in its own process under a small budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moeplace.trace import TraceError, TraceMeta, TraceWriter, read_trace, read_trace_sample, sample_request_ids

L, E, K = 3, 16, 2


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    """SYNTHETIC: 120 requests of 6 prompt and 58 decode tokens, written in shards of 800 rows (10 shards), the
    requests' rows interleaved across shards as a capture writes them."""
    rng = np.random.default_rng(0)
    n, prompt, gen = 120, 6, 58
    meta = TraceMeta(model="synthetic-sample", num_layers=L, num_experts=E, top_k=K, hidden_size=64, synthetic=True,
                     source="tests/test_compare_sample.py")
    rid = np.repeat(np.arange(n), prompt + gen)
    pos = np.tile(np.arange(prompt + gen), n)
    order = np.lexsort((rid, pos // 4))  # a few positions of every request, then the next few
    rid, pos = rid[order], pos[order]
    ph = (pos >= prompt).astype(np.int8)
    ids = np.argsort(rng.random((len(rid), L, E)), axis=2)[:, :, :K].astype(np.int16)
    path = tmp_path_factory.mktemp("sample") / "s.trace"
    with TraceWriter(path, meta, shard_tokens=800) as w:
        w.add_requests(np.arange(n) * 3 + 7, domain=["a", "b", "c"] * (n // 3), prompt_len=[prompt] * n,
                       gen_len=[gen] * n)
        w.add_tokens(rid * 3 + 7, pos, ph, ids)
    return path


def test_the_sample_is_the_whole_traces_rows_of_those_requests(trace):
    full = read_trace(trace)
    s = read_trace_sample(trace, 40, seed=3)
    keep = s.requests.request_id
    assert len(keep) == 40 and len(set(keep.tolist())) == 40
    table = full.requests.request_id.tolist()
    assert [table.index(r) for r in keep.tolist()] == sorted(table.index(r) for r in keep.tolist())  # table order
    m = np.isin(full.tokens.request_id, keep)
    for col in ("request_id", "position", "phase", "expert_ids"):
        assert np.array_equal(getattr(s.tokens, col), getattr(full.tokens, col)[m]), col
    sel = np.isin(full.requests.request_id, keep)
    assert s.requests.domain.tolist() == full.requests.domain[sel].tolist()
    # seeded: the same seed the same sample, another seed another one; N >= R is the whole trace
    assert np.array_equal(read_trace_sample(trace, 40, seed=3).requests.request_id, keep)
    assert not np.array_equal(read_trace_sample(trace, 40, seed=4).requests.request_id, keep)
    assert np.array_equal(read_trace_sample(trace, 1000).tokens.expert_ids, full.tokens.expert_ids)
    with pytest.raises(TraceError, match="at least 1 request"):
        sample_request_ids(keep, 0)


def test_the_sample_fits_a_budget_the_whole_trace_does_not(trace):
    from moeplace.trace.reader import decoded_row_bytes

    budget = 120 * 64 * decoded_row_bytes("tokens", read_trace(trace).meta) // 2  # half the whole trace's rows
    with pytest.raises(TraceError, match="over the memory budget"):
        read_trace(trace, budget=budget)
    s = read_trace_sample(trace, 30, budget=budget)
    assert len(s.tokens) == 30 * 64
    with pytest.raises(TraceError, match="the 100 sampled requests"):
        read_trace_sample(trace, 100, budget=budget)


def _compare(trace: Path, *extra: str, budget: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MOEPLACE_MEMORY_BUDGET": budget}
    return subprocess.run([sys.executable, "-m", "moeplace", "compare", str(trace), "--cluster", "2x2",
                           "--redundant", "4", "--strategies", "linear,eplb", "--split-seeds", "2", "--quiet",
                           *extra], capture_output=True, text=True, env=env, timeout=300)


def test_compare_cli_refuses_the_whole_trace_and_runs_on_a_sample(trace, tmp_path):
    out = _compare(trace, budget="512K")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert str(trace) in out.stderr and "--sample-requests N" in out.stderr
    js = tmp_path / "c.json"
    out = _compare(trace, "--sample-requests", "40", "--sample-seed", "1", "--json", str(js), budget="512K")
    assert out.returncode == 0, out.stderr
    res = json.loads(js.read_text())
    assert res["sample"] == {"requests": 40, "seed": 1}
    assert res["planning_requests"] + res["held_out_requests"] == 40
    out = _compare(trace, "--sample-seed", "1", budget="1G")
    assert out.returncode == 2 and "--sample-seed seeds --sample-requests" in out.stderr
