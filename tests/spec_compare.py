"""Hold a :class:`moeplace.simulate.SimResult` to the specification in spec_simulator.py.

Shared by tests/test_simulate_spec.py and tests/test_simulate.py. The result is read through its public fields
and ``to_json()`` only; the aggregates of the JSON (sums, medians, ratios) are recomputed here from the spec's
per-micro-batch arrays, so they are checked as well.
"""

from __future__ import annotations

from statistics import median

import numpy as np
from spec_simulator import CLASSES, MODES, PHASES, merge_phases, phase_summary

DECODE_SHIFT = 32  # docs/SIMULATOR.md: decode micro-batch id = window << 32 | step


def balanced_kwargs(plan, rule: str) -> dict:
    """spec_simulate's keyword arguments for ``rule``: for a balanced rule, the code's public ``assign_slots`` as
    the chooser (the spec checks each choice for optimality with its own solver) and the default locality costs."""
    from moeplace.simulate import BALANCED_RULES, ReplicaCosts, assign_slots

    if rule not in BALANCED_RULES:
        return {}
    pl = plan.placement
    node = np.arange(pl.num_gpus) // plan.cluster.gpus_per_node
    c = ReplicaCosts()

    def choose(layer: int, homes: list[int], experts: list[list[int]], rule: str) -> np.ndarray:
        ex = np.array(experts, np.int64).reshape(len(homes), -1)
        return assign_slots(pl.phy2log[layer], pl.slot_gpu, node, np.array(homes, np.int64), ex, rule=rule)

    return {"choose": choose, "intra_cost": c.intra_cost, "inter_cost": c.inter_cost}


def close(a, b) -> bool:
    return bool(np.allclose(np.asarray(a, float), np.asarray(b, float), rtol=1e-9, atol=1e-15))


def microbatch_keys(phase: str, ids: np.ndarray) -> list:
    """The simulator's int64 micro-batch ids as the spec's keys."""
    if phase == "prefill":
        return [int(i) for i in ids]
    return [(int(i) >> DECODE_SHIFT, int(i) & ((1 << DECODE_SHIFT) - 1)) for i in ids]


def assert_phase_matches(got, spec: dict, phase: str) -> None:
    """got: a PhaseResult; spec: one phase of spec_simulate. Integers exactly, floats allclose."""
    assert microbatch_keys(phase, got.microbatch_ids) == spec["microbatches"], phase
    assert got.num_tokens == spec["num_tokens"]
    np.testing.assert_array_equal(got.pairs, spec["pairs"], err_msg=f"{phase} pairs")
    np.testing.assert_array_equal(got.load, spec["load"], err_msg=f"{phase} load")
    np.testing.assert_array_equal(got.local_pairs, spec["local"], err_msg=f"{phase} local pairs")
    np.testing.assert_array_equal(got.node_local_pairs, spec["node_local"], err_msg=f"{phase} node-local pairs")
    for m in MODES:
        np.testing.assert_array_equal(got.sends[m], spec["sends"][m], err_msg=f"{phase} sends {m}")
    sp = spec["per_microbatch"]
    missing = set(got.per_microbatch) - set(sp)
    assert not missing, f"per-micro-batch outputs the spec does not define: {sorted(missing)}"
    for name, x in got.per_microbatch.items():
        assert x.shape == sp[name].shape, (phase, name, x.shape, sp[name].shape)
        if sp[name].dtype.kind == "i":
            np.testing.assert_array_equal(x, sp[name], err_msg=f"{phase} per_microbatch {name}")
        else:
            np.testing.assert_allclose(x, sp[name], rtol=1e-9, atol=1e-15, err_msg=f"{phase} per_microbatch {name}")


def _additive(j: dict, x: np.ndarray) -> None:
    """j: {total, per_layer, median_microbatch, median_per_layer} of x [B, L]."""
    assert close(j["total"], x.sum()), (j["total"], x.sum())
    assert close(j["per_layer"], x.sum(0) if len(x) else np.zeros(x.shape[1]))
    assert close(j["median_microbatch"], median(x.sum(1).tolist()) if len(x) else 0.0)
    assert close(j["median_per_layer"], [median(col) for col in x.T.tolist()] if len(x) else np.zeros(x.shape[1]))


def assert_json_matches(j: dict, spec: dict) -> None:
    """j: one phase's keys of SimResult.to_json() (a phase, or the top level for both); spec: the spec's phase."""
    pm = spec["per_microbatch"]
    dispatch_send_bytes, combine_send_bytes = spec["dispatch_send_bytes"], spec["combine_send_bytes"]
    L, W = spec["load"].shape
    send_bytes = dispatch_send_bytes + combine_send_bytes
    assert j["num_tokens"] == spec["num_tokens"]
    assert j["num_microbatches"] == len(spec["microbatches"])
    assert j["num_pairs"] == int(spec["pairs"].sum())
    for m in MODES:
        prefix = "" if m == "per_gpu" else "two_hop_"
        for where in ("inter_node", "intra_node"):
            _additive(j[f"{prefix}{where}_bytes"], pm[f"{m}.{where}_sends"] * send_bytes)
        for where in CLASSES:
            _additive(j[f"{prefix}sends"][where], pm[f"{m}.{where}_sends"])
        msg = pm[f"{m}.max_message_sends"] * dispatch_send_bytes
        assert close(j[f"{prefix}max_peer_message_bytes"]["total"], msg.max() if len(msg) else 0.0)
        assert close(j[f"{prefix}max_peer_message_bytes"]["per_layer"], msg.max(0) if len(msg) else np.zeros(L))
        for key in ("", "_padded"):
            comm = pm[f"{m}.comm_time{key}"]
            _additive(j[f"{prefix}comm_time{key}_s"], comm)
            _additive(j[f"{prefix}layer_time{key}_s"], comm + pm["compute_time"])
        X = spec["sends"][m].sum(0)  # [W, W] summed over layers
        traffic = [[0.0 if s == d else X[s, d] * dispatch_send_bytes + X[d, s] * combine_send_bytes
                    for d in range(W)] for s in range(W)]
        assert close(j[f"{prefix}traffic_matrix_bytes"], traffic)
    _additive(j["compute_time_s"], pm["compute_time"])
    for k in ("layer_time", "dispatch_time", "combine_time", "expert_time", "memory_time"):
        _additive(j["kernel_time"][f"{k}_s"], pm[k])
    for kernel in ("nccl", "deepep-normal", "deepep-ll"):
        for part in ("dispatch_time", "combine_time"):
            _additive(j["kernel_time"][kernel][f"{part}_s"], pm[f"{kernel}.{part}"])
    summ = phase_summary(spec)
    assert close(j["balancedness"]["total"], summ["balancedness"])
    assert close(j["balancedness"]["per_layer"], summ["balancedness_per_layer"])
    assert close(j["imbalance_ratio"]["total"], summ["imbalance"])
    assert close(j["imbalance_ratio"]["per_layer"], summ["imbalance_per_layer"])
    bal_mb = [sum((p / W) / mx if mx else 1.0 for p, mx in zip(prow, mrow, strict=True)) / L
              for prow, mrow in zip(pm["pairs"].tolist(), pm["max_load"].tolist(), strict=True)]
    assert close(j["balancedness"]["median_microbatch"], median(bal_mb) if bal_mb else 1.0)
    assert close(j["local_activation_rate"]["total"], summ["lar"])
    assert close(j["local_activation_rate"]["per_layer"], summ["lar_per_layer"])
    assert close(j["node_local_rate"]["total"], summ["node_local_rate"])
    assert close(j["node_local_rate"]["per_layer"], summ["node_local_per_layer"])
    assert j["load_per_gpu"] == spec["load"].sum(0).tolist()


def assert_matches_spec(res, spec: dict) -> None:
    """res: a SimResult; spec: spec_simulate's answer for the same trace, plan and parameters."""
    j = res.to_json()
    for phase in PHASES:
        assert_phase_matches(getattr(res, phase), spec[phase], phase)
        assert_json_matches(j[phase], spec[phase])
    assert_json_matches(j, merge_phases(spec["prefill"], spec["decode"]))
