"""``joint`` with ``objective="time"`` (the default): placement, replica dispatch and request grouping chosen by
predicted MoE layer time per micro-batch, deployed only with evidence that it beats the strongest EPLB out of
sample; otherwise the plan is exactly that EPLB (placement and dispatch rule).

Shape legend: L = MoE layers, E = logical experts, K = top-k, P = slots, W = GPUs, N = nodes, G = GPUs per node,
T = token rows, Rq = requests, C = candidate placements, F = folds (2).

Objective: the simulator's kernel time model (:func:`moeplace.simulate.simulator.simulate_rows`): dispatch +
expert compute + combine per micro-batch and layer, the max over GPUs inside each micro-batch, on micro-batches of
the deployment's size where the data allows (:func:`moeplace.plan.decide.evidence_microbatches`).

1. Homes: round-robin (what engines do) and two groupers' homes, each admitted in balanced rounds
   (:mod:`moeplace.plan.grouping`): ``signal``, K-means of the requests' admission activations, one cluster per
   node; and, where decode is weighed, ``usage``, the requests clustered by what they go on to use (their decode
   activations) and routed by a ridge regression from their admission activations
   (:func:`moeplace.plan.activation_clusters.usage_weights`). Both route a new request by its admission
   activations alone.
2. Candidates: the baselines (EPLB's global policy and, when the model's expert groups divide among the nodes, its
   hierarchical policy, with round-robin homes, each under the dispatch rules engines offer:
   :data:`moeplace.simulate.config.BASELINE_RULES`) and, per grouper, the grouped placements (node affinity as
   activation-clusters builds it, joint's node-affinity placement, and node affinity with EPLB's replica counts;
   named ``usage-...`` for the usage grouper), each under :data:`CANDIDATE_RULES`; and the usage-grouped ones
   again with each node's slots repacked by what the ``balanced`` dispatch puts on them on the building fold
   (:func:`moeplace.plan.activation_clusters.pack_by_dispatch`; named ``...+dispatch``, timed under the
   links-aware balanced rule).
3. Evidence by cross-validation: the planning requests are split into two folds (seeded); every candidate is built
   on one fold and timed on the other, both ways, prefill and decode apart. :func:`moeplace.plan.decide.decide`
   deploys a grouped candidate only when the paired 95% interval of its time ratio to the best baseline lies below
   1 in every phase; else the best baseline (EPLB's placement from the whole planning window, round-robin homes).
   The evidence chooses a builder; the deployed plan is that builder run on every planning request the evidence
   used (``deploy="rebuilt"``, the default: twice a fold's requests), or, ``deploy="as-built"``, the very plan the
   first fold's evidence timed. Rebuilt, the 3x8 decode cells of ``bench/plan_time.py`` were 0.909-0.947 of the
   strongest EPLB where as built they were 0.913-0.956, with narrower intervals (docs/PLANNER.md). The plan's
   ``cost_model.rule`` is its dispatch rule (the evaluation scores it under that rule) and ``extra["decision"]``
   the evidence, with ``deploy`` and ``built_on_requests``.

Everything is a function of (window, parameters, seed): no wall clock, no sampling beyond the seeded folds.
"""

from __future__ import annotations

import numpy as np

from moeplace.placement import Cluster, CostModel, Fallback
from moeplace.placement.grouper import DEFAULT_ROUND, Grouper
from moeplace.plan.activation_clusters import fill_node_slots, pack_by_dispatch, pack_by_use, usage_weights
from moeplace.plan.base import StrategyResult, Workload, check_sizes, load_from_tokens
from moeplace.plan.grouping import kmeans
from moeplace.plan.joint_common import assign_all, feature_layers, initial_placement, signal_features, use_by_gpu
from moeplace.simulate.batching import BatchConfig, window_microbatches
from moeplace.simulate.cost import CostConfig
from moeplace.simulate.routing import DEFAULT_RULE
from moeplace.simulate.simulator import simulate_rows

DEFAULT_HIDDEN = 4096  # elements per token vector when the window does not say (a trace's metadata usually does)
GROUPINGS = ("signal", "usage")  # how grouped candidates group requests (see grouping() in plan_joint_time)
REPACKED = "+dispatch"  # suffix of a grouped candidate repacked by :func:`pack_by_dispatch`
DEPLOY_CHOICES = ("rebuilt", "as-built")  # the grouped plan deployed: rebuilt on every planning request, or the fold's
MAX_EVAL_REQUESTS = 2048  # requests the candidates are scored on (the grouper still homes every request)


def affinity_with_counts(use_node: np.ndarray, replica_count: np.ndarray, num_slots: int,
                         gpus_per_node: int) -> np.ndarray:
    """phy2log int [L, P]: ``replica_count`` [L, E] copies of every expert, each copy on the node that uses the
    expert most among those with room (at most one copy per GPU of a node), then packed onto GPUs by load.

    use_node: float [N, L, E] pairs by the node of the token's home. The copies of an expert are handed out in
    order of decreasing per-copy use (use / copies), so the most used (node, expert) pairs are served locally.
    """
    N, L, E = use_node.shape
    P, G = num_slots, gpus_per_node
    per_node = P // N
    out = np.zeros((L, N, per_node), np.int64)
    for layer in range(L):
        u = use_node[:, layer, :]  # [N, E]
        cnt = np.asarray(replica_count[layer], np.int64)
        held: list[list[int]] = [[] for _ in range(N)]
        on = np.zeros((N, E), np.int64)
        left = cnt.copy()
        # (node, expert) pairs by decreasing use per copy, ties by node then expert (deterministic)
        score = u / np.maximum(cnt, 1)[None, :]
        for flat in np.argsort(-score, axis=None, kind="stable"):
            n, e = divmod(int(flat), E)
            if left[e] > 0 and len(held[n]) < per_node and on[n, e] < G:
                held[n].append(e)
                on[n, e] += 1
                left[e] -= 1
        for e in np.flatnonzero(left > 0):  # copies no node with room wanted: any node with room, if one can
            for _ in range(int(left[e])):  # take it (else the slot goes to fill_node_slots below)
                room = [n for n in range(N) if len(held[n]) < per_node and on[n, e] < G]
                if room:
                    n = min(room, key=lambda n: (len(held[n]), n))
                    held[n].append(int(e))
                    on[n, e] += 1
        for n in range(N):
            out[layer, n] = fill_node_slots(held[n], u[n], per_node, G)
    p2l = out.reshape(L, P)
    return pack_by_use(p2l, use_node, N, G)


def node_use(token_request: np.ndarray, ids: np.ndarray, homes: np.ndarray, num_nodes: int, gpus_per_node: int,
             num_experts: int) -> np.ndarray:
    """float [N, L, E]: pairs by the node of the row's home, per layer and expert (joint's per-GPU use summed
    over each node's GPUs). ids: int [T, L, K]."""
    L = ids.shape[1]
    use = use_by_gpu(token_request, ids, homes, num_nodes * gpus_per_node, num_experts)  # [L, W, E]
    return use.reshape(L, num_nodes, gpus_per_node, num_experts).sum(axis=2).transpose(1, 0, 2)


def window_layer_time(work: Workload, requests: np.ndarray, homes: np.ndarray, phy2log: np.ndarray,
                      cluster: Cluster, cost: CostConfig, batching: BatchConfig, arrival_seed: int,
                      rule: str) -> np.ndarray:
    """float [2, L]: predicted layer time (seconds) summed over the prefill (row 0) and the decode (row 1)
    micro-batches of ``requests`` (indices into the window), in a seeded mixed arrival order. homes: int [Rq] home
    GPU of every request."""
    sel = np.isin(work.token_request, requests)
    idx = np.full(work.num_requests, -1, np.int64)
    idx[requests] = np.arange(len(requests))
    tr = idx[work.token_request[sel]]
    ids = work.expert_ids[sel]
    pre, dec = work.phase_rows(sel)
    arrival = np.random.default_rng([arrival_seed, 7]).permutation(len(requests))
    mb = window_microbatches(tr, pre, arrival, batching)
    h = homes[requests][tr]
    total = np.zeros((2, work.num_layers))
    for i, (phase, m) in enumerate((("prefill", pre), ("decode", dec))):
        if m.any():
            _, met = simulate_rows(ids[m], h[m], mb[m], phase, phy2log, cluster, cost, model=work.model,
                                   rule=rule, num_experts=work.num_experts, bound=False)
            total[i] = met["layer_time"].sum(0)
    return total


def requests_load(work: Workload, requests: np.ndarray) -> np.ndarray:
    """float64 [L, E]: selections per expert in the rows of ``requests`` (indices into the window) that
    ``work.load`` counts (:meth:`~moeplace.plan.base.Workload.traffic_rows`: the rows after admission, or a
    prefill-only window's prompts), so an EPLB built on part of the window is built as the one on all of it."""
    sel = np.isin(work.token_request, requests) & work.traffic_rows()
    return load_from_tokens(work.expert_ids[sel], work.num_experts)


CV_FOLDS = 2  # cross-validation folds: each candidate is built on half the planning requests, timed on the other
# dispatch rules the grouped candidates are timed under; EPLB's placements are also timed under the rules of
# OWN_RULES (moeplace's own dispatch, not an engine's: candidates, never baselines)
CANDIDATE_RULES = ("nearest-least-loaded", "balanced", "balanced-links")
OWN_RULES = ("balanced-links",)
PHASE_CHOICES = ("both", "prefill", "decode")


def eplb_variants(num_groups: int, num_experts: int, num_nodes: int) -> list[tuple[str, int]]:
    """(name, num_groups) of the EPLB policies a deployment can run: global, and hierarchical when the model's
    groups divide among the nodes (DeepSeek's condition) and the experts among the groups."""
    out = [("eplb", 1)]
    if num_groups > 1 and num_groups % num_nodes == 0 and num_experts % num_groups == 0:
        out.append(("eplb-hierarchical", num_groups))
    return out


def plan_joint_time(work: Workload, cluster: Cluster, num_redundant: int, seed: int = 0,
                    round_size: int = DEFAULT_ROUND, hidden_size: int | None = None, dispatch_bytes: float = 1.0,
                    combine_bytes: float = 2.0, mode: str = "auto", rule: str = DEFAULT_RULE, overlap: bool = False,
                    decode_batch: int = 256, prefill_tokens: int = 8192,
                    max_eval_requests: int = MAX_EVAL_REQUESTS, decode_running: int | None = None,
                    dispatch: str = "choose", phases: str = "both", cv_folds: int = CV_FOLDS,
                    intermediate_size: int | None = None, deploy: str = "rebuilt") -> StrategyResult:
    """The time objective (see the module docstring), priced with the deployment's time model (hidden_size:
    default the window's, else 4096; element bytes, kernel mode, overlap, batch sizes; intermediate_size: the
    expert width that prices compute and weight reads, default the model preset's, else hidden_size, as the
    simulator's scoring prices them).

    rule: the deployment's replica rule; dispatch ``choose`` (default) also times the baselines under every engine
    rule and the candidates under :data:`CANDIDATE_RULES`, ``fixed`` times everything under ``rule`` only.
    decode_running: running requests per decode micro-batch (continuous batching; None: windows of
    ``decode_batch``). phases: the phases the evidence weighs (``both``, or the one a deployment serves).
    """
    from moeplace.deploy import expert_groups
    from moeplace.placement import replica_counts
    from moeplace.plan.activation_clusters import node_counts, place_by_node_affinity
    from moeplace.plan.decide import decide, evidence_microbatches
    from moeplace.plan.eplb import rebalance
    from moeplace.simulate.config import BASELINE_RULES

    if dispatch not in ("choose", "fixed"):
        raise ValueError(f"joint: dispatch must be 'choose' or 'fixed', got {dispatch!r}")
    if phases not in PHASE_CHOICES:
        raise ValueError(f"joint: phases must be one of {PHASE_CHOICES}, got {phases!r}")
    if deploy not in DEPLOY_CHOICES:
        raise ValueError(f"joint: deploy must be one of {DEPLOY_CHOICES}, got {deploy!r}")
    P, _ = check_sizes(work.num_layers, work.num_experts, cluster, num_redundant)
    N, G, W, E, L = cluster.num_nodes, cluster.gpus_per_node, cluster.world_size, work.num_experts, work.num_layers
    Rq = work.num_requests
    hidden = int(hidden_size or work.hidden_size or DEFAULT_HIDDEN)
    cost = CostConfig(hidden_size=hidden, dispatch_bytes=dispatch_bytes, combine_bytes=combine_bytes, mode=mode,
                      overlap=overlap, intermediate_size=intermediate_size)
    variants = eplb_variants(expert_groups(work.model), E, N)
    base_rules = BASELINE_RULES if dispatch == "choose" else (rule,)
    cand_rules = CANDIDATE_RULES if dispatch == "choose" else (rule,)
    own = tuple(r for r in OWN_RULES if r in cand_rules and r not in base_rules)  # EPLB under moeplace's dispatch
    # the repacked candidates are timed under one balanced rule (the links-aware one where allowed)
    repack_rule = next((r for r in ("balanced-links", "balanced") if r in cand_rules), None)

    def cost_model(r: str) -> CostModel:
        return CostModel(objective="layer_time", rule=r, dedup=mode, hidden_size=hidden,
                         intermediate_size=intermediate_size,
                         dispatch_bytes=cost.dispatch_bytes, combine_bytes=cost.combine_bytes, overlap=overlap,
                         decode_batch=decode_batch, prefill_tokens=prefill_tokens)

    rr = np.arange(Rq) % W  # round-robin homes, as engines place requests
    if Rq < 4 * N:  # too few requests to build on one half and check on the other
        reason = f"the planning window has {Rq} requests, fewer than 4 per node ({N} nodes): used EPLB's placement"
        return StrategyResult(rebalance(work.load, P, 1, N, W), rr, None, {"objective": "time"},
                              fallback=Fallback("eplb", reason), cost_model=cost_model(rule))
    rng = np.random.default_rng(seed)
    ev = np.sort(rng.choice(Rq, max_eval_requests, replace=False)) if Rq > max_eval_requests else np.arange(Rq)
    perm = rng.permutation(len(ev))
    F = max(2, min(int(cv_folds), len(ev) // (2 * N)))
    folds = [np.sort(ev[perm[f::F]]) for f in range(F)]
    flayers = feature_layers(L, E)
    weigh = PHASE_CHOICES[1:] if phases == "both" else (phases,)
    # a prefill's traffic is its prompt, the signal itself: grouping by later use only pays where decode is weighed
    # and the window has rows after admission to learn it from (a prefill-only window has none: no usage groups)
    groupings = GROUPINGS if "decode" in weigh and (~work.admission_rows).any() else ("signal",)

    def grouping(train: np.ndarray, by: str) -> tuple[Grouper, np.ndarray]:
        """A grouper fitted on ``train`` and the homes it gives every request of the window (each request admitted
        in balanced rounds). ``by="signal"``: K-means of admission activations, one cluster per node; ``"usage"``:
        the requests clustered by their traffic (decode) activations, routed by a ridge regression from their
        admission activations (:func:`moeplace.plan.activation_clusters.usage_weights`)."""
        x = signal_features(work, train, flayers)
        if by == "signal":
            g = Grouper(kmeans(x, N, seed=seed)[0], G, round_size, kind="centroids", layers=flayers)
        else:
            w, _ = usage_weights(x, signal_features(work, train, flayers, rows="traffic"), N, seed)
            g = Grouper(w, G, round_size, kind="usage-ridge", layers=flayers)
        return g, assign_all(g, work)  # features in chunks: bounded memory on 100k-request windows

    def build(train: np.ndarray, only: str | None = None
              ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, Grouper]]:
        """Candidate placements built on ``train``: name -> (phy2log [L, P], homes [Rq]), and the groupers by
        grouping (a candidate named ``usage-...`` uses the ``usage`` one). ``only``: the one grouped candidate of
        that name (and EPLB's global placement, which one of them takes its replica counts from)."""
        sel = np.isin(work.token_request, train)
        tr, ids = work.token_request[sel], work.expert_ids[sel]
        load = requests_load(work, train)  # built as the deployed baseline is (never an empty load)
        out = {name: (rebalance(load, P, g, N, W), rr) for name, g in variants if only is None or name == "eplb"}
        base = None if only is None else only.removesuffix(REPACKED)
        groupers = {}
        for by in groupings if only is None else (grouping_of(only),):
            groupers[by], homes = grouping(train, by)
            pre = "" if by == "signal" else by + "-"
            use_n = node_use(tr, ids, homes, N, G, E)
            for kind in ("node-affinity", "affinity", "affinity+eplb-replicas"):
                if base is None or base == pre + kind:
                    if kind == "node-affinity":
                        p2l = place_by_node_affinity(node_counts(tr, ids, homes // G, N, E), P, G)
                    elif kind == "affinity":
                        p2l = initial_placement(use_n, P, G)
                    else:
                        p2l = affinity_with_counts(use_n, replica_counts(out["eplb"][0], E), P, G)
                    out[pre + kind] = (p2l, homes)
        if repack_rule is not None and "usage" in groupers and (only is None or only.endswith(REPACKED)):
            # each usage-grouped placement again, repacked by what the dispatch puts on its slots (the usage
            # groupings are the ones built for decode; a work budget: repacking all six doubled the plan time)
            idx = np.full(Rq, -1, np.int64)
            idx[train] = np.arange(len(train))
            pre_t, dec_t = work.phase_rows(sel)
            arrival_t = np.random.default_rng([seed, 11]).permutation(len(train))
            mb_t, _ = evidence_microbatches(idx[tr], pre_t & ("prefill" in weigh), dec_t & ("decode" in weigh),
                                            arrival_t, full["prefill"], full["decode"], decode_windows=windows)
            on_d = dec_t & (mb_t >= 0)  # prefill and decode ids are separate spaces: decode's after prefill's
            mb_t[on_d] += mb_t[~on_d].max() + 1 if (~on_d & (mb_t >= 0)).any() else 0
            for name in [n for n in out if grouping_of(n) == "usage" and not n.endswith(REPACKED)]:
                p2l, homes = out[name]
                out[name + REPACKED] = (pack_by_dispatch(p2l, ids, homes[tr], mb_t, N, G, E), homes)
        return out, groupers

    # evidence: build on one fold, time on the other, both ways
    times: dict[str, dict[str, list[np.ndarray]]] = {ph: {} for ph in weigh}
    sizes: dict[str, int] = {}
    full = {"prefill": int(prefill_tokens), "decode": int(decode_running or decode_batch)}
    undersized: set[str] = set()  # phases whose evidence in some fold is below the deployment's micro-batch
    windows = decode_running is None  # decode served in windows of decode_batch requests, not continuous batching
    baselines = [f"{name}/{r}" for name, _ in variants for r in base_rules]
    for f in range(F):
        train, test = np.sort(np.concatenate([folds[g] for g in range(F) if g != f])), folds[f]
        cands, g_f = build(train)
        if f == 0:
            first = (cands, g_f)  # built on every fold but the first, timed on the first
        sel = np.isin(work.token_request, test)
        idx = np.full(Rq, -1, np.int64)
        idx[test] = np.arange(len(test))
        tr = idx[work.token_request[sel]]
        ids = work.expert_ids[sel]
        pre, dec = work.phase_rows(sel)
        arrival = np.random.default_rng([seed, 7, f]).permutation(len(test))
        mb, sizes = evidence_microbatches(tr, pre & ("prefill" in weigh), dec & ("decode" in weigh), arrival,
                                          full["prefill"], full["decode"], decode_windows=windows)
        # under decode windows a window is up to decode_batch requests (serving forms the last from what remains):
        # a fold with fewer forms one window of them, as a held-out window of fewer requests is scored
        undersized |= {ph for ph, n in sizes.items() if n < full[ph] and not (ph == "decode" and windows)}
        # homes of the test requests as serving gives them to a new set of requests (the held-out window's rule):
        # round-robin in arrival order, or the grouper's balanced rounds in arrival order
        test_rr = np.empty(len(test), np.int64)
        test_rr[arrival] = np.arange(len(test)) % W
        test_feats = signal_features(work, test[arrival], flayers)
        test_grouped = {}
        for by, g in g_f.items():
            test_grouped[by] = np.empty(len(test), np.int64)
            test_grouped[by][arrival] = g.assign_features(test_feats)
        timed: dict[tuple, np.ndarray] = {}  # candidates that coincide (placement, homes, rule) are timed once
        for name, (p2l, homes) in cands.items():
            h = (test_rr if homes is rr else test_grouped[grouping_of(name)])[tr]
            same = (np.ascontiguousarray(p2l).tobytes(), np.ascontiguousarray(h).tobytes())
            picks: dict[str, dict] = {"prefill": {}, "decode": {}}  # balanced-links starts from balanced's GPUs
            rules = ((*base_rules, *own) if name.startswith("eplb")
                     else (repack_rule,) if name.endswith(REPACKED) else cand_rules)
            for r in rules:
                for ph, m in (("prefill", pre), ("decode", dec)):
                    if ph not in weigh:
                        continue
                    m = m & (mb >= 0)
                    t = np.zeros(0)
                    if m.any():
                        key = (*same, r, ph)
                        if key not in timed:
                            _, met = simulate_rows(ids[m], h[m], mb[m], ph, p2l, cluster, cost, model=work.model,
                                                   rule=r, num_experts=E, bound=False, picks=picks[ph])
                            timed[key] = met["layer_time"].mean(axis=1)
                        t = timed[key]
                    times[ph].setdefault(f"{name}/{r}", []).append(t)
    times = {ph: v for ph, v in times.items() if sum(len(x) for x in next(iter(v.values()))) > 0}
    extra: dict = {"objective": "time", "seed": seed, "mode": mode, "hidden_size": hidden,
                   "eval_requests": int(len(ev))}
    if not times:
        reason = "the planning window forms no micro-batch of the weighed phases: used EPLB's placement"
        extra["decision"] = {"chosen": "eplb/" + rule, "deployed": "baseline", "reason": reason}
        return StrategyResult(rebalance(work.load, P, 1, N, W), rr, None, extra, fallback=Fallback("eplb", reason),
                              cost_model=cost_model(rule))
    # the default baseline: global EPLB under the balanced dispatch (SGLang's lp). On held-out requests it was the
    # strongest baseline or within 0.04% of it in every plan_time cell (hierarchical EPLB is 1% slower at 2x8 prefill)
    dflt_rule = "balanced" if "balanced" in base_rules else base_rules[0]
    decision = decide(times, baselines, seed=seed, default=f"{variants[0][0]}/{dflt_rule}", undersized=undersized)
    decision["microbatch_rows"] = sizes
    decision["deployment_rows"] = {ph: full[ph] for ph in sizes}
    decision["folds"] = F
    extra["decision"] = decision
    name, chosen_rule = decision["chosen"].rsplit("/", 1)
    if decision["deployed"] == "baseline":
        groups = dict(variants)[name]
        why = f"{decision['reason']}: EPLB's placement from the whole planning window, round-robin homes"
        return StrategyResult(rebalance(work.load, P, groups, N, W), rr, None, extra, fallback=Fallback(name, why),
                              cost_model=cost_model(chosen_rule))
    if name in dict(variants):  # EPLB's placement under moeplace's own dispatch: built as the baseline is
        return StrategyResult(rebalance(work.load, P, dict(variants)[name], N, W), rr, None, extra,
                              cost_model=cost_model(chosen_rule))
    # the evidence chose a builder; it builds the deployed plan from every planning request it learned on (twice a
    # fold's requests), or, deploy="as-built", the very plan the first fold's evidence is about
    built, groupers = first if deploy == "as-built" else build(ev, only=name)
    decision["deploy"] = deploy
    decision["built_on_requests"] = int(len(ev) - len(folds[0]) if deploy == "as-built" else len(ev))
    p2l, homes = built[name]
    return StrategyResult(p2l, homes, groupers[grouping_of(name)], extra, cost_model=cost_model(chosen_rule))


def grouping_of(candidate: str) -> str:
    """The grouping (:data:`GROUPINGS`) a grouped candidate's homes come from: ``usage-...`` or the signal's."""
    return "usage" if candidate.startswith("usage-") else "signal"
