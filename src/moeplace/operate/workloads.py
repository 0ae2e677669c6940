"""Workloads: order a request pool into a stream whose mix changes over time.

Shape legend: R = requests in the pool, N = arrivals in the stream, D = keys of the pool (its domains, or its
datasets: the part of ``source`` before the first ``/``), P = phases.

A :class:`MixSchedule` says, for arrival ``i`` (0, 1, ...), what share of arrivals comes from each key. It combines
three typed parts, each a small frozen dataclass with a JSON round trip:

- :class:`Phase` sequences: ``Phase(1000, {"code": 0.8, "chat": 0.2})`` then ``Phase(1000, {"chat": 0.8, ...})``
  (a code-heavy hour then a chat-heavy hour at 1,000 requests an hour). Phases repeat when the stream is longer.
- a :class:`DailyCycle`: the weight of key d at arrival t is ``base_d * (1 + a_d * sin(2 pi (t / period +
  offset_d)))``, clipped at 0, where ``base`` is the phase mix at t (or the schedule's ``base``; uniform when
  neither is given). The period is in arrivals; :meth:`DailyCycle.from_hours` states it in hours at an arrival
  rate (24 h at 500 requests/h = 12,000 arrivals).
- :class:`Burst` windows: arrivals ``start .. start + length - 1`` take ``share`` of their requests from one key;
  the rest keep the proportions of the mix underneath (spread evenly over the other keys when that mix has
  nothing else). Later bursts override earlier ones where they overlap.

Worked example: phases code 0.8 / chat 0.2 for 1,000 arrivals; a cycle with period 500 and amplitude 0.5 on code;
at arrival 125 (a quarter period) code's weight is 0.8 * 1.5 = 1.2 and chat's 0.2, so P(code) = 1.2 / 1.4 = 0.857.

:func:`order_pool` draws the stream: for each arrival a key from its probability vector, then a request of that
key's pool (with replacement, or ``replace=False``: each key's pool in a fresh shuffle per pass, so no request
repeats before its pool is used up). Draws come from NumPy's PCG64 stream seeded by ``seed``, which is the same
on every platform. :func:`stream_trace` applies it to a per-token trace and returns the re-ordered trace: fresh
request ids in arrival order, the provenance in each request's ``source`` and in ``meta.source``. A stream of real
routing is real routing re-ordered (each request's token rows are copied as recorded); the ``synthetic`` flag is
carried from the input.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from moeplace.budget import check_memory
from moeplace.trace.types import Requests, TokenChunk, Trace, TraceMeta

KEYS = ("domain", "dataset", "subdomain")
SCHEDULE_FORMAT = "moeplace-mix-schedule"
SCHEDULE_VERSION = 1
DRAWN_FROM = " (drawn from request "  # what a stream appends to each arrival's source, then "<id>)"


# --------------------------------------------------------------------------------------------------- validation


def _count(name: str, v: object, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    return int(v)


def _number(name: str, v: object, lo: float | None = None, hi: float | None = None, open_lo: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    x = float(v)
    if lo is not None and (x < lo or (open_lo and x == lo)):
        raise ValueError(f"{name} must be {'>' if open_lo else '>='} {lo}, got {v!r}")
    if hi is not None and x > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v!r}")
    return x


def _weights(name: str, d: object, positive_sum: bool = True, lo: float | None = 0.0) -> dict[str, float]:
    if not isinstance(d, Mapping):
        raise ValueError(f"{name} must be a mapping of key -> number, got {type(d).__name__}")
    out = {}
    for k, v in d.items():
        if not isinstance(k, str) or not k:
            raise ValueError(f"{name}: keys must be non-empty strings, got {k!r}")
        out[k] = _number(f"{name}[{k!r}]", v, lo)
    if positive_sum and (not out or sum(out.values()) <= 0):
        raise ValueError(f"{name} must give non-negative weights with a positive sum, got {dict(d)}")
    return out


def _fields(name: str, d: object, known: set[str], required: set[str]) -> dict:
    if not isinstance(d, Mapping):
        raise ValueError(f"{name}: expected a JSON object, got {type(d).__name__}")
    extra = sorted(set(d) - known)
    if extra:
        raise ValueError(f"{name}: unknown fields {extra} (expected {sorted(known)})")
    missing = sorted(required - set(d))
    if missing:
        raise ValueError(f"{name}: missing fields {missing}")
    return dict(d)


def _mix_text(mix: Mapping[str, float]) -> str:
    return "/".join(f"{k}:{v:.2g}" for k, v in mix.items() if v > 0)


# --------------------------------------------------------------------------------------------------- schedule parts


@dataclass(frozen=True)
class Phase:
    """A stretch of the stream: ``requests`` arrivals drawn from the keys in proportion to ``mix``."""

    requests: int  # arrivals in this phase (>= 1)
    mix: dict[str, float]  # key (domain or dataset) -> weight >= 0, normalised over the phase; positive sum

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests", _count("Phase.requests", self.requests, 1))
        object.__setattr__(self, "mix", _weights("Phase.mix", self.mix))

    def to_json(self) -> dict:
        return {"requests": self.requests, "mix": dict(self.mix)}

    @classmethod
    def from_json(cls, d: object, where: str = "phase") -> Phase:
        d = _fields(where, d, {"requests", "mix"}, {"requests", "mix"})
        try:
            return cls(d["requests"], d["mix"])
        except ValueError as e:  # name where in the file
            raise ValueError(f"{where}: {e}") from None


@dataclass(frozen=True)
class DailyCycle:
    """A periodic swing of the mix: key d's weight is multiplied by ``1 + amplitude[d] * sin(2 pi (t / period +
    offset[d]))`` (t = arrival index), clipped at 0. Keys missing from ``amplitude`` do not swing."""

    period: float  # arrivals per cycle (> 0)
    amplitude: dict[str, float]  # key -> a_d >= 0 (a_d > 1 switches the key off for part of the cycle)
    offset: dict[str, float] = field(default_factory=dict)  # key -> phase offset in cycles (0.5 = opposite swing)
    requests_per_hour: float | None = None  # arrival rate the period was stated at (documentation; None: not stated)

    def __post_init__(self) -> None:
        object.__setattr__(self, "period", _number("DailyCycle.period", self.period, 0.0, open_lo=True))
        object.__setattr__(self, "amplitude", _weights("DailyCycle.amplitude", self.amplitude, positive_sum=False))
        object.__setattr__(self, "offset", _weights("DailyCycle.offset", self.offset, positive_sum=False, lo=None))
        if self.requests_per_hour is not None:
            object.__setattr__(self, "requests_per_hour",
                               _number("DailyCycle.requests_per_hour", self.requests_per_hour, 0.0, open_lo=True))

    @classmethod
    def from_hours(cls, hours: float, requests_per_hour: float, amplitude: Mapping[str, float],
                   offset: Mapping[str, float] | None = None) -> DailyCycle:
        """A cycle of ``hours`` at ``requests_per_hour`` arrivals an hour (period = hours * rate arrivals)."""
        h = _number("DailyCycle hours", hours, 0.0, open_lo=True)
        r = _number("DailyCycle.requests_per_hour", requests_per_hour, 0.0, open_lo=True)
        return cls(h * r, dict(amplitude), dict(offset or {}), r)

    def factor(self, keys: Sequence[str], t: np.ndarray) -> np.ndarray:
        """float64 [N, D]: the multiplier of each key's weight at arrivals ``t`` [N] (not yet clipped)."""
        a = np.array([self.amplitude.get(k, 0.0) for k in keys], np.float64)
        o = np.array([self.offset.get(k, 0.0) for k in keys], np.float64)
        t = np.asarray(t, np.float64)
        return 1.0 + a[None, :] * np.sin(2.0 * np.pi * (t[:, None] / self.period + o[None, :]))

    def describe(self) -> str:
        when = f"{self.period:g} arrivals"
        if self.requests_per_hour:
            when += f" = {self.period / self.requests_per_hour:g} h at {self.requests_per_hour:g} requests/h"
        amp = "/".join(f"{k}:{v:g}" for k, v in self.amplitude.items())
        off = "/".join(f"{k}:{v:g}" for k, v in self.offset.items() if v)
        return f"cycle of {when}, amplitude {amp}" + (f", offset {off}" if off else "")

    def to_json(self) -> dict:
        return {"period": self.period, "amplitude": dict(self.amplitude), "offset": dict(self.offset),
                "requests_per_hour": self.requests_per_hour}

    @classmethod
    def from_json(cls, d: object, where: str = "cycle") -> DailyCycle:
        d = _fields(where, d, {"period", "amplitude", "offset", "requests_per_hour"}, {"period", "amplitude"})
        try:
            return cls(d["period"], d["amplitude"], d.get("offset") or {}, d.get("requests_per_hour"))
        except ValueError as e:  # name where in the file
            raise ValueError(f"{where}: {e}") from None


@dataclass(frozen=True)
class Burst:
    """Arrivals ``start .. start + length - 1`` take ``share`` of their requests from ``key``."""

    start: int  # first arrival of the burst (>= 0)
    length: int  # arrivals in the burst (>= 1)
    key: str  # the domain (or dataset, when streaming by dataset) the burst comes from
    share: float  # in [0, 1]: share of the burst's arrivals from ``key``

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", _count("Burst.start", self.start, 0))
        object.__setattr__(self, "length", _count("Burst.length", self.length, 1))
        if not isinstance(self.key, str) or not self.key:
            raise ValueError(f"Burst.key must be a non-empty string, got {self.key!r}")
        object.__setattr__(self, "share", _number("Burst.share", self.share, 0.0, 1.0))

    @property
    def end(self) -> int:
        """One past the burst's last arrival."""
        return self.start + self.length

    def describe(self) -> str:
        return f"{self.key} {self.share:.0%} at {self.start}..{self.end - 1}"

    def to_json(self) -> dict:
        return {"start": self.start, "length": self.length, "key": self.key, "share": self.share}

    @classmethod
    def from_json(cls, d: object, where: str = "burst") -> Burst:
        d = _fields(where, d, {"start", "length", "key", "share"}, {"start", "length", "key", "share"})
        try:
            return cls(d["start"], d["length"], d["key"], d["share"])
        except ValueError as e:  # name where in the file
            raise ValueError(f"{where}: {e}") from None


@dataclass(frozen=True)
class MixSchedule:
    """How the mix of a stream changes over arrivals: phases (repeating), a daily cycle, bursts."""

    phases: tuple[Phase, ...] = ()  # in order; they repeat when the stream is longer than their sum
    cycle: DailyCycle | None = None  # multiplies the mix underneath
    bursts: tuple[Burst, ...] = ()  # applied last, in order (a later burst overrides an earlier one)
    base: dict[str, float] | None = None  # mix when there are no phases (None: uniform over the pool's keys)

    def __post_init__(self) -> None:
        for name in ("phases", "bursts"):
            v = getattr(self, name)
            if not isinstance(v, (list, tuple)):
                raise ValueError(f"MixSchedule.{name} must be a sequence, got {type(v).__name__}")
            object.__setattr__(self, name, tuple(v))
        for i, ph in enumerate(self.phases):
            if not isinstance(ph, Phase):
                raise ValueError(f"MixSchedule.phases[{i}] must be a Phase, got {type(ph).__name__}")
        for i, b in enumerate(self.bursts):
            if not isinstance(b, Burst):
                raise ValueError(f"MixSchedule.bursts[{i}] must be a Burst, got {type(b).__name__}")
        if self.cycle is not None and not isinstance(self.cycle, DailyCycle):
            raise ValueError(f"MixSchedule.cycle must be a DailyCycle or None, got {type(self.cycle).__name__}")
        if self.base is not None:
            if self.phases:
                raise ValueError("MixSchedule.base: give either phases or a base mix, not both")
            object.__setattr__(self, "base", _weights("MixSchedule.base", self.base))

    @property
    def phase_requests(self) -> int:
        """Arrivals in one pass over the phases (0 without phases)."""
        return sum(ph.requests for ph in self.phases)

    def named_keys(self) -> list[tuple[str, str]]:
        """(field, key) for every key the schedule names, e.g. ("phases[1].mix", "code")."""
        out = [(f"phases[{i}].mix", k) for i, ph in enumerate(self.phases) for k in ph.mix]
        out += [("base", k) for k in (self.base or {})]
        if self.cycle is not None:
            out += [("cycle.amplitude", k) for k in self.cycle.amplitude]
            out += [("cycle.offset", k) for k in self.cycle.offset]
        out += [(f"bursts[{i}].key", b.key) for i, b in enumerate(self.bursts)]
        return out

    def check(self, keys: Sequence[str], num_requests: int, key: str = "domain") -> None:
        """Raise ValueError naming the field when the schedule names a ``key`` (domain or dataset) that ``keys``
        lacks, or a burst lies outside a stream of ``num_requests`` arrivals."""
        have = set(keys)
        bad: dict[str, list[str]] = {}
        for where, k in self.named_keys():
            if k not in have:
                bad.setdefault(where, []).append(k)
        if bad:
            where, ks = next(iter(bad.items()))
            raise ValueError(f"MixSchedule.{where} names {key}s {sorted(set(ks))} that the pool lacks "
                             f"(it has {sorted(have)})")
        for i, b in enumerate(self.bursts):
            if b.end > num_requests:
                raise ValueError(f"MixSchedule.bursts[{i}]: arrivals {b.start}..{b.end - 1} lie outside the stream "
                                 f"of {num_requests} arrivals")

    def probabilities(self, keys: Sequence[str], t: np.ndarray) -> np.ndarray:
        """float64 [N, D]: the probability of each key (column order of ``keys`` [D]) at arrivals ``t`` [N]
        (arrival indices, 0-based). Each row sums to 1. Raises ValueError where the mix is zero for every key
        (a cycle with amplitude > 1 can switch all keys off)."""
        keys = list(keys)
        D = len(keys)
        if D == 0:
            raise ValueError("MixSchedule: the pool has no keys")
        t = np.asarray(t, np.float64).reshape(-1)
        col = {k: j for j, k in enumerate(keys)}
        if self.phases:
            mixes = np.zeros((len(self.phases), D))
            for i, ph in enumerate(self.phases):
                for k, v in ph.mix.items():
                    mixes[i, col[k]] = v
            mixes /= mixes.sum(axis=1, keepdims=True)
            ends = np.cumsum([ph.requests for ph in self.phases])
            which = np.searchsorted(ends, np.floor(t) % ends[-1], side="right")
            w = mixes[which]
        else:
            base = np.ones(D) if self.base is None else np.array([self.base.get(k, 0.0) for k in keys])
            w = np.broadcast_to(base / base.sum(), (len(t), D)).copy()
        if self.cycle is not None:
            w = np.clip(w * self.cycle.factor(keys, t), 0.0, None)
        s = w.sum(axis=1, keepdims=True)
        if (s <= 0).any():
            i = int(np.flatnonzero(s[:, 0] <= 0)[0])
            raise ValueError(f"MixSchedule: the mix is zero for every key at arrival {int(t[i])} (a cycle amplitude "
                             "> 1 switches all keys off there)")
        p = w / s
        for b in self.bursts if D > 1 else ():  # one key: every arrival is from it whatever the burst
            rows = (t >= b.start) & (t < b.end)
            if not rows.any():
                continue
            j = col[b.key]
            rest = p[rows].copy()
            rest[:, j] = 0.0
            rs = rest.sum(axis=1, keepdims=True)
            even = np.full(D, 1.0 / max(D - 1, 1))
            even[j] = 0.0
            rest = np.where(rs > 0, rest / np.where(rs > 0, rs, 1.0), even[None, :])
            q = (1.0 - b.share) * rest
            q[:, j] += b.share
            p[rows] = q
        return p

    def describe(self) -> str:
        parts = []
        if self.phases:
            parts.append("phases " + " -> ".join(f"{_mix_text(ph.mix)} x{ph.requests}" for ph in self.phases))
        elif self.base is not None:
            parts.append(f"mix {_mix_text(self.base)}")
        else:
            parts.append("uniform mix")
        if self.cycle is not None:
            parts.append(self.cycle.describe())
        if self.bursts:
            parts.append("bursts " + ", ".join(b.describe() for b in self.bursts))
        return "; ".join(parts)

    def to_json(self) -> dict:
        return {"format": SCHEDULE_FORMAT, "version": SCHEDULE_VERSION,
                "phases": [ph.to_json() for ph in self.phases],
                "cycle": None if self.cycle is None else self.cycle.to_json(),
                "bursts": [b.to_json() for b in self.bursts],
                "base": None if self.base is None else dict(self.base)}

    @classmethod
    def from_json(cls, d: object, where: str = "schedule") -> MixSchedule:
        d = _fields(where, d, {"format", "version", "phases", "cycle", "bursts", "base"}, set())
        if d.get("format", SCHEDULE_FORMAT) != SCHEDULE_FORMAT:
            raise ValueError(f"{where}: format {d['format']!r}, expected {SCHEDULE_FORMAT!r}")
        v = d.get("version", SCHEDULE_VERSION)
        if v != SCHEDULE_VERSION:
            raise ValueError(f"{where}: version {v!r}, this moeplace reads version {SCHEDULE_VERSION}")
        for name in ("phases", "bursts"):
            if not isinstance(d.get(name, []), list):
                raise ValueError(f"{where}.{name}: expected a list")
        parts = (tuple(Phase.from_json(x, f"{where}.phases[{i}]") for i, x in enumerate(d.get("phases", []))),
                 None if d.get("cycle") is None else DailyCycle.from_json(d["cycle"], f"{where}.cycle"),
                 tuple(Burst.from_json(x, f"{where}.bursts[{i}]") for i, x in enumerate(d.get("bursts", []))))
        try:
            return cls(*parts, d.get("base"))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


def default_phases(keys: list[str], requests_per_phase: int, share: float = 0.7) -> list[Phase]:
    """One phase per key, in the given order: ``share`` of the requests from that key, the rest spread evenly over
    the others (4 domains, share 0.7: 70 / 10 / 10 / 10)."""
    if len(keys) < 2:
        return [Phase(requests_per_phase, {d: 1.0 for d in keys})]
    rest = (1.0 - share) / (len(keys) - 1)
    return [Phase(requests_per_phase, {d: (share if d == top else rest) for d in keys}) for top in keys]


# --------------------------------------------------------------------------------------------------- pools


def dataset_of(source: np.ndarray) -> np.ndarray:
    """object [R]: the dataset part of each request's ``source`` (text before the first ``/``)."""
    return np.array([str(s).split("/", 1)[0] for s in source], dtype=object)


def subdomain_of(source: np.ndarray) -> np.ndarray:
    """object [R]: each request's ``source`` without a stream's ``" (drawn from request i)"`` suffix: the
    ``<domain>/<subdomain>`` label of a recorded prompt (``code/c``), or gpt-oss-20b's ``dataset/category``."""
    return np.array([str(s).split(DRAWN_FROM, 1)[0] for s in source], dtype=object)


def keys_of(requests: Requests, key: str = "domain") -> np.ndarray:
    """object [R]: each request's domain (``key="domain"``), dataset (``key="dataset"``) or sub-domain label
    (``key="subdomain"``, :func:`subdomain_of`)."""
    if key not in KEYS:
        raise ValueError(f"key {key!r}: expected one of {KEYS}")
    if key == "domain":
        return np.asarray(requests.domain, dtype=object)
    return dataset_of(requests.source) if key == "dataset" else subdomain_of(requests.source)


def grouped_order(keys: np.ndarray) -> np.ndarray:
    """int64 [R]: a stable permutation that puts requests of the same key together, keys in first-seen order."""
    first = {k: i for i, k in enumerate(dict.fromkeys(np.asarray(keys, dtype=object).tolist()))}
    return np.argsort(np.array([first[k] for k in np.asarray(keys, dtype=object).tolist()], np.int64), kind="stable")


def _resolve_length(schedule: MixSchedule, num_requests: int | None) -> int:
    if num_requests is None:
        if not schedule.phases:
            raise ValueError("num_requests: give the stream length (CLI: --stream-requests; the schedule has no "
                             "phases to take it from)")
        return schedule.phase_requests
    return _count("num_requests", num_requests, 1)


def order_pool(pool_keys: np.ndarray, schedule: MixSchedule, num_requests: int | None = None, seed: int = 0,
               key: str = "domain", replace: bool = True) -> np.ndarray:
    """int64 [N]: indices into the pool, in arrival order.

    pool_keys: [R] the key (domain or dataset; ``key`` names which, for messages) of each pool request.
    num_requests: N arrivals (None: one pass over the schedule's phases).
    For arrival i a key is drawn from ``schedule.probabilities(sorted keys, i)``, then a request of that key:
    uniformly with replacement, or (``replace=False``) the next one of the key's pool in a shuffled order that is
    reshuffled after each pass. The same ``seed`` gives the same indices on any machine."""
    pool_keys = np.asarray(pool_keys, dtype=object).reshape(-1)
    if len(pool_keys) == 0:
        raise ValueError("pool_keys: the pool is empty")
    N = _resolve_length(schedule, num_requests)
    _count("seed", seed, 0)
    keys = sorted(set(pool_keys.tolist()))
    schedule.check(keys, N, key)
    p = schedule.probabilities(keys, np.arange(N))  # [N, D]
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(p, axis=1)
    cdf[:, -1] = 1.0
    g = (cdf <= rng.random(N)[:, None]).sum(axis=1)  # [N]: first column whose cdf exceeds the draw
    code = np.searchsorted(np.array(keys, dtype=object), pool_keys)  # [R]: key index of each pool request
    members = np.argsort(code, kind="stable")  # pool indices grouped by key, table order inside a key
    sizes = np.bincount(code, minlength=len(keys))  # [D]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    if replace:
        j = np.minimum(np.floor(rng.random(N) * sizes[g]).astype(np.int64), sizes[g] - 1)
        return members[starts[g] + j].astype(np.int64)
    out = np.empty(N, np.int64)
    for d in range(len(keys)):
        at = np.flatnonzero(g == d)
        if not len(at):
            continue
        pool = members[starts[d]:starts[d] + sizes[d]]
        passes = -(-len(at) // len(pool))
        out[at] = np.concatenate([rng.permutation(pool) for _ in range(passes)])[:len(at)]
    return out


# --------------------------------------------------------------------------------------------------- traces


def request_rows(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(rows [T], starts [Rq + 1]): token row indices grouped by request in request-table order (by position
    inside a request); request r's rows are ``rows[starts[r]:starts[r + 1]]``. Raises ValueError for a token row
    whose request is not in the table."""
    req, tk = trace.requests, trace.tokens
    if tk is None:
        raise ValueError("needs a per-token trace; this one is counts-only")
    order = np.argsort(req.request_id, kind="stable")
    idx = np.searchsorted(req.request_id[order], tk.request_id)
    idx = np.minimum(idx, max(len(order) - 1, 0))
    if len(order) == 0 or (req.request_id[order][idx] != tk.request_id).any():
        raise ValueError("a token row names a request that is not in the request table")
    table_index = order[idx]
    rows = np.lexsort((tk.position, table_index))
    starts = np.searchsorted(table_index[rows], np.arange(len(req) + 1))
    return rows, starts


def take_requests(trace: Trace, pick: np.ndarray, meta: TraceMeta | None = None) -> Trace:
    """The requests ``pick`` [N] (table indices, repeats allowed) as a new in-memory trace in that order:
    request ids 0..N-1, token rows copied from each picked request, ``source`` = "<source> (drawn from request
    <id>)"."""
    req = trace.requests
    pick = np.asarray(pick, np.int64).reshape(-1)
    rows, starts = request_rows(trace)
    lens = starts[pick + 1] - starts[pick]  # [N]
    first = np.cumsum(lens) - lens  # [N]: where each arrival's rows begin in the output
    take = rows[np.repeat(starts[pick] - first, lens) + np.arange(int(lens.sum()))]
    tk = trace.tokens.select(take)
    tokens = TokenChunk(np.repeat(np.arange(len(pick), dtype=np.int64), lens), tk.position, tk.phase, tk.expert_ids,
                        tk.expert_weights)
    src = np.array([f"{s}{DRAWN_FROM}{int(r)})" for s, r in zip(req.source[pick].tolist(),
                                                                        req.request_id[pick].tolist(), strict=True)],
                   dtype=object)
    r = Requests(np.arange(len(pick), dtype=np.int64), req.domain[pick], src, req.prompt_len[pick],
                 req.gen_len[pick])
    return Trace(meta or trace.meta, r, tokens, None)


def stream_bytes(trace: Trace, num_requests: int, num_keys: int) -> float:
    """Peak bytes of a stream of ``num_requests`` arrivals drawn from ``trace`` over ``num_keys`` keys:
    :func:`order_pool`'s [N, D] probability tables and the token rows :func:`take_requests` copies (the trace's
    mean rows per request, each with its ids, weights and columns), plus each arrival's source text."""
    tk = trace.tokens
    rows = len(tk) / max(len(trace.requests), 1) if tk is not None else 0.0
    row = 21 + (tk.expert_ids[:1].nbytes + (0 if tk.expert_weights is None else tk.expert_weights[:1].nbytes)
                if tk is not None else 0)
    return float(num_requests) * (32 * max(num_keys, 1) + 256 + 2 * rows * row)


def stream_trace(trace: Trace, schedule: MixSchedule, num_requests: int | None = None, seed: int = 0,
                 key: str = "domain", replace: bool = True, where: str = "num_requests") -> Trace:
    """``trace`` re-ordered into a stream of ``num_requests`` arrivals following ``schedule`` over its domains
    (``key="domain"``) or datasets (``key="dataset"``): :func:`order_pool` picks the requests, whose token rows are
    copied as recorded. Returns an in-memory trace whose request table is the arrival order (fresh ids 0..N-1);
    ``meta.source`` says "stream of X (seed s; key; schedule)" and whether it is real or synthetic routing
    re-ordered; ``meta.extra["stream"]`` holds the seed, key and schedule JSON; ``synthetic`` is carried over.
    A stream that would not fit the memory budget (:func:`stream_bytes`) is refused first, naming ``where`` (the
    option or file its length came from)."""
    if trace.tokens is None:
        raise ValueError("stream_trace: needs a per-token trace; this one is counts-only")
    pool = keys_of(trace.requests, key)
    N = _resolve_length(schedule, num_requests)
    check_memory(stream_bytes(trace, N, len(set(pool.tolist()))), f"a stream of {N} arrivals", where)
    pick = order_pool(pool, schedule, N, seed, key, replace)
    m = trace.meta
    what = "synthetic routing re-ordered" if m.synthetic else "real routing re-ordered"
    source = (f"stream of {m.source or m.model} (seed {seed}; by {key}; {'with' if replace else 'without'} "
              f"replacement; {schedule.describe()}): {what}")
    extra = {**m.extra, "stream": {"seed": seed, "key": key, "replace": replace, "num_requests": N,
                                   "schedule": schedule.to_json(), "of": m.source or m.model}}
    meta = TraceMeta(**{**m.to_json(), "source": source, "extra": extra})
    return take_requests(trace, pick, meta)
