"""The ``moeplace`` command line: a thin layer over the library.

Each stage has its own command module exposing ``register(subparsers)``; :data:`COMMAND_MODULES` lists them in
pipeline order, so ``moeplace --help`` shows exactly what exists.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "moeplace.cli.demo_cmd",
    "moeplace.cli.train_cmd",
    "moeplace.cli.trace_cmd",
    "moeplace.cli.synth_cmd",
    "moeplace.cli.simulate_cmd",
    "moeplace.cli.analyze_cmd",
    "moeplace.cli.plan_cmd",
    "moeplace.cli.run_cmd",
)

EPILOG = """examples:
  moeplace demo                                   # the main job on the bundled default trace
  moeplace trace info TRACE --json                # what a trace holds
  moeplace trace import --format gpt-oss-npz ../shared/data/gpt-oss-20b out.trace
"""


class CliError(Exception):
    """A user error found by the CLI itself (bad flag combination); printed without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        print("moeplace: interrupted", file=sys.stderr)
        return 130
    except (CliError, ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        # ValueError covers TraceError and every library validation error: they name the bad value.
        print(f"moeplace {args.command}: error: {e}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
