"""``moeplace compare --html``: a real compare of the bundled reference trace, its per-GPU rows checked against
the trace's own counts, and the page checked as text and as a headless chromium renders it (the browser test is
skipped only when chromium is not installed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from importlib import resources

import numpy as np
import pytest

from moeplace.cli import main
from moeplace.evaluate.html import render_compare_html
from moeplace.trace.reader import read_meta

TRACE = resources.files("moeplace.data") / "reference-default.trace"
MOE_STRATEGIES = ["linear", "eplb", "joint"]
SECTIONS = ["summary", "frontier", "load", "traffic"]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]
# After layout, measure what the browser drew and write it into the DOM: SVGs with a non-empty box; for each load
# chart the spread of drawn bar height / data value (0 when heights are proportional to the numbers); for each
# frontier chart whether the drawn x order of points follows their data x order.
CHECK_SCRIPT = """<script>window.addEventListener('load', function () {
  var svgs = [].slice.call(document.querySelectorAll('svg'));
  var shown = svgs.filter(function (s) { var r = s.getBoundingClientRect(); return r.width > 0 && r.height > 0; });
  var spread = 0, bars = 0;
  document.querySelectorAll('svg.load').forEach(function (s) {
    var k = [];
    s.querySelectorAll('rect.bar').forEach(function (b) {
      bars++; var v = +b.getAttribute('data-value'); if (v > 0) k.push(b.getBBox().height / v); });
    var lo = Math.min.apply(null, k), hi = Math.max.apply(null, k); spread = Math.max(spread, (hi - lo) / hi);
  });
  var misordered = 0;
  document.querySelectorAll('svg.frontier').forEach(function (s) {
    var p = [].slice.call(s.querySelectorAll('g.point')).map(function (g) {
      var c = g.querySelector('.marker').getBoundingClientRect();
      return [+g.getAttribute('data-x'), c.x + c.width / 2]; });
    p.forEach(function (a) { p.forEach(function (b) { if (a[0] < b[0] && a[1] > b[1]) misordered++; }); });
  });
  var clipped = [];  // text drawn (partly) outside its SVG's box is cut off by the browser
  svgs.forEach(function (s) {
    var box = s.getBoundingClientRect();
    s.querySelectorAll('text').forEach(function (t) {
      var r = t.getBoundingClientRect();
      if (r.left < box.left - 0.5 || r.right > box.right + 0.5 || r.top < box.top - 0.5 || r.bottom > box.bottom + 0.5)
        clipped.push(t.textContent);
    });
  });
  var d = document.createElement('div'); d.id = 'render-check';
  d.setAttribute('data-svgs', svgs.length); d.setAttribute('data-shown', shown.length);
  d.setAttribute('data-bars', bars); d.setAttribute('data-spread', spread.toFixed(6));
  d.setAttribute('data-misordered', misordered); d.setAttribute('data-clipped', clipped.length);
  d.setAttribute('data-clipped-text', clipped.join('|'));
  document.body.appendChild(d);
});</script>"""


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """The CLI run once: the compare JSON and the HTML page it wrote."""
    tmp = tmp_path_factory.mktemp("cmphtml")
    rc = main(["compare", str(TRACE), "--cluster", "2x2", "--redundant", "4", "--strategies", ",".join(MOE_STRATEGIES),
               "--quiet", "--json", str(tmp / "c.json"), "--html", str(tmp / "out" / "c.html")])
    assert rc == 0
    return json.loads((tmp / "c.json").read_text()), tmp / "out" / "c.html"


class _Marks(HTMLParser):
    """Every element's tag and attributes, and the text of each <td>."""

    def __init__(self) -> None:
        super().__init__()
        self.elems: list[tuple[str, dict]] = []
        self.cells: list[tuple[dict, str]] = []
        self._td: dict | None = None
        self._row: dict = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.elems.append((tag, a))
        if tag == "tr":
            self._row = a
        if tag == "td":
            self._td, self._text = {**a, "strategy": self._row.get("data-strategy")}, ""

    def handle_data(self, data):
        if self._td is not None:
            self._text += data

    def handle_endtag(self, tag):
        if tag == "td" and self._td is not None:
            self.cells.append((self._td, self._text.strip()))
            self._td = None


def _parse(text: str) -> _Marks:
    p = _Marks()
    p.feed(text)
    return p


def test_rows_keep_per_gpu_load_and_traffic(compared):
    res, _ = compared
    meta = read_meta(TRACE)
    pairs_per_token = meta.num_layers * meta.top_k  # every scored token computes k pairs in each MoE layer
    for name in MOE_STRATEGIES:
        row = res["strategies"][name]
        load = np.array(row["load_per_gpu"])
        assert load.shape == (4,) and load.sum() == res["scored_tokens"] * pairs_per_token
        M = np.array(row["traffic_matrix_bytes"])
        assert M.shape == (4, 4) and np.all(np.diag(M) == 0) and np.all(M >= 0)
        node = np.arange(4) // 2  # 2x2: GPUs 0, 1 on node 0
        assert M[node[:, None] != node[None, :]].sum() == pytest.approx(row["inter_node_bytes"], rel=1e-12)
        pre = np.array(row["prefill_load_per_gpu"])  # the reference trace has prefill rows
        assert pre.shape == (4,) and pre.sum() > 0 and pre.sum() % pairs_per_token == 0
    # the load bars show what balancedness summarises: eplb spreads decode load more evenly than linear
    mm = {n: np.mean(res["strategies"][n]["load_per_gpu"]) / np.max(res["strategies"][n]["load_per_gpu"])
          for n in ("linear", "eplb")}
    assert mm["eplb"] > mm["linear"]


def test_page_has_sections_and_numbers(compared):
    res, path = compared
    text = path.read_text()
    assert "<title>Placement strategies compared: moeplace-reference on 2x2</title>" in text
    assert "SYNTHETIC" not in text and "<script" not in text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), "no network resources"
    assert [m for m in re.findall(r"<section id='(\w+)'>", text)] == SECTIONS
    marks = _parse(text)
    cell = {(a["strategy"], a["data-key"]): t for a, t in marks.cells if "data-key" in a}
    for name in MOE_STRATEGIES:
        row = res["strategies"][name]
        assert cell[(name, "decode_layer_time_s")] == f"{row['decode_layer_time_s'] * 1e6:.1f}"
        assert cell[(name, "prefill_layer_time_s")] == f"{row['prefill_layer_time_s'] * 1e6:.1f}"
        assert cell[(name, "inter_node_bytes_vs_linear")] == f"{row['inter_node_bytes_vs_linear']:.3f}"
        assert cell[(name, "balancedness")] == f"{row['balancedness']:.3f}"
        assert cell[(name, "decode_layer_time_vs_eplb")] == f"{row['decode_layer_time_vs_eplb']:.3f}"
        for phase, key in (("decode", "load_per_gpu"), ("prefill", "prefill_load_per_gpu")):
            bars = [float(a["data-value"]) for t, a in _chart(marks, "load", name, phase) if t == "rect"
                    and a.get("class") == "bar"]
            assert bars == row[key]
        cells = {(int(a["data-src"]), int(a["data-dst"])): float(a["data-value"])
                 for t, a in _chart(marks, "traffic", name, "decode") if a.get("class") == "cell"}
        assert cells == {(i, j): v for i, r in enumerate(row["traffic_matrix_bytes"]) for j, v in enumerate(r)}
    frontier = [a for t, a in marks.elems if t == "svg" and "frontier" in a.get("class", "")]
    assert [a["data-kind"] for a in frontier] == ["prefill_time", "decode_time", "balance"]
    total = res["scored_tokens"] * 8 * 4  # the reference trace: 8 MoE layers, top-4
    assert all(f"{n}: {total:,} pairs" in text for n in MOE_STRATEGIES)


def _chart(marks: _Marks, kind: str, strategy: str, phase: str) -> list[tuple[str, dict]]:
    """The elements inside the one <svg class="chart KIND"> of ``strategy`` and ``phase``."""
    out, inside = [], False
    for t, a in marks.elems:
        if t == "svg":
            inside = kind in a.get("class", "") and a.get("data-strategy") == strategy and a.get("data-phase") == phase
            continue
        if inside:
            out.append((t, a))
    assert out, f"no {kind} chart for {strategy} {phase}"
    return out


def _frontier_charts(text: str) -> dict[str, str]:
    """Each frontier chart's SVG source by its data-kind."""
    return dict(re.findall(r'<svg class="chart frontier" data-kind="(\w+)"(.*?)</svg>', text, flags=re.S))


def test_frontier_names_every_strategy_whole_and_apart(compared):
    """Every strategy's name is drawn whole (as a legend entry, not a label cut at the chart's edge), and two
    strategies never share a marker: different shapes, and a point drawn on another says so."""
    res, path = compared
    names = list(res["strategies"])
    res = json.loads(json.dumps(res))
    res["strategies"]["joint"] = {**res["strategies"]["eplb"]}  # the same point as eplb in every chart
    for text in (path.read_text(), render_compare_html(res)):
        charts = _frontier_charts(text)
        assert set(charts) == {"prefill_time", "decode_time", "balance"}
        for svg in charts.values():
            drawn = re.findall(r"<text[^>]*>([^<]+)</text>", svg)
            legend = [t.split(" (same point as")[0] for t in drawn if t.split(" (")[0] in names]
            assert legend == names, drawn  # whole names, each once, in the answer's order
            shapes = re.findall(r'<g class="point" data-strategy="([^"]+)"[^>]*><\w+ class="marker" '
                                r'data-shape="([\w-]+)"', svg)
            assert [n for n, _ in shapes] == names and len({s for _, s in shapes}) == len(names)
    balance = _frontier_charts(render_compare_html(res))["balance"]
    assert "joint (same point as eplb)" in balance


def test_decode_only_answer_says_there_is_no_prefill(compared):
    res, _ = compared
    rows = {n: {k: v for k, v in r.items() if not k.startswith("prefill_")} for n, r in res["strategies"].items()}
    page = render_compare_html({**res, "strategies": rows})
    assert "Prefill: no prefill micro-batches in this trace" in page
    assert page.count("no prefill micro-batches in this trace") == 3  # frontier, load and traffic sections
    assert set(_frontier_charts(page)) == {"decode_time", "balance"}
    assert 'data-phase="prefill"' not in page  # no empty axes for the missing phase


def test_synthetic_label_and_old_answers(compared):
    res, _ = compared
    page = render_compare_html({**res, "synthetic": True})
    assert "[SYNTHETIC]</title>" in page and 'class="badge">SYNTHETIC' in page and "Synthetic trace" in page
    old = {**res, "strategies": {n: {k: v for k, v in r.items() if "per_gpu" not in k and "matrix" not in k}
                                 for n, r in res["strategies"].items()}}
    page = render_compare_html(old)  # a compare JSON saved before rows kept per-GPU data still renders
    assert "holds no per-GPU load" in page and "holds no traffic matrices" in page
    with pytest.raises(ValueError, match="strategies"):
        render_compare_html({"trace": "t", "cluster": "2x2", "num_redundant": 0})
    bad = json.loads(json.dumps(res))
    bad["strategies"]["eplb"]["traffic_matrix_bytes"] = [[0.0]]
    with pytest.raises(ValueError, match="eplb.*traffic_matrix_bytes.*expected \\(4, 4\\)"):
        render_compare_html(bad)


def test_html_option_is_checked_before_work(tmp_path, capsys):
    (tmp_path / "dir.html").mkdir()
    assert main(["compare", str(TRACE), "--cluster", "2x2", "--html", str(tmp_path / "dir.html")]) == 2
    assert "--html" in (err := capsys.readouterr().err) and "dir.html: is a directory" in err


def test_page_renders_in_chromium(compared, tmp_path):
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    _, path = compared
    checked = tmp_path / "checked.html"
    checked.write_text(path.read_text().replace("</body>", CHECK_SCRIPT + "</body>"))
    out = subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                          "--virtual-time-budget=10000", "--window-size=1300,2400", "--dump-dom", checked.as_uri()],
                         capture_output=True, text=True, timeout=120)
    m = re.search(r'<div id="render-check" data-svgs="(\d+)" data-shown="(\d+)" data-bars="(\d+)" '
                  r'data-spread="([\d.]+)" data-misordered="(\d+)" data-clipped="(\d+)" '
                  r'data-clipped-text="([^"]*)">', out.stdout)
    assert m, f"no render marker in the DOM; chromium stderr: {out.stderr[-2000:]}"
    assert m.group(7) == "", f"text cut off at its chart's edge: {m.group(7)}"
    svgs, shown, bars, spread, misordered, clipped = (float(g) for g in m.groups()[:6])
    assert clipped == 0
    # 3 table keys (marker shapes) + 3 frontier charts + 3 strategies x 2 phases x (load bars + traffic heatmap)
    assert svgs == shown == 3 + 3 + 3 * 2 * 2
    assert bars == 3 * 2 * 4 and spread < 1e-3 and misordered == 0
    for heading in ("Summary", "Frontier: time, bytes and balance", "Per-GPU load", "Traffic between GPUs"):
        assert f"<h2>{heading}</h2>" in out.stdout

    shot = tmp_path / "shot.png"
    subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile2'}", "--window-size=1300,2400",
                    f"--screenshot={shot}", path.as_uri()], capture_output=True, timeout=120)
    import matplotlib.image as mpimg

    px = mpimg.imread(shot)[..., :3]
    assert px.shape[0] == 2400 and px.std() > 0.05, "screenshot is blank"
    # the heatmaps are drawn: many shades of blue (blue channel well above red)
    blue = (px[..., 2] - px[..., 0] > 0.25).sum()
    assert blue > 5000


def test_floor_sweep_and_large_cluster(compared):
    res, _ = compared
    sweep = [{"balance_floor": None, "balancedness": 0.95, "inter_node_bytes_vs_linear": 1.0},
             {"balance_floor": 0.9, "balancedness": 0.91, "inter_node_bytes_vs_linear": 0.8},
             {"balance_floor": 0.97, "balancedness": 0.97, "inter_node_bytes_vs_linear": 0.99}]
    page = render_compare_html({**res, "frontier": {"joint": sweep, "eplb": sweep[:1]}})
    assert "joint re-planned at balance floors 0.9, 0.97" in page and page.count("<polyline") == 1
    # the dashed line joins the two re-planned points only (joint's compare row is its marker, not on the sweep)
    (line,) = re.findall(r'<g class="sweep" data-strategy="joint">(.*?)</g>', page, flags=re.S)
    assert line.count('class="sweep-point"') == 2 and "--balance-floor 0.97" in line
    # 9 nodes x 8 GPUs: the traffic matrix is drawn node by node, each cell the sum of its 8 x 8 GPU block
    rng = np.random.default_rng(0)
    M = rng.integers(0, 100, (72, 72)).astype(float)
    np.fill_diagonal(M, 0.0)
    row = {**res["strategies"]["eplb"], "load_per_gpu": rng.integers(1, 9, 72).tolist(),
           "traffic_matrix_bytes": M.tolist(), "prefill_load_per_gpu": None, "prefill_traffic_matrix_bytes": None}
    page = render_compare_html({**res, "cluster": "9x8", "cluster_hardware": None, "strategies": {"eplb": row}})
    marks = _parse(page)
    cells = {(int(a["data-src"]), int(a["data-dst"])): float(a["data-value"])
             for t, a in _chart(marks, "traffic", "eplb", "decode") if a.get("class") == "cell"}
    assert len(cells) == 81 and cells[(2, 5)] == M[16:24, 40:48].sum() and cells[(3, 3)] == M[24:32, 24:32].sum()
    node = np.arange(72) // 8
    intra = M[node[:, None] == node[None, :]].sum()
    assert f"intra-node {intra / 1e3:.2f} KB" in page  # node blocks on the diagonal, GPU diagonal left out
