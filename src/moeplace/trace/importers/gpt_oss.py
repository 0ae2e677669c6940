"""gpt-oss-20b routing published by its authors: decode routing per token (``gpt-oss-npz``) and per-group expert
frequencies (``gpt-oss-summaries``, counts-only). Layouts: docs/IMPORTERS.md.

Shape legend: T = tokens, L = MoE layers, K = top-k, E = logical experts, P = physical slots, G = count groups.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moeplace.trace.importers.common import (
    KnownModel,
    as_int,
    as_int_array,
    check_ids,
    existing,
    json_loads,
    load_npz,
    npz_array,
    open_writer,
    prepare_out,
    regular_input,
)
from moeplace.trace.types import DECODE, TraceError, TraceMeta

# Quantitative STEM categories of MMLU / MMLU-Pro count as "math" (matched as substrings of the category).
_MATH_WORDS = ("math", "algebra", "statistic", "physics", "chemistry", "econometrics", "engineering")


def gpt_oss_domain(dataset: str, category: str) -> str:
    """moeplace domain of a gpt-oss-20b generation from its upstream ``dataset`` and ``category``.

    - ``tulu3_persona_if*``, ``sorry_bench*`` -> ``chat`` (instruction following, assistant refusals)
    - ``gpqa_*`` -> ``math`` (graduate physics / chemistry / biology reasoning)
    - ``mmlu*`` whose category names quantitative STEM (math, algebra, statistics, physics, chemistry,
      econometrics, engineering) -> ``math``
    - everything else (other MMLU subjects, Polyglot-or-Not fact completion) -> ``general``

    The data has no code domain. The original dataset and category stay in the request ``source`` column.
    """
    ds, cat = dataset.lower(), category.lower()
    if ds.startswith(("tulu3_persona_if", "sorry_bench")):
        return "chat"
    if ds.startswith("gpqa"):
        return "math"
    if ds.startswith("mmlu") and any(w in cat for w in _MATH_WORDS):
        return "math"
    return "general"


GPT_OSS_20B = KnownModel("openai/gpt-oss-20b", 24, 32, 4, 2880)
_GPT_OSS_PROVENANCE = {
    "upstream": "https://github.com/AmanPriyanshu/GPT-OSS-MoE-ExpertFingerprinting",
    "upstream_commit": "72b368f",
    "license": "Apache-2.0",
    "recording": "router forward hooks during greedy Hugging Face generate (max_new_tokens=512), decode tokens only",
}


def _gpt_oss_paths(src: Path, npz_name: str, meta_name: str) -> tuple[Path, Path]:
    existing(src, f"expected a directory with {npz_name} and {meta_name}")
    if src.is_dir():
        return existing(src / npz_name, "gpt-oss data"), regular_input(src / meta_name, "gpt-oss metadata")
    return src, regular_input(src.with_name(meta_name), f"the metadata next to {src.name}")


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    try:
        with open(path, encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                d = json_loads(line, f"{path}: line {i}")
                if not isinstance(d, dict):
                    raise TraceError(f"{path}: line {i} is not a JSON object")
                rows.append(d)
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text ({e.reason})") from None
    return rows


def import_gpt_oss_npz(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    limit: int | None = None,
    select: Sequence[int] | None = None,
    weights: bool = True,
    overwrite: bool = False,
) -> Path:
    """Import gpt-oss-20b decode routing (``decode_routing.npz`` + ``decode_routing_meta.jsonl``).

    ``src`` is the directory holding both files (or the .npz itself). Arrays: ``expert_ids`` uint8 [T, 24, 4],
    ``expert_probs`` float16 [T, 24, 4] (kept as weights), ``example_offsets`` int64 [R+1] (generation i is rows
    offsets[i]:offsets[i+1]), ``token_position`` int32 [T]. Each generation becomes one request (id =
    ``example_index``); all rows are decode tokens. ``limit`` keeps the first N generations; ``select`` keeps
    the generations at these 0-based positions (in the given order), e.g. a stratified sample. ``weights=False``
    drops the routing weights (about 3x smaller on disk).
    """
    src = Path(src)
    npz_path, meta_path = _gpt_oss_paths(src, "decode_routing.npz", "decode_routing_meta.jsonl")
    z = load_npz(npz_path)
    offsets = as_int_array(npz_array(z, npz_path, "example_offsets"), f"{npz_path}: example_offsets")
    rows = _read_jsonl(meta_path)
    n_gen = len(offsets) - 1
    if offsets.ndim != 1 or n_gen < 0 or (n_gen and (offsets[0] != 0 or np.any(np.diff(offsets) < 0))):
        raise TraceError(f"{npz_path}: example_offsets must be a non-decreasing 1-D array starting at 0")
    if len(rows) != n_gen:
        raise TraceError(f"{meta_path}: {len(rows)} generations, but {npz_path.name} has {n_gen} (example_offsets)")
    gens = np.arange(n_gen)
    if select is not None:
        gens = np.asarray(select, dtype=np.int64).ravel()
        if len(gens) == 0 or gens.min() < 0 or gens.max() >= n_gen or len(np.unique(gens)) != len(gens):
            raise TraceError(f"{npz_path}: select must be distinct generation indices in [0, {n_gen})")
    if limit is not None:
        if limit < 1:
            raise TraceError(f"--limit must be >= 1, got {limit}")
        gens = gens[:limit]
    ids = npz_array(z, npz_path, "expert_ids")
    probs = npz_array(z, npz_path, "expert_probs")
    pos = npz_array(z, npz_path, "token_position")
    p = GPT_OSS_20B
    if ids.ndim != 3 or ids.shape[1:] != (p.num_layers, p.top_k):
        raise TraceError(f"{npz_path}: expert_ids must have shape [tokens, {p.num_layers}, {p.top_k}], "
                         f"got {ids.shape}")
    if probs.shape != ids.shape:
        raise TraceError(f"{npz_path}: expert_probs shape {probs.shape} differs from expert_ids {ids.shape}")
    if pos.shape != ids.shape[:1]:
        raise TraceError(f"{npz_path}: token_position shape {pos.shape} does not match {ids.shape[0]} tokens")
    if int(offsets[-1]) != ids.shape[0]:
        raise TraceError(f"{npz_path}: example_offsets ends at {int(offsets[-1])}, expert_ids has {ids.shape[0]} rows")
    rows_of = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in gens] or [np.zeros(0, np.int64)])
    ids, probs, pos = ids[rows_of], probs[rows_of], pos[rows_of]
    check_ids(ids, p.num_experts, f"{npz_path}: expert_ids")

    rids, doms, srcs, plen, glen = [], [], [], [], []
    for i in gens.tolist():
        r = rows[i]
        try:
            ds, cat = str(r["dataset"]), str(r["category"])
            w = f"{meta_path}: generation {i}"
            rid = as_int(r.get("example_index", i), f"{w}: example_index")
            prompt_len = as_int(r["prompt_len_tokens"], f"{w}: prompt_len_tokens")
            n_routed = as_int(r.get("n_routed_tokens", int(offsets[i + 1] - offsets[i])), f"{w}: n_routed_tokens")
            gen_len = as_int(r.get("n_generated_tokens", n_routed), f"{w}: n_generated_tokens")
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(f"{meta_path}: generation {i}: missing or invalid field ({e!r})") from None
        if n_routed != offsets[i + 1] - offsets[i]:
            raise TraceError(f"{meta_path}: generation {i}: n_routed_tokens={n_routed} but example_offsets give "
                             f"{int(offsets[i + 1] - offsets[i])} rows")
        rids.append(rid)
        doms.append(gpt_oss_domain(ds, cat))
        srcs.append(f"{ds}/{cat}")
        plen.append(prompt_len)
        glen.append(gen_len)
    if len(set(rids)) != len(rids):
        raise TraceError(f"{meta_path}: example_index values are not unique")
    req_of_row = np.repeat(np.asarray(rids, np.int64), offsets[gens + 1] - offsets[gens])
    end = len(rows_of)

    meta = TraceMeta(
        model=p.model, num_layers=p.num_layers, num_experts=p.num_experts, top_k=p.top_k,
        num_shared_experts=p.num_shared_experts, hidden_size=p.hidden_size,
        moe_layer_map=list(range(p.num_layers)), has_weights=weights,
        source=f"gpt-oss-npz:{npz_path}",
        extra={**_GPT_OSS_PROVENANCE, "importer": "gpt-oss-npz", "num_generations": len(gens),
               "domain_mapping": "moeplace.trace.importers.gpt_oss_domain"},
    )
    out_p = prepare_out(out, npz_path)
    with open_writer(out_p, meta, overwrite, [src, npz_path, meta_path]) as w:
        w.add_requests(rids, domain=doms, source=srcs, prompt_len=plen, gen_len=glen)
        step = 1 << 16
        for s in range(0, end, step):
            sl = slice(s, min(end, s + step))
            w.add_tokens(req_of_row[sl], pos[sl], np.full(sl.stop - s, DECODE, np.int8), ids[sl],
                         probs[sl] if weights else None)
    return out_p


def import_gpt_oss_summaries(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
) -> Path:
    """Import gpt-oss-20b per-group summaries (``domain_summaries.npz`` + ``domain_summaries_meta.json``).

    Counts-only. Each summary group (dataset x category x bucket) gives up to two count rows, ``<group>/think``
    and ``<group>/answer`` (both phase decode; a phase with no tokens is skipped). ``{think,answer}_count_
    frequency`` [G, 24, 32] is the mean fraction of tokens selecting each expert, so counts = frequency x
    num_tokens with num_tokens = sample_count x ``num_{think,answer}_tokens`` (mean tokens per sample).
    """
    src = Path(src)
    npz_path, meta_path = _gpt_oss_paths(src, "domain_summaries.npz", "domain_summaries_meta.json")
    z = load_npz(npz_path)
    try:
        groups = json_loads(meta_path.read_text(encoding="utf-8"), str(meta_path))
    except UnicodeDecodeError as e:
        raise TraceError(f"{meta_path}: not UTF-8 text ({e.reason})") from None
    if not isinstance(groups, list):
        raise TraceError(f"{meta_path}: expected a JSON list of groups")
    p = GPT_OSS_20B
    want = (len(groups), p.num_layers, p.num_experts)
    names, doms, phases, ntok, counts = [], [], [], [], []
    for ch in ("think", "answer"):
        freq = npz_array(z, npz_path, f"{ch}_count_frequency")
        if freq.shape != want:
            raise TraceError(f"{npz_path}: {ch}_count_frequency must have shape {list(want)} (one row per group in "
                             f"{meta_path.name}), got {list(freq.shape)}")
        for i, g in enumerate(groups):
            try:
                n_samples = float(as_int(g["sample_count"], f"{meta_path}: group {i}: sample_count"))
                per = g.get(f"num_{ch}_tokens")
                name = f"{g['dataset']}/{g['category']}/{g.get('bucket', '')}/{ch}"
                dom = gpt_oss_domain(str(g["dataset"]), str(g["category"]))
            except (KeyError, TypeError, ValueError) as e:
                raise TraceError(f"{meta_path}: group {i}: missing or invalid field ({e!r})") from None
            f = freq[i].astype(np.float64)
            if per is None or not np.isfinite(f).any():
                continue  # this phase never occurred in the group
            n = n_samples * float(per)
            names.append(name)
            doms.append(dom)
            phases.append(DECODE)
            ntok.append(n)
            counts.append(f * n)
    meta = TraceMeta(
        model=p.model, num_layers=p.num_layers, num_experts=p.num_experts, top_k=p.top_k,
        num_shared_experts=p.num_shared_experts, hidden_size=p.hidden_size,
        moe_layer_map=list(range(p.num_layers)), kind="counts",
        source=f"gpt-oss-summaries:{npz_path}",
        extra={**_GPT_OSS_PROVENANCE, "importer": "gpt-oss-summaries", "num_summary_groups": len(groups),
               "group_name": "dataset/category/bucket/{think|answer}",
               "domain_mapping": "moeplace.trace.importers.gpt_oss_domain"},
    )
    out_p = prepare_out(out, npz_path)
    with open_writer(out_p, meta, overwrite, [src, npz_path, meta_path]) as w:
        if names:
            w.add_counts(names, doms, np.asarray(phases, np.int8), np.asarray(ntok), np.stack(counts))
    return out_p
