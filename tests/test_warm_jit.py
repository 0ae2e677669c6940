"""scripts/warm_jit.py: which modules it compiles, and when it counts the cache as current."""

from __future__ import annotations

import ast

from conftest import REPO, load_script


def njit_modules() -> set[str]:
    """Modules under src/moeplace with a function decorated by numba's njit/jit (found by parsing, not grep)."""
    out = set()
    for p in (REPO / "src" / "moeplace").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef):
                for d in node.decorator_list:
                    f = d.func if isinstance(d, ast.Call) else d
                    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                    if name in ("njit", "jit"):
                        out.add(str(p.relative_to(REPO)))
    return out


def test_it_covers_every_module_with_compiled_functions():
    mod = load_script("warm_jit")
    got = {str(p.relative_to(REPO)) for p in mod.kernel_sources()}
    want = njit_modules()
    assert want and want <= got, sorted(want - got)


def test_the_stamp_changes_with_a_kernel_source(tmp_path, monkeypatch):
    mod = load_script("warm_jit")
    src = tmp_path / "src" / "moeplace"
    src.mkdir(parents=True)
    k = src / "loops.py"
    k.write_text("from numba import njit\n@njit(cache=True)\ndef f(x):\n    return x\n")
    (src / "plain.py").write_text("x = 1\n")
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    monkeypatch.setattr(mod, "SRC", src)
    a = mod.stamp()
    (src / "plain.py").write_text("x = 2\n")
    assert mod.stamp() == a  # a module without kernels does not touch the cache
    k.write_text(k.read_text() + "    # changed\n")
    assert mod.stamp() != a
