"""The README's quick tour runs as written, line by line and in order, from the repository root: every output goes
under ``out/tour/`` (here a temporary folder put in its place), each line uses only what the lines above it wrote,
and the lines marked ``# needs root``, ``# needs ../shared`` or ``# slow`` are skipped (slow ones run with
MOEPLACE_TOUR_SLOW=1), none of them writing what a later line needs."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOUR = "out/tour"
MARKS = {"# needs root": "needs root (it changes the host's network namespaces)",
         "# needs ../shared": "needs the project's ../shared data, which a fresh clone does not have",
         "# slow": "slow (set MOEPLACE_TOUR_SLOW=1 to run it)"}
ARTIFACT = re.compile(r"[\w./<>-]+\.(?:json|jsonl|html|png|trace|pt)\b")


def tour_lines() -> list[str]:
    """The lines of the bash block under README.md's "## Quick tour" heading."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick tour\n"):]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert block, "README.md: no ```bash block under ## Quick tour"
    return [ln for ln in block.group(1).splitlines() if ln.strip()]


def skip_reason(line: str) -> str | None:
    if line.strip() == ". .venv/bin/activate":
        return "the test runs with this interpreter's bin/ first on PATH"
    for mark, why in MARKS.items():
        if mark in line and not (mark == "# slow" and os.environ.get("MOEPLACE_TOUR_SLOW")):
            return why
    return None


def test_tour_writes_only_under_out_tour():
    """Every file a line names is under out/tour/, in the package's bundled data, or (marked) in ../shared."""
    for line in tour_lines():
        cmd = line.split("  #")[0]
        for path in ARTIFACT.findall(cmd):
            ok = path.startswith((f"{TOUR}/", "src/moeplace/data/")) or (
                path.startswith("../shared/") and "# needs ../shared" in line)
            assert ok, f"README quick tour: {path!r} is outside {TOUR}/ in: {line}"
        if "../shared/" in cmd:
            assert "# needs ../shared" in line, f"README quick tour: a ../shared line must say so: {line}"


def test_skipped_lines_feed_no_later_line():
    """What a skipped line writes (its out/tour paths) is not read by a later line that runs, unless a line that
    runs wrote it first."""
    written: set[str] = set()
    skipped: set[str] = set()
    for line in tour_lines():
        paths = set(re.findall(rf"{TOUR}/[\w.-]+", line.split("  #")[0]))
        if skip_reason(line) is not None:
            skipped |= paths - written
            continue
        needs = (paths & skipped) - written
        assert not needs, f"README quick tour: {line!r} uses {sorted(needs)}, written only by a skipped line"
        written |= paths


@pytest.mark.slow
def test_quick_tour_runs_in_order(tmp_path):
    out = tmp_path / "tour"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    ran, skipped, seconds = [], [], []
    for line in tour_lines():
        why = skip_reason(line)
        if why is not None:
            skipped.append((line, why))
            continue
        cmd = line.replace(TOUR, str(out))
        t0 = time.perf_counter()
        p = subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, f"README quick tour line failed ({p.returncode}): {line}\n{p.stderr[-3000:]}"
        ran.append(line)
        seconds.append(time.perf_counter() - t0)
    # each line's outputs exist (the last path a line names after an output flag or as its last word)
    for line in ran:
        words = shlex.split(line.split("  #")[0].replace(TOUR, str(out)))
        outs = [w for i, w in enumerate(words) if i and words[i - 1] in ("--out", "--json", "--html", "--plot")]
        if words[:3] in (["moeplace", "trace", "record"], ["moeplace", "trace", "import"]) or words[:2] == [
                "moeplace", "synth"]:
            outs.append(words[-1])
        for o in outs:
            assert Path(o).exists(), f"README quick tour: {line!r} did not write {o}"
    assert (out / "ref.trace" / "meta.json").exists() and len(ran) >= 10
    print("\n".join(f"{s:6.1f} s  {ln}" for s, ln in zip(seconds, ran, strict=True)))
    print(f"ran {len(ran)} lines; skipped {len(skipped)}: " + "; ".join(f"{ln.split()[1]}... ({w})"
                                                                       for ln, w in skipped))
