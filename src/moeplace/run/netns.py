"""Emulated nodes: one Linux network namespace per node, joined through a bridge, with shaped inter-node links.

Layout of a cluster named ``NAME`` with N nodes (nothing is created in the host's own namespace)::

    NAME-br   namespace holding bridge ``br0`` and one veth end ``n<i>`` per node
    NAME-n<i> namespace of node i: veth end ``mp0`` at 10.77.0.<i+1>/24, and ``lo``

Every rank of node i runs inside ``NAME-n<i>`` (``ip netns exec``); ranks of one node talk over that namespace's
own stack (no shaping: the fast intra-node link), ranks of different nodes through the bridge. Each node's veth is
shaped in both directions (``tbf`` on ``mp0`` egress and on ``n<i>`` egress): ``inter_gbit`` is a node's link
rate, shared by its G ranks. ``inter_delay_ms`` adds ``netem`` delay when the kernel has it, else the cluster
says it was skipped. Traffic only ever flows between namespaces this module created (10.77.0.0/24 is private
to them).

Bring-up is idempotent (same configuration: reused; different: rebuilt), a failure half-way removes what was
built, and :func:`cluster_down` removes every namespace of the name. :func:`emulated_cluster` is a context
manager for one run that always cleans up.

Concurrency and orphans: every change to cluster ``NAME`` holds an exclusive ``flock`` on
``STATE_DIR/NAME.lock`` and a run on it holds a shared one; whoever finds the lock taken gets
:class:`ClusterBusy` at once (never half of two shapes). A private cluster (:func:`emulated_cluster`) records
its owner's pid and is removed by a watchdog process when the owner dies, even by ``kill -9``;
:func:`remove_stale` (``moeplace cluster down --stale``) removes whatever a dead owner or a killed bring-up
left behind.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from moeplace.io import atomic_write_json, unique_keys

SUBNET_PREFIX = "10.77.0."  # addresses inside our namespaces only
NODE_IFNAME = "mp0"  # the veth end inside each node namespace (GLOO_SOCKET_IFNAME)
MAX_NODES = 250
MAX_GPUS_PER_NODE = 64
STATE_DIR = Path("/run/moeplace")
PROBE_PREFIX = "moeplace-probe-"  # check_support's throw-away namespace, suffixed with the prober's pid


class NetnsUnavailable(RuntimeError):
    """This machine does not let us build namespaces (not root, no iproute2, netns not permitted)."""


class NetnsError(RuntimeError):
    """A namespace command failed while building or removing an emulated cluster."""


class ClusterBusy(RuntimeError):
    """Another process holds the cluster's lock: it is bringing the cluster up or down, or running on it."""


@dataclass(frozen=True)
class EmulatedCluster:
    """An emulated cluster: where each rank runs and how to reach rank 0. ``mode`` is "netns" or "loopback"."""

    name: str  # namespace prefix
    num_nodes: int  # N
    gpus_per_node: int  # G
    inter_gbit: float | None = None  # shaped rate of each node's link (None: unshaped)
    inter_delay_ms: float | None = None  # requested one-way delay on each node's link
    delay_applied: bool = False  # whether netem delay is in place
    mode: str = "netns"  # "netns": one namespace per node; "loopback": all ranks in the host's namespace
    note: str = ""  # why we fell back, or what was skipped
    owner_pid: int | None = None  # the process whose run this private cluster serves (None: `cluster up`'s)
    owner_start: int | None = None  # that process's start time (clock ticks after boot), against pid reuse

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def node_ns(self, node: int) -> str:
        return f"{self.name}-n{node}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.name}-br"

    def addr(self, node: int) -> str:
        return f"{SUBNET_PREFIX}{node + 1}"

    def rank_netns(self) -> list[str | None]:
        """Namespace of each rank [W] (None for loopback mode)."""
        if self.mode != "netns":
            return [None] * self.world_size
        return [self.node_ns(r // self.gpus_per_node) for r in range(self.world_size)]

    @property
    def master_addr(self) -> str:
        return self.addr(0) if self.mode == "netns" else "127.0.0.1"

    @property
    def socket_ifname(self) -> str:
        return NODE_IFNAME if self.mode == "netns" else "lo"

    def launch_kwargs(self) -> dict:
        """Keyword arguments for :func:`moeplace.run.launch.launch` and :func:`moeplace.run.replay.replay`."""
        return dict(netns=self.rank_netns(), master_addr=self.master_addr, socket_ifname=self.socket_ifname)


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {(p.stderr or p.stdout).strip()}")
    return p


def check_support() -> str | None:
    """None when namespaces can be built here, else the reason they cannot (for the user)."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "building network namespaces needs root (run as root, or use plain loopback)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: install iproute2 (apt-get install -y iproute2)"
    probe = f"{PROBE_PREFIX}{os.getpid()}"
    p = _run(["ip", "netns", "add", probe], check=False)
    if p.returncode:
        return f"network namespaces not permitted here: {(p.stderr or p.stdout).strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def list_namespaces(name: str) -> list[str]:
    """Namespaces that belong to cluster ``name`` (``NAME-br``, ``NAME-n<i>``)."""
    if shutil.which("ip") is None:
        return []
    p = _run(["ip", "netns", "list"], check=False)
    out = []
    for line in p.stdout.splitlines():
        ns = line.split()[0] if line.strip() else ""
        if ns == f"{name}-br" or (ns.startswith(f"{name}-n") and ns[len(name) + 2:].isdigit()):
            out.append(ns)
    return sorted(out)


def _state_file(name: str) -> Path:
    return STATE_DIR / f"{name}.json"


def _lock_file(name: str) -> Path:
    return STATE_DIR / f"{name}.lock"


def process_start_time(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks after boot (/proc/PID/stat field 22), None when it is gone
    or a zombie. A (pid, start time) pair names one process even after the pid is reused."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _lock_holders(path: Path) -> list[int]:
    """Pids holding a flock on ``path`` (from /proc/locks), for the error message."""
    try:
        ino = path.stat().st_ino
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        f = line.split()
        if "->" in f:  # a waiter, not a holder
            continue
        try:
            if f[1] == "FLOCK" and int(f[5].rsplit(":", 1)[1]) == ino:
                out.append(int(f[4]))
        except (IndexError, ValueError):
            continue
    return sorted(set(out))


@contextmanager
def cluster_lock(name: str, shared: bool = False, wait: float = 0.0) -> Iterator[None]:
    """Hold the lock of cluster ``name`` for a ``with`` block: exclusive to change it, ``shared`` to run on it.

    The lock is an ``flock`` on ``STATE_DIR/NAME.lock``, so the kernel drops it when its holder dies, however it
    dies. Waits up to ``wait`` seconds, then raises :class:`ClusterBusy` naming the holders. :func:`cluster_down`
    deletes the file under the lock; a waiter that then gets the old file's lock sees it is no longer the one at
    the path and starts over.
    """
    _check_name(name)
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    path = _lock_file(name)
    deadline = time.monotonic() + wait
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                pids = [p for p in _lock_holders(path) if p != os.getpid()]
                who = f" (pid {', '.join(map(str, pids))})" if pids else ""
                raise ClusterBusy(f"cluster {name} is busy: another moeplace process{who} is bringing it up, "
                                  f"taking it down or running on it; try again when it has finished") from None
            time.sleep(0.05)
            continue
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)  # we locked a file cluster_down has just deleted: take the one at the path now
    try:
        yield
    finally:
        os.close(fd)  # releases the lock


def _drop_lock_file(name: str) -> None:
    """Delete the lock file of a cluster that no longer exists; call with its exclusive lock held."""
    if not list_namespaces(name) and not _state_file(name).exists():
        _lock_file(name).unlink(missing_ok=True)


def _check_name(name: str) -> None:
    if not name or len(name) > 40 or not all(c.isalnum() or c in "-_" for c in name):
        raise ValueError(f"cluster name {name!r}: expected 1-40 letters, digits, '-' or '_'")


def load_cluster(name: str) -> EmulatedCluster | None:
    """The cluster ``name`` as ``cluster up`` left it, or None when it is not up."""
    f = _state_file(name)
    if not f.exists():
        return None
    try:
        c = EmulatedCluster(**json.loads(f.read_text(), object_pairs_hook=unique_keys))
    except (ValueError, TypeError):
        return None
    if c.mode == "netns" and len(list_namespaces(name)) != c.num_nodes + 1:
        return None
    return c


def _tc_shape(ns: str, dev: str, gbit: float | None, delay_ms: float | None) -> bool:
    """Shape ``dev``'s egress in ``ns``: netem delay (if asked and available) then tbf rate. Returns delay_applied."""
    applied = False
    parent = ["root"]
    if delay_ms:
        p = _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                  "delay", f"{delay_ms}ms"], check=False)
        if p.returncode == 0:
            applied, parent = True, ["parent", "1:1"]
    if gbit:
        rate_bps = gbit * 1e9
        burst = max(32 * 1024, int(rate_bps / 8 / 250))  # at least one kernel tick (HZ >= 250) of data
        _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, *parent, "handle", "10:", "tbf",
              "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "200ms"])
    return applied


def cluster_up(num_nodes: int, gpus_per_node: int, inter_gbit: float | None = None,
               inter_delay_ms: float | None = None, name: str = "moeplace",
               fallback: bool = True, owner_pid: int | None = None) -> EmulatedCluster:
    """Build (or reuse) the emulated cluster; returns it. Idempotent.

    When namespaces are not possible here and ``fallback`` is set, returns a ``mode="loopback"`` cluster whose
    ``note`` says why (all ranks on the host's loopback, links unshaped); else raises :class:`NetnsUnavailable`.
    ``owner_pid``: the live process this cluster serves; once it is gone the cluster is stale
    (:func:`remove_stale`). Raises :class:`ClusterBusy` when another process holds the cluster's lock.
    """
    _check_name(name)
    if not 1 <= num_nodes <= MAX_NODES:
        raise ValueError(f"cluster up: nodes must be in [1, {MAX_NODES}], got {num_nodes}")
    if not 1 <= gpus_per_node <= MAX_GPUS_PER_NODE:
        raise ValueError(f"cluster up: gpus per node must be in [1, {MAX_GPUS_PER_NODE}], got {gpus_per_node}")
    for what, v in (("inter_gbit", inter_gbit), ("inter_delay_ms", inter_delay_ms)):
        if v is not None and not v > 0:
            raise ValueError(f"cluster up: {what} must be > 0, got {v}")
    reason = check_support()
    if reason:
        if not fallback:
            raise NetnsUnavailable(reason)
        return EmulatedCluster(name, num_nodes, gpus_per_node, inter_gbit, inter_delay_ms, False, "loopback",
                               f"{reason}; falling back to a single namespace (plain loopback, unshaped links)")
    owner_start = None
    if owner_pid is not None:
        owner_start = process_start_time(owner_pid)
        if owner_start is None:
            raise ValueError(f"cluster up: owner pid {owner_pid} is not a running process")
    with cluster_lock(name):
        return _cluster_up_locked(name, num_nodes, gpus_per_node, inter_gbit, inter_delay_ms, owner_pid,
                                  owner_start)


def _cluster_up_locked(name: str, num_nodes: int, gpus_per_node: int, inter_gbit: float | None,
                       inter_delay_ms: float | None, owner_pid: int | None,
                       owner_start: int | None) -> EmulatedCluster:
    old = load_cluster(name)
    if old is not None and (old.num_nodes, old.gpus_per_node, old.inter_gbit, old.inter_delay_ms, old.owner_pid,
                            old.owner_start) == (num_nodes, gpus_per_node, inter_gbit, inter_delay_ms, owner_pid,
                                                 owner_start):
        return old  # already up as asked
    _cluster_down_locked(name)
    c = EmulatedCluster(name, num_nodes, gpus_per_node, inter_gbit, inter_delay_ms)
    try:
        br = c.bridge_ns
        _run(["ip", "netns", "add", br])
        _run(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", "br0", "up"])
        delay_ok = True
        for n in range(num_nodes):
            ns = c.node_ns(n)
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", br, "link", "add", f"n{n}", "type", "veth", "peer", "name", NODE_IFNAME, "netns", ns])
            _run(["ip", "-n", br, "link", "set", f"n{n}", "master", "br0", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{c.addr(n)}/24", "dev", NODE_IFNAME])
            _run(["ip", "-n", ns, "link", "set", NODE_IFNAME, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if num_nodes > 1:
                delay_ok &= _tc_shape(ns, NODE_IFNAME, inter_gbit, inter_delay_ms)
                delay_ok &= _tc_shape(br, f"n{n}", inter_gbit, inter_delay_ms)
        applied = bool(inter_delay_ms) and delay_ok and num_nodes > 1
        note = ""
        if inter_delay_ms and not applied:
            note = ("netem qdisc not available in this kernel: inter-node delay not applied (rate shaping only)"
                    if num_nodes > 1 else "one node: no inter-node link to delay")
        c = EmulatedCluster(name, num_nodes, gpus_per_node, inter_gbit, inter_delay_ms, applied, "netns", note,
                            owner_pid, owner_start)
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        atomic_write_json(asdict(c), _state_file(name), indent=None)
        return c
    except BaseException:
        _cluster_down_locked(name)  # never leave half a cluster behind
        raise


def cluster_down(name: str = "moeplace", wait: float = 0.0) -> list[str]:
    """Remove every namespace of cluster ``name`` and its state; returns the namespaces removed. Idempotent.

    Raises :class:`ClusterBusy` when another process still holds the cluster's lock after ``wait`` seconds.
    """
    with cluster_lock(name, wait=wait):
        removed = _cluster_down_locked(name)
        _drop_lock_file(name)
        return removed


def _cluster_down_locked(name: str) -> list[str]:
    removed = []
    for ns in list_namespaces(name):
        _kill_namespace_processes(ns)
        p = _run(["ip", "netns", "del", ns], check=False)
        if p.returncode == 0:
            removed.append(ns)
    left = list_namespaces(name)
    _state_file(name).unlink(missing_ok=True)
    if left:
        raise NetnsError(f"cluster down: could not remove namespaces {left}")
    return removed


def _kill_namespace_processes(ns: str) -> None:
    """Stop processes still running inside ``ns`` (ranks of an interrupted run) so the namespace can go."""
    p = _run(["ip", "netns", "pids", ns], check=False)
    for pid in p.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _is_stale(name: str) -> bool:
    """Whether cluster ``name`` is an orphan: its owner is dead, or a bring-up was killed half-way (namespaces
    without a state file). Call with the cluster's lock held, so nobody is building or running on it."""
    try:
        state = json.loads(_state_file(name).read_text(), object_pairs_hook=unique_keys)
    except FileNotFoundError:
        return bool(list_namespaces(name))
    except (OSError, ValueError):
        return True  # unreadable state: nothing moeplace wrote completely
    if not isinstance(state, dict):
        return True
    pid, start = state.get("owner_pid"), state.get("owner_start")
    if pid is None:
        return False  # brought up by `cluster up`: kept until `cluster down`
    return not isinstance(pid, int) or process_start_time(pid) != start


def remove_stale() -> list[str]:
    """Remove every orphaned cluster and leftover probe namespace; returns the namespaces removed.

    Orphaned: a private cluster whose owner process is gone, or the namespaces of a bring-up killed half-way
    (no state file). Clusters brought up by ``cluster up`` stay until ``cluster down``; clusters whose lock is
    held (being built, in use) are left alone.
    """
    removed: list[str] = []
    names = set()
    if STATE_DIR.is_dir():
        names = {f.stem for f in STATE_DIR.iterdir() if f.suffix in (".lock", ".json")}
    for name in sorted(names):
        try:
            _check_name(name)
            with cluster_lock(name):
                if _is_stale(name):
                    removed += _cluster_down_locked(name)
                _drop_lock_file(name)  # also the lock of a name whose cluster is long gone
        except (ValueError, ClusterBusy):
            continue
    if shutil.which("ip") is not None:
        for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
            ns = line.split()[0] if line.strip() else ""
            pid = ns[len(PROBE_PREFIX):]
            if ns.startswith(PROBE_PREFIX) and pid.isdigit() and process_start_time(int(pid)) is None:
                if _run(["ip", "netns", "del", ns], check=False).returncode == 0:
                    removed.append(ns)
    return removed


def start_watchdog(name: str) -> subprocess.Popen:
    """A helper process, in its own session, that removes cluster ``name`` as soon as this process's end of its
    stdin pipe closes: at :func:`stop_watchdog`, or when this process dies, ``kill -9`` included."""
    return subprocess.Popen([sys.executable, "-m", "moeplace.run.netns", "--remove-on-eof", name],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)


def stop_watchdog(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Close the watchdog's pipe and wait for it to finish its (idempotent) clean-up."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def emulated_cluster(num_nodes: int, gpus_per_node: int, inter_gbit: float | None = None,
                     inter_delay_ms: float | None = None, name: str | None = None,
                     fallback: bool = True) -> Iterator[EmulatedCluster]:
    """A private emulated cluster for the duration of a ``with`` block; removed on exit, error or SIGTERM, and by
    a watchdog process (:func:`start_watchdog`) when this process dies without running its clean-up."""
    name = name or f"mp{os.getpid()}"
    _check_name(name)
    # started before any namespace exists, so a kill during bring-up is covered too; not needed on loopback
    watchdog = start_watchdog(name) if check_support() is None else None
    try:
        c = cluster_up(num_nodes, gpus_per_node, inter_gbit, inter_delay_ms, name=name, fallback=fallback,
                       owner_pid=os.getpid())
        old = signal.getsignal(signal.SIGTERM)

        def _term(signum, frame):  # turn SIGTERM into an exception so the finally below runs
            raise SystemExit(128 + signum)

        try:
            signal.signal(signal.SIGTERM, _term)
        except ValueError:  # not the main thread: keep the current handler
            old = None
        try:
            yield c
        finally:
            if old is not None:
                signal.signal(signal.SIGTERM, old)
            if c.mode == "netns":
                cluster_down(name, wait=30.0)
    finally:
        if watchdog is not None:
            stop_watchdog(watchdog)


def main(argv: list[str] | None = None) -> int:
    """``python -m moeplace.run.netns --remove-on-eof NAME``: the watchdog of :func:`start_watchdog`."""
    ap = argparse.ArgumentParser(prog="python -m moeplace.run.netns", description="internal: cluster watchdog")
    ap.add_argument("--remove-on-eof", required=True, metavar="NAME")
    a = ap.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the owner's Ctrl-C or hang-up is its business; we outlive it
    while sys.stdin.buffer.read(65536):  # blocks until the owner closes its end or dies
        pass
    try:
        cluster_down(a.remove_on_eof, wait=60.0)
    except (OSError, ValueError, NetnsError, ClusterBusy) as e:
        print(f"moeplace cluster watchdog: could not remove {a.remove_on_eof}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
