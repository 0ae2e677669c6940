"""Trace store: round trip, streaming, atomic shards, and one clear error per kind of bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moeplace.trace import (
    TraceError,
    TraceMeta,
    TraceWriter,
    iter_token_chunks,
    read_counts,
    read_trace,
    trace_info,
    write_trace,
)
from moeplace.trace.types import Counts, Requests, Trace


def test_round_trip_equals(small_trace):
    path, arr, meta = small_trace
    tr = read_trace(path)
    assert tr.meta.complete and tr.meta.num_layers == 3 and tr.meta.synthetic
    np.testing.assert_array_equal(tr.tokens.request_id, arr["request_id"])
    np.testing.assert_array_equal(tr.tokens.position, arr["position"])
    np.testing.assert_array_equal(tr.tokens.phase, arr["phase"])
    np.testing.assert_array_equal(tr.tokens.expert_ids, arr["expert_ids"])
    assert tr.tokens.expert_ids.dtype == np.int16 and tr.tokens.expert_weights.dtype == np.float16
    np.testing.assert_array_equal(tr.tokens.expert_weights, arr["expert_weights"])
    assert list(tr.requests.domain) == ["code", "math", "chat", "general", "code", "math"]
    # 54 tokens with 20 per shard -> several shards
    assert len(list(path.glob("part-*.tokens.parquet"))) >= 3


def test_write_trace_and_overwrite(small_trace, tmp_path):
    path, arr, meta = small_trace
    tr = read_trace(path)
    out = tmp_path / "copy.trace"
    write_trace(out, tr)
    with pytest.raises(TraceError, match="already exists"):
        write_trace(out, tr)
    # overwrite swaps in a complete new trace; the old one is never half-replaced
    tr.requests.domain[:] = "general"
    write_trace(out, tr, overwrite=True)
    assert set(read_trace(out).requests.domain) == {"general"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".copy.trace")]


def test_streaming_bounded_chunks(small_trace):
    path, arr, _ = small_trace
    chunks = list(iter_token_chunks(path, chunk_tokens=7))
    assert max(len(c) for c in chunks) <= 7
    np.testing.assert_array_equal(np.concatenate([c.expert_ids for c in chunks]), arr["expert_ids"])
    no_w = next(iter_token_chunks(path, columns_weights=False))
    assert no_w.expert_weights is None


def test_info_keys(small_trace):
    path, _, _ = small_trace
    info = trace_info(path)
    assert info["num_layers"] == 3 and info["num_experts"] == 8 and info["top_k"] == 2
    assert info["num_requests"] == 6
    assert info["num_tokens"] == {"prefill": 30, "decode": 24}
    assert info["domains"] == {"chat": 1, "code": 2, "general": 1, "math": 2}


def test_counts_trace_round_trip(tmp_path):
    meta = TraceMeta(model="m", num_layers=2, num_experts=4, top_k=1, kind="counts")
    c = np.arange(3 * 2 * 4, dtype=float).reshape(3, 2, 4)
    tr = Trace(meta, Requests(np.zeros(0, np.int64), np.array([], object), np.array([], object),
                              np.zeros(0, np.int32), np.zeros(0, np.int32)), None,
               Counts(np.array(["a", "b", "c"], object), np.array(["code", "math", "code"], object),
                      np.array([0, 1, -1], np.int8), np.array([1.0, 2.0, np.nan]), c))
    write_trace(tmp_path / "c.trace", tr)
    back = read_counts(tmp_path / "c.trace")
    np.testing.assert_array_equal(back.counts, c)
    assert list(back.domain) == ["code", "math", "code"]
    with pytest.raises(TraceError, match="counts-only"):
        list(iter_token_chunks(tmp_path / "c.trace"))


# ------------------------------------------------------------------------------------------ bad input

def test_missing_and_not_a_trace(tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        read_trace(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="no meta.json"):
        read_trace(tmp_path / "empty")


def test_newer_format_version(small_trace):
    path, _, _ = small_trace
    m = json.loads((path / "meta.json").read_text())
    m["format_version"] = 99
    (path / "meta.json").write_text(json.dumps(m))
    with pytest.raises(TraceError, match="format_version 99 is newer"):
        read_trace(path)


def test_corrupt_meta(small_trace):
    path, _, _ = small_trace
    (path / "meta.json").write_text("{not json")
    with pytest.raises(TraceError, match="corrupt metadata"):
        read_trace(path)


def test_truncated_shard(small_trace):
    path, _, _ = small_trace
    f = sorted(path.glob("part-*.tokens.parquet"))[1]
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match=f"{f.name}.*truncated or corrupt"):
        read_trace(path)


def test_wrong_schema(small_trace):
    path, _, _ = small_trace
    f = sorted(path.glob("part-*.tokens.parquet"))[0]
    pq.write_table(pq.read_table(f).drop_columns(["position"]), f)
    with pytest.raises(TraceError, match="missing column 'position'"):
        read_trace(path)


def test_shape_disagrees_with_meta(small_trace):
    path, _, _ = small_trace
    m = json.loads((path / "meta.json").read_text())
    m["top_k"] = 3
    (path / "meta.json").write_text(json.dumps(m))
    with pytest.raises(TraceError, match="shape disagrees with metadata"):
        read_trace(path)


def test_out_of_range_expert_id_on_read(small_trace):
    path, _, _ = small_trace
    m = json.loads((path / "meta.json").read_text())
    m["num_experts"] = 4  # the stored ids go up to 7
    (path / "meta.json").write_text(json.dumps(m))
    with pytest.raises(TraceError, match=r"expert id \d+ out of range \[0, 4\)"):
        read_trace(path)


def test_writer_rejects_bad_input(tmp_path):
    meta = TraceMeta(model="m", num_layers=2, num_experts=4, top_k=2)
    with TraceWriter(tmp_path / "t", meta) as w:
        with pytest.raises(TraceError, match=r"expert id 4 out of range \[0, 4\)"):
            w.add_tokens([0], [0], [0], np.array([[[0, 4], [1, 2]]]))
        with pytest.raises(TraceError, match=r"expected shape \[tokens, 2, 2\]"):
            w.add_tokens([0], [0], [0], np.zeros((1, 3, 2), np.int16))
        with pytest.raises(TraceError, match="phase must be 0"):
            w.add_tokens([0], [0], [5], np.array([[[0, 1], [2, 3]]], np.int16))
        with pytest.raises(TraceError, match="expected 1 entries"):
            w.add_tokens([0, 1], [0], [0], np.array([[[0, 1], [2, 3]]], np.int16))
    with pytest.raises(TraceError, match="top_k=9 exceeds"):
        TraceMeta(model="m", num_layers=1, num_experts=4, top_k=9)


def test_unknown_request_in_tokens(tmp_path):
    meta = TraceMeta(model="m", num_layers=1, num_experts=4, top_k=1)
    with TraceWriter(tmp_path / "t", meta) as w:
        w.add_requests([0])
        w.add_tokens([0, 7], [0, 0], [0, 0], np.zeros((2, 1, 1), np.int16))
    with pytest.raises(TraceError, match="request_id 7 that is not in the request table"):
        read_trace(tmp_path / "t")


def test_killed_writer_leaves_readable_shards(tmp_path):
    """SIGKILL a writer mid-stream: committed shards read back whole, no half-written shard is accepted."""
    out = tmp_path / "killed.trace"
    script = textwrap.dedent(f"""
        import numpy as np, sys
        from moeplace.trace import TraceMeta, TraceWriter
        meta = TraceMeta(model="m", num_layers=4, num_experts=16, top_k=2)
        w = TraceWriter({str(out)!r}, meta, shard_tokens=1000)
        i = 0
        while True:
            w.add_requests([i])
            w.add_tokens(np.full(1000, i), np.arange(1000), np.zeros(1000, np.int8),
                         np.broadcast_to(np.array([i % 16, (i + 1) % 16], np.int16), (1000, 4, 2)))
            i += 1
            if i == 3:
                print("ready", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    tr = read_trace(out)
    assert not tr.meta.complete
    n = len(tr.requests)
    assert n >= 3 and len(tr.tokens) == 1000 * n
    # every committed shard holds exactly its own request's rows
    for i in range(n):
        sel = tr.tokens.request_id == i
        assert sel.sum() == 1000 and (tr.tokens.expert_ids[sel][:, :, 0] == i % 16).all()


def test_exception_in_writer_keeps_validated_rows(tmp_path):
    meta = TraceMeta(model="m", num_layers=1, num_experts=4, top_k=1)
    with pytest.raises(RuntimeError):
        with TraceWriter(tmp_path / "t", meta) as w:
            w.add_requests([0])
            w.add_tokens([0], [0], [0], np.zeros((1, 1, 1), np.int16))
            raise RuntimeError("boom")
    tr = read_trace(tmp_path / "t")
    assert not tr.meta.complete and len(tr.tokens) == 1


def test_readable_without_moeplace(small_trace):
    path, arr, _ = small_trace
    t = pa.concat_tables([pq.read_table(f) for f in sorted(path.glob("part-*.tokens.parquet"))])
    ids = np.asarray(t.column("expert_ids").combine_chunks().flatten()).reshape(-1, 3, 2)
    np.testing.assert_array_equal(ids, arr["expert_ids"])
    duckdb = pytest.importorskip("duckdb")
    n = duckdb.sql(f"select count(*) from '{path}/part-*.tokens.parquet' where phase = 1").fetchall()[0][0]
    assert n == 24
    pl = pytest.importorskip("polars")
    df = pl.read_parquet(f"{path}/part-*.requests.parquet")
    assert df.height == 6
