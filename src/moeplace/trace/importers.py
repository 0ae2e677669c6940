"""Importers: real routing recorded by engines and third parties -> moeplace traces.

Shape legend: T = tokens, L = MoE layers, K = top-k, E = logical experts, P = physical slots, G = count groups.

Each importer is a function ``import_<format>(src, out, *, overwrite=False, ...) -> Path`` that validates its
input, writes a trace with :class:`moeplace.trace.TraceWriter` and returns ``out``. :data:`FORMATS` is the
registry keyed by the names ``moeplace trace import --format`` accepts; :func:`import_trace` dispatches on it.
Bad input raises :class:`moeplace.trace.TraceError` naming the file and the problem. Exact layouts: see
docs/IMPORTERS.md.
"""

from __future__ import annotations

import json
import os
import re
import warnings
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeplace.trace.formats import FORMATS, ImportFormat  # noqa: F401  (the registry; re-exported)
from moeplace.trace.reader import regular_file_size
from moeplace.trace.types import DECODE, MAX_EXPERTS, PREFILL, TraceError, TraceMeta
from moeplace.trace.writer import TraceWriter

# --------------------------------------------------------------------------------------------------- domains

DOMAINS = ("code", "math", "chat", "general", "unknown")

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


# OLMoE routing-analysis corpora -> moeplace domains.
OLMOE_DOMAINS = {"github": "code", "tulu": "chat", "arxiv": "general", "book": "general", "c4": "general",
                 "wikipedia": "general"}


@dataclass(frozen=True)
class KnownModel:
    """What the importers know about a model whose dumps do not say it."""

    model: str  # Hugging Face name
    num_layers: int  # MoE layers of the model
    num_experts: int  # E
    top_k: int  # K
    hidden_size: int
    num_shared_experts: int = 0


GPT_OSS_20B = KnownModel("openai/gpt-oss-20b", 24, 32, 4, 2880)
OLMOE_MODELS = {  # <model>.npz stem in olmoe-mixtral/ -> preset
    "olmoe": KnownModel("allenai/OLMoE-1B-7B-0924", 16, 64, 8, 2048),
    "olmoe-sft": KnownModel("allenai/OLMoE-1B-7B-0924-SFT", 16, 64, 8, 2048),
    "olmoe-dpo": KnownModel("allenai/OLMoE-1B-7B-0924-Instruct", 16, 64, 8, 2048),
    "mistral": KnownModel("mistralai/Mixtral-8x7B-v0.1", 32, 8, 2, 4096),
}
OLMOE_STORED_LAYERS = [0, 7, 15]  # model layers kept in the OLMoE repository's routing_output arrays

_GPT_OSS_PROVENANCE = {
    "upstream": "https://github.com/AmanPriyanshu/GPT-OSS-MoE-ExpertFingerprinting",
    "upstream_commit": "72b368f",
    "license": "Apache-2.0",
    "recording": "router forward hooks during greedy Hugging Face generate (max_new_tokens=512), decode tokens only",
}
_OLMOE_PROVENANCE = {
    "upstream": "https://github.com/allenai/OLMoE (scripts/routing_output/)",
    "upstream_commit": "357454f",
    "license": "Apache-2.0",
    "recording": "teacher-forced pass over 2048-token chunks (equivalent to prefill), ~209k tokens per domain",
}


# --------------------------------------------------------------------------------------------------- helpers


def _exists(p: Path, what: str) -> Path:
    if not p.exists():
        raise TraceError(f"{p}: no such file ({what})")
    return p


def _regular(p: Path, what: str) -> Path:
    """``p`` after :func:`moeplace.trace.reader.regular_file_size` checked it is a readable regular file."""
    regular_file_size(p, what)
    return p


def _json_loads(text: str, where: str):
    """json.loads with every failure (syntax, nesting too deep) as a TraceError naming ``where``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise TraceError(f"{where}: JSON nested too deeply") from None


def _as_int(v, where: str) -> int:
    """An integer field: ints, or floats with an integral value; fractions, NaN, bools and text are refused."""
    if isinstance(v, (bool, np.bool_)):
        raise TraceError(f"{where}: expected an integer, got {v!r}")
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)) and np.isfinite(v) and float(v).is_integer():
        return int(v)
    raise TraceError(f"{where}: expected an integer, got {v!r}")


def _as_int_array(a, where: str) -> np.ndarray:
    """int64 array of ``a``: integers, or floats with integral values (fractions and NaN refused)."""
    try:
        arr = np.asarray(a)
    except (ValueError, RecursionError) as e:
        raise TraceError(f"{where}: not an array ({_first_line(e)})") from None
    if arr.dtype.kind == "b" or arr.dtype.kind not in "iuf":
        raise TraceError(f"{where}: expected integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "f" and arr.size and not (np.isfinite(arr).all() and (arr == np.round(arr)).all()):
        raise TraceError(f"{where}: expected integers, found fractional or non-finite values")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise TraceError(f"{where}: value {int(arr.max())} is too large")
    return arr.astype(np.int64)


def _first_line(e: BaseException) -> str:
    s = str(e)
    return (s.splitlines()[0] if s else type(e).__name__)[:200]


def _load_npz(path: Path) -> np.lib.npyio.NpzFile:
    _regular(path, "a .npz archive")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise TraceError(f"{path}: not a readable .npz archive ({_first_line(e)})") from None


def _npz_array(z, path: Path, key: str) -> np.ndarray:
    if key not in z.files:
        raise TraceError(f"{path}: missing array {key!r} (found: {', '.join(sorted(z.files)) or 'none'})")
    try:
        return z[key]
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, MemoryError) as e:
        raise TraceError(f"{path}: array {key!r} is unreadable ({_first_line(e)})") from None


def _check_ids(ids: np.ndarray, num_experts: int, where: str) -> None:
    if ids.dtype.kind not in "iu":
        raise TraceError(f"{where}: expected integer expert ids, got dtype {ids.dtype}")
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            raise TraceError(f"{where}: expert id {lo if lo < 0 else hi} out of range [0, {num_experts})")


def _prepare_out(out: str | os.PathLike, src: Path) -> Path:
    o = Path(out)
    if o.resolve() == src.resolve():
        raise TraceError(f"{o}: output would overwrite the input")
    return o


def _writer(out: Path, meta: TraceMeta, overwrite: bool, inputs: Sequence[Path]) -> TraceWriter:
    """The importers' writer: built aside and moved into place when complete (a failure leaves nothing), and
    never replacing a folder that is or holds one of ``inputs``."""
    return TraceWriter(out, meta, overwrite=overwrite, keep_partial=False, inputs=inputs)


# --------------------------------------------------------------------------------------------------- gpt-oss


def _gpt_oss_paths(src: Path, npz_name: str, meta_name: str) -> tuple[Path, Path]:
    _exists(src, f"expected a directory with {npz_name} and {meta_name}")
    if src.is_dir():
        return _exists(src / npz_name, "gpt-oss data"), _regular(src / meta_name, "gpt-oss metadata")
    return src, _regular(src.with_name(meta_name), f"the metadata next to {src.name}")


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    try:
        with open(path, encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                d = _json_loads(line, f"{path}: line {i}")
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
    z = _load_npz(npz_path)
    offsets = _as_int_array(_npz_array(z, npz_path, "example_offsets"), f"{npz_path}: example_offsets")
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
    ids = _npz_array(z, npz_path, "expert_ids")
    probs = _npz_array(z, npz_path, "expert_probs")
    pos = _npz_array(z, npz_path, "token_position")
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
    _check_ids(ids, p.num_experts, f"{npz_path}: expert_ids")

    rids, doms, srcs, plen, glen = [], [], [], [], []
    for i in gens.tolist():
        r = rows[i]
        try:
            ds, cat = str(r["dataset"]), str(r["category"])
            w = f"{meta_path}: generation {i}"
            rid = _as_int(r.get("example_index", i), f"{w}: example_index")
            prompt_len = _as_int(r["prompt_len_tokens"], f"{w}: prompt_len_tokens")
            n_routed = _as_int(r.get("n_routed_tokens", int(offsets[i + 1] - offsets[i])), f"{w}: n_routed_tokens")
            gen_len = _as_int(r.get("n_generated_tokens", n_routed), f"{w}: n_generated_tokens")
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
    out_p = _prepare_out(out, npz_path)
    with _writer(out_p, meta, overwrite, [src, npz_path, meta_path]) as w:
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
    z = _load_npz(npz_path)
    try:
        groups = _json_loads(meta_path.read_text(encoding="utf-8"), str(meta_path))
    except UnicodeDecodeError as e:
        raise TraceError(f"{meta_path}: not UTF-8 text ({e.reason})") from None
    if not isinstance(groups, list):
        raise TraceError(f"{meta_path}: expected a JSON list of groups")
    p = GPT_OSS_20B
    want = (len(groups), p.num_layers, p.num_experts)
    names, doms, phases, ntok, counts = [], [], [], [], []
    for ch in ("think", "answer"):
        freq = _npz_array(z, npz_path, f"{ch}_count_frequency")
        if freq.shape != want:
            raise TraceError(f"{npz_path}: {ch}_count_frequency must have shape {list(want)} (one row per group in "
                             f"{meta_path.name}), got {list(freq.shape)}")
        for i, g in enumerate(groups):
            try:
                n_samples = float(_as_int(g["sample_count"], f"{meta_path}: group {i}: sample_count"))
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
    out_p = _prepare_out(out, npz_path)
    with _writer(out_p, meta, overwrite, [src, npz_path, meta_path]) as w:
        if names:
            w.add_counts(names, doms, np.asarray(phases, np.int8), np.asarray(ntok), np.stack(counts))
    return out_p


# --------------------------------------------------------------------------------------------------- OLMoE


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
    z = _load_npz(path)
    prefix = "expert_counts__"
    keys = sorted(k for k in z.files if k.startswith(prefix))
    if not keys:
        raise TraceError(f"{path}: no expert_counts__<domain> arrays (found: {', '.join(sorted(z.files)) or 'none'})")
    L = len(OLMOE_STORED_LAYERS)
    names, doms, ntok, counts = [], [], [], []
    for k in keys:
        c = _npz_array(z, path, k)
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
    out_p = _prepare_out(out, path)
    with _writer(out_p, meta, overwrite, [path]) as w:
        w.add_counts(names, doms, np.full(len(names), PREFILL, np.int8), np.asarray(ntok), np.stack(counts))
    return out_p


# --------------------------------------------------------------------------------------------------- shared


def _detect_dense_layers(nonzero_layer: np.ndarray, top_k: int) -> np.ndarray:
    """Indices of the MoE layers: layers that ever route to a nonzero id. Only meaningful for K >= 2."""
    if top_k < 2 or not nonzero_layer.any():
        return np.arange(len(nonzero_layer))
    return np.flatnonzero(nonzero_layer)


def _engine_meta(model: str, L: int, E: int, K: int, layer_map: list[int], hidden_size: int | None,
                 num_shared_experts: int, source: str, extra: dict, kind: str = "tokens") -> TraceMeta:
    try:
        return TraceMeta(model=model, num_layers=L, num_experts=E, top_k=K, num_shared_experts=num_shared_experts,
                         hidden_size=hidden_size, moe_layer_map=layer_map, kind=kind, source=source, extra=extra)
    except TraceError as e:
        raise TraceError(f"{source}: {e}") from None


# --------------------------------------------------------------------------------------------------- vLLM


@dataclass
class _VllmRequest:
    """One request's routed rows, placed on token positions. Row i is the token at position ``pos0 + i``; positions
    below ``prompt_len`` are prefill, the others decode."""

    orig_id: str
    domain: str
    rows: np.ndarray  # int64 [N, Lm, K] router order
    pos0: int  # position of row 0 (routed_experts_prompt_start in vLLM >= 0.32, else 0)
    prompt_len: int
    gen_len: int
    unknown: np.ndarray  # bool [N]: rows without routing (0.21 prefix-cached rows, zero- or -1-filled)


def _as_routing(a, where: str) -> np.ndarray:
    """int64 [N, Lm, K] from a nested list, an array, or the OpenAI server's base64 ``.npy`` string."""
    if a is None:
        return np.zeros((0, 0, 0), np.int64)
    if isinstance(a, str):
        a = _b64_npy(a, where)
    try:
        arr = np.asarray(a)
    except (ValueError, RecursionError) as e:  # ragged or absurdly nested lists
        raise TraceError(f"{where}: not a rectangular [tokens, layers, k] array ({_first_line(e)})") from None
    if arr.size == 0:
        return np.zeros((0, 0, 0), np.int64)
    if arr.ndim != 3:
        raise TraceError(f"{where}: expected shape [tokens, layers, k], got {list(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise TraceError(f"{where}: expected integer expert ids, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and int(arr.max()) > np.iinfo(np.int64).max:
        raise TraceError(f"{where}: expert id {int(arr.max())} is too large")
    return arr.astype(np.int64, copy=False)  # no narrowing: an id of 2**31 must not wrap


def _b64_npy(text: str, where: str) -> np.ndarray:
    """The array of a base64-encoded ``.npy`` (vLLM's ``numpy2base64``, what its OpenAI server returns)."""
    import base64
    import binascii
    import io

    try:
        raw = base64.b64decode(text, validate=True)
        return np.load(io.BytesIO(raw), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as e:
        raise TraceError(f"{where}: not a base64-encoded .npy array ({_first_line(e)})") from None


def _opt_len(d: dict, ids_key: str, len_key: str, where: str) -> int | None:
    """Length from a token-id list ``ids_key`` or a count ``len_key`` (they must agree when both are given)."""
    n = None
    if d.get(ids_key) is not None:
        ids = d[ids_key]
        if not isinstance(ids, (list, tuple, np.ndarray)):
            raise TraceError(f"{where}: {ids_key} must be a list of token ids")
        n = len(ids)
    if d.get(len_key) is not None:
        m = _as_int(d[len_key], f"{where}: {len_key}")
        if m < 0 or (n is not None and m != n):
            raise TraceError(f"{where}: {len_key}={m} but {ids_key} has {n} tokens" if n is not None
                             else f"{where}: {len_key} must be >= 0, got {m}")
        n = m
    return n


def _vllm_request(d: dict, where: str) -> _VllmRequest:
    """A request from one record (keys as in docs/IMPORTERS.md); refuses what it cannot place on positions."""
    rid = str(d.get("request_id", where))
    domain = str(d.get("domain") or "unknown")
    P = _opt_len(d, "prompt_token_ids", "prompt_len", where)
    G = _opt_len(d, "output_token_ids", "gen_len", where)
    if "prompt_routed_experts" in d:  # vLLM 0.21: prompt rows and generated rows apart
        pr = _as_routing(d.get("prompt_routed_experts"), f"{where} prompt_routed_experts")
        dc = _as_routing(d.get("routed_experts"), f"{where} routed_experts")
        if pr.size and dc.size and pr.shape[1:] != dc.shape[1:]:
            raise TraceError(f"{where}: prompt_routed_experts has [layers, k] = {list(pr.shape[1:])} but "
                             f"routed_experts {list(dc.shape[1:])}")
        if P is not None and len(pr) != P:
            raise TraceError(f"{where}: prompt_routed_experts has {len(pr)} rows for a {P}-token prompt")
        rows = pr if not dc.size else dc if not pr.size else np.concatenate([pr, dc])
        p_len = len(pr)
        cached = np.zeros(len(rows), bool)
        if len(rows):
            neg = (rows < 0).any(axis=(1, 2))
            partial = neg & ~(rows < 0).all(axis=(1, 2))
            if partial.any():
                i = int(np.flatnonzero(partial)[0])
                name, j = ("prompt_routed_experts", i) if i < p_len else ("routed_experts", i - p_len)
                raise TraceError(f"{where}: {name} row {j} has -1 in some layers only (-1 must mark a whole "
                                 "prefix-cached row)")
            zero = np.zeros(len(rows), bool)
            zero[:p_len] = (pr == 0).all(axis=(1, 2))
            if zero.any() and rows.shape[2] < 2:
                raise TraceError(f"{where}: prompt_routed_experts has all-zero rows and k = 1: a prefix-cached row "
                                 "(vLLM 0.21 leaves them zero) cannot be told from a token routed to expert 0")
            cached = neg | zero  # with k >= 2 a routed token never selects expert 0 twice in a layer
        return _VllmRequest(rid, domain, rows, 0, p_len, len(dc) if G is None else G, cached)
    if "routed_experts" not in d:
        raise TraceError(f"{where}: needs routed_experts (vLLM >= 0.32) or prompt_routed_experts (vLLM 0.21) "
                         f"(found keys: {', '.join(sorted(d)) or 'none'})")
    rows = _as_routing(d["routed_experts"], f"{where} routed_experts")
    N = len(rows)
    if P is None:
        raise TraceError(f"{where}: routed_experts holds prompt and generated tokens together (vLLM >= 0.32); "
                         "give prompt_token_ids or prompt_len so prefill rows can be told from decode rows")
    start = d.get("routed_experts_prompt_start")
    s = None if start is None else _as_int(start, f"{where}: routed_experts_prompt_start")
    if s is not None and not 0 <= s <= P:
        raise TraceError(f"{where}: routed_experts_prompt_start={s} is outside [0, {P}] (the prompt length)")
    if G is None:
        if s is None:
            raise TraceError(f"{where}: {N} routed_experts rows, but neither output_token_ids (or gen_len) nor "
                             "routed_experts_prompt_start is given, so where the rows start is ambiguous")
        G = N + s + 1 - P
        if G < 0:
            raise TraceError(f"{where}: {N} routed_experts rows from prompt position {s} end inside the {P}-token "
                             "prompt; give output_token_ids")
    else:
        want = max(P + G - 1 - (s or 0), 0)  # vLLM routes every token but the last generated one
        if N != want:
            hint = ("; if the request set routed_experts_prompt_start, give it" if s is None
                    else f" (routed_experts_prompt_start={s})")
            raise TraceError(f"{where}: routed_experts has {N} rows, but a {P}-token prompt with {G} generated "
                             f"tokens gives {want}{hint}")
    if (rows < 0).any():
        raise TraceError(f"{where}: routed_experts holds negative ids (vLLM >= 0.32 returns logical ids >= 0)")
    return _VllmRequest(rid, domain, rows, s or 0, P, G, np.zeros(N, bool))


_NPZ_FIELDS = ("prompt_lens", "gen_lens", "prompt_starts")  # optional [R] int arrays of the .npz layout


def _lines(fh, path: Path) -> Iterator[str]:
    try:
        yield from fh
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text ({e.reason})") from None


def _iter_vllm(path: Path) -> Iterator[_VllmRequest]:
    if path.suffix == ".npz":
        z = _load_npz(path)
        idx = sorted({int(k[3:].split("_")[0]) for k in z.files if k.startswith("req") and k[3:].split("_")[0]
                      .isdigit()})
        if idx != list(range(len(idx))):
            raise TraceError(f"{path}: request keys must be numbered req0.., req{{R-1}} without gaps")
        n = len(idx)
        rid_arr = _npz_array(z, path, "request_ids") if "request_ids" in z.files else np.arange(n).astype(str)
        dom_arr = _npz_array(z, path, "domains") if "domains" in z.files else np.full(n, "unknown")
        per = {k: _as_int_array(_npz_array(z, path, k), f"{path}: {k}").ravel() for k in _NPZ_FIELDS if k in z.files}
        for name, arr in (("request_ids", rid_arr), ("domains", dom_arr), *per.items()):
            if len(arr) != n:
                raise TraceError(f"{path}: {name} must have one entry per request ({n}), has {len(arr)}")
        for i in range(n):
            d: dict = {"request_id": str(rid_arr[i]), "domain": str(dom_arr[i])}
            for key, name in ((f"req{i}_prompt", "prompt_routed_experts"), (f"req{i}_decode", "routed_experts"),
                              (f"req{i}_routed", "routed_experts")):
                if key in z.files:
                    if name in d:
                        raise TraceError(f"{path}: req{i}_routed (vLLM >= 0.32) and req{i}_decode (0.21) together")
                    d[name] = _npz_array(z, path, key)
            if f"req{i}_prompt" in z.files or f"req{i}_decode" in z.files:
                d.setdefault("prompt_routed_experts", None)  # the 0.21 split layout
            for k, field_name in zip(_NPZ_FIELDS, ("prompt_len", "gen_len", "routed_experts_prompt_start"),
                                     strict=True):
                if k in per:
                    d[field_name] = int(per[k][i])
            yield _vllm_request(d, f"{path}: request {i} ({d['request_id']})")
        return
    _regular(path, "a .jsonl or .npz file of vLLM routed experts")
    with open(path, encoding="utf-8", errors="strict") as fh:
        for ln, line in enumerate(_lines(fh, path), 1):
            if not line.strip():
                continue
            w = f"{path}: line {ln}"
            d = _json_loads(line, w)
            if not isinstance(d, dict):
                raise TraceError(f"{w}: expected a JSON object")
            d.setdefault("request_id", ln - 1)
            yield _vllm_request(d, f"{w} (request {d['request_id']})")


def import_vllm_routed(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    model: str = "unknown",
    num_experts: int | None = None,
    hidden_size: int | None = None,
    num_shared_experts: int = 0,
    overwrite: bool = False,
) -> Path:
    """Import vLLM per-request routed experts (``--enable-return-routed-experts``) from .jsonl or .npz.

    vLLM >= 0.32: ``routed_experts`` [N, Lm, K] covers prompt and generated tokens together from prompt position
    ``routed_experts_prompt_start`` (default 0) to the last token but one; the prompt length (``prompt_token_ids``
    or ``prompt_len``) splits prefill rows from decode rows, and the generated length (``output_token_ids`` or
    ``gen_len``) checks the row count. vLLM 0.21: ``prompt_routed_experts`` [prompt_len, Lm, K] (prefill; rows
    of prefix-cached positions are all 0, or -1, and are dropped and counted) and ``routed_experts`` [gen_len,
    Lm, K] (decode). Lm = the model's hidden layers; layers whose ids are all 0 in every row are dense (vLLM
    never writes them) and are dropped when K >= 2, and ``moe_layer_map`` records the kept model layers.
    ``num_experts`` defaults to the largest id + 1. Request ids are renumbered 0..R-1; the original id is in
    ``source``. A request whose rows cannot be placed on token positions is refused, never guessed.
    """
    path = _exists(Path(src), "expected a .jsonl or .npz file of vLLM routed experts")
    where = f"vllm-routed:{path}"
    shape = None
    nonzero = None
    max_id = -1
    n_req = 0
    for r in _iter_vllm(path):  # pass 1: shapes, id range, dense layers
        n_req += 1
        if r.rows.shape[0] == 0:
            continue
        if shape is None:
            shape = r.rows.shape[1:]
            nonzero = np.zeros(shape[0], bool)
        elif r.rows.shape[1:] != shape:
            raise TraceError(f"{path}: request {r.orig_id}: routed_experts has [layers, k] = "
                             f"{list(r.rows.shape[1:])}, earlier requests have {list(shape)}")
        kept = r.rows[~r.unknown]
        if kept.size:
            max_id = max(max_id, int(kept.max()))
            nonzero |= (kept != 0).any(axis=(0, 2))
    if n_req == 0:
        raise TraceError(f"{path}: no requests found")
    if shape is None or max_id < 0:
        raise TraceError(f"{path}: no routed rows (every request is empty or fully prefix-cached)")
    Lm, K = shape
    if max_id >= MAX_EXPERTS:
        raise TraceError(f"{path}: expert id {max_id} is beyond what a trace holds (ids < {MAX_EXPERTS}); "
                         "is this file corrupt?")
    E = int(num_experts) if num_experts is not None else max_id + 1
    if max_id >= E:
        raise TraceError(f"{path}: expert id {max_id} out of range [0, {E}) (--num-experts {E})")
    layers = _detect_dense_layers(nonzero, K)
    extra = {"importer": "vllm-routed", "num_model_layers": int(Lm),
             "num_experts_inferred": num_experts is None, "request_id_map": "source column holds vLLM request_id"}
    meta = _engine_meta(model, len(layers), E, K, layers.tolist(), hidden_size, num_shared_experts, where, extra)
    out_p = _prepare_out(out, path)
    dropped = 0
    with _writer(out_p, meta, overwrite, [path]) as w:
        for i, r in enumerate(_iter_vllm(path)):  # pass 2: write
            w.add_requests([i], domain=[r.domain if r.domain in DOMAINS else "unknown"],
                           source=[f"vllm request_id={r.orig_id}"], prompt_len=[r.prompt_len], gen_len=[r.gen_len])
            keep = ~r.unknown
            dropped += int(r.unknown.sum())
            if not keep.any():
                continue
            pos = (r.pos0 + np.arange(len(r.rows)))[keep]
            phase = np.where(pos < r.prompt_len, PREFILL, DECODE).astype(np.int8)
            try:
                w.add_tokens(np.full(len(pos), i, np.int64), pos, phase, r.rows[keep][:, layers, :])
            except TraceError as e:
                raise TraceError(f"{path}: request {r.orig_id}: {e}") from None
        w.meta.extra["prefix_cached_rows_dropped"] = dropped
    return out_p


# --------------------------------------------------------------------------------------------------- SGLang

# SGLang ForwardMode values (python/sglang/srt/model_executor/forward_batch_info.py): stable for these three.
_SGL_EXTEND, _SGL_DECODE, _SGL_MIXED = 1, 2, 3


def _torch_load(path: Path) -> dict:
    _regular(path, "a .pt file written by SGLang's expert distribution recorder")
    import pickle

    import torch

    try:  # weights_only: a pickle that would run code is refused, never executed
        with warnings.catch_warnings():  # torch warns about pickle protocols on stderr
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        m = re.search(r"GLOBAL ([\w.]+)", str(e))
        why = f"it names {m.group(1)}" if m else "it holds more than tensors and plain containers"
        raise TraceError(f"{path}: not a readable torch.save file: loading it would run code ({why}); refused, "
                         "nothing was executed") from None
    except (RuntimeError, OSError, EOFError, ValueError, IndexError, KeyError, TypeError, AttributeError,
            UnicodeDecodeError, zipfile.BadZipFile, RecursionError, MemoryError) as e:
        raise TraceError(f"{path}: not a readable torch.save file ({type(e).__name__}: {_first_line(e)})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{path}: expected a dict (torch.save of the recorder dump), got {type(obj).__name__}")
    return obj


def _np(t, where: str) -> np.ndarray:
    import torch

    if isinstance(t, torch.Tensor):
        return t.detach().cpu().numpy()
    try:
        return np.asarray(t)
    except ValueError as e:
        raise TraceError(f"{where}: not an array ({e})") from None


def import_sglang_per_token(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    model: str = "unknown",
    num_experts: int | None = None,
    hidden_size: int | None = None,
    num_shared_experts: int = 0,
    overwrite: bool = False,
) -> Path:
    """Import one rank's SGLang expert-distribution dump in ``per_token`` mode (``expert_distribution_recorder_*.pt``).

    Dump: ``{"records": [...], "last_physical_to_logical_map": int [Lm, P]}``; each record has
    ``topk_ids_of_layer`` int [Lm, T, 8] (physical slot ids, -1 padding), ``positions`` [T], ``forward_mode``
    and ``extend_seq_lens``. Physical ids are mapped to logical experts with the map (the placement in force
    when the dump was written). Layers that never route (dense layers, all -1) are dropped; K = the number of
    columns that are ever used. The dump carries no request ids: each sequence of an extend pass (by
    ``extend_seq_lens``) and each token of a decode pass becomes its own request. Other modes are skipped.
    """
    path = Path(src)
    obj = _torch_load(path)
    for key in ("records", "last_physical_to_logical_map"):
        if key not in obj:
            raise TraceError(f"{path}: missing key {key!r} (found: {', '.join(map(str, obj)) or 'none'}); is this a "
                             "per_token dump? (stat dumps have 'logical_count': use --format sglang-stat)")
    records = obj["records"]
    if not isinstance(records, list):
        raise TraceError(f"{path}: 'records' must be a list")
    p2l = _np(obj["last_physical_to_logical_map"], f"{path}: last_physical_to_logical_map")
    if p2l.ndim != 2 or p2l.dtype.kind not in "iu" or p2l.size == 0:
        raise TraceError(f"{path}: last_physical_to_logical_map must be an integer [layers, physical] array, "
                         f"got shape {list(p2l.shape)} dtype {p2l.dtype}")
    Lm, P = p2l.shape
    E = int(num_experts) if num_experts is not None else int(p2l.max()) + 1
    _check_ids(p2l, E, f"{path}: last_physical_to_logical_map")

    kept: list[tuple[int, dict, np.ndarray]] = []  # (record index, record, ids [T, Lm, K8])
    skipped: dict[str, int] = {}
    used_layer = np.zeros(Lm, bool)
    used_cols = None
    for j, rec in enumerate(records):
        w = f"{path}: record {j}"
        if not isinstance(rec, dict) or "topk_ids_of_layer" not in rec:
            raise TraceError(f"{w}: missing 'topk_ids_of_layer' (is this a per_token dump?)")
        ids = _np(rec["topk_ids_of_layer"], f"{w} topk_ids_of_layer")
        if ids.ndim != 3 or ids.shape[0] != Lm or ids.dtype.kind not in "iu":
            raise TraceError(f"{w}: topk_ids_of_layer must be an integer [{Lm}, tokens, k] array (layers from "
                             f"last_physical_to_logical_map), got shape {list(ids.shape)} dtype {ids.dtype}")
        mode = _as_int(rec.get("forward_mode", -1), f"{w}: forward_mode")
        if ids.shape[1] == 0:
            continue
        if mode not in (_SGL_EXTEND, _SGL_DECODE, _SGL_MIXED):
            skipped[str(mode)] = skipped.get(str(mode), 0) + 1
            continue
        valid = ids >= 0
        if (ids >= P).any():
            raise TraceError(f"{w}: physical expert id {int(ids.max())} out of range [0, {P})")
        if used_cols is None:
            used_cols = np.zeros(ids.shape[2], bool)
        elif ids.shape[2] != len(used_cols):
            raise TraceError(f"{w}: topk_ids_of_layer has {ids.shape[2]} columns, earlier records {len(used_cols)}")
        used_layer |= valid.any(axis=(1, 2))
        used_cols |= valid.any(axis=(0, 1))
        kept.append((j, rec, ids))
    if not kept or not used_layer.any():
        raise TraceError(f"{path}: no routed tokens in extend/decode records")
    layers = np.flatnonzero(used_layer)
    K = int(np.flatnonzero(used_cols)[-1]) + 1
    extra = {"importer": "sglang-per-token", "num_model_layers": int(Lm), "num_physical_experts": int(P),
             "num_experts_inferred": num_experts is None, "skipped_records_by_forward_mode": skipped,
             "request_granularity": "one per extend sequence / decode token (SGLang records no request ids)",
             "physical_to_logical": "last_physical_to_logical_map (placement at dump time)"}
    meta = _engine_meta(model, len(layers), E, K, layers.tolist(), hidden_size, num_shared_experts,
                        f"sglang-per-token:{path}", extra)
    layer_idx = layers[:, None]  # [L, 1] for gathering p2l rows
    out_p = _prepare_out(out, path)
    next_rid = 0
    with _writer(out_p, meta, overwrite, [path]) as w:
        for j, rec, ids in kept:
            where = f"{path}: record {j}"
            phys = ids[layers][:, :, :K]  # [L, T, K]
            if (phys < 0).any():
                raise TraceError(f"{where}: a routed layer has -1 in its first {K} columns (incomplete top-k)")
            logical = np.take_along_axis(p2l[layer_idx.ravel()], phys.reshape(len(layers), -1), axis=1)
            logical = logical.reshape(phys.shape).transpose(1, 0, 2)  # [T, L, K]
            T = logical.shape[0]
            pos = _as_int_array(_np(rec.get("positions", np.arange(T)), f"{where} positions"),
                                f"{where} positions").ravel()
            if len(pos) != T:
                raise TraceError(f"{where}: positions has {len(pos)} entries, topk_ids_of_layer {T} tokens")
            mode = _as_int(rec["forward_mode"], f"{where}: forward_mode")
            if mode == _SGL_DECODE:
                seq_lens = np.ones(T, np.int64)
            else:
                esl = rec.get("extend_seq_lens")
                seq_lens = _as_int_array([T] if esl is None else _np(esl, f"{where} extend_seq_lens"),
                                         f"{where} extend_seq_lens").ravel()
                if seq_lens.sum() != T or (seq_lens < 0).any():
                    raise TraceError(f"{where}: extend_seq_lens sum to {int(seq_lens.sum())}, expected {T} tokens")
                seq_lens = seq_lens[seq_lens > 0]
            if mode == _SGL_EXTEND:
                seq_phase = np.full(len(seq_lens), PREFILL, np.int8)
            elif mode == _SGL_DECODE:
                seq_phase = np.full(len(seq_lens), DECODE, np.int8)
            else:  # MIXED: running requests join a chunked-prefill batch with one token each
                seq_phase = np.where(seq_lens == 1, DECODE, PREFILL).astype(np.int8)
            rids = next_rid + np.arange(len(seq_lens))
            next_rid += len(seq_lens)
            is_pre = seq_phase == PREFILL
            w.add_requests(rids, source=[f"sglang forward_pass {rec.get('forward_pass_id', j)}"] * len(rids),
                           prompt_len=np.where(is_pre, seq_lens, 0), gen_len=np.where(is_pre, 0, seq_lens))
            try:
                w.add_tokens(np.repeat(rids, seq_lens), pos, np.repeat(seq_phase, seq_lens), logical)
            except TraceError as e:
                raise TraceError(f"{where}: {e}") from None
    return out_p


def import_sglang_stat(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    model: str = "unknown",
    top_k: int | None = None,
    hidden_size: int | None = None,
    num_shared_experts: int = 0,
    overwrite: bool = False,
) -> Path:
    """Import an SGLang expert-distribution dump in ``stat`` mode as a counts-only trace.

    Dump: ``{"rank": int, "logical_count": int [buffer, Lm, E], ...}`` (already logical, summed over ranks).
    Each non-empty buffer row (one forward pass) becomes a group ``pass<i>`` with phase -1 (the dump does not say
    prefill or decode); all-zero rows (unused buffer slots) are dropped and counted. Layers that never count a
    token (dense layers) are dropped. The dump does not record K: pass ``top_k`` to fill ``num_tokens`` and the
    metadata (without it K is recorded as 1 and num_tokens as NaN).
    """
    path = Path(src)
    obj = _torch_load(path)
    if "logical_count" not in obj:
        hint = " (per_token dumps have 'records': use --format sglang-per-token)" if "records" in obj else ""
        raise TraceError(f"{path}: missing key 'logical_count' (found: {', '.join(map(str, obj)) or 'none'}){hint}")
    c = _np(obj["logical_count"], f"{path}: logical_count")
    if c.ndim != 3 or c.dtype.kind not in "iuf":
        raise TraceError(f"{path}: logical_count must be a numeric [buffer, layers, experts] array, "
                         f"got shape {list(c.shape)} dtype {c.dtype}")
    c = c.astype(np.float64)
    bad = ~np.isfinite(c)
    if bad.any():
        b, layer, e = (int(x[0]) for x in np.nonzero(bad))
        raise TraceError(f"{path}: logical_count holds {c[b, layer, e]} (NaN or infinite) at buffer row {b}, "
                         f"layer {layer}, expert {e}")
    if (c < 0).any():
        raise TraceError(f"{path}: logical_count holds negative counts")
    if (c != np.round(c)).any():
        raise TraceError(f"{path}: logical_count holds fractional counts (token counts are integers)")
    rows = np.flatnonzero(c.sum(axis=(1, 2)) > 0)
    if not len(rows):
        raise TraceError(f"{path}: logical_count is all zeros (nothing was recorded)")
    layers = np.flatnonzero(c.sum(axis=(0, 2)) > 0)
    E = c.shape[2]
    K = int(top_k) if top_k is not None else 1
    counts = c[rows][:, layers, :]
    ntok = counts.sum(axis=2).max(axis=1) / K if top_k is not None else np.full(len(rows), np.nan)
    extra = {"importer": "sglang-stat", "rank": obj.get("rank"), "num_model_layers": int(c.shape[1]),
             "buffer_rows": int(c.shape[0]), "empty_buffer_rows_dropped": int(c.shape[0] - len(rows)),
             "top_k_known": top_k is not None,
             "note": "rows are forward passes in circular-buffer order (not chronological after wrap-around)"}
    meta = _engine_meta(model, len(layers), E, K, layers.tolist(), hidden_size, num_shared_experts,
                        f"sglang-stat:{path}", extra, kind="counts")
    out_p = _prepare_out(out, path)
    with _writer(out_p, meta, overwrite, [path]) as w:
        w.add_counts([f"pass{i}" for i in rows], ["unknown"] * len(rows), np.full(len(rows), -1, np.int8), ntok,
                     counts)
    return out_p


# ------------------------------------------------------------------------------------- import (registry: formats.py)


def import_trace(fmt: str, src: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False,
                 **options) -> Path:
    """Import ``src`` in format ``fmt`` (a key of :data:`FORMATS`) into the trace directory ``out``.

    ``options`` not accepted by that format raise TraceError (None values are ignored).
    """
    if fmt not in FORMATS:
        raise TraceError(f"unknown import format {fmt!r}; known formats: {', '.join(FORMATS)}")
    f = FORMATS[fmt]
    given = {k: v for k, v in options.items() if v is not None}
    bad = sorted(set(given) - set(f.options))
    if bad:
        flags = ", ".join("--" + b.replace("_", "-") for b in bad)
        raise TraceError(f"format {fmt!r} does not take {flags}")
    return f.func(src, out, overwrite=overwrite, **given)
