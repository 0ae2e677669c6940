"""Shared fixtures: small hand-made traces and the location of ../shared/data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from moeplace.trace import TraceMeta, TraceWriter

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def load_script(name: str):
    """The module ``scripts/<name>.py`` (scripts are not a package), imported from its file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def shared_data(*parts: str) -> Path:
    """Path under ../shared/data; skips the calling test cleanly when it is absent."""
    p = SHARED_DATA.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"shared data not available: {p}")
    return p


def make_tokens(rng: np.random.Generator, n_req: int, L: int, E: int, K: int, prompt: int = 5, gen: int = 4):
    """Random per-token routing for n_req requests: returns dict of arrays (request_id, position, phase, ids, w)."""
    rid, pos, ph = [], [], []
    for r in range(n_req):
        n = prompt + gen
        rid += [r] * n
        pos += list(range(n))
        ph += [0] * prompt + [1] * gen
    T = len(rid)
    ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(T)]) if T else \
        np.zeros((0, L, K), np.int16)
    w = rng.random((T, L, K)).astype(np.float16)
    return dict(request_id=np.array(rid), position=np.array(pos), phase=np.array(ph, np.int8),
                expert_ids=ids.astype(np.int16), expert_weights=w)


@pytest.fixture
def small_trace(tmp_path):
    """A 6-request, L=3, E=8, K=2 per-token trace with weights; returns (path, arrays, meta)."""
    rng = np.random.default_rng(0)
    meta = TraceMeta(model="hand-made", num_layers=3, num_experts=8, top_k=2, hidden_size=16, has_weights=True,
                     synthetic=True, source="tests")
    arr = make_tokens(rng, 6, 3, 8, 2)
    path = tmp_path / "small.trace"
    with TraceWriter(path, meta, shard_tokens=20) as w:
        w.add_requests(np.arange(6), domain=["code", "math", "chat", "general", "code", "math"],
                       prompt_len=[5] * 6, gen_len=[4] * 6)
        w.add_tokens(arr["request_id"], arr["position"], arr["phase"], arr["expert_ids"], arr["expert_weights"])
    return path, arr, meta


# ------------------------------------------------------------------------------------------- file order
# scripts/test.sh runs whole files on 2 xdist workers (--dist loadfile --no-loadscope-reorder): they take files in
# collection order, so the longest go first (longest-processing-time-first) and no long file is left to run alone
# at the end. tests/file_seconds.json holds each file's seconds from a full run (MOEPLACE_RECORD_FILE_SECONDS=PATH
# writes a new one); a file it does not list counts as the median.
FILE_SECONDS = Path(__file__).with_name("file_seconds.json")


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    try:
        seconds = {k: float(v) for k, v in json.loads(FILE_SECONDS.read_text())["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return  # no timings: collection order
    median = float(np.median(list(seconds.values()))) if seconds else 0.0
    # a stable sort: a file's tests stay together and in order, files of equal seconds in collection order
    items.sort(key=lambda it: -seconds.get(_file_of(it.nodeid), median))


_seconds_by_file: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if os.environ.get("MOEPLACE_RECORD_FILE_SECONDS"):
        f = _file_of(report.nodeid)
        _seconds_by_file[f] = _seconds_by_file.get(f, 0.0) + float(report.duration)


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("MOEPLACE_RECORD_FILE_SECONDS")
    if out and _seconds_by_file and not hasattr(session.config, "workerinput"):  # the controller (or no xdist)
        from moeplace.io import atomic_write_json

        atomic_write_json({"what": "seconds per test file (setup + call + teardown) of one full suite run",
                           "seconds": {k: round(v, 2) for k, v in sorted(_seconds_by_file.items())}}, out)
