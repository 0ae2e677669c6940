"""Measure where users run: every strategy against the strongest EPLB, per phase, with paired 95% intervals and the
ideal bound (docs/EVALUATION.md).

Shape legend: S = split seeds, B_s = scored micro-batches of seed s, W = GPUs of a phase.

Protocol, per split seed (``split_seeds``; the arrival order has its own seed, the planners theirs):

1. Split the requests into a planning and a held-out window (:func:`moeplace.evaluate.windows.split_windows`).
2. Per phase, on that phase's deployment (a profile may run prefill and decode on different clusters; phases that
   share one are planned and simulated together): plan every strategy on the planning window and replay the held-out
   window. Only *full* micro-batches are scored when a profile states the batch sizes (prefill: C x W tokens;
   decode: a full running set of B x W requests, continuous batching); a phase that forms fewer than
   ``min_microbatches`` full ones is refused with one line unless ``allow_few`` (then every micro-batch is scored).
3. The baseline of a phase is the best on the held-out window (lowest mean layer time over all seeds) of EPLB's
   global policy and, when the model's expert groups divide among the phase's nodes, its hierarchical policy, each
   with the replica dispatch rules engines offer (:data:`BASELINE_RULES`: static, nearest least-loaded, and a
   per-micro-batch balanced assignment like SGLang's ``--ep-dispatch-algorithm``). Picking it on the held-out window
   favours the baseline.
4. Per strategy and phase: the mean layer time per micro-batch, its ratio to the baseline with a paired two-level
   bootstrap interval (:func:`moeplace.evaluate.intervals.paired_ratio_ci`: the same micro-batches for both), the
   ideal bounds of the same plan and traffic (balanced; balanced and local) and
   ``gap_closed = (baseline - plan) / (baseline - bound_balanced)``; and the *reachable* bound of the held-out
   traffic (:mod:`moeplace.simulate.bounds`: the least layer time any placement within the deployment's slots, any
   dispatch and any balanced grouping could give, certified from below) with
   ``gap_closed_reachable = (baseline - plan) / (baseline - bound_reachable)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moeplace.deploy import Deployment, expert_groups
from moeplace.evaluate.intervals import paired_ratio_ci
from moeplace.evaluate.windows import Windows, held_out_homes, scoring_trace
from moeplace.placement import Cluster, Plan
from moeplace.plan.registry import get_strategy
from moeplace.simulate import BatchConfig, CostConfig, SimResult, simulate
from moeplace.simulate.batching import build_layout
from moeplace.simulate.config import BASELINE_RULES
from moeplace.simulate.result import PhaseResult
from moeplace.trace.types import DECODE, PREFILL, Trace

MIN_MICROBATCHES = 20  # full micro-batches a phase must form to be scored under a profile
PHASE_CODES = {"prefill": PREFILL, "decode": DECODE}


@dataclass(frozen=True)
class PhaseSetup:
    """How one phase is planned and scored: its cluster, time model, micro-batching and replica rule."""

    cluster: Cluster
    cost: CostConfig
    batching: BatchConfig
    rule: str
    deployment: Deployment | None = None  # what strategies that price time are given
    full_only: bool = False  # score only full micro-batches (a profile states the batch sizes)

    def key(self) -> tuple:
        """Setups with equal keys are planned and simulated once for both phases."""
        return (self.cluster.spec(), self.cluster.to_json().__repr__(), self.cost, self.batching, self.rule,
                self.deployment)


def setup_of(dep: Deployment, full_only: bool) -> PhaseSetup:
    """The :class:`PhaseSetup` of a deployment (its cost model, batching and rule)."""
    cost = CostConfig(hidden_size=dep.hidden_size, dispatch_bytes=dep.dispatch_bytes,
                      combine_bytes=dep.combine_bytes, mode=dep.mode, overlap=dep.overlap,
                      intermediate_size=dep.intermediate_size)
    batching = BatchConfig(decode_batch=dep.decode_batch, prefill_tokens=dep.prefill_tokens,
                           decode_running=dep.decode_running)
    return PhaseSetup(dep.cluster, cost, batching, dep.rule, dep, full_only)


def baseline_variants(num_groups: int, cluster: Cluster) -> list[tuple[str, dict]]:
    """(name, eplb parameters) of the EPLB policies a phase can run: global, and hierarchical when the model has
    expert groups that divide among the nodes (DeepSeek's EPLB condition ``num_groups % num_nodes == 0``).
    Both with the refined packing: the held-out requests of a split come from the planning window's own mix (a
    stationary next window), where it is the stronger EPLB (docs/PLANNER.md)."""
    out = [("eplb", {"num_groups": 1, "packing": "refined"})]
    if num_groups > 1 and num_groups % cluster.num_nodes == 0:
        out.append(("eplb-hierarchical", {"num_groups": num_groups, "packing": "refined"}))
    return out


def microbatch_counts(windows: Windows, batching: BatchConfig) -> dict[str, dict[str, int]]:
    """Per phase: micro-batches the held-out window forms under ``batching`` and how many of them are full.
    A light pass (no routing), so a too-small trace is refused before anything is planned."""
    tr = scoring_trace(windows.held, windows.held_signal)
    lay = build_layout(tr, tr.requests, np.zeros(len(tr.requests), np.int64), batching)
    out = {}
    for name, code in PHASE_CODES.items():
        n = lay.mb_tokens[code]
        out[name] = {"microbatches": int(len(n)), "full": int((n >= batching.capacity(name)).sum())}
    return out


def check_enough(counts: dict[str, dict[str, int]], setups: dict[str, PhaseSetup], min_microbatches: int,
                 allow_few: bool, what: str) -> None:
    """ValueError (one line) when a phase scored on full micro-batches forms fewer than ``min_microbatches``."""
    for ph, st in setups.items():
        c = counts[ph]
        if not st.full_only or c["microbatches"] == 0 or c["full"] >= min_microbatches or allow_few:
            continue
        cap = st.batching.capacity(ph)
        unit = "tokens" if ph == "prefill" else "running requests"
        raise ValueError(f"{what}: the held-out {ph} forms {c['full']} full micro-batches of {cap:,} {unit} "
                         f"({c['microbatches']} in all); at least {min_microbatches} are needed to score it "
                         "(a bigger trace, a smaller profile via --cluster, or --allow-few to score every "
                         "micro-batch)")


def scored_mask(res: PhaseResult, capacity: int, full_only: bool, allow_few: bool, min_microbatches: int
                ) -> np.ndarray:
    """bool [B]: the micro-batches of ``res`` that are scored (full ones, or all; see the module docstring)."""
    n = res.microbatch_tokens if res.microbatch_tokens is not None else np.zeros(res.num_microbatches, np.int64)
    full = n >= capacity
    if not full_only or (allow_few and full.sum() < min_microbatches):
        return np.ones(len(n), bool)
    return full


@dataclass
class PhaseSamples:
    """One plan's scored micro-batches in one phase of one split seed: float [B_s] seconds each (bytes for
    ``inter_node_bytes``, None where not recorded)."""

    layer: np.ndarray
    bound_balanced: np.ndarray
    bound_local: np.ndarray
    inter_node_bytes: np.ndarray | None = None  # inter-node bytes of each micro-batch, all layers (per-GPU dedup)
    bound_reachable: np.ndarray | None = None  # the reachable bound (any placement the slots allow; plan-free)
    split: dict[str, np.ndarray] | None = None  # "dispatch", "expert", "combine": seconds [B_s] (mean over layers)
    inter_busiest: np.ndarray | None = None  # inter-node sends of the busiest GPU, summed over layers [B_s]
    inter_mean: np.ndarray | None = None  # inter-node sends per GPU on average, summed over layers [B_s]


SPLIT_PARTS = ("dispatch", "expert", "combine")  # where a layer's time goes (the kernel time model's three terms)


def samples(res: PhaseResult, mask: np.ndarray) -> PhaseSamples:
    """The scored micro-batches' layer times and bounds (mean over layers) and inter-node bytes (sum over layers)
    of one phase result."""
    reach = (res.layer_times("bound_reachable_time")[mask] if "bound_reachable_time" in res.per_microbatch
             else None)
    pm = res.per_microbatch
    split = ({p: res.layer_times(f"{p}_time")[mask] for p in SPLIT_PARTS}
             if all(f"{p}_time" in pm for p in SPLIT_PARTS) else None)
    inter = ("busiest_inter_sends" in pm and "mean_inter_sends" in pm)
    return PhaseSamples(res.layer_times()[mask], res.layer_times("bound_balanced_time")[mask],
                        res.layer_times("bound_local_time")[mask], res.bytes_per_microbatch().sum(1)[mask], reach,
                        split,
                        np.asarray(pm["busiest_inter_sends"], np.float64).sum(1)[mask] if inter else None,
                        np.asarray(pm["mean_inter_sends"], np.float64).sum(1)[mask] if inter else None)


def time_split(plan: list[PhaseSamples]) -> dict | None:
    """Where one strategy's layer time goes, pooled over seeds: the mean seconds per micro-batch of each of
    :data:`SPLIT_PARTS`, and ``inter_imbalance``, the busiest GPU's inter-node sends over their mean per GPU
    (sums over the scored micro-batches and layers; 1 = every GPU moves the same, None without inter-node
    sends). The balanced bound replaces the busiest by the mean, so this ratio is how far the links are from it."""
    if any(p.split is None for p in plan):
        return None
    n = sum(len(p.layer) for p in plan)
    out: dict = {f"{k}_s": float(sum(p.split[k].sum() for p in plan) / n) for k in SPLIT_PARTS}
    mean = sum(float(p.inter_mean.sum()) for p in plan if p.inter_mean is not None)
    busy = sum(float(p.inter_busiest.sum()) for p in plan if p.inter_busiest is not None)
    out["inter_imbalance"] = busy / mean if mean > 0 else None
    return out


def score_on(plan: Plan, windows: Windows, setup: PhaseSetup, rule: str | None = None,
             phases: tuple[str, ...] = ("prefill", "decode"), admission: str = "batch") -> SimResult:
    """Replay the held-out window's scored rows of ``phases`` on ``plan`` under ``setup``; the replica rule is
    ``rule`` when given, else the plan's own (:attr:`Plan.dispatch_rule`, a plan chosen with its dispatch), else the
    setup's. A phase left out has no micro-batches in the result. ``admission``: how a grouped plan's router
    admits the held-out requests (:func:`moeplace.evaluate.windows.held_out_homes`)."""
    homes = held_out_homes(plan, windows.held, windows.held_signal, admission)
    ev = Plan(plan.placement, plan.cluster, homes, plan.strategy)
    tr = scoring_trace(windows.held, windows.held_signal)
    if set(phases) != set(PHASE_CODES):
        keep = np.isin(tr.tokens.phase, [PHASE_CODES[p] for p in phases])
        tr = Trace(tr.meta, tr.requests, tr.tokens.select(keep), None)
    return simulate(tr, ev, cost=setup.cost, batching=setup.batching,
                    rule=rule or plan.dispatch_rule or setup.rule)


def phase_of(res: SimResult, phase: str) -> PhaseResult:
    return res.prefill if phase == "prefill" else res.decode


@dataclass(frozen=True)
class SeedJob:
    """One planning job of a split seed: an EPLB baseline policy (scored under every rule of
    :data:`BASELINE_RULES`) or a strategy, planned on the phases ``group`` share."""

    seed_index: int
    group: tuple[str, ...]  # phases planned and simulated together (one deployment)
    name: str  # the strategy, or the baseline policy ("eplb", "eplb-hierarchical")
    baseline: bool
    params: dict  # what plan_one adds to the strategy's parameters


def seed_jobs(seed_index: int, strategies: list[str], setups: dict[str, PhaseSetup], num_groups: int
              ) -> list[SeedJob]:
    """The jobs of one split seed, in the order their results are kept (baselines first, per deployment)."""
    groups: dict[tuple, list[str]] = {}
    for ph, st in setups.items():
        groups.setdefault(st.key(), []).append(ph)
    jobs = []
    for phases in groups.values():
        st = setups[phases[0]]
        for base, kw in baseline_variants(num_groups, st.cluster):
            jobs.append(SeedJob(seed_index, tuple(phases), base, True, kw))
        for n in strategies:
            one = {"phases": phases[0]} if len(phases) == 1 and get_strategy(n).param("phases") else {}
            jobs.append(SeedJob(seed_index, tuple(phases), n, False, one))  # a strategy that weighs phases: ours
    return jobs


def job_label(job: SeedJob, setups: dict[str, PhaseSetup]) -> str:
    return f"planning {job.name} on {setups[job.group[0]].cluster.spec()} ({'+'.join(job.group)})"


def run_seed_job(job: SeedJob, windows: list[Windows], setups: dict[str, PhaseSetup], redundant: dict[str, int],
                 plan_one: Callable[..., Plan]) -> tuple[dict[str, SimResult], Plan]:
    """Plan one job on its seed's planning window (``windows[job.seed_index]``) and score it on the held-out one:
    ({name or policy/rule: SimResult}, plan). A pure function of its arguments, so an engine may run it anywhere."""
    win, st, R = windows[job.seed_index], setups[job.group[0]], redundant[job.group[0]]
    if job.baseline:
        plan = plan_one("eplb", win, st.cluster, R, st.deployment, job.params)
        return {f"{job.name}/{rule}": score_on(plan, win, st, rule, job.group) for rule in BASELINE_RULES}, plan
    plan = plan_one(job.name, win, st.cluster, R, st.deployment, job.params)
    return {job.name: score_on(plan, win, st, phases=job.group)}, plan


def collect_seed(jobs: list[SeedJob], outs: list[tuple[dict[str, SimResult], Plan]], setups: dict[str, PhaseSetup],
                 min_microbatches: int, allow_few: bool) -> tuple[dict, dict, dict]:
    """What :func:`measure_seed` returns, from one seed's jobs and their :func:`run_seed_job` answers (in order)."""
    out: dict[str, dict[str, PhaseSamples]] = {ph: {} for ph in setups}
    results: dict[str, dict[str, SimResult]] = {ph: {} for ph in setups}
    plans: dict[str, dict[str, Plan]] = {ph: {} for ph in setups}
    for job, (scored, plan) in zip(jobs, outs, strict=True):
        st = setups[job.group[0]]
        for name, res in scored.items():
            for ph in job.group:  # the mask depends on micro-batch sizes only: the same for every plan (paired)
                pr = phase_of(res, ph)
                out[ph][name] = samples(pr, scored_mask(pr, st.batching.capacity(ph), st.full_only, allow_few,
                                                        min_microbatches))
        if not job.baseline:
            for ph in job.group:
                results[ph][job.name], plans[ph][job.name] = scored[job.name], plan
    return out, results, plans


def measure_seed(windows: Windows, strategies: list[str], setups: dict[str, PhaseSetup],
                 redundant: dict[str, int], num_groups: int, plan_one: Callable[..., Plan],
                 min_microbatches: int, allow_few: bool, progress: Callable[[str], None] | None = None
                 ) -> tuple[dict, dict, dict]:
    """One split seed. Returns (samples[phase][name] -> PhaseSamples, results[phase][strategy] -> SimResult,
    plans[phase][strategy] -> Plan); names are the strategies and the baseline candidates ``policy/rule``.

    plan_one(name, windows, cluster, num_redundant, deployment, params) -> Plan plans one strategy.
    """
    jobs = seed_jobs(0, strategies, setups, num_groups)
    outs = []
    for job in jobs:
        if progress:
            progress(job_label(job, setups))
        outs.append(run_seed_job(job, [windows], setups, redundant, plan_one))
    return collect_seed(jobs, outs, setups, min_microbatches, allow_few)


def phase_block(per_seed: list[dict[str, PhaseSamples]], strategy: str, baseline: str) -> dict | None:
    """The ``phases[phase]`` entry of one strategy: pooled over seeds (None when nothing was scored)."""
    plan = [s[strategy] for s in per_seed]
    base = [s[baseline] for s in per_seed]
    n = int(sum(len(p.layer) for p in plan))
    if n == 0:
        return None
    ci = paired_ratio_ci([p.layer for p in plan], [b.layer for b in base])
    mean = float(sum(p.layer.sum() for p in plan) / n)
    bmean = float(sum(b.layer.sum() for b in base) / n)
    bal = float(sum(p.bound_balanced.sum() for p in plan) / n)
    loc = float(sum(p.bound_local.sum() for p in plan) / n)
    room = bmean - bal
    # the reachable bound is a property of the held-out traffic and the slots, not of the plan: the baseline's
    # samples carry the same values (same micro-batches), so either gives it
    reach = (float(sum(b.bound_reachable.sum() for b in base) / n)
             if all(b.bound_reachable is not None for b in base) else None)
    rroom = None if reach is None else bmean - reach
    return {"layer_time_s": mean, "ratio_to_baseline": ci.ratio, "ci95": [ci.lo, ci.hi], "microbatches": n,
            "seeds": ci.seeds, "decided": ci.decided, "bound_balanced_s": bal, "bound_local_s": loc,
            "bound_reachable_s": reach, "baseline_layer_time_s": bmean,
            "gap_closed": (bmean - mean) / room if room > 0 else None,
            "gap_closed_reachable": (bmean - mean) / rroom if rroom is not None and rroom > 0 else None,
            "time_split": time_split(plan), "baseline_time_split": time_split(base)}


def strongest_baseline(per_seed: list[dict[str, PhaseSamples]]) -> tuple[str | None, dict[str, float]]:
    """(name, {candidate: mean layer time}) of the baseline candidates of one phase; the name is None when nothing
    was scored."""
    names = [k for k in per_seed[0] if k.startswith("eplb") and "/" in k] if per_seed else []
    n = sum(len(per_seed[i][names[0]].layer) for i in range(len(per_seed))) if names else 0
    if n == 0:
        return None, {}
    means = {k: float(sum(s[k].layer.sum() for s in per_seed) / n) for k in names}
    return min(means, key=means.get), means  # a tie goes to the first candidate (global before hierarchical)


def summarize(per_seed: dict[str, list[dict[str, PhaseSamples]]], strategies: list[str]) -> dict:
    """The measured part of the compare JSON: ``baseline``, ``baseline_candidates`` and per strategy ``phases``
    (a phase with no scored micro-batches is absent)."""
    baseline: dict[str, str] = {}
    cands: dict[str, dict[str, float]] = {}
    phases: dict[str, dict] = {n: {} for n in strategies}
    for ph, seeds in per_seed.items():
        name, means = strongest_baseline(seeds)
        if name is None:
            continue
        baseline[ph], cands[ph] = name, means
        for n in strategies:
            blk = phase_block(seeds, n, name)
            if blk is not None:
                phases[n][ph] = blk
    return {"baseline": baseline, "baseline_candidates": cands, "phases": phases}


def format_phases(result: dict) -> str:
    """The measured phases as text: per phase its baseline, then per strategy the layer time, the ratio with its
    95% interval (``0.91 [0.88, 0.95]``), the balanced bound and the gap closed."""
    lines = []
    for ph, base in result.get("baseline", {}).items():
        rows = [(n, r["phases"][ph]) for n, r in result["strategies"].items() if ph in r.get("phases", {})]
        if not rows:
            continue
        mb, seeds = rows[0][1]["microbatches"], rows[0][1]["seeds"]
        bt = result["baseline_candidates"][ph][base]
        lines.append(f"{ph}: baseline {base} ({bt * 1e6:.1f} us per layer per micro-batch); {mb} scored "
                     f"micro-batches over {seeds} split seed(s)")
        lines.append(f"  {'strategy':<20}{'layer us':>10}  {'ratio [95% interval]':<26}{'bound us':>10}"
                     f"{'local us':>10}{'gap closed':>12}{'reach us':>10}{'gap reach':>11}")
        for n, b in rows:
            ci = f"{b['ratio_to_baseline']:.3f} [{b['ci95'][0]:.3f}, {b['ci95'][1]:.3f}]"
            mark = "" if b["decided"] else " ~"
            gap = "-" if b["gap_closed"] is None else f"{b['gap_closed']:+.2f}"
            rb = "-" if b.get("bound_reachable_s") is None else f"{b['bound_reachable_s'] * 1e6:.1f}"
            rg = "-" if b.get("gap_closed_reachable") is None else f"{b['gap_closed_reachable']:+.2f}"
            lines.append(f"  {n:<20}{b['layer_time_s'] * 1e6:>10.1f}  {ci + mark:<26}"
                         f"{b['bound_balanced_s'] * 1e6:>10.1f}{b['bound_local_s'] * 1e6:>10.1f}{gap:>12}"
                         f"{rb:>10}{rg:>11}")
    if lines:
        lines.append("  (~: the interval contains 1, not told apart from the baseline)")
    return "\n".join(lines)


__all__ = ["BASELINE_RULES", "MIN_MICROBATCHES", "PhaseSamples", "PhaseSetup", "SeedJob", "baseline_variants",
           "check_enough", "collect_seed", "expert_groups", "format_phases", "job_label", "measure_seed",
           "microbatch_counts", "phase_block", "run_seed_job", "scored_mask", "seed_jobs",
           "setup_of", "strongest_baseline", "summarize"]
