"""Output safety and kills, through the real command line (``python -m moeplace`` in a subprocess).

- ``--overwrite`` replaces only a moeplace trace that holds no input; everything else is refused with exit 2.
- A bad output path (a directory, a parent that is a file) is one line on stderr, exit 2, before any work.
- Importers refuse wrapped, fractional, NaN, deeply nested and pickled-code input, naming the file.
- kill -9 of import, synth, record and analyze --html loses nothing that existed or was flushed before the kill,
  and the next run removes the hidden leftovers.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moeplace.io import atomic_write_text
from moeplace.trace import TraceMeta, TraceWriter, read_trace, trace_info

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", **extra}


def moeplace(*args: str, **popen) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeplace", *map(str, args)], capture_output=True, text=True,
                          env=_env(), timeout=TIMEOUT_S, **popen)


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moeplace", *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=_env())


def one_line_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, no traceback, one line on stderr containing every needle; returns the line."""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and len(lines) == 1, res.stderr[-3000:]
    for n in needles:
        assert n.lower() in lines[0].lower(), lines[0]
    return lines[0]


def wait_for(pred, proc: subprocess.Popen, what: str, timeout: float = TIMEOUT_S) -> None:
    t0 = time.time()
    while not pred():
        if proc.poll() is not None:
            pytest.fail(f"process ended (rc {proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}")
        if time.time() - t0 > timeout:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def small_trace(path: Path, n_req: int = 4) -> None:
    meta = TraceMeta(model="m", num_layers=2, num_experts=8, top_k=2, hidden_size=16)
    rng = np.random.default_rng(0)
    with TraceWriter(path, meta) as w:
        w.add_requests(np.arange(n_req), prompt_len=[3] * n_req, gen_len=[2] * n_req)
        n = 5 * n_req
        ids = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(2)]) for _ in range(n)])
        w.add_tokens(np.repeat(np.arange(n_req), 5), np.tile(np.arange(5), n_req),
                     np.tile([0, 0, 0, 1, 1], n_req), ids.astype(np.int16))


def olmoe_npz(path: Path) -> Path:
    rng = np.random.default_rng(1)
    np.savez(path, expert_counts__github=rng.integers(0, 100, (3, 64)).astype(np.float64),
             expert_counts__c4=rng.integers(0, 100, (3, 64)).astype(np.float64))
    return path


# ------------------------------------------------------------------------------------------- --overwrite


def test_overwrite_never_deletes_the_folder_holding_the_input(tmp_path):
    data = tmp_path / "DATA"
    data.mkdir()
    src = olmoe_npz(data / "olmoe.npz")
    (data / "unrelated.txt").write_text("keep me\n")
    res = moeplace("trace", "import", "--format", "olmoe-npz", src, data, "--overwrite")
    one_line_error(res, str(data), "input")
    assert sorted(p.name for p in data.iterdir()) == ["olmoe.npz", "unrelated.txt"]


def test_overwrite_refuses_a_folder_moeplace_did_not_write(tmp_path):
    other = tmp_path / "photos"
    other.mkdir()
    (other / "a.jpg").write_bytes(b"\xff\xd8")
    res = moeplace("trace", "import", "--format", "olmoe-npz", olmoe_npz(tmp_path / "olmoe.npz"), other,
                   "--overwrite")
    one_line_error(res, str(other), "not written by moeplace")
    assert [p.name for p in other.iterdir()] == ["a.jpg"]


def test_overwrite_replaces_a_moeplace_trace_with_umask_modes(tmp_path):
    out = tmp_path / "o.trace"
    small_trace(out)
    res = subprocess.run([sys.executable, "-c", f"""
import os, sys
os.umask(0o027)
from moeplace.cli import main
sys.exit(main(["trace", "import", "--format", "olmoe-npz", {str(olmoe_npz(tmp_path / "olmoe.npz"))!r},
               {str(out)!r}, "--overwrite"]))
"""], capture_output=True, text=True, env=_env(), timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stderr
    assert trace_info(out)["kind"] == "counts"
    assert out.stat().st_mode & 0o777 == 0o750
    assert {f.stat().st_mode & 0o777 for f in out.iterdir()} == {0o640}
    assert hidden(tmp_path) == []


# ------------------------------------------------------------------------------------------- output paths


def test_bad_output_paths_fail_first_with_one_line(tmp_path):
    t = tmp_path / "t.trace"
    small_trace(t)
    (tmp_path / "adir").mkdir()
    one_line_error(moeplace("analyze", t, "--no-progress", "--json", tmp_path / "adir"), "adir", "is a directory")
    (tmp_path / "afile").write_text("x")
    one_line_error(moeplace("analyze", t, "--no-progress", "--html", tmp_path / "afile" / "r.html"),
                   "afile", "not a directory")


# ------------------------------------------------------------------------------------------- importers


def test_vllm_ids_do_not_wrap_and_fractions_are_refused(tmp_path):
    for name, ids in (("wrap", 2**31), ("frac", 1.5), ("neg", -2)):
        src = tmp_path / f"{name}.jsonl"
        src.write_text(json.dumps({"routed_experts": [[[0, ids]], [[1, 2]]]}) + "\n")
        one_line_error(moeplace("trace", "import", "--format", "vllm-routed", src, tmp_path / f"{name}.trace"),
                       src.name)
        assert not (tmp_path / f"{name}.trace").exists() and hidden(tmp_path) == []
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"routed_experts": ' + "[" * 100000 + "]" * 100000 + "}\n")
    one_line_error(moeplace("trace", "import", "--format", "vllm-routed", deep, tmp_path / "d.trace"),
                   "deep.jsonl", "nested too deeply")


def test_sglang_nan_text_and_malicious_pickle(tmp_path):
    import torch

    nan = tmp_path / "stat.pt"
    c = torch.zeros((2, 3, 4))
    c[0, 1, 2] = float("nan")
    c[1, 0, 0] = 5
    torch.save({"rank": 0, "logical_count": c}, nan)
    one_line_error(moeplace("trace", "import", "--format", "sglang-stat", nan, tmp_path / "n.trace"),
                   "stat.pt", "nan")
    text = tmp_path / "notes.pt"
    text.write_text("this is not a torch file\n")
    one_line_error(moeplace("trace", "import", "--format", "sglang-stat", text, tmp_path / "t.trace"),
                   "notes.pt", "not a readable torch.save file")

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps({"logical_count": Evil()}))
    one_line_error(moeplace("trace", "import", "--format", "sglang-stat", evil, tmp_path / "e.trace"),
                   "evil.pt", "would run code")
    assert not marker.exists()


def test_negative_max_request_bytes(tmp_path):
    t = tmp_path / "t.trace"
    small_trace(t)
    one_line_error(moeplace("analyze", t, "--no-progress", "--max-request-bytes", "-5"), "--max-request-bytes")


# ------------------------------------------------------------------------------------------- kill -9


def _vllm_jsonl(path: Path, n_req: int) -> None:
    rng = np.random.default_rng(0)
    with open(path, "w") as fh:
        for r in range(n_req):
            ids = np.argsort(rng.random((24, 4, 16)), axis=2)[:, :, :2]
            fh.write(json.dumps({"request_id": f"r{r}", "prompt_len": 16, "gen_len": 9,  # 16 + 9 - 1 = 24 rows
                                 "routed_experts": ids.tolist()}) + "\n")


def test_kill9_import_keeps_the_old_trace_and_the_next_run_cleans_up(tmp_path):
    src = tmp_path / "big.jsonl"
    _vllm_jsonl(src, 6000)
    out = tmp_path / "o.trace"
    small_trace(out)
    before = read_trace(out)
    proc = start("trace", "import", "--format", "vllm-routed", src, out, "--overwrite")
    wait_for(lambda: any(n.startswith(".o.trace.new-") for n in hidden(tmp_path)), proc, "the build folder")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    after = read_trace(out)  # the old trace, whole
    np.testing.assert_array_equal(after.tokens.expert_ids, before.tokens.expert_ids)
    assert after.meta.complete and any(n.startswith(".o.trace.new-") for n in hidden(tmp_path))
    res = moeplace("trace", "import", "--format", "vllm-routed", src, out, "--overwrite")
    assert res.returncode == 0, res.stderr
    assert hidden(tmp_path) == [] and trace_info(out)["num_requests"] == 6000


def test_kill9_synth_leaves_nothing_and_reruns(tmp_path):
    out = tmp_path / "s.trace"
    args = ("synth", out, "--preset", "gpt-oss-20b", "--requests", "4000", "--prompt-len", "16", "--gen-len", "8",
            "--quiet")
    proc = start(*args)
    wait_for(lambda: any(n.startswith(".s.trace.new-") for n in hidden(tmp_path)), proc, "the build folder")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    small = ("synth", out, "--preset", "gpt-oss-20b", "--requests", "8", "--prompt-len", "4", "--gen-len", "4",
             "--quiet")
    res = moeplace(*small)
    assert res.returncode == 0, res.stderr
    assert hidden(tmp_path) == [] and trace_info(out)["num_requests"] == 8


def test_kill9_analyze_html_keeps_the_old_report(tmp_path):
    t = tmp_path / "t.trace"
    small_trace(t, 40)
    report = tmp_path / "report.html"
    for delay in (0.5, 2.0, 4.0):
        atomic_write_text("OLD REPORT\n", report)  # an old report moeplace wrote (its own files may be replaced)
        proc = start("analyze", t, "--no-progress", "--html", report)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        text = report.read_text()
        assert text == "OLD REPORT\n" or text.rstrip().endswith("</html>")
    res = moeplace("analyze", t, "--no-progress", "--html", report)
    assert res.returncode == 0 and report.read_text().rstrip().endswith("</html>")
    assert hidden(tmp_path) == []


# ------------------------------------------------------------------------------------------- record


def _reference_or_skip() -> None:
    try:
        from moeplace.models.reference import builtin_prompts

        builtin_prompts()
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(f"reference model not available: {e}")


def _check_partial(out: Path) -> int:
    tr = read_trace(out)
    assert not tr.meta.complete
    n = len(tr.requests)
    assert n >= 1
    for r, p, g in zip(tr.requests.request_id, tr.requests.prompt_len, tr.requests.gen_len, strict=True):
        assert (tr.tokens.request_id == r).sum() == p + g  # every flushed request is whole
    return n


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_record_keeps_what_was_flushed(tmp_path, sig):
    _reference_or_skip()
    out = tmp_path / "r.trace"
    proc = start("trace", "record", "--model", "reference", "--prompts", "builtin", "--max-new-tokens", "4",
                 "--batch-size", "1", "--flush-every", "1", out)
    wait_for(lambda: (out / "part-00001.tokens.parquet").exists(), proc, "the second shard")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=TIMEOUT_S)
    assert _check_partial(out) >= 2
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM and "terminated" in err and "Traceback" not in err


def test_record_refuses_prompts_beyond_the_model_positions(tmp_path):
    _reference_or_skip()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "word " * 2000}) + "\n")
    res = moeplace("trace", "record", "--model", "reference", "--prompts", prompts, "--max-new-tokens", "4",
                   tmp_path / "r.trace")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]  # model loading prints progress first
    assert "request 0: prompt of" in last and "max_position_embeddings" in last
    assert not (tmp_path / "r.trace").exists()


def test_record_on_a_device_this_machine_lacks(tmp_path):
    """``--device cuda:0`` on a CPU-only torch (or one GPU too many) is one line, before any model is loaded."""
    import torch

    dev = f"cuda:{torch.cuda.device_count()}"  # never present: one past the last GPU (cuda:0 on CPU machines)
    res = moeplace("trace", "record", "--model", "reference", "--prompts", "builtin", "--max-new-tokens", "2",
                   "--device", dev, tmp_path / "r.trace")
    one_line_error(res, f"--device {dev}")
    assert not (tmp_path / "r.trace").exists()


def test_kill9_plan_keeps_the_old_plan(tmp_path):
    """A plan killed mid-search leaves the plan file it would replace byte for byte, and no temporary beside it."""
    from moeplace.data import default_trace_path

    out = tmp_path / "p.json"
    first = moeplace("plan", default_trace_path(), "--strategy", "eplb", "--cluster", "2x2", "--redundant", "4",
                     "--out", out)
    assert first.returncode == 0, first.stderr
    before = out.read_bytes()
    p = start("plan", default_trace_path(), "--strategy", "joint", "--objective", "bytes", "--search-evals",
              "100000", "--cluster", "2x2", "--redundant", "4", "--out", out)
    time.sleep(8)  # well inside the search (100k evaluated moves per layer take minutes)
    p.kill()
    p.wait(timeout=30)
    assert out.read_bytes() == before
    assert sorted(x.name for x in tmp_path.iterdir()) == ["p.json"]


def write_empty_trace(path) -> None:
    """A per-token trace with no token rows (what a killed import can leave behind)."""
    from moeplace.trace.types import Requests, TokenChunk, Trace, TraceMeta
    from moeplace.trace.writer import write_trace

    meta = TraceMeta(model="m", num_layers=2, num_experts=8, top_k=2, hidden_size=16)
    req = Requests(np.zeros(0, np.int64), np.zeros(0, object), np.zeros(0, object), np.zeros(0, np.int32),
                   np.zeros(0, np.int32))
    tok = TokenChunk(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int8), np.zeros((0, 2, 2), np.int16))
    write_trace(path, Trace(meta, req, tok, None))


def test_plan_from_an_empty_trace_is_refused(tmp_path):
    """A trace with no token rows (e.g. left by a killed import) gives no plan, one line, exit 2."""
    write_empty_trace(tmp_path / "e.trace")
    for strategy in ("linear", "eplb", "joint"):
        res = moeplace("plan", tmp_path / "e.trace", "--strategy", strategy, "--cluster", "2x2", "--out",
                       tmp_path / "p.json")
        one_line_error(res, "no routed tokens")
        assert not (tmp_path / "p.json").exists()


def test_operate_on_an_empty_trace_is_refused(tmp_path):
    """operate over a stream without token rows is one line, exit 2, and writes no summary."""
    write_empty_trace(tmp_path / "e.trace")
    res = moeplace("operate", tmp_path / "e.trace", "--cluster", "2x2", "--model-preset", "gpt-oss-20b",
                   "--model-sizes-meant", "--json", tmp_path / "o.json")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "no routed tokens" in res.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "o.json").exists()
