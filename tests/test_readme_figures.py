"""README and docs figures come from bench/results: every marked figure must render from its result file and say
exactly what the result says (scripts/readme_figures.py; run it without --check to regenerate them)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "readme_figures.py"


def _load():
    spec = importlib.util.spec_from_file_location("readme_figures", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up by name
    spec.loader.exec_module(mod)
    return mod


rf = _load()


def test_repository_figures_match_results():
    out = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_benchmark_figure_is_marked():
    """The benchmark tables carry markers (a hand-typed number there would not be checked)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    assert len(rf.FIG.findall(section)) >= 6


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    results = tmp_path / "results"
    results.mkdir()
    (results / "speed.json").write_text(json.dumps({"results": {"a-b": {"rate": 16_345_678.9, "ratio": 412.6}},
                                                    "runs": [{"x": 0.12345}], "flag": True}))
    return tmp_path / "doc.md", results


def test_render_formats_and_scales(tree):
    _, results = tree
    assert rf.render("speed:results/a-b/rate:.1f:1e-6", results) == "16.3"
    assert rf.render("speed:results/a-b/ratio:,.0f", results) == "413"
    assert rf.render("speed:runs/0/x:.1%", results) == "12.3%"


@pytest.mark.parametrize("spec, msg", [
    ("missing:results/a-b/rate:.1f", "does not exist"),
    ("speed:results/a-c/rate:.1f", "no key 'a-c'"),
    ("speed:runs/3/x:.1f", "no key '3'"),
    ("speed:flag:.1f", "not a number"),
    ("speed:results/a-b:.1f", "not a number"),
    ("speed:results", "expected NAME:PATH:FORMAT"),
])
def test_bad_figure_is_reported(tree, spec, msg):
    doc, results = tree
    doc.write_text(f"rate <!-- fig {spec} -->1<!-- /fig --> M/s\n")
    problems = rf.check([doc], results)
    assert len(problems) == 1 and msg in problems[0]


def test_stale_figure_is_reported_then_fixed(tree):
    doc, results = tree
    doc.write_text("a\nrate <!-- fig speed:results/a-b/rate:.1f:1e-6 -->16.2<!-- /fig --> M/s\n")
    problems = rf.check([doc], results)
    assert len(problems) == 1 and "says '16.2'" in problems[0] and "'16.3'" in problems[0]
    assert rf.fill([doc], results) == 1
    assert doc.read_text() == "a\nrate <!-- fig speed:results/a-b/rate:.1f:1e-6 -->16.3<!-- /fig --> M/s\n"
    assert rf.check([doc], results) == []
