"""Analysing shard by shard and merging (moeplace.analyse.shards) gives the single-process answer byte for byte,
including drift windows that straddle shards, decode runs split across shards, and traces where the merge must fall
back to a sequential temporal pass (positions out of order)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeplace.analyse.summary import analyse_trace
from moeplace.engine import EngineError, LocalEngine, make_engine
from moeplace.trace import TraceError, TraceMeta, TraceWriter
from moeplace.trace.reader import shard_files


def _trace(path, seed: int, n_req: int = 12, shard_tokens: int = 23, shuffle: str = "none", L: int = 3,
           E: int = 8, K: int = 2):
    """Labelled-synthetic routing: requests of 4-9 prefill and 3-12 decode tokens, written request after request
    (``shuffle="interleave"``: all requests' rows interleaved, positions still rising in each; ``"swap"``: two
    decode rows of one request swapped, so its positions fall once and the merge falls back to the stream)."""
    rng = np.random.default_rng(seed)
    meta = TraceMeta(model="hand-made", num_layers=L, num_experts=E, top_k=K, hidden_size=16, synthetic=True,
                     source="tests (synthetic)")
    pl = rng.integers(4, 10, n_req)
    gl = rng.integers(3, 13, n_req)
    rid = np.repeat(np.arange(n_req), pl + gl)
    pos = np.concatenate([np.arange(a + b) for a, b in zip(pl, gl, strict=True)])
    ph = (pos >= pl[rid]).astype(np.int8)
    if shuffle == "interleave":  # position 0 of every request, then 1, ...: rising within each request
        o = np.lexsort((rid, pos))
        rid, pos, ph = rid[o], pos[o], ph[o]
    if shuffle == "swap":
        d = np.flatnonzero((rid == 2) & (ph == 1))
        pos[d[0]], pos[d[1]] = pos[d[1]], pos[d[0]]
    ids = np.argsort(rng.random((len(rid), L, E)) - 0.3 * (np.arange(E) < 3), -1)[..., :K].astype(np.int16)
    doms = ["code", "math", "chat"]
    with TraceWriter(path, meta, shard_tokens=shard_tokens) as w:
        w.add_requests(np.arange(n_req), domain=[doms[i % 3] for i in range(n_req)], prompt_len=pl, gen_len=gl)
        w.add_tokens(rid, pos, ph, ids)
    return path


def _same(path, **kw) -> dict:
    a = analyse_trace(path, **kw)
    b = analyse_trace(path, engine=LocalEngine(), **kw)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    return a


@pytest.mark.parametrize("shuffle", ["none", "interleave", "swap"])
@pytest.mark.parametrize("window", [5, 17, 64])
def test_shard_merge_equals_single_process(tmp_path, shuffle, window):
    p = _trace(tmp_path / "t.trace", seed=window, shuffle=shuffle)
    assert len(shard_files(p)) >= 5
    a = _same(p, window_tokens=window, chunk_tokens=10)
    assert a["temporal"]["num_pairs"] > 0
    if window < 64:
        assert a["drift"]["num_windows"] >= 2


def test_tracked_subset_and_one_shard(tmp_path):
    p = _trace(tmp_path / "t.trace", seed=4, n_req=20)
    a = _same(p, window_tokens=9, max_request_bytes=2 * 3 * 8 * 4 * 7)  # 7 of 20 requests tracked
    assert a["params"]["tracked_requests"] == 7
    q = _trace(tmp_path / "one.trace", seed=5, shard_tokens=1 << 16)
    assert len(shard_files(q)) == 1
    _same(q, window_tokens=11)


def test_carry_limit_falls_back_to_the_stream(tmp_path, monkeypatch):
    """With more decode requests than the stream's carry holds, the merge recomputes temporal the stream's way."""
    import moeplace.analyse.accumulate as accumulate

    p = _trace(tmp_path / "t.trace", seed=6, n_req=30, shuffle="interleave")
    monkeypatch.setattr(accumulate, "DEFAULT_CARRY_REQUESTS", 4)  # a real smaller carry, in both paths
    monkeypatch.setattr(accumulate.TokenAccumulator.__init__, "__defaults__",
                        tuple(4 if d == 1 << 16 else d for d in accumulate.TokenAccumulator.__init__.__defaults__))
    _same(p, window_tokens=13, chunk_tokens=7)


def test_a_shard_naming_an_unknown_request_is_one_error(tmp_path):
    p = _trace(tmp_path / "t.trace", seed=7)
    import pyarrow.parquet as pq

    f = shard_files(p)[2]
    t = pq.read_table(f)
    rid = t.column("request_id").to_numpy().copy()
    rid[0] = 999
    import pyarrow as pa

    pq.write_table(t.set_column(0, "request_id", pa.array(rid)), f)
    with pytest.raises(TraceError, match="999"):
        analyse_trace(p, engine=LocalEngine())
    with pytest.raises(TraceError, match="999"):
        analyse_trace(p)


def test_engine_names_and_addresses():
    with pytest.raises(EngineError, match="--engine spark"):
        make_engine("spark")
    with pytest.raises(EngineError, match="--address applies"):
        make_engine("local", "127.0.0.1:6379")
    with pytest.raises(EngineError, match="HOST:PORT"):
        make_engine("ray", "nohost")
    with pytest.raises(EngineError, match="no Ray cluster reachable"):
        make_engine("ray", "127.0.0.1:1")
    assert list(LocalEngine().map(lambda x, y: x * y, [1, 2, 3], 10)) == [10, 20, 30]
