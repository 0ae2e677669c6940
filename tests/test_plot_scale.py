"""scripts/plot_scale.py: the scale curve is drawn from a result file only (a real PNG from a real file), and a file
that is not a scale result is one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "plot_scale.py"


def _cell(wall: float, rss: float) -> dict:
    return {"wall_seconds": wall, "tree_peak_rss_bytes": rss}


def test_plots_the_measured_cells(tmp_path):
    res = {"git_commit": "0" * 40, "cpu_count": 2, "complete": False, "results": {"sizes": [
        {"trace_gb": 0.2, "runs": {"analyze": {"local": _cell(25, 1.5e9), "ray": _cell(31, 3.7e9)}}},
        {"trace_gb": 2.0, "runs": {"analyze": {"local": _cell(150, 1.6e9)}}},  # a stopped run: Ray cell missing
    ]}}
    src, out = tmp_path / "scale.json", tmp_path / "scale.png"
    src.write_text(json.dumps(res))
    r = subprocess.run([sys.executable, SCRIPT, "--json", src, "--out", out], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*.tmp"))


def test_not_a_scale_result_is_one_line(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"results": {"cells": []}}))
    r = subprocess.run([sys.executable, SCRIPT, "--json", bad, "--out", tmp_path / "o.png"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and str(bad) in r.stderr
    assert not (tmp_path / "o.png").exists()


def test_out_on_its_own_input_is_refused(tmp_path):
    src = tmp_path / "scale.json"
    src.write_text("{}")
    r = subprocess.run([sys.executable, SCRIPT, "--json", src, "--out", src], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "is the input --json" in r.stderr
    assert src.read_text() == "{}"
