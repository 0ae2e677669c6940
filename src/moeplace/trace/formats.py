"""The registry of import formats: name, one line of help, what each accepts. Standard library only, so
``moeplace trace import --help`` lists the formats without importing numpy; an importer's module loads when the
format is used (:attr:`ImportFormat.func`). Adding a format is one importer function and one entry here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

IMPORTERS = "moeplace.trace.importers"


@dataclass(frozen=True)
class ImportFormat:
    """One entry of :data:`FORMATS`."""

    name: str
    importer: str  # "module:function" of the importer, loaded on first use
    help: str  # one line for ``moeplace trace import --help``
    counts_only: bool  # True: the trace holds aggregate counts, not per-token routing
    options: tuple[str, ...] = ()  # keyword options the importer accepts besides overwrite

    @property
    def func(self) -> Callable[..., Path]:
        module, name = self.importer.split(":")
        return getattr(importlib.import_module(module), name)


FORMATS: dict[str, ImportFormat] = {
    f.name: f
    for f in (
        ImportFormat("gpt-oss-npz", f"{IMPORTERS}:import_gpt_oss_npz", "gpt-oss-20b decode routing: DIR with "
                     "decode_routing.npz + decode_routing_meta.jsonl", False, ("limit", "weights")),
        ImportFormat("gpt-oss-summaries", f"{IMPORTERS}:import_gpt_oss_summaries", "gpt-oss-20b per-group expert "
                     "frequencies: DIR with domain_summaries.npz + domain_summaries_meta.json (counts-only)", True),
        ImportFormat("olmoe-npz", f"{IMPORTERS}:import_olmoe_npz", "OLMoE/Mixtral per-domain expert counts: "
                     "olmoe-mixtral/<model>.npz (counts-only)", True),
        ImportFormat("vllm-routed", f"{IMPORTERS}:import_vllm_routed", "vLLM routed_experts per request (0.32+; "
                     "0.21's prompt_routed_experts too): .jsonl or .npz", False,
                     ("model", "num_experts", "hidden_size", "num_shared_experts")),
        ImportFormat("sglang-per-token", f"{IMPORTERS}:import_sglang_per_token", "SGLang expert distribution "
                     "recorder, per_token mode: expert_distribution_recorder_*.pt", False,
                     ("model", "num_experts", "hidden_size", "num_shared_experts")),
        ImportFormat("sglang-stat", f"{IMPORTERS}:import_sglang_stat", "SGLang expert distribution recorder, stat "
                     "mode: expert_distribution_recorder_*.pt (counts-only)", True,
                     ("model", "top_k", "hidden_size", "num_shared_experts")),
    )
}
