"""Compare strategies: plan every strategy on one window of requests, score each with the simulator on another.

Shape legend: T = token rows, L = MoE layers, K = top-k, E = experts, Rq = requests.

Protocol (``moeplace compare``; the frontier sweep re-plans joint at several balance floors):

1. Split the trace's requests into a planning window and a held-out window (``holdout`` fraction; ``random``
   split with a seed, or ``ordered``: the last requests of the table are held out).
2. Each request's *signal* rows are its prefill rows; a request without prefill (decode-only traces such as
   gpt-oss-20b) uses its first ``prefix_tokens`` decode rows instead, which then stand for the prompt. Signal
   rows are never scored.
3. Every strategy plans on the planning window (:func:`moeplace.plan.make_plan`). Held-out requests get homes
   from the plan's grouper (their signal rows, admitted in table order) when the strategy groups requests, else
   round-robin in table order.
4. The simulator replays the held-out window's decode rows (default replica rule, per-GPU dedup) for every plan;
   ``inter_node_bytes_vs_linear`` divides by the linear placement (same redundant slots, round-robin homes) on
   the same rows.
5. Each row also keeps the per-GPU load (``load_per_gpu``: token-expert pairs over all layers, [W]) and the
   traffic matrix (``traffic_matrix_bytes``: bytes source GPU -> destination GPU, [W, W]) of the decode phase, and
   of prefill under ``prefill_`` names (None without prefill rows); :mod:`moeplace.evaluate.html` draws them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from moeplace.deploy import Deployment, expert_groups
from moeplace.deploy.profiles import default_redundant
from moeplace.evaluate.measure import (
    MIN_MICROBATCHES,
    PhaseSetup,
    check_enough,
    collect_seed,
    measure_seed,
    microbatch_counts,
    run_seed_job,
    score_on,
    seed_jobs,
    setup_of,
    summarize,
)
from moeplace.evaluate.score import planning_balance, sim_metrics
from moeplace.evaluate.windows import DEFAULT_PREFIX_TOKENS, split_windows
from moeplace.placement import Cluster, Placement, Plan
from moeplace.plan import FOE_STRATEGIES, MOE_STRATEGIES, get_strategy, make_plan
from moeplace.simulate import BatchConfig, CostConfig
from moeplace.simulate.routing import DEFAULT_RULE
from moeplace.trace.types import Trace, TraceMeta

TABLE_COLUMNS = (("inter_node_bytes_vs_linear", "inter/lin", "{:.3f}"), ("balancedness", "balance", "{:.3f}"),
                 ("imbalance_ratio", "imbal", "{:.3f}"), ("max_per_peer_bytes", "max peer KB", "{:.1f}"),
                 ("prefill_layer_time_s", "prefill us", "{:.1f}"), ("decode_layer_time_s", "decode us", "{:.1f}"),
                 ("prefill_layer_time_vs_eplb", "pre/eplb", "{:.3f}"),
                 ("decode_layer_time_vs_eplb", "dec/eplb", "{:.3f}"),
                 ("node_local_rate", "node-local", "{:.3f}"),
                 ("plan_seconds", "plan s", "{:.2f}"))


def compare(trace: Trace, cluster: Cluster | None, num_redundant: int | None, strategies: list[str] | None = None,
            holdout: float = 0.25, split: str = "random", seed: int = 0,
            prefix_tokens: int = DEFAULT_PREFIX_TOKENS, balance_floor: float | None = None,
            params: dict | None = None, progress: Callable[[str], None] | None = None,
            arrival: str = "table", cost: CostConfig | None = None, batching: BatchConfig | None = None,
            rule: str = DEFAULT_RULE, deployment: Deployment | None = None, *,
            phase_deployments: dict[str, Deployment] | None = None, split_seeds: list[int] | None = None,
            arrival_seed: int | None = None, min_microbatches: int = MIN_MICROBATCHES, allow_few: bool = False,
            phases: tuple[str, ...] = ("prefill", "decode"), on_seed: Callable[..., None] | None = None,
            engine=None) -> dict:
    """Plan each strategy on the planning window and score it on the held-out one. Returns the compare JSON.

    arrival: the held-out window's arrival order (``table`` or ``mixed``, see :mod:`moeplace.evaluate.windows`).
    cost, batching, rule: the time model, micro-batching and replica rule of the scoring (default: the trace's
    hidden size, kernel ``auto``, the simulator's batching and rule); ``deployment`` gives the strategies that
    price time the same (the CLI builds all four from one option group). ``phase_deployments`` (a profile's, one
    per phase, :func:`moeplace.deploy.profiles.phase_deployments`) replaces all of these: each phase is planned and
    scored on its own deployment and only its full micro-batches count (at least ``min_microbatches`` per phase
    unless ``allow_few``). ``params``: strategy parameters, each given to the strategies that declare it;
    ``balance_floor`` to those with a floor. ``seed`` seeds the planners; ``split_seeds`` (default ``[seed]``) the
    splits, ``arrival_seed`` (default: each split's seed) the mixed arrival order. ``phases``: the phases measured
    (a bench that fills each phase on its own cluster measures one at a time). ``on_seed(split_seed, windows,
    samples, results, plans)``, when given, is called after each split seed with what
    :func:`moeplace.evaluate.measure.measure_seed` returned (a bench pairs its own per-micro-batch quantities,
    e.g. inter-node bytes, across plans with them); it does not change the answer. ``engine``
    (:mod:`moeplace.engine`): plan and score every strategy x split seed as a separate task; the answer is the
    sequential one (only the measured seconds differ).

    Rows (the first split seed) give the predicted MoE layer time per micro-batch for prefill and decode and each
    strategy's ratio to eplb's; ``phases`` (all split seeds, :mod:`moeplace.evaluate.measure`) the ratio to the
    strongest EPLB with its 95% interval, the ideal bounds and the gap closed.
    """
    names = list(strategies or MOE_STRATEGIES)
    for n in names:
        get_strategy(n)
        if n in FOE_STRATEGIES:
            raise ValueError(f"compare scores plain MoE execution; strategy {n!r} plans an FoE model, whose all-to-all "
                             "and all-reduce run-ep measures (docs/FOE.md)")
    meta: TraceMeta = trace.meta
    if phase_deployments is not None:
        setups = {ph: setup_of(d, full_only=True) for ph, d in phase_deployments.items()}
    else:
        if cluster is None:
            raise ValueError("compare needs a cluster or per-phase deployments")
        one = PhaseSetup(cluster, cost or CostConfig(), batching or BatchConfig(), rule, deployment)
        setups = {"prefill": one, "decode": one}
    bad = [p for p in phases if p not in setups]
    if bad or not phases:
        raise ValueError(f"compare: phases must be a non-empty subset of {tuple(setups)}, got {phases!r}")
    setups = {p: setups[p] for p in ("prefill", "decode") if p in phases}
    redundant = {ph: (num_redundant if num_redundant is not None
                      else default_redundant(meta.num_experts, st.cluster.world_size)) for ph, st in setups.items()}
    seeds = list(split_seeds) if split_seeds else [seed]
    num_groups = expert_groups(meta.model)

    def plan_one(n: str, win, cl: Cluster, R: int, dep: Deployment | None, extra: dict) -> Plan:
        st = get_strategy(n)
        kw = {k: v for k, v in (params or {}).items() if st.param(k) is not None}
        kw.update(extra)
        if balance_floor is not None and st.param("balance_floor") is not None:
            kw["balance_floor"] = balance_floor
        if dep is None and cost is not None and st.prices_time:  # price as the scoring does
            kw.setdefault("hidden_size", cost.hidden_size)
            kw.setdefault("mode", cost.mode)
        return make_plan(n, win.plan_work, cl, R, planned_on=f"{meta.model} planning window", deployment=dep,
                         seed=seed, **kw)

    dec_ph = "decode" if "decode" in setups else "prefill"  # the phase the table rows' plan comes from
    dec_st = setups[dec_ph]
    out: dict = {"trace": meta.model, "synthetic": bool(meta.synthetic), "cluster": dec_st.cluster.spec(),
                 "cluster_hardware": dec_st.cluster.to_json(),
                 "num_redundant": redundant[dec_ph], "holdout": holdout, "split": split, "seed": seed,
                 "split_seeds": seeds, "arrival_seed": arrival_seed, "arrival": arrival,
                 "prefix_tokens": prefix_tokens,
                 "profile": next((d.profile for d in (phase_deployments or {}).values() if d.profile), None),
                 "phase_deployments": {ph: {"cluster": st.cluster.spec(), "num_redundant": redundant[ph],
                                            "rule": st.rule, "mode": st.cost.mode,
                                            "capacity": st.batching.capacity(ph), "full_only": st.full_only}
                                       for ph, st in setups.items()},
                 "expert_groups": num_groups, "strategies": {}}
    per_seed: dict[str, list] = {ph: [] for ph in setups}
    counts_all: list[dict] = []

    def windows_of(i: int, s: int):
        win = split_windows(trace, holdout, split, s, prefix_tokens, arrival, arrival_seed)
        counts = {ph: microbatch_counts(win, st.batching)[ph] for ph, st in setups.items()}
        check_enough(counts, setups, min_microbatches, allow_few, f"{meta.model} (split seed {s})")
        counts_all.append(counts)
        return win

    measured_seeds = None
    if engine is not None:  # every strategy x split seed is one task; answers kept in the sequential order
        t0 = time.perf_counter()
        wins = [windows_of(i, s) for i, s in enumerate(seeds)]
        jobs = [seed_jobs(i, names, setups, num_groups) for i in range(len(seeds))]
        if progress:
            progress(f"{sum(map(len, jobs))} planning jobs over {len(seeds)} split seed(s) on {engine.name} "
                     f"({engine.workers} workers)")
        flat = list(engine.map(run_seed_job, [j for js in jobs for j in js], wins, setups, redundant, plan_one))
        measured_seeds, at = [], 0
        for js in jobs:
            measured_seeds.append(collect_seed(js, flat[at:at + len(js)], setups, min_microbatches, allow_few))
            at += len(js)
    for i, s in enumerate(seeds):
        if measured_seeds is not None:
            win = wins[i]
            smp, results, plans = measured_seeds[i]
        else:
            win = windows_of(i, s)
            if progress and len(seeds) > 1:
                progress(f"split seed {s} ({i + 1} of {len(seeds)})")
            t0 = time.perf_counter()
            smp, results, plans = measure_seed(win, names, setups, redundant, num_groups, plan_one,
                                               min_microbatches, allow_few, progress if i == 0 else None)
        for ph in setups:
            per_seed[ph].append(smp[ph])
        if on_seed is not None:
            on_seed(s, win, smp, results, plans)
        if i == 0:
            out["planning_requests"] = int(win.plan_work.num_requests)
            out["held_out_requests"] = int(len(win.held.requests))
            out["strategies"] = legacy_rows(names, win, dec_st, results, plans, redundant[dec_ph],
                                            time.perf_counter() - t0)
            out["scored_tokens"] = next(iter(out["strategies"].values()))["scored_tokens"] if names else 0
    out["microbatch_counts"] = {ph: {"microbatches": [c[ph]["microbatches"] for c in counts_all],
                                     "full": [c[ph]["full"] for c in counts_all]} for ph in setups}
    measured = summarize(per_seed, names)
    out["baseline"], out["baseline_candidates"] = measured["baseline"], measured["baseline_candidates"]
    for n in names:
        out["strategies"][n]["phases"] = measured["phases"][n]
    return out


def legacy_rows(names: list[str], win, dec_st: PhaseSetup, results: dict, plans: dict, num_redundant: int,
                wall: float) -> dict:
    """The per-strategy rows of the first split seed (decode from the decode phase's plan, prefill from the
    prefill phase's); ``inter_node_bytes_vs_linear`` divides by the linear placement on the decode cluster."""
    meta = win.held.meta
    base_plan = Plan(Placement.linear(meta.num_layers, meta.num_experts, dec_st.cluster.world_size, num_redundant),
                     dec_st.cluster, strategy="linear")
    base = score_on(base_plan, win, dec_st).decode.to_json()
    base_bytes = base["inter_node_bytes"]["total"]
    rows: dict = {}
    for n in names:
        d_res, p_res = (results.get(ph, results.get(other)) for ph, other in (("decode", "prefill"),
                                                                            ("prefill", "decode")))
        dec, pre = d_res[n].decode.to_json(), p_res[n].prefill.to_json()
        plan = plans.get("decode", plans.get("prefill"))[n]
        row = sim_metrics(dec, base_bytes, pre)
        row["scored_tokens"] = int(base["num_tokens"])
        # per-GPU pictures for the HTML report: load [W] (pairs, summed over layers) and bytes [W, W] (source ->
        # destination, dispatch + combine, per-GPU dedup); prefill's are None when no prefill rows were scored
        has_pre = pre["num_microbatches"] > 0
        row["load_per_gpu"], row["traffic_matrix_bytes"] = dec["load_per_gpu"], dec["traffic_matrix_bytes"]
        row["prefill_load_per_gpu"] = pre["load_per_gpu"] if has_pre else None
        row["prefill_traffic_matrix_bytes"] = pre["traffic_matrix_bytes"] if has_pre else None
        row["fallback"] = None if plan.fallback is None else plan.fallback.to_json()
        row["plan_seconds"] = plan.plan_seconds
        row["planning_balancedness"] = planning_balance(plan, win)
        row["wall_seconds"] = wall
        rows[n] = row
    ref = rows.get("eplb")
    if ref:
        for row in rows.values():
            for ph in ("prefill", "decode"):
                a, b = row.get(f"{ph}_layer_time_s"), ref.get(f"{ph}_layer_time_s")
                row[f"{ph}_layer_time_vs_eplb"] = a / b if a is not None and b else None
    return rows


def sweep_floor(trace: Trace, cluster: Cluster, num_redundant: int, result: dict, floors: list[float],
                holdout: float = 0.25, split: str = "random", seed: int = 0,
                prefix_tokens: int = DEFAULT_PREFIX_TOKENS, balance_floor: float | None = None,
                params: dict | None = None, progress: Callable[[str], None] | None = None,
                arrival: str = "table", **scoring: object) -> dict:
    """The bytes-vs-balance frontier: every strategy of ``result`` (a :func:`compare` answer) as one point, and
    each strategy with a balance floor (joint) re-planned at each floor of ``floors`` under its bytes objective
    (the floor binds only there). Returns strategy -> list of points. ``scoring``: compare's cost, batching, rule,
    deployment."""
    frontier: dict = {}
    floored = [n for n in result["strategies"] if get_strategy(n).param("balance_floor") is not None]
    if not floored:
        raise ValueError(f"--sweep-floor re-plans strategies with a balance floor; none of "
                         f"{', '.join(result['strategies'])} has one")
    for n, r in result["strategies"].items():
        obj = get_strategy(n).param("objective")  # the objective the row was planned under (None: has none)
        frontier[n] = [{"balance_floor": None,
                        "objective": (params or {}).get("objective", obj.default) if obj is not None else None,
                        "balancedness": r["balancedness"],
                        "inter_node_bytes_vs_linear": r["inter_node_bytes_vs_linear"]}]
    for n in floored:
        kw = dict(params or {})
        if get_strategy(n).param("objective") is not None:
            kw["objective"] = "bytes"
        for f in floors:
            if progress:
                progress(f"sweep {n} --objective bytes --balance-floor {f}")
            r = compare(trace, cluster, num_redundant, [n], holdout, split, seed, prefix_tokens, f, kw,
                        arrival=arrival, **scoring)["strategies"][n]
            frontier[n].append({"balance_floor": f, "objective": kw.get("objective"),
                                "balancedness": r["balancedness"],
                                "inter_node_bytes_vs_linear": r["inter_node_bytes_vs_linear"]})
    return frontier


def format_cell(key: str, value: float | None, fmt: str) -> str | None:
    """One :data:`TABLE_COLUMNS` cell as its heading's unit shows it (KB, microseconds); None when missing."""
    if value is None:
        return None
    if key == "max_per_peer_bytes":
        value = value / 1e3
    if key.endswith("layer_time_s"):
        value = value * 1e6
    return fmt.format(value)


def format_table(result: dict) -> str:
    """The compare answer as a fixed-width text table, one row per strategy."""
    head = f"{'strategy':<20}" + "".join(f"{h:>12}" for _, h, _ in TABLE_COLUMNS)
    lines = [head, "-" * len(head)]
    for name, row in result["strategies"].items():
        cells = [format_cell(key, row.get(key), fmt) for key, _, fmt in TABLE_COLUMNS]
        lines.append(f"{name:<20}" + "".join(f"{c if c is not None else '-':>12}" for c in cells))
    return "\n".join(lines)


def frontier_figure(frontier: dict, title: str = "Balance-floor frontier"):
    """The frontier as a matplotlib figure: held-out balancedness against inter-node bytes / linear, one line per
    strategy of ``frontier`` ({name: [{"balancedness", "inter_node_bytes_vs_linear", ...}]}), titled ``title``,
    with an arrow to the better corner (lower right: more balanced, fewer bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for name, pts in frontier.items():  # the compare row as a marker; the points re-planned at floors dashed
        row = [p for p in pts if p.get("balance_floor") is None]
        swept = sorted((p for p in pts if p.get("balance_floor") is not None), key=lambda p: p["balancedness"])
        (mark,) = ax.plot([p["balancedness"] for p in row], [p["inter_node_bytes_vs_linear"] for p in row],
                          marker="o", linestyle="none", label=name)
        if swept:
            ax.plot([p["balancedness"] for p in swept], [p["inter_node_bytes_vs_linear"] for p in swept],
                    marker="o", mfc="white", linestyle="--", color=mark.get_color(),
                    label=f"{name} at floors " + ", ".join(f"{p['balance_floor']:g}" for p in swept))
    ax.set_xlabel("balancedness (held-out, mean/max GPU load; higher is better)")
    ax.set_ylabel("inter-node bytes / linear  (lower is better)")
    ax.set_title(title, fontsize=10)
    ax.annotate("better: lower right", xy=(0.97, 0.05), xytext=(0.72, 0.28), xycoords="axes fraction", fontsize=9,
                ha="center", color="#2b8a3e", arrowprops={"arrowstyle": "->", "color": "#2b8a3e", "lw": 1.5})
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")  # where it hides the fewest points
    fig.tight_layout()
    return fig


def plot_frontier(frontier: dict, out: str, title: str = "Balance-floor frontier") -> None:
    """Write :func:`frontier_figure` to the image file ``out`` (format from its suffix; png without one)."""
    import io

    import matplotlib.pyplot as plt

    from moeplace.io import atomic_write_bytes

    fig = frontier_figure(frontier, title)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=120, format=out.rsplit(".", 1)[-1] if "." in out else "png")
    plt.close(fig)
    atomic_write_bytes(buf.getvalue(), out)


def run_compare(trace: Trace, cluster: Cluster | None, num_redundant: int | None,
                strategies: list[str] | None = None,
                holdout: float = 0.25, split: str = "random", seed: int = 0,
                prefix_tokens: int = DEFAULT_PREFIX_TOKENS, balance_floor: float | None = None,
                params: dict | None = None, progress: Callable[[str], None] | None = None,
                arrival: str = "table", floors: list[float] | None = None, plot: str | None = None,
                cost: CostConfig | None = None, batching: BatchConfig | None = None, rule: str = DEFAULT_RULE,
                deployment: Deployment | None = None, **measure: object) -> dict:
    """``moeplace compare``: :func:`compare`, then the frontier sweep over ``floors`` (stored under
    ``"frontier"``; on the first split seed) and its plot when asked. ``measure``: compare's keyword-only
    measurement options (phase_deployments, split_seeds, arrival_seed, min_microbatches, allow_few)."""
    scoring = {"cost": cost, "batching": batching, "rule": rule, "deployment": deployment}
    res = compare(trace, cluster, num_redundant, strategies, holdout, split, seed, prefix_tokens, balance_floor,
                  params, progress, arrival, **scoring, **measure)
    if floors:
        first = {k: v for k, v in measure.items() if k != "on_seed"}  # the sweep's compares report nothing per seed
        if first.get("split_seeds"):
            first["split_seeds"] = list(first["split_seeds"])[:1]  # type: ignore[call-overload]
        res["frontier"] = sweep_floor(trace, cluster, num_redundant, res, floors, holdout, split, seed,
                                      prefix_tokens, balance_floor, params, progress, arrival, **scoring, **first)
        if plot:
            plot_frontier(res["frontier"], plot, f"Balance-floor frontier: {res['trace']} on {res['cluster']}, "
                          f"R={res['num_redundant']} (held-out requests)")
    elif plot:
        raise ValueError("a frontier plot needs a floor sweep (--sweep-floor)")
    return res
