"""The operate loop: windows of routing -> counters and predicted time under the plan in force -> a policy ->
migration plan and new plan on disk.

Shape legend: L = MoE layers, E = logical experts, P = physical slots, W = GPUs.

For each window of the stream (:mod:`.streams`), in order:

1. counters (:mod:`.counters`): sampled per-domain expert counts; drops above capacity only when a capacity factor
   is set (the default is dropless, as SGLang and vLLM serve);
2. the window replayed by the simulator (:func:`moeplace.simulate.simulate`) on the plan in force: per-GPU load,
   balancedness, inter-node bytes and the predicted MoE layer time (dispatch + compute + combine, per micro-batch);
3. metrics for Prometheus and the dashboard (:mod:`.metrics`), when a sink is given;
4. the policy (:mod:`.policies`) decides; a change is priced by :func:`.migration.migration_plan`, applied from
   the next window on, and written (when an output folder is given): ``plan.json``, ``migration.json``,
   ``sglang.json``, ``vllm.json`` (atomic writes; ``changes/NNNN/`` keeps every change).

Total time = the sum of the windows' predicted layer time + the migrations' transfer time (a migration blocks the
engine, as SGLang's does). A bad source (a corrupt shard, a bad row) stops the loop with :class:`OperateError`;
files already written stay as they were (each was written whole, atomically), so the last plan is never lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from moeplace.deploy import ModelPreset, find_model, get_model
from moeplace.io import atomic_write_json, folder_replace_problem
from moeplace.operate.counters import count_window
from moeplace.operate.migration import MigrationPlan, expert_bytes, migration_plan
from moeplace.operate.policies import Context, Observation, Policy, PolicyState, make_policy
from moeplace.operate.streams import Stream
from moeplace.placement import Cluster, ModelLayers, Placement, Plan
from moeplace.plan.export import export_all, export_file_names, layers_of_trace
from moeplace.simulate import DEFAULT_RULE, BatchConfig, CostConfig, simulate
from moeplace.simulate.routing import mean_balancedness

EMA_WEIGHT = 0.5  # weight of the newest window in PolicyState.ema_load


class OperateError(ValueError):
    """The loop stopped: a bad source or a bad setting. The message names the window and the problem."""


@dataclass(frozen=True)
class OperateConfig:
    """How the loop counts, predicts and prices."""

    cluster: Cluster
    num_redundant: int = 0  # R redundant slots per layer
    window_requests: int = 256  # requests per window (a multiple of batching.decode_batch keeps decode batches)
    sample_every: int = 16  # 1-in-n sampling of the expert counters
    capacity_factor: float | None = None  # None: dropless; else pairs above floor(cf x pairs / E) per expert per
    # micro-batch are dropped and counted (token-dropping engines)
    model_preset: str | None = None  # sizes for the time model and the expert bytes; None: the trace's model
    weight_bytes: float = 2.0  # bytes per expert parameter (2 = bf16)
    batching: BatchConfig = field(default_factory=BatchConfig)
    rule: str = DEFAULT_RULE  # replica choice (moeplace.simulate.RULES)
    dedup: str = "per_gpu"  # communication mode of the time model ("per_gpu" or "two_hop")
    step_seconds: float = 0.0  # pace: wall-clock seconds per forward pass (0: as fast as possible)
    num_groups: int = 1  # EPLB expert groups (1: global policy)


@dataclass
class WindowReport:
    """One window as the loop saw it (JSON via :meth:`to_json`)."""

    window: int
    steps: int  # forward passes so far, this window included
    tokens: int
    domains: dict[str, int]  # tokens per domain
    balancedness: float
    top_expert_share: float  # max over layers of the hottest expert's share of the sampled selections
    gpu_load: list[float]  # pairs per GPU, summed over layers
    pairs: int
    inter_node_bytes: float
    layer_time_s: float
    plan_age_steps: int
    plan_version: int
    migration: dict | None = None  # summary of a change decided at the end of this window
    drop_ratio: float | None = None  # dropped / routed pairs; None (and not in the JSON) when dropless
    dropped_pairs: int | None = None

    def to_json(self) -> dict:
        out = asdict(self)
        if self.dropped_pairs is None:
            del out["drop_ratio"], out["dropped_pairs"]
        return out


@dataclass
class OperateResult:
    """The whole run: the benchmark keys plus the per-window history."""

    stream: str
    policy: str
    total_time_s: float
    layer_time_s: float
    migration_time_s: float
    migration_bytes: float
    mean_balancedness: float
    rebalances: int
    windows: list[WindowReport]
    params: dict

    def to_json(self, history: bool = True) -> dict:
        out = {"stream": self.stream, "policy": self.policy, "total_time_s": self.total_time_s,
               "layer_time_s": self.layer_time_s, "migration_time_s": self.migration_time_s,
               "migration_bytes": self.migration_bytes, "mean_balancedness": self.mean_balancedness,
               "rebalances": self.rebalances, "params": self.params}
        if history:
            out["windows"] = [w.to_json() for w in self.windows]
        return out


def _preset(cfg: OperateConfig, model: str) -> ModelPreset:
    if cfg.model_preset is not None:
        return get_model(cfg.model_preset)
    p = find_model(model)
    if p is None:
        raise OperateError(f"model {model!r} has no preset for the expert size and the time model; give one with "
                           "model_preset (CLI: --model-preset, e.g. gpt-oss-20b)")
    return p


def plan_folder_files() -> tuple[str, ...]:
    """What the loop writes into its output folder: the plan in force, its migration, its engine exports, and
    ``changes/`` (every change; names ending in "/" are folders)."""
    return ("plan.json", "migration.json", *export_file_names(), "changes/")


class PlanWriter:
    """Writes the plan in force and every change into ``out`` (atomic writes). OperateError before anything is
    written when ``out`` is unwritable or holds a file of :func:`plan_folder_files` that moeplace did not write."""

    def __init__(self, out: Path | None) -> None:
        self.out = out
        self.changes = 0
        problem = None if out is None else folder_replace_problem(out, plan_folder_files())
        if problem:
            raise OperateError(problem)

    def write(self, plan: Plan, migration: MigrationPlan | None, info: dict) -> None:
        if self.out is None:
            return
        dirs = [self.out]
        if migration is not None:
            self.changes += 1
            dirs.append(self.out / "changes" / f"{self.changes:04d}")
        for d in reversed(dirs):  # history first, so plan.json is always the newest complete change
            if migration is not None:
                atomic_write_json({**migration.to_json(), **info}, d / "migration.json")
            export_all(plan, d)
            plan.save(d / "plan.json")


def operate(stream: Stream, cfg: OperateConfig, policy: str | Policy = "moeplace", out: str | Path | None = None,
            sink: Callable[[WindowReport, dict], None] | None = None, initial: np.ndarray | None = None,
            **policy_params: object) -> OperateResult:
    """Run the loop over ``stream`` (module docstring). ``sink(report, state)`` is called after every window (the
    metrics endpoint and the dashboard); ``out`` is the folder for plans (None: write nothing). ``initial``: the
    placement in force at the start, phy2log int [L, E + num_redundant] (None: the linear placement)."""
    pol = policy if isinstance(policy, Policy) else make_policy(policy, **policy_params)
    meta = stream.meta
    L, E = meta.num_layers, meta.num_experts
    W = cfg.cluster.world_size
    if cfg.window_requests % cfg.batching.decode_batch and cfg.window_requests > cfg.batching.decode_batch:
        raise OperateError(f"window_requests={cfg.window_requests} must be a multiple of the decode batch "
                           f"({cfg.batching.decode_batch}) so windows keep the engine's decode batches")
    preset = _preset(cfg, meta.model)
    cost = CostConfig(hidden_size=preset.hidden_size, intermediate_size=preset.moe_intermediate_size)
    xbytes = expert_bytes(preset, cfg.weight_bytes)
    try:
        placement = Placement.linear(L, E, W, cfg.num_redundant)
        if initial is not None:
            p2l = np.asarray(initial)
            if p2l.shape != placement.phy2log.shape or not np.issubdtype(p2l.dtype, np.integer):
                raise ValueError(f"initial placement: expected int [{L}, {placement.num_slots}] (layers x slots of "
                                 f"{E} experts + {cfg.num_redundant} redundant), got {p2l.dtype} {list(p2l.shape)}")
            placement = Placement(p2l.astype(np.int64), E, W)
    except ValueError as e:
        raise OperateError(str(e)) from None
    P = placement.num_slots
    ctx = Context(cfg.cluster, P, xbytes, cfg.num_groups)
    state = PolicyState(placement.phy2log.copy())
    version = 0
    # the model's layer layout for the SGLang export: the trace's moe_layer_map; a trace without one is taken to
    # have every decoder layer an MoE layer (recorded in params)
    layers = layers_of_trace(meta) or ModelLayers(tuple(range(L)), L)
    plan = Plan(placement, cfg.cluster, strategy=f"operate:{pol.name}", planned_on=stream.label,
                extra={"operate_version": version}, model_layers=layers)
    writer = PlanWriter(Path(out) if out is not None else None)
    writer.write(plan, None, {})
    params = {"stream": stream.info, "cluster": cfg.cluster.spec(), "num_redundant": cfg.num_redundant,
              "window_requests": cfg.window_requests, "sample_every": cfg.sample_every,
              "capacity_factor": cfg.capacity_factor, "model_preset": preset.name, "expert_bytes": xbytes,
              "hidden_size": preset.hidden_size, "decode_batch": cfg.batching.decode_batch,
              "prefill_tokens": cfg.batching.prefill_tokens, "rule": cfg.rule, "dedup": cfg.dedup,
              "model_layers": {**layers.to_json(), "assumed": meta.moe_layer_map is None},
              "initial": "linear" if initial is None else "given",
              "policy": {k: v for k, v in asdict(pol).items() if k != "last"}}
    reports: list[WindowReport] = []
    layer_total = mig_time = mig_bytes = 0.0
    rebalances = steps = first_row = plan_since = 0
    last_load = None  # the previous window's load (PolicyState.load_before)
    t0 = time.monotonic()
    it = iter(stream.windows)
    w = 0
    while True:
        try:
            window = next(it)
        except StopIteration:
            break
        except (ValueError, OSError) as e:
            where = f" (last plan kept in {writer.out / 'plan.json'})" if writer.out is not None else ""
            raise OperateError(f"stream stopped at window {w}: {e}{where}") from None
        if len(window.requests) == 0:
            continue
        home = plan.home_of(window.requests.request_id)
        counts = count_window(window, home, cfg.batching, cfg.sample_every, cfg.capacity_factor, first_row)
        first_row += len(window.tokens)

        def run(p2l: np.ndarray, window=window) -> tuple[np.ndarray, object]:
            """float [B, L]: predicted time of each micro-batch and layer of the window under ``p2l``."""
            cand = Plan(Placement(p2l, E, W), cfg.cluster, strategy="candidate")
            res = simulate(window, cand, cost=cost, batching=cfg.batching, rule=cfg.rule).all
            pm = res.per_microbatch
            return pm[f"{cfg.dedup}.comm_time"] + pm["compute_time"], res

        lt_mb, res = run(state.phy2log)
        lt = lt_mb.sum(0)
        steps += counts.steps
        state.steps_since_change += counts.steps
        state.windows += 1
        load = counts.load
        state.load_since_change = load if state.load_since_change is None else state.load_since_change + load
        state.ema_before, state.load_before = state.ema_load, last_load
        state.ema_load = load if state.ema_load is None else (1 - EMA_WEIGHT) * state.ema_load + EMA_WEIGHT * load
        last_load = load
        bal = mean_balancedness(res.load)
        layer_total += float(lt.sum())
        rep = WindowReport(
            window=w, steps=steps, tokens=int(res.num_tokens),
            domains={d: int(n) for d, n in zip(counts.domains, counts.tokens.tolist(), strict=True)},
            balancedness=bal, top_expert_share=float(counts.top_expert_share().max()) if L else 0.0,
            gpu_load=res.load.sum(0).astype(float).tolist(), pairs=counts.pairs,
            inter_node_bytes=float(res.bytes_per_microbatch(cfg.dedup, "inter_node").sum()),
            layer_time_s=float(lt.sum()), plan_age_steps=steps - plan_since, plan_version=version,
            drop_ratio=counts.drop_ratio, dropped_pairs=counts.dropped)
        obs = Observation(w, counts.steps, load, bal, lt, lambda p2l: run(p2l)[0].sum(0), lt_mb,
                          lambda p2l: run(p2l)[0])
        new = pol.decide(obs, state, ctx)
        if new is not None and not np.array_equal(new, state.phy2log):
            mig = migration_plan(state.phy2log, new, cfg.cluster, xbytes)
            version += 1
            rebalances += 1
            mig_time += mig.seconds
            mig_bytes += mig.bytes
            state.phy2log = np.asarray(new, np.int64)
            state.steps_since_change = 0
            state.load_since_change = None
            plan_since = steps
            plan = Plan(Placement(state.phy2log, E, W), cfg.cluster, strategy=f"operate:{pol.name}",
                        planned_on=stream.label, extra={"operate_version": version, "decided_after_window": w},
                        model_layers=layers)
            info = {"version": version, "decided_after_window": w, "steps": steps,
                    "decision": dict(getattr(pol, "last", {}))}
            writer.write(plan, mig, info)
            rep.migration = {"version": version, "bytes": mig.bytes, "seconds": mig.seconds,
                             "moves": len(mig.moves), "layers": mig.layers}
        reports.append(rep)
        if sink is not None:
            sink(rep, {"label": stream.label, "policy": pol.name, "version": version, "rebalances": rebalances,
                       "migration_bytes": mig_bytes, "migration_time_s": mig_time, "layer_time_s": layer_total})
        if cfg.step_seconds > 0:
            lag = t0 + steps * cfg.step_seconds - time.monotonic()
            if lag > 0:
                time.sleep(lag)
        w += 1
    if not reports:
        raise OperateError(f"{stream.label}: no routed tokens to operate on (an empty trace, or one a killed import "
                           "left behind)")
    bals = [r.balancedness for r in reports]
    return OperateResult(stream.label, pol.name, layer_total + mig_time, layer_total, mig_time, mig_bytes,
                         float(np.mean(bals)) if bals else 1.0, rebalances, reports, params)
