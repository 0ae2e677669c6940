"""``moeplace trace record``: filled in by the capture work (see moeplace.trace.capture)."""

import argparse


def register(tsub: argparse._SubParsersAction) -> None:
    """Add the ``record`` subcommand to ``moeplace trace``."""
