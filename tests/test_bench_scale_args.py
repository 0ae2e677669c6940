"""The scale and plan-speed benchmarks answer a wrong flag with exit 2 and one line naming it (argparse), never a
traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("bench", ["scale.py", "scale_memory.py"])
@pytest.mark.parametrize(("args", "says"), [(["--sizes", "1,x"], "--sizes"), (["--sizes", "0"], "--sizes"),
                                            (["--base-requests", "-3"], "--base-requests"),
                                            (["--work", str(REPO / "README.md")], "not a folder")])
def test_wrong_flag_is_exit_2_naming_it(bench, args, says):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    p = subprocess.run([sys.executable, str(REPO / "bench" / bench), *args], cwd=REPO / "bench", env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert says in p.stderr and "Traceback" not in p.stderr


def test_reps_must_be_positive():
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    p = subprocess.run([sys.executable, str(REPO / "bench" / "scale_memory.py"), "--reps", "0"], cwd=REPO / "bench",
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--reps" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize(("args", "says"), [(["--previous", "no-such-revision"], "--previous"),
                                            (["--trace", str(REPO / "README.md")], "--trace"),
                                            (["--reps", "0"], "--reps"),
                                            (["--json", str(REPO / "src" / "moeplace" / "data" / "reference-fg.trace"
                                                            / "meta.json")], "--json")])
def test_plan_speed_wrong_flag_is_exit_2(args, says):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    p = subprocess.run([sys.executable, str(REPO / "bench" / "plan_speed.py"), *args], cwd=REPO / "bench", env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert says in p.stderr and "Traceback" not in p.stderr
