"""Analyse a trace: stream it, accumulate, and summarise as the stable JSON of docs/ANALYSIS.md.

Shape legend: T = tokens, L = MoE layers, K = top-k, E = logical experts, R = requests, D = domains,
G = count groups, S = tracked requests.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from moeplace.analyse.accumulate import TokenAccumulator
from moeplace.analyse.config import DEFAULT_CHUNK_TOKENS, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_WINDOW_TOKENS
from moeplace.analyse.stats import (
    coactivation_lift,
    follow_share,
    interlayer_lift,
    load_stats,
    normalise,
    pairwise_js,
    prefill_decode_correlation,
    softmax_regression_accuracy,
    top_pairs,
)
from moeplace.trace.budget import check_memory
from moeplace.trace.reader import iter_token_chunks, num_token_rows, read_counts, read_meta, read_requests
from moeplace.trace.types import DECODE, PREFILL, Counts, TraceMeta

SCHEMA_VERSION = 1
UNKNOWN = "unknown"
JS_LOG_BASE = 2
CLASSIFIER = ("multinomial logistic regression (L2 0.01, standardised features) on per-layer L1-normalised expert "
              "counts; seeded stratified split")
MAX_CLASSIFIER_SAMPLES = 4000  # a seeded subset beyond this keeps the fit to seconds
NUM_TOP_PAIRS = 20
MIN_PAIR_SUPPORT = 0.01  # a pair ranks by lift (and heads the report) only if seen in >= 1% of tokens
STAT_KEYS = ("max_over_mean", "cv", "gini", "top10_share")


# --------------------------------------------------------------------------------------------- JSON helpers


def to_json(obj):
    """Plain Python for ``json.dump``: numpy arrays to lists, NaN and infinities to None."""
    if isinstance(obj, dict):
        return {str(k): to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind in "iub":
            return obj.tolist()
        return to_json(obj.tolist())
    if isinstance(obj, (np.integer, np.bool_)):
        return obj.item()
    if isinstance(obj, (float, np.floating)):
        v = float(obj)
        return v if math.isfinite(v) else None
    return obj


def _nanmean(x: np.ndarray, axis=None):
    x = np.asarray(x, dtype=np.float64)
    ok = np.isfinite(x)
    n = ok.sum(axis)
    s = np.where(ok, x, 0.0).sum(axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, s / np.maximum(n, 1), np.nan)


def _imbalance(load: np.ndarray) -> dict:
    """Load statistics of one [L, E] load, per layer and averaged over layers."""
    st = load_stats(load)
    out: dict = {k: st[k] for k in STAT_KEYS}
    out["layer_mean"] = {k: float(_nanmean(st[k])) for k in STAT_KEYS}
    out["num_selections"] = float(load.sum())
    return out


def _null_section(keys: tuple[str, ...], **fixed) -> dict:
    return {**dict.fromkeys(keys), **fixed}


PD_KEYS = ("pearson", "pearson_mean", "spearman", "spearman_mean", "top_n_overlap", "top_n_overlap_mean",
           "top_n", "num_requests")
COACT_KEYS = ("top_pairs", "top_lift_pairs", "max_lift", "min_count", "layer", "counts", "lift")
INTER_KEYS = ("top_pairs", "top_lift_pairs", "max_lift", "follow_share", "follow_share_random", "min_count")
TEMPORAL_KEYS = ("decode_overlap", "decode_overlap_mean", "random_overlap", "num_pairs")
DRIFT_KEYS = ("window_tokens", "num_windows", "js", "js_mean", "js_series", "split_half_js", "split_half_js_mean")
CLASS_KEYS = ("chance", "num_train", "num_test", "confusion", "order", "samples", "classifier", "seed",
              "test_fraction")


def _meta_json(meta: TraceMeta, path: str, n_tokens: dict, num_requests: int, num_groups: int | None) -> dict:
    return {
        "trace": path,
        "model": meta.model,
        "source": meta.source,
        "kind": meta.kind,
        "synthetic": bool(meta.synthetic),
        "complete": bool(meta.complete),
        "num_layers": meta.num_layers,
        "num_experts": meta.num_experts,
        "top_k": meta.top_k,
        "moe_layer_map": meta.moe_layer_map,
        "sampling_rate": meta.sampling_rate,
        "num_tokens": n_tokens,
        "num_requests": num_requests,
        "num_count_groups": num_groups,
    }


def _domain_section(
    names: list[str], load_DLE: np.ndarray, tokens_D: np.ndarray, X: np.ndarray, y: np.ndarray, samples: str,
    seed: int, test_fraction: float, unavailable: dict,
) -> dict:
    """Domain specificity from per-domain load [D, L, E] (names[d]) and samples X [N, L, E] labelled y [N]."""
    keep = [i for i, n in enumerate(names) if n != UNKNOWN and load_DLE[i].sum() > 0]
    order = [names[i] for i in keep]
    freq = normalise(load_DLE[keep]) if keep else np.zeros((0,) + load_DLE.shape[1:])
    sec: dict = {
        "order": order,
        "num_tokens": tokens_D[keep],
        "frequency": freq,
        "js_log_base": JS_LOG_BASE,
        "js_divergence": None,
        "js_divergence_per_layer": None,
        "js_divergence_mean": None,
        "classification_accuracy": None,
        "classification": _null_section(CLASS_KEYS),
    }
    if len(order) < 2:
        unavailable["domain"] = (f"needs at least 2 known domains with tokens, found {len(order)} "
                                 f"({', '.join(order) or 'none'}; domain '{UNKNOWN}' is not counted)")
        return sec
    js_l = pairwise_js(load_DLE[keep])  # [L, D, D]
    js = _nanmean(js_l, axis=0)
    off = ~np.eye(len(order), dtype=bool)
    sec.update(js_divergence=js, js_divergence_per_layer=js_l, js_divergence_mean=float(_nanmean(js[off])))
    remap = np.full(len(names), -1)
    remap[keep] = np.arange(len(keep))
    lab = remap[y] if len(y) else np.zeros(0, np.intp)
    ok = lab >= 0
    if ok.sum() > MAX_CLASSIFIER_SAMPLES:
        sub = np.random.default_rng(seed).choice(np.flatnonzero(ok), MAX_CLASSIFIER_SAMPLES, replace=False)
        ok = np.zeros_like(ok)
        ok[sub] = True
    feats = normalise(X[ok]).reshape(int(ok.sum()), -1)
    res = softmax_regression_accuracy(feats, lab[ok], len(order), test_fraction=test_fraction, seed=seed)
    if res is None:
        counts = np.bincount(lab[ok], minlength=len(order))
        unavailable["domain.classification_accuracy"] = (
            f"needs at least 2 domains with 2 or more {samples} each; {samples} per domain: "
            + ", ".join(f"{d}={int(c)}" for d, c in zip(order, counts, strict=True))
        )
        return sec
    sec["classification_accuracy"] = res["accuracy"]
    sec["classification"] = {
        "chance": res["chance"], "num_train": res["num_train"], "num_test": res["num_test"],
        "confusion": res["confusion"], "order": order, "samples": samples, "classifier": CLASSIFIER,
        "seed": seed, "test_fraction": test_fraction,
    }
    return sec


def _check_params(chunk_tokens: int, window_tokens: int, test_fraction: float, top_n: int | None, K: int,
                  E: int, layer: int | None, L: int, max_request_bytes: int = 0) -> None:
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if window_tokens < 1:
        raise ValueError(f"window_tokens must be >= 1, got {window_tokens}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if top_n is not None and not 1 <= top_n <= E:
        raise ValueError(f"top_n must be in [1, E={E}], got {top_n}")
    if layer is not None and not 0 <= layer < L:
        raise ValueError(f"coactivation layer must be in [0, L={L}), got {layer}")
    if max_request_bytes < 0:
        raise ValueError(f"max_request_bytes must be >= 0, got {max_request_bytes}")


# --------------------------------------------------------------------------------------------- entry point


def analyse_trace(
    path: str | os.PathLike,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    window_tokens: int = DEFAULT_WINDOW_TOKENS,
    coactivation_layer: int | None = None,
    top_n: int | None = None,
    seed: int = 0,
    test_fraction: float = 0.3,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    progress: bool = False,
    engine=None,
) -> dict:
    """All activation-pattern statistics of a trace, as the JSON-ready dict documented in docs/ANALYSIS.md.

    Per-token traces are streamed in chunks of ``chunk_tokens`` rows. ``window_tokens``: drift window (tokens in
    trace order). ``coactivation_layer``: layer whose full E x E co-activation matrix is kept (default L // 2).
    ``top_n``: n of the prefill-decode top-n overlap (default K). ``seed``, ``test_fraction``: the domain
    classifier's split. ``max_request_bytes`` bounds the per-request count vectors (S x 2 x L x E float32); when
    the trace has more requests, a seeded random subset of them is tracked (``params.tracked_requests``).
    Counts-only traces get what counts allow; the rest is null and explained under ``unavailable``.
    ``engine`` (:mod:`moeplace.engine`): analyse the shards of a per-token trace as separate tasks and merge their
    accumulators exactly (:mod:`moeplace.analyse.shards`); the answer is byte-identical to the default
    single-process stream.
    """
    meta = read_meta(path)
    L, E, K = meta.num_layers, meta.num_experts, meta.top_k
    _check_params(chunk_tokens, window_tokens, test_fraction, top_n, K, E, coactivation_layer, L, max_request_bytes)
    if meta.kind == "tokens":  # co-activation and inter-layer counters: two [L, E * E] int64 tables
        check_memory(2 * 8 * L * E * E, "the co-activation counters [L, E, E]", Path(path) / "meta.json")
    top_n = K if top_n is None else top_n
    layer = L // 2 if coactivation_layer is None else coactivation_layer
    params = {"chunk_tokens": chunk_tokens, "window_tokens": window_tokens, "coactivation_layer": layer,
              "top_n": top_n, "seed": seed, "test_fraction": test_fraction, "js_log_base": JS_LOG_BASE,
              "max_request_bytes": max_request_bytes, "tracked_requests": None}
    if meta.kind == "counts":
        return to_json(_analyse_counts(meta, str(path), read_counts(path), params))
    return to_json(_analyse_tokens(meta, str(path), params, progress, engine))


@dataclass
class TokenLabels:
    """Request-level lookups of a per-token analysis: each token's domain index and tracked-request slot.

    names: domains (sorted, then ``unknown``) [D]; rid_sorted, dom_sorted, slot_sorted: int [R] request ids sorted
    and their domain index and slot (-1: not tracked); chosen: int [S] table index (sorted order) of each slot.
    """

    names: list[str]
    rid_sorted: np.ndarray
    dom_sorted: np.ndarray
    slot_sorted: np.ndarray
    chosen: np.ndarray
    num_slots: int
    num_requests: int

    def of(self, request_id: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(domain index int [T], slot int [T]) of tokens with these request ids (unknown ids: domain unknown)."""
        R = self.num_requests
        pos = np.clip(np.searchsorted(self.rid_sorted, request_id), 0, max(R - 1, 0))
        found = self.rid_sorted[pos] == request_id if R else np.zeros(len(request_id), bool)
        dom = np.where(found, self.dom_sorted[pos] if R else 0, len(self.names) - 1)
        slot = np.where(found, self.slot_sorted[pos] if R else -1, -1)
        return dom, slot


def token_labels(meta: TraceMeta, reqs, params: dict) -> TokenLabels:
    """The :class:`TokenLabels` of a request table; sets ``params["tracked_requests"]`` (a seeded subset of the
    requests when their count vectors would exceed ``params["max_request_bytes"]``)."""
    L, E = meta.num_layers, meta.num_experts
    R = len(reqs)
    names = sorted({d for d in reqs.domain.tolist() if d != UNKNOWN}) + [UNKNOWN]
    dom_index = {d: i for i, d in enumerate(names)}
    order = np.argsort(reqs.request_id, kind="stable")
    rid_sorted = reqs.request_id[order]
    dom_sorted = np.array([dom_index[d] for d in reqs.domain[order].tolist()], dtype=np.intp)
    n_slots = min(R, max(0, int(params["max_request_bytes"]) // (2 * L * E * 4)))
    slot_sorted = np.full(R, -1, np.intp)
    chosen = np.arange(R) if n_slots == R else np.sort(np.random.default_rng(params["seed"]).choice(R, n_slots,
                                                                                                    replace=False))
    slot_sorted[chosen] = np.arange(n_slots)
    params["tracked_requests"] = n_slots
    return TokenLabels(names, rid_sorted, dom_sorted, slot_sorted, chosen, n_slots, R)


def new_accumulator(meta: TraceMeta, labels: TokenLabels, params: dict) -> TokenAccumulator:
    """The accumulator of a whole per-token analysis (the single-process path and the merge of shards)."""
    return TokenAccumulator(meta.num_layers, meta.num_experts, meta.top_k, num_domains=len(labels.names),
                            num_slots=labels.num_slots, window_tokens=params["window_tokens"])


def _analyse_tokens(meta: TraceMeta, path: str, params: dict, progress: bool, engine=None) -> dict:
    labels = token_labels(meta, read_requests(path), params)
    if engine is not None:
        from moeplace.analyse.shards import accumulate_shards

        acc = accumulate_shards(path, meta, labels, params, engine)
        return summarise_tokens(meta, path, params, labels, acc)
    acc = new_accumulator(meta, labels, params)
    total = num_token_rows(path)
    with tqdm(total=total, unit="tok", unit_scale=True, disable=not progress, desc="analyse") as bar:
        for ch in iter_token_chunks(path, chunk_tokens=params["chunk_tokens"], columns_weights=False):
            dom, slot = labels.of(ch.request_id)
            acc.update(ch.expert_ids, ch.request_id, ch.position, ch.phase, dom, slot)
            bar.update(len(ch))
    acc.finish()
    return summarise_tokens(meta, path, params, labels, acc)


def summarise_tokens(meta: TraceMeta, path: str, params: dict, labels: TokenLabels, acc: TokenAccumulator) -> dict:
    """The JSON-ready answer of a per-token analysis from its finished accumulator."""
    L, E, K = meta.num_layers, meta.num_experts, meta.top_k
    names, R, n_slots = labels.names, labels.num_requests, labels.num_slots
    dom_sorted, chosen = labels.dom_sorted, labels.chosen
    acc.finish()
    T = acc.num_tokens
    unavailable: dict[str, str] = {}
    load_pd = acc.load.sum(1)  # [2, L, E]
    load = load_pd.sum(0)
    tok_phase = load_pd.sum((1, 2)) / (L * K)
    n_tokens = {"total": T, "prefill": int(round(tok_phase[PREFILL])), "decode": int(round(tok_phase[DECODE]))}
    out: dict = {"schema_version": SCHEMA_VERSION,
                 "meta": _meta_json(meta, path, n_tokens, R, None), "params": params}
    out["load"] = {"counts": load, "prefill": load_pd[PREFILL] if load_pd[PREFILL].sum() else None,
                   "decode": load_pd[DECODE] if load_pd[DECODE].sum() else None}
    out["imbalance"] = _imbalance(load)
    out["imbalance"]["by_phase"] = {}
    for name, ph in (("prefill", PREFILL), ("decode", DECODE)):
        if load_pd[ph].sum() > 0:
            out["imbalance"]["by_phase"][name] = _imbalance(load_pd[ph])
        else:
            out["imbalance"]["by_phase"][name] = None
            unavailable[f"imbalance.by_phase.{name}"] = f"the trace has no {name} tokens"
    load_dom = acc.load.sum(0)  # [D, L, E]
    out["imbalance"]["by_domain"] = {n: _imbalance(load_dom[i]) for i, n in enumerate(names) if load_dom[i].sum()}

    # per-request vectors (tracked requests only)
    req_dom = np.full(n_slots, -1, np.intp)
    req_dom[np.arange(n_slots)] = dom_sorted[chosen]
    has_tokens = acc.req.sum((1, 2, 3)) > 0
    X = acc.req.sum(1)[has_tokens]
    out["domain"] = _domain_section(names, load_dom, load_dom.sum((1, 2)) / (L * K), X, req_dom[has_tokens],
                                    "requests", params["seed"], params["test_fraction"], unavailable)

    pd = prefill_decode_correlation(acc.req[:, PREFILL], acc.req[:, DECODE], params["top_n"])
    if len(pd["requests"]):
        sec = {"top_n": params["top_n"], "num_requests": len(pd["requests"])}
        for k in ("pearson", "spearman", "top_n_overlap"):
            per_layer = _nanmean(pd[k], axis=0)
            sec[k] = per_layer
            sec[f"{k}_mean"] = float(_nanmean(per_layer))
        out["prefill_decode"] = sec
    else:
        out["prefill_decode"] = _null_section(PD_KEYS, top_n=params["top_n"], num_requests=0)
        unavailable["prefill_decode"] = "no request has both prefill and decode tokens" + (
            "" if n_tokens["prefill"] else " (the trace has no prefill tokens)")

    min_count = max(1, math.ceil(MIN_PAIR_SUPPORT * T))  # few-token pairs have huge, meaningless lifts
    layer = params["coactivation_layer"]
    if K >= 2 and T:
        lift = coactivation_lift(acc.coact, load)
        supported = np.where(acc.coact >= min_count, lift, np.nan)
        out["coactivation"] = {
            "top_pairs": top_pairs(acc.coact, lift, NUM_TOP_PAIRS, by="count"),
            "top_lift_pairs": top_pairs(acc.coact, lift, NUM_TOP_PAIRS, by="lift", min_count=min_count),
            "max_lift": np.nanmax(np.where(np.isfinite(supported), supported, -np.inf), axis=(1, 2)),
            "min_count": min_count, "layer": layer, "counts": acc.coact[layer], "lift": lift[layer],
        }
    else:
        out["coactivation"] = _null_section(COACT_KEYS, layer=layer, min_count=min_count)
        unavailable["coactivation"] = "top-k is 1: no expert pairs within a token" if K < 2 else "no tokens"

    if L >= 2 and T:
        ilift = interlayer_lift(acc.inter, load, T)
        supported = np.where(acc.inter >= min_count, ilift, np.nan)
        out["interlayer"] = {
            "top_pairs": top_pairs(acc.inter, ilift, NUM_TOP_PAIRS, by="count", symmetric=False),
            "top_lift_pairs": top_pairs(acc.inter, ilift, NUM_TOP_PAIRS, by="lift", min_count=min_count,
                                        symmetric=False),
            "max_lift": np.nanmax(np.where(np.isfinite(supported), supported, -np.inf), axis=(1, 2)),
            "follow_share": follow_share(acc.inter, K), "follow_share_random": K / E, "min_count": min_count,
        }
    else:
        out["interlayer"] = _null_section(INTER_KEYS, follow_share_random=K / E, min_count=min_count)
        unavailable["interlayer"] = "the model has one MoE layer" if L < 2 else "no tokens"

    if acc.overlap_pairs:
        ov = acc.overlap_sum / (acc.overlap_pairs * K)
        out["temporal"] = {"decode_overlap": ov, "decode_overlap_mean": float(ov.mean()), "random_overlap": K / E,
                           "num_pairs": acc.overlap_pairs}
    else:
        out["temporal"] = _null_section(TEMPORAL_KEYS, random_overlap=K / E, num_pairs=0)
        unavailable["temporal"] = "no two consecutive decode tokens of one request (positions p, p+1)"

    W = params["window_tokens"]
    n_win = len(acc.split_js)
    if len(acc.drift_js):
        dj = np.stack(acc.drift_js)  # [windows-1, L]
        sj = np.stack(acc.split_js)
        out["drift"] = {"window_tokens": W, "num_windows": n_win, "js": _nanmean(dj, 0),
                        "js_mean": float(_nanmean(dj)), "js_series": _nanmean(dj, 1),
                        "split_half_js": _nanmean(sj, 0), "split_half_js_mean": float(_nanmean(sj))}
    else:
        out["drift"] = _null_section(DRIFT_KEYS, window_tokens=W, num_windows=n_win)
        unavailable["drift"] = (f"needs at least 2 full windows of {W} tokens, the trace has {T} tokens "
                                "(lower --window-tokens)")
    out["groups"] = None
    out["unavailable"] = unavailable
    return out


def _analyse_counts(meta: TraceMeta, path: str, counts: Counts, params: dict) -> dict:
    L, E, K = meta.num_layers, meta.num_experts, meta.top_k
    c = np.where(np.isfinite(counts.counts), counts.counts, 0.0)  # [G, L, E]; NaN = not recorded
    G = len(counts)
    nt = np.where(np.isfinite(counts.num_tokens), counts.num_tokens, 0.0)
    n_tokens = {"total": float(nt.sum()), "prefill": float(nt[counts.phase == PREFILL].sum()),
                "decode": float(nt[counts.phase == DECODE].sum())}
    reqs = read_requests(path)
    unavailable: dict[str, str] = {}
    out: dict = {"schema_version": SCHEMA_VERSION, "meta": _meta_json(meta, path, n_tokens, len(reqs), G),
                 "params": {**params, "tracked_requests": None}}
    load = c.sum(0)
    by_phase = {n: c[counts.phase == ph].sum(0) for n, ph in (("prefill", PREFILL), ("decode", DECODE))}
    out["load"] = {"counts": load, "prefill": by_phase["prefill"] if by_phase["prefill"].sum() else None,
                   "decode": by_phase["decode"] if by_phase["decode"].sum() else None}
    out["imbalance"] = _imbalance(load)
    out["imbalance"]["by_phase"] = {}
    for n, lp in by_phase.items():
        out["imbalance"]["by_phase"][n] = _imbalance(lp) if lp.sum() else None
        if not lp.sum():
            unavailable[f"imbalance.by_phase.{n}"] = f"no count group is marked {n}"
    dom = [str(d) for d in counts.domain.tolist()]
    names = sorted({d for d in dom if d != UNKNOWN}) + [UNKNOWN]
    di = np.array([names.index(d) for d in dom], dtype=np.intp)
    load_dom = np.stack([c[di == i].sum(0) for i in range(len(names))])
    tok_dom = np.array([nt[di == i].sum() for i in range(len(names))])
    out["imbalance"]["by_domain"] = {n: _imbalance(load_dom[i]) for i, n in enumerate(names) if load_dom[i].sum()}
    has = c.sum((1, 2)) > 0
    out["domain"] = _domain_section(names, load_dom, tok_dom, c[has], di[has], "count groups", params["seed"],
                                    params["test_fraction"], unavailable)
    per_group = [load_stats(c[g]) for g in range(G)]
    out["groups"] = {
        "order": [str(g) for g in counts.group.tolist()], "domain": dom, "phase": counts.phase,
        "num_tokens": counts.num_tokens,
        **{k: np.array([s[k] for s in per_group]).reshape(G, L) for k in ("max_over_mean", "gini")},
    }
    why = "counts-only trace: needs per-token routing (which experts each token selected together)"
    out["prefill_decode"] = _null_section(PD_KEYS, top_n=params["top_n"], num_requests=0)
    unavailable["prefill_decode"] = "counts-only trace: needs per-request prefill and decode counts"
    out["coactivation"] = _null_section(COACT_KEYS, layer=params["coactivation_layer"])
    unavailable["coactivation"] = why
    out["interlayer"] = _null_section(INTER_KEYS, follow_share_random=K / E)
    unavailable["interlayer"] = why
    out["temporal"] = _null_section(TEMPORAL_KEYS, random_overlap=K / E, num_pairs=0)
    unavailable["temporal"] = "counts-only trace: needs consecutive decode tokens"
    out["drift"] = _null_section(DRIFT_KEYS, window_tokens=params["window_tokens"], num_windows=0)
    unavailable["drift"] = "counts-only trace: needs tokens in trace order"
    out["unavailable"] = unavailable
    return out


def _fmt(v, fmt: str = "{:.3f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def format_summary(res: dict) -> str:
    """The short summary table of an :func:`analyse_trace` answer, as printed by ``moeplace analyze``."""
    lines: list[str] = []
    m = res["meta"]
    tag = "  [SYNTHETIC]" if m["synthetic"] else ""
    nt = m["num_tokens"]
    lines.append(f"{m['model']}{tag}: {m['kind']} trace, L={m['num_layers']} E={m['num_experts']} k={m['top_k']}, "
          f"{nt['total']:,.0f} tokens (prefill {nt['prefill']:,.0f}, decode {nt['decode']:,.0f}), "
          f"{m['num_requests']:,} requests")
    imb, dom, pd, tm, dr = res["imbalance"], res["domain"], res["prefill_decode"], res["temporal"], res["drift"]
    mom = [v for v in imb["max_over_mean"] if v is not None]
    rows = [
        ("max/mean expert load", _fmt(imb["layer_mean"]["max_over_mean"], "{:.2f}"),
         f"layers {min(mom):.2f} .. {max(mom):.2f}" if mom else ""),
        ("Gini of expert load", _fmt(imb["layer_mean"]["gini"]), ""),
        ("top-10% experts' share", _fmt(imb["layer_mean"]["top10_share"], "{:.1%}"), ""),
        ("domain JS divergence (bits)", _fmt(dom["js_divergence_mean"], "{:.4f}"), ", ".join(dom["order"])),
        ("domain classification", _fmt(dom["classification_accuracy"], "{:.1%}"),
         "" if dom["classification"]["chance"] is None else f"majority baseline {dom['classification']['chance']:.1%}"),
        ("prefill-decode Pearson", _fmt(pd["pearson_mean"]), f"{pd['num_requests']} requests"),
        ("decode overlap with prev token", _fmt(tm["decode_overlap_mean"], "{:.1%}"),
         f"random {tm['random_overlap']:.1%}"),
        ("drift JS between windows", _fmt(dr["js_mean"], "{:.4f}"),
         "" if dr["split_half_js_mean"] is None else f"split-half reference {dr['split_half_js_mean']:.4f}"),
    ]
    top = res["coactivation"]["top_lift_pairs"]
    if top:
        p = top[0]
        rows.append(("strongest co-activation", f"lift {p['lift']:.1f}",
                     f"layer {p['layer']}, experts {p['experts'][0]}+{p['experts'][1]} ({p['count']:,.0f} tokens; "
                     f"among pairs in >= {MIN_PAIR_SUPPORT:.0%} of tokens)"))
    w = max(len(r[0]) for r in rows)
    for name, val, note in rows:
        lines.append(f"  {name:<{w}}  {val:>8}  {note}")
    if res["unavailable"]:
        lines.append("  unavailable: " + "; ".join(f"{k} ({v})" for k, v in res["unavailable"].items()))
    return "\n".join(lines)
