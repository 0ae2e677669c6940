"""Prometheus metrics of the operate loop, the HTTP endpoint that serves them, and the live dashboard.

One server on ``127.0.0.1:PORT`` (port 0: any free port) serves:

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

import json
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
.bar{display:inline-block;background:#4a7;height:12px;vertical-align:middle}
#spark{border:1px solid #ccc}
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
<tr><th>migration bytes</th><td id="mig-bytes">0</td></tr>
<tr><th>status</th><td id="status">running</td></tr>
</table>
<h2>balancedness per window</h2>
<svg id="spark" width="600" height="120" viewBox="0 0 600 120"><polyline id="line" fill="none" stroke="#36c"
 stroke-width="2" points=""/></svg>
<h2>load per GPU (newest window)</h2>
<div id="gpus"></div>
<p><a href="/metrics">/metrics</a> &middot; <a href="/api/state">/api/state</a></p>
<script>
function fmt(x, d) { return (x === undefined || x === null) ? '-' : Number(x).toFixed(d); }
function draw(s) {
  var L = s.latest || {};
  document.getElementById('label').textContent = s.label || 'waiting for the first window...';
  document.getElementById('policy').textContent = s.policy || '-';
  document.getElementById('windows').textContent = s.windows;
  document.getElementById('steps').textContent = L.steps || 0;
  document.getElementById('balancedness').textContent = fmt(L.balancedness, 4);
  document.getElementById('top-share').textContent = fmt(L.top_expert_share, 4);
  document.getElementById('drop').textContent = fmt(L.drop_ratio, 4);
  document.getElementById('version').textContent = s.version || 0;
  document.getElementById('age').textContent = (L.plan_age_steps || 0) + ' steps, ' + fmt(s.plan_age_seconds, 1) + ' s';
  document.getElementById('rebalances').textContent = s.rebalances || 0;
  document.getElementById('mig-bytes').textContent = (s.migration_bytes || 0).toExponential(3);
  document.getElementById('status').textContent = s.error ? ('stopped: ' + s.error) : (s.done ? 'done' : 'running');
  var h = s.history || [];
  var pts = h.map(function (w, i) {
    return (h.length > 1 ? i * 600 / (h.length - 1) : 0).toFixed(1) + ',' + (115 - 110 * w.balancedness).toFixed(1);
  });
  document.getElementById('line').setAttribute('points', pts.join(' '));
  var g = L.gpu_load || [], mx = Math.max.apply(null, g.concat([1]));
  document.getElementById('gpus').innerHTML = g.map(function (x, i) {
    return '<div class="gpu" data-load="' + x + '">GPU ' + i + ' <span class="bar" style="width:' +
      (300 * x / mx).toFixed(0) + 'px"></span> ' + x + '</div>';
  }).join('');
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


class MetricsServer:
    """The endpoint and dashboard on 127.0.0.1:``port`` in a daemon thread (port 0: a free port)."""

    def __init__(self, metrics: OperateMetrics, port: int = 0) -> None:
        handler = type("OperateHandler", (_Handler,), {"metrics": metrics})
        try:
            self.httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)
        except OSError as e:
            raise ValueError(f"--metrics-port {port}: cannot listen on 127.0.0.1 ({e.strerror or e})") from None
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="moeplace-metrics", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
