"""run-ep and cluster under bad options, concurrency and kill -9, with real processes.

- options out of range, or meaningless together, end with exit 2 and one line before any rank starts;
- an output path that cannot be written is refused before the run, and a report that cannot be written at the
  end is printed instead of lost;
- one process at a time changes a cluster: a concurrent ``cluster up`` of another shape gets one line, exit 2;
- ``kill -9`` of run-ep leaves no rank process and no namespace; ``cluster down --stale`` removes orphans.

Namespace tests need root and iproute2; they skip with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import moeplace
from moeplace.cli import main
from moeplace.placement import Cluster, Placement, Plan
from moeplace.run import launch as launch_mod
from moeplace.run.netns import (
    STATE_DIR,
    ClusterBusy,
    check_support,
    cluster_down,
    cluster_lock,
    cluster_up,
    list_namespaces,
    load_cluster,
    process_start_time,
)
from moeplace.run.report import RunEpOptions, run_ep
from moeplace.trace import TraceMeta, TraceWriter

REASON = check_support()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")
SRC = str(Path(moeplace.__file__).resolve().parents[1])
MOEPLACE = [sys.executable, "-c", "import sys; from moeplace.cli import main; sys.exit(main())"]
ENV = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _alive(pid: int) -> bool:
    return process_start_time(pid) is not None  # gone or a zombie: dead


def _children(pid: int, marker: bytes) -> list[int]:
    """Live children of ``pid`` whose command line contains ``marker``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and marker in cmd and _alive(int(d.name)):
            out.append(int(d.name))
    return out


def _wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def tiny(tmp_path):
    """A 2-layer, 8-expert, top-2 trace with 8 requests of 40 decode tokens and a matching linear 2x2 plan."""
    rng = np.random.default_rng(0)
    L, E, K, R, G = 2, 8, 2, 8, 40
    meta = TraceMeta(model="hand-made", num_layers=L, num_experts=E, top_k=K, hidden_size=8, synthetic=True,
                     source="tests")
    n = R * G
    ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(n)])
    with TraceWriter(tmp_path / "t.trace", meta) as w:
        w.add_requests(np.arange(R), domain=["chat"] * R, prompt_len=[1] * R, gen_len=[G - 1] * R)
        w.add_tokens(np.repeat(np.arange(R), G), np.tile(np.arange(G), R), np.tile([0] + [1] * (G - 1), R), ids)
    Plan(Placement.linear(L, E, 4), Cluster(2, 2)).save(tmp_path / "plan.json")
    return tmp_path / "t.trace", tmp_path / "plan.json", tmp_path


@pytest.fixture
def no_spawn(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a process was started for a run that should have been rejected")

    monkeypatch.setattr(launch_mod, "launch", boom)


def _one_error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "error:" in lines[0]
    return lines[0]


# ------------------------------------------------------------------------------------------------ options


@pytest.mark.parametrize("extra, expect", [
    (["--ffn", "-3"], "--ffn"),
    (["--hidden-size", "100000000"], "--hidden-size"),
    (["--hidden-size", "0"], "--hidden-size"),
    (["--hidden-size", "12.5"], "--hidden-size"),
    (["--repeats", "0"], "--repeats"),
    (["--microbatches", "-1"], "--microbatches"),
    (["--skip", "-2"], "--skip"),
    (["--batch-tokens", "0"], "--batch-tokens"),
    (["--timeout", "nan"], "--timeout"),
    (["--timeout", "inf"], "--timeout"),
    (["--emulate", "--inter-gbit", "-1"], "--inter-gbit"),
    (["--emulate", "--inter-delay-ms", "1e9"], "--inter-delay-ms"),
    (["--inter-gbit", "1"], "--inter-gbit"),  # without --emulate: would do nothing
    (["--inter-delay-ms", "5"], "--inter-delay-ms"),
    (["--netns", "x", "--inter-gbit", "1"], "--inter-gbit"),
    (["--emulate", "--netns", "x"], "--netns"),
    (["--dtype", "int8"], "--dtype"),
    (["--emulate-compute", "--compute-flops", "0"], "--compute-flops"),
    (["--compute-hbm-gbps", "10"], "--compute-hbm-gbps"),  # without --emulate-compute: would do nothing
    # deployment-group flags a measured run has no use for: refused, never ignored
    (["--mode", "nccl"], "--mode does not apply to run-ep"),
    (["--overlap"], "--overlap does not apply to run-ep"),
    (["--dispatch-bytes", "2"], "--dispatch-bytes does not apply to run-ep"),
    (["--combine-bytes", "4"], "--combine-bytes does not apply to run-ep"),
    (["--batch-tokens", "8", "--prefill-tokens", "16"], "--batch-tokens"),
    (["--decode-batch", "0"], "--decode-batch"),
    (["--cluster", "4x1"], "does not match the plan's cluster 2x2"),
    (["--cluster", "2"], "--cluster-preset"),
])
def test_out_of_range_options_are_one_line_exit_2_before_any_rank(tiny, no_spawn, capsys, extra, expect):
    trace, plan, _ = tiny
    argv = ["run-ep", str(trace), "--plan", str(plan), "--cluster", "2x2", *extra]
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own exit
        rc = e.code
    assert rc == 2
    assert expect in _one_error_line(capsys.readouterr().err)


def test_library_options_are_checked_too(tmp_path):
    base = dict(trace=tmp_path, plan=tmp_path / "p.json", cluster="2x2")
    for bad in (dict(ffn=-3), dict(hidden=10 ** 8), dict(hidden=True), dict(repeats=1.5), dict(timeout=float("nan")),
                dict(inter_gbit=1.0), dict(emulate=True, netns="x"), dict(rule="nope"), dict(phase="both"),
                dict(compute_flops=1e9), dict(emulate_compute=True, compute_hbm_gbps=-1.0)):
        with pytest.raises(ValueError):
            RunEpOptions(**base, **bad)
    RunEpOptions(**base, emulate=True, inter_gbit=1.0, timeout=5)  # valid
    RunEpOptions(**base, emulate_compute=True, compute_flops=1e9, compute_hbm_gbps=50.0)  # valid


def test_memory_the_ranks_would_need_is_checked_before_they_start(tiny, no_spawn, capsys):
    trace, plan, _ = tiny
    # 8 experts x 2 x 60000^2 float32 per rank: about 230 GiB per rank, far above any test machine
    rc = main(["run-ep", str(trace), "--plan", str(plan), "--cluster", "2x2", "--hidden-size", "60000",
               "--ffn", "60000"])
    assert rc == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "GiB" in line and "--hidden-size" in line
    # through the library with an explicit budget: 4 ranks x (8 experts x 2 x 4096^2 float32 + base) > 4 GiB
    opts = RunEpOptions(trace, plan, "2x2", hidden=4096, ffn=4096)
    with pytest.raises(ValueError, match="would need about"):
        run_ep(opts, memory_budget=4 << 30)


@pytest.mark.parametrize("kind", ["dir", "under_file", "long_name", "read_only"])
def test_unwritable_json_is_refused_before_the_run(tiny, no_spawn, capsys, kind):
    trace, plan, tmp = tiny
    if kind == "dir":
        out = tmp / "outdir"
        out.mkdir()
    elif kind == "under_file":
        out = plan / "x.json"  # plan.json is a file
    elif kind == "long_name":
        out = tmp / ("x" * 251 + ".json")  # 256 bytes: over NAME_MAX
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes anywhere")
        ro = tmp / "ro"
        ro.mkdir(mode=0o500)
        out = ro / "x.json"
    rc = main(["run-ep", str(trace), "--plan", str(plan), "--cluster", "2x2", "--json", str(out)])
    assert rc == 2
    assert "--json" in _one_error_line(capsys.readouterr().err)


def test_run_ep_with_emulated_compute_reports_the_wait_next_to_the_prediction(tiny, tmp_path, capsys):
    trace, plan, _ = tiny
    out = tmp_path / "emu.json"
    rc = main(["run-ep", str(trace), "--plan", str(plan), "--cluster", "2x2", "--batch-tokens", "8",
               "--microbatches", "2", "--repeats", "1", "--emulate-compute", "--compute-flops", "1e6",
               "--compute-hbm-gbps", "0.01", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "emulated expert compute" in text
    rep = json.loads(out.read_text())
    assert rep["config"]["emulate_compute"] and rep["config"]["compute_device"]["expert_flops"] == 1e6
    _check_text_and_unit(text, rep)
    waited, predicted = rep["emulated_compute_s"]["total"], rep["predicted"]["kernel_time"]["expert_time_s"]["total"]
    assert waited == pytest.approx(predicted, rel=1e-9) and waited > 0
    assert rep["layer_time_s"]["total"] >= waited  # the wait is inside every timed layer call
    assert rep["bytes_match_simulator"]


def _check_text_and_unit(text: str, rep: dict) -> None:
    """run-ep's text and JSON: one layer on one micro-batch in µs, measured next to predicted, the replayed tokens
    out of the trace's, and the measured ratio in words (docs/RUNTIME.md, "Units")."""
    M, L = rep["window"]["num_microbatches"], len(rep["layer_time_s"]["per_layer"])
    measured = rep["layer_time_us_per_microbatch"]["decode"]
    predicted = rep["predicted"]["layer_time_us_per_microbatch"]["decode"]
    assert measured == pytest.approx(rep["layer_time_s"]["total"] / (M * L) * 1e6)
    assert predicted == pytest.approx(rep["predicted"]["kernel_time"]["layer_time_s"]["total"] / (M * L) * 1e6)
    assert (f"layer time per layer per micro-batch: measured {measured:,.1f} µs, predicted {predicted:,.1f} µs"
            in text)
    w = rep["window"]
    assert w["trace_tokens"] == 320 and f"replayed {w['num_tokens']:,} of 320 tokens in the trace" in text
    ratio = measured / predicted
    assert "measured / predicted = " in text
    assert (f"{ratio:.2f}x" if 0.5 <= ratio <= 2 else f"{ratio:,.0f}x") in text
    assert "compare ratios between plans" in text or "close to the time model" in text


def test_run_ep_text_gives_us_per_layer_per_microbatch_and_the_replayed_tokens(tiny, tmp_path, capsys):
    trace, plan, _ = tiny
    out = tmp_path / "run.json"
    rc = main(["run-ep", str(trace), "--plan", str(plan), "--cluster", "2x2", "--decode-batch", "4",
               "--microbatches", "2", "--repeats", "1", "--hidden-size", "16", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert rep["config"]["hidden"] == 16 and rep["config"]["decode_batch"] == 4
    assert rep["config"]["batch_tokens"] == 4  # the replayed phase's batch size, as before
    assert "2 decode micro-batches of up to 4 requests" in text and "gloo over loopback" in text
    _check_text_and_unit(text, rep)


def test_a_report_that_cannot_be_written_at_the_end_is_printed_not_lost(tiny, capsys):
    """The path is fine when checked; while the ranks run, a file takes the place of the report's folder."""
    trace, plan, tmp = tiny
    out = tmp / "later" / "run.json"

    def block_the_folder():  # as soon as the ranks exist, i.e. after every check passed
        _wait_for(lambda: _children(os.getpid(), b"moeplace.run.launch"), 60, "the ranks to start")
        (tmp / "later").write_text("a file where the report's folder should be")

    t = threading.Thread(target=block_the_folder)
    t.start()
    try:
        rc = main(["run-ep", str(trace), "--plan", str(plan), "--cluster", "2x2", "--batch-tokens", "8",
                   "--microbatches", "2", "--repeats", "1", "--json", str(out)])
    finally:
        t.join()
    cap = capsys.readouterr()
    assert rc == 1, cap.err
    assert "printed to stdout" in _one_error_line(cap.err)
    report = json.loads(cap.out)  # nothing lost
    assert report["bytes_match_simulator"] is True and report["window"]["num_microbatches"] == 2


# ------------------------------------------------------------------------------------------------ locks


@needs_netns
def test_cluster_up_while_another_process_changes_it_is_one_line_exit_2(capsys):
    name = f"mpl{os.getpid()}"
    try:
        with cluster_lock(name):  # as another `cluster up` would hold it
            rc = main(["cluster", "up", "--nodes", "2", "--gpus-per-node", "1", "--name", name])
            assert rc == 2
            line = _one_error_line(capsys.readouterr().err)
            assert "busy" in line and name in line
            assert main(["cluster", "down", "--name", name]) == 2
            assert "busy" in _one_error_line(capsys.readouterr().err)
        assert list_namespaces(name) == []  # the refused bring-up built nothing
        with cluster_lock(name, shared=True):  # a run on it (run-ep --netns) holds it shared
            with pytest.raises(ClusterBusy):
                cluster_up(2, 1, name=name)
            with cluster_lock(name, shared=True):  # two runs may share it
                pass
    finally:
        cluster_down(name)


RACE = """
import json, sys
from moeplace.run.netns import ClusterBusy, cluster_up
print("ready", flush=True)
sys.stdin.readline()
try:
    c = cluster_up(int(sys.argv[2]), 1, inter_gbit=1.0, name=sys.argv[1])
except ClusterBusy as e:
    print(e, file=sys.stderr)
    sys.exit(2)
print(c.num_nodes)
"""


@needs_netns
def test_two_concurrent_cluster_ups_of_different_shapes_give_one_cluster_and_one_error():
    """Two processes bring up one name with different shapes at the same moment: one builds its shape whole, the
    other is refused (the CLI turns that refusal into one line and exit 2: tested above)."""
    name = f"mpr{os.getpid()}"
    shapes = (24, 25)  # about 0.5 s to build each: far longer than the two processes take to wake
    procs = [subprocess.Popen([sys.executable, "-c", RACE, name, str(n)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV) for n in shapes]
    try:
        for p in procs:
            assert p.stdout.readline() == "ready\n"  # imports done: what is left is the bring-up itself
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=60) for p in procs]
        assert sorted(p.returncode for p in procs) == [0, 2], outs
        win = next(i for i, p in enumerate(procs) if p.returncode == 0)
        assert "busy" in outs[1 - win][1] and "Traceback" not in outs[1 - win][1]
        assert int(outs[win][0]) == shapes[win]
        c = load_cluster(name)
        assert c is not None and c.num_nodes == shapes[win]  # the winner's shape, whole
        assert len(list_namespaces(name)) == shapes[win] + 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        cluster_down(name, wait=30)
    assert list_namespaces(name) == []


# ------------------------------------------------------------------------------------------------ kill -9


def _start_run(trace: Path, plan: Path, *extra: str) -> subprocess.Popen:
    """A run-ep that lasts well beyond the test's kill: many repeats of a few micro-batches."""
    return subprocess.Popen([*MOEPLACE, "run-ep", str(trace), "--plan", str(plan), "--cluster", "2x2",
                             "--batch-tokens", "8", "--microbatches", "4", "--repeats", "1000", "--timeout", "300",
                             *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)


def test_ranks_die_with_run_ep_killed_by_sigkill(tiny):
    trace, plan, _ = tiny
    run = _start_run(trace, plan)
    try:
        ranks = _wait_for(lambda: (r := _children(run.pid, b"moeplace.run.launch")) and len(r) == 4 and r,
                          60, "4 rank processes")
        time.sleep(1.0)  # past their first instructions: the parent-death signal is set
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
        _wait_for(lambda: not any(_alive(p) for p in ranks), 5, f"ranks {ranks} to die after their parent")
    finally:
        if run.poll() is None:
            run.kill()


@needs_netns
def test_namespaces_and_ranks_die_with_emulated_run_ep_killed_by_sigkill(tiny):
    trace, plan, _ = tiny
    run = _start_run(trace, plan, "--emulate", "--inter-gbit", "1")
    name = f"mp{run.pid}"
    try:
        ranks = _wait_for(lambda: (r := _children(run.pid, b"moeplace.run.launch")) and len(r) == 4 and r,
                          60, "4 rank processes")
        watchdogs = _children(run.pid, b"--remove-on-eof")
        assert len(watchdogs) == 1
        assert len(list_namespaces(name)) == 3 and load_cluster(name).owner_pid == run.pid
        time.sleep(1.0)
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
        _wait_for(lambda: not any(_alive(p) for p in ranks), 5, f"ranks {ranks} to die after their parent")
        _wait_for(lambda: list_namespaces(name) == [], 10, f"namespaces of {name} to be removed")
        _wait_for(lambda: not _alive(watchdogs[0]), 10, "the watchdog to finish")
        assert not (STATE_DIR / f"{name}.json").exists()
    finally:
        if run.poll() is None:
            run.kill()
        cluster_down(name, wait=30)


@needs_netns
def test_cluster_down_stale_removes_orphans_only(capsys):
    dead, kept, mine, half = (f"mps{os.getpid()}{x}" for x in "dkmh")
    try:
        # a private cluster whose owner exits without cleaning up (as after kill -9 of owner and watchdog)
        subprocess.run([sys.executable, "-c", "import os, sys; from moeplace.run.netns import cluster_up; "
                        "cluster_up(2, 1, name=sys.argv[1], owner_pid=os.getpid())", dead], check=True, env=ENV)
        cluster_up(2, 1, name=kept)  # brought up on purpose: not an orphan
        cluster_up(1, 1, name=mine, owner_pid=os.getpid())  # owner alive
        with cluster_lock(half):  # a bring-up killed half-way: a namespace, no state
            subprocess.run(["ip", "netns", "add", f"{half}-br"], check=True)
        assert len(list_namespaces(dead)) == 3 and list_namespaces(half) == [f"{half}-br"]
        assert main(["cluster", "down", "--stale"]) == 0
        err = capsys.readouterr().err
        assert f"{dead}-br" in err and f"{half}-br" in err
        assert list_namespaces(dead) == [] and list_namespaces(half) == []
        assert load_cluster(dead) is None
        assert load_cluster(kept) is not None and load_cluster(mine) is not None
        assert main(["cluster", "down", "--stale", "--name", kept]) == 2  # one or the other, not both
        assert "not allowed" in _one_error_line(capsys.readouterr().err)
    finally:
        for n in (dead, kept, mine, half):
            cluster_down(n)
