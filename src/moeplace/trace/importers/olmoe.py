"""OLMoE / Mixtral per-domain expert counts from the OLMoE repository (``olmoe-npz``, counts-only). Layout:
docs/IMPORTERS.md.

Shape legend: T = tokens, L = MoE layers, K = top-k, E = logical experts, P = physical slots, G = count groups.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from moeplace.trace.importers.common import KnownModel, load_npz, npz_array, open_writer, prepare_out
from moeplace.trace.types import PREFILL, TraceError, TraceMeta

# OLMoE routing-analysis corpora -> moeplace domains.
OLMOE_DOMAINS = {"github": "code", "tulu": "chat", "arxiv": "general", "book": "general", "c4": "general",
                 "wikipedia": "general"}
OLMOE_MODELS = {  # <model>.npz stem in olmoe-mixtral/ -> preset
    "olmoe": KnownModel("allenai/OLMoE-1B-7B-0924", 16, 64, 8, 2048),
    "olmoe-sft": KnownModel("allenai/OLMoE-1B-7B-0924-SFT", 16, 64, 8, 2048),
    "olmoe-dpo": KnownModel("allenai/OLMoE-1B-7B-0924-Instruct", 16, 64, 8, 2048),
    "mistral": KnownModel("mistralai/Mixtral-8x7B-v0.1", 32, 8, 2, 4096),
}
OLMOE_STORED_LAYERS = [0, 7, 15]  # model layers kept in the OLMoE repository's routing_output arrays
_OLMOE_PROVENANCE = {
    "upstream": "https://github.com/allenai/OLMoE (scripts/routing_output/)",
    "upstream_commit": "357454f",
    "license": "Apache-2.0",
    "recording": "teacher-forced pass over 2048-token chunks (equivalent to prefill), ~209k tokens per domain",
}


def import_olmoe_npz(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
) -> Path:
    """Import OLMoE / Mixtral per-domain expert counts (``olmoe-mixtral/<model>.npz``) as a counts-only trace.

    The model comes from the file name (olmoe, olmoe-sft, olmoe-dpo, mistral). Each ``expert_counts__<domain>``
    [3, E] (tokens per expert over all top-k slots at model layers 0, 7, 15) becomes one prefill group named
    ``<model>/<domain>``; L = 3 with ``moe_layer_map = [0, 7, 15]``; num_tokens = counts of a layer / K.
    """
    path = Path(src)
    if path.is_dir():
        found = ", ".join(sorted(f.name for f in path.glob("*.npz"))) or "none"
        raise TraceError(f"{path}: is a directory; pass one <model>.npz file (found: {found})")
    stem = path.name[:-4] if path.name.endswith(".npz") else path.name
    if stem not in OLMOE_MODELS:
        raise TraceError(f"{path}: unknown model {stem!r}; expected a file named one of "
                         f"{', '.join(f'{m}.npz' for m in OLMOE_MODELS)}")
    p = OLMOE_MODELS[stem]
    z = load_npz(path)
    prefix = "expert_counts__"
    keys = sorted(k for k in z.files if k.startswith(prefix))
    if not keys:
        raise TraceError(f"{path}: no expert_counts__<domain> arrays (found: {', '.join(sorted(z.files)) or 'none'})")
    L = len(OLMOE_STORED_LAYERS)
    names, doms, ntok, counts = [], [], [], []
    for k in keys:
        c = npz_array(z, path, k)
        if c.shape != (L, p.num_experts):
            raise TraceError(f"{path}: {k} must have shape [{L}, {p.num_experts}] (layers {OLMOE_STORED_LAYERS} x "
                             f"experts of {p.model}), got {list(c.shape)}")
        c = c.astype(np.float64)
        if np.any(c < 0) or not np.isfinite(c).all():
            raise TraceError(f"{path}: {k} holds negative or non-finite counts")
        per_layer = c.sum(axis=1) / p.top_k
        domain = k[len(prefix):]
        names.append(f"{stem}/{domain}")
        doms.append(OLMOE_DOMAINS.get(domain, "unknown"))
        ntok.append(float(per_layer.max()))
        counts.append(c)
    meta = TraceMeta(
        model=p.model, num_layers=L, num_experts=p.num_experts, top_k=p.top_k,
        num_shared_experts=p.num_shared_experts, hidden_size=p.hidden_size,
        moe_layer_map=list(OLMOE_STORED_LAYERS), kind="counts",
        source=f"olmoe-npz:{path}",
        extra={**_OLMOE_PROVENANCE, "importer": "olmoe-npz", "model_num_layers": p.num_layers,
               "domain_mapping": dict(OLMOE_DOMAINS)},
    )
    out_p = prepare_out(out, path)
    with open_writer(out_p, meta, overwrite, [path]) as w:
        w.add_counts(names, doms, np.full(len(names), PREFILL, np.int8), np.asarray(ntok), np.stack(counts))
    return out_p
