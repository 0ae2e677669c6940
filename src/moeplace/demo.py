"""The main job (``moeplace demo``): the whole pipeline on one trace, printing what each stage finds.

trace info -> analysis (JSON + HTML report) -> every strategy planned on one window and scored on held-out
requests (:mod:`moeplace.evaluate`) -> the chosen strategy planned on the whole trace and exported for SGLang and
vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moeplace.io import atomic_write_json

if TYPE_CHECKING:
    from moeplace.deploy import Deployment

DEFAULT_CLUSTER = "4x2"  # the demo's cluster when no deployment is given (generic links)


@dataclass(frozen=True)
class DemoConfig:
    """What ``moeplace demo`` runs on and writes."""

    trace: Path  # trace directory (the bundled default trace unless given)
    out: Path  # folder for the reports
    deployment: Deployment | None = None  # cluster, hardware, time model, rule, batch sizes (the CLI's deployment
    # option group, docs/DEPLOYMENT.md); None: DEFAULT_CLUSTER with the library defaults
    redundant: int = 8  # redundant slots per layer
    strategies: tuple[str, ...] = ()  # strategies to compare (empty: all registered)
    export_strategy: str = "joint"  # strategy planned on the whole trace and exported
    holdout: float = 0.25  # fraction of requests held out for scoring
    seed: int = 0  # the first window split, and the strategies
    split_seeds: int = 5  # random splits the headline's interval resamples
    progress: bool = True  # progress bars and lines


def in_users_terms(cmp: dict, nodes: int, gpus_per_node: int, links: str, hidden: int | None) -> str:
    """One sentence: how much faster (or slower) joint's MoE layers are than the strongest EPLB on held-out
    requests, with the 95% interval, saying so when the interval cannot tell the two apart."""
    rows = cmp["strategies"]
    if "joint" not in rows:
        return "(compare joint to see the headline)"
    j = rows["joint"].get("phases", {})
    parts = []
    for ph in ("prefill", "decode"):
        b = j.get(ph)
        if b is None:
            continue
        r, (lo, hi) = b["ratio_to_baseline"], b["ci95"]
        ci = f"{r:.3f}x [{lo:.3f}, {hi:.3f}]"
        if not b["decided"]:
            parts.append(f"not told apart from it for {ph} ({ci})")
        else:
            parts.append(f"{abs(1 - r):.1%} {'faster' if r < 1 else 'slower'} for {ph} ({ci})")
    if not parts:
        return "(no phase was scored)"
    base = " / ".join(sorted(set(cmp["baseline"].values())))
    seeds = len(cmp.get("split_seeds") or [0])
    return (f"On {nodes} nodes x {gpus_per_node} GPUs ({links}), with {hidden}-element token vectors, joint's MoE "
            f"layers, against the strongest EPLB ({base}), are {'; '.join(parts)}: 95% intervals over {seeds} "
            f"random splits and their micro-batches, {cmp['held_out_requests']} held-out requests each "
            f"(arrival order: {cmp['arrival']}).")


def run_demo(cfg: DemoConfig, say: Callable[[str], None] = print) -> dict:
    """Run the pipeline of the module docstring; ``say`` gets every line to show. Returns {"compare": ...,
    "outputs": [paths written]}."""
    from moeplace.analyse.report import write_report
    from moeplace.analyse.summary import analyse_trace, format_summary
    from moeplace.deploy import Deployment, get_cluster_preset, parse_cluster
    from moeplace.evaluate import compare, format_table
    from moeplace.plan import MOE_STRATEGIES, get_strategy, make_plan
    from moeplace.plan.base import workload_from_trace
    from moeplace.plan.export import export_all
    from moeplace.simulate import BatchConfig, CostConfig
    from moeplace.trace import read_meta, read_trace
    from moeplace.trace.describe import format_trace_info
    from moeplace.trace.reader import trace_info

    dep = cfg.deployment or Deployment(parse_cluster(DEFAULT_CLUSTER))
    cluster = dep.cluster
    cost = CostConfig(hidden_size=dep.hidden_size, dispatch_bytes=dep.dispatch_bytes, combine_bytes=dep.combine_bytes,
                      mode=dep.mode, overlap=dep.overlap)
    batching = BatchConfig(decode_batch=dep.decode_batch, prefill_tokens=dep.prefill_tokens)
    names = list(cfg.strategies) or list(MOE_STRATEGIES)
    for n in [*names, cfg.export_strategy]:
        get_strategy(n)
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    meta = read_meta(cfg.trace)
    tag = " [SYNTHETIC]" if meta.synthetic else ""
    say(f"moeplace demo on {cfg.trace}{tag}\nreports go to {out}/")
    written: list[Path] = []

    def stage(n: int, title: str) -> float:
        say(f"\n[{n}/4] {title}")
        return time.perf_counter()

    stage(1, "trace")
    say(format_trace_info(trace_info(cfg.trace)))

    t0 = stage(2, "analyse: load imbalance, domains, prefill->decode, co-activation")
    res = analyse_trace(cfg.trace, progress=cfg.progress)
    written.append(atomic_write_json(res, out / "analysis.json", allow_nan=False))
    written.append(write_report(res, out / "report.html"))
    say(format_summary(res))
    say(f"  ({time.perf_counter() - t0:.1f} s) wrote {out / 'analysis.json'} and {out / 'report.html'}")

    t0 = stage(3, f"plan every strategy on a window, score on held-out requests ({cluster.spec()}, "
                  f"{cfg.redundant} redundant slots per layer)")

    def step(msg: str) -> None:
        if cfg.progress:
            say(f"  {msg} ...")

    cmp = compare(read_trace(cfg.trace), cluster, cfg.redundant, names, holdout=cfg.holdout, seed=cfg.seed,
                  progress=step, arrival="mixed", cost=cost, batching=batching, rule=dep.rule,
                  deployment=dep, split_seeds=[cfg.seed + i for i in range(cfg.split_seeds)])
    written.append(atomic_write_json(cmp, out / "compare.json"))
    say(f"  planned on {cmp['planning_requests']} requests, scored on {cmp['held_out_requests']} held-out "
        f"requests ({cmp['scored_tokens']} decode tokens, arrival order: {cmp['arrival']})")
    say(format_table(cmp))
    from moeplace.evaluate.measure import format_phases

    say(format_phases(cmp))
    say(f"  ({time.perf_counter() - t0:.1f} s) wrote {out / 'compare.json'}")
    links = (get_cluster_preset(dep.cluster_preset).note if dep.cluster_preset else
             f"default links: {cluster.intra_bw / 1e9:.0f} GB/s inside a node, {cluster.inter_bw / 1e9:.0f} GB/s "
             "between nodes per GPU")
    say("\n" + in_users_terms(cmp, cluster.num_nodes, cluster.gpus_per_node, links,
                              dep.hidden_size or meta.hidden_size))

    best = cfg.export_strategy
    t0 = stage(4, f"plan '{best}' on the whole trace and export it")
    work, info = workload_from_trace(cfg.trace, 32)
    plan = make_plan(best, work, cluster, cfg.redundant, planned_on=str(cfg.trace), deployment=dep, seed=cfg.seed)
    files = [plan.save(out / f"{best}.plan.json"),
             *export_all(plan, out, f"{best}.", {"moe_layer_map": info.get("moe_layer_map")})]
    for f in files:
        written.append(Path(f))
        say(f"  wrote {f}")
    row = cmp["strategies"].get(best)
    if row:
        say(f"\n'{best}' on held-out requests: inter-node bytes {row['inter_node_bytes_vs_linear']:.2f}x linear, "
            f"balancedness {row['balancedness']:.3f}  ({time.perf_counter() - t0:.1f} s)")
    say(f"open {out / 'report.html'} in a browser for the figures")
    return {"compare": cmp, "outputs": [str(p) for p in written]}
