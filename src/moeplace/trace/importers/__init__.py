"""Importers: real routing recorded by engines and third parties -> moeplace traces.

One module per engine format (:mod:`~moeplace.trace.importers.gpt_oss`, :mod:`~moeplace.trace.importers.olmoe`,
:mod:`~moeplace.trace.importers.vllm`, :mod:`~moeplace.trace.importers.sglang`; shared checks in
:mod:`~moeplace.trace.importers.common`). Each importer is a function ``import_<format>(src, out, *,
overwrite=False, ...) -> Path`` that validates its input, writes a trace with :class:`moeplace.trace.TraceWriter`
and returns ``out``. :data:`IMPORTERS` is the one registry, keyed by the names ``moeplace trace import --format``
accepts; :func:`import_trace` dispatches on it. Bad input raises :class:`moeplace.trace.TraceError` naming the file
and the problem. Exact layouts: docs/IMPORTERS.md.

This module is standard library only, so ``moeplace trace import --help`` lists the formats without importing
numpy; an importer's module loads when its format is used (:attr:`Importer.func`). Adding a format is one module
with its importer function and one entry in :data:`IMPORTERS`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moeplace.lazy import lazy_exports


@dataclass(frozen=True)
class Importer:
    """One entry of :data:`IMPORTERS`."""

    name: str  # the --format value
    summary: str  # one line for ``moeplace trace import --help``
    importer: str  # "module:function" of the importer, loaded on first use
    counts_only: bool  # True: the trace holds aggregate counts, not per-token routing
    options: tuple[str, ...] = ()  # keyword options the importer accepts besides overwrite
    not_imported: str = ""  # token content of the format that is never read into the trace (token ids, text);
    # "" when the format holds none. The CLI prints it, the trace records it in extra["not_imported"]
    # (docs/PRIVACY.md)

    @property
    def func(self) -> Callable[..., Path]:
        module, name = self.importer.split(":")
        return getattr(importlib.import_module(module), name)


_HERE = __name__

IMPORTERS: dict[str, Importer] = {
    f.name: f
    for f in (
        Importer("gpt-oss-npz", "gpt-oss-20b decode routing: DIR with decode_routing.npz + decode_routing_meta.jsonl",
                 f"{_HERE}.gpt_oss:import_gpt_oss_npz", False, ("limit", "weights"),
                 "original_prompt and generated_tokens (prompt and output text), source_file and row_index of "
                 "decode_routing_meta.jsonl; channel of decode_routing.npz"),
        Importer("gpt-oss-summaries", "gpt-oss-20b per-group expert frequencies: DIR with domain_summaries.npz + "
                 "domain_summaries_meta.json (counts-only)", f"{_HERE}.gpt_oss:import_gpt_oss_summaries", True),
        Importer("olmoe-npz", "OLMoE/Mixtral per-domain expert counts: olmoe-mixtral/<model>.npz (counts-only)",
                 f"{_HERE}.olmoe:import_olmoe_npz", True, (),
                 "eid2token__<domain> (the tokens each expert selects), expert_counts_top1__* and "
                 "expert_counts_crosslayer*"),
        Importer("vllm-routed", "vLLM routed_experts per request (0.32+; 0.21's prompt_routed_experts too): .jsonl "
                 "or .npz", f"{_HERE}.vllm:import_vllm_routed", False,
                 ("model", "num_experts", "hidden_size", "num_shared_experts"),
                 "prompt_token_ids and output_token_ids (token ids: only their lengths are kept) and every other "
                 "key (prompt or output text)"),
        Importer("sglang-per-token", "SGLang expert distribution recorder, per_token mode: "
                 "expert_distribution_recorder_*.pt", f"{_HERE}.sglang:import_sglang_per_token", False,
                 ("model", "num_experts", "hidden_size", "num_shared_experts"),
                 "input_ids (the token ids of every forward pass), misc_objects and global_physical_count"),
        Importer("sglang-stat", "SGLang expert distribution recorder, stat mode: expert_distribution_recorder_*.pt "
                 "(counts-only)", f"{_HERE}.sglang:import_sglang_stat", True,
                 ("model", "top_k", "hidden_size", "num_shared_experts")),
    )
}


NOTHING_NOT_IMPORTED = "nothing: the format holds no token ids or text"


def not_imported(fmt: str) -> str:
    """What the importer of ``fmt`` leaves out of the trace that could reveal text (token ids, prompts, outputs):
    :attr:`Importer.not_imported`, or :data:`NOTHING_NOT_IMPORTED` when the format holds none (docs/PRIVACY.md)."""
    return IMPORTERS[fmt].not_imported or NOTHING_NOT_IMPORTED


def import_trace(fmt: str, src: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False,
                 **options) -> Path:
    """Import ``src`` in format ``fmt`` (a key of :data:`IMPORTERS`) into the trace directory ``out``.

    ``options`` not accepted by that format raise TraceError (None values are ignored).
    """
    from moeplace.trace.types import TraceError

    if fmt not in IMPORTERS:
        raise TraceError(f"unknown import format {fmt!r}; known formats: {', '.join(IMPORTERS)}")
    f = IMPORTERS[fmt]
    given = {k: v for k, v in options.items() if v is not None}
    bad = sorted(set(given) - set(f.options))
    if bad:
        flags = ", ".join("--" + b.replace("_", "-") for b in bad)
        raise TraceError(f"format {fmt!r} does not take {flags}")
    return f.func(src, out, overwrite=overwrite, **given)


__getattr__, __dir__, _LAZY = lazy_exports(__name__, {
    "common": ("DOMAINS", "KnownModel"),
    "gpt_oss": ("GPT_OSS_20B", "gpt_oss_domain", "import_gpt_oss_npz", "import_gpt_oss_summaries"),
    "olmoe": ("OLMOE_DOMAINS", "OLMOE_MODELS", "OLMOE_STORED_LAYERS", "import_olmoe_npz"),
    "vllm": ("import_vllm_routed",),
    "sglang": ("import_sglang_per_token", "import_sglang_stat"),
})
__all__ = sorted([*_LAZY, "IMPORTERS", "NOTHING_NOT_IMPORTED", "Importer", "import_trace", "not_imported"])
