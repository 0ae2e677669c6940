"""--engine ray against a real local Ray cluster (2 worker processes, one cluster for the module): byte-identical to
the single-process path, a worker killed mid-run is retried with the same answer, and a cluster that is not there
is one line and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from fault.harness import SRC, assert_clean_failure, run_cli

from moeplace.analyse.summary import analyse_trace
from moeplace.data import DATA_DIR
from moeplace.engine import KILL_ONCE_ENV

ray = pytest.importorskip("ray")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module

FG = DATA_DIR / "reference-fg.trace"
BENCH = SRC.parent / "bench"


def _pid(x: int) -> tuple[int, int]:
    time.sleep(0.3)
    return os.getpid(), x


@pytest.fixture(scope="module")
def engine():
    from moeplace.engine import RayEngine

    eng = RayEngine(num_cpus=2)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def fg_local():
    return json.dumps(analyse_trace(FG, window_tokens=4096), sort_keys=True)


def test_cluster_has_two_worker_processes(engine):
    out = list(engine.map(_pid, range(6)))
    assert [x for _, x in out] == list(range(6))  # in item order
    assert len({p for p, _ in out}) >= 2 and os.getpid() not in {p for p, _ in out}


def _arrays(x, path="result"):
    """(path, ndarray) of every numpy array reachable in ``x`` (containers, dataclasses, plain objects)."""
    if isinstance(x, np.ndarray):
        yield path, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _arrays(v, f"{path}[{k!r}]")
    elif isinstance(x, list | tuple):
        for i, v in enumerate(x):
            yield from _arrays(v, f"{path}[{i}]")
    elif hasattr(x, "__dict__"):
        for k, v in vars(x).items():
            yield from _arrays(v, f"{path}.{k}")


def _store_like(i: int) -> dict:
    return {"big": np.full(1 << 20, i, np.int64), "small": [np.arange(58.0) + i]}


def test_results_own_their_arrays(engine):
    """The driver keeps pieces of results (drift values, micro-batch metrics): each must be its own memory, not a
    read-only view that pins the task's whole result in the object store (the Ray analyze driver grew with the
    trace, docs/SCALE.md). ray.get alone returns such views: checked first, so the test can tell."""
    raw = ray.get(ray.remote(_store_like).remote(3))
    assert not raw["small"][0].flags.writeable  # what Ray hands back: a view of the stored object
    out = list(engine.map(_store_like, range(3)))
    assert [int(o["big"][0]) for o in out] == [0, 1, 2]
    from moeplace.analyse.shards import ShardTask, analyse_shard
    from moeplace.analyse.summary import token_labels
    from moeplace.trace import read_meta, read_requests

    meta = read_meta(FG)
    params = {"window_tokens": 256, "chunk_tokens": 4096, "max_request_bytes": 1 << 20, "seed": 0}
    labels = token_labels(meta, read_requests(FG), params)
    parts = list(engine.map(analyse_shard, [ShardTask(str(FG), (i,), 0) for i in range(2)], meta, labels, params))
    found = [*_arrays(out), *_arrays(parts)]
    assert any(".acc.drift_js" in p for p, _ in found) and any(".edges.tail_ids" in p for p, _ in found)
    views = [p for p, a in found if not (a.flags.writeable and a.flags.owndata)]
    assert not views, f"results hold views of the object store: {views[:5]}"


def test_analyze_on_ray_is_byte_identical(engine, fg_local):
    assert json.dumps(analyse_trace(FG, window_tokens=4096, engine=engine), sort_keys=True) == fg_local


def test_killed_worker_is_retried_with_the_same_answer(engine, fg_local, tmp_path, monkeypatch):
    marker = tmp_path / "killed"
    monkeypatch.setenv(KILL_ONCE_ENV, str(marker))
    got = json.dumps(analyse_trace(FG, window_tokens=4096, engine=engine), sort_keys=True)
    assert marker.exists()  # a worker did SIGKILL itself mid-run
    assert got == fg_local


def _pieces(item: tuple[int, str | None]):
    n, marker = item
    for j in range(n):
        yield n, j, np.full(1 << 16, j, np.int32)
        if marker and j == 1 and not os.path.exists(marker):  # die after handing over two pieces
            open(marker, "w").close()
            os.kill(os.getpid(), 9)


def test_pieces_stream_in_order_and_a_killed_worker_replays(engine, tmp_path, monkeypatch):
    # streaming-generator tasks: every piece once, in item order and in yield order, the same after a worker that
    # SIGKILLs itself is retried (Ray replays the generator and skips the pieces already handed over)
    from moeplace.engine import LocalEngine

    sizes = [3, 0, 5, 1]
    want = [(i, (n, j)) for i, n in enumerate(sizes) for j in range(n)]
    items = [(n, None) for n in sizes]
    assert [(i, p[:2]) for i, p in LocalEngine().map_pieces(_pieces, items)] == want
    assert [(i, p[:2]) for i, p in engine.map_pieces(_pieces, items)] == want
    mid = tmp_path / "mid"
    for marker, its in ((tmp_path / "start", items), (mid, [(n, str(mid) if n == 5 else None) for n in sizes])):
        if marker.name == "start":  # killed before its first piece (the engine's hook)
            monkeypatch.setenv(KILL_ONCE_ENV, str(marker))
        got = list(engine.map_pieces(_pieces, its))
        monkeypatch.delenv(KILL_ONCE_ENV, raising=False)
        assert marker.exists()
        assert [(i, p[:2]) for i, p in got] == want
        assert all(int(p[2][0]) == p[1] and p[2].flags.owndata for _, p in got)  # copies out of the store


def test_compare_on_ray_is_the_sequential_answer(engine):
    from test_compare_engine import compare_both

    a, b = compare_both(engine)
    assert a == b


def _nice(_: int) -> int:
    return os.nice(0)


def test_local_cluster_workers_run_at_the_commands_priority(engine):
    """Ray starts workers at nice 15 by default; a local cluster's workers do the command's work, so they run at
    the driver's niceness (beside busy processes nice-15 workers got ~1/20 of the CPU)."""
    assert set(engine.map(_nice, range(4))) == {os.nice(0)}


def test_simulate_on_ray_is_byte_identical(engine):
    from moeplace.placement import Cluster
    from moeplace.simulate import BatchConfig, simulate

    kw = {"cluster": Cluster(2, 4), "batching": BatchConfig(decode_batch=64, prefill_tokens=4096), "rule": "balanced"}
    a = simulate(FG, **kw).to_json()
    b = simulate(FG, engine=engine, **kw).to_json()
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_simulate_survives_a_killed_worker(engine, tmp_path, monkeypatch):
    # simulate's tasks stream their finished micro-batches (Engine.map_pieces); a task whose worker dies runs again
    from moeplace.placement import Cluster
    from moeplace.simulate import BatchConfig, simulate

    kw = {"cluster": Cluster(2, 4), "batching": BatchConfig(decode_batch=16, prefill_tokens=1024)}
    ref = json.dumps(simulate(FG, **kw).to_json(), sort_keys=True)
    marker = tmp_path / "killed"
    monkeypatch.setenv(KILL_ONCE_ENV, str(marker))
    got = json.dumps(simulate(FG, engine=engine, **kw).to_json(), sort_keys=True)
    assert marker.exists()
    assert got == ref



def _cli(args: list, cwd) -> subprocess.CompletedProcess:
    """``python -m moeplace ARGS`` without the fault harness's address-space cap (a Ray driver maps the object
    store's shared memory)."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "moeplace", *map(str, args)], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=300)


def test_cli_joins_an_existing_cluster(engine, tmp_path):
    address = ray.get_runtime_context().gcs_address
    a, b = tmp_path / "local.json", tmp_path / "ray.json"
    local = _cli(["analyze", FG, "--json", a, "--no-progress"], tmp_path)
    assert local.returncode == 0, local.stderr
    on_ray = _cli(["analyze", FG, "--json", b, "--no-progress", "--engine", "ray", "--address", address], tmp_path)
    assert on_ray.returncode == 0, on_ray.stderr[-3000:]
    assert a.read_bytes() == b.read_bytes()


MEASURED = {"seconds", "plan_seconds", "wall_seconds"}  # measured time: the one thing an engine may change
RUN_CONTEXT = {"command", "git_commit", "dirty", "date", "loadavg_before", "loadavg_after", "cpu_count", "machine",
               "versions"}


def _numbers(x, top: bool = True):
    """A bench result without its run context, its engine flags and its measured seconds."""
    if isinstance(x, dict):
        return {k: _numbers(v, False) for k, v in x.items()
                if k not in MEASURED and k not in ("engine", "address") and not (top and k in RUN_CONTEXT)}
    if isinstance(x, list):
        return [_numbers(v, False) for v in x]
    return x


@pytest.mark.parametrize("bench", ["plan_time", "plan_compare"])
def test_bench_sweep_on_ray_gives_the_local_numbers(engine, tmp_path, bench):
    """bench/plan_time.py and bench/plan_compare.py --engine ray --address: their strategies x split seeds as Ray
    tasks, the same JSON but for measured seconds (a tiny configuration of each: plan_time 1 seed x 2 strategies
    on reference-fg, plan_compare 2 seeds x 2 strategies on the small bundled trace)."""
    address = ray.get_runtime_context().gcs_address
    if bench == "plan_time":
        args = ["--workloads", "reference-fg", "--phases", "decode", "--seeds", "1", "--profiles",
                "sglang-h200-ep16", "--strategies", "eplb,joint"]
        out = {e: (["--json", tmp_path / f"{e}.json"], tmp_path / f"{e}.json") for e in ("local", "ray")}
    else:
        args = ["--trace", DATA_DIR / "reference-default.trace", "--clusters", "2x4", "--seeds", "2",
                "--strategies", "eplb,activation-clusters"]
        out = {e: (["--out", tmp_path / e], tmp_path / f"{e}_2x4.json") for e in ("local", "ray")}
    got = {}
    for eng, extra in (("local", []), ("ray", ["--engine", "ray", "--address", address])):
        env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, str(BENCH / f"{bench}.py"), *map(str, args), *map(str, out[eng][0]),
                               *extra], cwd=tmp_path, env=env, text=True, capture_output=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[eng] = json.loads(out[eng][1].read_text())
    assert got["ray"]["params"]["engine"] == "ray" and got["local"]["params"]["engine"] == "local"
    assert got["local"]["results"] and _numbers(got["ray"]) == _numbers(got["local"])


def test_cli_unreachable_address_is_one_line(tmp_path):
    for cmd in (["analyze", FG], ["simulate", FG, "--cluster", "2x2"],
                ["compare", FG, "--cluster", "2x4", "--redundant", "8"]):
        proc = run_cli([*cmd, "--engine", "ray", "--address", "127.0.0.1:1"], tmp_path, timeout=120)
        assert_clean_failure(proc, ["--address 127.0.0.1:1", "no Ray cluster reachable"])
