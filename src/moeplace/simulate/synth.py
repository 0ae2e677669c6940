"""Synthetic workloads for the model presets: labelled synthetic everywhere (metadata, source, CLI output).

Shape legend: R = requests, T = tokens, L = MoE layers, E = experts, K = top-k, H = FoE groups.

Generative model (per layer l, request r, phase p in {prefill, decode}):

- expert logits ``s * b_l + u_{r,p}``: ``b_l`` a fixed popularity profile (normal quantiles, shuffled per layer),
  ``s`` the skew scale; ``u_{r,prefill} = sigma * (sqrt(w) * D_domain + sqrt(1-w) * g_r)`` (domain share ``w``),
  ``u_{r,decode} = c * u_{r,prefill} + sqrt(1-c^2) * sigma * g'_r`` (``c`` drives prefill-decode correlation);
- each of the K slots of a token holds its expert for a run of tokens: at each token a slot switches with
  probability ``1 - tau`` (``tau`` drives consecutive-token overlap; every slot switches at a request's first token
  and at the first decode token); a switching slot takes, with probability ``layer_affinity``, the *partner* of its
  expert in layer l-1 (the expert of the same popularity rank in layer l), else a fresh draw without replacement
  from its request-phase distribution;
- FoE (``foe_groups=H``): slot j draws only inside group ``j // (K/H)`` (experts ``[g*E/H, (g+1)*E/H)``).

``s``, ``tau`` and ``c`` are calibrated by bisection on a pilot sample so that the measured per-layer load
max/mean, consecutive decode-token overlap and prefill-decode Pearson come back as asked (:func:`calibrate`).
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Iterable, Iterator
from contextlib import closing
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from scipy.special import ndtri

from moeplace.deploy import ModelPreset, get_model
from moeplace.simulate.loops import by_ranges
from moeplace.simulate.synth_config import SYNTH_AHEAD, SynthConfig
from moeplace.simulate.synth_loops import guide_table, later_duplicates, search_rows, switch_fill
from moeplace.trace.types import DECODE, PREFILL, TraceMeta
from moeplace.trace.writer import TraceWriter

DOMAINS = ("code", "math", "chat", "general", "science", "writing", "multilingual", "reasoning")


@dataclass(frozen=True)
class _Params:
    s: float  # skew scale
    tau: float  # slot stickiness per token
    c: float  # prefill-decode logit correlation


def domain_names(n: int) -> list[str]:
    return [DOMAINS[i] if i < len(DOMAINS) else f"domain-{i}" for i in range(n)]


# --------------------------------------------------------------------------------------------------- measures


def measure_load_skew(ids: np.ndarray, num_experts: int) -> float:
    """Mean over layers of max/mean expert load. ids: int [T, L, K]."""
    loads = np.stack([np.bincount(ids[:, j].ravel(), minlength=num_experts) for j in range(ids.shape[1])])
    return float((loads.max(1) / loads.mean(1)).mean())


def measure_temporal_overlap(ids: np.ndarray, request_id: np.ndarray, position: np.ndarray, phase: np.ndarray
                             ) -> float:
    """Mean share of top-k experts a decode token keeps from the previous decode token of its request.
    ids: int [T, L, K]; rows of one request in position order."""
    K = ids.shape[-1]
    ok = (request_id[1:] == request_id[:-1]) & (position[1:] == position[:-1] + 1) & (phase[1:] == DECODE) & (
        phase[:-1] == DECODE)
    if not ok.any():
        return float("nan")
    a, b = ids[1:][ok], ids[:-1][ok]  # [n, L, K]
    same = (a[..., :, None] == b[..., None, :]).any(-1).sum(-1)
    return float(same.mean() / K)


def measure_prefill_decode_corr(ids: np.ndarray, request_id: np.ndarray, phase: np.ndarray, num_experts: int
                                ) -> float:
    """Mean Pearson correlation of prefill vs decode expert-count vectors per (request, layer)."""
    _, r = np.unique(request_id, return_inverse=True)
    R, L = r.max() + 1, ids.shape[1]
    cnt = np.zeros((2, R, L, num_experts))
    key = (r[:, None, None] * L + np.arange(L)[None, :, None]) * num_experts + ids
    for p in (PREFILL, DECODE):
        sel = phase == p
        cnt[p] = np.bincount(key[sel].ravel(), minlength=R * L * num_experts).reshape(R, L, num_experts)
    a = cnt[0] - cnt[0].mean(-1, keepdims=True)
    b = cnt[1] - cnt[1].mean(-1, keepdims=True)
    den = np.sqrt((a * a).sum(-1) * (b * b).sum(-1))
    ok = den > 0
    return float(((a * b).sum(-1)[ok] / den[ok]).mean()) if ok.any() else float("nan")


# --------------------------------------------------------------------------------------------------- generator


class _Model:
    """Fixed per-layer parts of the generative model (profiles, domains, partner maps)."""

    def __init__(self, L: int, E: int, K: int, cfg: SynthConfig, rng: np.random.Generator) -> None:
        H = cfg.foe_groups or 1
        if K % H or E % H:
            raise ValueError(f"synth: foe_groups={cfg.foe_groups} must divide top_k={K} and num_experts={E}")
        self.L, self.E, self.K, self.H = L, E, K, H
        self.Eg, self.Kg = E // H, K // H
        q = ndtri((np.arange(self.Eg) + 0.5) / self.Eg)  # popularity profile inside each group
        rank = np.stack([np.concatenate([rng.permutation(self.Eg) for _ in range(H)]) for _ in range(L)])  # [L, E]
        self.base = q[rank]  # [L, E]
        # partner of expert e at layer l-1: the expert of the same rank (and group) at layer l
        grp = np.arange(E) // self.Eg
        self.partner = np.zeros((L, E), np.int64)
        for layer in range(1, L):
            inv = np.empty(E, np.int64)
            inv[grp * self.Eg + rank[layer]] = np.arange(E)
            self.partner[layer] = inv[grp * self.Eg + rank[layer - 1]]
        self.dom = rng.standard_normal((L, cfg.num_domains, E))
        self.slot_group = np.arange(K) // self.Kg  # [K]


def _lengths(cfg: SynthConfig, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    j = cfg.length_jitter
    pl = np.maximum(1, np.rint(cfg.prompt_len * rng.uniform(1 - j, 1 + j, n))).astype(np.int64)
    gl = np.maximum(0, np.rint(cfg.gen_len * rng.uniform(1 - j, 1 + j, n))).astype(np.int64) if cfg.gen_len else \
        np.zeros(n, np.int64)
    return pl, gl


def _gen_batch(m: _Model, cfg: SynthConfig, p: _Params, rng: np.random.Generator, pl: np.ndarray, gl: np.ndarray,
               dom: np.ndarray, layers: int | None = None) -> np.ndarray:
    """Routing of a batch of requests: int16 [R, T_max, L, K] (entries past a request's length are garbage)."""
    R = len(pl)
    L = layers or m.L
    T = int((pl + gl).max())
    E, K, Eg, H = m.E, m.K, m.Eg, m.H
    t = np.arange(T)
    is_dec = t[None, :] >= pl[:, None]  # [R, T]
    out = np.empty((R, T, L, K), np.int16)
    w, sig, c = cfg.domain_strength, cfg.request_spread, p.c
    rows_r = np.arange(R)
    prev = None
    for layer in range(L):
        u_pre = sig * (np.sqrt(w) * m.dom[layer, dom] + np.sqrt(1 - w) * rng.standard_normal((R, E)))
        u_dec = c * u_pre + np.sqrt(max(0.0, 1 - c * c)) * sig * rng.standard_normal((R, E))
        logits = p.s * m.base[layer][None, None, :] + np.stack([u_pre, u_dec], 1)  # [R, 2, E]
        lg = logits.reshape(R, 2, H, Eg)
        wts = np.exp(lg - lg.max(-1, keepdims=True))
        cum = np.cumsum(wts, -1)
        cum /= cum[..., -1:]
        n_rows = R * 2 * H
        flat = (cum.reshape(n_rows, Eg) + np.arange(n_rows)[:, None]).ravel()
        guide = guide_table(flat, n_rows, Eg)

        def draw(r_idx, dec, slot, _flat=flat, _g=guide):
            row = (r_idx * 2 + dec) * H + m.slot_group[slot]
            pos = search_rows(_flat, _g, rng.random(len(row)) + row, row, Eg)  # = searchsorted(right) - row * Eg
            return m.slot_group[slot] * Eg + np.clip(pos, 0, Eg - 1)

        switch = rng.random((R, T, K)) >= p.tau
        switch[:, 0] = True
        switch[rows_r, np.minimum(pl, T - 1)] = True  # first decode token (harmless when gen_len = 0)
        per_req = np.count_nonzero(switch.reshape(R, -1), axis=1)
        offsets = np.concatenate([[0], np.cumsum(per_req)[:-1]]).astype(np.int64)
        n_sw = int(per_req.sum())
        u = rng.random(n_sw)  # one draw per switch, in np.nonzero(switch) order
        follows = prev is not None and cfg.layer_affinity > 0
        fu = rng.random(n_sw) if follows else np.empty(0)
        ids = np.empty((R, T, K), np.int64)  # each slot keeps its expert until it switches
        by_ranges(switch_fill, R, switch, u, fu, float(cfg.layer_affinity), prev if follows else ids,
                  m.partner[layer], flat, guide, pl, m.slot_group, H, Eg, offsets, ids)
        cr = ct = None  # tokens that had duplicates: only they can have them after a redraw
        for attempt in range(9):  # a token's slots must hold distinct experts: redraw later duplicates
            if cr is None:
                dr, dt, dk = np.nonzero(later_duplicates(ids))
            else:  # the same entries, in the same (r, t, k) order, as a check of every token would find
                i, dk = np.nonzero(later_duplicates(ids[cr, ct][None])[0])
                dr, dt = cr[i], ct[i]
            if not len(dr):
                break
            if attempt < 8:
                ids[dr, dt, dk] = draw(dr, is_dec[dr, dt].astype(np.int64), dk)
                first = np.r_[True, (dr[1:] != dr[:-1]) | (dt[1:] != dt[:-1])]
                cr, ct = dr[first], dt[first]
                continue
            # skewed rows: the remaining duplicates take uniformly random unused experts of their group, in turn
            for j in np.unique(dk):
                sel = dk == j
                a, b = dr[sel], dt[sel]
                g = m.slot_group[j]
                keys = rng.random((len(a), Eg))
                used = ids[a, b] - g * Eg  # [n, K]; other groups' experts fall outside [0, Eg)
                inside = (used >= 0) & (used < Eg)
                keys[np.repeat(np.arange(len(a)), K)[inside.ravel()], used[inside]] = -1.0
                ids[a, b, j] = g * Eg + keys.argmax(1)
        out[:, :, layer] = ids
        prev = ids
    return out


def _flatten(batch: np.ndarray, pl: np.ndarray, gl: np.ndarray, rid0: int):
    """Valid rows of a batch in request order: request_id, position, phase, ids [T, L, K]."""
    n = pl + gl
    r = np.repeat(np.arange(len(pl)), n)
    pos = np.concatenate([np.arange(x) for x in n]) if len(n) else np.zeros(0, np.int64)
    phase = (pos >= pl[r]).astype(np.int8)
    return r + rid0, pos.astype(np.int32), phase, batch[r, pos]


# --------------------------------------------------------------------------------------------------- calibration


def _pilot(m: _Model, cfg: SynthConfig, p: _Params, n_req: int, seed: int, layers: int = 2
           ) -> tuple[float, float, float]:
    rng = np.random.default_rng(seed)
    pl, gl = _lengths(cfg, rng, n_req)
    dom = rng.integers(0, cfg.num_domains, n_req)
    batch = _gen_batch(m, cfg, p, rng, pl, gl, dom, layers=min(m.L, layers))
    rid, pos, ph, ids = _flatten(batch, pl, gl, 0)
    return (measure_load_skew(ids, m.E), measure_temporal_overlap(ids, rid, pos, ph),
            measure_prefill_decode_corr(ids, rid, ph, m.E))


def _bisect(f, lo: float, hi: float, target: float, iters: int = 9) -> float:
    flo, fhi = f(lo), f(hi)
    if not np.isfinite(flo) or not np.isfinite(fhi):
        return lo
    if target <= flo:
        return lo
    if target >= fhi:
        return hi
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def calibrate(m: _Model, cfg: SynthConfig, pilot_requests: int = 40) -> tuple[_Params, dict]:
    """Parameters whose pilot sample measures the asked skew, overlap and prefill-decode Pearson."""
    p = _Params(s=max(cfg.load_skew - 1, 0.0), tau=cfg.temporal_overlap, c=cfg.prefill_decode_corr)
    if not cfg.calibrate:
        return p, {}
    seed = cfg.seed + 7919
    n = min(pilot_requests, cfg.num_requests) if cfg.num_requests >= 8 else pilot_requests
    # max/mean of a finite sample is biased upwards: measure skew on a pilot as large as the trace (capped)
    n_skew = max(n, min(cfg.num_requests, 256))

    def skew_at(s):
        return _pilot(m, cfg, replace(p, s=s), n_skew, seed, layers=4)[0]

    def overlap_at(x, q):
        return _pilot(m, cfg, replace(q, tau=x), n, seed)[1]

    def corr_at(x, q):
        return _pilot(m, cfg, replace(q, c=x), n, seed)[2]

    p = replace(p, s=_bisect(skew_at, 0.0, 4.0, cfg.load_skew))
    if cfg.gen_len > 1:
        p = replace(p, tau=_bisect(lambda x, q=p: overlap_at(x, q), 0.0, 0.999, cfg.temporal_overlap))
        p = replace(p, c=_bisect(lambda x, q=p: corr_at(x, q), -1.0, 1.0, cfg.prefill_decode_corr))
        p = replace(p, s=_bisect(skew_at, 0.0, 4.0, cfg.load_skew))  # stickiness and c move the skew a little
    got = _pilot(m, cfg, p, n, seed + 1)
    achieved = {"load_skew": _pilot(m, cfg, p, n_skew, seed + 1, layers=4)[0], "temporal_overlap": got[1],
                "prefill_decode_corr": got[2]}
    asked = {"load_skew": cfg.load_skew, "temporal_overlap": cfg.temporal_overlap,
             "prefill_decode_corr": cfg.prefill_decode_corr}
    for k, v in achieved.items():
        if np.isfinite(v) and abs(v - asked[k]) > 0.1 * max(1.0, abs(asked[k])):
            warnings.warn(f"synth: asked {k}={asked[k]} but the pilot sample measures {v:.3f} (out of reach for "
                          "these lengths and shape)", stacklevel=2)
    return p, {"pilot_measured": achieved}


# --------------------------------------------------------------------------------------------------- entry points


def _meta(preset: ModelPreset, cfg: SynthConfig, params: _Params, extra: dict) -> TraceMeta:
    kind = f"FoE H={cfg.foe_groups} " if cfg.foe_groups else ""
    return TraceMeta(
        model=preset.hf_id, num_layers=preset.num_layers, num_experts=preset.num_experts, top_k=preset.top_k,
        num_shared_experts=preset.num_shared_experts, hidden_size=preset.hidden_size,
        moe_layer_map=list(preset.moe_layer_map), synthetic=True, foe_groups=cfg.foe_groups or 1,
        source=f"synthetic: moeplace.synth {kind}workload for preset {preset.name} (seed {cfg.seed}); not real routing",
        extra={"generator": "moeplace.synth", "preset": preset.to_json(), "config": asdict(cfg),
               "params": asdict(params), **extra},
    )


def generate_batches(preset: ModelPreset | str, cfg: SynthConfig, batch_requests: int = 64
                     ) -> tuple[TraceMeta, Iterator[tuple[dict, tuple]]]:
    """Metadata and an iterator of (request rows, token rows) batches; token rows are in request-then-position order.

    Request rows: dict of request_id, domain, prompt_len, gen_len arrays; token rows: (request_id, position, phase,
    expert_ids [T, L, K]).
    """
    preset = get_model(preset) if isinstance(preset, str) else preset
    rng = np.random.default_rng(cfg.seed)
    m = _Model(preset.num_layers, preset.num_experts, preset.top_k, cfg, rng)
    params, extra = calibrate(m, cfg)
    meta = _meta(preset, cfg, params, extra)
    names = np.array(domain_names(cfg.num_domains), dtype=object)
    mix = np.full(cfg.num_domains, 1.0) if cfg.domain_mix is None else np.asarray(cfg.domain_mix, float)
    mix = mix / mix.sum()

    def it():
        for start in range(0, cfg.num_requests, batch_requests):
            n = min(batch_requests, cfg.num_requests - start)
            pl, gl = _lengths(cfg, rng, n)
            dom = rng.choice(cfg.num_domains, n, p=mix)
            batch = _gen_batch(m, cfg, params, rng, pl, gl, dom)
            reqs = {"request_id": np.arange(start, start + n), "domain": names[dom], "prompt_len": pl, "gen_len": gl}
            yield reqs, _flatten(batch, pl, gl, start)

    return meta, it()


def read_ahead(items: Iterable, depth: int = SYNTH_AHEAD) -> Iterator:
    """The items of ``items``, computed in a background thread up to ``depth`` ahead of the consumer (synth: the
    next batch is generated while the last one is compressed and written; the generator's random stream is drawn
    in one thread, in the same order, so the trace is unchanged). An exception in the thread is raised here."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def put(x) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for x in items:
                if not put((x, None)):
                    return
            put((end, None))
        except BaseException as e:  # handed to the consumer, raised there
            put((end, e))

    t = threading.Thread(target=work, name="moeplace-synth", daemon=True)
    t.start()
    try:
        while True:
            x, err = q.get()
            if err is not None:
                raise err
            if x is end:
                return
            yield x
    finally:
        stop.set()


def synthesize(path: str | Path, preset: ModelPreset | str, cfg: SynthConfig, overwrite: bool = False,
               progress: bool = False, batch_requests: int = 64) -> Path:
    """Write a synthetic trace (metadata synthetic=True) for a model preset, streaming batches to TraceWriter."""
    meta, batches = generate_batches(preset, cfg, batch_requests)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.num_requests, unit="req", desc=f"synth {meta.model}")
    with TraceWriter(path, meta, overwrite=overwrite, keep_partial=False) as w, \
            closing(read_ahead(batches)) as ahead:  # a failure leaves no folder and stops the generating thread
        for reqs, (rid, pos, ph, ids) in ahead:
            w.add_requests(reqs["request_id"], domain=reqs["domain"], source=["synthetic"] * len(reqs["request_id"]),
                           prompt_len=reqs["prompt_len"], gen_len=reqs["gen_len"])
            w.add_tokens(rid, pos, ph, ids)
            if bar is not None:
                bar.update(len(reqs["request_id"]))
    if bar is not None:
        bar.close()
    return Path(path)
