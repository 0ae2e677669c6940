"""simulate over ranges of shards (moeplace.simulate.simulator.simulate_parts) gives the single-process result byte
for byte: every replica rule, decode windows and continuous batching, micro-batches straddling ranges."""

from __future__ import annotations

import json

import pytest

from moeplace.data import DATA_DIR
from moeplace.engine import LocalEngine
from moeplace.placement import Cluster
from moeplace.simulate import BatchConfig, simulate
from moeplace.simulate.config import RULES
from moeplace.simulate.simulator import plan_parts
from moeplace.trace import TraceError
from moeplace.trace.reader import shard_files

FG = DATA_DIR / "reference-fg.trace"


def _same(**kw) -> dict:
    a = simulate(FG, cluster=Cluster(2, 4), chunk_tokens=5000, **kw).to_json()
    b = simulate(FG, cluster=Cluster(2, 4), chunk_tokens=5000, engine=LocalEngine(), **kw).to_json()
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    return a


@pytest.mark.parametrize("rule", RULES)
def test_every_rule_small_microbatches(rule):
    j = _same(rule=rule, batching=BatchConfig(decode_batch=16, prefill_tokens=1000))
    assert j["decode"]["num_microbatches"] > 100


@pytest.mark.parametrize("batching", [BatchConfig(), BatchConfig(decode_running=64)])
def test_windows_and_continuous_batching(batching):
    # 256-request decode windows and a running set of 64 span many of the 65 shards: most rows straddle ranges
    _same(batching=batching, rule="balanced")


def test_ranges_cover_every_shard_once():
    parts = plan_parts(str(FG), 8)
    assert 6 <= len(parts) <= 9
    assert [i for p in parts for i in p.shards] == list(range(len(shard_files(FG))))


def test_small_budget_spills_and_gives_the_same_answer(monkeypatch, tmp_path):
    # 64M: a 4 MB in-memory buffer, so the metrics of these 33,088 decode micro-batches go to spill files
    import moeplace.simulate.simulator as sim

    kw = dict(cluster=Cluster(2, 4), batching=BatchConfig(decode_batch=4, prefill_tokens=64))
    with monkeypatch.context() as m:
        m.setattr(sim, "SPILL_BYTES", 1 << 40)  # everything in memory
        ref = simulate(FG, **kw)
    assert not ref.decode.per_microbatch.spilled
    monkeypatch.setenv("MOEPLACE_MEMORY_BUDGET", "64M")  # the trace itself streams in far less
    monkeypatch.setenv("MOEPLACE_SPILL_DIR", str(tmp_path))
    res = simulate(FG, **kw)
    assert res.decode.per_microbatch.spilled
    assert list(tmp_path.iterdir())  # the spill folder, while the result lives
    assert json.dumps(res.to_json(), sort_keys=True) == json.dumps(ref.to_json(), sort_keys=True)
    for k in ("layer_time", "pairs", "per_gpu.inter_node_sends"):  # whole metrics read back in micro-batch order
        assert (res.decode.per_microbatch[k] == ref.decode.per_microbatch[k]).all()
    del res
    import gc

    gc.collect()
    assert not list(tmp_path.iterdir())  # removed with the result


def test_result_memory_is_checked_before_routing(monkeypatch):
    monkeypatch.setenv("MOEPLACE_MEMORY_BUDGET", "2M")  # less than the metrics' in-memory part needs
    with pytest.raises(TraceError, match="per-micro-batch metrics"):
        simulate(FG, cluster=Cluster(2, 4), batching=BatchConfig(decode_batch=4, prefill_tokens=64))



def test_route_groups_are_whole_microbatches_within_the_bound():
    import numpy as np

    from moeplace.simulate.simulator import route_groups

    rng = np.random.default_rng(3)
    mb = rng.integers(0, 40, 500)  # rows of 40 micro-batches in a shuffled (trace) order
    sizes = np.bincount(mb)
    for cap in (1, 7, 30, 100, 499, 500):
        groups = route_groups(mb, cap)
        flat = np.concatenate(groups)
        assert sorted(flat.tolist()) == list(range(len(mb)))  # every row once
        seen: list[int] = []
        for g in groups:
            ids = np.unique(mb[g])
            assert all(int((mb[g] == i).sum()) == sizes[i] for i in ids)  # whole micro-batches
            assert len(g) <= cap or len(ids) == 1  # within the bound, or one micro-batch alone
            for i in ids:  # rows of a micro-batch keep their order
                assert (np.diff(g[mb[g] == i]) > 0).all()
            seen += ids.tolist()
        assert seen == sorted(seen) == list(np.unique(mb))  # groups in micro-batch id order
        if cap >= 500:
            assert len(groups) == 1


def test_small_route_groups_give_the_same_answer(monkeypatch):
    # many decode micro-batches complete at once when a window's last request is read; routing them in groups of a
    # few rows must not change a bit of the result
    import moeplace.simulate.simulator as sim

    kw = dict(cluster=Cluster(2, 4), chunk_tokens=5000, batching=BatchConfig(decode_batch=16, prefill_tokens=1000))
    ref = json.dumps(simulate(FG, **kw).to_json(), sort_keys=True)
    monkeypatch.setattr(sim, "ROUTE_ROWS", 37)
    got = json.dumps(simulate(FG, **kw).to_json(), sort_keys=True)
    assert got == ref


@pytest.mark.parametrize("batching", [BatchConfig(decode_batch=16, prefill_tokens=1000),
                                      BatchConfig(decode_running=64)])
def test_each_microbatch_has_one_owner_that_reads_all_its_shards(batching):
    # the owner of a micro-batch is the range holding its first row; it must read on to the last shard with a row
    # of it, and no other range may route it (which shards hold which micro-batch: from each shard's rows here)
    import numpy as np

    from moeplace.simulate.batching import build_layout, microbatch_ids, rows_of
    from moeplace.simulate.simulator import own_microbatches, part_microbatches
    from moeplace.trace.reader import iter_light_columns, read_requests
    from moeplace.trace.types import DECODE, PREFILL

    req = read_requests(FG)
    lay = build_layout(str(FG), req, np.zeros(len(req), np.int64), batching)
    where: dict[tuple[int, int], list[int]] = {}
    for s in range(len(shard_files(FG))):
        for rid, pos, ph in iter_light_columns(str(FG), shards=[s]):
            mb = microbatch_ids(lay, rows_of(lay, rid), pos, ph)
            for key in {(int(p), int(m)) for p, m in zip(ph.tolist(), mb.tolist(), strict=True)}:
                where.setdefault(key, []).append(s)
    parts = plan_parts(str(FG), 8)
    owned = own_microbatches(parts, lay, [x for p in parts for x in part_microbatches(p, lay)])
    seen: dict[tuple[int, int], int] = {}
    for k, part in enumerate(owned):
        assert part.shards == parts[k].shards and part.read_to >= part.shards[-1]
        for p, ids in zip((PREFILL, DECODE), part.owned, strict=True):
            assert (np.diff(ids) > 0).all()
            for m in ids.tolist():
                assert (p, m) not in seen  # one owner
                seen[(p, m)] = k
                assert min(where[(p, m)]) in part.shards and max(where[(p, m)]) <= part.read_to
    assert set(seen) == set(where)  # every micro-batch with a row has an owner
    straddling = sum(1 for v in where.values() if len(set(v)) > 1)
    assert straddling > 10  # the case that matters occurs: micro-batches whose rows lie in several shards
