"""The package layout keeps imports one way (/work/shared/LAYOUT.md; README "Layout"):

(a) every module under src/moeplace imports, and no import cycle runs among moeplace modules at module level (the
    graph of each file's top-level imports, read with ``ast``; imports inside functions and under
    ``if TYPE_CHECKING:`` are not edges);
(b) the shared core (moeplace.placement, moeplace.io, moeplace.schema, moeplace.deploy) imports no stage package,
    not even inside a function;
(c) no module imports a name starting with ``_`` from another moeplace module.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import moeplace

SRC = Path(moeplace.__file__).resolve().parent.parent
CORE = ("moeplace.placement", "moeplace.io", "moeplace.schema", "moeplace.deploy")
STAGES = tuple(f"moeplace.{s}" for s in ("trace", "analyse", "plan", "simulate", "evaluate", "run", "operate",
                                         "models", "cli"))
# (importer, imported) pairs that break a rule and are owned elsewhere; keep this empty if at all possible
ALLOWED: set[tuple[str, str]] = set()


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module under src/moeplace (a package is its __init__.py)."""
    out = {}
    for p in sorted((SRC / "moeplace").rglob("*.py")):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imports(name: str, path: Path, module_level: bool) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) of every import in the file; with module_level, only those that run
    when the module is imported (not inside functions, not under ``if TYPE_CHECKING:``)."""
    is_pkg = path.name == "__init__.py"
    out: list[tuple[str, str | None, int]] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if module_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if module_level and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                out.extend((a.name, None, node.lineno) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[:len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                out.extend((base, a.name, node.lineno) for a in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                sub = getattr(node, field, None)
                if isinstance(sub, list):
                    visit([s for s in sub if isinstance(s, ast.stmt | ast.ExceptHandler)])

    visit(ast.parse(path.read_text()).body)
    return out


def target(mods: dict[str, Path], base: str, name: str | None) -> str:
    """The moeplace module an import loads: ``from a import b`` is module a.b when that exists, else a."""
    t = f"{base}.{name}" if name and f"{base}.{name}" in mods else base
    while t not in mods and "." in t:
        t = t.rsplit(".", 1)[0]
    return t


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def inside(mod: str, prefixes: tuple[str, ...]) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def test_cycle_finder_finds_a_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]] and cycles({"a": {"b"}, "b": set()}) == []


def test_every_module_imports():
    names = sorted(m for m in modules() if m != "moeplace.__main__")  # __main__ runs the CLI
    code = "import importlib, sys\nfor n in sys.stdin.read().split():\n    importlib.import_module(n)\n"
    r = subprocess.run([sys.executable, "-c", code], input="\n".join(names), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def test_no_import_cycle_at_module_level():
    mods = modules()
    graph = {m: set() for m in mods}
    for m, p in mods.items():
        for base, name, _ in imports(m, p, module_level=True):
            if inside(base, ("moeplace",)):
                t = target(mods, base, name)
                if t != m and (m, t) not in ALLOWED:
                    graph[m].add(t)
    assert cycles(graph) == []


def test_shared_core_imports_no_stage():
    mods = modules()
    bad = [f"{m}:{line} imports {t}" for m, p in mods.items() if inside(m, CORE)
           for base, name, line in imports(m, p, module_level=False)
           if inside(base, ("moeplace",)) and inside(t := target(mods, base, name), STAGES) and (m, t) not in ALLOWED]
    assert bad == []


def test_no_private_name_crosses_modules():
    mods = modules()
    bad = [f"{m}:{line} imports {name} from {base}" for m, p in mods.items()
           for base, name, line in imports(m, p, module_level=False)
           if inside(base, ("moeplace",)) and name and name.startswith("_") and not name.startswith("__")
           and target(mods, base, name) != m and (m, base) not in ALLOWED]
    assert bad == []
