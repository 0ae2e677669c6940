"""Plan JSON format version 2: typed fields, byte-identical round trips for every strategy, version-1 plans load,
and every malformed plan is refused with the file, the field and the problem."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moeplace.placement import PLAN_FORMAT_VERSION, BalanceOutcome, Cluster, Fallback, Placement, Plan
from moeplace.placement.grouper import Grouper
from moeplace.plan import MOE_STRATEGIES, STRATEGIES, make_plan, workload_from_tokens
from moeplace.schema import SchemaError

FIXTURES = Path(__file__).parent / "fixtures"


def clustered_work(seed: int = 0, n_req: int = 16, L: int = 2, E: int = 8, K: int = 2):
    rng = np.random.default_rng(seed)
    rid, phase, ids = [], [], []
    for r in range(n_req):
        pref = np.arange((r % 2) * E // 2, (r % 2 + 1) * E // 2)
        for t in range(12):
            rid.append(r)
            phase.append(0 if t < 4 else 1)
            ids.append([rng.choice(pref if rng.random() < 0.8 else np.arange(E), K, replace=False)
                        for _ in range(L)])
    return workload_from_tokens(np.array(rid), np.array(phase, np.int8), np.array(ids, np.int16), E)


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    work = clustered_work()
    out = {}
    for name in MOE_STRATEGIES:
        kw = {"search_evals": 300, "iters": 2} if name == "joint" else {}
        out[name] = make_plan(name, work, Cluster(2, 2), 4, planned_on="test", **kw)
    return out


@pytest.mark.parametrize("name", list(MOE_STRATEGIES))
def test_round_trip_is_byte_identical(name, plans, tmp_path):
    plan = plans[name]
    text = json.dumps(plan.to_json())
    again = Plan.from_json(json.loads(text))
    assert json.dumps(again.to_json()) == text
    f = plan.save(tmp_path / "p.json")
    assert json.dumps(Plan.load(f).to_json()) == text
    d = json.loads(text)
    assert d["format_version"] == PLAN_FORMAT_VERSION == 2
    # the typed outcome never hides in extra
    assert not {"grouper", "fallback", "balance_floor", "allow_colocated", "num_redundant"} & set(d["extra"])


def test_grouping_strategies_carry_a_typed_grouper_that_rebuilds(plans):
    for name, s in ((n, STRATEGIES[n]) for n in MOE_STRATEGIES):
        plan = plans[name]
        # joint without evidence of a win deploys the baseline (round-robin homes, no grouper) and says so
        kept_baseline = name == "joint" and plan.fallback is not None
        assert (plan.grouper is not None) == (s.groups_requests and not kept_baseline), name
        if plan.grouper is not None:
            g = Grouper.from_json(plan.grouper.to_json())
            assert g.num_nodes == 2 and g.gpus_per_node == 2
            x = np.random.default_rng(1).random((5, 2, 8))
            back = Grouper.from_json(Plan.from_json(plan.to_json()).grouper.to_json())
            assert back.assign(x).tolist() == g.assign(x).tolist()


def test_joint_reports_its_floor_as_a_typed_outcome(plans):
    bytes_plan = make_plan("joint", clustered_work(), Cluster(2, 2), 4, objective="bytes", search_evals=300, iters=2)
    b = bytes_plan.balance
    assert isinstance(b, BalanceOutcome) and b.floor == 0.95 and b.achieved is not None
    assert b.met == (b.achieved >= 0.95)
    f = bytes_plan.fallback
    assert f is None or (f.used == "eplb" and "floor" in f.reason)
    t = plans["joint"]  # the time objective reports its cost model, and EPLB when it kept EPLB's plan
    assert t.cost_model is not None and t.cost_model.objective == "layer_time"
    assert t.fallback is None or (t.fallback.used == "eplb" and "EPLB" in t.fallback.reason)
    for name in ("linear", "eplb", "coactivation"):
        assert plans[name].balance is None and plans[name].fallback is None


def test_allow_colocated_replicas_survives_the_round_trip():
    p2l = np.array([[0, 0, 1, 1]])
    plan = Plan(Placement(p2l, 2, 2, allow_colocated_replicas=True), Cluster(1, 2))
    back = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert back.placement.allow_colocated_replicas
    d = plan.to_json()
    d["allow_colocated_replicas"] = False
    with pytest.raises(SchemaError, match="two replicas on GPU 0"):
        Plan.from_json(d, "p.json")


@pytest.mark.parametrize("name", ["joint", "eplb", "activation_clusters"])
def test_version_1_plans_written_by_38bf2ff_still_load(name):
    f = FIXTURES / f"plan_v1_{name}.json"
    old = json.loads(f.read_text())
    plan = Plan.load(f)
    assert old["format_version"] == 1
    np.testing.assert_array_equal(plan.placement.phy2log, old["phy2log"])
    assert plan.homes == {int(k): v for k, v in old["homes"].items()}
    assert plan.cluster == Cluster.from_json(old["cluster"])
    if "grouper" in old["extra"]:
        np.testing.assert_allclose(plan.grouper.weights, old["extra"]["grouper"]["weights"], rtol=1e-6)
        assert plan.grouper.round_size == old["extra"]["grouper"]["round_size"]
    else:
        assert plan.grouper is None
    if name == "joint":
        assert plan.balance == BalanceOutcome(old["extra"]["balance_floor"],
                                              old["extra"]["planning_balancedness"][-1])
        assert plan.fallback is None  # the fixture's joint met its floor
        assert plan.extra["history"] == old["extra"]["history"]
    assert "num_redundant" not in plan.extra
    # and it is written back as version 2
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()


def test_version_1_allow_colocated_and_fallback_map_to_typed_fields():
    plan = Plan.load(FIXTURES / "plan_v1_colocated.json")
    assert plan.placement.allow_colocated_replicas and plan.extra == {"note": "two replicas of expert 0 on GPU 0"}
    old = json.loads((FIXTURES / "plan_v1_joint.json").read_text())
    old["extra"]["fallback"] = "joint reached 0.9 < floor 0.95; used EPLB's placement"
    old["extra"]["planning_balancedness"] = [0.9, 0.93]
    p = Plan.from_json(old)
    assert p.fallback == Fallback("eplb", old["extra"]["fallback"])
    assert p.balance.achieved == 0.93 and not p.balance.met


def good_plan() -> dict:
    return json.loads((FIXTURES / "plan_v1_joint.json").read_text()) | {"format_version": 1}


def v2(d: dict) -> dict:
    return Plan.from_json(d).to_json()


def mutate(d: dict, path: str, value) -> dict:
    d = json.loads(json.dumps(d))
    keys = path.split(".")
    cur = d
    for k in keys[:-1]:
        cur = cur[int(k)] if isinstance(cur, list) else cur[k]
    last = keys[-1]
    if value is KeyError:
        del cur[last]
    elif isinstance(cur, list):
        cur[int(last)] = value
    else:
        cur[last] = value
    return d


BAD = [
    ("cluster.gpus_per_node", KeyError, "cluster.gpus_per_node: field required"),
    ("cluster.num_nodes", "2", "cluster.num_nodes: Input should be a valid integer"),
    ("cluster.num_nodes", None, "cluster.num_nodes"),
    ("cluster.num_nodes", True, "cluster.num_nodes"),
    ("cluster.num_nodes", 1.5, "cluster.num_nodes"),
    ("cluster.inter_bw", -1.0, "cluster.inter_bw: Input should be greater than 0"),
    ("extra", [], "extra: Input should be a valid dictionary"),
    ("extra", None, "extra: Input should be a valid dictionary"),
    ("phy2log.0.0", 2 ** 70, "phy2log[0][0]: Input should be less than or equal to"),
    ("phy2log.0.0", float("inf"), "phy2log[0][0]"),
    ("phy2log.0.0", 99, "expert id 99 out of range"),
    ("phy2log.1", [1, 2], "phy2log: rows have different lengths"),
    ("homes.0", "x", "homes.0: Input should be a valid integer"),
    ("homes.0", 9, "request 0 has home GPU 9"),
    ("num_experts", 0, "num_experts: Input should be greater than or equal to 1"),
    ("num_slots", 13, "num_slots: says 13"),
    ("format_version", 0, "format_version: unsupported plan version 0"),
    ("format_version", -1, "format_version: unsupported plan version -1"),
    ("format_version", 3, "unsupported plan version 3"),
    ("format_version", True, "unsupported plan version True"),
    ("format_version", KeyError, "format_version: field required"),
    ("surprise", 1, "surprise: unknown field"),
    ("grouper.weights.0.0", "w", "grouper.weights[0][0]"),
    ("grouper.gpus_per_node", 4, "grouper is for 2x4 GPUs"),
    ("balance.met", False, "balance.met: says False"),
    ("balance.floor", 1.5, "balance.floor: Input should be less than or equal to 1"),
]


@pytest.mark.parametrize("path,value,message", BAD, ids=[f"{p}={v!r}" for p, v, _ in BAD])
def test_malformed_v2_plans_name_the_file_and_field(path, value, message):
    good = v2(good_plan())
    if path.startswith("balance.met"):
        good["balance"]["achieved"] = 0.99
        value = False
    with pytest.raises(SchemaError) as ei:
        Plan.from_json(mutate(good, path, value), "p.json")
    msg = str(ei.value)
    assert msg.startswith("p.json: ") and message in msg and "\n" not in msg


def test_whole_floats_are_accepted_as_integers():
    d = mutate(v2(good_plan()), "cluster.num_nodes", 2.0)
    d["phy2log"][0] = [float(x) for x in d["phy2log"][0]]
    assert Plan.from_json(d).cluster.num_nodes == 2


def test_files_that_are_not_plans(tmp_path):
    (tmp_path / "inf.json").write_text('{"format_version": 2, "plan_seconds": Infinity}')
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    (tmp_path / "big.json").write_text('{"format_version": 1e999}')
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "dir.json").mkdir()
    for name, message in (("inf.json", "Infinity"), ("deep.json", "nested too deeply"),
                          ("big.json", "overflows"), ("bin.json", "not"), ("dir.json", "is a directory")):
        with pytest.raises(SchemaError, match=message) as ei:
            Plan.load(tmp_path / name)
        assert str(tmp_path / name) in str(ei.value)
    with pytest.raises(FileNotFoundError, match="no such plan file"):
        Plan.load(tmp_path / "missing.json")


def test_a_node_with_more_slots_than_experts_is_refused_before_planning():
    work = clustered_work()
    with pytest.raises(ValueError, match="num_redundant=40: .* at most 24 redundant"):
        make_plan("eplb", work, Cluster(2, 2), 40)
