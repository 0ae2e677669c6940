"""Fault injection on plan, load and engine JSON, on options and on output paths.

Every case ends with exit 0 and a correct output, or exit 2 and one stderr line naming the file or option and the
problem, never a traceback. Cheap property cases call ``moeplace.cli.main`` in-process (an exception escaping it
fails the test: the CLI would have printed a traceback); a few run as real processes under the harness's 2 GB
address-space cap and timeout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from harness import assert_clean_failure, assert_clean_outcome, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeplace.cli import build_parser, main
from moeplace.placement import Cluster, Placement, Plan
from moeplace.plan.export import from_vllm
from moeplace.trace import TraceMeta, TraceWriter

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def work_dir():
    with tempfile.TemporaryDirectory(prefix="moeplace-fault-") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def tiny_trace(work_dir) -> Path:
    """L=2, E=8, K=2: 8 requests of 3 prefill + 5 decode tokens."""
    rng = np.random.default_rng(0)
    meta = TraceMeta(model="fault", num_layers=2, num_experts=8, top_k=2, hidden_size=16, synthetic=True,
                     source="tests")
    n = 8 * 8
    rid = np.repeat(np.arange(8), 8)
    pos = np.tile(np.arange(8), 8)
    phase = np.tile(np.array([0, 0, 0, 1, 1, 1, 1, 1], np.int8), 8)
    ids = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(2)]) for _ in range(n)])
    path = work_dir / "tiny.trace"
    with TraceWriter(path, meta) as w:
        w.add_requests(np.arange(8), domain=["chat"] * 8, prompt_len=[3] * 8, gen_len=[5] * 8)
        w.add_tokens(rid, pos, phase, ids.astype(np.int16))
    return path


def good_plan() -> dict:
    """A valid version-2 plan for the tiny trace's shape (2x2 cluster, L=2, E=8, 12 slots, a grouper)."""
    return Plan.load(FIXTURES / "plan_v1_joint.json").to_json()


def run_main(args: list[str], capsys) -> tuple[int, str]:
    """``main(args)`` in-process: (exit status, stderr). SystemExit from argparse counts as its status."""
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:
        rc = int(e.code or 0)
    return rc, capsys.readouterr().err


def check_outcome(rc: int, err: str, mentions: list[str]) -> None:
    assert "Traceback" not in err
    if rc == 0:
        return
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, (rc, err)
    for m in mentions:
        assert m in lines[0], (m, lines[0])


# --------------------------------------------------------------------------------------- JSON values and paths

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2 ** 80), 2 ** 80), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 1.0, 1.5, 2 ** 31, 2 ** 63, 2 ** 70, "", "2", "x" * 300, "big"]),
)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                    max_leaves=12)


def leaf_paths(obj, prefix=()) -> list[tuple]:
    """Every path into obj (dict keys and list indices), short lists sampled by their first two entries."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += leaf_paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:2]):
            out += leaf_paths(v, prefix + (i,))
    return out


PLAN_PATHS = leaf_paths(good_plan())


def replaced(obj, path: tuple, value, delete: bool = False):
    if not path:
        return value
    obj = json.loads(json.dumps(obj))
    cur = obj
    for k in path[:-1]:
        cur = cur[k]
    if delete and isinstance(cur, dict):
        del cur[path[-1]]
    else:
        cur[path[-1]] = value
    return obj


def dump(obj) -> str:
    """JSON text; NaN and Infinity appear as the non-standard constants a careless writer would emit."""
    return json.dumps(obj, allow_nan=True)


@PROPERTY
@given(path=st.sampled_from(PLAN_PATHS), value=JSON, delete=st.booleans())
def test_bad_plan_json_given_to_export(path, value, delete, work_dir, capsys):
    f = work_dir / "bad.plan.json"
    f.write_text(dump(replaced(good_plan(), path, value, delete)))
    out = work_dir / "exported.json"
    out.unlink(missing_ok=True)
    rc, err = run_main(["export", f, "--format", "vllm", "--out", out], capsys)
    check_outcome(rc, err, [str(f)])
    if rc == 0:  # what was accepted is exported correctly: the mapping reads back to the plan's placement
        plan = Plan.load(f)
        back = from_vllm(json.loads(out.read_text()))
        np.testing.assert_array_equal(back.phy2log, plan.placement.phy2log)


@PROPERTY
@given(path=st.sampled_from(PLAN_PATHS), value=JSON)
def test_bad_plan_json_given_to_simulate(path, value, tiny_trace, work_dir, capsys):
    f = work_dir / "sim.plan.json"
    f.write_text(dump(replaced(good_plan(), path, value)))
    rc, err = run_main(["simulate", tiny_trace, "--plan", f], capsys)
    check_outcome(rc, err, [])
    if rc == 2 and "plan does not fit the trace" not in err and "cluster" not in err.split(":")[0]:
        assert str(f) in err


LOADS = st.one_of(
    JSON,
    st.lists(st.lists(st.one_of(st.integers(0, 100), st.floats(), st.none(), st.text(max_size=2)), min_size=1,
                      max_size=5), min_size=1, max_size=3),
    st.builds(lambda x: {"logical_count": x}, JSON),
)


@PROPERTY
@given(load=LOADS)
def test_bad_load_json_given_to_plan(load, work_dir, capsys):
    f = work_dir / "bad.load.json"
    f.write_text(dump(load))
    out = work_dir / "load.plan.json"
    out.unlink(missing_ok=True)
    rc, err = run_main(["plan", "--load", f, "--strategy", "eplb", "--cluster", "1x1", "--out", out], capsys)
    check_outcome(rc, err, [])
    if rc == 0:
        arr = np.asarray(load["logical_count"] if isinstance(load, dict) else load, np.float64)
        arr = arr.sum(axis=0) if arr.ndim == 3 else arr
        assert np.isfinite(arr).all() and (arr >= 0).all()
        assert Plan.load(out).placement.phy2log.shape == arr.shape
    elif "argument" not in err and "num_redundant" not in err:
        assert str(f) in err


@pytest.mark.parametrize("text,message", [
    ("[" * 5000 + "]" * 5000, "nested too deeply"),
    ('{"format_version": 2, "cluster": {"num_nodes": NaN}}', "NaN"),
    ('{"format_version": 2e400}', "overflows"),
    ("1" * 5000, "not valid JSON"),
    ("", "not valid JSON"),
    ("\x00\xff", "not"),
])
def test_unparseable_plan_files(text, message, work_dir, capsys):
    f = work_dir / "raw.plan.json"
    f.write_bytes(text.encode("latin-1"))
    rc, err = run_main(["export", f, "--format", "sglang", "--out", work_dir / "s.json"], capsys)
    check_outcome(rc, err, [str(f), message])
    assert rc == 2


# --------------------------------------------------------------------------------------- options

def numeric_actions() -> list[tuple[str, argparse.Action]]:
    """(command, action) of every option of every command whose value is not free text."""
    out = []

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for a in parser._actions:  # argparse exposes no public walk of a parser's actions
            if isinstance(a, argparse._SubParsersAction):
                for sub_name, sub in a.choices.items():
                    walk(sub, f"{name} {sub_name}".strip())
            elif a.type is not None:
                out.append((name, a))

    walk(build_parser(), "")
    return out


def test_no_numeric_option_is_unbounded():
    parser = build_parser()
    untyped = []

    def walk(p, name):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub_name, sub in a.choices.items():
                    walk(sub, f"{name} {sub_name}".strip())
            elif a.type in (int, float):
                untyped.append(f"{name} {a.option_strings}")

    walk(parser, "")
    assert not untyped, f"options parsed with bare int/float (no range check): {untyped}"


BAD_NUMBERS = ["nan", "inf", "-inf", "1e400", "-1e400", "abc", "", "9" * 30, "-9" * 15, "1.5e308", "0x10"]


@pytest.mark.parametrize("cmd,action", numeric_actions(), ids=lambda x: x if isinstance(x, str) else
                         "/".join(x.option_strings) or x.dest)
def test_every_option_refuses_values_out_of_range(cmd, action):
    for text in BAD_NUMBERS:
        try:
            v = action.type(text)
        except argparse.ArgumentTypeError as e:
            assert "\n" not in str(e)
            continue
        # accepted: it must be a sane value (a path-like option may take any text)
        if isinstance(v, (int, float)):
            assert math.isfinite(v) and abs(v) < 2 ** 63, (cmd, action.option_strings, text, v)


@pytest.mark.parametrize("args,mentions", [
    (["plan", "--load", "L", "--strategy", "eplb", "--cluster", "2x1", "--redundant", "-3", "--out", "p.json"],
     ["--redundant", "-3"]),
    (["plan", "--load", "L", "--strategy", "joint", "--cluster", "2x1", "--time-limit", "nan", "--out", "p.json"],
     ["--time-limit"]),
    (["plan", "--load", "L", "--strategy", "eplb", "--cluster", "2x1", "--groups", "0", "--out", "p.json"],
     ["--groups"]),
    (["plan", "--load", "L", "--strategy", "eplb", "--cluster", "0x4", "--out", "p.json"], ["--cluster"]),
    (["plan", "--load", "L", "--strategy", "eplb", "--cluster", "999999x999", "--out", "p.json"], ["--cluster"]),
    (["plan", "--load", "L", "--strategy", "eplb", "--cluster", "2x1", "--redundant", "1000", "--out", "p.json"],
     ["num_redundant=1000"]),
    (["plan", "--load", "L", "--strategy", "eplb", "--cluster", "2x1", "--balance-floor", "1.5", "--out", "p"],
     ["--balance-floor"]),
    (["compare", "T", "--cluster", "2x2", "--plot", "f.png"], ["--sweep-floor"]),
    (["compare", "T", "--cluster", "2x2", "--holdout", "1"], ["--holdout"]),
    (["compare", "T", "--cluster", "2x2", "--sweep-floor", "0.9,nan"], ["--sweep-floor"]),
    (["export", "P", "--format", "sglang", "--num-decoder-layers", "100000000", "--out", "s.json"],
     ["--num-decoder-layers"]),
    (["simulate", "T", "--cluster", "2x2", "--redundant", "4000000"], ["--redundant"]),
    (["simulate", "T", "--cluster", "2x2", "--redundant", "100000"], ["num_redundant=100000"]),
    (["simulate", "T", "--cluster", "2x2", "--hidden-size", "-5"], ["--hidden-size"]),
    (["simulate", "T", "--cluster", "2x2", "--dispatch-bytes", "inf"], ["--dispatch-bytes"]),
    (["analyze", "T", "--max-request-bytes", "-1"], ["--max-request-bytes"]),
    (["analyze", "T", "--test-fraction", "nan"], ["--test-fraction"]),
    (["synth", "out.trace", "--preset", "gpt-oss-20b", "--requests", "0"], ["--requests"]),
    (["trace", "record", "--model", "m", "--prompts", "p", "--max-new-tokens", "1", "--device", "bogus", "o"],
     ["--device"]),
    (["trace", "record", "--model", "m", "--prompts", "p", "--max-new-tokens", "2", "--min-new-tokens", "3", "o"],
     ["--min-new-tokens"]),
    (["trace", "record", "--model", "m", "--prompts", "p", "--max-new-tokens", "2", "--min-new-tokens", "-1", "o"],
     ["--min-new-tokens"]),
    (["run-ep", "T", "--plan", "P", "--cluster", "2x2", "--ffn", "-3"], ["--ffn"]),
    (["run-ep", "T", "--plan", "P", "--cluster", "2x2", "--hidden-size", "100000000"], ["--hidden-size"]),
])
def test_options_out_of_range(args, mentions, tiny_trace, work_dir, capsys):
    load = work_dir / "ok.load.json"
    load.write_text(json.dumps([[1, 2, 3, 4], [4, 3, 2, 1]]))
    plan = work_dir / "ok.plan.json"
    Plan(Placement.linear(2, 8, 4), Cluster(2, 2)).save(plan)
    subst = {"L": str(load), "T": str(tiny_trace), "P": str(plan)}
    args = [subst.get(a, a) for a in args]
    cwd = os.getcwd()
    os.chdir(work_dir)
    try:
        rc, err = run_main(args, capsys)
    finally:
        os.chdir(cwd)
    check_outcome(rc, err, mentions)
    assert rc == 2


# --------------------------------------------------------------------------------------- paths

def test_directories_fifos_and_long_names_as_outputs(tiny_trace, work_dir, capsys):
    d = work_dir / "outs"
    d.mkdir(exist_ok=True)
    fifo = d / "fifo.json"
    if not fifo.exists():
        os.mkfifo(fifo)
    (d / "file").write_text("x")
    plan = d / "p.json"
    Plan(Placement.linear(2, 8, 4), Cluster(2, 2)).save(plan)
    bad_outputs = {str(d): "is a directory", str(d) + "/": "directory", str(fifo): "not a regular file",
                   str(d / "file" / "x.json"): "file is not a directory", str(d / ("a" * 251 + ".json")): "too long",
                   "/dev/null": "not a regular file"}
    for out, problem in bad_outputs.items():
        cases = [
            ["plan", tiny_trace, "--strategy", "eplb", "--cluster", "2x2", "--out", out],
            ["export", plan, "--format", "vllm", "--out", out],
            ["simulate", tiny_trace, "--cluster", "2x2", "--json", out],
            ["analyze", tiny_trace, "--html", out],
            ["analyze", tiny_trace, "--json", out],
            ["compare", tiny_trace, "--cluster", "2x2", "--json", out],
            ["compare", tiny_trace, "--cluster", "2x2", "--sweep-floor", "0.9", "--plot", out],
            ["run-ep", tiny_trace, "--plan", plan, "--cluster", "2x2", "--json", out],
        ]
        for args in cases:
            rc, err = run_main(args, capsys)
            check_outcome(rc, err, [problem])
            assert rc == 2, (args, err)
    for args, problem in ((["export", d, "--format", "vllm", "--out", d / "o.json"], "is a directory"),
                          (["simulate", tiny_trace, "--plan", d], "is a directory"),
                          (["simulate", tiny_trace, "--plan", fifo], "not a regular file"),
                          (["plan", "--load", d / "missing.json", "--strategy", "eplb", "--cluster", "1x1",
                            "--out", d / "o.json"], "No such file"),
                          (["run-ep", tiny_trace, "--plan", d, "--cluster", "2x2"], "is a directory"),
                          (["synth", d / "file", "--preset", "gpt-oss-20b"], "not a directory")):
        rc, err = run_main(args, capsys)
        check_outcome(rc, err, [problem])
        assert rc == 2, (args, err)


# --------------------------------------------------------------------------------------- real processes

class Evil:
    """Unpickling this runs a shell command."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_real_processes(tiny_trace, work_dir):
    d = work_dir / "proc"
    d.mkdir(exist_ok=True)
    marker = d / "pwned"
    (d / "text.pt").write_text("this is not a torch file\n")
    (d / "raw.pt").write_bytes(pickle.dumps({"logical_count": Evil(str(marker))}))
    import torch

    torch.save({"logical_count": Evil(str(marker))}, d / "evil.pt")
    torch.save({"logical_count": torch.tensor([[[1.0, float("nan")], [2.0, 3.0]]])}, d / "nan.pt")
    torch.save({"logical_count": torch.tensor([[[1, 2], [2, 3]]])}, d / "good.pt")
    for name, problem in (("text.pt", "not a torch file"), ("raw.pt", "not a torch file"),
                          ("evil.pt", "not a torch file"), ("nan.pt", "NaN")):
        proc = run_cli(["plan", "--load", d / name, "--strategy", "eplb", "--cluster", "1x1", "--out",
                        d / "p.json"], cwd=d, timeout=120)
        assert_clean_failure(proc, [str(d / name), problem])
    assert not marker.exists(), "a pickle ran code"
    proc = run_cli(["plan", "--load", d / "good.pt", "--strategy", "eplb", "--cluster", "1x1", "--out",
                    d / "p.json"], cwd=d, timeout=120)
    assert assert_clean_outcome(proc) and Plan.load(d / "p.json").placement.num_experts == 2
    # a plan nested 100k deep, a simulate that would allocate 4M slots, an option out of range
    (d / "deep.json").write_text("[" * 100000 + "]" * 100000)
    proc = run_cli(["simulate", tiny_trace, "--plan", d / "deep.json"], cwd=d, timeout=120)
    assert_clean_failure(proc, [str(d / "deep.json"), "nested too deeply"])
    proc = run_cli(["simulate", tiny_trace, "--cluster", "2x2", "--redundant", "1000000"], cwd=d, timeout=120)
    assert_clean_failure(proc, ["num_redundant=1000000"])
    proc = run_cli(["export", FIXTURES / "plan_v1_joint.json", "--format", "sglang", "--num-decoder-layers",
                    "100000000", "--out", d / "s.json"], cwd=d, timeout=60)
    assert_clean_failure(proc, ["--num-decoder-layers"])
    # the v1 fixture is accepted end to end: export (it records no model layout, so the row count is given) and
    # simulate
    proc = run_cli(["export", FIXTURES / "plan_v1_joint.json", "--format", "sglang", "--num-decoder-layers", "2",
                    "--out", d / "s.json"], cwd=d, timeout=60)
    assert assert_clean_outcome(proc) and len(json.loads((d / "s.json").read_text())["physical_to_logical_map"]) == 2
    proc = run_cli(["simulate", tiny_trace, "--plan", FIXTURES / "plan_v1_joint.json"], cwd=d, timeout=180)
    assert assert_clean_outcome(proc) and "decode" in proc.stdout


def test_closed_pipe_exits_quietly(work_dir):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
    p = subprocess.Popen([sys.executable, "-m", "moeplace", "plan", "--list"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env, cwd=work_dir)
    p.stdout.close()  # the reader is gone before the first write, as with `| head -0`
    _, err = p.communicate(timeout=60)
    assert err.decode() == "" and p.returncode == 141


# --------------------------------------------------------------------------------------- FoE plans and traces


@pytest.fixture(scope="module")
def foe_files(work_dir):
    """An FoE trace (synthetic, H = 2, E = 32, k = 4) and a valid FoE plan for it on 2x2."""
    from moeplace.simulate.synth import SynthConfig, synthesize

    trace = work_dir / "foe.trace"
    if not trace.exists():
        synthesize(trace, "gpt-oss-20b", SynthConfig(num_requests=8, prompt_len=4, gen_len=2, foe_groups=2,
                                                     calibrate=False))
    plan = work_dir / "foe.plan.json"
    assert main(["plan", str(trace), "--strategy", "foe", "--cluster", "2x2", "--out", str(plan)]) == 0
    return trace, json.loads(plan.read_text())


@pytest.mark.parametrize("value", [0, -1, 1, 3, 5, 2.5, "2", None, True, [2], {"h": 2}, 10 ** 30, "delete"])
def test_bad_foe_groups_in_a_plan_given_to_run_ep(value, foe_files, work_dir, capsys):
    """run-ep on an FoE trace with a plan whose foe_groups is wrong in type, range or fit: exit 2, one line naming
    the plan file, before any rank starts (a plain plan for an FoE trace included)."""
    trace, plan = foe_files
    bad = {k: v for k, v in plan.items() if k != "foe_groups"} if value == "delete" else {**plan, "foe_groups": value}
    f = work_dir / "foe-bad.plan.json"
    f.write_text(dump(bad))
    rc, err = run_main(["run-ep", trace, "--plan", f, "--cluster", "2x2", "--microbatches", "1"], capsys)
    assert rc == 2
    check_outcome(rc, err, [str(f)])


@pytest.mark.parametrize("args", [["--strategy", "foe", "--cluster", "4x1"], ["--strategy", "foe", "--cluster", "2x2",
                                                                              "--redundant", "4"]])
def test_foe_plans_that_cannot_be_placed(args, foe_files, work_dir, capsys):
    trace, _ = foe_files
    out = work_dir / "never.json"
    rc, err = run_main(["plan", trace, *args, "--out", out], capsys)
    assert rc == 2 and not out.exists()
    check_outcome(rc, err, [])
