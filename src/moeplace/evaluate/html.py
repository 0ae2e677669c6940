"""The compare report: one self-contained HTML page of a :func:`moeplace.evaluate.compare.compare` answer (inline
CSS and hand-built SVG; no script, no network resource), written by ``moeplace compare --html``.

Sections: the table of every strategy's held-out metrics; the frontier (layer time per micro-batch, inter-node
bytes / linear and balancedness, one point per strategy, with joint's balance-floor sweep when it was run); per-GPU
load bars; traffic heatmaps (bytes from source GPU to destination GPU). Every mark carries its number in a
``<title>`` (hover) and ``data-`` attributes, so a reader and a test can check it. Synthetic traces are labelled.

Shape legend: W = GPUs, N = nodes, G = GPUs per node (GPU ``g`` on node ``g // G``).
"""

from __future__ import annotations

import html
import os
from pathlib import Path

import numpy as np

from moeplace.deploy import parse_cluster
from moeplace.evaluate.compare import TABLE_COLUMNS, format_cell
from moeplace.htmlstyle import BASE_CSS
from moeplace.io import atomic_write_text
from moeplace.placement import Cluster

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
           "#bcbd22")  # one colour per strategy, in the answer's order
MARKERS = ("circle", "square", "triangle", "diamond", "triangle-down", "pentagon", "star", "plus", "cross",
           "hexagon")  # one marker shape per strategy, in the answer's order (with PALETTE: colour and shape)
NODE_COLORS = ("#4c6ef5", "#12b886", "#f59f00", "#e64980", "#7950f2", "#15aabf", "#fd7e14", "#82c91e")
MAX_MATRIX_GPUS = 64  # larger clusters get a node x node traffic matrix (a W x W one would be W*W marks each)
PHASES = ("decode", "prefill")
_KEYS = {"decode": ("load_per_gpu", "traffic_matrix_bytes"),
         "prefill": ("prefill_load_per_gpu", "prefill_traffic_matrix_bytes")}

_CSS = BASE_CSS + """h3{font-size:14px;margin:8px 0 4px}
.warn{font-size:13px;color:#d9480f;font-weight:600}
.grid{display:flex;flex-wrap:wrap;gap:14px}
.panel{border:1px solid #e1e4ea;border-radius:6px;padding:6px 10px;background:#fafbfc}
.panel p{font-size:12px;color:#5b6475;margin:2px 0;max-width:360px}
svg text{font-family:inherit;fill:#3d4555}
svg.key{vertical-align:-2px;margin:0 4px 0 6px}
.panel.empty{display:flex;align-items:center;justify-content:center;width:300px}
.panel.empty p{font-size:13px;text-align:center}
"""


def _esc(x) -> str:
    return html.escape(str(x), quote=True)


def _bytes(v: float) -> str:
    """Decimal units: 1 KB = 1e3 bytes."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.2f} {unit}"
    return f"{v:.0f} B"


def _ticks(lo: float, hi: float, n: int = 5) -> np.ndarray:
    """About ``n`` round tick values covering [lo, hi]."""
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(n).tick_values(lo, hi)


def _span(vals: list[float]) -> tuple[float, float]:
    lo, hi = min(vals), max(vals)
    pad = (hi - lo) * 0.08 or max(abs(hi) * 0.05, 1e-9)
    return lo - pad, hi + pad


# --------------------------------------------------------------------------------------------- SVG charts


def _marker(shape: str, cx: float, cy: float, color: str, r: float = 5.5, title: str | None = None) -> str:
    """One marker of ``shape`` (see MARKERS) centred on (cx, cy): translucent fill, solid outline, so a marker
    drawn on another one leaves both outlines visible."""
    style = f'class="marker" data-shape="{shape}" fill="{color}" fill-opacity="0.3" stroke="{color}" stroke-width="1.6"'
    inner = "/>" if title is None else f"><title>{_esc(title)}</title></{'circle' if shape == 'circle' else 'polygon'}>"
    if shape == "circle":
        return f'<circle {style} cx="{cx:.1f}" cy="{cy:.1f}" r="{r:.1f}"{inner}'
    a = r * 0.9
    pts = {
        "square": [(-a, -a), (a, -a), (a, a), (-a, a)],
        "triangle": [(0, -1.2 * r), (1.1 * r, 0.8 * r), (-1.1 * r, 0.8 * r)],
        "diamond": [(0, -1.3 * r), (1.1 * r, 0), (0, 1.3 * r), (-1.1 * r, 0)],
        "triangle-down": [(0, 1.2 * r), (1.1 * r, -0.8 * r), (-1.1 * r, -0.8 * r)],
        "pentagon": [(1.15 * r * np.sin(t), -1.15 * r * np.cos(t)) for t in np.arange(5) * 2 * np.pi / 5],
        "hexagon": [(1.15 * r * np.sin(t), -1.15 * r * np.cos(t)) for t in np.arange(6) * 2 * np.pi / 6],
        "star": [((1.35 if i % 2 == 0 else 0.6) * r * np.sin(t), -(1.35 if i % 2 == 0 else 0.6) * r * np.cos(t))
                 for i, t in enumerate(np.arange(10) * np.pi / 5)],
        "plus": [(-a / 3, -a), (a / 3, -a), (a / 3, -a / 3), (a, -a / 3), (a, a / 3), (a / 3, a / 3), (a / 3, a),
                 (-a / 3, a), (-a / 3, a / 3), (-a, a / 3), (-a, -a / 3), (-a / 3, -a / 3)],
        "cross": [(x * 0.7071 - y * 0.7071, x * 0.7071 + y * 0.7071) for x, y in
                  [(-a / 3, -a * 1.2), (a / 3, -a * 1.2), (a / 3, -a / 3), (a * 1.2, -a / 3), (a * 1.2, a / 3),
                   (a / 3, a / 3), (a / 3, a * 1.2), (-a / 3, a * 1.2), (-a / 3, a / 3), (-a * 1.2, a / 3),
                   (-a * 1.2, -a / 3), (-a / 3, -a / 3)]],
    }[shape]
    d = " ".join(f"{cx + x:.1f},{cy + y:.1f}" for x, y in pts)
    return f'<polygon {style} points="{d}"{inner}'


def _text_width(text: str, size: float) -> float:
    """A generous estimate of the width (px) of ``text`` in the page's sans-serif font at ``size`` px: wider than
    the browser draws it, so space laid out with it never clips (the chromium test measures the real width)."""
    return 0.64 * size * len(text)


def _legend(entries: list[tuple[str, str, str]], x0: float, y0: float, width: float) -> tuple[list[str], float]:
    """Legend entries (label, shape, colour) flowed left to right in rows inside [x0, x0 + width]; returns the
    SVG elements and the height used."""
    out, x, y, row_h = [], x0, y0 + 8, 15
    for label, shape, color in entries:
        w = 16 + _text_width(label, 10) + 10
        if x > x0 and x + w > x0 + width:
            x, y = x0, y + row_h
        out.append(f'<g class="legend-entry">{_marker(shape, x + 6, y, color, r=4.5)}'
                   f'<text x="{x + 16:.1f}" y="{y + 3.5:.1f}" font-size="10">{_esc(label)}</text></g>')
        x += w
    return out, y - y0 + 10


def _scatter(points: list[dict], xlabel: str, ylabel: str, kind: str,
             lines: list[tuple[str, str, list[tuple[float, float, str]]]]) -> str:
    """An x-y chart: ``points`` are dicts (name, x, y, color, shape, tip); ``lines`` (strategy, color,
    [(x, y, tip)]) are sweeps, drawn dashed through hollow circles (hover: the tip). Strategies are told apart by
    colour and marker shape, named in a legend under the axes (no labels beside the points, which collide and
    clip); a point drawn on an earlier one says so in the legend."""
    w, h, ml, mr, mt, mb = 360, 280, 58, 14, 12, 44
    xs = [p["x"] for p in points] + [q[0] for _, _, pts in lines for q in pts]
    ys = [p["y"] for p in points] + [q[1] for _, _, pts in lines for q in pts]
    x0, x1 = _span(xs)
    y0, y1 = _span(ys)
    xt = [t for t in _ticks(x0, x1) if x0 <= t <= x1]
    yt = [t for t in _ticks(y0, y1) if y0 <= t <= y1]
    x0, x1 = min([x0, *xt]), max([x1, *xt])
    y0, y1 = min([y0, *yt]), max([y1, *yt])

    def px(x: float) -> float:
        return ml + (x - x0) / (x1 - x0) * (w - ml - mr)

    def py(y: float) -> float:
        return h - mb - (y - y0) / (y1 - y0) * (h - mt - mb)

    drawn: list[tuple[str, float, float]] = []
    entries = []
    for p in points:
        cx, cy = px(p["x"]), py(p["y"])
        on = [n for n, a, b in drawn if abs(cx - a) < 6 and abs(cy - b) < 6]
        drawn.append((p["name"], cx, cy))
        entries.append((p["name"] + (f" (same point as {', '.join(on)})" if on else ""), p["shape"], p["color"]))
    legend, lh = _legend(entries, 8, h, w - 16)
    H = h + lh
    out = [f'<svg class="chart frontier" data-kind="{kind}" width="{w}" height="{H:.0f}" viewBox="0 0 {w} {H:.0f}" '
           f'xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{_esc(ylabel)} vs {_esc(xlabel)}">',
           f'<rect x="{ml}" y="{mt}" width="{w - ml - mr}" height="{h - mt - mb}" fill="#fff" stroke="#ccd"/>']
    for t in xt:
        out.append(f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{mt}" y2="{h - mb}" stroke="#eef"/>'
                   f'<text x="{px(t):.1f}" y="{h - mb + 14}" font-size="10" text-anchor="middle">{t:g}</text>')
    for t in yt:
        out.append(f'<line x1="{ml}" x2="{w - mr}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#eef"/>'
                   f'<text x="{ml - 4}" y="{py(t) + 3:.1f}" font-size="10" text-anchor="end">{t:g}</text>')
    out.append(f'<text x="{(ml + w - mr) / 2}" y="{h - 8}" font-size="11" text-anchor="middle">{_esc(xlabel)}</text>'
               f'<text transform="translate(13 {(mt + h - mb) / 2}) rotate(-90)" font-size="11" '
               f'text-anchor="middle">{_esc(ylabel)}</text>')
    for name, color, pts in lines:
        pts = sorted(pts)
        d = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y, _ in pts)
        out.append(f'<g class="sweep" data-strategy="{_esc(name)}"><polyline points="{d}" fill="none" '
                   f'stroke="{color}" stroke-width="1.5" stroke-dasharray="4 3"/>')
        out += [f'<circle class="sweep-point" cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5" fill="#fff" stroke="{color}" '
                f'stroke-width="1.5"><title>{_esc(t)}</title></circle>' for x, y, t in pts]
        out.append("</g>")
    for p, (_, cx, cy) in zip(points, drawn, strict=True):
        out.append(f'<g class="point" data-strategy="{_esc(p["name"])}" data-x="{p["x"]!r}" data-y="{p["y"]!r}">'
                   f'{_marker(p["shape"], cx, cy, p["color"], title=p["tip"])}</g>')
    out += legend
    out.append("</svg>")
    return "".join(out)


def _bars(load: list[float], gpus_per_node: int, ymax: float, strategy: str, phase: str) -> str:
    """Token-expert pairs per GPU, coloured by node, with the mean as a dashed line."""
    W = len(load)
    bw = max(4.0, min(50.0, 360.0 / W))
    ml, mt, mb = 56, 10, 30
    pw = bw * W
    w, h = ml + pw + 10, 190
    ph = h - mt - mb
    ymax = ymax or 1.0
    out = [f'<svg class="chart load" data-strategy="{_esc(strategy)}" data-phase="{phase}" width="{w:.0f}" '
           f'height="{h}" viewBox="0 0 {w:.0f} {h}" xmlns="http://www.w3.org/2000/svg" role="img" '
           f'aria-label="{_esc(strategy)} {phase} load per GPU">']
    for t in _ticks(0, ymax, 4):
        if t <= ymax:
            y = mt + ph - t / ymax * ph
            out.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eef"/>'
                       f'<text x="{ml - 4}" y="{y + 3:.1f}" font-size="10" text-anchor="end">{t:,.0f}</text>')
    for g, v in enumerate(load):
        bh = v / ymax * ph
        x = ml + g * bw
        out.append(f'<rect class="bar" data-gpu="{g}" data-value="{v!r}" x="{x + 0.1 * bw:.1f}" '
                   f'y="{mt + ph - bh:.2f}" width="{0.8 * bw:.1f}" height="{bh:.2f}" '
                   f'fill="{NODE_COLORS[(g // gpus_per_node) % len(NODE_COLORS)]}">'
                   f"<title>GPU {g} (node {g // gpus_per_node}): {v:,.0f} pairs</title></rect>")
        if W <= 32:
            out.append(f'<text x="{x + bw / 2:.1f}" y="{mt + ph + 12}" font-size="9" text-anchor="middle">{g}</text>')
    mean = float(np.mean(load)) if W else 0.0
    ym = mt + ph - mean / ymax * ph
    out.append(f'<line class="mean" x1="{ml}" x2="{ml + pw}" y1="{ym:.2f}" y2="{ym:.2f}" stroke="#1d2330" '
               f'stroke-dasharray="5 3"><title>mean {mean:,.1f} pairs</title></line>'
               f'<text x="{ml + pw / 2}" y="{h - 4}" font-size="10" text-anchor="middle">GPU</text></svg>')
    return "".join(out)


def _heatmap(M: np.ndarray, vmax: float, group: int, strategy: str, phase: str, unit: str) -> str:
    """M: [n, n] bytes source (row) -> destination (column); ``group`` rows per node (1 for a node matrix, whose
    diagonal is intra-node traffic; a GPU matrix's diagonal stays on the GPU and is drawn grey)."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    cmap = colormaps["Blues"]
    n = M.shape[0]
    c = max(6.0, min(40.0, 320.0 / n))
    ml, mt = 40, 26
    w, h = ml + c * n + 10, mt + c * n + 10
    out = [f'<svg class="chart traffic" data-strategy="{_esc(strategy)}" data-phase="{phase}" data-unit="{unit}" '
           f'width="{w:.0f}" height="{h:.0f}" viewBox="0 0 {w:.0f} {h:.0f}" xmlns="http://www.w3.org/2000/svg" '
           f'role="img" aria-label="{_esc(strategy)} {phase} traffic matrix">',
           f'<text x="{ml + c * n / 2:.1f}" y="10" font-size="10" text-anchor="middle">destination {unit}</text>',
           f'<text transform="translate(10 {mt + c * n / 2:.1f}) rotate(-90)" font-size="10" '
           f'text-anchor="middle">source {unit}</text>']
    for i in range(n):
        if n <= 32:
            out.append(f'<text x="{ml + (i + 0.5) * c:.1f}" y="{mt - 3}" font-size="9" text-anchor="middle">{i}</text>'
                       f'<text x="{ml - 3}" y="{mt + (i + 0.6) * c:.1f}" font-size="9" text-anchor="end">{i}</text>')
        for j in range(n):
            v = float(M[i, j])
            own = i == j and unit == "GPU"
            fill = "#eeeeee" if own else to_hex(cmap(0.05 + 0.95 * v / vmax if vmax > 0 else 0.05))
            cross = "inter-node" if i // group != j // group else ("same GPU" if own else "intra-node")
            out.append(f'<rect class="cell" data-src="{i}" data-dst="{j}" data-value="{v!r}" x="{ml + j * c:.1f}" '
                       f'y="{mt + i * c:.1f}" width="{c:.1f}" height="{c:.1f}" fill="{fill}">'
                       f"<title>{unit} {i} -> {unit} {j} ({cross}): {_bytes(v)}</title></rect>")
    for k in range(group, n, group) if group < n else ():  # node boundaries
        z = k * c
        out.append(f'<line x1="{ml + z:.1f}" x2="{ml + z:.1f}" y1="{mt}" y2="{mt + c * n:.1f}" stroke="#d9480f"/>'
                   f'<line x1="{ml}" x2="{ml + c * n:.1f}" y1="{mt + z:.1f}" y2="{mt + z:.1f}" stroke="#d9480f"/>')
    out.append("</svg>")
    return "".join(out)


# --------------------------------------------------------------------------------------------- sections


def _table(result: dict) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for _, h, _ in TABLE_COLUMNS)
    rows = []
    for i, (name, row) in enumerate(result["strategies"].items()):
        cells = [format_cell(k, row.get(k), fmt) for k, _, fmt in TABLE_COLUMNS]
        tds = "".join(f'<td data-key="{k}">{c}</td>' if c is not None else f'<td data-key="{k}" class="na">-</td>'
                      for (k, _, _), c in zip(TABLE_COLUMNS, cells, strict=True))
        color, shape = _style(i)
        rows.append(f'<tr data-strategy="{_esc(name)}"><td><svg class="key" width="14" height="14" '
                    f'viewBox="0 0 14 14" aria-hidden="true">{_marker(shape, 7, 7, color, r=4.5)}</svg>'
                    f"{_esc(name)}</td>{tds}</tr>")
    return f"<table><thead><tr><th>strategy</th>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _style(i: int) -> tuple[str, str]:
    """Colour and marker shape of the ``i``-th strategy of an answer (the same in the table and every chart)."""
    return PALETTE[i % len(PALETTE)], MARKERS[i % len(MARKERS)]


def _frontier(result: dict, styles: dict[str, tuple[str, str]]) -> str:
    rows = result["strategies"]

    def tip(n: str, r: dict) -> str:
        parts = [n, f"inter-node bytes / linear {r['inter_node_bytes_vs_linear']:.3f}",
                 f"balancedness {r['balancedness']:.3f}"]
        for ph in ("prefill", "decode"):
            t, v = r.get(f"{ph}_layer_time_s"), r.get(f"{ph}_layer_time_vs_eplb")
            if t is not None:
                parts.append(f"{ph} {t * 1e6:.1f} us" + (f" ({v:.3f}x eplb)" if v is not None else ""))
        return "; ".join(parts)

    panels = []
    for ph in ("prefill", "decode"):
        key = f"{ph}_layer_time_s"
        pts = [{"name": n, "x": r["inter_node_bytes_vs_linear"], "y": r[key] * 1e6, "color": styles[n][0],
                "shape": styles[n][1], "tip": tip(n, r)} for n, r in rows.items() if r.get(key) is not None]
        if pts:
            panels.append((_scatter(pts, "inter-node bytes / linear", f"{ph} MoE layer time per micro-batch (us)",
                                    f"{ph}_time", []),
                           f"{ph.capitalize()}: predicted MoE layer time (dispatch + expert compute + combine, "
                           "slowest GPU of each micro-batch) against inter-node bytes. Lower left is better."))
        else:
            panels.append((None, f"{ph.capitalize()}: no {ph} micro-batches in this trace, so there is no {ph} "
                           "layer time to plot."))
    # the floor sweep: each floored strategy re-planned at every floor (its first point is its compare row, which
    # the marker shows; the dashed line joins only the re-planned points, so it is the frontier the floors trace)
    sweep = {n: [p for p in pts if p.get("balance_floor") is not None]
             for n, pts in (result.get("frontier") or {}).items()}
    sweep = {n: pts for n, pts in sweep.items() if pts}

    def sweep_tip(n: str, p: dict) -> str:
        return (f"{n} --objective {p.get('objective') or 'bytes'} --balance-floor {p['balance_floor']:g}: "
                f"inter-node bytes / linear {p['inter_node_bytes_vs_linear']:.3f}, "
                f"balancedness {p['balancedness']:.3f}")

    lines = [(n, styles.get(n, ("#555",))[0],
              [(p["balancedness"], p["inter_node_bytes_vs_linear"], sweep_tip(n, p)) for p in pts])
             for n, pts in sweep.items()]
    pts = [{"name": n, "x": r["balancedness"], "y": r["inter_node_bytes_vs_linear"], "color": styles[n][0],
            "shape": styles[n][1], "tip": tip(n, r)} for n, r in rows.items()]
    cap = "Balancedness (mean/max GPU load per layer, averaged) against inter-node bytes. Lower right is better."
    for n, pts_n in sweep.items():
        floors = ", ".join(f"{p['balance_floor']:g}" for p in pts_n)
        cap += (f" Dashed through hollow circles: {n} re-planned at balance floors {floors} "
                f"(--objective {pts_n[0].get('objective') or 'bytes'}; hover a circle for its floor).")
    panels.append((_scatter(pts, "balancedness (held-out)", "inter-node bytes / linear", "balance", lines), cap))
    return '<div class="grid">' + "".join(
        f'<div class="panel">{svg}<p>{_esc(c)}</p></div>' if svg else
        f'<div class="panel empty"><p class="na">{_esc(c)}</p></div>'
        for svg, c in panels) + "</div>"


def _phases(result: dict) -> list[str]:
    rows = result["strategies"].values()
    return [ph for ph in PHASES if any(r.get(_KEYS[ph][0]) is not None for r in rows)]


def _no_phase(result: dict) -> list[str]:
    """A line for each phase the answer has no rows of, while it has the other's (a decode-only trace)."""
    have = _phases(result)
    return [f"<h3>{ph.capitalize()}</h3><p class='na'>no {ph} micro-batches in this trace</p>"
            for ph in PHASES if have and ph not in have]


def _load(result: dict, cluster: Cluster) -> str:
    rows = result["strategies"]
    parts = []
    for ph in _phases(result):
        key = _KEYS[ph][0]
        ymax = max(max(r[key]) for r in rows.values() if r.get(key) is not None)
        panels = []
        for n, r in rows.items():
            load = r.get(key)
            if load is None:
                continue
            mm = float(np.mean(load) / max(load)) if max(load) > 0 else 1.0
            bal = r["balancedness"] if ph == "decode" else None
            cap = f"{n}: {sum(load):,.0f} pairs; mean/max of these totals {mm:.3f}"
            cap += f"; balancedness per layer, averaged: {bal:.3f}" if bal is not None else ""
            panels.append(f'<div class="panel"><h3>{_esc(n)}</h3>{_bars(load, cluster.gpus_per_node, ymax, n, ph)}'
                          f"<p>{_esc(cap)}</p></div>")
        parts.append(f"<h3>{ph.capitalize()}</h3><div class='grid'>{''.join(panels)}</div>")
    parts += _no_phase(result)
    if not parts:
        return "<p class='na'>The compare answer holds no per-GPU load (made before moeplace kept it).</p>"
    return ("<p class='note'>Token-expert pairs each GPU computed on the held-out window, summed over MoE layers; "
            "bars are coloured by node, the dashed line is the mean. Same scale for every strategy.</p>"
            + "".join(parts))


def _traffic(result: dict, cluster: Cluster) -> str:
    rows = result["strategies"]
    W, G, N = cluster.world_size, cluster.gpus_per_node, cluster.num_nodes
    by_node = W > MAX_MATRIX_GPUS
    parts = []
    for ph in _phases(result):
        key = _KEYS[ph][1]
        mats, split = {}, {}
        for n, r in rows.items():
            if r.get(key) is None:
                continue
            M = np.asarray(r[key], dtype=np.float64)  # [W, W]
            if M.shape != (W, W):
                raise ValueError(f"strategy {n!r}: {key} has shape {M.shape}; expected ({W}, {W}) for {cluster.spec()}")
            node = np.arange(W) // G
            cross = node[:, None] != node[None, :]
            split[n] = float(M[cross].sum()), float(M[~cross].sum() - np.trace(M))  # inter-, intra-node bytes
            mats[n] = M.reshape(N, G, N, G).sum((1, 3)) if by_node else M
        vmax = max(float(M.max()) for M in mats.values()) if mats else 0.0
        panels = []
        for n, M in mats.items():
            inter, intra = split[n]
            cap = f"{n}: inter-node {_bytes(inter)}, intra-node {_bytes(intra)}"
            panels.append(f'<div class="panel" data-inter-node-bytes="{inter!r}"><h3>{_esc(n)}</h3>'
                          f'{_heatmap(M, vmax, 1 if by_node else G, n, ph, "node" if by_node else "GPU")}'
                          f"<p>{_esc(cap)}</p></div>")
        parts.append(f"<h3>{ph.capitalize()} (darkest cell: {_bytes(vmax)})</h3><div class='grid'>{''.join(panels)}"
                     "</div>")
    parts += _no_phase(result)
    if not parts:
        return "<p class='na'>The compare answer holds no traffic matrices (made before moeplace kept them).</p>"
    what = f"node to node ({W} GPUs are too many to draw one by one)" if by_node else "GPU to GPU"
    return (f"<p class='note'>Bytes sent {what} on the held-out window (dispatch plus the returning combine, "
            "one copy per destination GPU), summed over MoE layers. Rows are sources, columns destinations; orange "
            "lines mark node boundaries, so off-diagonal blocks are inter-node traffic. Same colour scale for every "
            "strategy within a phase.</p>" + "".join(parts))


def render_compare_html(result: dict) -> str:
    """The HTML page (a string) of one compare answer (the dict of :func:`moeplace.evaluate.compare.compare` or
    :func:`~moeplace.evaluate.compare.run_compare`, or its saved JSON)."""
    for key in ("trace", "cluster", "strategies", "num_redundant"):
        if key not in result:
            raise ValueError(f"compare result lacks the key {key!r}; expected the output of moeplace compare")
    if not result["strategies"]:
        raise ValueError("compare result has no strategies")
    hw = result.get("cluster_hardware")  # the compared cluster with its links (older answers: the shape only)
    cluster = Cluster.from_json(hw) if hw else parse_cluster(result["cluster"])
    synthetic = bool(result.get("synthetic"))
    styles = {n: _style(i) for i, n in enumerate(result["strategies"])}
    title = f"Placement strategies compared: {result['trace']} on {result['cluster']}"
    badge = '<span class="badge">SYNTHETIC</span>' if synthetic else ""
    sub = (f"{cluster.num_nodes} nodes x {cluster.gpus_per_node} GPUs, R={result['num_redundant']} redundant slots "
           f"&middot; planned on {result.get('planning_requests', '?')} requests, scored on "
           f"{result.get('held_out_requests', '?')} held-out requests ({result.get('scored_tokens', '?')} decode "
           f"tokens) &middot; split {_esc(result.get('split', '?'))}, seed {_esc(result.get('seed', '?'))}, "
           f"arrival order {_esc(result.get('arrival', '?'))}")
    warn = ("<p class='warn'>Synthetic trace: these numbers describe a generated workload, not a real model's "
            "routing.</p>") if synthetic else ""
    body = [
        f"<section id='summary'><h2>Summary</h2>{warn}{_table(result)}<p class='note'>Held-out metrics of each "
        "plan (decode rows unless marked prefill). inter/lin: inter-node bytes divided by linear placement's; "
        "balance: mean/max GPU load; pre/eplb and dec/eplb: predicted layer time over eplb's.</p></section>",
        f"<section id='frontier'><h2>Frontier: time, bytes and balance</h2>{_frontier(result, styles)}</section>",
        f"<section id='load'><h2>Per-GPU load</h2>{_load(result, cluster)}</section>",
        f"<section id='traffic'><h2>Traffic between GPUs</h2>{_traffic(result, cluster)}</section>",
    ]
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>{_esc(title)}{' [SYNTHETIC]' if synthetic else ''}</title><style>{_CSS}</style></head><body>"
            f"<header><h1>{_esc(title)}{badge}</h1><p>{sub}</p></header><main>{''.join(body)}</main></body></html>\n")


def write_compare_html(result: dict, path: str | os.PathLike) -> Path:
    """Write the HTML page of ``result`` to ``path`` atomically (parents created); returns the path."""
    return atomic_write_text(render_compare_html(result), Path(path), what="the compare HTML report")
