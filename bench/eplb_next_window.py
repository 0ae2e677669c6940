"""EPLB chosen for the next window: plan on one window's load, score balancedness on the next window's, for the
published algorithm, moeplace's twin-free greedy, its packing refinement, and replica caps; plus plan time at
DeepSeek-V3 scale.

Usage:
  python bench/eplb_next_window.py [--windows 8] [--repeats 10] [--json PATH]

Variants (each gets the load [L, E] of the planning window):
- ``published``: DeepSeek's EPLB as vLLM and SGLang ship it (bench/eplb_torch.py, which reproduces the placement
  of EPLB's README): greedy replication and packing, two replicas of one expert may share a GPU.
- ``greedy``: ``moeplace.plan.eplb.rebalance(refine=False)``: the same greedy, twin-free (a replica never joins a
  GPU that holds the expert; replicas per expert capped at the GPUs it can spread over).
- ``refined``: ``refine=True``: the greedy GPU packing followed by the swap local search ``refine_packing``.
- ``greedy-capC`` / ``refined-capC``: the same with at most C replicas per expert (``max_replicas=C``), for the
  caps C in (2, 4) that the slots allow (E x C >= slots) below the default cap.

Balancedness = mean over layers of mean_g / max_g GPU load with each expert's load split evenly over its replicas
(EPLB's own model, SGLang's metric: ``moeplace.plan.base.ideal_gpu_load``). *Next window*: planned on window k,
scored on window k + 1; *same window*: scored on window k. A ratio to ``published`` is sum(variant) / sum(published)
over the pairs with a paired 95% interval (``common.paired_ci``, i.e. ``moeplace.intervals.paired_ratio_ci``;
pooled: cells (dataset x cluster x policy) as the outer level, pairs inside).

Datasets (everything at hand):
- the bundled traces ``src/moeplace/data/*.trace`` (the project's reference models' routing and the gpt-oss-20b
  sample): the request table cut into ``--windows`` equal windows of consecutive requests, in the recorded order
  and in a seeded shuffle (seed 0: a stationary stream); a window's load = expert selections of all its token rows;
- ``../shared/data/gpt-oss-20b`` (decode routing of 528 generations, recorded order = grouped by dataset, and
  shuffled), when present;
- ``../shared/data/olmoe-mixtral`` (OLMoE-1B-7B and Mixtral-8x7B per-domain expert counts at 3 layers), when
  present: consecutive domains in file order form the pairs (a change of domain, not of time);
- DeepSeek-V3 load data: looked for under ../shared/data (``found`` in the result says what was there).

Clusters per expert count (nodes x GPUs, redundant slots): E = 8: 2x2 R=4; E = 32: 2x4 R=8 and 4x2 R=8; E = 64:
2x4 R=16 and 4x8 R=32; E = 256: 4x8 R=32 (DeepSeek-V3's 288 slots). Policies: global (1 group) and hierarchical
(8 groups, when E is a multiple of 8).

Under a workload change (the DeepSeek-V3-shaped loads of ``deepseek_shaped_datasets``: another domain, a mix
change, SYNTHETIC 58-layer workloads; plus the recorded-order and domain-ordered cells above) every variant is
also scored against the engines' own EPLB, vLLM's and SGLang's, run from their interop venvs
(scripts/interop_venvs.sh; bench/engine_eplb.py in a subprocess) on the same planning windows; ``--no-engines``,
or an absent venv, leaves them out and says so in ``engines``. ``results.defaults`` is the decision the ``eplb``
strategy's default packing follows (``moeplace.plan.registry.DEFAULT_EPLB_PACKING``).

Plan time: DeepSeek-V3 shape (58 x 256, 288 slots, 4 x 8), Pareto(1.5) x 1000 load (seed 0, SYNTHETIC, as
bench/eplb_speed.py), median of ``--repeats`` calls after one warm-up, per variant and policy.
Writes bench/results/eplb_next_window.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from common import REPO, BenchRun, median, paired_ci
from eplb_torch import rebalance as rebalance_torch

from moeplace.plan.base import ideal_gpu_load
from moeplace.plan.eplb import rebalance
from moeplace.simulate.routing import mean_balancedness
from moeplace.trace import read_trace

DATA = REPO / "src" / "moeplace" / "data"
SHARED = REPO.parent / "shared" / "data"
CLUSTERS = {8: ((2, 2, 4),), 32: ((2, 4, 8), (4, 2, 8)), 64: ((2, 4, 16), (4, 8, 32)), 256: ((4, 8, 32),)}
CAPS = (2, 4)
DS_SHAPE = (58, 256, 288, 32, 4)  # L, E, P, W, N


@dataclass
class Dataset:
    name: str
    what: str  # how the windows were formed
    loads: np.ndarray  # float64 [K, L, E]: one load per window, in order
    pairs: list[tuple[int, int]] | None = None  # (plan on, score on) window pairs; None: consecutive (k, k + 1)
    change: str = "time"  # what differs between the two windows of a pair: time, domain, mix

    def pair_list(self) -> list[tuple[int, int]]:
        K = self.loads.shape[0]
        return list(self.pairs) if self.pairs is not None else [(k, k + 1) for k in range(K - 1)]


def layer_counts(ids: np.ndarray, E: int) -> np.ndarray:
    """float [L, E]: expert selections per layer. ids: int [T, L, k]."""
    L = ids.shape[1]
    return np.stack([np.bincount(ids[:, li].ravel(), minlength=E) for li in range(L)]).astype(np.float64)


def cut(groups: list[np.ndarray], rows_of, E: int, K: int) -> np.ndarray:
    """[K, L, E]: the groups (request units, in order) cut into K windows of equal count, each window's load."""
    bounds = np.linspace(0, len(groups), K + 1).round().astype(int)
    return np.stack([layer_counts(rows_of(np.concatenate(groups[a:b])), E)
                     for a, b in zip(bounds[:-1], bounds[1:], strict=True)])


def trace_datasets(path: Path, K: int) -> list[Dataset]:
    t = read_trace(path)
    if t.tokens is None:
        return []
    E = t.meta.num_experts
    ids = t.tokens.expert_ids.astype(np.int64)
    order = np.argsort(t.tokens.request_id, kind="stable")
    rid_sorted = t.tokens.request_id[order]
    req = t.requests.request_id
    lo = np.searchsorted(rid_sorted, req, "left")
    hi = np.searchsorted(rid_sorted, req, "right")
    groups = [order[a:b] for a, b in zip(lo, hi, strict=True)]  # token rows of each request, request-table order
    out = []
    for what, perm in (("recorded order", np.arange(len(groups))),
                       ("seeded shuffle (seed 0)", np.random.default_rng(0).permutation(len(groups)))):
        g = [groups[i] for i in perm]
        out.append(Dataset(f"{path.name} ({what})", f"{len(req)} requests of {t.meta.model} ({what}) in {K} "
                           "windows of consecutive requests", cut(g, lambda r: ids[r], E, K)))
    return out


def gpt_oss_datasets(K: int) -> list[Dataset]:
    f = SHARED / "gpt-oss-20b" / "decode_routing.npz"
    if not f.exists():
        return []
    z = np.load(f, allow_pickle=False)
    ids, off = z["expert_ids"].astype(np.int64), z["example_offsets"]
    groups = [np.arange(a, b) for a, b in zip(off[:-1], off[1:], strict=True)]
    out = []
    for what, perm in (("recorded order, grouped by dataset", np.arange(len(groups))),
                       ("seeded shuffle (seed 0)", np.random.default_rng(0).permutation(len(groups)))):
        g = [groups[i] for i in perm]
        out.append(Dataset(f"shared gpt-oss-20b ({what.split(',')[0]})",
                           f"{len(groups)} gpt-oss-20b decode generations ({what}) in {K} windows",
                           cut(g, lambda r: ids[r], 32, K)))
    return out


def olmoe_datasets() -> list[Dataset]:
    out = []
    for model in ("olmoe", "mistral"):
        f = SHARED / "olmoe-mixtral" / f"{model}.npz"
        if not f.exists():
            continue
        z = np.load(f, allow_pickle=False)
        doms = sorted(k.split("__", 1)[1] for k in z.files if k.startswith("expert_counts__"))
        loads = np.stack([z[f"expert_counts__{d}"].astype(np.float64) for d in doms])
        out.append(Dataset(f"shared {model} domains", f"{model} per-domain expert counts at layers 0/7/15, domains "
                           f"in file order {' -> '.join(doms)} (a change of domain, not of time)", loads,
                           change="domain"))
    return out


DS_DOMAINS = ("code", "math", "general")  # reference-ds's domains with >= 1,000 requests (chat has 118)
SYN_SHIFT, SYN_TOKENS = 0.1, 65536  # synthetic DeepSeek-V3-shaped windows: per-workload log-sigma, tokens per window
MIXES = ((0.7, 0.2, 0.1), (0.1, 0.7, 0.2), (0.2, 0.1, 0.7), (0.4, 0.4, 0.2))  # (code, math, general) per window


def deepseek_shaped_datasets(seed: int = 0) -> list[Dataset]:
    """DeepSeek-V3-shaped loads (256 experts in 8 groups, top-8) under a workload change.

    - ``reference-ds`` (the project's trained DeepSeek-V3-architecture reference model, real routing), per phase:
      *another workload*: each domain's load, every ordered pair of distinct domains (plan on code, score on math,
      ...); *a mix change*: windows of 1,000 requests drawn (seeded, without replacement inside a window) with
      the domain mixes ``MIXES`` in turn, consecutive windows paired (a 70/20/10 mix followed by 10/70/20, ...).
    - SYNTHETIC, 58 layers (DeepSeek-V3's MoE layer count): per layer a log-normal expert popularity (sigma 1),
      each of 6 workloads perturbing it (log-normal, sigma ``SYN_SHIFT``), ``SYN_TOKENS`` decode tokens x top-8
      per window
      drawn multinomially; consecutive workloads paired. Labelled SYNTHETIC in its name.
    """
    out: list[Dataset] = []
    path = DATA / "reference-ds.trace"
    if path.exists():
        t = read_trace(path)
        E = t.meta.num_experts
        ids = t.tokens.expert_ids.astype(np.int64)
        dom_of = dict(zip(t.requests.request_id.tolist(), [str(d) for d in t.requests.domain], strict=True))
        tok_dom = np.array([dom_of[r] for r in t.tokens.request_id.tolist()])
        rng = np.random.default_rng(seed)
        for phase, code in (("decode", 1), ("prefill", 0)):
            ph = t.tokens.phase == code
            loads = np.stack([layer_counts(ids[ph & (tok_dom == d)], E) for d in DS_DOMAINS])
            pairs = [(a, b) for a in range(len(DS_DOMAINS)) for b in range(len(DS_DOMAINS)) if a != b]
            out.append(Dataset(f"reference-ds {phase} domains", f"reference-ds {phase} load per domain "
                               f"({', '.join(DS_DOMAINS)}), every ordered pair of distinct domains (another workload)",
                               loads, pairs=pairs, change="domain"))
            req_dom = np.array([dom_of[r] for r in t.requests.request_id.tolist()])
            pools = {d: t.requests.request_id[req_dom == d] for d in DS_DOMAINS}
            rows_of = {}
            order = np.argsort(t.tokens.request_id, kind="stable")
            rs = t.tokens.request_id[order]
            wins = []
            for mix in MIXES:
                take = [rng.choice(pools[d], int(round(1000 * m)), replace=False) for d, m in
                        zip(DS_DOMAINS, mix, strict=True)]
                rids = np.concatenate(take)
                lo, hi = np.searchsorted(rs, rids, "left"), np.searchsorted(rs, rids, "right")
                rows = np.concatenate([order[a:b] for a, b in zip(lo, hi, strict=True)])
                rows_of[mix] = rows[ph[rows]]
                wins.append(layer_counts(ids[rows_of[mix]], E))
            out.append(Dataset(f"reference-ds {phase} mix change", f"reference-ds {phase} load of 1,000-request "
                               f"windows with (code, math, general) mixes {' -> '.join(map(str, MIXES))}",
                               np.stack(wins),
                               change="mix"))
    rng = np.random.default_rng(seed)
    L, E = DS_SHAPE[0], DS_SHAPE[1]
    base = rng.normal(0.0, 1.0, (L, E))
    wins = []
    for _ in range(6):
        p = np.exp(base + rng.normal(0.0, SYN_SHIFT, (L, E)))
        p /= p.sum(axis=1, keepdims=True)
        wins.append(np.stack([rng.multinomial(SYN_TOKENS * 8, row) for row in p]).astype(np.float64))
    out.append(Dataset("SYNTHETIC DeepSeek-V3-shaped decode (58 x 256)", "SYNTHETIC: 58 layers x 256 experts, "
                       f"log-normal popularity (sigma 1) perturbed per workload (sigma {SYN_SHIFT}), {SYN_TOKENS:,} "
                       "tokens x top-8 per window, 6 workloads in turn", np.stack(wins), change="workload (synthetic)"))
    return out


def deepseek_search() -> list[str]:
    """Files under ../shared/data whose path mentions DeepSeek (the SGLang reproduction's load data)."""
    if not SHARED.exists():
        return []
    return sorted(str(p.relative_to(SHARED)) for p in SHARED.rglob("*") if "deepseek" in str(p).lower())


def variants(E: int, P: int, W: int, N: int, groups: int) -> dict[str, object]:
    """name -> fn(load [L, E]) -> phy2log [L, P]."""
    G = W // N if groups > 1 else W  # the GPUs one expert's replicas may spread over
    out = {"published": lambda x: rebalance_torch(torch.from_numpy(x), P, groups, N, W).numpy(),
           "greedy": lambda x: rebalance(x, P, groups, N, W, refine=False),
           "refined": lambda x: rebalance(x, P, groups, N, W, refine=True)}
    for c in CAPS:
        if E * c >= P and c < G:
            out[f"greedy-cap{c}"] = lambda x, c=c: rebalance(x, P, groups, N, W, refine=False, max_replicas=c)
            out[f"refined-cap{c}"] = lambda x, c=c: rebalance(x, P, groups, N, W, refine=True, max_replicas=c)
    return out


def score(p2l: np.ndarray, load: np.ndarray, W: int) -> float:
    return mean_balancedness(ideal_gpu_load(p2l, load, W))


def run_cell(ds: Dataset, nodes: int, gpus: int, R: int, groups: int,
             engine_plans: dict[str, list[np.ndarray]] | None = None) -> dict:
    """One cell: every variant planned on each pair's first window, scored on both. engine_plans: engine name ->
    its phy2log [L, P] per pair (planned on the same windows by bench/engine_eplb.py), scored alike."""
    K, L, E = ds.loads.shape
    W, P = nodes * gpus, E + R
    fns = variants(E, P, W, nodes, groups)
    nxt = {v: [] for v in fns}
    same = {v: [] for v in fns}
    for i, (k, k2) in enumerate(ds.pair_list()):
        for v, fn in fns.items():
            p2l = np.asarray(fn(ds.loads[k]), np.int64)
            nxt[v].append(score(p2l, ds.loads[k2], W))
            same[v].append(score(p2l, ds.loads[k], W))
        for v, plans in (engine_plans or {}).items():
            nxt.setdefault(v, []).append(score(plans[i], ds.loads[k2], W))
            same.setdefault(v, []).append(score(plans[i], ds.loads[k], W))
    pub = np.array(nxt["published"])
    res = {}
    for v in nxt:
        n = np.array(nxt[v])
        res[v] = {"next_window": float(n.mean()), "same_window": float(np.mean(same[v])),
                  "next_per_pair": n.tolist(), "same_per_pair": [float(x) for x in same[v]],
                  "next_vs_published": paired_ci(n, pub),
                  "pairs_at_least_published": int((n >= pub - 1e-12).sum()),
                  "worst_pair_minus_published": float((n - pub).min())}
    return {"dataset": ds.name, "cluster": f"{nodes}x{gpus}", "redundant": R, "slots": P,
            "policy": "hierarchical" if groups > 1 else "global", "num_groups": groups,
            "pairs": len(ds.pair_list()), "change": ds.change,
            "variants": res}


ENGINES = ("vllm", "sglang")


def engine_python(name: str) -> str | None:
    """The python of the ``name`` engine venv (``MOEPLACE_<NAME>_PYTHON``, else ``.venv-<name>`` of this checkout
    once scripts/interop_venvs.sh finished it), or None."""
    env = os.environ.get(f"MOEPLACE_{name.upper()}_PYTHON")
    if env:
        return env if Path(env).is_file() else None
    py = REPO / f".venv-{name}" / "bin" / "python"
    return str(py) if py.is_file() and (REPO / f".venv-{name}" / ".moeplace-ok").is_file() else None


def run_engines(jobs: list[tuple[np.ndarray, tuple[int, int, int, int]]]) -> tuple[dict, dict]:
    """Every job (planning load [L, E], (slots, groups, nodes, GPUs)) planned by each engine whose venv is there,
    with the engine's own EPLB code (bench/engine_eplb.py in a subprocess). Returns (engine -> list of phy2log
    [L, P] in job order, engine -> meta: version, function, or why it is absent)."""
    plans, meta = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        jf = Path(tmp) / "jobs.npz"
        np.savez(jf, params=np.array([p for _, p in jobs], np.int64),
                 **{f"load_{j}": x for j, (x, _) in enumerate(jobs)})
        for name in ENGINES:
            py = engine_python(name)
            if py is None:
                meta[name] = {"absent": f"no .venv-{name} (bash scripts/interop_venvs.sh . {name})"}
                continue
            of = Path(tmp) / f"{name}.npz"
            p = subprocess.run([py, str(REPO / "bench" / "engine_eplb.py"), name, str(jf), str(of)],
                               capture_output=True, text=True, timeout=3600,
                               env={**os.environ, "PYTHONPATH": "", "CUDA_VISIBLE_DEVICES": ""})
            if p.returncode != 0:
                raise SystemExit(f"eplb_next_window: {name}'s EPLB failed:\n{p.stderr[-3000:]}")
            with np.load(of, allow_pickle=False) as z:
                plans[name] = [z[f"p2l_{j}"] for j in range(len(jobs))]
                m = json.loads(str(z["meta"]))
            meta[name] = {"version": m["version"], "function": m["function"], "python": py,
                          "median_ms_per_job": median(m["seconds"]) * 1e3}
            print(f"{name} {m['version']}: {len(jobs)} plans ({m['function']})", flush=True)
    return plans, meta


def plan_times(repeats: int) -> dict:
    L, E, P, W, N = DS_SHAPE
    load = np.random.default_rng(0).pareto(1.5, (L, E)) * 1000
    out = {}
    for policy, groups in (("hierarchical", 8), ("global", 1)):
        row = {}
        for v, fn in variants(E, P, W, N, groups).items():
            fn(load)  # warm-up (numba compiles the refinement once)
            ts = []
            for _ in range(3 if v == "published" else repeats):
                t = time.perf_counter()
                fn(load)
                ts.append(time.perf_counter() - t)
            row[v] = {"median_ms": median(ts) * 1e3, "min_ms": min(ts) * 1e3, "calls": len(ts)}
        out[policy] = row
    return out


def pooled(cells: list[dict], name: str) -> dict:
    have = [c for c in cells if name in c["variants"]]
    plan = [np.array(c["variants"][name]["next_per_pair"]) for c in have]
    base = [np.array(c["variants"]["published"]["next_per_pair"]) for c in have]
    same_p = [np.array(c["variants"][name]["same_per_pair"]) for c in have]
    same_b = [np.array(c["variants"]["published"]["same_per_pair"]) for c in have]
    diffs = np.concatenate([p - b for p, b in zip(plan, base, strict=True)])
    return {"cells": len(have), "pairs": int(sum(len(p) for p in plan)),
            "next_vs_published": paired_ci(plan, base), "same_vs_published": paired_ci(same_p, same_b),
            "pairs_at_least_published": int((diffs >= -1e-12).sum()),
            "worst_pair_minus_published": float(diffs.min()),
            "mean_next_window": float(np.mean(np.concatenate(plan)))}


def compare(cells: list[dict], a: str, b: str, policy: str | None = None) -> dict:
    """Variant ``a`` against ``b`` on the cells that have both (and ``policy``, when given): the paired ratio of
    next-window and of same-window balancedness, and the cells where ``a``'s mean is at least ``b``'s."""
    have = [c for c in cells if a in c["variants"] and b in c["variants"] and policy in (None, c["policy"])]
    out = {"cells": len(have)}
    for key in ("next", "same"):
        A = [np.array(c["variants"][a][f"{key}_per_pair"]) for c in have]
        B = [np.array(c["variants"][b][f"{key}_per_pair"]) for c in have]
        out[f"{key}_window"] = paired_ci(A, B)
        out[f"{key}_cells_at_least"] = int(sum(x.mean() >= y.mean() - 1e-12 for x, y in zip(A, B, strict=True)))
    return out


def decide(comparisons: dict) -> dict:
    """Defaults by next-window results: the refined packing becomes the default only when it lowers next-window
    balancedness neither pooled nor under a workload change (the cells whose two windows are different
    workloads: another domain, another mix); a replica cap becomes the default only when its interval lies above 1."""
    ref = comparisons["refined_vs_greedy"]["next_window"]
    chg = comparisons["refined_vs_greedy_under_change"]["next_window"]
    caps = {k: v["next_window"] for k, v in comparisons.items() if "-cap" in k and k.startswith("refined")}
    better = [k for k, v in caps.items() if v["ci95"][0] > 1.0]
    return {"refine": bool(ref["ratio"] >= 1.0 and chg["ratio"] >= 1.0), "packing":
            "refined" if ref["ratio"] >= 1.0 and chg["ratio"] >= 1.0 else "greedy",
            "refine_next_window_ratio": ref, "refine_under_change_ratio": chg,
            "max_replicas": better[0] if better else None,
            "rule": "refined packing by default iff it lowers neither pooled nor under-change next-window "
                    "balancedness vs the twin-free greedy; a cap only when its next-window interval vs the uncapped "
                    "variant lies above 1"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=8, help="windows per trace (pairs = windows - 1)")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per variant at DeepSeek-V3 scale")
    ap.add_argument("--json", help="write here instead of bench/results/eplb_next_window.json")
    ap.add_argument("--no-engines", action="store_true", help="leave out vLLM's and SGLang's own EPLB (their venvs)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    run = BenchRun("eplb_next_window", baseline="DeepSeek's EPLB as vLLM/SGLang ship it (bench/eplb_torch.py)")
    datasets: list[Dataset] = []
    for p in sorted(DATA.glob("*.trace")):
        datasets += trace_datasets(p, args.windows)
    datasets += gpt_oss_datasets(args.windows) + olmoe_datasets() + deepseek_shaped_datasets()
    todo = []  # (dataset, nodes, gpus, R, groups)
    for ds in datasets:
        E = ds.loads.shape[2]
        for nodes, gpus, R in CLUSTERS.get(E, ()):
            for groups in (1, 8):
                if groups > 1 and (E % groups or groups % nodes):
                    continue
                todo.append((ds, nodes, gpus, R, groups))
    jobs = [(ds.loads[k], (ds.loads.shape[2] + R, groups, nodes, nodes * gpus))
            for ds, nodes, gpus, R, groups in todo for k, _ in ds.pair_list()]
    eplans, engines = run_engines(jobs) if not args.no_engines else ({}, {"skipped": "--no-engines"})
    cells, j0 = [], 0
    for ds, nodes, gpus, R, groups in todo:
        n = len(ds.pair_list())
        c = run_cell(ds, nodes, gpus, R, groups, {e: p[j0:j0 + n] for e, p in eplans.items()})
        j0 += n
        cells.append(c)
        v = c["variants"]
        eng = " ".join(f"{e} {v[e]['next_window']:.4f}" for e in eplans)
        print(f"{ds.name:58s} {c['cluster']:>4s} R={R:<3d} {c['policy']:12s} next: published "
              f"{v['published']['next_window']:.4f} {eng} greedy {v['greedy']['next_window']:.4f} refined "
              f"{v['refined']['next_window']:.4f}   same: greedy {v['greedy']['same_window']:.4f} "
              f"refined {v['refined']['same_window']:.4f}", flush=True)
    names = sorted({v for c in cells for v in c["variants"]} - {"published"})
    shifted = [c for c in cells if c["change"] != "time"]  # the two windows are different workloads
    ds_shaped = [c for c in shifted if c["dataset"].startswith(("reference-ds ", "SYNTHETIC"))]
    summary = {v: pooled(cells, v) for v in names}
    under_change = {v: pooled(shifted, v) for v in names}
    deepseek_change = {v: pooled(ds_shaped, v) for v in names}

    def vs(c: dict, a: str, b: str) -> dict | None:
        return paired_ci(np.array(c["variants"][a]["next_per_pair"]), np.array(c["variants"][b]["next_per_pair"]))

    per_cell = [{"dataset": c["dataset"], "cluster": c["cluster"], "policy": c["policy"], "change": c["change"],
                 "next_window": {v: c["variants"][v]["next_window"] for v in c["variants"]},
                 **{f"{a}_vs_{b}": vs(c, a, b) for a in ("greedy", "refined") for b in ("published", *eplans)}}
                for c in cells]
    comparisons = {"refined_vs_greedy": compare(cells, "refined", "greedy"),
                   "greedy_vs_published": compare(cells, "greedy", "published"),
                   "refined_vs_published": compare(cells, "refined", "published")}
    comparisons["refined_vs_greedy_under_change"] = compare(shifted, "refined", "greedy")
    comparisons["refined_vs_greedy_deepseek_change"] = compare(ds_shaped, "refined", "greedy")
    comparisons["greedy_vs_published_under_change"] = compare(shifted, "greedy", "published")
    comparisons["refined_vs_published_under_change"] = compare(shifted, "refined", "published")
    for pol in ("global", "hierarchical"):
        comparisons[f"refined_vs_greedy_{pol}"] = compare(cells, "refined", "greedy", pol)
    for e in eplans:
        for v in ("greedy", "refined", "published"):
            comparisons[f"{v}_vs_{e}"] = compare(cells, v, e)
            comparisons[f"{v}_vs_{e}_under_change"] = compare(shifted, v, e)
            comparisons[f"{v}_vs_{e}_deepseek_change"] = compare(ds_shaped, v, e)
    for c in CAPS:
        for base in ("greedy", "refined"):
            comparisons[f"{base}-cap{c}_vs_{base}"] = compare(cells, f"{base}-cap{c}", base)
    decision = decide(comparisons)
    for k, v in comparisons.items():
        n = v["next_window"]
        print(f"{k:28s} next {n['ratio']:.5f} [{n['ci95'][0]:.5f}, {n['ci95'][1]:.5f}] same "
              f"{v['same_window']['ratio']:.5f}; at least on {v['next_cells_at_least']}/{v['cells']} cells")
    print("defaults:", {k: v for k, v in decision.items() if k in ("packing", "max_replicas")})
    for r in per_cell:
        if r["change"] != "time":
            print(f"{r['dataset']:50s} {r['policy']:12s} " + " ".join(
                f"{k} {r[k]['ratio']:.4f} [{r[k]['ci95'][0]:.4f}, {r[k]['ci95'][1]:.4f}]"
                for k in r if k.startswith("greedy_vs") and r[k]))
    times = plan_times(args.repeats)
    for v, s in summary.items():
        ci = s["next_vs_published"]
        print(f"pooled {v:15s} next/published {ci['ratio']:.5f} [{ci['ci95'][0]:.5f}, {ci['ci95'][1]:.5f}] over "
              f"{s['pairs']} pairs; >= published on {s['pairs_at_least_published']}; worst "
              f"{s['worst_pair_minus_published']:+.5f}")
    for pol, row in times.items():
        print(pol, {v: round(r["median_ms"], 1) for v, r in row.items()})
    body = {"params": {"windows": args.windows, "repeats": args.repeats, "clusters": {str(k): v for k, v in
                                                                                      CLUSTERS.items()},
                       "caps": list(CAPS), "deepseek_v3_shape": dict(zip("L E P W N".split(), DS_SHAPE, strict=True)),
                       "plan_time_load": "pareto(1.5) x 1000, seed 0 (SYNTHETIC)", "torch_threads": 1},
            "datasets": [{"name": d.name, "what": d.what, "windows": int(d.loads.shape[0]),
                          "layers": int(d.loads.shape[1]), "experts": int(d.loads.shape[2])} for d in datasets],
            "deepseek_v3_load_data": {"searched": str(SHARED), "found": deepseek_search()},
            "engines": engines,
            "results": {"cells": cells, "pooled": summary, "under_change": under_change,
                        "deepseek_change": deepseek_change, "per_cell": per_cell, "comparisons": comparisons,
                        "defaults": decision,
                        "plan_time_ms": times}}
    run.write(body, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
