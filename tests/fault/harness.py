"""Run ``python -m moeplace`` as a real process under a memory cap and a timeout, and check how it ended.

A user error must end with exit status 2 and exactly one line on stderr that names the file or option and the
problem; success is exit 0. Nothing may print a traceback. The cap is on address space (RLIMIT_AS), so an input
that asks for a huge allocation fails fast instead of swapping the machine.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
MEMORY_CAP = 2 << 30  # bytes of address space for the child


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def run_cli(args: Sequence[object], cwd: str | os.PathLike, timeout: float = 120,
            stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess:
    """``python -m moeplace ARGS`` in ``cwd`` with this checkout's sources first on the path, at most
    :data:`MEMORY_CAP` bytes of address space and ``timeout`` seconds (TimeoutExpired otherwise)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, "-m", "moeplace", *map(str, args)], cwd=cwd, env=env, text=True,
                          stdout=stdout, stderr=subprocess.PIPE, timeout=timeout, preexec_fn=_cap_memory)


def assert_clean_failure(proc: subprocess.CompletedProcess, mentions: Sequence[str] = ()) -> str:
    """Exit 2, one stderr line containing every string of ``mentions``, no traceback; returns the line."""
    err = proc.stderr or ""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2, f"exit {proc.returncode}, stderr: {err[-2000:]}"
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{err[-2000:]}"
    for m in mentions:
        assert m in lines[0], f"{m!r} not in {lines[0]!r}"
    return lines[0]


def assert_clean_outcome(proc: subprocess.CompletedProcess, mentions: Sequence[str] = ()) -> bool:
    """Exit 0, or a clean failure (see :func:`assert_clean_failure`); returns True on success."""
    if proc.returncode == 0:
        assert "Traceback" not in (proc.stderr or ""), proc.stderr
        return True
    assert_clean_failure(proc, mentions)
    return False
