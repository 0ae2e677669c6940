"""Atomic writes: readers see the old file or the whole new one, never a half-written one."""

import json
import os
import subprocess
import sys

import pytest

from moeplace.io import OutputError, atomic_write_json, atomic_write_text, make_temp_dir, temp_prefix


def test_write_creates_folder_and_leaves_no_temp_file(tmp_path):
    dest = tmp_path / "sub" / "out.json"
    atomic_write_json({"a": [1, 2]}, dest)
    assert json.loads(dest.read_text()) == {"a": [1, 2]}
    assert [p.name for p in dest.parent.iterdir()] == ["out.json"]


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    dest = tmp_path / "out.json"
    atomic_write_text("old\n", dest)
    with pytest.raises(ValueError):
        atomic_write_json({"x": float("nan")}, dest, allow_nan=False)  # fails before anything is written
    assert dest.read_text() == "old\n"

    def crash(fd):  # the data is written but the process dies before the rename
        raise KeyboardInterrupt

    monkeypatch.setattr("moeplace.io.os.fsync", crash)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text("new\n", dest)
    assert dest.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_modes_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        f = atomic_write_text("x\n", tmp_path / "a.txt")
        d = make_temp_dir(tmp_path / "t", "new")
    finally:
        os.umask(old)
    assert f.stat().st_mode & 0o777 == 0o640
    assert d.stat().st_mode & 0o777 == 0o750


def test_long_names_and_bad_destinations(tmp_path):
    name = "r" * 250 + ".json"  # legal (255 bytes), but name + a temp suffix is not
    atomic_write_json({"a": 1}, tmp_path / name)
    assert json.loads((tmp_path / name).read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == [name]
    (tmp_path / "adir").mkdir()
    with pytest.raises(OutputError, match="adir: is a directory"):
        atomic_write_text("x", tmp_path / "adir")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputError, match="afile is not a directory"):
        atomic_write_text("x", tmp_path / "afile" / "out.json")


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path):
    dest = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(proc.stdout)  # a pid that has exited
    stale = tmp_path / f"{temp_prefix(dest.name, 'tmp')}{dead}-abc"
    stale.write_text("half")
    live = tmp_path / f"{temp_prefix(dest.name, 'tmp')}{os.getppid()}-abc"  # a running process: kept
    live.write_text("busy")
    atomic_write_text("whole\n", dest)
    assert not stale.exists() and live.exists() and dest.read_text() == "whole\n"
