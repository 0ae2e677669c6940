"""What a trace keeps and what it never keeps (docs/PRIVACY.md): importers drop token ids and text and say so; the
counts-only capture keeps per-window counts only, enough for eplb; operate's HTTP server listens on loopback
unless told otherwise and serves nothing that identifies a request.

Every check reads the written files back independently (pyarrow, raw bytes, /proc/net/tcp, the served bodies),
not through moeplace's reader.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import shared_data

from moeplace.cli import main

FIXTURES = Path(__file__).parent / "fixtures"
VLLM_032 = FIXTURES / "vllm_routed_0.32.jsonl"
SGL_PER_TOKEN = FIXTURES / "sglang_per_token_0.5.23.pt"

# Every column a trace file may hold (docs/TRACE_FORMAT.md): none of them is a token id or text.
TOKEN_COLUMNS = {"request_id", "position", "phase", "expert_ids", "expert_weights"}
REQUEST_COLUMNS = {"request_id", "domain", "source", "prompt_len", "gen_len"}
COUNT_COLUMNS = {"group", "domain", "phase", "num_tokens", "counts"}
# Planted token ids: no expert id (< 32), position, length or request number of these small traces comes near them.
PLANTED = [48611, 27183, 31415, 9265, 35897, 32384, 62643, 38327, 9502, 28841, 19716, 39937]


def _columns(trace: Path) -> dict[str, set[str]]:
    """Column names of every Parquet file of ``trace``, read with pyarrow."""
    return {f.name: set(pq.read_schema(f).names) for f in sorted(trace.glob("*.parquet"))}


def _values(trace: Path) -> tuple[list[np.ndarray], list[str]]:
    """Every numeric column of every Parquet file of ``trace``, flattened (lists too), and every string value."""
    nums, strs = [], []
    for f in sorted(trace.glob("*.parquet")):
        t = pq.read_table(f)
        for name in t.column_names:
            col = t.column(name).combine_chunks()
            while pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type):
                col = col.flatten()
            vals = col.to_pylist()
            if vals and isinstance(vals[0], str):
                strs += vals
            else:
                nums.append(np.asarray(vals, dtype=np.float64))
    return nums, strs


def _has_run(a: np.ndarray, seq: list[int]) -> bool:
    """Whether ``seq`` occurs as consecutive entries of ``a``."""
    n = len(seq)
    if len(a) < n:
        return False
    win = np.lib.stride_tricks.sliding_window_view(a, n)
    return bool((win == np.asarray(seq, np.float64)).all(axis=1).any())


def _byte_forms(seq: list[int]) -> list[bytes]:
    """``seq`` as the bytes a file could hold it in: little-endian integers of every width, and decimal text."""
    forms = [np.asarray(seq, dt).tobytes() for dt in ("<u2", "<i4", "<i8")]
    forms += [", ".join(map(str, seq)).encode(), ",".join(map(str, seq)).encode()]
    return forms


def assert_no_token_ids(trace: Path, seqs: list[list[int]]) -> None:
    """No column beyond the documented ones, and none of ``seqs`` (token id sequences of the source) in any
    decoded column, in meta.json or in the raw bytes of any file of the trace."""
    cols = _columns(trace)
    assert cols, f"{trace}: no Parquet files"
    for name, c in cols.items():
        allowed = (REQUEST_COLUMNS if name.endswith(".requests.parquet") else
                   TOKEN_COLUMNS if name.endswith(".tokens.parquet") else COUNT_COLUMNS)
        assert c <= allowed, f"{name}: unexpected columns {sorted(c - allowed)}"
    nums, strs = _values(trace)
    blobs = [p.read_bytes() for p in trace.iterdir() if p.is_file()]
    for seq in seqs:
        # four consecutive ids already identify the run: the four with the largest smallest id, so that no expert
        # id, position, length or request number of a small trace can be mistaken for them
        probe = max((seq[i:i + 4] for i in range(len(seq) - 3)), key=min)
        assert not any(_has_run(a, probe) for a in nums), f"token ids {probe} found in a column of {trace}"
        text = ", ".join(map(str, probe))
        assert not any(text in s or ",".join(map(str, probe)) in s for s in strs)
        for form in _byte_forms(probe):
            assert not any(form in b for b in blobs), f"token ids {probe} found in the bytes of {trace}"


# --------------------------------------------------------------------------------------------------- importers


def test_vllm_import_keeps_no_token_ids(tmp_path, capsys):
    """The real vLLM 0.32 fixture with its prompt_token_ids / output_token_ids replaced by planted ids: the trace
    holds their lengths only, and the command says what it left out."""
    rows = [json.loads(x) for x in VLLM_032.read_text().splitlines() if x.strip()]
    seqs, k = [], 0
    for r in rows:
        for key in ("prompt_token_ids", "output_token_ids"):
            n = len(r[key])
            r[key] = [PLANTED[(k + i) % len(PLANTED)] for i in range(n)]
            seqs.append(r[key])
            k += 1
        r["prompt"] = "PLANTED-PROMPT-TEXT the password is hunter2"
    src = tmp_path / "routed.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "v.trace"
    assert main(["trace", "import", "--format", "vllm-routed", str(src), str(out)]) == 0
    err = capsys.readouterr().err
    assert "not imported" in err and "prompt_token_ids" in err and "output_token_ids" in err
    meta = json.loads((out / "meta.json").read_text())
    assert "prompt_token_ids" in meta["extra"]["not_imported"]
    assert_no_token_ids(out, seqs)
    assert not any(b"hunter2" in p.read_bytes() for p in out.iterdir())
    # the lengths are what is kept
    req = pq.read_table(out / "part-00000.requests.parquet").to_pydict()
    assert req["prompt_len"] == [len(r["prompt_token_ids"]) for r in rows]
    assert req["gen_len"] == [len(r["output_token_ids"]) for r in rows]


def test_sglang_per_token_import_keeps_no_input_ids(tmp_path, capsys):
    """SGLang 0.5.23's own per_token dump (input_ids next to topk_ids in every record), once as committed and once
    with planted input_ids: no column and no byte of the trace holds them."""
    import torch

    d = torch.load(SGL_PER_TOKEN, weights_only=True)
    assert all("input_ids" in r for r in d["records"])
    seqs = []
    for j, r in enumerate(d["records"]):
        r["input_ids"] = [PLANTED[(j + i) % len(PLANTED)] for i in range(len(r["input_ids"]))]
        if len(r["input_ids"]) >= 4:
            seqs.append(r["input_ids"])
    assert seqs
    planted = tmp_path / "expert_distribution_recorder_0.pt"
    torch.save(d, planted)
    for src in (SGL_PER_TOKEN, planted):
        out = tmp_path / f"{src.stem}.trace"
        assert main(["trace", "import", "--format", "sglang-per-token", str(src), str(out)]) == 0
        err = capsys.readouterr().err
        assert "not imported" in err and "input_ids" in err
        assert "input_ids" in json.loads((out / "meta.json").read_text())["extra"]["not_imported"]
        assert_no_token_ids(out, seqs)


@pytest.mark.shared_data
def test_gpt_oss_import_keeps_no_prompt_text(tmp_path, capsys):
    """The published gpt-oss-20b data carries each prompt's text and the generated tokens; the trace keeps neither."""
    src = shared_data("gpt-oss-20b")
    with open(src / "decode_routing_meta.jsonl") as fh:
        first = [json.loads(next(fh)) for _ in range(2)]
    out = tmp_path / "g.trace"
    assert main(["trace", "import", "--format", "gpt-oss-npz", str(src), str(out), "--limit", "2"]) == 0
    assert "original_prompt" in capsys.readouterr().err
    _, strs = _values(out)
    blobs = [p.read_bytes() for p in out.iterdir() if p.is_file()]
    for r in first:
        prompt = r["original_prompt"].strip()[:40]
        generated = "".join(r["generated_tokens"][4:14])
        for snippet in (prompt, generated):
            assert len(snippet) >= 10
            assert not any(snippet in s for s in strs)
            assert not any(snippet.encode() in b for b in blobs)


def test_every_importer_says_what_it_leaves_out():
    from moeplace.trace.importers import IMPORTERS, NOTHING_NOT_IMPORTED, not_imported

    for name, f in IMPORTERS.items():
        assert not_imported(name)
        if not f.counts_only:  # every per-token format carries token content next to the routing
            assert f.not_imported and not_imported(name) != NOTHING_NOT_IMPORTED, name
    assert "input_ids" in not_imported("sglang-per-token")
    assert "prompt_token_ids" in not_imported("vllm-routed")


# --------------------------------------------------------------------------------------------------- counts-only


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The bundled reference model on its first 10 held-out prompts (3 new tokens each), recorded twice the same
    way: per token, and with ``--counts-only 4`` (windows of 4, 4 and 2 requests)."""
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("rec")
    common = ["trace", "record", "--model", "reference", "--prompts", "builtin", "--max-new-tokens", "3",
              "--max-requests", "10", "--no-weights"]
    assert main([*common, str(d / "tokens.trace")]) == 0
    assert main([*common, "--counts-only", "4", str(d / "counts.trace")]) == 0
    return d / "tokens.trace", d / "counts.trace"


def _token_rows(trace: Path) -> dict[str, np.ndarray]:
    """The per-token trace's rows, read with pyarrow: request_id, phase [T], expert_ids [T, L*K]."""
    t = pq.read_table(sorted(trace.glob("*.tokens.parquet")))
    K = json.loads((trace / "meta.json").read_text())["top_k"]
    ids = np.asarray(t.column("expert_ids").combine_chunks().flatten()).reshape(t.num_rows, -1)
    return {"request_id": np.asarray(t.column("request_id")), "phase": np.asarray(t.column("phase")),
            "expert_ids": ids, "K": K}


def test_counts_only_record_keeps_per_window_counts_only(recorded):
    """--counts-only 4: one count row per window and phase, equal to the per-token recording's selections counted
    with bincount over the same windows; no token rows, no request rows, nothing per request."""
    tokens, counts = recorded
    meta = json.loads((counts / "meta.json").read_text())
    assert meta["kind"] == "counts" and not meta["has_weights"] and meta["extra"]["counts_window_requests"] == 4
    assert not list(counts.glob("*.tokens.parquet"))
    assert sum(pq.read_metadata(f).num_rows for f in counts.glob("*.requests.parquet")) == 0
    cols = _columns(counts)
    assert all(c == COUNT_COLUMNS for n, c in cols.items() if n.endswith(".counts.parquet"))
    got = pq.read_table(sorted(counts.glob("*.counts.parquet"))).to_pydict()
    tok = _token_rows(tokens)
    L, E = meta["num_layers"], meta["num_experts"]
    rids = np.unique(tok["request_id"])
    assert len(rids) == 10
    window = {int(r): i // 4 for i, r in enumerate(np.sort(rids))}
    want = {}
    for w in range(3):
        for p in (0, 1):
            m = np.array([window[int(r)] == w for r in tok["request_id"]]) & (tok["phase"] == p)
            layer = np.repeat(np.arange(L), tok["K"])[None, :]  # column j of the [T, L*K] row is layer j // K
            c = np.zeros((L, E))
            np.add.at(c, (np.broadcast_to(layer, tok["expert_ids"][m].shape), tok["expert_ids"][m]), 1)
            want[(f"window{w}", p)] = (int(m.sum()), c)
    assert sorted(zip(got["group"], got["phase"], strict=True)) == sorted(want)
    for g, p, n, c in zip(got["group"], got["phase"], got["num_tokens"], got["counts"], strict=True):
        assert n == want[(g, p)][0]
        np.testing.assert_array_equal(np.asarray(c).reshape(L, E), want[(g, p)][1])
    # the only strings are the window names and the windows' domains: no request id, source or length
    _, strs = _values(counts)
    assert set(strs) <= {f"window{w}" for w in range(3)} | {"code", "chat", "general", "math", "mixed", "unknown"}


def test_trace_record_keeps_no_token_ids(recorded):
    """Neither recording holds the prompts' token ids (the recorder reads them to find EOS, and drops them)."""
    from moeplace.models.reference import builtin_prompts, load_reference

    _, tokenizer = load_reference()
    seqs = [tokenizer(r["prompt"])["input_ids"] for r in builtin_prompts()[:10]]
    seqs = [q for q in seqs if len(q) >= 4 and min(max((q[i:i + 4] for i in range(len(q) - 3)), key=min)) > 256]
    assert len(seqs) >= 8  # ids above 256: beyond every expert id, position and length of these traces
    for trace in recorded:
        assert_no_token_ids(trace, seqs)


def test_eplb_plans_from_a_counts_only_recording(recorded, tmp_path):
    """plan --strategy eplb on the counts-only trace gives the placement eplb gives for the load counted from the
    per-token recording (every row, with bincount)."""
    tokens, counts = recorded
    tok = _token_rows(tokens)
    meta = json.loads((tokens / "meta.json").read_text())
    L, E = meta["num_layers"], meta["num_experts"]
    load = np.zeros((L, E))
    layer = np.repeat(np.arange(L), tok["K"])
    for row in tok["expert_ids"]:
        np.add.at(load, (layer, row), 1)
    (tmp_path / "load.json").write_text(json.dumps(load.tolist()))
    opts = ["--strategy", "eplb", "--cluster", "2x4", "--redundant", "8"]
    assert main(["plan", str(counts), *opts, "--out", str(tmp_path / "from_counts.json")]) == 0
    assert main(["plan", "--load", str(tmp_path / "load.json"), *opts, "--out", str(tmp_path / "from_load.json")]) == 0
    a = json.loads((tmp_path / "from_counts.json").read_text())
    b = json.loads((tmp_path / "from_load.json").read_text())
    assert a["phy2log"] == b["phy2log"] and a["num_slots"] == E + 8
    assert sorted(set(np.asarray(a["phy2log"]).ravel().tolist())) == list(range(E))


def test_counts_sink_windows_domains_and_late_tokens(tmp_path):
    """CountsSink on hand-made (synthetic) rows: arrival order makes the windows, a window of two domains is
    'mixed', and tokens of a request whose window was already written are refused."""
    from moeplace.trace import TraceError, TraceMeta, TraceWriter, read_counts
    from moeplace.trace.capture_counts import CountsSink, counts_meta

    meta = counts_meta(TraceMeta(model="hand-made", num_layers=2, num_experts=4, top_k=2, synthetic=True), 2)
    ids = np.array([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[3, 0], [1, 2]]])  # [3 tokens, L=2, K=2]
    with TraceWriter(tmp_path / "c.trace", meta) as w:
        sink = CountsSink(w, 2)
        sink.add_requests([10, 11, 12], domain=["code", "math", "code"])
        sink.add_tokens([10, 11, 12], [0, 0, 0], [0, 0, 1], ids)
        sink.flush()  # window 0 (requests 10, 11) is full and written; window 1 (request 12) stays open
        with pytest.raises(TraceError, match="request 10 has no request row in an open window"):
            sink.add_tokens([10], [1], [1], ids[:1])
        sink.close()
    c = read_counts(tmp_path / "c.trace")
    assert c.group.tolist() == ["window0", "window1"] and c.domain.tolist() == ["mixed", "code"]
    assert c.phase.tolist() == [0, 1] and c.num_tokens.tolist() == [2.0, 1.0]
    np.testing.assert_array_equal(c.counts[0], [[1, 2, 1, 0], [1, 0, 1, 2]])
    np.testing.assert_array_equal(c.counts[1], [[1, 0, 0, 1], [0, 1, 1, 0]])


# --------------------------------------------------------------------------------------------------- operate's server

SECRET_IDS = [7340033 + 97 * i for i in range(24)]  # request ids no served number could equal by chance


@pytest.fixture(scope="module")
def secret_trace(tmp_path_factory):
    """A synthetic per-token trace (gpt-oss-20b's E=32, k=4; 2 layers) whose request ids and sources are
    distinctive, so a served body that leaked them would show it."""
    from moeplace.trace import TraceMeta, TraceWriter

    rng = np.random.default_rng(5)
    path = tmp_path_factory.mktemp("srv") / "secret.trace"
    meta = TraceMeta(model="synthetic-privacy", num_layers=2, num_experts=32, top_k=4, synthetic=True,
                     source="tests/test_privacy.py (synthetic)")
    with TraceWriter(path, meta) as w:
        n = len(SECRET_IDS)
        w.add_requests(SECRET_IDS, domain=["code", "math"] * (n // 2),
                       source=[f"secret-src-{i}-XQ" for i in range(n)], prompt_len=[6] * n, gen_len=[3] * n)
        rid = np.repeat(SECRET_IDS, 9)
        pos = np.tile(np.arange(9), n)
        ph = np.tile(np.r_[np.zeros(6), np.ones(3)].astype(np.int8), n)
        ids = np.argsort(rng.random((len(rid), 2, 32)), axis=2)[:, :, :4]
        w.add_tokens(rid, pos, ph, ids)
    return path


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on, from /proc (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
        except OSError:
            continue
        if m:
            inodes.add(m.group(1))
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = f[1].split(":")
            raw = bytes.fromhex(addr)
            if v6:  # four little-endian 32-bit words
                import ipaddress

                ip = str(ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))))
            else:
                ip = ".".join(str(b) for b in raw[::-1])
            out.append((ip, int(port, 16)))
    return out


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def _serve(trace: Path, *extra: str):
    """``moeplace operate`` on ``trace`` with its metrics server (port 0), in its own process, as a user runs it:
    returns (process, base URL) once its JSON state says the loop is done."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "moeplace", "operate", str(trace), "--cluster", "2x4", "--redundant", "8",
         "--model-preset", "gpt-oss-20b", "--window-requests", "8", "--decode-batch", "8", "--sample-every", "1",
         "--policy", "periodic", "--period-steps", "4", "--metrics-port", "0", "--linger", "120", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = None
    for line in proc.stdout:
        m = re.match(r"metrics on (http://\S+)/metrics", line)
        if m:
            url = m.group(1)
            break
    assert url, proc.stderr.read()
    deadline = time.monotonic() + 60
    while not json.loads(_get(f"{url}/api/state")).get("done"):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    return proc, url


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _keys(obj) -> set[str]:
    if isinstance(obj, dict):
        return set(obj) | set().union(*(_keys(v) for v in obj.values()))
    if isinstance(obj, list):
        return set().union(*(_keys(v) for v in obj)) if obj else set()
    return set()


def test_operate_server_listens_on_loopback_and_serves_no_request_data(secret_trace):
    """The real ``moeplace operate`` process: its only listening socket is 127.0.0.1:PORT; /metrics carries only
    the gpu and domain labels; /metrics, /api/state and / hold no request id, no source, no per-request key."""
    from prometheus_client.parser import text_string_to_metric_families

    proc, url = _serve(secret_trace)
    try:
        port = int(url.rsplit(":", 1)[1])
        assert _listening(proc.pid) == [("127.0.0.1", port)]
        bodies = {p: _get(f"{url}{p}").decode() for p in ("/metrics", "/api/state", "/")}
    finally:
        _stop(proc)
    labels = {}
    for fam in text_string_to_metric_families(bodies["/metrics"]):
        for smp in fam.samples:
            for k, v in smp.labels.items():
                labels.setdefault(k, set()).add(v)
    assert set(labels) == {"gpu", "domain"}
    assert labels["domain"] == {"code", "math"} and labels["gpu"] == {str(g) for g in range(8)}
    state = json.loads(bodies["/api/state"])
    assert state["done"] and state["windows"] == 3
    assert not _keys(state) & {"request_id", "request_ids", "source", "sources", "prompt_len", "gen_len",
                               "position", "positions", "prompt", "requests"}
    for body in bodies.values():
        assert "secret-src" not in body
        assert not any(str(r) in body for r in SECRET_IDS)


def test_operate_metrics_host_flag(secret_trace, capsys):
    """--metrics-host binds the address it names (127.0.0.2, another loopback address, so nothing is exposed);
    without --metrics-port, or empty, it is refused with one line."""
    proc, url = _serve(secret_trace, "--metrics-host", "127.0.0.2")
    try:
        assert url.startswith("http://127.0.0.2:")
        assert _listening(proc.pid) == [("127.0.0.2", int(url.rsplit(":", 1)[1]))]
        assert b"moeplace_balancedness_ratio" in _get(f"{url}/metrics")
    finally:
        _stop(proc)
    assert main(["operate", str(secret_trace), "--cluster", "2x4", "--model-preset", "gpt-oss-20b",
                 "--metrics-host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--metrics-host" in err and "--metrics-port" in err and len(err.strip().splitlines()) == 1
    assert main(["operate", str(secret_trace), "--cluster", "2x4", "--model-preset", "gpt-oss-20b",
                 "--metrics-port", "0", "--metrics-host", ""]) == 2
    assert "--metrics-host: empty" in capsys.readouterr().err
    import socket

    with socket.socket() as busy:  # a port in use, an unknown name: refused before the stream is opened
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        for host, port in (("127.0.0.1", busy.getsockname()[1]), ("no-such-host.invalid", 0)):
            assert main(["operate", str(secret_trace), "--cluster", "2x4", "--model-preset", "gpt-oss-20b",
                         "--metrics-port", str(port), "--metrics-host", host]) == 2
            out, err = capsys.readouterr()
            assert f"--metrics-host {host} --metrics-port {port}: cannot listen there" in err
            assert len(err.strip().splitlines()) == 1 and "stream:" not in out


def test_loopback_addresses():
    """What operate treats as this-machine-only (a note on stderr for anything else)."""
    from moeplace.operate.metrics import DEFAULT_HOST, is_loopback

    assert DEFAULT_HOST == "127.0.0.1"
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "192.168.1.5", "example.org"]))
