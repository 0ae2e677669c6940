"""Shared fixtures: small hand-made traces and the location of ../shared/data."""

from __future__ import annotations

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
