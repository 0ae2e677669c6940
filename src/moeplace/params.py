"""Declared parameters of an extension point (a policy, an exporter, ...): name, type, range, default, help.

A registry entry lists its :class:`Param` s; :func:`bind` turns the keywords a caller gave into the full set
(defaults filled, values checked) and refuses a keyword the entry does not declare, so nothing is swallowed. The
CLI builds its flags from the same declarations (``Param.flag``), so a flag and its parameter cannot drift.
Standard library only: the CLI reads these declarations before any heavy import.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Param:
    """One declared parameter. Numbers lie in ``[lo, hi]`` (``lo_open``: ``(lo, hi]``); None: unbounded."""

    name: str  # keyword name; the CLI flag is --name-with-dashes
    type: type  # int, float, str or list
    default: object  # None: unset unless given (the entry decides what that means, said in its help)
    help: str  # one line, without the default (added by :meth:`describe`)
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    choices: tuple = ()  # the allowed values (a str parameter); () = any

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def range_text(self) -> str:
        if self.lo is None and self.hi is None:
            return ""
        def num(x: float) -> str:
            return str(int(x)) if self.type is int else f"{x:g}"

        lo = "-inf" if self.lo is None else num(self.lo)
        hi = "inf" if self.hi is None else num(self.hi)
        return f"{'(' if self.lo_open else '['}{lo}, {hi}]"

    def describe(self) -> str:
        """'help (int in [1, 1e+12], default 1000)'."""
        kind = "|".join(map(str, self.choices)) if self.choices else self.type.__name__
        rng = self.range_text()
        default = "" if self.default is None else f", default {self.default}"
        return f"{self.help} ({kind}{' in ' + rng if rng else ''}{default})"

    def check(self, value: object, owner: str) -> object:
        """``value`` as this parameter's type; ValueError naming the parameter and ``owner`` otherwise."""
        where = f"{owner}: parameter {self.name!r}"
        if value is None and self.default is None:  # an optional parameter left unset
            return None
        if self.type is int:
            if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
                raise ValueError(f"{where}: expected an integer, got {value!r}")
            v: object = int(value)
        elif self.type is float:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{where}: expected a finite number, got {value!r}")
            v = float(value)
        elif self.type is list and isinstance(value, tuple):
            v = list(value)
        else:
            if not isinstance(value, self.type):
                raise ValueError(f"{where}: expected {self.type.__name__}, got {value!r}")
            v = value
        if self.choices and v not in self.choices:
            raise ValueError(f"{where}: expected one of {', '.join(map(str, self.choices))}, got {value!r}")
        if isinstance(v, int | float):
            low_bad = self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo)
            if low_bad or (self.hi is not None and v > self.hi):
                raise ValueError(f"{where}: expected a value in {self.range_text()}, got {value!r}")
        return v


def bind(params: Iterable[Param], given: Mapping[str, object], owner: str) -> dict[str, object]:
    """Every declared parameter's value: ``given`` checked, the rest defaulted. ValueError naming ``owner`` and the
    first keyword it does not declare (with what it does take)."""
    declared = {p.name: p for p in params}
    for k in given:
        if k not in declared:
            takes = ", ".join(declared) if declared else "none"
            raise ValueError(f"{owner} has no parameter {k!r} (it takes: {takes})")
    return {k: p.check(given[k], owner) if k in given else p.default for k, p in declared.items()}


def check_declared(params: Iterable[Param], owner: str) -> None:
    """Registry check (at import): unique names, and each default passes its own check."""
    seen: set[str] = set()
    for p in params:
        assert p.name.isidentifier() and p.name not in seen, f"{owner}: bad or duplicate parameter {p.name!r}"
        seen.add(p.name)
        assert p.help, f"{owner}: parameter {p.name!r} has no help"
        p.check(p.default, owner)
