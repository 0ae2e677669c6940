"""Fault injection for the scripts that make the fine-grained model's card: a missing or wrong input is one line
on stderr naming it, exit 2, no traceback, and nothing written (real processes, as a user runs them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_script(args: list[str]) -> tuple[int, list[str]]:
    p = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    return p.returncode, [line for line in p.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize("make, mentions", [
    (lambda d: ["scripts/reference_structure.py", str(d / "nope.trace")], ["nope.trace"]),
    (lambda d: ["scripts/reference_structure.py", str(d / "empty")], ["empty"]),
    (lambda d: ["scripts/heldout_ce_subdomains.py", str(d / "nope"), "--json", str(d / "out.json")], ["nope"]),
    (lambda d: ["scripts/heldout_ce_subdomains.py", str(d / "empty"), "--config", "bogus"], ["bogus"]),
    (lambda d: ["scripts/fg_model_card.py", str(d / "empty")], ["empty", "train_metrics.json"]),
])
def test_scripts_answer_bad_input_in_one_line(make, mentions, tmp_path):
    (tmp_path / "empty").mkdir()
    rc, err = run_script(make(tmp_path))
    assert rc == 2 and len(err) == 1 and "Traceback" not in err[0], (rc, err)
    for m in mentions:
        assert m in err[0], (m, err)
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "empty" / "MODEL_CARD.md").exists()
