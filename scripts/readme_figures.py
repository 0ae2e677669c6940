"""Fill or check the benchmark figures in README.md, bench/README.md and docs/*.md from bench/results/*.json (and
from the result files the package ships under src/moeplace/data/).

A figure is a marked span in the Markdown; the comment names the result file, a path into its JSON and a Python
format spec, optionally a scale factor; the text between the markers is generated:

    <!-- fig simulate_speed:results/gpt-oss-20b/rules/nearest-static/speedup_vs_spec:,.0f -->413<!-- /fig -->x
    <!-- fig analyse_speed:results/gpt-oss-20b/moeplace_per_s:.1f:1e-6 -->39.2<!-- /fig --> M decisions/s

``simulate_speed`` is bench/results/simulate_speed.json; a name under ``data/`` is a file the package ships and code
wrote (``data/reference-fg/structure`` = src/moeplace/data/reference-fg/structure.json: the fine-grained model's
measured structure; ``data/reference-fg/train_metrics``: its training run); the path is '/'-separated keys (list
indices as numbers; keys may hold spaces, not ':' or '/'); the value is multiplied by the scale, if given, and formatted
with ``format(value, spec)``.

    python scripts/readme_figures.py            # rewrite every marked figure from the results
    python scripts/readme_figures.py --check    # exit 1 listing each figure that is stale or points nowhere
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PACKAGE = REPO / "src" / "moeplace"  # figures named data/... read the package's shipped result files
FIG = re.compile(r"<!-- fig (?P<spec>[^\n]+?) -->(?P<text>.*?)<!-- /fig -->", re.S)


@dataclass(frozen=True)
class Figure:
    """One marked figure: where it is and what it should say."""

    doc: Path
    line: int  # 1-based line of the opening marker
    spec: str  # NAME:PATH:FORMAT[:SCALE]
    text: str  # what the document says now


def doc_files(repo: Path = REPO) -> list[Path]:
    """The Markdown files whose figures are generated: README.md, bench/README.md, docs/*.md."""
    files = [repo / "README.md", repo / "bench" / "README.md", *sorted((repo / "docs").glob("*.md"))]
    return [f for f in files if f.exists()]


def figures(doc: Path) -> list[Figure]:
    text = doc.read_text(encoding="utf-8")
    return [Figure(doc, text.count("\n", 0, m.start()) + 1, m["spec"], m["text"]) for m in FIG.finditer(text)]


def render(spec: str, results: Path = RESULTS) -> str:
    """The text of figure ``spec`` (NAME:PATH:FORMAT[:SCALE]) from its result file; ValueError if it cannot."""
    parts = spec.split(":")
    if len(parts) not in (3, 4):
        raise ValueError(f"figure spec {spec!r}: expected NAME:PATH:FORMAT[:SCALE]")
    name, path, fmt = parts[:3]
    src = (PACKAGE if name.startswith("data/") else results) / f"{name}.json"
    if not src.exists():
        raise ValueError(f"figure spec {spec!r}: result file {src} does not exist")
    node = json.loads(src.read_text(encoding="utf-8"))
    for key in path.split("/"):
        if isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        elif isinstance(node, dict) and key in node:
            node = node[key]
        else:
            raise ValueError(f"figure spec {spec!r}: {src.name} has no key {key!r} on path {path!r}")
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        raise ValueError(f"figure spec {spec!r}: {path!r} in {src.name} is {node!r}, not a number")
    try:
        return format(node * float(parts[3]) if len(parts) == 4 else node, fmt)
    except ValueError as e:
        raise ValueError(f"figure spec {spec!r}: {e}") from None


def check(docs: list[Path], results: Path = RESULTS) -> list[str]:
    """One line per figure that is stale or cannot be rendered; empty when every figure matches its result."""
    problems = []
    for doc in docs:
        for f in figures(doc):
            where = f"{f.doc.relative_to(REPO) if f.doc.is_relative_to(REPO) else f.doc}:{f.line}"
            try:
                want = render(f.spec, results)
            except ValueError as e:
                problems.append(f"{where}: {e}")
                continue
            if want != f.text:
                problems.append(f"{where}: says {f.text!r}, {f.spec} gives {want!r}")
    return problems


def fill(docs: list[Path], results: Path = RESULTS) -> int:
    """Rewrite every figure from its result; returns how many changed. Raises ValueError on a bad figure."""
    changed = 0
    for doc in docs:
        text = doc.read_text(encoding="utf-8")

        def sub(m: re.Match) -> str:
            nonlocal changed
            new = render(m["spec"], results)
            changed += new != m["text"]
            return f"<!-- fig {m['spec']} -->{new}<!-- /fig -->"

        new_text = FIG.sub(sub, text)
        if new_text != text:
            doc.write_text(new_text, encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if any figure is stale")
    args = ap.parse_args(argv)
    docs = doc_files()
    if args.check:
        problems = check(docs)
        for p in problems:
            print(p)
        n = sum(len(figures(d)) for d in docs)
        print(f"{n - len(problems)} of {n} figures match their result files" if n else "no figures marked")
        return 1 if problems else 0
    try:
        changed = fill(docs)
    except ValueError as e:
        print(f"readme_figures: {e}", file=sys.stderr)
        return 2
    print(f"{changed} figure(s) updated")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
