"""Compile moeplace's numba kernels into their on-disk cache once, before many processes want them at once.

``@njit(cache=True)`` keeps compiled code in ``__pycache__`` beside each module, keyed by the source file's stamp.
On a fresh clone that cache is empty, and the test suite's two pytest workers, their CLI subprocesses and a local
Ray cluster's workers each compile the same kernels concurrently (about 40 s of CPU per process for the simulator
loops alone), on 2 cores. This script compiles them once, in two processes that take different kernels, by
running real commands on the bundled default trace (``moeplace demo``, ``simulate`` with every replica rule,
``analyze`` and a small labelled-synthetic ``synth``) into a temporary folder, then records a stamp of the kernel
sources in ``.venv`` so an unchanged checkout skips it (under a second).

Usage::

    .venv/bin/python scripts/warm_jit.py          # what scripts/test.sh runs before pytest
    .venv/bin/python scripts/warm_jit.py --force  # compile again even if the stamp matches
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "moeplace"
TRACE = SRC / "data" / "reference-default.trace"
RULES = ("nearest-least-loaded", "nearest-static", "balanced-local", "balanced", "balanced-links")


def kernel_sources() -> list[Path]:
    """Every module of the package that defines a numba-compiled function (sorted)."""
    return sorted(p for p in SRC.rglob("*.py") if "njit" in p.read_text(encoding="utf-8"))


def stamp() -> str:
    """Hash of the kernel modules' bytes and the interpreter: the cache is stale when this changes."""
    h = hashlib.sha256(sys.version.encode())
    for p in kernel_sources():
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def commands(out: Path) -> tuple[list[list[str]], list[list[str]]]:
    """Two command lists, one per process, that between them call every kernel with the types the code uses."""
    m = [sys.executable, "-m", "moeplace"]
    first = [m + ["demo", "--out", str(out / "demo"), "--quiet"]]
    second = [m + ["simulate", str(TRACE), "--cluster", "2x4", "--rule", r] for r in RULES]
    second += [
        m + ["analyze", str(TRACE), "--json", str(out / "a.json"), "--no-progress"],
        m + ["synth", "--preset", "olmoe-1b-7b", "--requests", "40", "--prompt-len", "16", "--gen-len", "8",
             "--quiet", str(out / "synth.trace")],
    ]
    return first, second


def run_list(cmds: list[list[str]]) -> subprocess.Popen:
    """One process that runs ``cmds`` in order and stops at the first failure."""
    script = " && ".join(shlex.join(c) for c in cmds)
    return subprocess.Popen(["bash", "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--force", action="store_true", help="compile even if the stamp says the cache is current")
    args = ap.parse_args(argv)
    marker = ROOT / ".venv" / ".moeplace-jit-warm"
    want = stamp()
    if not args.force and marker.is_file() and marker.read_text().strip() == want:
        print("== numba cache current (scripts/warm_jit.py)")
        return 0
    t0 = time.perf_counter()
    print("== compiling the numba kernels once into their cache (2 processes, scripts/warm_jit.py)", flush=True)
    with tempfile.TemporaryDirectory(prefix="moeplace-warm-") as tmp:
        procs = [run_list(c) for c in commands(Path(tmp))]
        errs = [p.communicate()[1] for p in procs]
    bad = [e for p, e in zip(procs, errs, strict=True) if p.returncode != 0]
    if bad:
        # Not fatal for the suite: the tests then compile as they go, only slower.
        last = bad[0].strip().splitlines()[-1] if bad[0].strip() else "(no message)"
        print(f"warning: scripts/warm_jit.py: a warm-up command failed ({last}); the kernels compile on first use",
              file=sys.stderr)
        return 0
    tmp_marker = marker.with_name(marker.name + f".{os.getpid()}.tmp")
    tmp_marker.write_text(want + "\n")
    os.replace(tmp_marker, marker)
    print(f"== numba kernels compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
