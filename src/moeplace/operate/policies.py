"""Rebalancer policies, in a registry keyed by name: when to change the placement, and to what.

Shape legend: L = MoE layers, E = logical experts, P = physical slots, W = GPUs.

Every policy is called at the end of each window with what the loop observed and returns a new ``phy2log``
[L, P] or None (keep the plan). Steps are forward passes (micro-batches, prefill and decode).

- ``static``: never changes the initial (linear) placement.
- ``static-eplb``: EPLB from the first window's load, once.
- ``periodic``: EPLB from the load accumulated since the last change, every ``period_steps`` steps; the new map
  replaces the old one whole (SGLang: ``--eplb-rebalance-num-iterations``, default 1000).
- ``periodic-preserve``: the same, with vLLM's slot preservation: experts that stay on a GPU keep their slots.
- ``threshold``: when the window's balancedness falls below ``threshold``, EPLB of that window's load, deployed
  only when the evidence test below passes (scored: EPLB of the window before).
- ``moeplace`` (ours): per layer, two candidates built from the recent load (an exponential average of windows,
  newest weight 1/2): *replicate first* (redundant replicas move: hot experts gain replicas on the least-loaded
  GPUs, cold ones lose theirs; a primary moves only to make room) and *re-place* (EPLB, its GPUs matched to the old
  ones with ``linear_sum_assignment`` so the fewest experts move, and unchanged slots kept). Each layer keeps the
  candidate with the largest point net gain (layer time saved on the newest window per step, times
  ``horizon_steps``, minus the layer's migration time); at most ``chunk_layers`` layers, the largest net first,
  are considered; of the prefixes of that list that pass the evidence test, the one with the largest bound gain
  net of its migration time moves: migration in chunks of layers.

Evidence test (:func:`gain_evidence`; ``moeplace`` and ``threshold``). After window ``w`` a policy builds each
candidate twice with the same construction: *scored* from the load without window w, and *deployed* from the load
with it. The scored one is compared with the plan in force on window w, which it did not see (out of sample:
fitting a placement to a window's noise gains nothing on another window); the deployed one is what would move, one
window ahead of its data, as the scored one was. Let ``c_b`` and ``n_b`` be the predicted MoE time (all layers) of
micro-batch ``b`` of window w under the plan in force and under the scored placement, ``T = sum_b c_b``, ``s`` the
window's steps (= micro-batches), ``r = sum_b n_b / T`` and ``[lo, hi]`` its paired 95% interval
(:func:`moeplace.intervals.paired_ratio_ci`: the same micro-batches for both, bootstrap seeded by the window index).
The gain per step is ``(1 - r) T / s``, its lower confidence bound ``G_lo = (1 - hi) T / s``. The move happens only
when ``G_lo x horizon_steps > 0`` and ``G_lo x horizon_steps > margin x C``, with ``C`` the migration time of plan
in force -> deployed placement (:func:`moeplace.operate.migration.migration_plan`: changed slots x expert bytes on
the busiest link / its bandwidth): the lower bound of the gain over the
``horizon_steps`` steps the move is expected to stay in force must pay for it. ``moeplace`` also keeps a ledger
(``pay_back``): after a move, each window charges its saving (predicted time under the plan before the move minus
under the plan in force, on the window's micro-batches) against the move's migration time; what is not yet paid back
(``owed_s``) is added to ``C`` for the next move, and the ledger closes once the saving covers it. A stream whose mix
changes before a move pays back so stops adding moves to an unpaid one. The horizon a move is priced over is
``horizon_steps`` only once the stream has shown that a re-fitted placement keeps its gain for
``persistence_windows`` windows (:meth:`MoePlace.horizon`); before that, or when the gain fades sooner, it is the
steps over which the gain persisted (the table-order replay, whose mix changes every 4 windows, so makes no move).
Window 0 has no earlier window to
score on: no move. On a stationary stream (the same requests shuffled) whose plan already fits the traffic, a
re-fitted placement gains nothing beyond noise on a window it did not see, so nothing moves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING

from moeplace.params import Param, bind, check_declared

if TYPE_CHECKING:  # numpy and the planner load when a policy decides: the CLI reads this registry at start
    import numpy as np

    from moeplace.placement import Cluster

SGLANG_REBALANCE_STEPS = 1000  # SGLang's eplb_rebalance_num_iterations default (server_args.py)
DEFAULT_PERSISTENCE_WINDOWS = 6  # moeplace: windows a re-fitted placement's gain must persist for the full horizon


@dataclass
class Observation:
    """What the loop saw in the window that just ended, under the plan in force."""

    window: int  # index of the window
    steps: int  # forward passes in it
    load: np.ndarray  # float64 [L, E]: estimated expert load (sampled counts x n)
    balancedness: float  # mean over layers of mean_g / max_g GPU load
    layer_time: np.ndarray  # float64 [L]: predicted MoE layer time of the window, seconds, per layer
    predict: Callable[[np.ndarray], np.ndarray]  # phy2log [L, P] -> float [L] layer time of this window's routing
    layer_time_mb: np.ndarray | None = None  # float64 [B, L]: the same per micro-batch (B = its micro-batches)
    predict_mb: Callable[[np.ndarray], np.ndarray] | None = None  # phy2log [L, P] -> float [B, L]


@dataclass
class Context:
    """What a policy may use besides the observation."""

    cluster: Cluster
    num_slots: int  # P
    expert_bytes: float  # bytes of one expert's weights
    num_groups: int = 1  # expert groups for EPLB (1: global policy)


@dataclass
class PolicyState:
    """The plan in force and what has accumulated since it changed."""

    phy2log: np.ndarray  # int64 [L, P]
    steps_since_change: int = 0
    load_since_change: np.ndarray | None = None  # float64 [L, E]
    ema_load: np.ndarray | None = None  # float64 [L, E]: exponential average of the windows, the newest included
    windows: int = 0
    ema_before: np.ndarray | None = None  # float64 [L, E]: ema_load before the newest window (None after window 0)
    load_before: np.ndarray | None = None  # float64 [L, E]: the load of the window before the newest one


def eplb_map(load: np.ndarray, ctx: Context) -> np.ndarray:
    """int64 [L, P]: DeepSeek's EPLB for ``load`` [L, E] on the context's cluster."""
    from moeplace.plan.eplb import rebalance

    c = ctx.cluster
    return rebalance(load, ctx.num_slots, ctx.num_groups, c.num_nodes, c.world_size)


@dataclass
class Policy:
    """Base: never changes anything (``static``)."""

    name: str = "static"

    def decide(self, obs: Observation, state: PolicyState, ctx: Context) -> np.ndarray | None:
        return None


@dataclass
class StaticEplb(Policy):
    name: str = "static-eplb"

    def decide(self, obs: Observation, state: PolicyState, ctx: Context) -> np.ndarray | None:
        return eplb_map(obs.load, ctx) if obs.window == 0 else None


@dataclass
class Periodic(Policy):
    name: str = "periodic"
    period_steps: int = SGLANG_REBALANCE_STEPS
    preserve: bool = False  # vLLM's slot preservation

    def decide(self, obs: Observation, state: PolicyState, ctx: Context) -> np.ndarray | None:
        if state.steps_since_change < self.period_steps:
            return None
        from moeplace.operate.migration import preserve_slots

        new = eplb_map(state.load_since_change, ctx)
        return preserve_slots(state.phy2log, new, ctx.cluster.world_size) if self.preserve else new


@dataclass(frozen=True)
class Evidence:
    """The evidence test of one candidate move (module docstring); every field JSON-able."""

    ratio: float  # r: the candidate's time over the plan in force's on the newest window's micro-batches
    lo: float  # paired 95% interval of r
    hi: float
    gain_per_step_s: float  # (1 - r) T / s
    gain_lo_per_step_s: float  # G_lo = (1 - hi) T / s
    horizon_gain_lo_s: float  # G_lo x horizon_steps
    cost_s: float  # C: migration seconds
    bytes: float  # migration bytes over links
    moves: bool  # horizon_gain_lo_s > margin x cost_s and > 0

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def gain_evidence(obs: Observation, current: np.ndarray, scored: np.ndarray, deploy: np.ndarray, ctx: Context,
                  horizon_steps: int, margin: float, scored_mb: np.ndarray | None = None, owed_s: float = 0.0
                  ) -> Evidence:
    """The evidence test (module docstring): ``scored`` (int [L, P], built without the newest window) is compared
    with ``current`` on the newest window's micro-batches; the move priced is ``current`` -> ``deploy`` (the same
    construction on the load with the newest window). ``scored_mb``: float [B, L] the scored placement's predicted
    times when already replayed (else ``obs.predict_mb(scored)``)."""
    import numpy as np

    from moeplace.intervals import paired_ratio_ci
    from moeplace.operate.migration import migration_plan

    cur_b = obs.layer_time_mb.sum(1)
    new_b = (obs.predict_mb(scored) if scored_mb is None else scored_mb).sum(1)
    mig = migration_plan(current, deploy, ctx.cluster, ctx.expert_bytes)
    T, s = float(cur_b.sum()), max(obs.steps, 1)
    if T <= 0 or np.array_equal(deploy, current):
        return Evidence(1.0, 1.0, 1.0, 0.0, 0.0, 0.0, mig.seconds, mig.bytes, False)
    ci = paired_ratio_ci(new_b, cur_b, seed=int(obs.window))
    lo_gain = (1.0 - ci.hi) * T / s
    over = lo_gain * horizon_steps
    return Evidence(ci.ratio, ci.lo, ci.hi, (1.0 - ci.ratio) * T / s, lo_gain, over, mig.seconds, mig.bytes,
                    bool(over > 0 and over > margin * (mig.seconds + owed_s)))


@dataclass
class Threshold(Policy):
    name: str = "threshold"
    threshold: float = 0.5  # consider a rebalance when the window's balancedness is below this
    horizon_steps: int = SGLANG_REBALANCE_STEPS  # steps a change is expected to pay back over
    margin: float = 1.0  # move only when the gain's lower bound over the horizon > margin x migration time
    last: dict = field(default_factory=dict)  # diagnostics of the last decision (JSON-able)

    def decide(self, obs: Observation, state: PolicyState, ctx: Context) -> np.ndarray | None:
        self.last = {"window": obs.window}
        if obs.balancedness >= self.threshold:
            return None
        if state.load_before is None:
            self.last["reason"] = "no earlier window to build a candidate from"
            return None
        new = eplb_map(obs.load, ctx)
        ev = gain_evidence(obs, state.phy2log, eplb_map(state.load_before, ctx), new, ctx, self.horizon_steps,
                           self.margin)
        self.last.update(evidence=ev.to_json(), reason="the gain's lower bound pays" if ev.moves else
                         "the gain's lower bound does not pay for the migration")
        return new if ev.moves else None


def replicate_first(current: np.ndarray, load: np.ndarray, num_gpus: int) -> np.ndarray:
    """int64 [L, P]: ``current`` with only redundant replicas moved to follow ``load`` [L, E].

    Target replica counts are EPLB's (one more replica at a time to the largest load per replica, at most one per
    GPU). Experts above their target free their replicas on the busiest GPUs; experts below it get the freed
    slots, hottest first, each on the least-loaded GPU that does not hold it yet. An expert's last replica never
    moves. A layer where no such assignment exists is left unchanged.
    """
    import numpy as np

    from moeplace.plan.eplb import replicate_experts

    cur = np.asarray(current, np.int64)
    L, P = cur.shape
    E = load.shape[1]
    S = P // num_gpus
    gpu = np.arange(P) // S
    _, _, target = replicate_experts(np.asarray(load, np.float64), P, max_replicas=num_gpus)
    out = cur.copy()
    for li in range(L):
        row = cur[li].copy()
        c = target[li]
        share = load[li] / c  # predicted load of one replica under the target counts
        have = np.bincount(row, minlength=E)
        gl = np.bincount(gpu, weights=share[row], minlength=num_gpus)
        free: list[int] = []
        for e in np.flatnonzero(have > c).tolist():
            slots = np.flatnonzero(row == e)
            slots = slots[np.argsort(-gl[gpu[slots]], kind="stable")][: have[e] - c[e]]
            for p in slots.tolist():
                gl[gpu[p]] -= share[e]
                row[p] = -1
                free.append(p)
        need = [e for e in np.argsort(-share, kind="stable").tolist() for _ in range(max(c[e] - have[e], 0))]
        ok = True
        for e in need:
            cand = [p for p in free if not (row[gpu == gpu[p]] == e).any()]
            if cand:
                p = min(cand, key=lambda q: (gl[gpu[q]], q))
            else:  # every free slot is on a GPU holding e: shift one other expert x into a free slot first
                p = _make_room(row, gpu, free, e, gl, share)
                if p < 0:
                    ok = False
                    break
            row[p] = e
            gl[gpu[p]] += share[e]
            free.remove(p)
        if ok and not free:
            out[li] = row
    return out


def _make_room(row: np.ndarray, gpu: np.ndarray, free: list[int], e: int, gl: np.ndarray,
               share: np.ndarray) -> int:
    """A slot for a new replica of ``e`` when every free slot sits on a GPU that holds ``e``: move the coldest
    expert x of the least-loaded GPU without ``e`` into a free slot whose GPU lacks x, and return x's old slot
    (free, on a GPU without ``e``); -1 when no such x exists. Edits ``row``, ``free`` and ``gl`` in place."""
    import numpy as np

    W = int(gpu.max()) + 1
    holders = set(gpu[row == e].tolist())
    for g in sorted(set(range(W)) - holders, key=lambda h: gl[h]):
        for q in sorted(np.flatnonzero((gpu == g) & (row >= 0)).tolist(), key=lambda s: share[row[s]]):
            x = int(row[q])
            dest = [f for f in free if not (row[gpu == gpu[f]] == x).any()]
            if dest:
                f = dest[0]
                row[f] = x
                gl[gpu[f]] += share[x]
                free.remove(f)
                row[q] = -1
                gl[g] -= share[x]
                free.append(q)
                return q
    return -1


@dataclass
class MoePlace(Policy):
    name: str = "moeplace"
    horizon_steps: int = SGLANG_REBALANCE_STEPS  # steps a change is expected to pay back over
    margin: float = 1.0  # move only when the gain's lower bound over the horizon > margin x migration time
    chunk_layers: int = 0  # layers changed per decision at most (0: a quarter of the layers, at least 1)
    pay_back: bool = True  # a move must also pay what the earlier moves still owe (:meth:`settle`)
    persistence_windows: int = DEFAULT_PERSISTENCE_WINDOWS  # K of :meth:`horizon` (0: always horizon_steps)
    last: dict = field(default_factory=dict)  # diagnostics of the last decision (JSON-able)

    def __post_init__(self) -> None:
        self._anchor: np.ndarray | None = None  # int [L, P]: the plan in force before the moves that still owe
        self.debt_s = 0.0  # their migration seconds minus the time they saved since (predicted; 0 without pay_back)
        self._past: list[np.ndarray] = []  # the recent-load estimates before each of the last K windows, newest first

    def horizon(self, obs: Observation, state: PolicyState, ctx: Context) -> tuple[int, list[float]]:
        """(steps a move is trusted to stay useful, the persistence curve g_k in seconds): how long a placement
        fitted to the recent load keeps its gain, measured on the newest window. For each of the last K =
        ``persistence_windows`` estimates of the recent load (the EMA before window w, w - 1, ..., w - K + 1),
        re-place EPLB on it (matched to the plan in force) and predict the newest window: g_k = time under the plan
        in force minus under that placement. With ``rel_k = clip(g_k / g_1, 0, 1)`` the gain has persisted
        ``sum_k rel_k`` windows of what the history shows; while the history is shorter than K, or when the gain
        has faded by lag K (``rel_K < 1/2``), the horizon is that many windows of the newest window's steps (at
        most ``horizon_steps``), else ``horizon_steps``. A mix that changes every few windows so never prices a
        move as if it stayed 1,000 steps; a slow drift, or the linear placement on a stationary stream, gets the
        full horizon once K windows have shown the gain. ``g_1 <= 0``: nothing to gain, the full horizon (the
        evidence test rejects the move anyway)."""
        import numpy as np

        from moeplace.operate.migration import match_gpus

        K = self.persistence_windows
        if K <= 0:
            return self.horizon_steps, []
        if obs.window == 0:
            self._past = []
        if state.ema_before is not None:
            self._past.insert(0, np.array(state.ema_before))
            del self._past[K:]
        if not self._past:
            return self.horizon_steps, []
        W = ctx.cluster.world_size
        base = float(obs.layer_time_mb.sum())
        g = [base - float(obs.predict_mb(match_gpus(state.phy2log, eplb_map(x, ctx), W)).sum()) for x in self._past]
        if g[0] <= 0:
            return self.horizon_steps, g
        rel = np.clip(np.array(g) / g[0], 0.0, 1.0)
        if len(self._past) >= K and rel[-1] >= 0.5:
            return self.horizon_steps, g
        return max(1, min(self.horizon_steps, int(obs.steps * rel.sum()))), g

    def settle(self, obs: Observation) -> None:
        """Charge the newest window's saving to the moves that still owe: the predicted time of its micro-batches
        under the plan before them minus under the plan in force. At <= 0 they have paid back (nothing owed)."""
        if obs.window == 0:
            self._anchor, self.debt_s = None, 0.0
        if self._anchor is None:
            return
        self.debt_s -= float(obs.predict_mb(self._anchor).sum() - obs.layer_time_mb.sum())
        if self.debt_s <= 0:
            self._anchor, self.debt_s = None, 0.0

    def decide(self, obs: Observation, state: PolicyState, ctx: Context) -> np.ndarray | None:
        import numpy as np

        from moeplace.operate.migration import migration_plan

        self.last = {"window": obs.window, "layers": []}
        if self.pay_back:
            self.settle(obs)
        H, curve = self.horizon(obs, state, ctx)
        if state.ema_before is None:
            self.last["reason"] = "no earlier window to build a candidate from"
            return None
        cur = state.phy2log
        L = cur.shape[0]
        scored = self.candidates(cur, state.ema_before, ctx)  # built without the newest window: scored on it
        deploy = self.candidates(cur, state.ema_load, ctx)  # the same construction with it: what would move
        scale = H / max(obs.steps, 1)
        best_net = np.zeros(L)
        best = np.full(L, "", dtype=object)
        mb = {}  # candidate -> float [B, L] on the newest window
        for name, cand in scored.items():
            changed = (cand != cur).any(1) & (deploy[name] != cur).any(1)
            if not changed.any():
                continue
            mb[name] = obs.predict_mb(np.where(changed[:, None], cand, cur))
            gain = (obs.layer_time_mb - mb[name]).sum(0) * scale  # [L]
            for li in np.flatnonzero(changed).tolist():
                cost = migration_plan(cur[li:li + 1], deploy[name][li:li + 1], ctx.cluster, ctx.expert_bytes).seconds
                net = gain[li] - cost
                if gain[li] > 0 and net > best_net[li]:
                    best_net[li], best[li] = net, name
        order = [li for li in np.argsort(-best_net, kind="stable").tolist() if best[li]]
        order = order[:self.chunk_layers or max(1, L // 4)]
        chosen: list[int] = []
        ev = None
        for k in range(len(order), 0, -1):  # every prefix, longest first; keep the largest bound net of cost
            layers = order[:k]
            sc, new, sc_mb = cur.copy(), cur.copy(), obs.layer_time_mb.copy()
            for li in layers:
                sc[li], new[li] = scored[best[li]][li], deploy[best[li]][li]
                sc_mb[:, li] = mb[best[li]][:, li]
            e = gain_evidence(obs, cur, sc, new, ctx, H, self.margin, sc_mb, self.debt_s)
            if e.moves and (ev is None or e.horizon_gain_lo_s - e.cost_s > ev.horizon_gain_lo_s - ev.cost_s):
                chosen, ev = layers, e
        self.last = {"window": obs.window, "layers": sorted(chosen),
                     "candidates": {str(li): str(best[li]) for li in chosen},
                     "predicted_net_seconds": float(best_net[chosen].sum()) if chosen else 0.0,
                     "considered_layers": len(order), "evidence": ev.to_json() if ev else None,
                     "owed_s": self.debt_s, "horizon_steps": H, "persistence_s": curve,
                     "reason": "the gain's lower bound pays" if chosen else
                     ("no layer gains on the newest window" if not order else
                      "the gain's lower bound does not pay for the migration")}
        if not chosen:
            return None
        new = cur.copy()
        for li in chosen:
            new[li] = deploy[best[li]][li]
        if self.pay_back:
            if self._anchor is None:
                self._anchor = cur.copy()
            self.debt_s += ev.cost_s
        return new

    @staticmethod
    def candidates(cur: np.ndarray, load: np.ndarray, ctx: Context) -> dict[str, np.ndarray]:
        """int [L, P] per candidate: replicate first and re-place (EPLB matched to ``cur``), from ``load`` [L, E]."""
        from moeplace.operate.migration import match_gpus

        W = ctx.cluster.world_size
        return {"replicate": replicate_first(cur, load, W), "replace": match_gpus(cur, eplb_map(load, ctx), W)}


@dataclass(frozen=True)
class PolicySpec:
    """One registered policy: its class, the parameters a caller may set, and the fields it fixes."""

    name: str
    summary: str  # one line for the CLI
    cls: type[Policy]
    params: tuple[Param, ...] = ()  # what make_policy (and the CLI's flags) accept
    fixed: tuple[tuple[str, object], ...] = ()  # fields set by the entry itself (periodic-preserve: preserve=True)


PERIOD_STEPS = Param("period_steps", int, SGLANG_REBALANCE_STEPS, "steps between rebalances (SGLang's default)",
                     1, 1 << 40)
THRESHOLD = Param("threshold", float, 0.5, "balancedness below which to consider a rebalance", 0, 1, lo_open=True)
HORIZON_STEPS = Param("horizon_steps", int, SGLANG_REBALANCE_STEPS, "steps a change must pay back over", 1, 1 << 40)
MARGIN = Param("margin", float, 1.0, "move only when the lower confidence bound of the gain over the horizon > "
               "margin x migration time", 0, 1e6)
_ALL = (
    PolicySpec("static", "never change the initial linear placement", Policy),
    PolicySpec("static-eplb", "EPLB from the first window, once", StaticEplb),
    PolicySpec("periodic", "EPLB every period_steps steps, map replaced whole (SGLang)", Periodic, (PERIOD_STEPS,),
               (("preserve", False),)),
    PolicySpec("periodic-preserve", "periodic EPLB, experts staying on a GPU keep their slots (vLLM)", Periodic,
               (PERIOD_STEPS,), (("preserve", True),)),
    PolicySpec("threshold", "EPLB when the window's balancedness falls below threshold and the gain's lower bound "
               "pays for the move", Threshold, (THRESHOLD, HORIZON_STEPS, MARGIN)),
    PolicySpec("moeplace", "ours: replicate first, minimal moves, layer chunks; moves when the gain's lower bound "
               "pays", MoePlace,
               (HORIZON_STEPS, MARGIN,
                Param("chunk_layers", int, 0, "layers changed per decision at most (0: a quarter of the layers)",
                      0, 1 << 20),
                Param("persistence_windows", int, DEFAULT_PERSISTENCE_WINDOWS, "windows of history over which a "
                      "re-fitted placement's gain must persist before a move is priced over horizon_steps (0: "
                      "always horizon_steps)", 0, 1 << 10)), (("pay_back", True),)),
)
POLICIES: dict[str, PolicySpec] = {s.name: s for s in _ALL}


def policy_params() -> dict[str, Param]:
    """Every declared parameter by name, over all policies (one name has one meaning: the CLI's flags)."""
    out: dict[str, Param] = {}
    for s in _ALL:
        for p in s.params:
            out.setdefault(p.name, p)
    return out


def _check_registry() -> None:
    assert len(POLICIES) == len(_ALL), "duplicate policy name"
    union = policy_params()
    for s in _ALL:
        check_declared(s.params, f"policy {s.name!r}")
        defaults = {f.name: f.default for f in fields(s.cls) if f.default is not MISSING}
        for p in s.params:
            assert union[p.name] == p, f"parameter {p.name!r} declared two ways"
            assert defaults.get(p.name, MISSING) == p.default, f"policy {s.name!r}: {p.name} default differs"
        assert all(k in defaults for k, _ in s.fixed), f"policy {s.name!r}: a fixed key is not a field"


_check_registry()


def make_policy(name: str, **params: object) -> Policy:
    """The policy ``name`` with ``params`` (its declared parameters, :data:`POLICIES`); ValueError naming the
    policy and the unknown name, or the parameter the policy does not take, or a value out of range."""
    if name not in POLICIES:
        raise ValueError(f"policy {name!r}: expected one of {', '.join(POLICIES)}")
    s = POLICIES[name]
    return s.cls(name=name, **dict(s.fixed), **bind(s.params, params, f"policy {name!r}"))
