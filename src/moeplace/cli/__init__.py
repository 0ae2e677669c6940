"""The ``moeplace`` command line: a thin layer over the library.

Each stage has its own command module exposing ``register(subparsers)``; :data:`COMMAND_MODULES` lists them in
pipeline order, so ``moeplace --help`` shows exactly what exists.

User errors end with exit status 2 and one line on stderr that names the file or option and the problem, never a
traceback: options are checked when they are parsed (the ``type=`` functions below), paths before any work
starts (outputs against inputs and against files moeplace did not write: :func:`check_paths`), and
:func:`main` turns the library's errors (ValueError and its subclasses, OSError, RecursionError,
MemoryError) into that line. A closed stdout (``moeplace ... | head``) ends quietly.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import math
import os
import re
import stat
import sys
from collections.abc import Callable
from pathlib import Path

COMMAND_MODULES = (
    "moeplace.cli.demo_cmd",
    "moeplace.cli.train_cmd",
    "moeplace.cli.trace_cmd",
    "moeplace.cli.synth_cmd",
    "moeplace.cli.simulate_cmd",
    "moeplace.cli.predict_cmd",
    "moeplace.cli.analyze_cmd",
    "moeplace.cli.profiles_cmd",
    "moeplace.cli.plan_cmd",
    "moeplace.cli.route_cmd",
    "moeplace.cli.run_cmd",
    "moeplace.cli.operate_cmd",
)

EPILOG = """examples:
  moeplace demo                                   # the main job on the bundled default trace
  moeplace trace info TRACE --json                # what a trace holds
  moeplace trace import --format gpt-oss-npz ../shared/data/gpt-oss-20b out.trace
"""


class CliError(Exception):
    """A user error found by the CLI itself (bad flag combination); printed without a traceback."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``moeplace plan: error: argument --redundant: ... (see --help)``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


# ------------------------------------------------------------------------------------------ option types
# Each returns a ``type=`` function for argparse; the bounds keep what an option allocates sane.

MAX_REDUNDANT = 1 << 20  # checked again against the trace's E and the cluster (at most E * (W - 1))
MAX_TOKENS = 1 << 24  # chunk, window and batch sizes in tokens
from moeplace.io import NAME_MAX, TEMP_SUFFIX_BYTES  # noqa: E402  (the one output-path check's limits; stdlib only)


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An integer in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            if not text.isascii():  # int() reads full-width and other Unicode digits: a number is ASCII here
                raise ValueError(text)
            v = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer in [{lo}, {hi}], got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer in [{lo}, {hi}], got {v}")
        return v

    parse.__name__ = "integer"
    parse.bounds = (lo, hi)  # for listings and the fault suite's options-at-their-bounds walk
    return parse


def float_in(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> Callable[[str], float]:
    """A finite number in the interval from lo to hi (each end open or closed)."""
    span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def parse(text: str) -> float:
        try:
            if not text.isascii():  # float() reads full-width and other Unicode digits: a number is ASCII here
                raise ValueError(text)
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number in {span}, got {text!r}") from None
        ok = math.isfinite(v) and (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)
        if not ok:
            raise argparse.ArgumentTypeError(f"expected a finite number in {span}, got {text}")
        return v

    parse.__name__ = "number"
    parse.bounds = (lo, hi)
    return parse


def param_type(p) -> Callable[[str], object]:
    """The ``type=`` function of a declared parameter (:class:`moeplace.params.Param`): its type and range."""
    if p.type is int:
        return int_in(int(p.lo) if p.lo is not None else -(1 << 62), int(p.hi) if p.hi is not None else 1 << 62)
    if p.type is float:
        return float_in(-math.inf if p.lo is None else p.lo, math.inf if p.hi is None else p.hi, lo_open=p.lo_open)
    return p.type


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    return float_in(0.0, 1.0, lo_open=True)(text)


def fraction_list(text: str) -> list[float]:
    """Comma-separated numbers in (0, 1]."""
    return [fraction(x) for x in text.split(",")]


def cluster_spec(text: str) -> str:
    """NODESxGPUS (checked; returned as given)."""
    from moeplace.placement import Cluster

    try:
        Cluster.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def device_spec(text: str) -> str:
    """A torch device name: cpu, cuda, cuda:N, mps, xpu:N (whether it exists is checked when it is used)."""
    if not re.fullmatch(r"(cpu|cuda|mps|xpu)(:\d{1,4})?", text):
        raise argparse.ArgumentTypeError(f"expected a device such as cpu, cuda or cuda:0, got {text!r}")
    return text


def output_file(text: str) -> str:
    """A file to write: not a directory, FIFO or device; a name short enough for its temporary file; its
    folder a directory (created if missing); not an existing file moeplace did not write (or a read-only one).
    Returned as given."""
    from moeplace.io import output_path_problem, replace_problem

    problem = output_path_problem(text) or replace_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{short(text)}: {problem}")
    return text


def short(text: str, keep: int = 80) -> str:
    """A path for a message: long ones cut in the middle."""
    return text if len(text) <= keep else f"{text[:keep // 2]}...{text[-keep // 2:]}"


def output_dir(text: str) -> str:
    """A folder to write into: not an empty name (which would be the current folder), not an existing file, in
    a place this process may write."""
    from moeplace.io import folder_replace_problem

    problem = folder_replace_problem(text, ())
    if problem:
        raise argparse.ArgumentTypeError(problem)
    p = Path(text)
    if p.exists() and not p.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: exists and is not a directory")
    if any(len(os.fsencode(part)) > NAME_MAX - TEMP_SUFFIX_BYTES for part in p.parts):
        raise argparse.ArgumentTypeError(f"{text}: a path component is longer than "
                                         f"{NAME_MAX - TEMP_SUFFIX_BYTES} bytes")
    return text


def input_file(text: str) -> str:
    """An existing regular file to read (not a directory, FIFO or device). Returned as given."""
    try:
        st = os.stat(text)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{short(text)}: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise argparse.ArgumentTypeError(f"{text}: is a directory, expected a file")
    if not stat.S_ISREG(st.st_mode):
        raise argparse.ArgumentTypeError(f"{text}: not a regular file (a FIFO, device or socket)")
    return text


def one_line(text: str) -> str:
    """``text`` on one line (multi-line library messages joined with '; ')."""
    return "; ".join(s.strip() for s in str(text).splitlines() if s.strip())


def describe_os_error(e: OSError) -> str:
    """'PATH: problem' for an OSError (ENAMETOOLONG shows the length instead of the whole name)."""
    name = e.filename
    if name is not None and e.errno == errno.ENAMETOOLONG:
        name = f"{os.fsdecode(name)[:60]}... ({len(os.fsencode(name))} bytes)"
    if name is not None:
        return f"{os.fsdecode(name)}: {e.strerror or e}"
    return str(e)


# Arguments read as inputs by the commands that have them (a trace, a plan, a load or schedule file, prompts, a
# model folder), by destination; every argument parsed with input_file counts too. Outputs are the arguments parsed
# with output_file or output_dir; a command whose output folder holds a fixed set of files declares them with
# ``set_defaults(folder_files={dest: names})`` (a tuple, or a function returning one, so the parser stays light;
# names ending in "/" are subfolders).
INPUT_DESTS = ("trace", "stream", "src", "plan", "load", "schedule", "prompts", "model")


def _declare_paths(parser: argparse.ArgumentParser) -> None:
    """``set_defaults(io_paths=...)`` on every (sub)command: (dest, label, kind) of its path arguments, kind
    "in", "file" or "dir" (see :func:`check_paths`)."""
    paths = []
    for a in parser._actions:  # argparse offers no public walk of a parser's actions
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                _declare_paths(sub)
            continue
        label = a.option_strings[0] if a.option_strings else a.dest.upper()
        if a.type is output_file:
            paths.append((a.dest, label, "file"))
        elif a.type is output_dir:
            paths.append((a.dest, label, "dir"))
        elif a.type is input_file or a.dest in INPUT_DESTS:
            paths.append((a.dest, label, "in"))
    parser.set_defaults(io_paths=tuple(paths))


def check_paths(args: argparse.Namespace) -> None:
    """Before any work: CliError (one line) for an output that is, lies inside or contains one of the command's
    inputs, or that another output shares (:func:`moeplace.io.input_output_clash`), and for a declared output
    folder whose files moeplace would write over a file it did not write (:func:`moeplace.io.
    folder_replace_problem`)."""
    from moeplace.io import folder_replace_problem, input_output_clash

    folder_files = getattr(args, "folder_files", None) or {}
    ins, outs = [], []
    for dest, label, kind in getattr(args, "io_paths", ()):
        v = getattr(args, dest, None)
        values = [x for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, str) and x]
        if kind == "in":
            ins += [(label, x) for x in values]
        elif dest in folder_files:  # a folder of known files: the files are the outputs, not the folder
            names = folder_files[dest]() if callable(folder_files[dest]) else folder_files[dest]
            outs += [(label, os.path.join(x, n.rstrip("/"))) for x in values for n in names]
            for x in values:
                problem = folder_replace_problem(x, names)
                if problem:
                    raise CliError(f"{label} {short(x)}: {problem}")
        else:
            outs += [(label, x) for x in values]
    problem = input_output_clash(outs, ins)
    if problem:
        raise CliError(problem)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="moeplace",
        description="Trace, analyse and plan expert placement and request grouping for multi-node MoE inference.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from moeplace import __version__

    parser.add_argument("--version", action="version", version=f"moeplace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    _declare_paths(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status (2 for a user error, reported on one stderr line)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a bad option (already reported on one line)
        return e.code if isinstance(e.code, int) else 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    where = f"moeplace {args.command}"
    from moeplace.budget import fix_allocators

    fix_allocators()  # streaming commands' RSS stays flat with the trace's length (docs/SCALE.md)
    try:
        check_paths(args)  # outputs never over inputs nor over a user's files, before any work
        check = getattr(args, "check", None)
        if check is not None:
            check(args)  # option combinations, before any work starts
        rc = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly. Python's recipe: point stdout at devnull so the final
        # flush at exit does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by a closed pipe
    except (CliError, ValueError) as e:
        # ValueError covers TraceError, SchemaError and every library validation error: they name the bad value.
        print(f"{where}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:  # missing, unreadable or unwritable files, directories where files belong, long names
        print(f"{where}: error: {one_line(describe_os_error(e))}", file=sys.stderr)
        return 2
    except RecursionError:
        print(f"{where}: error: an input is nested too deeply to read", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"{where}: error: out of memory: an input or option asks for more memory than is available",
              file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
