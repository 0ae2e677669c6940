"""The analysis report: one self-contained HTML file (inline CSS, figures as base64 PNGs, no network resources).

It is drawn from the JSON dict of :func:`moeplace.analyse.analyse_trace` alone, so a saved ``analysis.json`` can be
rendered again later. Shape legend: L = MoE layers, E = logical experts, D = domains.
"""

from __future__ import annotations

import base64
import html
import io
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import TwoSlopeNorm  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from moeplace.analyse.summary import MIN_PAIR_SUPPORT  # noqa: E402
from moeplace.htmlstyle import BASE_CSS  # noqa: E402
from moeplace.io import atomic_write_text  # noqa: E402

_CSS = BASE_CSS + """.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{border:1px solid #e1e4ea;border-radius:6px;padding:8px 14px;min-width:150px;background:#fafbfc}
.card b{display:block;font-size:20px}
.card span{font-size:12px;color:#5b6475}
figure{margin:8px 0}
figure img{max-width:100%;height:auto;display:block}
figcaption{font-size:12px;color:#5b6475;margin-top:2px}
.scroll{overflow-x:auto}
"""


def _num(v, fmt: str = "{:.3f}") -> str:
    if v is None:
        return '<span class="na">n/a</span>'
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return f"{int(v):,}"
    return fmt.format(float(v))


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(fig, caption: str, alt: str) -> str:
    return (f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{_png(fig)}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def _arr(v) -> np.ndarray:
    """JSON list (None = unavailable) to a float array with NaN."""
    return np.array([[np.nan if x is None else x for x in row] if isinstance(row, list) else
                     (np.nan if row is None else row) for row in v], dtype=np.float64)


def _layer_labels(res: dict) -> list[str]:
    lm = res["meta"].get("moe_layer_map")
    L = res["meta"]["num_layers"]
    return [str(i) if lm is None else f"{i} ({lm[i]})" for i in range(L)]


def _table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{h}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<div class="scroll"><table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table></div>'


# --------------------------------------------------------------------------------------------- figures


def _fig_load(res: dict) -> str:
    load = _arr(res["load"]["counts"])  # [L, E]
    L, E = load.shape
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = load / load.mean(1, keepdims=True)
    fig, ax = plt.subplots(figsize=(min(13, 3 + E * 0.12), min(9, 1.6 + L * 0.22)))
    im = ax.imshow(rel, aspect="auto", cmap="magma", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    labels = _layer_labels(res)
    step = max(1, L // 16)
    ax.set_yticks(range(0, L, step), labels[::step])
    fig.colorbar(im, ax=ax, label="load / layer mean")
    ax.set_title("Expert load per layer (1 = balanced)")
    return _figure(fig, "Token-expert selections per layer and expert, divided by the layer's mean. Bright cells "
                   "are hot experts.", "expert load heatmap")


def _fig_imbalance(res: dict) -> str:
    imb = res["imbalance"]
    L = res["meta"]["num_layers"]
    x = np.arange(L)
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.4))
    series = [(k, v) for k, v in imb["by_phase"].items() if v is not None]
    for ax, key in zip(axes, ("max_over_mean", "gini"), strict=True):
        ax.plot(x, _arr(imb[key]), color="black", lw=2.5, alpha=0.35, label="all tokens")
        for name, st in series:
            ax.plot(x, _arr(st[key]), marker="o", ms=3, label=name)
    axes[0].axhline(1.0, color="#999", lw=0.8, ls="--")
    axes[0].set_title("max / mean expert load")
    axes[1].set_title("Gini of expert load")
    for ax in axes:
        ax.set_xlabel("MoE layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _figure(fig, "Load imbalance per layer, over all tokens and by phase.", "imbalance per layer")


def _profile_layers(L: int) -> list[int]:
    return sorted({0, L // 2, L - 1})


def _fig_domains(res: dict) -> str:
    dom = res["domain"]
    order = dom["order"]
    freq = _arr(dom["frequency"]) if order else None  # [D, L, E]
    if freq is None or freq.ndim != 3:
        return ""
    D, L, E = freq.shape
    layers = _profile_layers(L)
    labels = _layer_labels(res)
    has_js = dom["js_divergence"] is not None
    fig, axes = plt.subplots(1, len(layers) + has_js, figsize=(4.3 * (len(layers) + has_js), 0.9 + 0.38 * D + 1.4),
                             squeeze=False)
    axes = axes[0]
    vmax = np.nanmax(freq * E) if np.isfinite(freq).any() else 1.0
    for n, (ax, lyr) in enumerate(zip(axes, layers, strict=False)):
        im = ax.imshow(freq[:, lyr] * E, aspect="auto", cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
        ax.set_yticks(range(D), order if n == 0 else [])
        ax.set_xlabel("expert")
        ax.set_title(f"layer {labels[lyr]}")
    fig.colorbar(im, ax=list(axes[: len(layers)]), label="share x E (1 = uniform)", shrink=0.9)
    if has_js:
        ax = axes[-1]
        js = _arr(dom["js_divergence"])
        im2 = ax.imshow(js, cmap="Reds", vmin=0, interpolation="nearest")
        ax.set_xticks(range(D), order, rotation=45, ha="right")
        ax.set_yticks(range(D), order)
        for i in range(D):
            for j in range(D):
                if np.isfinite(js[i, j]):
                    ax.text(j, i, f"{js[i, j]:.3f}", ha="center", va="center", fontsize=7,
                            color="white" if js[i, j] > 0.6 * np.nanmax(js) else "black")
        ax.set_title("JS divergence (bits)")
        fig.colorbar(im2, ax=ax, shrink=0.9)
    return _figure(fig, "Per-domain expert frequency profiles (share of the layer's selections times E) and the "
                   "pairwise Jensen-Shannon divergence between domains.", "domain load profiles")


def _fig_prefill_decode(res: dict) -> str:
    pre, dec = res["load"]["prefill"], res["load"]["decode"]
    pd = res["prefill_decode"]
    if pre is None or dec is None or pd["pearson"] is None:
        return ""
    pre, dec = _arr(pre), _arr(dec)
    L, E = pre.shape
    with np.errstate(invalid="ignore", divide="ignore"):
        ps = pre / pre.sum(1, keepdims=True) * E
        ds = dec / dec.sum(1, keepdims=True) * E
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    layer_idx = np.repeat(np.arange(L), E)
    sc = axes[0].scatter(ps.ravel(), ds.ravel(), c=layer_idx, cmap="viridis", s=9, alpha=0.7)
    hi = np.nanmax([np.nanmax(ps), np.nanmax(ds), 1.0])
    axes[0].plot([0, hi], [0, hi], color="#999", lw=0.8, ls="--")
    axes[0].set_xlabel("prefill load share x E")
    axes[0].set_ylabel("decode load share x E")
    axes[0].set_title("Prefill vs decode load, one dot per (layer, expert)")
    fig.colorbar(sc, ax=axes[0], label="MoE layer")
    x = np.arange(L)
    names = (("pearson", "Pearson"), ("spearman", "Spearman"), ("top_n_overlap", f"top-{pd['top_n']} overlap"))
    for key, name in names:
        axes[1].plot(x, _arr(pd[key]), marker="o", ms=3, label=name)
    axes[1].set_ylim(-0.05, 1.05)
    axes[1].set_xlabel("MoE layer")
    axes[1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[1].set_title(f"Per-request correlation, mean over {pd['num_requests']} requests")
    axes[1].grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    return _figure(fig, "Left: aggregate load of every expert in prefill and in decode. Right: per request and "
                   "layer, the correlation of its prefill and decode expert counts, averaged over requests.",
                   "prefill vs decode scatter")


def _support() -> str:
    """The minimum support of a lift, as text ("1%")."""
    return f"{MIN_PAIR_SUPPORT:.0%}"


def _fig_coactivation(res: dict) -> str:
    co = res["coactivation"]
    if co["lift"] is None:
        return ""
    lift = _arr(co["lift"])
    counts = _arr(co["counts"])
    E = lift.shape[0]
    with np.errstate(divide="ignore", invalid="ignore"):
        lg = np.where(counts >= max(co["min_count"], 1), np.log2(lift), np.nan)  # rare pairs: grey
    lim = 3.0  # colours saturate at 8x above or below independence
    lg = np.clip(lg, -lim, lim)
    fig, axes = plt.subplots(1, 2, figsize=(12.5, 5.2))
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="#dddddd")
    im = axes[0].imshow(lg, cmap=cmap, norm=TwoSlopeNorm(0.0, -lim, lim), interpolation="nearest")
    fig.colorbar(im, ax=axes[0], label="log2 lift (0 = independent, clipped at +-3)", shrink=0.85, extend="both")
    axes[0].set_title(f"Co-activation lift, layer {co['layer']}")
    im2 = axes[1].imshow(counts, cmap="Blues", interpolation="nearest")
    fig.colorbar(im2, ax=axes[1], label="tokens selecting both", shrink=0.85)
    axes[1].set_title(f"Co-activation counts, layer {co['layer']}")
    for ax in axes:
        ax.set_xlabel("expert")
        ax.set_ylabel("expert")
    return _figure(fig, f"Expert pairs in one token's top-k in layer {co['layer']} ({E} experts). Lift compares "
                   "the count with random pairing that keeps each expert's load; grey: seen in fewer than "
                   f"{co['min_count']:,} tokens ({_support()} of the trace: the minimum support for a lift).",
                   "co-activation heatmap")


def _share_panel(ax, values, random_level: float, color: str, xlabel: str, title: str) -> None:
    """One per-layer share curve (0..1) with its random-routing level as a dashed line."""
    ax.plot(_arr(values), marker="o", ms=3, color=color)
    ax.axhline(random_level, color="#999", ls="--", lw=0.8, label="random")
    ax.set_ylim(0, 1)
    ax.set_xlabel(xlabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _fig_locality(res: dict) -> str:
    tm, il, dr = res["temporal"], res["interlayer"], res["drift"]
    panels = [p for p in (tm["decode_overlap"] is not None, il["follow_share"] is not None,
                          dr["js_series"] is not None) if p]
    if not panels:
        return ""
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.4), squeeze=False)
    axes = list(axes[0])
    if tm["decode_overlap"] is not None:
        _share_panel(axes.pop(0), tm["decode_overlap"], tm["random_overlap"], "#2b8a3e", "MoE layer",
                     "Decode: experts shared with previous token")
    if il["follow_share"] is not None:
        _share_panel(axes.pop(0), il["follow_share"], il["follow_share_random"], "#5f3dc4",
                     "layer l (pair l -> l+1)", "Inter-layer: share to top-k successors")
    if dr["js_series"] is not None:
        ax = axes.pop(0)
        ax.plot(_arr(dr["js_series"]), marker=".", color="#c92a2a", label="window vs next")
        if dr["split_half_js_mean"] is not None:
            ax.axhline(dr["split_half_js_mean"], color="#999", ls="--", lw=0.8, label="split-half reference")
        ax.set_xlabel(f"window ({dr['window_tokens']} tokens)")
        ax.set_ylim(bottom=0)
        ax.set_title("Drift: JS divergence (bits)", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return _figure(fig, "Temporal locality in decode, inter-layer affinity and drift of the load over the trace.",
                   "locality and drift")


# --------------------------------------------------------------------------------------------- sections


def _cards(res: dict) -> str:
    imb, dom, pd, tm = res["imbalance"], res["domain"], res["prefill_decode"], res["temporal"]
    items = [
        (_num(imb["layer_mean"]["max_over_mean"], "{:.2f}"), "max/mean load (mean over layers)"),
        (_num(imb["layer_mean"]["gini"], "{:.3f}"), "Gini (mean over layers)"),
        (_num(dom["js_divergence_mean"], "{:.4f}"), "domain JS divergence (bits)"),
        (_num(dom["classification_accuracy"], "{:.1%}"), "domain from expert counts (held out)"),
        (_num(pd["pearson_mean"], "{:.3f}"), "prefill-decode Pearson"),
        (_num(tm["decode_overlap_mean"], "{:.1%}"), "experts kept by next decode token"),
    ]
    return '<div class="cards">' + "".join(f'<div class="card"><b>{v}</b><span>{k}</span></div>'
                                           for v, k in items) + "</div>"


def _layer_table(res: dict) -> str:
    imb, pd, tm, il, co = (res[k] for k in ("imbalance", "prefill_decode", "temporal", "interlayer", "coactivation"))
    labels = _layer_labels(res)
    L = len(labels)
    follow = None if il["follow_share"] is None else list(il["follow_share"]) + [None]
    cols = [  # (heading, per-layer values or None, format); columns with no value at all are left out
        ("max/mean", imb["max_over_mean"], "{:.2f}"), ("CV", imb["cv"], "{:.3f}"), ("Gini", imb["gini"], "{:.3f}"),
        ("top-10% share", imb["top10_share"], "{:.1%}"), ("PD Pearson", pd["pearson"], "{:.3f}"),
        ("PD Spearman", pd["spearman"], "{:.3f}"), (f"PD top-{pd['top_n']}", pd["top_n_overlap"], "{:.1%}"),
        ("decode overlap", tm["decode_overlap"], "{:.1%}"), (f"max pair lift (&ge; {_support()} tokens)",
                                                             co["max_lift"], "{:.1f}"),
        ("l->l+1 follow", follow, "{:.1%}"),
    ]
    cols = [c for c in cols if c[1] is not None and any(v is not None for v in c[1])]
    rows = [[labels[i]] + [_num(v[i], f) for _, v, f in cols] for i in range(L)]
    return _table(["layer (model)"] + [c[0] for c in cols], rows)


def _domain_tables(res: dict) -> str:
    dom = res["domain"]
    order = dom["order"]
    parts = []
    byd = res["imbalance"]["by_domain"]
    if byd:
        rows = [[html.escape(d), _num(st["layer_mean"]["max_over_mean"], "{:.2f}"), _num(st["layer_mean"]["gini"]),
                 _num(st["layer_mean"]["top10_share"], "{:.1%}"), _num(st["num_selections"], "{:,.0f}")]
                for d, st in byd.items()]
        parts.append(_table(["domain", "max/mean", "Gini", "top-10% share", "selections"], rows))
    if dom["js_divergence"] is not None:
        js = dom["js_divergence"]
        parts.append("<p class='note'>Jensen-Shannon divergence between domains (bits, log base 2; 0 = same "
                     "expert usage, 1 = disjoint), mean over layers:</p>")
        parts.append(_table([""] + [html.escape(d) for d in order],
                            [[html.escape(d)] + [_num(v, "{:.4f}") for v in row] for d, row in zip(order, js,
                                                                                                   strict=True)]))
    cl = dom["classification"]
    if dom["classification_accuracy"] is not None:
        parts.append(f"<p class='note'>Domain predicted from the expert-count vector of held-out "
                     f"{cl['samples']}: accuracy <b>{dom['classification_accuracy']:.1%}</b> on {cl['num_test']} "
                     f"({cl['num_train']} for training; majority-class baseline {cl['chance']:.1%}). "
                     f"Classifier: {html.escape(cl['classifier'])}, seed {cl['seed']}.</p>")
        conf = cl["confusion"]
        parts.append(_table(["true \\ predicted"] + [html.escape(d) for d in cl["order"]],
                            [[html.escape(d)] + [_num(int(v)) for v in row]
                             for d, row in zip(cl["order"], conf, strict=True)]))
    return "".join(parts)


def _pairs_table(pairs, arrow: str, labels: list[str]) -> str:
    if not pairs:
        return '<p class="na">none</p>'
    rows = [[labels[p["layer"]] if arrow == "&harr;" else f"{p['layer']} &rarr; {p['layer'] + 1}",
             f"{p['experts'][0]} {arrow} {p['experts'][1]}", _num(p["count"], "{:,.0f}"), _num(p["lift"], "{:.2f}")]
            for p in pairs[:10]]
    return _table(["layer", "experts", "tokens", "lift"], rows)


def _na(res: dict, *keys: str) -> str:
    un = res.get("unavailable") or {}
    return "".join(f"<p class='na'>{html.escape(k)}: {html.escape(un[k])}</p>" for k in keys if k in un)


def _pairs_section(res: dict, labels: list[str]) -> str:
    co, il = res["coactivation"], res["interlayer"]
    parts = [_fig_coactivation(res) or _na(res, "coactivation")]
    if co["top_pairs"] is not None:
        n = co["min_count"]
        parts += ["<h3>Most frequent pairs in one token's top-k</h3>", _pairs_table(co["top_pairs"], "&harr;", labels),
                  f"<h3>Highest-lift pairs (seen in at least {n:,} token{'' if n == 1 else 's'})</h3>",
                  f"<p class='note'>Only pairs seen in at least {_support()} of the tokens rank by lift: a pair seen "
                  "in a handful of tokens can have a lift in the thousands by chance.</p>",
                  _pairs_table(co["top_lift_pairs"], "&harr;", labels)]
    if il["top_pairs"] is not None:
        parts += ["<h3>Highest-lift layer-to-layer pairs</h3>", _pairs_table(il["top_lift_pairs"], "&rarr;", labels)]
    else:
        parts.append(_na(res, "interlayer"))
    return "".join(parts)


def _unavailable(res: dict) -> str:
    un = res.get("unavailable") or {}
    if not un:
        return "<p class='note'>Every metric was computed.</p>"
    return "<ul>" + "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in un.items()) + "</ul>"


def render_report(res: dict) -> str:
    """The HTML report (a string) of one analysis result (the dict of ``analyse_trace`` or its saved JSON)."""
    for key in ("meta", "imbalance", "domain", "prefill_decode", "coactivation", "temporal", "drift", "load"):
        if key not in res:
            raise ValueError(f"analysis result lacks the key {key!r}; expected the output of analyse_trace")
    m = res["meta"]
    synthetic = bool(m.get("synthetic"))
    title = f"Expert activation patterns: {m['model']}" + (" [SYNTHETIC]" if synthetic else "")
    badge = '<span class="badge">SYNTHETIC</span>' if synthetic else ""
    nt = m["num_tokens"]
    sub = (f"{m['kind']} trace {html.escape(str(m['trace']))} &middot; L={m['num_layers']} MoE layers, "
           f"E={m['num_experts']} experts, top-{m['top_k']} &middot; {_num(nt['total'], '{:,.0f}')} tokens "
           f"(prefill {_num(nt['prefill'], '{:,.0f}')}, decode {_num(nt['decode'], '{:,.0f}')}) &middot; "
           f"{m['num_requests']:,} requests" + (f", {m['num_count_groups']} count groups"
                                                 if m.get("num_count_groups") is not None else ""))
    if m.get("source"):
        sub += f" &middot; source: {html.escape(m['source'])}"
    labels = _layer_labels(res)
    body = [
        f"<section><h2>Summary</h2>{_cards(res)}</section>",
        f"<section><h2>Expert load</h2>{_fig_load(res)}{_fig_imbalance(res)}</section>",
        f"<section><h2>Domains</h2>{_fig_domains(res) or ''}{_domain_tables(res) or ''}"
        + ("" if res["domain"]["js_divergence"] is not None else
           f"<p class='na'>{html.escape(res['unavailable'].get('domain', 'unavailable'))}</p>") + "</section>",
        "<section><h2>Prefill vs decode</h2>"
        + (_fig_prefill_decode(res) or f"<p class='na'>{html.escape(res['unavailable'].get('prefill_decode', ''))}"
           "</p>") + "</section>",
        f"<section><h2>Co-activation and inter-layer affinity</h2>{_pairs_section(res, labels)}</section>",
        "<section><h2>Locality and drift</h2>" + (_fig_locality(res) or _na(res, "temporal", "drift"))
        + _drift_note(res) + "</section>",
        f"<section><h2>Per layer</h2>{_layer_table(res)}</section>",
        f"<section><h2>Not available for this trace</h2>{_unavailable(res)}</section>",
    ]
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
        f"<header><h1>{html.escape(title.replace(' [SYNTHETIC]', ''))}{badge}</h1><p>{sub}</p></header>"
        f"<main>{''.join(body)}</main></body></html>\n"
    )


def _drift_note(res: dict) -> str:
    dr, tm = res["drift"], res["temporal"]
    parts = []
    if tm["decode_overlap_mean"] is not None:
        parts.append(f"Consecutive decode tokens of a request share {tm['decode_overlap_mean']:.1%} of their experts "
                     f"on average over layers ({tm['num_pairs']:,} pairs; random routing: {tm['random_overlap']:.1%}).")
    if dr["js_mean"] is not None:
        parts.append(f"Load drift between consecutive windows of {dr['window_tokens']:,} tokens: "
                     f"{dr['js_mean']:.4f} bits on average ({dr['num_windows']} windows); within-window split-half "
                     f"reference {_num(dr['split_half_js_mean'], '{:.4f}')} bits.")
    return f"<p class='note'>{' '.join(parts)}</p>" if parts else ""


def write_report(res: dict, path: str | os.PathLike) -> Path:
    """Write the HTML report of ``res`` to ``path`` atomically (parents created); returns the path."""
    return atomic_write_text(render_report(res), Path(path), what="the HTML report")
