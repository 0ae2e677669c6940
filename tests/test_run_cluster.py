"""Emulated nodes, the launcher's failure handling and run-ep's checks before any process starts.

Namespace tests need root and iproute2 (CI runs as root); they skip with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moeplace.cli import main
from moeplace.placement import Cluster, Placement, Plan
from moeplace.run import launch as launch_mod
from moeplace.run.launch import INJECTED_FAILURE_EXIT, RankFailed, launch
from moeplace.run.netns import (
    NODE_IFNAME,
    check_support,
    cluster_down,
    cluster_up,
    list_namespaces,
    load_cluster,
)
from moeplace.trace import TraceMeta, TraceWriter

REASON = check_support()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")


def _rank_processes() -> list[int]:
    """Pids of rank processes (python -m moeplace.run.launch --worker ...) started by this test process,
    zombies included (a rank killed but never waited for)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == os.getpid() and (b"--worker" in cmd or cmd == [b""]):
                out.append(int(d.name))
    return out


@pytest.fixture
def tiny(tmp_path):
    """A 2-layer, 8-expert, top-2 trace with 4 requests and a matching linear 2x2 plan."""
    rng = np.random.default_rng(0)
    L, E, K = 2, 8, 2
    meta = TraceMeta(model="hand-made", num_layers=L, num_experts=E, top_k=K, hidden_size=8, synthetic=True,
                     source="tests")
    n = 4 * 3
    ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(n)])
    with TraceWriter(tmp_path / "t.trace", meta) as w:
        w.add_requests(np.arange(4), domain=["chat"] * 4, prompt_len=[1] * 4, gen_len=[3] * 4)
        w.add_tokens(np.repeat(np.arange(4), 3), np.tile(np.arange(3), 4), np.tile([0, 1, 1], 4), ids)
    plan = Plan(Placement.linear(L, E, 4), Cluster(2, 2))
    plan.save(tmp_path / "plan.json")
    return tmp_path / "t.trace", tmp_path / "plan.json", tmp_path


# ------------------------------------------------------------------------------------------------ namespaces


@needs_netns
def test_cluster_up_is_idempotent_and_down_leaves_nothing():
    name = f"mpt{os.getpid()}"
    try:
        c = cluster_up(2, 2, inter_gbit=2.0, name=name)
        assert c.mode == "netns" and c.rank_netns() == [f"{name}-n0"] * 2 + [f"{name}-n1"] * 2
        assert list_namespaces(name) == sorted([f"{name}-br", f"{name}-n0", f"{name}-n1"])
        qd = subprocess.run(["ip", "netns", "exec", f"{name}-n1", "tc", "-j", "qdisc", "show", "dev", NODE_IFNAME],
                            capture_output=True, text=True, check=True).stdout
        assert any(q.get("kind") == "tbf" for q in json.loads(qd)), qd
        assert cluster_up(2, 2, inter_gbit=2.0, name=name) == c  # same request: reused as is
        assert load_cluster(name) == c
        c3 = cluster_up(3, 1, name=name)  # a different shape: rebuilt
        assert list_namespaces(name) == sorted([f"{name}-br"] + [f"{name}-n{i}" for i in range(3)])
        assert c3.world_size == 3
        # node 0 reaches node 2 through the bridge, and only our addresses exist in there
        ping = subprocess.run(["ip", "netns", "exec", c3.node_ns(0), sys.executable, "-c",
                               f"import socket; s=socket.create_connection(('{c3.addr(2)}', 9), 2)"],
                              capture_output=True, text=True)
        assert "refused" in ping.stderr.lower(), ping.stderr  # routed there, nobody listening: reachable
    finally:
        removed = cluster_down(name)
    assert len(removed) == 4
    assert list_namespaces(name) == [] and load_cluster(name) is None
    assert cluster_down(name) == []  # idempotent


@needs_netns
def test_cluster_cli_up_down(capsys):
    name = f"mpc{os.getpid()}"
    try:
        assert main(["cluster", "up", "--nodes", "2", "--gpus-per-node", "1", "--inter-gbit", "1",
                     "--inter-delay-ms", "1", "--name", name]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["mode"] == "netns" and info["master_addr"] == "10.77.0.1"
        if not info["delay_applied"]:
            assert "netem" in info["note"]  # says what it could not do
        assert main(["cluster", "up", "--nodes", "2", "--gpus-per-node", "1", "--inter-gbit", "1",
                     "--inter-delay-ms", "1", "--name", name]) == 0
        assert "already up" in capsys.readouterr().err
    finally:
        assert main(["cluster", "down", "--name", name]) == 0
    assert main(["cluster", "down", "--name", name]) == 0
    assert "nothing to remove" in capsys.readouterr().err
    assert list_namespaces(name) == []


def test_cluster_falls_back_to_loopback_and_says_so(monkeypatch):
    monkeypatch.setattr("moeplace.run.netns.check_support", lambda: "building network namespaces needs root")
    c = cluster_up(2, 2, name="mpfallback")
    assert c.mode == "loopback" and "needs root" in c.note and "loopback" in c.note
    assert c.rank_netns() == [None] * 4 and c.master_addr == "127.0.0.1"
    with pytest.raises(Exception, match="needs root"):
        cluster_up(2, 2, name="mpfallback", fallback=False)


def test_cluster_rejects_bad_arguments():
    with pytest.raises(ValueError, match="nodes"):
        cluster_up(0, 2, name="mpbad")
    with pytest.raises(ValueError, match="inter_gbit"):
        cluster_up(2, 2, inter_gbit=-1, name="mpbad")
    with pytest.raises(ValueError, match="cluster name"):
        cluster_up(2, 2, name="bad name;rm")


# ------------------------------------------------------------------------------------------------ failures


@needs_netns
def test_a_dying_rank_fails_the_run_naming_it(tiny, monkeypatch, capsys):
    trace, plan, _ = tiny
    monkeypatch.setenv("MOEPLACE_RUN_FAIL_RANK", "2")
    rc = main(["run-ep", str(trace), "--plan", str(plan), "--cluster", "2x2", "--emulate", "--batch-tokens", "4",
               "--microbatches", "1", "--repeats", "1", "--timeout", "60"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "rank 2" in err and f"code {INJECTED_FAILURE_EXIT}" in err
    assert _rank_processes() == []  # no rank left behind
    assert list_namespaces(f"mp{os.getpid()}") == []  # the run's private cluster is gone


def test_launcher_names_the_rank_that_raised():
    with pytest.raises(RankFailed) as ei:
        launch("moeplace.run.launch:free_port", 2, {"bogus": 1}, timeout=60)  # TypeError in every rank
    assert ei.value.rank in (0, 1) and f"rank {ei.value.rank}" in str(ei.value)
    assert "TypeError" in str(ei.value)
    assert _rank_processes() == []


def test_launcher_rejects_unknown_targets():
    with pytest.raises((ValueError, AttributeError, ModuleNotFoundError)):
        launch("moeplace.run.launch:no_such_function", 2)


# ------------------------------------------------------------------------------------------------ bad plans


@pytest.fixture
def no_spawn(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a process was started for a run that should have been rejected")

    monkeypatch.setattr(launch_mod, "launch", boom)


def test_bad_plans_are_rejected_before_any_process(tiny, no_spawn, capsys):
    trace, plan_path, tmp = tiny
    base = ["run-ep", str(trace), "--cluster", "2x2", "--batch-tokens", "4"]
    # cluster of the plan differs from --cluster
    assert main(base[:3] + ["1x4", "--plan", str(plan_path)]) == 2
    assert "does not match the plan's cluster" in capsys.readouterr().err
    # plan for another model shape
    Plan(Placement.linear(3, 8, 4), Cluster(2, 2)).save(tmp / "l3.json")
    assert main(base + ["--plan", str(tmp / "l3.json")]) == 2
    assert "does not fit trace" in capsys.readouterr().err
    # an expert without a slot
    d = json.loads(plan_path.read_text())
    d["phy2log"][1][3] = 0
    (tmp / "hole.json").write_text(json.dumps(d))
    assert main(base + ["--plan", str(tmp / "hole.json")]) == 2
    assert "expert 3 has no slot in layer 1" in capsys.readouterr().err
    # not JSON, and missing
    (tmp / "junk.json").write_text("{not json")
    assert main(base + ["--plan", str(tmp / "junk.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main(base + ["--plan", str(tmp / "absent.json")]) == 2
    assert "No such file" in capsys.readouterr().err
    # a window the trace does not have
    assert main(base + ["--plan", str(plan_path), "--skip", "99"]) == 2
    assert "micro-batches" in capsys.readouterr().err
