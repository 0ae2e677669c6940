"""Spawn W rank processes, each running one function under ``torch.distributed``, and collect their results.

The same code runs on CPU (gloo) and on GPUs (NCCL, one device per rank) - :func:`launch` picks the backend from
``torch.cuda.is_available()`` unless told. Each rank is a subprocess (``python -m moeplace.run.launch --worker``),
optionally prefixed with ``ip netns exec NS`` so the ranks of one emulated node run inside its network namespace
(:mod:`moeplace.run.netns`).

Failure handling: the parent polls every rank; the first that exits non-zero makes :func:`launch` kill every
rank's process group and raise :class:`RankFailed` naming it (exit code and the tail of its stderr). A timeout or
Ctrl-C also kills them all, so no rank outlives the call. If the parent itself dies (``kill -9``), every rank
gets SIGKILL from the kernel: the first thing a rank does is :func:`die_with_parent`.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from importlib import import_module
from pathlib import Path
from typing import Any

INJECTED_FAILURE_EXIT = 17  # exit code of a rank killed by ``fail_rank`` (tests)
PARENT_PID_ENV = "MOEPLACE_RANK_PARENT_PID"  # set for each rank: the launcher's pid, checked by die_with_parent
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
ORPHAN_EXIT = 70  # exit code of a rank that found its launcher already gone


class RankFailed(RuntimeError):
    """A rank process exited with an error (or was killed); ``rank`` and ``returncode`` say which and how."""

    def __init__(self, rank: int, returncode: int | None, detail: str) -> None:
        self.rank, self.returncode = rank, returncode
        super().__init__(detail)


@dataclass(frozen=True)
class RankContext:
    """What a rank function receives besides its keyword arguments."""

    rank: int
    world_size: int
    backend: str  # "gloo" or "nccl"
    device: str  # "cpu" or "cuda:i"
    netns: str | None  # the namespace this rank runs in, None for the host's own


def free_port() -> int:
    """A TCP port free on the host's loopback right now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent(parent_pid: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent exits (Linux ``prctl(PR_SET_PDEATHSIG)``); exit at
    once with :data:`ORPHAN_EXIT` when the parent is already gone, i.e. ``os.getppid() != parent_pid`` (it died
    between our fork and this call). Call it first thing in a child process. No-op off Linux.

    The kernel sends the signal when the *thread* that forked us ends, so the launcher starts and waits for its
    ranks in one thread (:func:`launch` does); the setting survives ``exec`` (``ip netns exec`` execs the rank).
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(ORPHAN_EXIT)


def _resolve(target: str) -> Callable[..., Any]:
    mod, _, name = target.partition(":")
    if not mod or not name:
        raise ValueError(f"launch target {target!r}: expected 'package.module:function'")
    return getattr(import_module(mod), name)


def _kill_all(procs: Sequence[subprocess.Popen], grace: float = 2.0) -> None:
    """SIGTERM every live rank's process group, then SIGKILL what is left after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, sig)  # each rank leads its own session: this reaches its children too
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(0.02)
    for p in procs:
        if p.poll() is None:
            p.wait()


def _tail(path: Path, n: int = 1500) -> str:
    try:
        data = path.read_bytes()[-n:].decode(errors="replace").strip()
    except OSError:
        return ""
    return data


def launch(target: str, world_size: int, kwargs: dict[str, Any] | None = None, *,
           netns: Sequence[str | None] | None = None, master_addr: str = "127.0.0.1", master_port: int | None = None,
           socket_ifname: str | None = None, backend: str | None = None, timeout: float = 600.0,
           fail_rank: int | None = None, env: dict[str, str] | None = None,
           threads_per_rank: int = 1) -> list[Any]:
    """Run ``target(ctx: RankContext, **kwargs)`` in ``world_size`` processes; returns their results by rank.

    target: ``"package.module:function"`` (importable in the children); kwargs: picklable arguments, the same for
    every rank; netns: per rank, the network namespace to run in (None: the host's); master_addr/master_port: the
    rendezvous (rank 0's address, reachable from every rank); socket_ifname: GLOO_SOCKET_IFNAME for the ranks;
    fail_rank: that rank exits with :data:`INJECTED_FAILURE_EXIT` right after joining the group (tests).
    Raises :class:`RankFailed` naming the first rank that failed, ``TimeoutError`` after ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"launch: world_size must be >= 1, got {world_size}")
    if netns is not None and len(netns) != world_size:
        raise ValueError(f"launch: netns lists {len(netns)} namespaces for {world_size} ranks")
    _resolve(target)  # fail here, not in W children, when the target does not exist
    if backend is None:
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    port = master_port or free_port()
    with tempfile.TemporaryDirectory(prefix="moeplace-run-") as tmp:
        job_dir = Path(tmp)
        job = dict(target=target, kwargs=kwargs or {}, world_size=world_size, backend=backend,
                   master_addr=master_addr, master_port=port, timeout=timeout, fail_rank=fail_rank,
                   netns=list(netns) if netns is not None else [None] * world_size)
        (job_dir / "job.pkl").write_bytes(pickle.dumps(job))
        base_env = {**os.environ, **(env or {}), "MASTER_ADDR": master_addr, "MASTER_PORT": str(port),
                    "OMP_NUM_THREADS": str(threads_per_rank), "PYTHONUNBUFFERED": "1",
                    PARENT_PID_ENV: str(os.getpid())}
        if socket_ifname:
            base_env["GLOO_SOCKET_IFNAME"] = socket_ifname
        procs: list[subprocess.Popen] = []
        try:
            for r in range(world_size):
                cmd = [sys.executable, "-m", "moeplace.run.launch", "--worker", str(job_dir), str(r)]
                ns = job["netns"][r]
                if ns:
                    cmd = ["ip", "netns", "exec", ns, *cmd]  # ip execs the command: the pid is the rank's
                with open(job_dir / f"rank{r}.out", "wb") as out, open(job_dir / f"rank{r}.err", "wb") as err:
                    procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env={**base_env, "RANK": str(r)},
                                                  start_new_session=True))
            _wait(procs, job_dir, timeout)
            results = []
            for r in range(world_size):
                f = job_dir / f"result{r}.pkl"
                if not f.exists():
                    raise RankFailed(r, 0, f"rank {r} exited without writing its result")
                results.append(pickle.loads(f.read_bytes()))
            return results
        finally:
            _kill_all(procs)  # no rank outlives the call, whatever happened above


def _wait(procs: Sequence[subprocess.Popen], job_dir: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        for r, c in enumerate(codes):
            if c not in (None, 0):
                _kill_all(procs)
                how = f"was killed by signal {-c}" if c < 0 else f"exited with code {c}"
                tail = _tail(job_dir / f"rank{r}.err")
                raise RankFailed(r, c, f"rank {r} {how}; the other ranks were stopped"
                                       + (f"\n--- rank {r} stderr (tail) ---\n{tail}" if tail else ""))
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            live = [r for r, c in enumerate(codes) if c is None]
            _kill_all(procs)
            raise TimeoutError(f"launch: ranks {live} still running after {timeout:.0f} s; all ranks were stopped")
        time.sleep(0.05)


def _worker(job_dir: Path, rank: int) -> int:
    """Child side: join the process group, run the target, write the result."""
    import torch
    import torch.distributed as dist

    job = pickle.loads((job_dir / "job.pkl").read_bytes())
    W = job["world_size"]
    device = "cpu"
    if job["backend"] == "nccl":
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    # host waits here until all W ranks have joined the rendezvous at MASTER_ADDR:MASTER_PORT
    dist.init_process_group(job["backend"], rank=rank, world_size=W, timeout=timedelta(seconds=job["timeout"]))
    try:
        if job["fail_rank"] == rank:
            print(f"rank {rank}: injected failure (fail_rank={rank})", file=sys.stderr, flush=True)
            os._exit(INJECTED_FAILURE_EXIT)
        ctx = RankContext(rank, W, job["backend"], device, job["netns"][rank])
        result = _resolve(job["target"])(ctx, **job["kwargs"])
        tmp = job_dir / f".result{rank}.pkl.tmp"
        tmp.write_bytes(pickle.dumps(result))
        os.replace(tmp, job_dir / f"result{rank}.pkl")
        dist.barrier()  # host waits: no rank tears the group down while a peer still uses it
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parent = os.environ.get(PARENT_PID_ENV)
    die_with_parent(int(parent) if parent else None)  # before the slow imports: a rank never outlives its launcher
    ap = argparse.ArgumentParser(prog="python -m moeplace.run.launch", description="internal: one rank process")
    ap.add_argument("--worker", nargs=2, metavar=("JOB_DIR", "RANK"), required=True)
    a = ap.parse_args(argv)
    try:
        return _worker(Path(a.worker[0]), int(a.worker[1]))
    except Exception:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
