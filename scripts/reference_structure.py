"""Structure numbers of a per-token routing trace (written for the reference model's card).

Shape legend: T = tokens, R = requests, L = MoE layers, E = experts, K = top-k, D = domains.

Self-contained numpy over the trace store (so it can check moeplace.analyse rather than depend on it):

- expert load per layer: max/mean (1.0 = perfectly balanced), coefficient of variation, share of the top 10%;
- domain specificity: accuracy of predicting a request's domain from its expert-count vector (per-layer
  frequencies, [L*E]) on a stratified held-out half of the requests, with a nearest-centroid (cosine) and a
  softmax-regression classifier, against the majority baseline; Jensen-Shannon divergence (base 2, in [0, 1])
  between the domains' expert-frequency vectors per layer, with a noise floor (two random halves of one domain);
- prefill-decode correlation: per request and layer, Pearson correlation of the prefill and the decode
  expert-count vectors, averaged; baseline: the same with another request's decode vector (same domain, and
  another domain), which tells request-specific from domain-generic agreement;
- sub-domain specificity (when request sources are ``<domain>/<subdomain>``): the same classifiers over the
  sub-domain labels with at least ``MIN_LABEL`` requests, and within each domain;
- group-limited routing (when ``meta.extra`` has ``expert_groups``/``topk_groups``, DeepSeek-V3 style): how many
  groups (expert // (E / groups)) each token-layer's K experts fall in, against the limit;
- decode temporal overlap: per layer, the share of a decode token's K experts that the same request's previous
  decode token also chose; baseline: the same share for two decode tokens of different requests.

Usage::

    python scripts/reference_structure.py src/moeplace/data/reference-default.trace [--json out.json] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from moeplace.io import atomic_write_json
from moeplace.trace.reader import read_trace
from moeplace.trace.types import DECODE, PREFILL


def request_counts(request_id: np.ndarray, ids_TLK: np.ndarray, num_experts: int, rids: np.ndarray) -> np.ndarray:
    """Expert-selection counts per request: [R, L, E] for the requests ``rids`` (tokens of other requests ignored)."""
    r_index = {int(r): i for i, r in enumerate(rids.tolist())}
    row = np.array([r_index.get(int(r), -1) for r in request_id])
    keep = row >= 0
    T, L, K = ids_TLK.shape
    out = np.zeros((len(rids), L, num_experts), dtype=np.int64)
    r_TLK = np.broadcast_to(row[:, None, None], ids_TLK.shape)[keep]
    l_TLK = np.broadcast_to(np.arange(L)[None, :, None], ids_TLK.shape)[keep]
    np.add.at(out, (r_TLK.ravel(), l_TLK.ravel(), ids_TLK[keep].astype(np.int64).ravel()), 1)
    return out


def load_stats(load_LE: np.ndarray) -> dict:
    """Per-layer balance of [L, E] counts."""
    mean = load_LE.mean(axis=1)
    top = max(1, int(round(0.1 * load_LE.shape[1])))
    srt = np.sort(load_LE, axis=1)[:, ::-1]
    return {
        "max_over_mean": (load_LE.max(axis=1) / mean).tolist(),
        "cv": (load_LE.std(axis=1) / mean).tolist(),
        "top10pct_share": (srt[:, :top].sum(axis=1) / load_LE.sum(axis=1)).tolist(),
        "min_over_mean": (load_LE.min(axis=1) / mean).tolist(),
    }


def js_divergence(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Jensen-Shannon divergence in bits over the last axis of two distributions."""
    p = p / p.sum(axis=-1, keepdims=True)
    q = q / q.sum(axis=-1, keepdims=True)
    m = 0.5 * (p + q)

    def kl(a: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(a > 0, a * np.log2(a / m), 0.0)
        return t.sum(axis=-1)

    return 0.5 * kl(p) + 0.5 * kl(q)


def features(counts_RLE: np.ndarray) -> np.ndarray:
    """Per-layer expert frequencies, flattened: [R, L*E]."""
    tot = counts_RLE.sum(axis=2, keepdims=True)
    return (counts_RLE / np.maximum(tot, 1)).reshape(len(counts_RLE), -1)


def stratified_halves(labels: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of a train half and a test half with each label split evenly."""
    rng = np.random.default_rng(seed)
    tr, te = [], []
    for lab in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == lab))
        tr.append(idx[: len(idx) // 2])
        te.append(idx[len(idx) // 2:])
    return np.concatenate(tr), np.concatenate(te)


def nearest_centroid_accuracy(x: np.ndarray, y: np.ndarray, tr: np.ndarray, te: np.ndarray) -> float:
    classes = np.unique(y[tr])
    cent = np.stack([x[tr][y[tr] == c].mean(axis=0) for c in classes])
    cent /= np.linalg.norm(cent, axis=1, keepdims=True) + 1e-12
    xt = x[te] / (np.linalg.norm(x[te], axis=1, keepdims=True) + 1e-12)
    pred = classes[np.argmax(xt @ cent.T, axis=1)]
    return float((pred == y[te]).mean())


def softmax_regression_accuracy(x: np.ndarray, y: np.ndarray, tr: np.ndarray, te: np.ndarray,
                                l2: float = 1e-2, iters: int = 500, lr: float = 0.5) -> float:
    """Multinomial logistic regression on standardised features, full-batch gradient descent."""
    classes = np.unique(y[tr])
    mu, sd = x[tr].mean(axis=0), x[tr].std(axis=0) + 1e-6
    xtr, xte = (x[tr] - mu) / sd, (x[te] - mu) / sd
    onehot = (y[tr][:, None] == classes[None, :]).astype(float)
    w = np.zeros((x.shape[1], len(classes)))
    b = np.zeros(len(classes))
    for _ in range(iters):
        z = xtr @ w + b
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        g = (p - onehot) / len(xtr)
        w -= lr * (xtr.T @ g + l2 * w)
        b -= lr * g.sum(axis=0)
    pred = classes[np.argmax(xte @ w + b, axis=1)]
    return float((pred == y[te]).mean())


def row_pearson(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pearson correlation of matching rows of [N, E]; NaN where a row is constant."""
    a = a - a.mean(axis=1, keepdims=True)
    b = b - b.mean(axis=1, keepdims=True)
    den = np.sqrt((a * a).sum(axis=1) * (b * b).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (a * b).sum(axis=1) / den, np.nan)


MIN_LABEL = 10  # a sub-domain needs this many requests to be classified (5 per half)


def groups_per_token(ids_TLK: np.ndarray, num_experts: int, num_groups: int) -> np.ndarray:
    """Number of distinct expert groups (contiguous blocks of E / num_groups ids) among each token-layer's K
    experts: [T, L] int."""
    g = ids_TLK // (num_experts // num_groups)  # [T, L, K]
    hit = np.zeros(g.shape[:2] + (num_groups,), dtype=bool)
    t, la, _ = np.indices(g.shape)
    hit[t.ravel(), la.ravel(), g.ravel()] = True
    return hit.sum(axis=2)


def set_overlap(a_NLK: np.ndarray, b_NLK: np.ndarray) -> np.ndarray:
    """Share of the K ids of ``a`` that also appear in ``b``, per row and layer: [N, L] in [0, 1]."""
    return (a_NLK[..., :, None] == b_NLK[..., None, :]).any(axis=-1).mean(axis=-1)


def temporal_overlap(request_id: np.ndarray, position: np.ndarray, ids_TLK: np.ndarray, seed: int) -> dict:
    """Consecutive-decode-token overlap per layer, and a different-request baseline (decode rows only given)."""
    order = np.lexsort((position, request_id))
    r, p, x = request_id[order], position[order], ids_TLK[order]
    nxt = np.flatnonzero((r[1:] == r[:-1]) & (p[1:] == p[:-1] + 1))
    if not len(nxt):
        return {"pairs": 0}
    ov = set_overlap(x[nxt], x[nxt + 1])  # [N, L]
    rng = np.random.default_rng(seed)
    other = rng.integers(0, len(x), size=len(nxt))
    keep = r[other] != r[nxt]
    base = set_overlap(x[nxt][keep], x[other][keep])
    return {"pairs": int(len(nxt)), "mean": float(ov.mean()), "per_layer": ov.mean(axis=0).tolist(),
            "baseline_other_request": float(base.mean())}


def label_accuracy(cnt: np.ndarray, labels: np.ndarray, seed: int) -> dict:
    """Classifiers of ``labels`` [R] from expert counts [R, L, E]; labels with fewer than MIN_LABEL requests are
    left out (and listed)."""
    names, n = np.unique(labels, return_counts=True)
    kept = set(names[n >= MIN_LABEL].tolist())
    sel = np.array([lab in kept for lab in labels])
    out: dict = {"labels": {str(a): int(b) for a, b in zip(names, n, strict=True) if a in kept},
                 "left_out_fewer_than_min": {str(a): int(b) for a, b in zip(names, n, strict=True) if a not in kept}}
    if len(kept) < 2:
        return out
    x, y = features(cnt[sel]), labels[sel]
    trn, tst = stratified_halves(y, seed)
    out.update({
        "requests": int(sel.sum()),
        "majority_baseline": float(max(np.mean(y[tst] == c) for c in kept)),
        "nearest_centroid_accuracy": nearest_centroid_accuracy(x, y, trn, tst),
        "softmax_regression_accuracy": softmax_regression_accuracy(x, y, trn, tst),
    })
    return out


def structure(path: str, seed: int = 0) -> dict:
    tr = read_trace(path)
    meta, tok, req = tr.meta, tr.tokens, tr.requests
    if tok is None:
        raise ValueError(f"{path}: a counts-only trace; this script needs per-token routing")
    L, E, K = meta.num_layers, meta.num_experts, meta.top_k
    ids = tok.expert_ids.astype(np.int64)  # [T, L, K]
    load = np.zeros((L, E), dtype=np.int64)
    for layer in range(L):
        load[layer] = np.bincount(ids[:, layer].ravel(), minlength=E)
    out: dict = {"trace": path, "model": meta.model, "L": L, "E": E, "K": K, "requests": len(req),
                 "tokens": {"prefill": int((tok.phase == PREFILL).sum()), "decode": int((tok.phase == DECODE).sum())}}
    ls = load_stats(load)
    out["load"] = {"per_layer": ls, **{f"mean_{k}": float(np.mean(v)) for k, v in ls.items()}}
    for name, ph in (("prefill", PREFILL), ("decode", DECODE)):
        sel = ids[tok.phase == ph]
        if len(sel):
            lp = np.stack([np.bincount(sel[:, layer].ravel(), minlength=E) for layer in range(L)])
            out["load"][f"mean_max_over_mean_{name}"] = float(np.mean(load_stats(lp)["max_over_mean"]))

    rids = req.request_id
    dom = np.asarray(req.domain).astype(str)
    domains = sorted(set(dom.tolist()))
    srt = np.argsort(rids)
    t_dom = dom[srt][np.searchsorted(rids[srt], tok.request_id)]  # [T]: each token's request's domain
    out["load"]["mean_max_over_mean_by_domain"] = {}
    for d in domains:
        sel = ids[t_dom == d]
        ld = np.stack([np.bincount(sel[:, layer].ravel(), minlength=E) for layer in range(L)])
        out["load"]["mean_max_over_mean_by_domain"][d] = float(np.mean(load_stats(ld)["max_over_mean"]))
    cnt = request_counts(tok.request_id, ids, E, rids)  # [R, L, E]
    pre = request_counts(tok.request_id[tok.phase == PREFILL], ids[tok.phase == PREFILL], E, rids)
    dec = request_counts(tok.request_id[tok.phase == DECODE], ids[tok.phase == DECODE], E, rids)

    # Domain specificity.
    x = features(cnt)
    trn, tst = stratified_halves(dom, seed)
    majority = max(np.mean(dom[tst] == d) for d in domains)
    per_layer_nc = [nearest_centroid_accuracy(features(cnt[:, [layer]]), dom, trn, tst) for layer in range(L)]
    out["domain"] = {
        "domains": {d: int((dom == d).sum()) for d in domains},
        "split": f"stratified halves, seed {seed}: {len(trn)} train / {len(tst)} test requests",
        "majority_baseline": float(majority),
        "nearest_centroid_accuracy": nearest_centroid_accuracy(x, dom, trn, tst),
        "softmax_regression_accuracy": softmax_regression_accuracy(x, dom, trn, tst),
        "nearest_centroid_accuracy_per_layer": per_layer_nc,
        "prefill_only_nearest_centroid_accuracy": nearest_centroid_accuracy(features(pre), dom, trn, tst),
        "decode_only_nearest_centroid_accuracy": nearest_centroid_accuracy(features(dec), dom, trn, tst),
    }
    freq = {d: cnt[dom == d].sum(axis=0).astype(float) for d in domains}  # [L, E] each
    jsd = {f"{a}|{b}": js_divergence(freq[a], freq[b]).tolist()
           for i, a in enumerate(domains) for b in domains[i + 1:]}
    rng = np.random.default_rng(seed)
    floor = {}
    for d in domains:
        idx = rng.permutation(np.flatnonzero(dom == d))
        h = len(idx) // 2
        floor[d] = float(np.mean(js_divergence(cnt[idx[:h]].sum(axis=0) + 0.0, cnt[idx[h:]].sum(axis=0) + 0.0)))
    out["domain"]["jsd_bits_mean_over_layers"] = {k: float(np.mean(v)) for k, v in jsd.items()}
    out["domain"]["jsd_bits_per_layer_mean_over_pairs"] = np.mean(list(jsd.values()), axis=0).tolist()
    out["domain"]["jsd_bits_mean"] = float(np.mean(list(jsd.values())))
    out["domain"]["jsd_noise_floor_half_vs_half"] = floor

    # Prefill-decode correlation.
    has = (pre.sum(axis=(1, 2)) > 0) & (dec.sum(axis=(1, 2)) > 0)
    r_idx = np.flatnonzero(has)
    pear = row_pearson(pre[r_idx].reshape(-1, E).astype(float), dec[r_idx].reshape(-1, E).astype(float))
    pear = pear.reshape(len(r_idx), L)
    perm_same = np.empty_like(r_idx)
    perm_other = np.empty_like(r_idx)
    for j, r in enumerate(r_idx):
        same = r_idx[(dom[r_idx] == dom[r]) & (r_idx != r)]
        other = r_idx[dom[r_idx] != dom[r]]
        perm_same[j] = rng.choice(same) if len(same) else r
        perm_other[j] = rng.choice(other) if len(other) else r
    base_same = row_pearson(pre[r_idx].reshape(-1, E).astype(float), dec[perm_same].reshape(-1, E).astype(float))
    base_other = row_pearson(pre[r_idx].reshape(-1, E).astype(float), dec[perm_other].reshape(-1, E).astype(float))
    out["prefill_decode"] = {
        "requests": int(len(r_idx)),
        "pearson_mean": float(np.nanmean(pear)),
        "pearson_median": float(np.nanmedian(pear)),
        "pearson_per_layer": np.nanmean(pear, axis=0).tolist(),
        "pearson_per_domain": {d: float(np.nanmean(pear[dom[r_idx] == d])) for d in domains},
        "baseline_other_request_same_domain": float(np.nanmean(base_same)),
        "baseline_other_request_other_domain": float(np.nanmean(base_other)),
    }

    # Sub-domains, when the sources carry them.
    src = np.asarray(req.source).astype(str)
    sub = np.array([s.split(" (")[0] for s in src])
    if all("/" in s and s.split("/", 1)[0] == d for s, d in zip(sub, dom, strict=True)):
        out["subdomain"] = {"all": label_accuracy(cnt, sub, seed),
                            "within_domain": {d: label_accuracy(cnt[dom == d], sub[dom == d], seed) for d in domains}}

    # Group-limited routing.
    groups, limit = meta.extra.get("expert_groups"), meta.extra.get("topk_groups")
    if groups:
        gpt = groups_per_token(ids, E, int(groups))
        hist = np.bincount(gpt.ravel(), minlength=int(groups) + 1)
        out["groups"] = {"expert_groups": int(groups), "topk_groups": limit, "token_layers": int(gpt.size),
                         "max_groups_per_token_layer": int(gpt.max()),
                         "mean_groups_per_token_layer": float(gpt.mean()),
                         "histogram": {str(i): int(c) for i, c in enumerate(hist) if c},
                         "violations": int((gpt > int(limit)).sum()) if limit else None}

    # Decode temporal overlap.
    dsel = tok.phase == DECODE
    out["temporal"] = temporal_overlap(tok.request_id[dsel], tok.position[dsel], ids[dsel], seed)
    return out


def markdown(s: dict) -> str:
    d, pd, ld = s["domain"], s["prefill_decode"], s["load"]
    lines = [
        f"Trace: `{s['trace']}` ({s['requests']} requests, {s['tokens']['prefill']} prefill + "
        f"{s['tokens']['decode']} decode tokens; L={s['L']}, E={s['E']}, K={s['K']}).",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| expert load max/mean, mean over layers (all / prefill / decode) | {ld['mean_max_over_mean']:.2f} / "
        f"{ld.get('mean_max_over_mean_prefill', float('nan')):.2f} / "
        f"{ld.get('mean_max_over_mean_decode', float('nan')):.2f} |",
        "| expert load max/mean per layer | " + ", ".join(f"{v:.2f}" for v in ld["per_layer"]["max_over_mean"])
        + " |",
        "| expert load max/mean, mean over layers, one domain's tokens alone | " + ", ".join(
            f"{k} {v:.2f}" for k, v in ld.get("mean_max_over_mean_by_domain", {}).items()) + " |",
        f"| expert load CV, mean over layers | {ld['mean_cv']:.2f} |",
        f"| share of the top 10% experts, mean over layers | {ld['mean_top10pct_share']:.3f} |",
        f"| domain accuracy, softmax regression (held-out half) | {d['softmax_regression_accuracy']:.3f} |",
        f"| domain accuracy, nearest centroid (held-out half) | {d['nearest_centroid_accuracy']:.3f} |",
        f"| domain accuracy, nearest centroid, prefill only / decode only | "
        f"{d['prefill_only_nearest_centroid_accuracy']:.3f} / {d['decode_only_nearest_centroid_accuracy']:.3f} |",
        "| domain accuracy, nearest centroid, one layer at a time | "
        + ", ".join(f"{v:.2f}" for v in d["nearest_centroid_accuracy_per_layer"]) + " |",
        f"| majority baseline | {d['majority_baseline']:.3f} |",
        f"| JSD between domains (bits), mean over pairs and layers | {d['jsd_bits_mean']:.3f} |",
        "| JSD per pair | " + ", ".join(f"{k.replace('|', ' vs ')} {v:.3f}"
                                       for k, v in d["jsd_bits_mean_over_layers"].items()) + " |",
        "| JSD noise floor (half vs half of one domain) | " + ", ".join(
            f"{k} {v:.3f}" for k, v in d["jsd_noise_floor_half_vs_half"].items()) + " |",
        f"| prefill-decode Pearson, mean over requests and layers | {pd['pearson_mean']:.3f} "
        f"(median {pd['pearson_median']:.3f}) |",
        "| prefill-decode Pearson per domain | " + ", ".join(
            f"{k} {v:.3f}" for k, v in pd["pearson_per_domain"].items()) + " |",
        "| prefill-decode Pearson per layer | " + ", ".join(f"{v:.2f}" for v in pd["pearson_per_layer"]) + " |",
        f"| baseline: another request's decode, same domain / other domain | "
        f"{pd['baseline_other_request_same_domain']:.3f} / {pd['baseline_other_request_other_domain']:.3f} |",
    ]
    if "subdomain" in s:
        a = s["subdomain"]["all"]
        if "softmax_regression_accuracy" in a:
            lines.append(f"| sub-domain accuracy, softmax regression / nearest centroid ({len(a['labels'])} "
                         f"sub-domains with >= {MIN_LABEL} requests; majority {a['majority_baseline']:.3f}) | "
                         f"{a['softmax_regression_accuracy']:.3f} / {a['nearest_centroid_accuracy']:.3f} |")
        within = [f"{d} {v['softmax_regression_accuracy']:.3f} ({len(v['labels'])} labels, majority "
                  f"{v['majority_baseline']:.3f})" for d, v in s["subdomain"]["within_domain"].items()
                  if "softmax_regression_accuracy" in v]
        if within:
            lines.append("| sub-domain accuracy within a domain, softmax regression | " + ", ".join(within) + " |")
    if "groups" in s:
        g = s["groups"]
        lines.append(f"| group-limited routing: most groups per token-layer (limit {g['topk_groups']} of "
                     f"{g['expert_groups']}); mean; violations | {g['max_groups_per_token_layer']}; "
                     f"{g['mean_groups_per_token_layer']:.2f}; {g['violations']} of {g['token_layers']:,} |")
    t = s.get("temporal", {})
    if t.get("pairs"):
        lines.append(f"| decode temporal overlap (share of a token's experts its predecessor chose), mean over "
                     f"layers / per layer | {t['mean']:.3f} / " + ", ".join(f"{v:.2f}" for v in t["per_layer"])
                     + f" (other-request baseline {t['baseline_other_request']:.3f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="per-token trace directory")
    ap.add_argument("--json", help="write the numbers as JSON to this file")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table (default: JSON to stdout)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the request split and the baselines")
    args = ap.parse_args(argv)
    try:
        s = structure(args.trace, args.seed)
        if args.json:
            atomic_write_json(s, args.json)
    except (OSError, ValueError) as e:  # TraceError is a ValueError and names the file
        print(f"reference_structure: error: {e}", file=sys.stderr)
        return 2
    print(markdown(s) if args.markdown else json.dumps(s, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
