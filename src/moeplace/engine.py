"""The one seam for work that spans processes or machines: map a pure function over items, in order.

A stage (analyse, simulate, evaluate) splits its work into items (shards of a trace, micro-batch ranges,
strategy x seed pairs), gives :meth:`Engine.map` a module-level function ``fn(item, *shared)`` and reduces what
comes back itself, exactly, in item order; it does not know which engine ran the function:

- :class:`LocalEngine` calls ``fn`` in this process, one item after another;
- :class:`RayEngine` runs each call as a Ray task (``max_retries``: a task whose worker process dies is run again,
  and since ``fn`` is pure the retried result is the same), on a cluster at ``address`` or, without one, on a local
  cluster it starts with ``num_cpus`` workers. ``shared`` arguments are put in the object store once.

Results come back in item order with at most ``window`` calls in flight, so a driver that reduces as it goes holds
a bounded number of partial results. :meth:`Engine.map_pieces` does the same for a generator function, piece by
piece (a Ray streaming-generator task per item): a task whose result grows with its share of the trace (simulate's
per-micro-batch metrics) hands it over in bounded blocks, and neither the worker nor the store holds it whole.
A Ray result is a copy the caller owns: ``ray.get`` hands back numpy arrays
that are read-only views of the task's whole object in the object store, and a reducer that keeps any one of them
(a [L] drift value, a micro-batch's metrics) would keep the whole result (its counters, its rows) pinned in the
store and mapped into the driver, so the driver grew with the number of tasks (docs/SCALE.md). Ray is imported only
when a :class:`RayEngine` is made (the CLI starts fast).

Test hook: ``MOEPLACE_ENGINE_KILL_ONCE=FILE`` makes the first call that finds FILE absent create it and kill its
own worker process (SIGKILL), so tests can check that a worker killed mid-run is retried (docs/SCALE.md).
"""

from __future__ import annotations

import copy
import os
import signal
import socket
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

ENGINES = ("local", "ray")
KILL_ONCE_ENV = "MOEPLACE_ENGINE_KILL_ONCE"  # test hook: see the module docstring
DEFAULT_LOCAL_CPUS = 2  # workers of the local Ray cluster started without --address
TASKS_PER_WORKER = 4  # items a stage cuts its work into per worker: few parts to merge, and still a balanced tail
DEFAULT_MAX_RETRIES = 3  # runs of a task whose worker died, after the first
CONNECT_TIMEOUT_S = 5.0  # a cluster address that accepts no TCP connection within this is unreachable
# Object store of the local cluster: Ray's default (30% of RAM) lets the store's resident pages grow with every part
# that passes through it (measured: 6 GB on a 5 GB trace); results stream through it a few at a time, so 1 GiB holds
# what is in flight (bench/scale.py).
LOCAL_OBJECT_STORE_BYTES = 1 << 30


class EngineError(ValueError):
    """An engine that cannot run as asked (unreachable cluster, Ray not installed); one line naming the flag."""


def _kill_once(marker: str | None) -> None:
    if not marker:
        return
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def owned(result: Any) -> Any:
    """``result`` with every numpy array copied out of the object store (writable, owning its memory), so that
    keeping a piece of it keeps nothing else of the stored object alive (the module docstring)."""
    return copy.deepcopy(result)


def _call(fn: Callable, item: Any, marker: str | None, *shared: Any) -> Any:
    _kill_once(marker)
    from moeplace.budget import fix_allocators

    fix_allocators()  # in a Ray worker as in the CLI's process (moeplace.budget)
    return fn(item, *shared)


def _call_pieces(fn: Callable, item: Any, marker: str | None, *shared: Any) -> Iterator:
    """:func:`_call` for a generator function: a Ray streaming-generator task (a retried task replays its pieces;
    Ray skips those already handed over, so ``fn`` must yield the same pieces every time, as a pure one does)."""
    yield from _call(fn, item, marker, *shared)


class Engine:
    """Runs ``fn(item, *shared)`` for each item and yields the results in item order (see the module docstring)."""

    name = "local"
    workers = 1

    def map(self, fn: Callable, items: Sequence, *shared: Any) -> Iterator:
        raise NotImplementedError

    def map_pieces(self, fn: Callable, items: Sequence, *shared: Any) -> Iterator[tuple[int, Any]]:
        """Like :meth:`map` for a generator function ``fn``: yields ``(item index, piece)`` for every piece each
        call yields, in item order and, within an item, in the order it yielded them. A task hands each piece over
        as it is made, so neither the task nor the store holds its whole result at once."""
        for i, item in enumerate(items):
            for piece in fn(item, *shared):
                yield i, piece

    def close(self) -> None:
        """Release what the engine holds (a local Ray cluster it started is shut down)."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalEngine(Engine):
    """In this process, one item after another."""

    def map(self, fn: Callable, items: Sequence, *shared: Any) -> Iterator:
        for item in items:
            yield fn(item, *shared)


def _address_problem(address: str) -> str | None:
    """Why ``address`` (``HOST:PORT``, ``ray://HOST:PORT`` or ``auto``) cannot be a reachable Ray cluster, or None."""
    if address == "auto":
        return None
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return "expected HOST:PORT of a Ray head node (or ray://HOST:PORT, or auto)"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
            return None
    except OSError as e:
        return f"no Ray cluster reachable there ({e.strerror or e.__class__.__name__})"


class RayEngine(Engine):
    """Ray tasks on the cluster at ``address``, or on a local cluster of ``num_cpus`` workers started here."""

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: int = DEFAULT_LOCAL_CPUS,
                 max_retries: int = DEFAULT_MAX_RETRIES, window: int | None = None) -> None:
        if address is not None:
            problem = _address_problem(address)
            if problem:
                raise EngineError(f"--address {address}: {problem}")
        try:
            import ray
        except ImportError:
            raise EngineError("--engine ray: Ray is not installed (pip install -c constraints.txt "
                              "'moeplace[ray]')") from None
        self._ray = ray
        self._started = False
        if not ray.is_initialized():
            kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local cluster for this process only
            try:
                if address is None:
                    # Ray starts workers at nice 15 by default. A local cluster's workers do this command's work
                    # while it waits, so they run at the command's own priority: beside two busy processes,
                    # nice-15 workers took simulate on reference-fg from 2 s to 70 s (6.5 s at the same nice)
                    os.environ.setdefault("RAY_worker_niceness", "0")
                    ray.init(num_cpus=num_cpus, object_store_memory=LOCAL_OBJECT_STORE_BYTES, **kw)
                else:  # the cluster's workers were not started from here: hand them the allocator choice
                    from moeplace.budget import ARROW_POOL_ENV, use_system_arrow_pool

                    env = {ARROW_POOL_ENV: use_system_arrow_pool()}
                    ray.init(address=address, runtime_env={"env_vars": env}, **kw)
            except (ConnectionError, RuntimeError, ValueError) as e:
                where = f"--address {address}" if address else "--engine ray"
                raise EngineError(f"{where}: could not start or join a Ray cluster ({str(e).splitlines()[0]})"
                                  ) from None
            self._started = True
        self.workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.max_retries = max_retries
        self.window = window or 2 * self.workers
        self._remote = ray.remote(_call).options(max_retries=max_retries, retry_exceptions=False)
        self._remote_pieces = ray.remote(_call_pieces).options(max_retries=max_retries, retry_exceptions=False,
                                                               num_returns="streaming")

    def _failed(self, e: Exception, pending: deque) -> Exception:
        """The error to raise for a failed task (``pending``: the calls in flight, cancelled)."""
        for ref in pending:
            try:
                self._ray.cancel(ref, force=True)
            except (TypeError, ValueError, self._ray.exceptions.RayError):  # a finished streaming call
                pass
        cause = getattr(e, "cause", None)
        if isinstance(e, self._ray.exceptions.RayTaskError) and isinstance(cause, Exception):
            return cause  # the function's own error (a bad shard: one line naming the file)
        return EngineError(f"--engine ray: a task failed ({str(e).splitlines()[0]})")

    def map(self, fn: Callable, items: Sequence, *shared: Any) -> Iterator:
        ray = self._ray
        refs = [ray.put(s) for s in shared]  # top-level arguments: Ray hands each task the objects
        marker = os.environ.get(KILL_ONCE_ENV)
        pending: deque = deque()
        it = iter(items)
        done = object()
        while True:
            while len(pending) < self.window:
                item = next(it, done)
                if item is done:
                    break
                pending.append(self._remote.remote(fn, item, marker, *refs))
            if not pending:
                return
            try:
                out = owned(ray.get(pending.popleft()))  # the store's copy is released with the ref
            except ray.exceptions.RayError as e:
                raise self._failed(e, pending) from None
            yield out

    def map_pieces(self, fn: Callable, items: Sequence, *shared: Any) -> Iterator[tuple[int, Any]]:
        ray = self._ray
        refs = [ray.put(s) for s in shared]
        marker = os.environ.get(KILL_ONCE_ENV)
        pending: deque = deque()  # (item index, ObjectRefGenerator)
        it = enumerate(items)
        while True:
            while len(pending) < self.window:
                nxt = next(it, None)
                if nxt is None:
                    break
                pending.append((nxt[0], self._remote_pieces.remote(fn, nxt[1], marker, *refs)))
            if not pending:
                return
            i, gen = pending.popleft()
            while True:
                try:
                    ref = next(gen, None)
                    if ref is None:
                        break
                    piece = owned(ray.get(ref))
                except ray.exceptions.RayError as e:
                    raise self._failed(e, deque(g for _, g in pending)) from None
                del ref  # the store's copy goes with it
                yield i, piece

    def close(self) -> None:
        if self._started and self._ray.is_initialized():
            self._ray.shutdown()
        self._started = False


def make_engine(name: str = "local", address: str | None = None, num_cpus: int = DEFAULT_LOCAL_CPUS) -> Engine:
    """The engine called ``name`` (:data:`ENGINES`); ``address`` applies to ``ray`` only."""
    if name not in ENGINES:
        raise EngineError(f"--engine {name}: expected one of {', '.join(ENGINES)}")
    if name == "local":
        if address is not None:
            raise EngineError("--address applies to --engine ray only")
        return LocalEngine()
    return RayEngine(address, num_cpus)
