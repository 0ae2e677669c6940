"""``run-ep`` as a library call: check everything, run the layer, report measured next to predicted.

Shape legend: W = ranks, L = MoE layers, E = logical experts, K = top-k, H = hidden size, F = expert intermediate
size, T = tokens of one micro-batch, M = micro-batches.

:func:`run_ep` is the one entry point: :func:`prepare_run` checks the options, the plan, the trace, the window,
the output path and the memory the ranks will need before any process starts; :func:`execute` runs the
micro-batches in W rank processes (plain, on a private emulated cluster, or on one brought up by
``moeplace cluster up``); :func:`build_report` puts the measured bytes and time beside the simulator's prediction
for the same micro-batches. Every check raises ValueError naming the value and what was expected.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeplace.deploy import CLUSTER_PRESETS, parse_cluster
from moeplace.io import atomic_write_json, check_output_path
from moeplace.placement import Cluster, Plan
from moeplace.run.netns import EmulatedCluster, cluster_lock, emulated_cluster, load_cluster
from moeplace.run.options import LIMITS, RunEpOptions  # noqa: F401  (re-exported)
from moeplace.run.replay import (
    MicroBatch,
    ReplayConfig,
    ReplayResult,
    batches_from_window,
    check_batches,
    compute_seconds,
    predict,
    replay,
    replay_cost,
    select_window,
    summarize,
)
from moeplace.simulate import PHASE_NAMES, BatchConfig
from moeplace.trace.reader import read_trace
from moeplace.trace.types import Trace

RANK_BASE_BYTES = 400 << 20  # what one rank process holds before any tensor (torch, gloo), measured on CPU


class ReportWriteError(OSError):
    """The run finished but its report could not be written; ``report`` holds it, so nothing is lost."""

    def __init__(self, path: Path, cause: Exception, report: dict[str, Any]) -> None:
        self.path, self.report = path, report
        why = getattr(cause, "strerror", None) or cause
        super().__init__(getattr(cause, "errno", None), f"could not write the report to {path}: {why}")


@dataclass(frozen=True)
class PreparedRun:
    """Everything :func:`prepare_run` checked, ready for :func:`execute`."""

    plan: Plan
    window: Trace  # the replayed tokens (full request table), for the simulator's prediction
    batches: list[MicroBatch]  # M micro-batches
    config: ReplayConfig
    batching: BatchConfig
    compute_cluster: Cluster  # the plan's cluster with the emulated device's rates (time model of the prediction)
    rows: tuple[Any, ...] = ()  # rows[m]: int [T_m] window token indices of micro-batch m
    foe: bool = False  # an FoE model's trace and plan (moeplace.run.foe_replay)
    trace_tokens: int = 0  # tokens in the whole trace (the replayed ones are a window of them)
    phase_tokens: int = 0  # tokens of the replayed phase in the whole trace


def rank_memory_bytes(num_experts: int, top_k: int, max_tokens: int, total_tokens: int, cfg: ReplayConfig) -> int:
    """Host memory one rank needs, roughly: the expert table (float32 as drawn, plus the cast copy), the hidden
    vectors of the window, the largest exchange's buffers, and :data:`RANK_BASE_BYTES`. An upper estimate."""
    H, F, b = cfg.hidden, cfg.ffn or cfg.hidden, cfg.bytes_per_element
    table = num_experts * (2 * H * F + H) * (4 + (0 if b == 4 else b))
    window = total_tokens * H * (4 + b)
    exchange = max_tokens * top_k * (H * (3 * b + 4) + F * 4)  # rows sent, received, expert in/out per row
    return RANK_BASE_BYTES + table + window + exchange


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo, None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def prepare_run(opts: RunEpOptions, memory_budget: int | None = None) -> PreparedRun:
    """Everything checked before a process starts: output path, plan, cluster, trace, window, fail_rank and the
    memory W ranks will need (``memory_budget`` bytes; None: 80% of MemAvailable). Raises ValueError naming what
    does not fit."""
    if opts.json_out is not None:
        check_output_path(opts.json_out, "--json")
    plan = Plan.load(opts.plan)
    cluster = parse_cluster(opts.cluster, opts.cluster_preset)  # the one --cluster parser (moeplace.deploy)
    if cluster.spec() != plan.cluster.spec():
        raise ValueError(f"--cluster {opts.cluster} is {cluster.spec()}, which does not match the plan's cluster "
                         f"{plan.cluster.spec()} ({opts.plan})")
    # the prediction's links and GPU speed: a named preset's, else the plan's (what it was planned for)
    named = opts.cluster_preset is not None or str(opts.cluster).strip().lower() in CLUSTER_PRESETS
    hardware = cluster if named else plan.cluster
    W = plan.cluster.world_size
    if opts.fail_rank is not None and not 0 <= opts.fail_rank < W:
        raise ValueError(f"fail_rank {opts.fail_rank}: expected a rank in [0, {W})")
    trace = read_trace(opts.trace)
    meta, pl = trace.meta, plan.placement
    if (pl.num_layers, pl.num_experts) != (meta.num_layers, meta.num_experts):
        raise ValueError(f"plan {opts.plan} does not fit trace {opts.trace}: the plan places L={pl.num_layers} "
                         f"layers x E={pl.num_experts} experts, the trace has L={meta.num_layers} x "
                         f"E={meta.num_experts}")
    foe_t = meta.foe_groups
    if foe_t != plan.foe_groups:
        raise ValueError(f"plan {opts.plan} is for " + (f"an FoE model with {plan.foe_groups} groups" if
                         plan.foe_groups > 1 else "a plain MoE") + f", but trace {opts.trace} is of " +
                         (f"an FoE model with {foe_t} groups" if foe_t > 1 else "a plain MoE") +
                         ("; plan it with --strategy foe" if foe_t > 1 else ""))
    if foe_t > 1 and opts.two_hop:
        raise ValueError("--two-hop forwards inter-node rows inside a node; an FoE all-to-all never leaves a "
                         "group's node, so it does not apply to FoE traces")
    cfg = ReplayConfig(hidden=opts.hidden, ffn=opts.ffn, dtype=opts.dtype, two_hop=opts.two_hop,
                       repeats=opts.repeats, timeout=opts.timeout, emulate_compute=opts.emulate_compute)
    decode_batch, prefill_tokens = opts.batch_sizes
    batching = BatchConfig(decode_batch=decode_batch, prefill_tokens=prefill_tokens)
    sub, rows = select_window(trace, plan, batching, opts.phase, opts.microbatches, opts.skip)
    if foe_t > 1:
        from moeplace.run.foe_replay import foe_batches

        batches = foe_batches(sub, rows, plan)
    else:
        batches = batches_from_window(sub, rows, plan, opts.rule)
    check_batches(plan, batches)
    sizes = [len(b) for b in batches]
    need = W * rank_memory_bytes(pl.num_experts, meta.top_k, max(sizes, default=0), sum(sizes), cfg)
    if memory_budget is None:
        avail = available_memory_bytes()
        memory_budget = None if avail is None else int(0.8 * avail)
    if memory_budget is not None and need > memory_budget:
        raise ValueError(f"{W} ranks would need about {need / 2**30:.1f} GiB (E={pl.num_experts} experts "
                         f"of H={cfg.hidden} x F={cfg.ffn or cfg.hidden}, {sum(sizes)} tokens), more than the "
                         f"{memory_budget / 2**30:.1f} GiB available; lower --hidden-size, --ffn, --microbatches, "
                         f"--decode-batch or --prefill-tokens")
    rates = {k: v for k, v in (("expert_flops", opts.compute_flops),
                               ("hbm_bw", None if opts.compute_hbm_gbps is None else opts.compute_hbm_gbps * 1e9))
             if v is not None}
    ph = PHASE_NAMES.index(opts.phase)
    return PreparedRun(plan, sub, batches, cfg, batching, dataclasses.replace(hardware, **rates), tuple(rows),
                       foe_t > 1, int(len(trace.tokens.request_id)), int((trace.tokens.phase == ph).sum()))


def _replay(prep: PreparedRun, **kw):
    """The plain replay, or the FoE replay for an FoE run (same launch keywords)."""
    if not prep.foe:
        return replay(prep.plan, prep.batches, prep.config, **kw)
    from moeplace.run.foe_replay import foe_replay

    cc = kw.pop("compute_cluster")
    waits = compute_seconds(prep.plan, prep.batches, prep.config, cc) if prep.config.emulate_compute else None
    return foe_replay(prep.plan, prep.batches, prep.config, waits=waits, **kw)


def execute(prep: PreparedRun, opts: RunEpOptions) -> tuple[Any, EmulatedCluster | None]:
    """Run the prepared micro-batches in W rank processes where ``opts`` says; returns the result
    (:class:`ReplayResult`, or :class:`moeplace.run.foe_replay.FoeReplayResult` for an FoE run) and the emulated
    cluster it ran on (None: plain, on the host's loopback). Raises RankFailed, TimeoutError, NetnsError, or
    ClusterBusy when a ``--netns`` cluster is being changed."""
    plan = prep.plan
    N, G = plan.cluster.num_nodes, plan.cluster.gpus_per_node
    kw = dict(fail_rank=opts.fail_rank, compute_cluster=prep.compute_cluster)
    if opts.netns:
        with cluster_lock(opts.netns, shared=True):  # nobody rebuilds or removes it under the run
            emu = load_cluster(opts.netns)
            if emu is None:
                raise ValueError(f"--netns {opts.netns}: no such emulated cluster is up "
                                 f"(moeplace cluster up --name {opts.netns} ...)")
            if (emu.num_nodes, emu.gpus_per_node) != (N, G):
                raise ValueError(f"--netns {opts.netns} is {emu.num_nodes}x{emu.gpus_per_node}, the plan needs "
                                 f"{N}x{G}")
            return _replay(prep, **kw, **emu.launch_kwargs()), emu
    if opts.emulate:
        with emulated_cluster(N, G, opts.inter_gbit, opts.inter_delay_ms) as emu:
            return _replay(prep, **kw, **emu.launch_kwargs()), emu
    return _replay(prep, **kw), None


def build_report(opts: RunEpOptions, prep: PreparedRun, result: ReplayResult, emu: EmulatedCluster | None,
                 backend: str) -> dict[str, Any]:
    """The run-ep JSON: the measured bytes and time (:func:`moeplace.run.replay.summarize`), the simulator's
    prediction for the same micro-batches (``predicted``), and whether the bytes agree (``bytes_match_simulator``).
    """
    plan, cfg = prep.plan, prep.config
    if prep.foe:
        return _build_foe_report(opts, prep, result, emu, backend)
    measured = summarize(result)
    sim = predict(prep.window, plan, cfg, prep.batching, opts.rule, prep.compute_cluster).all.to_json()
    pre = "two_hop_" if cfg.two_hop else ""
    predicted = {k: sim[pre + k] for k in ("inter_node_bytes", "intra_node_bytes", "layer_time_s", "comm_time_s",
                                           "traffic_matrix_bytes")}
    # the kernel time model (nccl, or deepep-normal two-hop): its expert_time is what emulated compute waits
    predicted["kernel_time"] = {k: sim["kernel_time"][k] for k in ("layer_time_s", "dispatch_time_s",
                                                                   "combine_time_s", "expert_time_s")}
    predicted["kernel"] = replay_cost(cfg).mode
    predicted["layer_time_us_per_microbatch"] = {
        opts.phase: _per_layer_microbatch_us(predicted["kernel_time"]["layer_time_s"]["total"], prep)}
    return {
        **_report_head(opts, prep, emu, backend),
        **measured,
        "layer_time_us_per_microbatch": {opts.phase: _per_layer_microbatch_us(measured["layer_time_s"]["total"],
                                                                              prep)},
        "predicted": predicted,
        "bytes_match_simulator": all(measured[k]["total"] == predicted[k]["total"]
                                     for k in ("inter_node_bytes", "intra_node_bytes")),
    }


def _per_layer_microbatch_us(total_s: float, prep: PreparedRun) -> float | None:
    """Microseconds of one layer on one micro-batch: ``total_s`` (summed over M micro-batches and L layers) / (M L);
    the unit every command prints (docs/RUNTIME.md, "Units")."""
    M, L = len(prep.batches), prep.plan.placement.num_layers
    return total_s / (M * L) * 1e6 if M and L else None


def _report_head(opts: RunEpOptions, prep: PreparedRun, emu: EmulatedCluster | None, backend: str) -> dict:
    """What ran, where and how: the keys every run-ep report starts with."""
    plan, cfg = prep.plan, prep.config
    return {
        "trace": str(opts.trace), "plan": str(opts.plan), "strategy": plan.strategy, "cluster": plan.cluster.spec(),
        "emulation": None if emu is None else {"mode": emu.mode, "name": emu.name, "inter_gbit": emu.inter_gbit,
                                               "inter_delay_ms": emu.inter_delay_ms,
                                               "delay_applied": emu.delay_applied, "note": emu.note},
        "backend": backend,
        "config": {"hidden": cfg.hidden, "ffn": cfg.ffn or cfg.hidden, "dtype": cfg.dtype,
                   "bytes_per_element": cfg.bytes_per_element, "two_hop": cfg.two_hop, "repeats": cfg.repeats,
                   "rule": opts.rule, "batch_tokens": prep.batching.decode_batch if opts.phase == "decode"
                   else prep.batching.prefill_tokens, "decode_batch": prep.batching.decode_batch,
                   "prefill_tokens": prep.batching.prefill_tokens,
                   "emulate_compute": cfg.emulate_compute,
                   "compute_device": {"expert_flops": prep.compute_cluster.expert_flops,
                                      "hbm_bw": prep.compute_cluster.hbm_bw,
                                      "compute_overhead": prep.compute_cluster.compute_overhead}},
        "window": {"phase": opts.phase, "skip": opts.skip, "num_microbatches": len(prep.batches),
                   "num_tokens": int(sum(len(b) for b in prep.batches)), "trace_tokens": prep.trace_tokens,
                   "trace_phase_tokens": prep.phase_tokens},
    }


FOE_BYTE_KEYS = ("inter_node_bytes", "intra_node_bytes", "allreduce_inter_node_bytes", "allreduce_intra_node_bytes")


def _build_foe_report(opts: RunEpOptions, prep: PreparedRun, result: Any, emu: EmulatedCluster | None,
                      backend: str) -> dict[str, Any]:
    """The run-ep JSON of an FoE run: measured all-to-all and all-reduce bytes and times, the simulator's FoE replay
    of the same micro-batches (``predicted``) and the closed forms of docs/MODEL.md."""
    from moeplace.run.foe_replay import summarize_foe
    from moeplace.simulate.foe import replay_foe

    measured = summarize_foe(result)
    predicted = replay_foe(prep.window, list(prep.rows), prep.plan, replay_cost(prep.config), prep.batching)
    ar_total = measured["allreduce_inter_node_bytes"]["total"] + measured["allreduce_intra_node_bytes"]["total"]
    return {
        **_report_head(opts, prep, emu, backend),
        **measured,
        "layer_time_us_per_microbatch": {opts.phase: _per_layer_microbatch_us(measured["layer_time_s"]["total"],
                                                                              prep)},
        "predicted": predicted,  # bytes only: the simulator has no time model of the FoE all-reduce
        "bytes_match_simulator": all(measured[k]["total"] == predicted[k]["total"] for k in FOE_BYTE_KEYS),
        "allreduce_matches_closed_form": ar_total == predicted["closed_form"]["allreduce_bytes"],
    }


def _why_slower(report: dict[str, Any], ratio: float) -> str:
    """In words, why the measured layer time differs from the prediction (``ratio`` = measured / predicted)."""
    emu = report["emulation"] or {}
    if report["backend"] == "gloo":
        where = {"netns": "network namespaces" + (f" shaped to {emu['inter_gbit']:g} Gbit/s"
                                                  if emu.get("inter_gbit") else ""),
                 }.get(emu.get("mode"), "loopback")
        transport = f"gloo over {where} on CPU processes"
    else:
        transport = "NCCL on this host's GPUs"
    compute = ("emulated expert compute (waits of the time model)" if report["config"].get("emulate_compute")
               else "expert compute " + ("on CPU" if report["backend"] == "gloo" else "run for real"))
    if 0.5 <= ratio <= 2:
        return (f"measured / predicted = {ratio:.2f}x: the run is close to the time model ({transport}, "
                f"{compute})")
    return (f"measured / predicted = {ratio:,.0f}x: {transport} and {compute}, not the NVLink/InfiniBand links "
            f"the prediction prices; compare ratios between plans, not absolute times")


def summary_line(report: dict[str, Any], out: str | os.PathLike | None = None) -> str:
    """The text for a person (several lines): what ran, how many tokens of the trace it replayed, the bytes (and
    whether the simulator agrees), the layer time per layer per micro-batch in µs, measured next to predicted,
    and why they differ."""
    inter, intra = report["inter_node_bytes"]["total"], report["intra_node_bytes"]["total"]
    w, c = report["window"], report["config"]
    ph = w["phase"]
    size = f"{c['batch_tokens']:,} {'requests' if ph == 'decode' else 'tokens'}"
    replayed = (f"replayed {w['num_tokens']:,} of {w.get('trace_tokens', w['num_tokens']):,} tokens in the trace "
                f"({w['num_microbatches']} {ph} micro-batches of up to {size} after skipping {w['skip']}; "
                f"--microbatches, --skip)")
    same = "same" if report["bytes_match_simulator"] else "DIFFERENT"
    measured = (report.get("layer_time_us_per_microbatch") or {}).get(ph)
    predicted = (report["predicted"].get("layer_time_us_per_microbatch") or {}).get(ph)
    if "foe" in report:
        f = report["foe"]
        lines = [f"run-ep FoE (H={f['groups']}) on {report['cluster']}: {replayed}",
                 f"  all-to-all inter-node {inter:,} B, intra-node {intra:,} B; all-reduce inter-node "
                 f"{report['allreduce_inter_node_bytes']['total']:,} B, intra-node "
                 f"{report['allreduce_intra_node_bytes']['total']:,} B (simulator: {same})"]
    else:
        lines = [f"run-ep {report['strategy']} on {report['cluster']} ({report['dedup']}): {replayed}",
                 f"  inter-node {inter:,} B, intra-node {intra:,} B (simulator: {same})"]
    if measured is not None:
        if predicted is None:
            lines.append(f"  layer time per layer per micro-batch: measured {measured:,.1f} µs (the simulator "
                         f"predicts FoE bytes, not time)")
        else:
            lines.append(f"  layer time per layer per micro-batch: measured {measured:,.1f} µs, predicted "
                         f"{predicted:,.1f} µs ({report['predicted']['kernel']} kernel model)")
            if predicted > 0:
                lines.append("  " + _why_slower(report, measured / predicted))
    if out is not None:
        lines.append(f"wrote {out}")
    return "\n".join(lines)


def run_ep(opts: RunEpOptions, memory_budget: int | None = None) -> dict[str, Any]:
    """Check, run, report, and write the report to ``opts.json_out`` if set; returns the report.

    Raises ValueError for anything wrong with the options or inputs (before any process starts), RankFailed /
    TimeoutError / NetnsError / ClusterBusy when the run fails, and :class:`ReportWriteError` (carrying the
    report) when the report cannot be written at the end.
    """
    prep = prepare_run(opts, memory_budget)
    result, emu = execute(prep, opts)
    import torch

    report = build_report(opts, prep, result, emu, "nccl" if torch.cuda.is_available() else "gloo")
    if opts.json_out is not None:
        try:
            atomic_write_json(report, opts.json_out)
        except (OSError, ValueError) as e:  # ValueError: moeplace.io.OutputError (the path went bad meanwhile)
            raise ReportWriteError(Path(opts.json_out), e, report) from e
    return report
