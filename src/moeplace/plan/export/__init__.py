"""Export a plan's placement to the engines, one module per engine in one registry (:data:`EXPORTERS`).

- :mod:`.sglang`: SGLang's ``--init-expert-location`` JSON, ``[decoder layers][P]`` (dense layers trivial);
- :mod:`.vllm`: vLLM's EPLB mapping over MoE layers, and :func:`.vllm.apply_to_vllm` to install it;
- :mod:`.grouper`: the plan's grouper for a request router (``moeplace route serve``; plans with a grouper only);
- :mod:`.base`: the model's layer layout (:func:`.base.resolve_layers`, :func:`.base.layers_of_trace`).

Each :class:`Exporter` declares its parameters (:class:`moeplace.params.Param`); :func:`export_plan` refuses one
the format does not declare, so ``export --format vllm --trace T`` is an error, not a silently ignored flag.
``moeplace export``, the operate loop and the demo all write through this registry. Adding an engine is one module
and one entry.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moeplace.lazy import lazy_exports
from moeplace.params import Param, bind, check_declared

if TYPE_CHECKING:
    from moeplace.placement import Plan

MAX_DECODER_LAYERS = 10000  # D: bounds the [D, P] SGLang map (DeepSeek-V3 has 61)

# The registry is standard library only (the CLI lists it at start); an engine's module loads when it is used.
__getattr__, __dir__, _LAZY = lazy_exports(__name__, {
    "base": ("layers_of_trace", "resolve_layers"),
    "sglang": ("from_sglang", "to_sglang"),
    "vllm": ("apply_to_vllm", "from_vllm", "to_vllm"),
    "grouper": ("export_grouper", "from_grouper"),
})


@dataclass(frozen=True)
class Exporter:
    """One engine format: ``build(plan, **params)`` is the JSON object written to ``file_name``."""

    name: str
    summary: str  # one line for the CLI
    builder: str  # "module:function" of build(plan, **params) -> dict, loaded on first use
    file_name: str  # what the operate loop and the demo call the file (the demo prefixes the strategy)
    params: tuple[Param, ...] = ()
    in_all: bool = True  # written by export_all (False: only asked for, e.g. what only some plans have)

    @property
    def build(self) -> Callable[..., dict]:
        module, name = self.builder.split(":")
        return getattr(importlib.import_module(module), name)


_ALL = (
    Exporter("sglang", "SGLang --init-expert-location: physical_to_logical_map [decoder layers][P]",
             f"{__name__}.sglang:export_sglang",
             "sglang.json",
             (Param("moe_layer_map", list, None, "the decoder layer id of each MoE layer (from a trace; default: "
                    "the layout the plan records)"),
              Param("num_decoder_layers", int, None, "decoder layers of the model, dense ones included (default: "
                    "the plan's or the trace's record)", 1, MAX_DECODER_LAYERS))),
    Exporter("vllm", "vLLM EPLB state: physical_to_logical_map [MoE layers][P] and its shape facts",
             f"{__name__}.vllm:export_vllm",
             "vllm.json"),
    Exporter("grouper", "the plan's grouper for a request router (moeplace route serve): scorer rows, layers, "
             "deployment shape, round size; plans with a grouper only",
             f"{__name__}.grouper:export_grouper",
             "grouper.json",
             (Param("moe_layer_map", list, None, "the model layer of each MoE layer (from a trace; default: the "
                    "layout the plan records, else none)"),
              Param("num_decoder_layers", int, None, "decoder layers of the model, dense ones included", 1,
                    MAX_DECODER_LAYERS)),
             in_all=False),
)
EXPORTERS: dict[str, Exporter] = {e.name: e for e in _ALL}


def _check_registry() -> None:
    assert len(EXPORTERS) == len(_ALL), "duplicate exporter name"
    assert len({e.file_name for e in _ALL}) == len(_ALL), "two exporters write one file name"
    for e in _ALL:
        check_declared(e.params, f"export format {e.name!r}")


_check_registry()


def get_exporter(fmt: str) -> Exporter:
    """The exporter ``fmt``; ValueError listing the known formats otherwise."""
    try:
        return EXPORTERS[fmt]
    except KeyError:
        raise ValueError(f"export format {fmt!r}: expected one of {', '.join(EXPORTERS)}") from None


def export_plan(plan: Plan, fmt: str, out: str | Path, **params: object) -> Path:
    """Write ``plan`` in engine format ``fmt`` (a key of :data:`EXPORTERS`) to ``out``, atomically. ``params``: the
    format's declared parameters (a None value counts as not given); ValueError naming one it does not declare,
    or when the export cannot be made (sglang: the row count is not known)."""
    from moeplace.io import atomic_write_json

    ex = get_exporter(fmt)
    given = {k: v for k, v in params.items() if v is not None}
    return atomic_write_json(ex.build(plan, **bind(ex.params, given, f"export format {fmt!r}")), out, indent=None)


def export_file_names(prefix: str = "") -> tuple[str, ...]:
    """The file names :func:`export_all` writes with ``prefix``."""
    return tuple(f"{prefix}{ex.file_name}" for ex in _ALL if ex.in_all)


def export_all(plan: Plan, folder: str | Path, prefix: str = "", known: Mapping[str, object] | None = None
               ) -> list[Path]:
    """Write ``plan`` in every registered format with ``in_all`` into ``folder`` as ``prefix + file_name``.
    ``known``: facts about the model (e.g. a trace's ``moe_layer_map``); each format gets those it declares and no
    others."""
    known = dict(known or {})
    out = []
    for ex in (e for e in _ALL if e.in_all):
        names = {p.name for p in ex.params}
        out.append(export_plan(plan, ex.name, Path(folder) / f"{prefix}{ex.file_name}",
                               **{k: v for k, v in known.items() if k in names}))
    return out


__all__ = sorted(["EXPORTERS", "MAX_DECODER_LAYERS", "Exporter", "export_all", "export_file_names", "export_plan",
                  "get_exporter", *_LAZY])
