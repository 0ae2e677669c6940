"""``moeplace trace import``: filled in by the importers work (see moeplace.trace.importers)."""

import argparse


def register(tsub: argparse._SubParsersAction) -> None:
    """Add the ``import`` subcommand to ``moeplace trace``."""
