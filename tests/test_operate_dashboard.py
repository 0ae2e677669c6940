"""The operate dashboard drawn by headless Chromium from a known state: every GPU's bar starts at the same x (a
fixed, right-aligned label column: GPU 10-31 used to start 9 px right of GPU 0-9), the balancedness sparkline has
labelled axes (min/max balancedness, first/last step), and bytes print human-readable (16.5 GB, not 1.652e+10).

Skipped only when chromium is missing (``apt-get install -y chromium``)."""

from __future__ import annotations

import html
import re
import shutil
import subprocess

import pytest

from moeplace.operate.loop import WindowReport
from moeplace.operate.metrics import MetricsServer, OperateMetrics

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
GPUS = 32


def report(w: int, bal: float, migrated: bool) -> WindowReport:
    return WindowReport(window=w, steps=9 * (w + 1), tokens=100, domains={"code": 100}, balancedness=bal,
                        top_expert_share=0.1, gpu_load=[1000.0 + 37 * g * (w + 1) for g in range(GPUS)],
                        pairs=1000, inter_node_bytes=1e6, layer_time_s=1e-3, plan_age_steps=9, plan_version=0,
                        migration={"bytes": 8.26e9, "seconds": 0.1, "moves": 3, "layers": [0]} if migrated else None)


@pytest.fixture(scope="module")
def dom(tmp_path_factory):
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    m = OperateMetrics()
    bals = [0.41, 0.55, 0.83, 0.79, 0.9]
    for w, b in enumerate(bals):
        mig = w in (1, 3)
        m.update(report(w, b, mig), {"label": "test stream", "policy": "moeplace", "version": w // 2,
                                     "rebalances": 2 if w >= 3 else w, "migration_bytes": 1.652e10 if w >= 3 else 0,
                                     "migration_time_s": 0.2, "layer_time_s": 1e-2})
    m.finish()
    srv = MetricsServer(m, 0)
    tmp = tmp_path_factory.mktemp("dash")
    try:
        out = subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={tmp / 'profile'}",
                              "--virtual-time-budget=5000", "--dump-dom", f"{srv.url}/"],
                             capture_output=True, text=True, timeout=120)
    finally:
        srv.close()
    assert 'data-updated="5"' in out.stdout, f"the page never drew; chromium stderr: {out.stderr[-2000:]}"
    return out.stdout


def test_every_gpu_bar_starts_at_the_same_x(dom):
    bars = re.findall(r'<rect class="bar"[^>]* x="([\d.]+)"', dom)
    assert len(bars) == GPUS and len(set(bars)) == 1
    labels = re.findall(r'<text x="([\d.]+)"[^>]*text-anchor="end"[^>]*>GPU \d+</text>', dom)
    assert len(labels) == GPUS and len(set(labels)) == 1  # right-aligned at one x, left of the bars
    assert float(labels[0]) < float(bars[0])
    loads = re.findall(r'class="gpu" data-load="([\d.]+)"', dom)
    assert len(loads) == GPUS and ">6,735<" in dom  # counts with thousands separators (1000 + 37 * 31 * 5)


def test_sparkline_has_labelled_axes(dom):
    def label(cls: str) -> str:
        m = re.search(rf'class="{cls}"[^>]*>([^<]+)</text>', dom)
        assert m, cls
        return html.unescape(m.group(1))

    assert (label("ymin"), label("ymax")) == ("0.410", "0.900")
    assert (label("xmin"), label("xmax")) == ("9", "45")
    assert "step (forward passes" in dom
    assert len(re.findall(r'<circle fill="#c33" r="3" cx="[\d.]+"', dom)) == 2  # the two windows before a change
    assert re.search(r'<polyline id="line"[^>]*points="([\d.]+,[\d.]+ ){4}[\d.]+,[\d.]+"', dom)


def test_bytes_print_human_readable_and_drops_say_dropless(dom):
    assert '<td id="mig-bytes">16.5 GB</td>' in dom
    assert "e+10" not in dom
    assert '<td id="drop">none: dropless (no capacity factor)</td>' in dom
