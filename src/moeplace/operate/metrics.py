"""Prometheus metrics of the operate loop, the HTTP endpoint that serves them, and the live dashboard.

One server on ``127.0.0.1:PORT`` (port 0: any free port; ``host`` / ``--metrics-host`` binds another address)
serves what the loop aggregates per window, never a request's id, source, text or length:

- ``/metrics``: the Prometheus text format (prometheus-client), names below;
- ``/``: the dashboard, plain HTML whose script polls ``/api/state`` every second and redraws itself;
- ``/api/state``: the loop's state as JSON (the newest window, recent history, totals).

Metrics (names, units and labels follow Prometheus conventions; gauges describe the newest window). The two drop
metrics (``*``) exist only when the loop runs with a capacity factor: the default is dropless, as SGLang and vLLM
serve, and a metric that is always 0 would only invite an alert on it:

==========================================  =======  ==============================================================
``moeplace_balancedness_ratio``             gauge    mean over layers of mean_g / max_g GPU load (SGLang's)
``moeplace_top_expert_share_ratio``         gauge    hottest expert's share of a layer's selections, max over layers
``moeplace_gpu_load_pairs{gpu}``            gauge    token-expert pairs each GPU computed, summed over layers
``moeplace_drop_ratio`` *                   gauge    pairs above capacity / pairs
``moeplace_inter_node_per_token_bytes``     gauge    inter-node bytes per token (dispatch + combine, all layers)
``moeplace_plan_age_seconds``               gauge    wall-clock seconds since the plan in force was applied
``moeplace_plan_age_steps``                 gauge    forward passes since then
``moeplace_plan_version``                   gauge    0 for the initial plan, +1 per change
``moeplace_tokens_total{domain}``           counter  tokens replayed, by domain
``moeplace_steps_total``                    counter  forward passes (micro-batches)
``moeplace_routed_pairs_total``             counter  token-expert pairs routed
``moeplace_dropped_pairs_total`` *          counter  pairs above capacity
``moeplace_inter_node_bytes_total``         counter  inter-node bytes
``moeplace_predicted_layer_seconds_total``  counter  predicted MoE layer time
``moeplace_migrations_total``               counter  plan changes
``moeplace_migration_bytes_total``          counter  bytes moved by migrations
``moeplace_migration_seconds_total``        counter  predicted migration transfer time
==========================================  =======  ==============================================================
"""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from moeplace.operate.loop import WindowReport

HISTORY = 300  # windows kept for the dashboard


class OperateMetrics:
    """The metrics above in their own registry, and the state the dashboard shows. Thread-safe: the loop calls
    :meth:`update`, the server threads read. ``drops``: register the drop metrics (the loop has a capacity
    factor)."""

    def __init__(self, drops: bool = False) -> None:
        r = self.registry = CollectorRegistry()
        self.balancedness = Gauge("moeplace_balancedness_ratio", "Mean over layers of mean/max GPU load of the "
                                  "newest window (SGLang's balancedness)", registry=r)
        self.top_share = Gauge("moeplace_top_expert_share_ratio", "Hottest expert's share of a layer's selections "
                               "in the newest window, max over layers", registry=r)
        self.gpu_load = Gauge("moeplace_gpu_load_pairs", "Token-expert pairs each GPU computed in the newest window, "
                              "summed over layers", ["gpu"], registry=r)
        self.drop = Gauge("moeplace_drop_ratio", "Pairs above capacity / pairs in the newest window",
                          registry=r) if drops else None
        self.inter_per_token = Gauge("moeplace_inter_node_per_token_bytes", "Inter-node bytes per token in the "
                                     "newest window", registry=r)
        self.age_s = Gauge("moeplace_plan_age_seconds", "Seconds since the plan in force was applied", registry=r)
        self.age_steps = Gauge("moeplace_plan_age_steps", "Forward passes since the plan in force was applied",
                               registry=r)
        self.version = Gauge("moeplace_plan_version", "Version of the plan in force (0: initial)", registry=r)
        self.tokens = Counter("moeplace_tokens", "Tokens replayed", ["domain"], registry=r)
        self.steps = Counter("moeplace_steps", "Forward passes (micro-batches)", registry=r)
        self.pairs = Counter("moeplace_routed_pairs", "Token-expert pairs routed", registry=r)
        self.dropped = Counter("moeplace_dropped_pairs", "Token-expert pairs above capacity",
                               registry=r) if drops else None
        self.inter = Counter("moeplace_inter_node_bytes", "Inter-node bytes", registry=r)
        self.layer_s = Counter("moeplace_predicted_layer_seconds", "Predicted MoE layer time", registry=r)
        self.migrations = Counter("moeplace_migrations", "Plan changes", registry=r)
        self.mig_bytes = Counter("moeplace_migration_bytes", "Bytes moved by migrations", registry=r)
        self.mig_s = Counter("moeplace_migration_seconds", "Predicted migration transfer time", registry=r)
        self._lock = threading.Lock()
        self._history: deque = deque(maxlen=HISTORY)
        self._state: dict = {"windows": 0, "done": False, "error": None}
        self._applied = time.monotonic()
        self._last_steps = 0

    def update(self, rep: WindowReport, totals: dict) -> None:
        """Take one window's report (the loop's ``sink``)."""
        now = time.monotonic()
        with self._lock:
            if rep.migration is not None:
                self._applied = now
                self.migrations.inc()
                self.mig_bytes.inc(rep.migration["bytes"])
                self.mig_s.inc(rep.migration["seconds"])
            self.balancedness.set(rep.balancedness)
            self.top_share.set(rep.top_expert_share)
            for g, x in enumerate(rep.gpu_load):
                self.gpu_load.labels(gpu=str(g)).set(x)
            if self.drop is not None and rep.drop_ratio is not None:
                self.drop.set(rep.drop_ratio)
            self.inter_per_token.set(rep.inter_node_bytes / rep.tokens if rep.tokens else 0.0)
            self.age_steps.set(0 if rep.migration is not None else rep.plan_age_steps)
            self.version.set(totals["version"])
            for d, n in rep.domains.items():
                self.tokens.labels(domain=d).inc(n)
            self.steps.inc(rep.steps - self._last_steps)
            self._last_steps = rep.steps
            self.pairs.inc(rep.pairs)
            if self.dropped is not None and rep.dropped_pairs is not None:
                self.dropped.inc(rep.dropped_pairs)
            self.inter.inc(rep.inter_node_bytes)
            self.layer_s.inc(rep.layer_time_s)
            self._history.append({"window": rep.window, "steps": rep.steps, "balancedness": rep.balancedness,
                                  "top_expert_share": rep.top_expert_share, "drop_ratio": rep.drop_ratio,
                                  "plan_version": totals["version"], "migrated": rep.migration is not None})
            self._state = {**self._state, **totals, "windows": rep.window + 1, "latest": rep.to_json()}

    def finish(self, error: str | None = None) -> None:
        with self._lock:
            self._state = {**self._state, "done": True, "error": error}

    def state(self) -> dict:
        with self._lock:
            age = time.monotonic() - self._applied
            self.age_s.set(age)
            return {**self._state, "plan_age_seconds": age, "history": list(self._history)}

    def exposition(self) -> bytes:
        with self._lock:
            self.age_s.set(time.monotonic() - self._applied)
        return generate_latest(self.registry)


DASHBOARD = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>moeplace operate</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse}td,th{padding:.2em .8em;text-align:left;border-bottom:1px solid #ddd}
svg text{font:12px system-ui,sans-serif;fill:#444}
.axis{stroke:#888;stroke-width:1}
</style></head>
<body>
<h1>moeplace operate</h1>
<p id="label">waiting for the first window...</p>
<table>
<tr><th>policy</th><td id="policy">-</td></tr>
<tr><th>windows</th><td id="windows">0</td></tr>
<tr><th>steps</th><td id="steps">0</td></tr>
<tr><th>balancedness</th><td id="balancedness">-</td></tr>
<tr><th>top expert share</th><td id="top-share">-</td></tr>
<tr><th>drop ratio</th><td id="drop">-</td></tr>
<tr><th>plan version</th><td id="version">0</td></tr>
<tr><th>plan age</th><td id="age">-</td></tr>
<tr><th>migrations</th><td id="rebalances">0</td></tr>
<tr><th>migration bytes</th><td id="mig-bytes">0 B</td></tr>
<tr><th>status</th><td id="status">running</td></tr>
</table>
<h2>balancedness per window</h2>
<svg id="spark" width="640" height="170" viewBox="0 0 640 170" role="img"
 aria-label="balancedness of each window against the step it ended at"></svg>
<h2>load per GPU (newest window, token-expert pairs)</h2>
<svg id="gpus" width="640" height="0" role="img" aria-label="token-expert pairs per GPU"></svg>
<p><a href="/metrics">/metrics</a> &middot; <a href="/api/state">/api/state</a></p>
<script>
// Layout of both figures: a fixed label column, so every bar and the plot start at the same x.
var SP = {w: 640, h: 170, left: 56, right: 16, top: 10, bottom: 40};
var BAR = {left: 64, width: 420, row: 16, height: 11};
function fmt(x, d) { return (x === undefined || x === null) ? '-' : Number(x).toFixed(d); }
function fmtBytes(x) {
  var u = ['B', 'kB', 'MB', 'GB', 'TB', 'PB'], i = 0;
  x = Number(x || 0);
  while (Math.abs(x) >= 1000 && i < u.length - 1) { x /= 1000; i++; }
  return (i ? x.toFixed(x < 10 ? 2 : 1) : x.toFixed(0)) + ' ' + u[i];
}
function fmtCount(x) { return Math.round(x).toString().replace(/\\B(?=(\\d{3})+(?!\\d))/g, ','); }
function esc(t) { return String(t).replace(/&/g, '&amp;').replace(/</g, '&lt;'); }
function text(x, y, t, anchor, extra) {
  return '<text x="' + x + '" y="' + y + '" text-anchor="' + (anchor || 'start') + '"' + (extra || '') + '>' +
    esc(t) + '</text>';
}
function line(x1, y1, x2, y2) {
  return '<line class="axis" x1="' + x1 + '" y1="' + y1 + '" x2="' + x2 + '" y2="' + y2 + '"/>';
}
function drawSpark(h) {
  var x0 = SP.left, x1 = SP.w - SP.right, y0 = SP.h - SP.bottom, y1 = SP.top, out = [];
  out.push(line(x0, y1, x0, y0), line(x0, y0, x1, y0));
  if (h.length) {
    var ys = h.map(function (w) { return w.balancedness; }), xs = h.map(function (w) { return w.steps; });
    var lo = Math.min.apply(null, ys), hi = Math.max.apply(null, ys);
    if (hi - lo < 1e-9) { lo -= 0.01; hi += 0.01; }
    var s0 = h.length > 1 ? xs[0] : 0, s1 = xs[xs.length - 1];
    if (s1 <= s0) { s1 = s0 + 1; }
    var X = function (s) { return x0 + (x1 - x0) * (s - s0) / (s1 - s0); };
    var Y = function (b) { return y0 - (y0 - y1) * (b - lo) / (hi - lo); };
    out.push(line(x0 - 4, Y(hi), x0, Y(hi)), line(x0 - 4, Y(lo), x0, Y(lo)));
    out.push(text(x0 - 6, Y(hi) + 4, hi.toFixed(3), 'end', ' class="ymax"'),
             text(x0 - 6, Y(lo) + 4, lo.toFixed(3), 'end', ' class="ymin"'));
    out.push(line(X(s0), y0, X(s0), y0 + 4), line(X(s1), y0, X(s1), y0 + 4));
    out.push(text(X(s0), y0 + 16, fmtCount(s0), 'start', ' class="xmin"'),
             text(X(s1), y0 + 16, fmtCount(s1), 'end', ' class="xmax"'));
    out.push(text((x0 + x1) / 2, SP.h - 6, 'step (forward passes; dots: a migration after that window)', 'middle'));
    var pts = h.map(function (w) { return X(w.steps).toFixed(1) + ',' + Y(w.balancedness).toFixed(1); });
    out.push('<polyline id="line" fill="none" stroke="#36c" stroke-width="2" points="' + pts.join(' ') + '"/>');
    h.forEach(function (w) {
      if (w.migrated) {
        out.push('<circle fill="#c33" r="3" cx="' + X(w.steps).toFixed(1) + '" cy="' +
                 Y(w.balancedness).toFixed(1) + '"/>');
      }
    });
  }
  document.getElementById('spark').innerHTML = out.join('');
}
function drawGpus(g) {
  var mx = Math.max.apply(null, g.concat([1])), out = [], H = g.length * BAR.row + 4;
  g.forEach(function (x, i) {
    var y = i * BAR.row + 2, w = (BAR.width * x / mx).toFixed(1);
    out.push('<g class="gpu" data-load="' + x + '">' +
             text(BAR.left - 8, y + BAR.height - 1, 'GPU ' + i, 'end') +
             '<rect class="bar" fill="#4a7" x="' + BAR.left + '" y="' + y + '" width="' + w + '" height="' +
             BAR.height + '"/>' + text(BAR.left + Number(w) + 6, y + BAR.height - 1, fmtCount(x)) + '</g>');
  });
  var svg = document.getElementById('gpus');
  svg.setAttribute('height', H);
  svg.setAttribute('viewBox', '0 0 640 ' + H);
  svg.innerHTML = out.join('');
}
function draw(s) {
  var L = s.latest || {};
  document.getElementById('label').textContent = s.label || 'waiting for the first window...';
  document.getElementById('policy').textContent = s.policy || '-';
  document.getElementById('windows').textContent = s.windows;
  document.getElementById('steps').textContent = fmtCount(L.steps || 0);
  document.getElementById('balancedness').textContent = fmt(L.balancedness, 4);
  document.getElementById('top-share').textContent = fmt(L.top_expert_share, 4);
  document.getElementById('drop').textContent = (L.drop_ratio === undefined || L.drop_ratio === null) ?
    (s.windows ? 'none: dropless (no capacity factor)' : '-') : fmt(L.drop_ratio, 4);
  document.getElementById('version').textContent = s.version || 0;
  document.getElementById('age').textContent = fmtCount(L.plan_age_steps || 0) + ' steps, ' +
    fmt(s.plan_age_seconds, 1) + ' s';
  document.getElementById('rebalances').textContent = s.rebalances || 0;
  document.getElementById('mig-bytes').textContent = fmtBytes(s.migration_bytes);
  document.getElementById('status').textContent = s.error ? ('stopped: ' + s.error) : (s.done ? 'done' : 'running');
  drawSpark(s.history || []);
  drawGpus(L.gpu_load || []);
  document.body.setAttribute('data-updated', String(s.windows));
}
function poll() {
  fetch('/api/state').then(function (r) { return r.json(); }).then(draw)
    .catch(function () { document.getElementById('status').textContent = 'endpoint unreachable'; })
    .finally(function () { setTimeout(poll, 1000); });
}
poll();
</script>
</body></html>
"""


class _Handler(BaseHTTPRequestHandler):
    metrics: OperateMetrics  # set on the subclass made by serve()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, ctype = self.metrics.exposition(), CONTENT_TYPE_LATEST
        elif path == "/api/state":
            body, ctype = json.dumps(self.metrics.state()).encode(), "application/json"
        elif path in ("/", "/index.html"):
            body, ctype = DASHBOARD.encode(), "text/html; charset=utf-8"
        else:
            self.send_error(404, "not found: try /, /metrics or /api/state")
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's signature)
        pass


DEFAULT_HOST = "127.0.0.1"  # loopback: only this machine reaches the endpoint unless --metrics-host says otherwise


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IPv4 or IPv6 address, or ``localhost``) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _listen_error(host: str, port: int, e: BaseException) -> ValueError:
    why = getattr(e, "strerror", None) or e
    return ValueError(f"--metrics-host {host} --metrics-port {port}: cannot listen there ({why})")


def check_listen(host: str, port: int) -> None:
    """ValueError naming the flags when ``host``:``port`` cannot be listened on (an unknown name, an address not
    on this machine, a port in use), so operate refuses before any work; :class:`MetricsServer` binds again."""
    if not host:
        raise ValueError("--metrics-host: empty; give an address (0.0.0.0 or :: listens on every interface)")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does
            s.bind((host, port))
    except (OSError, OverflowError, UnicodeError) as e:
        raise _listen_error(host, port, e) from None


class MetricsServer:
    """The endpoint and dashboard on ``host``:``port`` in a daemon thread (port 0: a free port). ``host`` is
    127.0.0.1 unless given: what is served is aggregate (module docstring), but only loopback keeps it on this
    machine (docs/PRIVACY.md)."""

    def __init__(self, metrics: OperateMetrics, port: int = 0, host: str = DEFAULT_HOST) -> None:
        if not host:
            raise ValueError("--metrics-host: empty; give an address (0.0.0.0 or :: listens on every interface)")
        handler = type("OperateHandler", (_Handler,), {"metrics": metrics})
        cls = _Server6 if ":" in host else ThreadingHTTPServer
        try:
            self.httpd = cls((host, port), handler)
        except (OSError, OverflowError, UnicodeError) as e:
            raise _listen_error(host, port, e) from None
        self.httpd.daemon_threads = True
        self.host = host
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="moeplace-metrics", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://[{self.host}]:{self.port}" if ":" in self.host else f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
