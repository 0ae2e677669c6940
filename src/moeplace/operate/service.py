"""``moeplace operate`` as one library call: build the stream, serve metrics and the dashboard, run the loop,
write the JSON summary."""

from __future__ import annotations

import time
from pathlib import Path

from moeplace.io import atomic_write_json
from moeplace.operate.loop import OperateConfig, OperateError, OperateResult, operate
from moeplace.operate.metrics import DEFAULT_HOST, MetricsServer, OperateMetrics
from moeplace.operate.orders import STREAM_ORDERS
from moeplace.operate.streams import ORDERS, Stream, drift_stream, schedule_stream, trace_stream
from moeplace.operate.workloads import MixSchedule


def check_stream_model(path: str | Path, model_preset: str | None, sizes_meant: bool = False) -> str | None:
    """Before a stream is opened: ValueError naming the trace for an FoE trace (the loop prices plain MoE
    execution), and for a model preset whose experts or top-k differ from the trace's (one line naming both: its
    hidden and expert sizes would price another model's routing) unless ``sizes_meant`` (CLI:
    ``--model-sizes-meant``, a deliberate what-if), which returns the note to print instead; else None."""
    from moeplace.deploy import get_model
    from moeplace.trace.reader import read_meta

    meta = read_meta(path)
    if meta.foe_groups > 1:
        raise ValueError(f"{path}: an FoE trace (foe_groups={meta.foe_groups}): operate prices plain MoE execution "
                         "and exports engine maps, which an FoE model has none of (docs/FOE.md)")
    if model_preset is not None:
        p = get_model(model_preset)
        if (p.num_experts, p.top_k) != (meta.num_experts, meta.top_k):
            if not sizes_meant:
                raise ValueError(f"--model-preset {model_preset} has {p.num_experts} experts, top-{p.top_k}, but "
                                 f"{path} routes to {meta.num_experts} experts, top-{meta.top_k} (model "
                                 f"{meta.model}): give the trace's model, or --model-sizes-meant to price this "
                                 "trace with the preset's sizes on purpose")
            return (f"note: --model-preset {model_preset} has {p.num_experts} experts, top-{p.top_k}; {path} routes "
                    f"to {meta.num_experts}, top-{meta.top_k}: the preset's sizes (hidden {p.hidden_size}, expert "
                    f"intermediate {p.moe_intermediate_size}) price the trace's {meta.num_experts} experts "
                    "(--model-sizes-meant)")
    return None


def open_stream(path: str | Path, window_requests: int, order: str = "table", seed: int = 0,
                drift_requests: int = 1000, schedule: MixSchedule | None = None, stream_requests: int | None = None,
                stream_key: str = "domain") -> Stream:
    """The stream ``moeplace operate`` replays: a trace in ``order`` (:data:`STREAM_ORDERS`); ``drift``: the seeded
    drift of :func:`moeplace.operate.streams.drift_stream`, one phase per domain of ``drift_requests`` requests;
    ``schedule``: the trace re-ordered by ``schedule`` over its ``stream_key`` (domain or dataset),
    ``stream_requests`` arrivals (None: one pass over the schedule's phases), :mod:`moeplace.operate.workloads`."""
    if (order == "schedule") != (schedule is not None):
        raise ValueError("a mix schedule (--schedule FILE) goes with --order schedule, and --order schedule needs one")
    if order == "schedule":
        return schedule_stream(path, window_requests, schedule, stream_requests, seed, stream_key)
    if order == "drift":
        return drift_stream(path, window_requests, seed=seed, requests_per_phase=drift_requests)
    if order not in ORDERS:
        raise ValueError(f"stream order {order!r}: expected one of {STREAM_ORDERS}")
    return trace_stream(path, window_requests, order)


def run(stream: Stream, cfg: OperateConfig, policy: str = "moeplace", out: str | Path | None = None,
        json_path: str | Path | None = None, metrics_port: int | None = None, linger_s: float = 0.0,
        on_start: object = None, metrics_host: str = DEFAULT_HOST, **policy_params: object) -> OperateResult:
    """Run the loop on ``stream``; with ``metrics_port`` serve /metrics, / and /api/state on ``metrics_host``
    (127.0.0.1 unless given; the URL is passed to ``on_start(url)`` once listening) and keep serving ``linger_s``
    seconds after the end. The JSON summary (benchmark keys, parameters, per-window history) goes to
    ``json_path``."""
    metrics = server = None
    if metrics_port is not None:
        metrics = OperateMetrics(drops=cfg.capacity_factor is not None)
        server = MetricsServer(metrics, metrics_port, metrics_host)
        if callable(on_start):
            on_start(server.url)
    try:
        try:
            res = operate(stream, cfg, policy, out, metrics.update if metrics else None, **policy_params)
        except OperateError as e:
            if metrics is not None:
                metrics.finish(str(e))
            raise
        if metrics is not None:
            metrics.finish()
        if json_path is not None:
            atomic_write_json(res.to_json(), json_path)
        if server is not None and linger_s > 0:
            time.sleep(linger_s)
        return res
    finally:
        if server is not None:
            server.close()
