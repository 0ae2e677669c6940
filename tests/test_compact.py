"""``moeplace trace compact``: fewer, larger shards with the same rows; verified before the rename; atomic; the input
is never touched, even when the run is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from fault.harness import SRC, assert_clean_failure, run_cli

from moeplace.analyse.summary import analyse_trace
from moeplace.data import DATA_DIR
from moeplace.trace import TraceError, TraceMeta, TraceWriter, read_requests, read_trace
from moeplace.trace.compact import compact_trace, trace_digest
from moeplace.trace.reader import shard_files

FG = DATA_DIR / "reference-fg.trace"


def _tree(p: Path) -> dict[str, tuple[int, int]]:
    """name -> (size, mtime_ns) of every file under p: what 'unmodified' means here."""
    return {str(f.relative_to(p)): (f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(p.rglob("*"))}


def _arrays_equal(a, b) -> None:
    for name in ("request_id", "position", "phase", "expert_ids"):
        np.testing.assert_array_equal(getattr(a.tokens, name), getattr(b.tokens, name))
    for name in ("request_id", "domain", "source", "prompt_len", "gen_len"):
        np.testing.assert_array_equal(getattr(a.requests, name), getattr(b.requests, name))


@pytest.fixture(scope="module")
def fg_compact(tmp_path_factory):
    out = tmp_path_factory.mktemp("compact") / "fg.trace"
    before = _tree(FG)
    res = compact_trace(FG, out)
    assert _tree(FG) == before  # the input was only read
    return out, res


def test_compact_reference_fg_same_rows_fewer_shards(fg_compact):
    out, res = fg_compact
    assert res.shards_in == len(shard_files(FG)) == 65
    assert res.shards_out == len(shard_files(out)) == 2  # 284k rows at 2^18 per shard
    for f in shard_files(out):
        assert pq.ParquetFile(f).metadata.num_row_groups == 1
    # an independent read of both traces: every column equal, in order (not only the digest)
    _arrays_equal(read_trace(FG), read_trace(out))
    assert trace_digest(FG) == trace_digest(out) == res.digest
    assert res.digest.token_rows == 284414
    meta_in = json.loads((FG / "meta.json").read_text())
    meta_out = json.loads((out / "meta.json").read_text())
    assert {k: v for k, v in meta_out.items() if k != "written_by"} == \
        {k: v for k, v in meta_in.items() if k != "written_by"}


def test_analyze_identical_on_compacted_trace(fg_compact):
    out, _ = fg_compact
    a, b = analyse_trace(FG), analyse_trace(out)
    assert a["meta"].pop("trace") != b["meta"].pop("trace")
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_request_order_kept_and_requests_come_with_their_tokens(tmp_path):
    out = tmp_path / "fg-small-shards.trace"
    compact_trace(FG, out, shard_tokens=100_000)
    assert len(shard_files(out)) == 3
    np.testing.assert_array_equal(read_requests(out).request_id, read_requests(FG).request_id)
    seen: set[int] = set()
    for f in shard_files(out):  # every token's request was written in its shard or an earlier one
        seen |= set(pq.read_table(str(f).replace(".tokens.", ".requests."), columns=["request_id"])
                    .column(0).to_pylist())
        rid = set(pq.read_table(f, columns=["request_id"]).column(0).to_pylist())
        assert rid <= seen


def _weights_trace(path: Path, shard_tokens: int) -> Path:
    rng = np.random.default_rng(3)
    meta = TraceMeta(model="hand-made", num_layers=2, num_experts=8, top_k=2, has_weights=True, synthetic=True,
                     source="tests (synthetic)")
    with TraceWriter(path, meta, shard_tokens=shard_tokens) as w:
        w.add_requests(np.arange(5) * 7, domain=["a", "b", "a", "b", "a"], prompt_len=[3] * 5, gen_len=[2] * 5)
        rid = np.repeat(np.arange(5) * 7, 5)
        ids = np.argsort(rng.random((25, 2, 8)), -1)[..., :2].astype(np.int16)
        w.add_tokens(rid, np.tile(np.arange(5), 5), np.tile([0, 0, 0, 1, 1], 5), ids,
                     rng.random((25, 2, 2)).astype(np.float16))
    return path


def test_weights_are_copied(tmp_path):
    src = _weights_trace(tmp_path / "w.trace", 4)
    out = tmp_path / "w-compact.trace"
    res = compact_trace(src, out)
    assert res.shards_in == 7 and res.shards_out == 1
    np.testing.assert_array_equal(read_trace(out).tokens.expert_weights, read_trace(src).tokens.expert_weights)


def test_digest_sees_one_changed_expert_id(tmp_path):
    src = _weights_trace(tmp_path / "w.trace", 100)
    d0 = trace_digest(src)
    f = shard_files(src)[0]
    t = pq.read_table(f)
    ids = np.array(t.column("expert_ids").combine_chunks().flatten())
    ids[0], ids[1] = ids[1], ids[0]  # swap a token's two experts: still valid, different content
    import pyarrow as pa

    col = pa.FixedSizeListArray.from_arrays(pa.array(ids, pa.int16()), 4)
    pq.write_table(t.set_column(t.schema.get_field_index("expert_ids"), "expert_ids", col), f)
    d1 = trace_digest(src)
    assert (d1.token_rows, d1.request_rows) == (d0.token_rows, d0.request_rows) and d1.sha256 != d0.sha256


def test_failed_verification_leaves_nothing(tmp_path):
    """The writer's verify step runs before the rename: when it raises, the output never appears."""
    src = _weights_trace(tmp_path / "w.trace", 100)
    out = tmp_path / "out.trace"

    def refuse(folder: Path) -> None:
        assert trace_digest(folder) == trace_digest(src)  # the finished copy is there to check...
        raise TraceError("refused by the test")  # ...and a failed check discards it

    tr = read_trace(src)
    with pytest.raises(TraceError, match="refused"):
        with TraceWriter(out, tr.meta, keep_partial=False, verify=refuse) as w:
            w.add_requests(tr.requests.request_id, tr.requests.domain, tr.requests.source, tr.requests.prompt_len,
                           tr.requests.gen_len)
            tk = tr.tokens
            w.add_tokens(tk.request_id, tk.position, tk.phase, tk.expert_ids, tk.expert_weights)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.trace"]


def test_kill_mid_run_loses_nothing_and_rerun_cleans_up(tmp_path):
    out = tmp_path / "fg.trace"
    before = _tree(FG)
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "moeplace", "trace", "compact", str(FG), str(out),
                             "--shard-tokens", "20000"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    building: list[Path] = []
    while time.time() < deadline and proc.poll() is None:  # kill once the copy is half built
        building = [p for p in tmp_path.iterdir() if p.name.startswith(".fg.trace.new-")]
        if building and len(list(building[0].glob("part-*.tokens.parquet"))) >= 3:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "compact finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert building and building[0].exists()
    assert not out.exists() and _tree(FG) == before
    res = compact_trace(FG, out, shard_tokens=100_000)  # a rerun removes the dead run's build folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fg.trace"]
    assert res.digest == trace_digest(FG)


def test_cli_refuses_bad_inputs_with_one_line(tmp_path):
    assert_clean_failure(run_cli(["trace", "compact", FG, FG], tmp_path), ["input"])
    assert_clean_failure(run_cli(["trace", "compact", tmp_path / "nope.trace", tmp_path / "o.trace"], tmp_path),
                         ["nope.trace"])
    inc = _weights_trace(tmp_path / "inc.trace", 100)
    meta = json.loads((inc / "meta.json").read_text())
    (inc / "meta.json").write_text(json.dumps({**meta, "complete": False}))
    assert_clean_failure(run_cli(["trace", "compact", inc, tmp_path / "o.trace"], tmp_path), ["incomplete"])
    src = _weights_trace(tmp_path / "w.trace", 100)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("not a trace")
    assert_clean_failure(run_cli(["trace", "compact", src, tmp_path / "full", "--overwrite"], tmp_path),
                         ["not written by moeplace"])
    assert (tmp_path / "full" / "keep.txt").read_text() == "not a trace"
    ok = run_cli(["trace", "compact", src, tmp_path / "ok.trace"], tmp_path)
    assert ok.returncode == 0 and "verified" in ok.stdout
