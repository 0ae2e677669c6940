"""Run many ``moeplace`` command lines fast: import the CLI once, then fork one child per command.

Protocol: one JSON object a line on stdin, ``{"argv": [...], "stdout": PATH, "stderr": PATH, "timeout": s,
"as_cap": bytes}`` (optional ``"env"``: variables to set, ``"unset"``: names to remove, ``"cwd"``: folder to run
in); one JSON line back, ``{"rc": int}``. Each child sets its address-space cap and an alarm, points
fds 1 and 2 at the given files and runs ``moeplace.cli.main(argv)`` exactly as ``python -m moeplace`` does: an
exception that escapes main is printed as a traceback and gives exit 1; the alarm kills the child (rc -14).
Used by test_fault_traces.py, where starting a fresh interpreter (torch import included) for each of a hundred
runs would take minutes.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import traceback


def _child(req: dict) -> int:
    os.environ.update(req.get("env") or {})
    for k in req.get("unset") or ():
        os.environ.pop(k, None)
    if req.get("cwd"):
        os.chdir(req["cwd"])
    resource.setrlimit(resource.RLIMIT_AS, (req["as_cap"], req["as_cap"]))
    signal.alarm(int(req["timeout"]))
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    from moeplace.cli import main

    try:
        rc = main(req["argv"])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        rc = 1
    return int(rc or 0)


# Library modules the commands import when they run, imported once here so that each child does not pay for them
# again (numba, pyarrow and the kernels' modules: about 0.9 s of each ``analyze``). torch is left out: the commands
# that need it import it in the child, as a fresh interpreter does.
PRELOAD = ("pyarrow.compute", "moeplace.trace.reader", "moeplace.trace.writer", "moeplace.analyse.summary",
           "moeplace.simulate.simulator", "moeplace.plan.registry", "moeplace.plan.joint", "moeplace.evaluate.compare",
           "moeplace.operate.service", "moeplace.analyse.report")


def serve() -> None:
    import importlib

    from moeplace.cli import build_parser

    build_parser()  # import every command module before forking
    for name in PRELOAD:
        importlib.import_module(name)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                rc = _child(req)
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(rc)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
