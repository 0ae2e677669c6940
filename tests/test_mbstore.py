"""moeplace.simulate.mbstore: per-micro-batch metrics kept in memory or spilled to files read back equal to the
plain arrays, in micro-batch id order, and reduced to the statistics numpy gives on the whole [B, L] array."""

from __future__ import annotations

import gc
import pickle

import numpy as np
import pytest

import moeplace.simulate.mbstore as mbs
from moeplace.simulate.mbstore import MicrobatchMetrics, reduce_layers


def _pieces(rng, B: int, L: int, n: int):
    """n pieces of shuffled micro-batch ids 0..B-1 with float and int metrics; and the whole arrays by id."""
    ids = rng.permutation(B)
    f = rng.random((B, L))
    i = rng.integers(0, 1000, (B, L))
    cuts = np.sort(rng.choice(np.arange(1, B), n - 1, replace=False))
    bounds = zip(np.r_[0, cuts], np.r_[cuts, B], strict=True)
    out = [(ids[a:b], {"t": f[ids[a:b]], "n": i[ids[a:b]]}) for a, b in bounds]
    return out, f, i


@pytest.mark.parametrize("spill", [None, 1, 20_000])
def test_reads_and_statistics_equal_numpy(spill, tmp_path, monkeypatch):
    monkeypatch.setenv("MOEPLACE_SPILL_DIR", str(tmp_path))
    monkeypatch.setattr(mbs, "COLUMN_ELEMENTS", 3 * 500)  # 3 layers per block: several blocks, a ragged last one
    rng = np.random.default_rng(0)
    B, L = 500, 7
    pieces, f, i = _pieces(rng, B, L, 12)
    m = MicrobatchMetrics(L, spill)
    for ids, d in pieces:
        m.append(ids, d)
    m.freeze()
    assert m.spilled == (spill is not None)
    assert m.layer_blocks() == [(0, 3), (3, 6), (6, 7)]
    assert (m.ids == np.arange(B)).all()
    assert (m["t"] == f).all() and (m["n"] == i).all() and m["n"].dtype == i.dtype
    per_layer, med, row = reduce_layers(m, ("t", "n"), lambda a, b: a * b)
    x = f * i
    np.testing.assert_allclose(per_layer, x.sum(0), rtol=1e-13)
    np.testing.assert_allclose(row, x.sum(1), rtol=1e-13)
    assert (med == np.median(x, 0)).all()
    per_layer, med, row = reduce_layers(m, ("n",), how="max")
    assert (per_layer == i.max(0)).all() and (row == i.max(1)).all()


def test_same_bits_spilled_or_not(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEPLACE_SPILL_DIR", str(tmp_path))
    rng = np.random.default_rng(1)
    pieces, _, _ = _pieces(rng, 300, 5, 9)
    out = []
    for spill in (None, 1, 5_000):
        m = MicrobatchMetrics(5, spill)
        for ids, d in pieces:
            m.append(ids, d)
        out.append([a.tobytes() for a in reduce_layers(m, ("t",))])
    assert out[0] == out[1] == out[2]


def test_concat_pickle_and_cleanup(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEPLACE_SPILL_DIR", str(tmp_path))
    rng = np.random.default_rng(2)
    pa, fa, _ = _pieces(rng, 40, 3, 4)
    pb, fb, _ = _pieces(rng, 30, 3, 3)
    a, b = MicrobatchMetrics(3, 1), MicrobatchMetrics(3, None)
    for ids, d in pa:
        a.append(ids, d)
    for ids, d in pb:
        b.append(ids, d)
    c = MicrobatchMetrics.concat(a, b)
    assert (c.ids == np.r_[np.arange(40), np.arange(30)]).all()
    assert (c["t"] == np.concatenate([fa, fb])).all()
    back = pickle.loads(pickle.dumps(c))  # the values travel, not the paths
    assert not back.spilled and (back["t"] == c["t"]).all() and (back.ids == c.ids).all()
    del a  # the concatenation keeps a's files alive
    gc.collect()
    assert (c["t"][:40] == fa).all()
    del c
    gc.collect()
    assert not list(tmp_path.iterdir())


def test_a_missing_spill_file_is_one_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEPLACE_SPILL_DIR", str(tmp_path))
    m = MicrobatchMetrics(2, 1)
    m.append(np.arange(3), {"t": np.ones((3, 2))})
    m.freeze()
    for p in tmp_path.rglob("*.bin"):
        p.write_bytes(b"")
    with pytest.raises(ValueError, match="shorter than written"):
        m["t"]


def test_unwritable_spill_dir_names_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEPLACE_SPILL_DIR", str(tmp_path / "missing"))
    m = MicrobatchMetrics(2, 1)
    with pytest.raises(ValueError, match="MOEPLACE_SPILL_DIR"):
        m.append(np.arange(3), {"t": np.ones((3, 2))})


def test_a_killed_replays_spill_folder_is_removed_by_the_next(tmp_path, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setenv("MOEPLACE_SPILL_DIR", str(tmp_path))
    code = ("import os, numpy as np; from moeplace.simulate.mbstore import MicrobatchMetrics as M; "
            "m = M(2, 1); m.append(np.arange(3), {'t': np.ones((3, 2))}); os._exit(0)")  # no clean-up runs
    subprocess.run([sys.executable, "-c", code], check=True)
    left = list(tmp_path.iterdir())
    assert len(left) == 1 and left[0].name.startswith("moeplace-spill-")
    m = MicrobatchMetrics(2, 1)
    m.append(np.arange(3), {"t": np.ones((3, 2))})
    assert [p for p in tmp_path.iterdir()] != left and len(list(tmp_path.iterdir())) == 1


def test_one_pass_equals_each_reduction_alone(tmp_path, monkeypatch):
    from moeplace.simulate.mbstore import reduce_many

    monkeypatch.setenv("MOEPLACE_SPILL_DIR", str(tmp_path))
    monkeypatch.setattr(mbs, "COLUMN_ELEMENTS", 2 * 200)
    pieces, _, _ = _pieces(np.random.default_rng(3), 200, 5, 6)
    m = MicrobatchMetrics(5, 4_000)
    for ids, d in pieces:
        m.append(ids, d)
    specs = [(("t",), None, "sum"), (("t", "n"), np.add, "max"), (("n",), lambda x: x * 3.0, "sum"),
             (("t",), None, "max")]
    together = reduce_many(m, specs)
    for spec, got in zip(specs, together, strict=True):
        alone = reduce_layers(m, *spec)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(alone, got, strict=True))


def test_mmap_threshold_is_fixed_on_glibc():
    import platform

    from moeplace.budget import fix_mmap_threshold

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt's M_MMAP_THRESHOLD is glibc's")
    assert fix_mmap_threshold() is True


@pytest.mark.parametrize("preset", [None, "mimalloc"])
def test_arrow_buffers_come_from_the_system_pool_unless_the_user_chose(preset):
    import os
    import subprocess
    import sys

    import pyarrow as pa

    if preset == "mimalloc":
        try:
            pa.mimalloc_memory_pool()
        except (NotImplementedError, pa.ArrowNotImplementedError):
            pytest.skip("this pyarrow has no mimalloc")
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if preset:
        env["ARROW_DEFAULT_MEMORY_POOL"] = preset
    code = ("import sys; import pyarrow as pa\n"  # pyarrow first: its Python-level default pool is switched
            "from moeplace.budget import use_system_arrow_pool\n"
            "print(use_system_arrow_pool(), pa.default_memory_pool().backend_name)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    want = preset or "system"
    assert out.stdout.split() == [want, want]
    # imported after the call, pyarrow reads the variable the call set (what a Ray worker started from here sees)
    code2 = ("from moeplace.budget import use_system_arrow_pool\nuse_system_arrow_pool()\nimport pyarrow as pa\n"
             "print(pa.default_memory_pool().backend_name)")
    out = subprocess.run([sys.executable, "-c", code2], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [want]


def test_the_cli_chooses_the_system_pool_before_pyarrow_loads(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    code = ("import os, sys\nfrom moeplace.cli import main\n"
            f"rc = main(['analyze', {str(tmp_path / 'absent.trace')!r}, '--json', {str(tmp_path / 'a.json')!r}])\n"
            "import pyarrow as pa\n"
            "print(rc, os.environ.get('ARROW_DEFAULT_MEMORY_POOL'), pa.default_memory_pool().backend_name)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-3:] == ["2", "system", "system"]  # chosen before the command read its input
