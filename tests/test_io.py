"""Atomic writes: readers see the old file or the whole new one, never a half-written one."""

import json

import pytest

from moeplace.io import atomic_write_json, atomic_write_text


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
