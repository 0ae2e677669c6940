"""The HTML report: self-contained, marked SYNTHETIC, and rendered by a real headless browser (Debian's chromium;
the browser test is skipped only when chromium is not installed)."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess

import numpy as np
import pytest
from conftest import make_tokens

from moeplace.analyse import analyse_trace
from moeplace.analyse.report import render_report, write_report
from moeplace.analyse.summary import MIN_PAIR_SUPPORT
from moeplace.trace import TraceMeta, TraceWriter

FIGURES = ["expert load heatmap", "imbalance per layer", "domain load profiles", "prefill vs decode scatter",
           "co-activation heatmap", "locality and drift"]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]
# After load, count the images that decoded (complete, naturalWidth > 0) and write the numbers into the DOM.
CHECK_SCRIPT = """<script>window.addEventListener('load', function () {
  var im = [].slice.call(document.images);
  var ok = im.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  var d = document.createElement('div'); d.id = 'render-check';
  d.setAttribute('data-images', im.length); d.setAttribute('data-rendered', ok);
  document.body.appendChild(d);
});</script>"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """Analysis and report of a synthetic trace with both phases, three domains and several drift windows."""
    tmp = tmp_path_factory.mktemp("report")
    rng = np.random.default_rng(0)
    L, E, K = 4, 12, 2
    arr = make_tokens(rng, 24, L, E, K, prompt=6, gen=6)
    meta = TraceMeta(model="synthetic-moe", num_layers=L, num_experts=E, top_k=K, synthetic=True, source="tests")
    with TraceWriter(tmp / "t", meta) as w:
        w.add_requests(np.arange(24), domain=["code", "math", "chat"] * 8)
        w.add_tokens(arr["request_id"], arr["position"], arr["phase"], arr["expert_ids"])
    res = analyse_trace(tmp / "t", window_tokens=48)
    return res, write_report(res, tmp / "out" / "report.html")


def test_report_is_self_contained(report):
    res, path = report
    text = path.read_text()
    assert "<title>Expert activation patterns: synthetic-moe [SYNTHETIC]</title>" in text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), "no network resources"
    imgs = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)"', text)
    assert [a for a, _ in imgs] == FIGURES
    assert all(base64.b64decode(b)[:8] == b"\x89PNG\r\n\x1a\n" for _, b in imgs)
    for number in ("max/mean", "JS divergence", "Pearson", "Per layer"):
        assert number in text
    # lifts rank only pairs with the minimum support, and the page says so next to the ranking and the column
    n = res["coactivation"]["min_count"]
    assert n == max(1, int(np.ceil(MIN_PAIR_SUPPORT * res["meta"]["num_tokens"]["total"])))
    assert f"Highest-lift pairs (seen in at least {n:,} tokens)" in text
    assert "at least 1% of the tokens rank by lift" in text and "max pair lift (&ge; 1% tokens)" in text


def test_report_of_counts_and_real_trace(report, tmp_path):
    res = dict(report[0])
    res["meta"] = {**res["meta"], "synthetic": False}
    assert "SYNTHETIC" not in render_report(res)
    meta = TraceMeta(model="counts", num_layers=2, num_experts=4, top_k=2, kind="counts")
    with TraceWriter(tmp_path / "c", meta) as w:
        w.add_counts(["a", "b"], ["a", "b"], np.array([-1, -1], np.int8), np.array([5.0, 5]),
                     np.arange(16, dtype=float).reshape(2, 2, 4))
    text = render_report(analyse_trace(tmp_path / "c"))
    assert "Not available for this trace" in text and "counts-only trace" in text
    with pytest.raises(ValueError, match="meta"):
        render_report({"imbalance": {}})


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    return exe


def test_report_renders_in_chromium(report, tmp_path):
    exe = _chromium()
    _, path = report
    checked = tmp_path / "checked.html"
    checked.write_text(path.read_text().replace("</body>", CHECK_SCRIPT + "</body>"))
    out = subprocess.run(
        [exe, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000",
         "--dump-dom", checked.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    m = re.search(r'<div id="render-check" data-images="(\d+)" data-rendered="(\d+)">', out.stdout)
    assert m, f"no render marker in the DOM; chromium stderr: {out.stderr[-2000:]}"
    assert int(m.group(1)) == len(FIGURES) and int(m.group(2)) == len(FIGURES)

    shot = tmp_path / "shot.png"
    subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile2'}", "--window-size=1300,2400",
                    f"--screenshot={shot}", path.as_uri()], capture_output=True, timeout=120)
    import matplotlib.image as mpimg

    px = mpimg.imread(shot)[..., :3]
    assert px.shape[0] == 2400 and px.std() > 0.05, "screenshot is blank"
    # the figures are there: many distinct colours, not just page background and text
    assert len(np.unique((px[::4, ::4] * 255).astype(np.uint8).reshape(-1, 3), axis=0)) > 500
