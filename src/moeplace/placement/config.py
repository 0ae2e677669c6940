"""Defaults of the plan types that light modules read without numpy (the CLI lists strategy parameters at start)."""

DEFAULT_ROUND = 64  # requests admitted per scheduling round (the grouper's, :mod:`moeplace.placement.grouper`)
