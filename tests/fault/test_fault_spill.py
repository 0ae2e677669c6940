"""simulate's spill files (moeplace.simulate.mbstore) as a real process: a folder it cannot make is one line and exit
2; a kill -9 while it spills leaves no output and a folder that the next replay removes, and that replay writes
the same JSON as one that never spilled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from harness import SRC, assert_clean_failure, run_cli

from moeplace.data import DATA_DIR

FG = DATA_DIR / "reference-fg.trace"
SMALL = ["--cluster", "2x4", "--decode-batch", "4", "--prefill-tokens", "64"]  # ~33,000 decode micro-batches


def test_a_spill_folder_it_cannot_make_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEPLACE_SPILL_DIR", str(tmp_path / "missing"))
    monkeypatch.setenv("MOEPLACE_MEMORY_BUDGET", "64M")  # a 4 MB buffer: this replay spills
    p = run_cli(["simulate", FG, *SMALL], tmp_path, timeout=300)
    assert_clean_failure(p, [str(tmp_path / "missing"), "MOEPLACE_SPILL_DIR"])


def test_kill_while_spilling_then_rerun(tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir()
    env = {**os.environ, "PYTHONPATH": str(SRC), "MOEPLACE_SPILL_DIR": str(spill), "MOEPLACE_MEMORY_BUDGET": "64M"}
    out = tmp_path / "sim.json"
    proc = subprocess.Popen([sys.executable, "-m", "moeplace", "simulate", str(FG), *SMALL, "--json", str(out)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while not list(spill.rglob("*.bin")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the replay ended before it spilled"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    left = list(spill.iterdir())
    assert len(left) == 1 and list(left[0].glob("*.bin"))  # the killed replay's folder stays behind
    assert not out.exists()  # and no half-written output

    again = subprocess.run([sys.executable, "-m", "moeplace", "simulate", str(FG), *SMALL, "--json", str(out)],
                           env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert not list(spill.iterdir())  # the stale folder went with the next replay, its own at its exit
    env_mem = {**env, "MOEPLACE_MEMORY_BUDGET": "24M"}  # a 3 MB buffer: other block boundaries, the same answer
    ref = tmp_path / "ref.json"
    p = subprocess.run([sys.executable, "-m", "moeplace", "simulate", str(FG), *SMALL, "--json", str(ref)],
                       env=env_mem, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    a, b = json.loads(out.read_text()), json.loads(ref.read_text())
    assert a == b
