"""Fault injection: generated bad traces given to the real command line under a 2 GB address-space cap.

Every case starts from a valid trace written by moeplace, breaks one thing (flipped bytes, truncation, lying
Parquet footers, wrong types, absurd sizes, files of the wrong kind), and runs ``python -m moeplace trace info``
and ``python -m moeplace analyze`` on it. Each run must end with exit 0 and the right numbers, or exit 2 with one
line on stderr naming the broken file; never a traceback, a crash, a hang (timeout) or an exhausted memory cap.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from harness import ForkServer

from moeplace.trace import TraceMeta, TraceWriter

REPO = Path(__file__).resolve().parents[2]
AS_CAP = 2 << 30  # bytes of address space each run may map
TIMEOUT_S = 240
L, E, K = 2, 8, 2
N_REQ, PROMPT, GEN = 6, 5, 4
SHARD_TOKENS = 20


def _limit_memory() -> None:  # runs in the child before exec
    resource.setrlimit(resource.RLIMIT_AS, (AS_CAP, AS_CAP))


def run_cli(*args: str, cwd: Path | None = None, preexec=_limit_memory) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
    env.pop("MOEPLACE_MEMORY_BUDGET", None)
    return subprocess.run([sys.executable, "-m", "moeplace", *args], capture_output=True, text=True, env=env,
                          timeout=TIMEOUT_S, preexec_fn=preexec, cwd=cwd)


# --------------------------------------------------------------------------------------------- valid traces


def write_tokens_trace(path: Path) -> dict:
    """A valid per-token trace (3 shards); returns the expected ``trace info`` numbers."""
    rng = np.random.default_rng(7)
    meta = TraceMeta(model="fault-base", num_layers=L, num_experts=E, top_k=K, hidden_size=16, source="tests")
    rid, pos, ph = [], [], []
    for r in range(N_REQ):
        rid += [r] * (PROMPT + GEN)
        pos += list(range(PROMPT + GEN))
        ph += [0] * PROMPT + [1] * GEN
    T = len(rid)
    ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(T)])
    with TraceWriter(path, meta, shard_tokens=SHARD_TOKENS) as w:
        w.add_requests(np.arange(N_REQ), domain=["code", "math"] * (N_REQ // 2), prompt_len=[PROMPT] * N_REQ,
                       gen_len=[GEN] * N_REQ)
        w.add_tokens(rid, pos, ph, ids.astype(np.int16))
    return {"num_requests": N_REQ, "num_tokens": {"prefill": N_REQ * PROMPT, "decode": N_REQ * GEN}}


def write_counts_trace(path: Path) -> dict:
    meta = TraceMeta(model="fault-counts", num_layers=L, num_experts=E, top_k=K, kind="counts", source="tests")
    counts = np.arange(3 * L * E, dtype=np.float64).reshape(3, L, E)
    with TraceWriter(path, meta) as w:
        w.add_counts(["a", "b", "c"], ["code", "math", "chat"], np.array([0, 1, 1], np.int8),
                     np.array([10.0, 20.0, np.nan]), counts)
    return {"num_requests": 0, "num_tokens": {"prefill": 10.0, "decode": 20.0}}


# --------------------------------------------------------------------------------------------- mutations


def _meta(t: Path, **changes) -> None:
    d = json.loads((t / "meta.json").read_text())
    d.update(changes)
    (t / "meta.json").write_text(json.dumps(d))


def _meta_raw(t: Path, text: str) -> None:
    (t / "meta.json").write_text(text)


def _shard(t: Path, i: int = 0, kind: str = "tokens") -> Path:
    return t / f"part-{i:05d}.{kind}.parquet"


def _flip(f: Path, where: float, n: int = 4, seed: int = 0) -> None:
    b = bytearray(f.read_bytes())
    rng = np.random.default_rng(seed)
    at = int(where * (len(b) - 1))
    for j in range(n):
        k = min(len(b) - 1, at + j * 3)
        b[k] ^= int(rng.integers(1, 256))
    f.write_bytes(bytes(b))


def _truncate(f: Path, keep: float) -> None:
    b = f.read_bytes()
    f.write_bytes(b[: int(len(b) * keep)])


def _varint(n: int) -> bytes:
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while True:
        if z < 0x80:
            out.append(z)
            return bytes(out)
        out.append((z & 0x7F) | 0x80)
        z >>= 7


def _lie_rows(f: Path, claim: int, every: bool = True) -> None:
    """Rewrite the Thrift footer so it claims ``claim`` rows (every i64 field equal to the row count, or only the
    first: the file's total, leaving the row groups' counts as they were)."""
    data = f.read_bytes()
    flen = int.from_bytes(data[-8:-4], "little")
    body, footer = data[: -8 - flen], data[-8 - flen:-8]
    n = pq.ParquetFile(f).metadata.num_rows
    old, new = b"\x16" + _varint(n), b"\x16" + _varint(claim)
    assert old in footer
    footer = footer.replace(old, new) if every else footer.replace(old, new, 1)
    f.write_bytes(body + footer + len(footer).to_bytes(4, "little") + b"PAR1")


def _rewrite(f: Path, fn) -> None:
    t = pq.read_table(f)
    pq.write_table(fn(t), f)


def _set_col(t: pa.Table, name: str, arr) -> pa.Table:
    return t.set_column(t.schema.get_field_index(name), name, arr)


def _ids_with(t: pa.Table, fn) -> pa.Table:
    ids = t.column("expert_ids").combine_chunks().flatten().to_numpy().reshape(t.num_rows, L, K).copy()
    fn(ids)
    return _set_col(t, "expert_ids", pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), L * K))


def _counts_with(t: pa.Table, fn) -> pa.Table:
    c = t.column("counts").combine_chunks().flatten().to_numpy().copy()
    fn(c)
    return _set_col(t, "counts", pa.FixedSizeListArray.from_arrays(pa.array(c), L * E))


def _replace_with_dir(f: Path) -> None:
    f.unlink()
    f.mkdir()


def _fifo_meta(t: Path) -> None:
    (t / "meta.json").unlink()
    os.mkfifo(t / "meta.json")


def _link_meta(t: Path, target: str) -> None:
    (t / "meta.json").unlink()
    os.symlink(target, t / "meta.json")


@dataclass(frozen=True)
class Case:
    name: str
    mutate: object  # (trace path) -> None
    expect: str  # "error", "ok" or "any" (exit 0 or 2; for random byte flips)
    names: str = "meta.json"  # file the error message must name
    kind: str = "tokens"
    info: str = ""  # what ``trace info`` must do when it differs from ``expect`` (it does not decode routing)


S0 = "part-00000.tokens.parquet"
R0 = "part-00000.requests.parquet"
C0 = "part-00000.counts.parquet"

CASES = [
    # meta.json: kind of file, size, syntax
    Case("meta-missing", lambda t: (t / "meta.json").unlink(), "error", "trace"),
    Case("meta-is-dir", lambda t: ((t / "meta.json").unlink(), (t / "meta.json").mkdir()), "error"),
    Case("meta-is-fifo", _fifo_meta, "error"),
    Case("meta-links-dev-zero", lambda t: _link_meta(t, "/dev/zero"), "error"),
    Case("meta-huge", lambda t: _meta_raw(t, " " * (3 << 20) + "{}"), "error"),
    Case("meta-truncated", lambda t: _truncate(t / "meta.json", 0.5), "error"),
    Case("meta-flipped", lambda t: _flip(t / "meta.json", 0.3, 6), "any"),
    Case("meta-deep-nesting", lambda t: _meta_raw(t, "[" * 200000 + "]" * 200000), "error"),
    Case("meta-not-object", lambda t: _meta_raw(t, "[1, 2]"), "error"),
    # meta.json: wrong types and absurd values
    Case("layers-1e12", lambda t: _meta(t, num_layers=1e12), "error"),
    Case("layers-true", lambda t: _meta(t, num_layers=True), "error"),
    Case("layers-string", lambda t: _meta(t, num_layers="2"), "error"),
    Case("layers-100000-experts-32000", lambda t: _meta(t, num_layers=100000, num_experts=32000), "error"),
    Case("experts-zero", lambda t: _meta(t, num_experts=0), "error"),
    Case("topk-over-experts", lambda t: _meta(t, top_k=9), "error"),
    Case("hidden-big-string", lambda t: _meta(t, hidden_size="big"), "error"),
    Case("hidden-negative", lambda t: _meta(t, hidden_size=-5), "error"),
    Case("shared-negative", lambda t: _meta(t, num_shared_experts=-1), "error"),
    Case("format-version-0", lambda t: _meta(t, format_version=0), "error"),
    Case("format-version-neg", lambda t: _meta(t, format_version=-1), "error"),
    Case("format-version-future", lambda t: _meta(t, format_version=99), "error"),
    Case("format-version-null", lambda t: _meta(t, format_version=None), "error"),
    Case("sampling-rate-nan", lambda t: _meta_raw(t, (t / "meta.json").read_text().replace(
        '"sampling_rate": 1.0', '"sampling_rate": NaN')), "error"),
    Case("kind-unknown", lambda t: _meta(t, kind="weird"), "error"),
    Case("layer-map-wrong-length", lambda t: _meta(t, moe_layer_map=[0, 1, 2]), "error"),
    Case("extra-is-list", lambda t: _meta(t, extra=[1]), "error"),
    Case("model-null", lambda t: _meta(t, model=None), "error"),
    Case("foe-groups-not-dividing", lambda t: _meta(t, foe_groups=3), "error"),
    Case("foe-groups-string", lambda t: _meta(t, foe_groups="2"), "error"),
    # metadata that disagrees with the shards
    Case("foe-groups-ids-ungrouped", lambda t: _meta(t, foe_groups=2), "error", S0, info="ok"),  # random ids
    Case("meta-layers-disagree", lambda t: _meta(t, num_layers=3), "error", S0),
    Case("meta-says-weights", lambda t: _meta(t, has_weights=True), "error", S0),
    Case("meta-says-counts", lambda t: _meta(t, kind="counts"), "error"),  # over token shards: they disagree
    Case("complete-without-shards", lambda t: [f.unlink() for f in t.glob("part-*")], "error",
         "complete-without-shards.trace"),
    # Parquet files: truncation, flipped bytes, wrong kinds of file
    Case("shard-truncated-half", lambda t: _truncate(_shard(t), 0.5), "error", S0),
    Case("shard-truncated-tail", lambda t: _truncate(_shard(t), 0.98), "error", S0),
    Case("shard-empty", lambda t: _truncate(_shard(t), 0.0), "error", S0),
    Case("shard-flip-start", lambda t: _flip(_shard(t), 0.02), "any", S0),
    Case("shard-flip-data-1", lambda t: _flip(_shard(t), 0.25, seed=1), "any", S0),
    Case("shard-flip-data-2", lambda t: _flip(_shard(t), 0.45, seed=2), "any", S0),
    Case("shard-flip-data-3", lambda t: _flip(_shard(t), 0.6, seed=3), "any", S0),
    Case("shard-flip-footer", lambda t: _flip(_shard(t), 0.85, seed=4), "any", S0),
    Case("shard-flip-magic", lambda t: _flip(_shard(t), 1.0, 1), "error", S0),
    Case("shard-is-dir", lambda t: _replace_with_dir(_shard(t)), "error", S0),
    Case("shard-is-text", lambda t: _shard(t).write_text("not parquet\n"), "error", S0),
    Case("requests-missing", lambda t: (t / R0).unlink(), "error", R0),
    Case("requests-truncated", lambda t: _truncate(t / R0, 0.6), "error", R0),
    # lying footers
    Case("footer-claims-1e12-rows", lambda t: _lie_rows(_shard(t), 10**12), "error", S0),
    Case("footer-total-disagrees", lambda t: _lie_rows(_shard(t), 10**9, every=False), "error", S0),
    Case("footer-claims-1e12-requests", lambda t: _lie_rows(t / R0, 10**12), "error", R0),
    # wrong column types and values
    Case("position-float", lambda t: _rewrite(_shard(t), lambda x: _set_col(
        x, "position", pa.array(x.column("position").to_numpy().astype(np.float64)))), "error", S0),
    Case("request-id-string", lambda t: _rewrite(_shard(t), lambda x: _set_col(
        x, "request_id", pa.array([str(v) for v in x.column("request_id").to_pylist()]))), "error", S0),
    Case("expert-ids-variable-list", lambda t: _rewrite(_shard(t), lambda x: _set_col(
        x, "expert_ids", pa.array(x.column("expert_ids").to_pylist(), pa.list_(pa.int16())))), "error", S0),
    Case("column-missing", lambda t: _rewrite(_shard(t), lambda x: x.drop_columns(["phase"])), "error", S0),
    Case("request-id-null", lambda t: _rewrite(t / R0, lambda x: _set_col(
        x, "request_id", pa.array([None] + x.column("request_id").to_pylist()[1:], pa.int64()))), "error", R0),
    Case("token-request-id-null", lambda t: _rewrite(_shard(t), lambda x: _set_col(
        x, "request_id", pa.array([None] + x.column("request_id").to_pylist()[1:], pa.int64()))), "error", S0),
    Case("position-negative", lambda t: _rewrite(_shard(t), lambda x: _set_col(
        x, "position", pa.array(np.r_[-3, x.column("position").to_numpy()[1:]].astype(np.int32)))), "error", S0),
    Case("phase-7", lambda t: _rewrite(_shard(t), lambda x: _set_col(
        x, "phase", pa.array(np.full(x.num_rows, 7, np.int8)))), "error", S0),
    Case("unknown-request-id", lambda t: _rewrite(_shard(t), lambda x: _set_col(
        x, "request_id", pa.array(np.full(x.num_rows, 999, np.int64)))), "error", S0),
    Case("duplicate-request", lambda t: _rewrite(t / R0, lambda x: pa.concat_tables([x, x])), "error", "trace"),
    Case("negative-prompt-len", lambda t: _rewrite(t / R0, lambda x: _set_col(
        x, "prompt_len", pa.array(np.full(x.num_rows, -4, np.int32)))), "error", "trace"),
    Case("expert-id-out-of-range", lambda t: _rewrite(_shard(t), lambda x: _ids_with(
        x, lambda a: a.__setitem__((0, 0, 0), E + 3))), "error", S0, info="ok"),
    Case("expert-id-repeated", lambda t: _rewrite(_shard(t), lambda x: _ids_with(
        x, lambda a: a.__setitem__((0, 1, 1), a[0, 1, 0]))), "error", S0, info="ok"),
    # harmless oddities: must still work and give the right numbers
    Case("extra-file", lambda t: (t / "README.txt").write_text("notes\n"), "ok"),
    Case("incomplete", lambda t: _meta(t, complete=False), "ok"),
    Case("unknown-meta-key", lambda t: _meta(t, future_key=1), "ok"),
    # counts-only traces
    Case("counts-ok", lambda t: None, "ok", kind="counts"),
    Case("counts-nan", lambda t: _rewrite(t / C0, lambda x: _counts_with(x, lambda c: c.__setitem__(0, np.nan))),
         "error", C0, "counts"),
    Case("counts-negative", lambda t: _rewrite(t / C0, lambda x: _counts_with(x, lambda c: c.__setitem__(3, -2.0))),
         "error", C0, "counts"),
    Case("counts-footer-lies", lambda t: _lie_rows(t / C0, 10**11), "error", C0, "counts"),
    Case("counts-meta-experts-disagree", lambda t: _meta(t, num_experts=9), "error", C0, "counts"),
]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("fault-base")
    return {"tokens": (root / "tokens.trace", write_tokens_trace(root / "tokens.trace")),
            "counts": (root / "counts.trace", write_counts_trace(root / "counts.trace"))}


@pytest.fixture(scope="module")
def cli():
    fs = ForkServer(timeout=TIMEOUT_S, as_cap=AS_CAP)
    yield fs
    fs.close()


def _check(res: subprocess.CompletedProcess, case: Case, what: str, expect: str = "") -> str:
    """'ok' or 'error' after checking the run's contract; fails the test otherwise."""
    expect = expect or case.expect
    assert "Traceback" not in res.stderr, f"{case.name} {what}: traceback\n{res.stderr[-3000:]}"
    if res.returncode == 0:
        assert expect in ("ok", "any"), f"{case.name} {what}: accepted a bad trace\n{res.stdout[-2000:]}"
        return "ok"
    assert res.returncode == 2, f"{case.name} {what}: exit {res.returncode}\n{res.stderr[-3000:]}"
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"{case.name} {what}: expected one line on stderr, got\n{res.stderr}"
    assert expect in ("error", "any"), f"{case.name} {what}: refused a good trace: {lines[0]}"
    assert case.names in lines[0], f"{case.name} {what}: the message does not name {case.names}: {lines[0]}"
    return "error"


def _log(case: Case, what: str, outcome: str, res: subprocess.CompletedProcess) -> None:
    """Append the outcome to $MOEPLACE_FAULT_LOG (the figures in docs/RELIABILITY.md come from it)."""
    if os.environ.get("MOEPLACE_FAULT_LOG"):
        with open(os.environ["MOEPLACE_FAULT_LOG"], "a") as fh:
            fh.write(json.dumps({"case": case.name, "command": what, "outcome": outcome,
                                 "stderr": res.stderr.strip()[:300]}) + "\n")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fault_case(case: Case, bases, cli, tmp_path):
    base, expected = bases[case.kind]
    t = tmp_path / f"{case.name}.trace"
    shutil.copytree(base, t)
    case.mutate(t)

    info = cli.run(tmp_path, "trace", "info", str(t), "--json")
    got = _check(info, case, "trace info", case.info)
    _log(case, "trace info", got, info)
    if got == "ok" and (case.info or case.expect) == "ok":
        d = json.loads(info.stdout)
        assert d["num_requests"] == expected["num_requests"]
        assert d["num_tokens"] == expected["num_tokens"]

    out = tmp_path / "analysis.json"
    res = cli.run(tmp_path, "analyze", str(t), "--no-progress", "--json", str(out))
    got = _check(res, case, "analyze")
    _log(case, "analyze", got, res)
    if got == "ok":
        a = json.loads(out.read_text())
        if case.expect == "ok" and case.kind == "tokens":
            assert a["meta"]["num_tokens"]["total"] == N_REQ * (PROMPT + GEN)
    else:
        assert not out.exists()


@pytest.mark.parametrize("name", ["footer-claims-1e12-rows", "meta-is-fifo", "shard-is-dir"])
def test_fresh_interpreter_agrees(name: str, bases, tmp_path):
    """A few cases through a fresh ``python -m moeplace`` process, as a user runs it (no fork server)."""
    case = next(c for c in CASES if c.name == name)
    t = tmp_path / f"{name}.trace"
    shutil.copytree(bases[case.kind][0], t)
    case.mutate(t)
    assert _check(run_cli("trace", "info", str(t)), case, "trace info (fresh)") == "error"


def test_permission_denied_shard_is_reported_as_such(bases, tmp_path):
    """Root reads anything, so the run drops CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH (setpriv) when it is root."""
    base, _ = bases["tokens"]
    t = tmp_path / "perm.trace"
    shutil.copytree(base, t)
    os.chmod(_shard(t), 0)
    prefix = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: cannot make a file unreadable")
        prefix = [setpriv, "--inh-caps=-dac_override,-dac_read_search",
                  "--bounding-set=-dac_override,-dac_read_search", "--"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    res = subprocess.run([*prefix, sys.executable, "-m", "moeplace", "trace", "info", str(t)], capture_output=True,
                         text=True, env=env, timeout=TIMEOUT_S, preexec_fn=_limit_memory)
    if res.returncode != 2 and "Permission denied" in res.stderr and "moeplace" not in res.stderr:
        pytest.skip(f"setpriv unusable here: {res.stderr[-300:]}")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"{S0}: permission denied" in res.stderr and "corrupt" not in res.stderr


def test_memory_budget_env_bounds_reads(bases, tmp_path):
    """A genuine trace bigger than MOEPLACE_MEMORY_BUDGET is refused before decoding, naming the budget."""
    base, _ = bases["tokens"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "MOEPLACE_MEMORY_BUDGET": "300"}
    res = subprocess.run([sys.executable, "-m", "moeplace", "trace", "info", str(base)], capture_output=True,
                         text=True, env=env, timeout=TIMEOUT_S)
    assert res.returncode == 2 and "MOEPLACE_MEMORY_BUDGET" in res.stderr and "Traceback" not in res.stderr
