"""Lazy package namespaces (PEP 562), so that importing one light module of a package does not pay for the rest.

A package lists its public names by the submodule that defines each; a name is imported on first use. Then
``import moeplace.simulate.config`` (what the CLI reads to build its options) runs ``moeplace/simulate/__init__.py``
without importing numpy, numba or pyarrow, while ``from moeplace.simulate import simulate`` still works.

A lazy name must not equal a submodule's name: importing the submodule would bind that name on the package first.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, tuple[str, ...]]
                 ) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """(``__getattr__``, ``__dir__``, ``__all__``) for ``package``; ``exports`` maps a submodule (relative to the
    package) to the names it defines that the package re-exports."""
    where = {name: mod for mod, names in exports.items() for name in names}
    clash = sorted(n for n in where if n in exports)
    assert not clash, f"{package}: lazy names equal submodule names: {clash}"

    def __getattr__(name: str) -> object:
        mod = where.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{mod}"), name)
        setattr(sys.modules[package], name, value)  # later look-ups are plain attribute reads
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__, sorted(where)
