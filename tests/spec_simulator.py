"""The simulator's independent specification: plain per-token loops written from docs/MODEL.md and docs/SIMULATOR.md.

``moeplace.simulate`` is held to this file by tests/test_simulate_spec.py. It imports nothing from
``moeplace.simulate`` (a test parses this file to make sure): only the plan types (``moeplace.placement``) and the
trace types (``moeplace.trace.types``). Speed is not a goal; clarity is. Every definition below is written as the
docs state it, one token, one layer, one expert at a time.

Shape legend: T = tokens, L = MoE layers, K = top-k, E = logical experts, P = physical slots, W = GPUs,
G = GPUs per node, S = slots per GPU (slot p lives on GPU p // S, GPU g on node g // G), B = micro-batches.

Definitions (docs/SIMULATOR.md unless noted):

- request index r = the request's row in the request table; home GPU = the plan's home, else r % W (round-robin
  in request-table order); prompt[r] = prompt_len, or 1 + the largest prefill position of the request when it is 0.
- prefill micro-batch of token (r, pos) = (sum(prompt[:r]) + pos) // prefill_tokens; decode micro-batch =
  (window r // decode_batch, step pos - prompt[r]). Inside a micro-batch tokens go in trace row order.
- nearest tier of expert e for home h: its slots on h if any, else on h's node, else all of them.
  ``nearest-least-loaded``: pairs in token order then k order pick the tier slot whose GPU has the fewest pairs so
  far in this micro-batch and layer (every pair counts), ties to the lowest slot. ``nearest-static``: tier slot
  number h % len(tier) in slot order.
- ``balanced-local`` / ``balanced``: the pairs of one micro-batch and layer, each served by any GPU holding its
  expert, minimise max_g load_g + sum of locality costs (0 on the home GPU, intra_cost on the home node,
  inter_cost elsewhere); ``balanced`` minimises the max load, then the locality cost. Which optimal assignment is
  the code's choice: the spec takes it from ``choose`` (the code's public ``assign_slots``) and checks, with its
  own solver (one binary variable per pair and replica GPU, scipy's MILP), that it is optimal, that every slot
  holds the pair's expert and is the expert's first slot on its GPU, and that inside each group (home, expert)
  pairs in token order never go back to an earlier replica GPU in slot order; then counts as for the other rules.
- per-GPU dedup: one send home -> g per distinct target GPU g (g == home is the intra-GPU "send", the diagonal).
  Two-hop: targets on the home node are sent directly; per remote node n one send home -> n*G + home % G (the GPU
  of the same local rank there), which forwards over NVLink to each other target GPU of node n.
- per micro-batch and layer, for each send matrix X [W, W]: sends by class (intra-GPU = diagonal, intra-node,
  inter-node), the largest per-peer message (max off-diagonal entry), and the busiest GPU's max(sent, received)
  over intra-node links and over inter-node links. Time of a class = alpha + sends * bytes / bandwidth on its
  busiest GPU (no sends: 0); dispatch and combine each take the slower class; comm = dispatch + combine. Padded:
  every GPU sends peers_of_class * max message (peers: G - 1 intra-node, W - G inter-node).
- compute = busiest GPU's pairs * pair_seconds (the link model's ``compute_time``).
- kernel time model (docs/SIMULATOR.md, "Kernel time model"): per GPU, active experts = distinct experts with a
  pair on it; expert time = max over GPUs of max(active * expert_bytes / hbm_bw, pairs * pair_seconds) +
  compute_overhead (0 without pairs). Sends of a kernel: nccl = the per-GPU dedup matrix, deepep-normal = the
  two-hop one, deepep-ll = one per (token, expert) pair off the home GPU. One kernel call = its alpha (when the
  micro-batch has pairs) + the slower class of alpha_c + busiest_c * bytes / (eff_c * bandwidth_c) (a class
  without sends: 0). Dispatch bytes = hidden * dispatch_bytes + 4 per 128 elements when dispatch_bytes < 2, + 16
  for deepep-ll; combine = hidden * combine_bytes. Layer time = dispatch + expert + combine of the phase's kernel
  (auto: deepep-normal for prefill, deepep-ll for decode); with overlap, halves send half the messages and
  compute max(memory, flops / 2) + overhead: d + max(m, d) + max(c, m) + c.
- balancedness = mean_g / max_g of the load per layer (1 where a layer has no load), averaged over layers;
  imbalance = (max - mean) / mean (0 where no load); LAR = pairs on the home GPU / pairs; node-local rate = pairs
  on the home node / pairs.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from moeplace.placement import Plan
from moeplace.trace.types import Trace

PHASES = ("prefill", "decode")  # trace phase codes 0 and 1
MODES = ("per_gpu", "two_hop")
CLASSES = ("intra_gpu", "intra_node", "inter_node")
LINK_COUNTS = ("intra_gpu_sends", "intra_node_sends", "inter_node_sends", "max_message_sends", "busiest_intra",
               "busiest_inter")
KERNEL_SENDS = {"nccl": "per_gpu", "deepep-normal": "two_hop", "deepep-ll": "per_pair"}
# (alpha of one call, NVLink efficiency, RDMA efficiency, dispatch header bytes): docs/SIMULATOR.md's table
KERNEL_CONSTANTS = {"nccl": (0.0, 1.0, 1.0, 0), "deepep-normal": (0.0, 0.68, 0.88, 0),
                    "deepep-ll": (5e-6, 0.68, 0.88, 16)}


# --------------------------------------------------------------------------------------------------- requests


def prompt_lengths(trace: Trace) -> list[int]:
    """[R] prompt length of each request (table order): prompt_len, or 1 + its largest prefill position if 0."""
    rids = [int(x) for x in trace.requests.request_id]
    row = {rid: r for r, rid in enumerate(rids)}
    prompt = [int(x) for x in trace.requests.prompt_len]
    largest = [-1] * len(rids)
    tk = trace.tokens
    for rid, pos, ph in zip(tk.request_id.tolist(), tk.position.tolist(), tk.phase.tolist(), strict=True):
        if ph == 0:
            largest[row[rid]] = max(largest[row[rid]], pos)
    return [p if p > 0 else largest[r] + 1 for r, p in enumerate(prompt)]


def home_gpus(trace: Trace, plan: Plan) -> list[int]:
    """[R] home GPU of each request: the plan's, else round-robin r % W in request-table order."""
    W = plan.cluster.world_size
    return [int(plan.homes.get(int(rid), r % W)) for r, rid in enumerate(trace.requests.request_id)]


def microbatch_key(r: int, pos: int, phase: int, prompt: list[int], prefill_start: list[int], decode_batch: int,
                   prefill_tokens: int) -> int | tuple[int, int]:
    """Prefill: the micro-batch number (prompts end to end, cut every prefill_tokens). Decode: (window, step)."""
    if phase == 0:
        return (prefill_start[r] + pos) // prefill_tokens
    return (r // decode_batch, pos - prompt[r])


# --------------------------------------------------------------------------------------------------- routing


def nearest_tier(slots: list[int], home: int, S: int, G: int) -> list[int]:
    """The slots (ascending) of one expert that are nearest to GPU ``home``: same GPU, else same node, else all."""
    def distance(p: int) -> int:
        g = p // S
        return 0 if g == home else (1 if g // G == home // G else 2)

    best = min(distance(p) for p in slots)
    return [p for p in slots if distance(p) == best]


def choose_slot(rule: str, tier: list[int], home: int, pairs_on_gpu: list[int], S: int) -> int:
    """One pair's replica, given the pairs each GPU already got in this micro-batch and layer."""
    if rule == "nearest-static":
        return tier[home % len(tier)]
    if rule == "nearest-least-loaded":
        return min(tier, key=lambda p: (pairs_on_gpu[p // S], p))
    raise ValueError(f"unknown replica rule {rule!r}")


BALANCED = ("balanced-local", "balanced", "balanced-links")


def locality_cost(home: int, g: int, G: int, intra_cost: float, inter_cost: float) -> float:
    """What serving a pair homed on GPU ``home`` on GPU ``g`` adds to the balanced-local objective, in pairs."""
    return 0.0 if g == home else (intra_cost if g // G == home // G else inter_cost)


def best_balance(options: list[list[int]], homes: list[int], W: int, G: int, intra_cost: float, inter_cost: float,
                 cap: float | None = None) -> tuple[float, float]:
    """(max load, locality cost) of the best assignment: pair i goes to one GPU of options[i].

    cap None: minimise max load + locality cost; else minimise the locality cost with every load <= cap.
    One binary variable per (pair, option) and the max load t: a mixed-integer program (HiGHS through scipy).
    """
    var = [(i, g) for i, opts in enumerate(options) for g in opts]
    n = len(var)
    c = np.array([locality_cost(homes[i], g, G, intra_cost, inter_cost) for i, g in var] + [1.0 if cap is None
                                                                                              else 0.0])
    one = np.zeros((len(options), n + 1))
    for v, (i, _) in enumerate(var):
        one[i, v] = 1
    load = np.zeros((W, n + 1))
    for v, (_, g) in enumerate(var):
        load[g, v] = 1
    load[:, n] = -1
    hi = np.full(n + 1, 1.0)
    hi[n] = np.inf if cap is None else cap
    res = milp(c, constraints=[LinearConstraint(one, 1, 1), LinearConstraint(load, -np.inf, 0)],
               integrality=np.r_[np.ones(n), 0], bounds=Bounds(np.zeros(n + 1), hi))
    assert res.success, res.message
    y = np.round(res.x[:n])
    loads = [0] * W
    for v, (_, g) in enumerate(var):
        loads[g] += int(y[v])
    return float(max(loads)), float(sum(c[v] * y[v] for v in range(n)))


def check_balanced(rule: str, slots: list[list[int]], experts: list[list[int]], homes: list[int], p2l: list[int],
                   S: int, W: int, G: int, intra_cost: float, inter_cost: float) -> None:
    """Raise AssertionError unless ``slots`` [n][K] is a valid, optimal choice of ``rule`` for one micro-batch and
    layer (see the module docstring)."""
    rep_gpus = {}  # expert -> its distinct GPUs in slot order, and its first slot on each
    for p, e in enumerate(p2l):
        if p // S not in rep_gpus.setdefault(e, {}):
            rep_gpus[e][p // S] = p
    options, pair_home, loads, cost = [], [], [0] * W, 0.0
    last: dict[tuple[int, int], int] = {}  # group (home, expert) -> index of the last replica GPU used
    for t, row in enumerate(experts):
        for k, e in enumerate(row):
            p = slots[t][k]
            g = p // S
            assert p2l[p] == e, f"slot {p} holds expert {p2l[p]}, not {e}"
            assert rep_gpus[e][g] == p, f"slot {p} is not expert {e}'s first slot on GPU {g}"
            order = list(rep_gpus[e])
            assert order.index(g) >= last.get((homes[t], e), 0), "a group went back to an earlier replica GPU"
            last[(homes[t], e)] = order.index(g)
            options.append(order)
            pair_home.append(homes[t])
            loads[g] += 1
            cost += locality_cost(homes[t], g, G, intra_cost, inter_cost)
    if not options:
        return
    if rule == "balanced-links":
        # a refinement of a least-max-load assignment under load caps up to 5 steps of max(1, t // 20) above it
        t_opt, _ = best_balance(options, pair_home, W, G, 0.0, 0.0)
        assert t_opt <= max(loads) <= t_opt + 5 * max(1, int(t_opt) // 20), (max(loads), t_opt)
    elif rule == "balanced-local":
        t_opt, c_opt = best_balance(options, pair_home, W, G, intra_cost, inter_cost)
        assert abs(max(loads) + cost - (t_opt + c_opt)) < 1e-6, (max(loads), cost, t_opt, c_opt)
    else:
        t_opt, _ = best_balance(options, pair_home, W, G, 0.0, 0.0)
        assert max(loads) == t_opt, (max(loads), t_opt)
        _, c_opt = best_balance(options, pair_home, W, G, intra_cost, inter_cost, cap=t_opt)
        assert abs(cost - c_opt) < 1e-6, (cost, c_opt)


def per_gpu_sends(home: int, targets: list[int]) -> list[tuple[int, int]]:
    """(source, destination) sends of one token-layer: one per distinct target GPU."""
    return [(home, g) for g in sorted(set(targets))]


def two_hop_sends(home: int, targets: list[int], G: int) -> list[tuple[int, int]]:
    """(source, destination) sends of one token-layer under per-node dedup (DeepEP normal)."""
    out = []
    home_node = home // G
    for g in sorted(set(targets)):
        if g // G == home_node:
            out.append((home, g))  # inside the home node: direct (g == home is the intra-GPU one)
    for n in sorted({g // G for g in targets} - {home_node}):
        land = n * G + home % G  # same local rank on the remote node
        out.append((home, land))
        for g in sorted(set(targets)):
            if g // G == n and g != land:
                out.append((land, g))  # NVLink forwarding
    return out


# --------------------------------------------------------------------------------------------------- costs


def link_counts(X: list[list[int]], G: int) -> dict[str, int]:
    """Counts of one send matrix X [W][W] (source -> destination), see LINK_COUNTS."""
    W = len(X)
    out = dict.fromkeys(LINK_COUNTS, 0)
    for s in range(W):
        for d in range(W):
            if s == d:
                out["intra_gpu_sends"] += X[s][d]
            elif s // G == d // G:
                out["intra_node_sends"] += X[s][d]
            else:
                out["inter_node_sends"] += X[s][d]
            if s != d:
                out["max_message_sends"] = max(out["max_message_sends"], X[s][d])
    for g in range(W):
        for cls, same_node in (("busiest_intra", True), ("busiest_inter", False)):
            sent = sum(X[g][d] for d in range(W) if d != g and (d // G == g // G) == same_node)
            received = sum(X[s][g] for s in range(W) if s != g and (s // G == g // G) == same_node)
            out[cls] = max(out[cls], sent, received)
    return out


def link_time(sends: int, alpha: float, bandwidth: float, send_bytes: float) -> float:
    """Seconds for ``sends`` messages of ``send_bytes`` over one link (alpha-beta); nothing to send costs 0."""
    return 0.0 if sends == 0 else alpha + sends * send_bytes / bandwidth


def comm_time(intra_sends: int, inter_sends: int, cluster, dispatch_send_bytes: float,
              combine_send_bytes: float) -> float:
    """Dispatch + combine seconds, each the slower of the busiest intra-node and inter-node links."""
    total = 0.0
    for send_bytes in (dispatch_send_bytes, combine_send_bytes):
        total += max(link_time(intra_sends, cluster.intra_latency, cluster.intra_bw, send_bytes),
                     link_time(inter_sends, cluster.inter_latency, cluster.inter_bw, send_bytes))
    return total


def kernel_call_time(kernel: str, busiest_intra: float, busiest_inter: float, has_pairs: bool, cluster,
                     send_bytes: float) -> float:
    """One dispatch or combine call of ``kernel`` (docs/SIMULATOR.md, "Kernel time model")."""
    alpha, eff_intra, eff_inter, _ = KERNEL_CONSTANTS[kernel]
    t = max(link_time(busiest_intra, cluster.intra_latency, eff_intra * cluster.intra_bw, send_bytes),
            link_time(busiest_inter, cluster.inter_latency, eff_inter * cluster.inter_bw, send_bytes))
    return t + (alpha if has_pairs else 0.0)


def layer_of(kernel: str, bi: float, be: float, act: float, flop: float, has_pairs: bool, cluster,
             dbytes: float, cbytes: float, expert_bytes: float, overlap: bool) -> float:
    """One layer's time from the busiest (or mean) sends bi/be, active experts and FLOP time: dispatch + expert +
    combine, or the two halves of two-batch overlap."""
    if overlap:
        dh = kernel_call_time(kernel, bi / 2, be / 2, has_pairs, cluster, dbytes)
        ch = kernel_call_time(kernel, bi / 2, be / 2, has_pairs, cluster, cbytes)
        mh = max(act * expert_bytes / cluster.hbm_bw, flop / 2) + cluster.compute_overhead if has_pairs else 0.0
        return dh + max(mh, dh) + max(ch, mh) + ch
    ex = max(act * expert_bytes / cluster.hbm_bw, flop) + cluster.compute_overhead if has_pairs else 0.0
    return (kernel_call_time(kernel, bi, be, has_pairs, cluster, dbytes) + ex
            + kernel_call_time(kernel, bi, be, has_pairs, cluster, cbytes))


def pair_busiest(pairs_from_to: list[tuple[int, int]], W: int, G: int) -> dict[str, int]:
    """Per-pair sends (no dedup) of one micro-batch and layer: (home, serving GPU) of every pair."""
    sent = {c: [0] * W for c in ("intra", "inter")}
    recv = {c: [0] * W for c in ("intra", "inter")}
    for h, g in pairs_from_to:
        if h == g:
            continue
        c = "intra" if h // G == g // G else "inter"
        sent[c][h] += 1
        recv[c][g] += 1
    return {"intra_node_sends": sum(sent["intra"]), "inter_node_sends": sum(sent["inter"]),
            "busiest_intra": max(max(sent["intra"]), max(recv["intra"])),
            "busiest_inter": max(max(sent["inter"]), max(recv["inter"]))}


def most_local_pairs(demand: list[int], cap: int, units: int, extra: int) -> list[int]:
    """For j = 0 .. extra: the most pairs any placement serves on their token's own unit (node or GPU of at most
    ``cap`` tokens) when experts serve from j units beyond one each: every expert e holds min(demand[e], cap) on its
    first unit, and each further unit it serves adds min(cap, demand[e] - (units it has) x cap) while positive; the
    j largest such additions are taken (docs/SIMULATOR.md, "Bounds")."""
    gains = []
    for d in demand:
        for u in range(1, units):
            gains.append(min(cap, max(0, d - u * cap)))
    gains.sort(reverse=True)
    base = sum(min(d, cap) for d in demand)
    return [base + sum(gains[:j]) for j in range(extra + 1)]


def least_kernel_call(kernel: str, off_gpu: float, inter_lo: float, has_pairs: bool, cluster, nbytes: float
                      ) -> float:
    """The least kernel call time over splits of ``off_gpu`` busiest sends into NVLink (off_gpu - te) and
    inter-node (te >= inter_lo): the call is the slower of a rising and a falling line in te, so the least is at
    an end or where the two cross."""
    _, eff_i, eff_e, _ = KERNEL_CONSTANTS[kernel]
    a_i, a_e = nbytes / (eff_i * cluster.intra_bw), nbytes / (eff_e * cluster.inter_bw)
    lo = min(inter_lo, off_gpu)
    cross = (cluster.intra_latency - cluster.inter_latency + off_gpu * a_i) / (a_i + a_e)
    cross = min(max(cross, lo), off_gpu)
    return min(kernel_call_time(kernel, max(off_gpu - te, 0.0), te, has_pairs, cluster, nbytes)
               for te in (lo, off_gpu, cross))


def reachable_layer(kernel: str, demand: list[int], tokens: int, W: int, G: int, K: int, num_slots: int, cluster,
                    pair_seconds: float, dbytes: float, cbytes: float, expert_bytes: float, overlap: bool) -> float:
    """The reachable bound of one micro-batch and layer (docs/SIMULATOR.md, "Bounds"): the least over j extra
    (expert, unit) activations of the layer time with the fewest off-GPU and inter-node sends any placement of
    ``num_slots`` slots and any balanced grouping allow, mean loads, and (A + j) / W active experts per GPU."""
    N = W // G
    E = len(demand)
    extra = max(num_slots - E, 0)
    P = sum(demand)
    node = most_local_pairs(demand, -(-tokens // N), N, extra)
    gpu = most_local_pairs(demand, -(-tokens // W), W, extra)
    per_send = 1.0 if KERNEL_SENDS[kernel] == "per_pair" else 1.0 / K
    A = sum(1 for d in demand if d > 0)
    best = float("inf")
    half = 0.5 if overlap else 1.0
    for j in range(extra + 1):
        off = max(P - gpu[j], 0) * per_send / W * half
        inter = (max(P - node[j], 0) * per_send / W if N > 1 else 0.0) * half
        d = least_kernel_call(kernel, off, inter, P > 0, cluster, dbytes)
        c = least_kernel_call(kernel, off, inter, P > 0, cluster, cbytes)
        m = (max((A + j) / W * expert_bytes / cluster.hbm_bw, P / W * pair_seconds * half) + cluster.compute_overhead
             if P > 0 else 0.0)
        best = min(best, d + max(m, d) + max(c, m) + c if overlap else d + m + c)
    return best


def _balance(load_row: list[int]) -> tuple[float, float]:
    """(balancedness mean/max, imbalance (max - mean)/mean) of one layer's load per GPU."""
    mean = sum(load_row) / len(load_row)
    mx = max(load_row)
    return (mean / mx if mx > 0 else 1.0), ((mx - mean) / mean if mean > 0 else 0.0)


def phase_summary(ph: dict) -> dict:
    """Load and locality figures of one phase dict from :func:`spec_simulate` (or a merge of two)."""
    load = ph["load"].tolist()
    L = len(load)
    bal = [_balance(row)[0] for row in load]
    imb = [_balance(row)[1] for row in load]
    pairs = ph["pairs"].tolist()
    lar = [a / p if p else 0.0 for a, p in zip(ph["local"].tolist(), pairs, strict=True)]
    nlr = [a / p if p else 0.0 for a, p in zip(ph["node_local"].tolist(), pairs, strict=True)]
    tot = sum(pairs)
    return {
        "balancedness_per_layer": bal, "balancedness": sum(bal) / L if L else 1.0,
        "imbalance_per_layer": imb, "imbalance": sum(imb) / L if L else 0.0,
        "lar_per_layer": lar, "lar": sum(ph["local"].tolist()) / tot if tot else 0.0,
        "node_local_per_layer": nlr, "node_local_rate": sum(ph["node_local"].tolist()) / tot if tot else 0.0,
    }


# --------------------------------------------------------------------------------------------------- simulator


def spec_simulate(trace: Trace, plan: Plan, *, rule: str, hidden: int, dispatch_bytes: float,
                  combine_bytes: float, pair_seconds: float, decode_batch: int, prefill_tokens: int,
                  mode: str = "auto", overlap: bool = False, expert_bytes: float | None = None,
                  choose=None, intra_cost: float = 0.0, inter_cost: float = 0.0) -> dict:
    """Replay a per-token in-memory trace on a plan, one token, layer and expert at a time.

    Balanced rules: ``choose(layer, homes [n], experts [n][K], rule)`` gives the slots [n][K] of one micro-batch
    and layer, checked by :func:`check_balanced` with the locality costs ``intra_cost`` and ``inter_cost``.

    Returns {"prefill": phase, "decode": phase}; a phase is a dict with
    ``microbatches`` (sorted keys: int for prefill, (window, step) for decode), ``num_tokens``,
    ``dispatch_send_bytes`` and ``combine_send_bytes`` (bytes of one send: hidden x bytes per element), exact integer
    arrays ``pairs [L]``, ``load [L, W]``, ``local [L]``, ``node_local [L]``, ``sends[mode] [L, W, W]``, and
    ``per_microbatch[name] [B, L]``: ``{mode}.{count}`` for every count of LINK_COUNTS, ``{mode}.comm_time``,
    ``{mode}.comm_time_padded``, ``compute_time``, ``pairs``, ``max_load``, and the kernel time model's
    ``max_active``, ``per_pair.*``, ``memory_time``, ``expert_time``, ``{kernel}.dispatch_time``,
    ``{kernel}.combine_time``, ``dispatch_time``, ``combine_time``, ``layer_time``. expert_bytes: weight bytes of
    one expert (default 3 * hidden * hidden * 2: a bf16 expert as wide as the hidden size).
    """
    cluster = plan.cluster
    W, G = cluster.world_size, cluster.gpus_per_node
    L, K = trace.meta.num_layers, trace.meta.top_k
    p2l = plan.placement.phy2log.tolist()
    P = len(p2l[0])
    S = P // W
    dispatch_send_bytes = hidden * dispatch_bytes
    combine_send_bytes = hidden * combine_bytes
    expert_bytes = 3 * hidden * hidden * 2 if expert_bytes is None else expert_bytes
    vector = hidden * dispatch_bytes + (4 * -(-hidden // 128) if dispatch_bytes < 2 else 0)

    # the nearest tier depends only on (layer, expert, home)
    tier = [[[nearest_tier([p for p in range(P) if p2l[layer][p] == e], h, S, G) for h in range(W)]
             for e in range(trace.meta.num_experts)] for layer in range(L)]

    rids = [int(x) for x in trace.requests.request_id]
    row_of = {rid: r for r, rid in enumerate(rids)}
    prompt = prompt_lengths(trace)
    prefill_start = [sum(prompt[:r]) for r in range(len(prompt))]
    home = home_gpus(trace, plan)

    tk = trace.tokens
    ids = tk.expert_ids.tolist()  # [T][L][K]
    members: dict[tuple[int, object], list[int]] = {}  # (phase, micro-batch key) -> token rows in trace order
    token_home = []  # [T]
    for t, (rid, pos, ph) in enumerate(zip(tk.request_id.tolist(), tk.position.tolist(), tk.phase.tolist(),
                                           strict=True)):
        r = row_of[rid]
        token_home.append(home[r])
        key = microbatch_key(r, pos, ph, prompt, prefill_start, decode_batch, prefill_tokens)
        members.setdefault((ph, key), []).append(t)

    out = {}
    for code, name in enumerate(PHASES):
        keys = sorted(k for (p, k) in members if p == code)
        pairs = [0] * L
        local = [0] * L
        node_local = [0] * L
        load = [[0] * W for _ in range(L)]
        sends = {m: [[[0] * W for _ in range(W)] for _ in range(L)] for m in MODES}
        per_mb: dict[str, list[list]] = {}
        num_tokens = 0
        for key in keys:
            rows = members[(code, key)]
            num_tokens += len(rows)
            mb_row: dict[str, list] = {}
            for layer in range(L):
                pairs_on_gpu = [0] * W
                X = {m: [[0] * W for _ in range(W)] for m in MODES}
                experts_on_gpu: list[set] = [set() for _ in range(W)]
                pair_routes = []  # (home, serving GPU) of every pair
                chosen = {}
                if rule in BALANCED:
                    mb_homes = [token_home[t] for t in rows]
                    mb_experts = [[ids[t][layer][k] for k in range(K)] for t in rows]
                    got = [[int(p) for p in row] for row in choose(layer, mb_homes, mb_experts, rule)]
                    check_balanced(rule, got, mb_experts, mb_homes, p2l[layer], S, W, G, intra_cost, inter_cost)
                    chosen = dict(zip(rows, got, strict=True))
                for t in rows:
                    h = token_home[t]
                    targets = []
                    for k in range(K):
                        e = ids[t][layer][k]
                        if rule in BALANCED:
                            g = chosen[t][k] // S
                        else:
                            g = choose_slot(rule, tier[layer][e][h], h, pairs_on_gpu, S) // S
                        pairs_on_gpu[g] += 1
                        experts_on_gpu[g].add(e)
                        pair_routes.append((h, g))
                        targets.append(g)
                        pairs[layer] += 1
                        local[layer] += g == h
                        node_local[layer] += g // G == h // G
                    for s, d in per_gpu_sends(h, targets):
                        X["per_gpu"][s][d] += 1
                    for s, d in two_hop_sends(h, targets, G):
                        X["two_hop"][s][d] += 1
                for g in range(W):
                    load[layer][g] += pairs_on_gpu[g]
                for m in MODES:
                    for s in range(W):
                        for d in range(W):
                            sends[m][layer][s][d] += X[m][s][d]
                    c = link_counts(X[m], G)
                    for cname, v in c.items():
                        mb_row.setdefault(f"{m}.{cname}", []).append(v)
                    mb_row.setdefault(f"{m}.comm_time", []).append(
                        comm_time(c["busiest_intra"], c["busiest_inter"], cluster, dispatch_send_bytes,
                                  combine_send_bytes))
                    mb_row.setdefault(f"{m}.comm_time_padded", []).append(
                        comm_time((G - 1) * c["max_message_sends"], (W - G) * c["max_message_sends"], cluster,
                                  dispatch_send_bytes, combine_send_bytes))
                compute = max(pairs_on_gpu) * pair_seconds
                mb_row.setdefault("compute_time", []).append(compute)
                mb_row.setdefault("pairs", []).append(sum(pairs_on_gpu))
                mb_row.setdefault("max_load", []).append(max(pairs_on_gpu))
                # the kernel time model
                has_pairs = sum(pairs_on_gpu) > 0
                active = max(len(x) for x in experts_on_gpu)
                pb = pair_busiest(pair_routes, W, G)
                memory = active * expert_bytes / cluster.hbm_bw
                mb_row.setdefault("max_active", []).append(active)
                for cname, v in pb.items():
                    mb_row.setdefault(f"per_pair.{cname}", []).append(v)
                mb_row.setdefault("memory_time", []).append(memory)
                expert = max(memory, compute) + cluster.compute_overhead if has_pairs else 0.0
                mb_row.setdefault("expert_time", []).append(expert)
                busiest = {m: link_counts(X[m], G) for m in MODES}
                busiest["per_pair"] = pb
                calls = {}
                for kernel, kind in KERNEL_SENDS.items():
                    bi, be = busiest[kind]["busiest_intra"], busiest[kind]["busiest_inter"]
                    header = KERNEL_CONSTANTS[kernel][3]
                    calls[kernel] = (bi, be, vector + header)
                    mb_row.setdefault(f"{kernel}.dispatch_time", []).append(
                        kernel_call_time(kernel, bi, be, has_pairs, cluster, vector + header))
                    mb_row.setdefault(f"{kernel}.combine_time", []).append(
                        kernel_call_time(kernel, bi, be, has_pairs, cluster, combine_send_bytes))
                kernel = mode if mode != "auto" else ("deepep-normal" if name == "prefill" else "deepep-ll")
                d = mb_row[f"{kernel}.dispatch_time"][-1]
                c = mb_row[f"{kernel}.combine_time"][-1]
                mb_row.setdefault("dispatch_time", []).append(d)
                mb_row.setdefault("combine_time", []).append(c)
                bi, be, _ = calls[kernel]
                args = (has_pairs, cluster, calls[kernel][2], combine_send_bytes, expert_bytes, overlap)
                mb_row.setdefault("layer_time", []).append(layer_of(kernel, bi, be, active, compute, *args))
                # the ideal bounds: every busiest quantity by its mean over the W GPUs (sends counted from source
                # to destination of the kernel's send kind), then also no inter-node sends
                if KERNEL_SENDS[kernel] == "per_pair":
                    routes = [(h, g) for h, g in pair_routes if h != g]
                else:
                    Xk = X[KERNEL_SENDS[kernel]]
                    routes = [(s_, d_) for s_ in range(W) for d_ in range(W) if s_ != d_ for _ in range(Xk[s_][d_])]
                mi = sum(1 for s_, d_ in routes if s_ // G == d_ // G) / W
                me = sum(1 for s_, d_ in routes if s_ // G != d_ // G) / W
                mact = sum(len(x) for x in experts_on_gpu) / W
                mflop = sum(pairs_on_gpu) / W * pair_seconds
                mb_row.setdefault("bound_balanced_time", []).append(layer_of(kernel, mi, me, mact, mflop, *args))
                mb_row.setdefault("bound_local_time", []).append(layer_of(kernel, mi, 0.0, mact, mflop, *args))
                mb_row.setdefault("busiest_inter_sends", []).append(be)  # the chosen kernel's busiest GPU
                mb_row.setdefault("mean_inter_sends", []).append(me)  # and its inter-node sends per GPU
                demand = [0] * trace.meta.num_experts
                for t in rows:
                    for k in range(K):
                        demand[ids[t][layer][k]] += 1
                mb_row.setdefault("bound_reachable_time", []).append(reachable_layer(
                    kernel, demand, len(rows), W, G, K, P, cluster, pair_seconds, calls[kernel][2],
                    combine_send_bytes, expert_bytes, overlap))
            for k, v in mb_row.items():
                per_mb.setdefault(k, []).append(v)
        names = [f"{m}.{c}" for m in MODES for c in LINK_COUNTS] + [
            f"{m}.{c}" for m in MODES for c in ("comm_time", "comm_time_padded")] + ["compute_time", "pairs",
                                                                                     "max_load"]
        names += ["max_active", "memory_time", "expert_time", "dispatch_time", "combine_time", "layer_time",
                  "bound_balanced_time", "bound_local_time", "bound_reachable_time", "busiest_inter_sends",
                  "mean_inter_sends"]
        names += [f"per_pair.{c}" for c in ("intra_node_sends", "inter_node_sends", "busiest_intra", "busiest_inter")]
        names += [f"{k}.{c}" for k in KERNEL_SENDS for c in ("dispatch_time", "combine_time")]
        per_microbatch = {}
        for n in names:
            floats = "time" in n or n == "mean_inter_sends"
            per_microbatch[n] = (np.array(per_mb[n], float if floats else np.int64) if keys
                                 else np.zeros((0, L), float if floats else np.int64))
        out[name] = {
            "microbatches": keys, "num_tokens": num_tokens, "dispatch_send_bytes": dispatch_send_bytes,
            "combine_send_bytes": combine_send_bytes, "pairs": np.array(pairs, np.int64),
            "load": np.array(load, np.int64).reshape(L, W), "local": np.array(local, np.int64),
            "node_local": np.array(node_local, np.int64),
            "sends": {m: np.array(sends[m], np.int64).reshape(L, W, W) for m in MODES},
            "per_microbatch": per_microbatch,
        }
    return out


def merge_phases(a: dict, b: dict) -> dict:
    """Both phases together: counts added, micro-batches listed a then b."""
    return {
        "microbatches": list(a["microbatches"]) + list(b["microbatches"]),
        "num_tokens": a["num_tokens"] + b["num_tokens"],
        "dispatch_send_bytes": a["dispatch_send_bytes"], "combine_send_bytes": a["combine_send_bytes"],
        **{k: a[k] + b[k] for k in ("pairs", "load", "local", "node_local")},
        "sends": {m: a["sends"][m] + b["sends"][m] for m in MODES},
        "per_microbatch": {k: np.concatenate([a["per_microbatch"][k], b["per_microbatch"][k]])
                           for k in a["per_microbatch"]},
    }
