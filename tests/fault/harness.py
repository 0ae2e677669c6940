"""Run ``python -m moeplace`` as a real process under a memory cap and a timeout, and check how it ended.

A user error must end with exit status 2 and exactly one line on stderr that names the file or option and the
problem; success is exit 0. Nothing may print a traceback. The cap is on address space (RLIMIT_AS), so an input
that asks for a huge allocation fails fast instead of swapping the machine.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Mapping, Sequence
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


class ForkServer:
    """Runs ``moeplace`` command lines in forked children of one interpreter that imported the CLI once
    (forkserver.py): each child gets ``as_cap`` bytes of address space, ``timeout`` seconds, its own stdout and
    stderr files, and optionally its own environment changes and working folder. ``MOEPLACE_MEMORY_BUDGET`` is
    unset unless a run sets it, so the budget is half the cap."""

    def __init__(self, timeout: float = 240, as_cap: int = MEMORY_CAP) -> None:
        env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
        env.pop("MOEPLACE_MEMORY_BUDGET", None)
        self.timeout, self.as_cap = timeout, as_cap
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forkserver.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def run(self, tmp: Path, *argv: object, env: Mapping[str, str] | None = None, unset: Sequence[str] = (),
            cwd: str | os.PathLike | None = None, timeout: float | None = None) -> subprocess.CompletedProcess:
        out, err = Path(tmp) / ".fork-stdout.txt", Path(tmp) / ".fork-stderr.txt"
        req = {"argv": [str(a) for a in argv], "stdout": str(out), "stderr": str(err),
               "timeout": timeout or self.timeout, "as_cap": self.as_cap, "env": dict(env or {}),
               "unset": list(unset), "cwd": None if cwd is None else str(cwd)}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        rc = json.loads(self.proc.stdout.readline())["rc"]
        return subprocess.CompletedProcess(req["argv"], rc, out.read_text(), err.read_text())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


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
