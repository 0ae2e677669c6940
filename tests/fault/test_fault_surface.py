"""Fault injection on the surface added since the first rounds (issue 25): operate, predict-kernel, FoE, export,
train-reference, synth; outputs aimed at inputs, at a user's files and at read-only places; sizes from options
and files under a memory cap; duplicate JSON keys; options at their bounds; generated schedule, plan and load files.

Every run goes through ``moeplace.cli.main`` in a child forked from one interpreter (forkserver.py) under a 2 GiB
address-space cap (so the memory budget is 1 GiB) and a timeout, exactly as ``python -m moeplace`` runs it. Each
case names its outcome: exit 2 with one stderr line holding every listed string (and, where it says so, the
files it must not have touched left byte for byte and nothing written), or exit 0 with a result checked against
what the case built. A traceback, a crash, a timeout or an exhausted cap fails the case. docs/RELIABILITY.md
("Round two") lists each guarantee with its case; tests/fault/CASES_25.md lists the issue's cases.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from harness import SRC, ForkServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeplace.cli import build_parser
from moeplace.io import atomic_write_json, atomic_write_text
from moeplace.placement import Cluster, Placement, Plan
from moeplace.trace import TraceMeta, TraceWriter

L, E, K = 2, 32, 4  # gpt-oss-20b's experts and top-k, so --model-preset gpt-oss-20b prices the tiny trace
N_REQ, PROMPT, GEN = 16, 3, 5
PROPERTY = settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
OPERATE = ["--cluster", "2x2", "--model-preset", "gpt-oss-20b", "--window-requests", "8", "--decode-batch", "8"]


def write_tiny_trace(path: Path, foe: bool = False) -> None:
    """L=2, E=32, K=4 (FoE: H=2, each token's 2 + 2 experts in groups 0..15 and 16..31): 16 requests of 3 prefill
    and 5 decode tokens over domains code and chat, written by moeplace (so its files carry moeplace's mark)."""
    rng = np.random.default_rng(3)
    meta = TraceMeta(model="fault-surface", num_layers=L, num_experts=E, top_k=K, hidden_size=16, synthetic=True,
                     source="tests (synthetic)", foe_groups=2 if foe else 1)
    n = N_REQ * (PROMPT + GEN)
    if foe:
        ids = np.concatenate([np.stack([np.stack([rng.choice(16, 2, replace=False) + 16 * g for _ in range(L)])
                                        for _ in range(n)]) for g in (0, 1)], axis=2)
    else:
        ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(n)])
    with TraceWriter(path, meta) as w:
        w.add_requests(np.arange(N_REQ), domain=["code", "chat"] * (N_REQ // 2), prompt_len=[PROMPT] * N_REQ,
                       gen_len=[GEN] * N_REQ)
        w.add_tokens(np.repeat(np.arange(N_REQ), PROMPT + GEN), np.tile(np.arange(PROMPT + GEN), N_REQ),
                     np.tile(np.array([0] * PROMPT + [1] * GEN, np.int8), N_REQ), ids.astype(np.int16))


@pytest.fixture(scope="module")
def cli():
    fs = ForkServer(timeout=180)
    yield fs
    fs.close()


@pytest.fixture(scope="module")
def base(tmp_path_factory, cli) -> Path:
    """T (tiny trace), F (FoE twin), P (eplb plan of T on 2x2), FP (foe plan of F), S (a valid mix schedule)."""
    d = tmp_path_factory.mktemp("surface")
    write_tiny_trace(d / "T")
    write_tiny_trace(d / "F", foe=True)
    for args in (["plan", d / "T", "--strategy", "eplb", "--cluster", "2x2", "--out", d / "P"],
                 ["plan", d / "F", "--strategy", "foe", "--cluster", "2x2", "--out", d / "FP"]):
        res = cli.run(d, *args)
        assert res.returncode == 0, res.stderr
    (d / "S").write_text(json.dumps({"phases": [{"requests": 8, "mix": {"code": 1}},
                                                {"requests": 8, "mix": {"chat": 1}}]}))
    return d


def one_line(res: subprocess.CompletedProcess) -> str:
    err = res.stderr or ""
    assert "Traceback" not in err, err[-3000:]
    lines = [x for x in err.splitlines() if x.strip()]
    assert res.returncode == 2, f"exit {res.returncode}: {err[-2000:]}"
    assert len(lines) == 1, f"expected one stderr line, got:\n{err[-2000:]}"
    return lines[0]


def fingerprint(paths: list[Path]) -> dict[str, bytes | None]:
    """Bytes of every file under ``paths`` (None: absent), to show a refusal touched nothing."""
    out: dict[str, bytes | None] = {}
    for p in paths:
        if p.is_dir():
            out.update({str(f): f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()})
        else:
            out[str(p)] = p.read_bytes() if p.exists() else None
    return out


# ------------------------------------------------------------------------------------------------ the cases

@dataclass
class Case:
    """A command line built in a fresh folder ``d`` (the base files are copied into it by name: T, F, P, FP, S).

    ``setup(d)`` prepares files; ``argv`` may name ``@X`` for ``d / X``; ``expect`` "error" (one line holding every
    string of ``mentions``; the files in ``keep`` unchanged and those in ``absent`` never written) or "ok" (then
    ``check(d, stdout)`` holds)."""

    name: str
    argv: list[str]
    expect: str
    mentions: list[str] = field(default_factory=list)
    setup: Callable[[Path], None] | None = None
    keep: list[str] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)
    check: Callable[[Path, str], None] | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: bool = False  # run inside d


def user_files(*names: str) -> Callable[[Path], None]:
    """Files a user wrote (no moeplace mark) under d."""

    def f(d: Path) -> None:
        for n in names:
            (d / n).parent.mkdir(parents=True, exist_ok=True)
            (d / n).write_text("a user's file\n")

    return f


def chain(*fs: Callable[[Path], None]) -> Callable[[Path], None]:
    def f(d: Path) -> None:
        for g in fs:
            g(d)

    return f


def own_file(name: str, text: str = "{}\n") -> Callable[[Path], None]:
    """A file moeplace wrote (its atomic writer marks it)."""
    return lambda d: atomic_write_text(text, d / name)


def edit_json(name: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    def f(d: Path) -> None:
        obj = json.loads((d / name).read_text())
        change(obj)
        (d / name).write_text(json.dumps(obj))

    return f


def write(name: str, text: str) -> Callable[[Path], None]:
    return lambda d: (d / name).write_text(text)


def load(arr) -> Callable[[Path], None]:
    return write("l.json", json.dumps(arr))


def schedule(obj) -> Callable[[Path], None]:
    return write("s.json", json.dumps(obj))


def readonly(name: str) -> Callable[[Path], None]:
    return lambda d: os.chmod(d / name, 0o444)


def predict_ep1(mode: str) -> Case:
    def check(d: Path, out: str) -> None:  # EP 1 sends nothing: the model prices 0 s, GB/s undefined (null)
        row = json.loads((d / "k.json").read_text())["rows"][0]
        assert row["ep"] == 1 and row["dispatch_us"] == 0 and row["combine_us"] == 0
        assert row["dispatch_gbps"] is None and row["combine_gbps"] is None

    return Case(f"predict-kernel-ep1-{mode}", ["predict-kernel", "--model", "deepseek-v3", "--cluster-preset", "h800-8",
                                               "--ep", "1", "--mode", mode, "--tokens-per-rank", "64", "--json",
                                               "@k.json"], "ok", check=check)


def shape_trace(layers: int, experts: int) -> Callable[[Path], None]:
    """A one-token trace of ``layers`` x ``experts`` (its tables are what is big)."""

    def f(d: Path) -> None:
        meta = TraceMeta(model="big", num_layers=layers, num_experts=experts, top_k=2, hidden_size=16, synthetic=True,
                         source="tests (synthetic)")
        with TraceWriter(d / "B", meta) as w:
            w.add_requests([0], domain=["x"], prompt_len=[0], gen_len=[1])
            w.add_tokens([0], [0], [1], np.tile(np.array([0, 1], np.int16), (1, layers, 1)))

    return f


def operate_twice_ok(d: Path, out: str) -> None:
    assert json.loads((d / "o" / "plan.json").read_text())["strategy"] == "operate:moeplace"


def dup_key(name: str, key: str) -> Callable[[Path], None]:
    """Give JSON object ``name`` its key ``key`` twice (the second value differs)."""

    def f(d: Path) -> None:
        text = (d / name).read_text()
        obj = json.loads(text)
        first = json.dumps(obj)[1:]
        (d / name).write_text("{" + json.dumps(key) + ": " + json.dumps(obj[key] if not isinstance(obj[key], int)
                                                                         else obj[key] + 1) + ", " + first)

    return f


CASES = [
    # ---------------------------------------------------------------- data loss: a user's files, the inputs
    Case("operate-out-over-user-files", ["operate", "@T", *OPERATE, "--out", "@u"], "error",
         ["--out", "plan.json", "moeplace did not write"], user_files("u/plan.json", "u/sglang.json", "u/vllm.json"),
         keep=["u"]),
    Case("operate-out-over-user-change", ["operate", "@T", *OPERATE, "--out", "@u"], "error",
         ["changes/0001/plan.json", "moeplace did not write"], user_files("u/changes/0001/plan.json"), keep=["u"]),
    Case("operate-out-beside-user-files", ["operate", "@T", *OPERATE, "--out", "@u"], "ok", [],
         user_files("u/notes.txt"), check=lambda d, o: (d / "u" / "plan.json").exists()
         and (d / "u" / "notes.txt").read_text() == "a user's file\n"),
    Case("operate-out-inside-the-trace", ["operate", "@T", *OPERATE, "--out", "@T/plans"], "error",
         ["--out", "lies inside the input"], keep=["T"], absent=["T/plans"]),
    Case("operate-out-is-the-current-folder", ["operate", "T", *OPERATE, "--out", "."], "ok", cwd=True,
         check=lambda d, o: (d / "plan.json").exists() and (d / "T" / "meta.json").exists()),
    Case("operate-json-onto-meta", ["operate", "@T", *OPERATE, "--json", "@T/meta.json"], "error",
         ["--json", "T/meta.json", "input"], keep=["T"]),
    Case("operate-json-onto-unmarked-meta", ["operate", "@T", *OPERATE, "--json", "@T/meta.json"], "error",
         ["--json", "moeplace did not write"], edit_json("T/meta.json", lambda m: None), keep=["T"]),
    Case("train-out-over-user-config", ["train-reference", "--config", "tiny", "--steps", "1", "--quiet", "--out",
                                        "@m"], "error", ["config.json", "moeplace did not write"],
         user_files("m/config.json"), keep=["m"]),
    Case("train-out-empty-name", ["train-reference", "--config", "tiny", "--out", ""], "error", ["--out", "empty"],
         cwd=True),
    Case("train-out-a-file", ["train-reference", "--config", "tiny", "--out", "@f"], "error", ["--out", "directory"],
         user_files("f"), keep=["f"]),
    Case("simulate-json-onto-meta", ["simulate", "@T", "--cluster", "2x2", "--json", "@T/meta.json"], "error",
         ["--json", "input"], keep=["T"]),
    Case("analyze-json-onto-shard", ["analyze", "@T", "--no-progress", "--json", "@T/part-00000.requests.parquet"],
         "error", ["--json", "input"], keep=["T"]),
    Case("compare-html-onto-meta", ["compare", "@T", "--cluster", "2x2", "--strategies", "linear", "--split-seeds",
                                    "1", "--quiet", "--html", "@T/meta.json"], "error", ["--html", "input"],
         keep=["T"]),
    Case("plan-out-onto-its-user-load", ["plan", "--load", "@l.json", "--strategy", "eplb", "--cluster", "2x1",
                                         "--out", "@l.json"], "error", ["--out", "l.json"], load([[1, 2], [3, 4]]),
         keep=["l.json"]),
    Case("plan-out-onto-its-own-load", ["plan", "--load", "@l.json", "--strategy", "eplb", "--cluster", "2x1",
                                        "--out", "@l.json"], "error", ["--out", "is the input --load"],
         own_file("l.json", "[[1, 2], [3, 4]]\n"), keep=["l.json"]),
    Case("export-out-is-the-plan", ["export", "@P", "--format", "sglang", "--out", "@P"], "error",
         ["--out", "is the input PLAN"], keep=["P"]),
    Case("export-out-hard-link-to-the-plan", ["export", "@P", "--format", "vllm", "--out", "@h.json"], "error",
         ["is the input PLAN"], lambda d: os.link(d / "P", d / "h.json"), keep=["P"]),
    Case("export-out-symlink-to-the-plan", ["export", "@P", "--format", "vllm", "--out", "@s.json"], "error",
         ["symbolic link"], lambda d: os.symlink(d / "P", d / "s.json"), keep=["P"]),
    Case("json-and-html-one-path", ["analyze", "@T", "--no-progress", "--json", "@x", "--html", "@x"], "error",
         ["also given to --json"], absent=["x"]),
    Case("simulate-json-over-user-file", ["simulate", "@T", "--cluster", "2x2", "--json", "@x.json"], "error",
         ["--json", "moeplace did not write"], user_files("x.json"), keep=["x.json"]),
    Case("simulate-json-over-read-only-own-file", ["simulate", "@T", "--cluster", "2x2", "--json", "@x.json"],
         "error", ["--json", "read-only"], chain(own_file("x.json"), readonly("x.json")), keep=["x.json"]),
    Case("simulate-json-over-own-file-edited", ["simulate", "@T", "--cluster", "2x2", "--json", "@x.json"], "error",
         ["changed since"], chain(own_file("x.json"), lambda d: open(d / "x.json", "a").write("edit\n")),
         keep=["x.json"]),
    Case("simulate-json-over-own-file", ["simulate", "@T", "--cluster", "2x2", "--json", "@x.json"], "ok",
         setup=own_file("x.json"), check=lambda d, o: json.loads((d / "x.json").read_text())["cluster"]),
    # ---------------------------------------------------------------- tracebacks before
    Case("policy-option-of-another-policy", ["operate", "@T", *OPERATE, "--policy", "static", "--period-steps", "5"],
         "error", ["--period-steps", "static"]),
    Case("threshold-given-to-periodic", ["operate", "@T", *OPERATE, "--policy", "periodic", "--threshold", "0.5"],
         "error", ["--threshold", "periodic"]),
    predict_ep1("deepep-normal"),
    predict_ep1("nccl"),
    Case("json-read-over-the-budget", ["plan", "--load", "@l.json", "--strategy", "eplb", "--cluster", "1x1",
                                       "--out", "@o.json"], "error", ["l.json", "memory budget"],
         load([[1] * 1000] * 1000), absent=["o.json"], env={"MOEPLACE_MEMORY_BUDGET": "32M"}),
    Case("plan-json-over-the-budget", ["export", "@P", "--format", "vllm", "--out", "@o.json"], "error",
         ["P", "memory budget"], absent=["o.json"], env={"MOEPLACE_MEMORY_BUDGET": "4K"}),
    # ---------------------------------------------------------------- sizes from options and files
    Case("schedule-phase-of-1e8", ["operate", "@T", *OPERATE, "--order", "schedule", "--schedule", "@s.json"],
         "error", ["--schedule", "s.json", "memory budget"],
         schedule({"phases": [{"requests": 10 ** 8, "mix": {"code": 1}}]})),
    Case("schedule-phase-of-1e12", ["operate", "@T", *OPERATE, "--order", "schedule", "--schedule", "@s.json"],
         "error", ["--schedule", "memory budget"], schedule({"phases": [{"requests": 10 ** 12, "mix": {"code": 1}}]})),
    Case("stream-requests-at-its-bound", ["operate", "@T", *OPERATE, "--order", "schedule", "--schedule", "@S",
                                          "--stream-requests", "16777216"], "error",
         ["--stream-requests", "memory budget"]),
    Case("drift-requests-at-its-bound", ["operate", "@T", *OPERATE, "--order", "drift", "--drift-requests",
                                         "16777216"], "error", ["--drift-requests", "memory budget"]),
    Case("predict-kernel-ep256-65536-tokens", ["predict-kernel", "--model", "deepseek-v3", "--cluster-preset",
                                               "h800-8", "--ep", "256", "--mode", "deepep-normal",
                                               "--tokens-per-rank", "65536"], "error",
         ["--tokens-per-rank 65536", "memory budget"]),
    Case("synth-prompt-len-at-its-bound", ["synth", "@s.trace", "--preset", "gpt-oss-20b", "--requests", "4",
                                           "--prompt-len", "1048576", "--quiet"], "error",
         ["--prompt-len 1048576", "memory budget"], absent=["s.trace"]),
    Case("export-of-2e9-decoder-layers", ["export", "@P", "--format", "sglang", "--out", "@o.json"], "error",
         ["P", "num_decoder_layers=2000000000"],
         edit_json("P", lambda p: p.__setitem__("model_layers", {"moe_layer_map": [0, 1],
                                                                 "num_decoder_layers": 2_000_000_000})),
         absent=["o.json"]),
    Case("simulate-l1000-e32000", ["simulate", "@B", "--cluster", "1x1"], "error", ["B", "placement tables",
                                                                                  "memory budget"],
         shape_trace(1000, 32000), env={"MOEPLACE_MEMORY_BUDGET": "1200M"}),
    # ---------------------------------------------------------------- accepted without a word before
    Case("counts-kind-over-token-shards", ["simulate", "@T", "--cluster", "2x2"], "error",
         ["meta.json", "kind='counts'"], edit_json("T/meta.json", lambda m: m.__setitem__("kind", "counts"))),
    Case("complete-trace-without-shards", ["analyze", "@T", "--no-progress"], "error", ["T", "no part-"],
         lambda d: [f.unlink() for f in (d / "T").glob("part-*")]),
    Case("homes-of-requests-not-in-the-trace", ["simulate", "@T", "--plan", "@p.json"], "error",
         ["p.json", "999999"], lambda d: (d / "p.json").write_text(json.dumps(
             {**json.loads((d / "FPJ").read_text()), "homes": {"999999": 1, "0": 0}}))),
    Case("load-of-1e308", ["plan", "--load", "@l.json", "--strategy", "eplb", "--cluster", "2x1", "--out",
                           "@o.json"], "error", ["l.json", "2^53"], load([[1e308] * 4] * 2), absent=["o.json"]),
    Case("load-of-70000-experts", ["plan", "--load", "@l.json", "--strategy", "eplb", "--cluster", "1x1", "--out",
                                   "@o.json"], "error", ["l.json", "70000 experts"], load([[1] * 70000]),
         absent=["o.json"]),
    Case("load-of-5000-layers", ["plan", "--load", "@l.json", "--strategy", "eplb", "--cluster", "1x1", "--out",
                                 "@o.json"], "error", ["l.json", "5000 layers"], load([[1, 2]] * 5000),
         absent=["o.json"]),
    Case("groups-not-dividing-experts", ["plan", "--load", "@l.json", "--strategy", "eplb", "--cluster", "2x1",
                                         "--groups", "3", "--out", "@o.json"], "error", ["--groups", "8 experts"],
         load([list(range(1, 9))] * 2), absent=["o.json"]),
    Case("full-width-cluster", ["simulate", "@T", "--cluster", "\uff12x\uff12"], "error", ["--cluster"]),
    Case("full-width-number", ["simulate", "@T", "--cluster", "2x2", "--redundant", "\uff14"], "error",
         ["--redundant"]),
    Case("preset-of-another-shape", ["operate", "@T", "--cluster", "2x2", "--model-preset", "deepseek-v3",
                                      "--policy", "static"], "error",
         ["--model-preset deepseek-v3 has 256 experts", "routes to 32 experts", "--model-sizes-meant"]),
    Case("preset-of-another-shape-meant", ["operate", "@T", "--cluster", "2x2", "--model-preset", "deepseek-v3",
                                           "--model-sizes-meant", "--policy", "static"], "ok",
         check=lambda d, out: out.startswith("note: --model-preset deepseek-v3 has 256 experts, top-8;")
         and "price the trace's 32 experts" in out.splitlines()[0]),
    Case("foe-trace-given-to-eplb", ["plan", "@F", "--strategy", "eplb", "--cluster", "2x2", "--out", "@o.json"],
         "error", ["FoE trace", "--strategy foe"], absent=["o.json"]),
    Case("foe-trace-given-to-joint", ["plan", "@F", "--strategy", "joint", "--search-evals", "10", "--cluster", "2x2",
                                      "--out", "@o.json"], "error", ["FoE trace"], absent=["o.json"]),
    Case("foe-trace-given-to-simulate", ["simulate", "@F", "--cluster", "2x2"], "error", ["FoE trace"]),
    Case("foe-trace-given-to-operate", ["operate", "@F", *OPERATE], "error", ["F", "FoE trace"]),
    Case("foe-plan-exported-for-sglang", ["export", "@FP", "--format", "sglang", "--out", "@o.json"], "error",
         ["FP", "FoE plan"], absent=["o.json"]),
    Case("foe-plan-exported-for-vllm", ["export", "@FP", "--format", "vllm", "--out", "@o.json"], "error",
         ["FoE plan"], absent=["o.json"]),
    Case("export-vllm-with-trace", ["export", "@P", "--format", "vllm", "--trace", "@T", "--out", "@o.json"], "error",
         ["--trace", "--format vllm"], absent=["o.json"]),
    Case("export-vllm-with-decoder-layers", ["export", "@P", "--format", "vllm", "--num-decoder-layers", "2",
                                             "--out", "@o.json"], "error", ["--num-decoder-layers"],
         absent=["o.json"]),
    Case("duplicate-key-in-a-plan", ["export", "@P", "--format", "vllm", "--out", "@o.json"], "error",
         ["P", "duplicate key 'num_experts'"], dup_key("P", "num_experts"), absent=["o.json"]),
    Case("duplicate-key-in-meta", ["trace", "info", "@T"], "error", ["meta.json", "duplicate key 'num_layers'"],
         dup_key("T/meta.json", "num_layers")),
    Case("duplicate-key-in-a-load", ["plan", "--load", "@l.json", "--strategy", "eplb", "--cluster", "1x1", "--out",
                                     "@o.json"], "error", ["l.json", "duplicate key"],
         write("l.json", '{"logical_count": [[1, 2]], "logical_count": [[3, 4]]}'), absent=["o.json"]),
    Case("duplicate-key-in-a-schedule", ["operate", "@T", *OPERATE, "--order", "schedule", "--schedule", "@s.json"],
         "error", ["--schedule", "duplicate key 'phases'"],
         write("s.json", '{"phases": [], "phases": [{"requests": 8, "mix": {"code": 1}}]}')),
    Case("duplicate-key-in-prompts", ["trace", "record", "--model", "reference", "--prompts", "@p.jsonl",
                                      "--max-new-tokens", "2", "@r.trace"], "error", ["p.jsonl:1", "duplicate key"],
         write("p.jsonl", '{"prompt": "a", "prompt": "b"}\n'), absent=["r.trace"]),
    # ---------------------------------------------------------------- unclear messages before
    *[Case(f"domain-mix-{i}", ["synth", "@s.trace", "--preset", "gpt-oss-20b", "--requests", "8", "--domain-mix=" + m,
                               "--quiet"], "error", ["--domain-mix"], absent=["s.trace"])
      for i, m in enumerate(["nan,1,1,1", "inf,1,1,1", "1e308,1e308,1,1", "0,0,0,0", "1,1", "a,b", "-1,1,1,1"])],
    Case("schedule-error-names-the-file", ["operate", "@T", *OPERATE, "--order", "schedule", "--schedule",
                                           "@s.json"], "error", ["--schedule", "s.json", "phases[0]", "requests"],
         schedule({"phases": [{"requests": 0, "mix": {"code": 1}}]})),
    Case("schedule-key-the-pool-lacks", ["operate", "@T", *OPERATE, "--order", "schedule", "--schedule", "@s.json"],
         "error", ["--schedule", "s.json", "nope"], schedule({"phases": [{"requests": 4, "mix": {"nope": 1}}]})),
    Case("schedule-without-length", ["operate", "@T", *OPERATE, "--order", "schedule", "--schedule", "@s.json"],
         "error", ["--schedule", "--stream-requests"], schedule({"base": {"code": 1}})),
    Case("tokenizer-error-names-the-model", ["trace", "record", "--model", "@m", "--prompts", "builtin",
                                             "--max-new-tokens", "2", "@r.trace"], "error", ["--model", "m"],
         lambda d: ((d / "m").mkdir(), (d / "m" / "config.json").write_text('{"model_type": "qwen3_moe"}'),
                    (d / "m" / "tokenizer.json").write_text("{bad")), absent=["r.trace"]),
]


def prepare(case: Case, base: Path, d: Path) -> list[str]:
    for name in ("T", "F", "P", "FP", "S"):
        src = base / name
        if any(a == f"@{name}" or a.startswith(f"@{name}/") for a in case.argv) or name in ("T", "P"):
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, d / name)
    shutil.copy2(base / "P", d / "FPJ")  # a plan of T to edit (homes)
    if case.setup is not None:
        case.setup(d)
    return [str(d / a[1:]) if a.startswith("@") else a for a in case.argv]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_surface_case(case: Case, base, cli, tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    argv = prepare(case, base, d)
    before = fingerprint([d / k for k in case.keep])
    res = cli.run(tmp_path, *argv, env=case.env, cwd=d if case.cwd else None)
    if case.expect == "ok":
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
        if case.check is not None:
            assert case.check(d, res.stdout) is not False
        return
    line = one_line(res)
    for m in case.mentions:
        assert m in line, f"{m!r} not in {line!r}"
    assert fingerprint([d / k for k in case.keep]) == before, "a refused run changed a file it must not touch"
    for a in case.absent:
        assert not (d / a).exists() and not (d / a).is_symlink(), f"{a} was written by a refused run"


def test_reruns_replace_only_what_moeplace_wrote(base, cli, tmp_path):
    """A second run over the first one's outputs is allowed (they carry moeplace's mark), for files and for the
    operate folder; a user's edit in between makes it a refusal again."""
    t = tmp_path / "T"
    shutil.copytree(base / "T", t)
    for _ in range(2):
        res = cli.run(tmp_path, "operate", t, *OPERATE, "--out", tmp_path / "o", "--json", tmp_path / "o.json")
        assert res.returncode == 0, res.stderr
        res = cli.run(tmp_path, "simulate", t, "--cluster", "2x2", "--json", tmp_path / "s.json")
        assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "o" / "plan.json").read_text())["strategy"] == "operate:moeplace"
    with open(tmp_path / "o" / "sglang.json", "a") as fh:
        fh.write(" ")
    line = one_line(cli.run(tmp_path, "operate", t, *OPERATE, "--out", tmp_path / "o"))
    assert "sglang.json" in line and "changed since" in line


# ------------------------------------------------------------------------------------------------ read-only places

SETPRIV = ["--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search", "--"]


def fresh(args: list[object], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m moeplace ARGS`` in a fresh process; as root, without the capability to write anywhere."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: cannot make a folder read-only")
        prefix = [setpriv, *SETPRIV]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    return subprocess.run([*prefix, sys.executable, "-m", "moeplace", *map(str, args)], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=300)


def test_read_only_places_are_refused_before_any_work(base, tmp_path):
    """Output folders and files in a folder this process may not write: one line naming the flag and the place
    (not a hidden temporary), before any work (synth calibrates, train-reference trains, operate replays)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    t = tmp_path / "T"
    shutil.copytree(base / "T", t)
    os.chmod(ro, 0o555)
    try:
        for args, flag in ((["synth", ro / "s.trace", "--preset", "gpt-oss-20b", "--requests", "8"], "out"),
                           (["operate", t, *OPERATE, "--out", ro / "o"], "--out"),
                           (["train-reference", "--config", "tiny", "--out", ro / "m"], "--out"),
                           (["simulate", t, "--cluster", "2x2", "--json", ro / "s.json"], "--json")):
            res = fresh(args, tmp_path)
            if res.returncode == 0 or "Permission denied" in res.stderr and "moeplace" not in res.stderr:
                pytest.skip(f"setpriv unusable here: {res.stderr[-300:]}")
            line = one_line(res)
            assert flag in line and str(ro) in line and "no permission" in line and ".new-" not in line, line
            assert sorted(os.listdir(ro)) == []
    finally:
        os.chmod(ro, 0o755)


# ------------------------------------------------------------------------------------------------ disk space

def test_synth_larger_than_the_free_disk_is_refused(cli, tmp_path):
    """4M requests of 2000 tokens (322 GB of routing stored at 20%) where the disk has less: one line naming the
    options and the free space, nothing written."""
    free = shutil.disk_usage(tmp_path).free
    if free > 300e9:
        pytest.skip(f"{free / 1e9:.0f} GB free: this disk would hold the trace")
    line = one_line(cli.run(tmp_path, "synth", tmp_path / "s.trace", "--preset", "gpt-oss-20b", "--requests",
                            "4194304", "--max-requests", "4194304", "--prompt-len", "1000", "--gen-len", "1000",
                            "--length-jitter", "0"))
    assert "--requests 4194304" in line and "GB free" in line and not (tmp_path / "s.trace").exists()


# ------------------------------------------------------------------------------------------------ options at bounds

BOUND_COMMANDS = {  # a cheap base command line per command; the option under test is appended
    "operate": ["operate", "@T", *OPERATE],
    "predict-kernel": ["predict-kernel", "--model", "deepseek-v3", "--cluster-preset", "h800-8", "--ep", "8",
                       "--mode", "deepep-ll", "--tokens-per-rank", "8"],
    "synth": ["synth", "@s.trace", "--preset", "gpt-oss-20b", "--requests", "4", "--prompt-len", "4", "--gen-len",
              "2", "--quiet"],
    "export": ["export", "@P", "--format", "sglang", "--out", "@o.json"],
}
# options that wait by design (seconds of wall clock), or apply to --source live / a profile, are not walked: a
# bound of theirs asks for an hour of sleep or a model load, not for memory; synth --requests at 4M short requests
# is a long job by design (time linear in requests, with a progress bar: CASES_25.md, M7)
NOT_WALKED = {"--linger", "--step-seconds", "--metrics-port", "--max-requests", "--max-new-tokens", "--batch-size",
              "--decode-running", "synth --requests"}


def bound_cases() -> list[tuple[str, str, str]]:
    """(command, option, value) for the lowest and highest value of every bounded numeric option."""
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    out = []
    for cmd in BOUND_COMMANDS:
        for a in subs[cmd]._actions:
            bounds = getattr(a.type, "bounds", None)
            flag = a.option_strings[0] if a.option_strings else ""
            if bounds is None or not flag or flag in NOT_WALKED or f"{cmd} {flag}" in NOT_WALKED:
                continue
            for v in bounds:
                if v in (float("inf"), float("-inf")) or abs(v) > 1 << 62:
                    continue
                out.append((cmd, flag, repr(v) if isinstance(v, float) else str(v)))
    return out


@pytest.mark.parametrize("cmd,option,value", bound_cases(), ids=lambda x: str(x))
def test_every_option_at_its_bounds(cmd, option, value, base, cli, tmp_path):
    """Each bounded option of operate, predict-kernel, synth and export at its lowest and highest value: exit 0, or
    one line (naming the option when the option is what is refused); never a traceback, a crash or a timeout."""
    d = tmp_path / "d"
    d.mkdir()
    for name in ("T", "P"):
        (shutil.copytree if (base / name).is_dir() else shutil.copy2)(base / name, d / name)
    argv = [str(d / a[1:]) if a.startswith("@") else a for a in BOUND_COMMANDS[cmd]]
    res = cli.run(tmp_path, *argv, option, value, timeout=120)
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert res.returncode in (0, 2), f"exit {res.returncode}: {res.stderr[-2000:]}"
    if res.returncode == 2:
        one_line(res)


# ------------------------------------------------------------------------------------------------ generated files

GOOD_SCHEDULE = {"format": "moeplace-mix-schedule", "version": 1,
                 "phases": [{"requests": 8, "mix": {"code": 0.7, "chat": 0.3}}, {"requests": 8, "mix": {"chat": 1}}],
                 "cycle": {"period": 10, "amplitude": {"code": 0.5}, "offset": {"chat": 0.5}},
                 "bursts": [{"start": 2, "length": 3, "key": "code", "share": 0.9}], "base": None}
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.sampled_from([10 ** 9, 2 ** 63, 1e308, -0.5,
                                                                                   0.5, 1.5, "", "code", "chat",
                                                                                   "nope", "x" * 70]),
                   st.lists(st.integers(0, 3), max_size=3), st.dictionaries(st.sampled_from(["code", "chat", "zz"]),
                                                                            st.floats(-1, 3), max_size=3))


def paths(obj, prefix=()):
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += paths(v, prefix + (i,))
    return out


def mutated(obj, path, value, delete):
    obj = json.loads(json.dumps(obj))
    if not path:
        return value
    cur = obj
    for k in path[:-1]:
        cur = cur[k]
    if delete and isinstance(cur, dict):
        del cur[path[-1]]
    else:
        cur[path[-1]] = value
    return obj


@PROPERTY
@given(path=st.sampled_from(paths(GOOD_SCHEDULE)), value=VALUES, delete=st.booleans(),
       stream=st.sampled_from([None, "1", "40"]))
def test_generated_schedules(path, value, delete, stream, base, cli, tmp_path_factory):
    """A valid schedule with one field replaced or removed: exit 0 (a stream of the asked length was replayed), or
    one line naming --schedule and the file."""
    d = tmp_path_factory.mktemp("sched")
    s = d / "s.json"
    sched = mutated(GOOD_SCHEDULE, path, value, delete)
    s.write_text(json.dumps(sched, allow_nan=True))
    extra = ["--stream-requests", stream] if stream else []
    res = cli.run(d, "operate", base / "T", *OPERATE, "--order", "schedule", "--schedule", s, *extra, "--json",
                  d / "o.json")
    if res.returncode == 0:
        out = json.loads((d / "o.json").read_text())
        n = int(stream) if stream else sum(p["requests"] for p in sched["phases"])
        assert sum(w["tokens"] for w in out["windows"]) == n * (PROMPT + GEN)
        return
    line = one_line(res)
    assert "--schedule" in line and str(s) in line or "--stream-requests" in line, line


@PROPERTY
@given(homes=st.dictionaries(st.integers(-2, 40).map(str) | st.sampled_from(["x", "1.5", "", "99999999999"]),
                             st.integers(-1, 5) | st.sampled_from([1.5, None, "0"]), max_size=6))
def test_generated_homes(homes, base, cli, tmp_path_factory):
    """Plans of the tiny trace with generated homes: exit 0 with every token replayed (homes of requests in the
    trace, on GPUs that exist), or one line naming the plan file."""
    d = tmp_path_factory.mktemp("homes")
    p = d / "p.json"
    p.write_text(json.dumps({**json.loads((base / "P").read_text()), "homes": homes}))
    res = cli.run(d, "simulate", base / "T", "--plan", p, "--json", d / "s.json")
    if res.returncode == 0:
        assert all(0 <= int(g) < 4 and 0 <= int(r) < N_REQ for r, g in homes.items())
        out = json.loads((d / "s.json").read_text())
        assert out["decode"]["num_tokens"] + out["prefill"]["num_tokens"] == N_REQ * (PROMPT + GEN)
        return
    assert str(p) in one_line(res)


@PROPERTY
@given(layers=st.sampled_from([1, 2, 4096, 4097]), experts=st.sampled_from([1, 2, 8, 32767, 32768]),
       fill=st.sampled_from([0.0, 1.0, 3.5, 1e15, 1e300, -1.0]), wrap=st.booleans())
def test_generated_load_shapes(layers, experts, fill, wrap, cli, tmp_path_factory):
    """Load matrices at and past the trace limits, and at and past the exact-sum limit: a plan of that shape, or one
    line naming the load file; nothing written on refusal."""
    if layers * experts > 1 << 16:  # keep each file small: the limits are met on one axis at a time
        experts = min(experts, (1 << 16) // layers) if layers <= 4096 else 1
    d = tmp_path_factory.mktemp("load")
    f, out = d / "l.json", d / "o.json"
    arr = np.full((layers, experts), fill).tolist()
    f.write_text(json.dumps({"logical_count": arr} if wrap else arr))
    res = cli.run(d, "plan", "--load", f, "--strategy", "eplb", "--cluster", "1x1", "--out", out)
    ok = layers <= 4096 and experts <= 32767 and fill >= 0 and fill * experts <= 2 ** 53 and fill > 0
    if res.returncode == 0:
        assert ok, (layers, experts, fill)
        assert np.asarray(json.loads(out.read_text())["phy2log"]).shape == (layers, experts)
        return
    line = one_line(res)
    assert str(f) in line and not out.exists(), line
    assert not ok, (layers, experts, fill, line)


def test_case_list_matches_the_checklist():
    """tests/fault/CASES_25.md names each case of this file (the issue's cases with their outcomes)."""
    text = (Path(__file__).with_name("CASES_25.md")).read_text()
    missing = [c.name for c in CASES if f"`{c.name}`" not in text]
    assert not missing, f"cases missing from CASES_25.md: {missing}"


def test_one_plan_is_what_the_base_built(base):
    """The base plan is a plain eplb plan of the tiny trace (what the cases edit)."""
    p = Plan.load(base / "P")
    assert p.strategy == "eplb" and p.placement.num_experts == E and p.cluster.spec() == Cluster(2, 2).spec()
    assert Placement.linear(L, E, 4).num_slots == p.placement.num_slots
    atomic_write_json({}, base / "unused.json")  # the writer's mark works on this file system
    from moeplace.io import moeplace_wrote

    assert moeplace_wrote(base / "unused.json")
