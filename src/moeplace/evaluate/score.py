"""Score a plan on held-out requests with the simulator: the only place where a plan meets requests it never saw.

Shape legend: L = MoE layers, B = micro-batches.
"""

from __future__ import annotations

from moeplace.evaluate.windows import Windows, held_out_homes, scoring_trace
from moeplace.placement import Plan
from moeplace.simulate import DEFAULT_RULE, BatchConfig, CostConfig, SimResult, simulate
from moeplace.simulate.result import layer_time_per_microbatch_s, layer_time_us_per_microbatch


def sim_metrics(res_json: dict, base_bytes: float | None, prefill_json: dict | None = None) -> dict:
    """The compare row from a simulator PhaseResult JSON (decode phase) and, when given, the prefill phase's."""
    inter = res_json["inter_node_bytes"]["total"]
    L = len(res_json["balancedness"]["per_layer"])
    B = max(res_json["num_microbatches"], 1)
    return {
        "decode_layer_time_s": layer_time_per_microbatch_s(res_json),
        "prefill_layer_time_s": layer_time_per_microbatch_s(prefill_json),
        # the same two times in µs under the key simulate and run-ep use (docs/SIMULATOR.md, "Units")
        "layer_time_us_per_microbatch": layer_time_us_per_microbatch({"prefill": prefill_json, "decode": res_json}),
        "inter_node_bytes": inter,
        "inter_node_bytes_vs_linear": (inter / base_bytes) if base_bytes else float("nan"),
        "median_microbatch_inter_node_bytes": res_json["inter_node_bytes"]["median_microbatch"],
        "balancedness": res_json["balancedness"]["total"],
        "balancedness_median_microbatch": res_json["balancedness"]["median_microbatch"],
        "imbalance_ratio": res_json["imbalance_ratio"]["total"],
        "max_per_peer_bytes": res_json["max_peer_message_bytes"]["total"],
        "median_max_per_peer_bytes": res_json["max_peer_message_bytes"]["median_microbatch"],
        "layer_time_s": res_json["layer_time_s"]["total"] / (B * L),
        "layer_time_padded_s": res_json["layer_time_padded_s"]["total"] / (B * L),
        "local_activation_rate": res_json["local_activation_rate"]["total"],
        "node_local_rate": res_json["node_local_rate"]["total"],
        "two_hop_inter_node_bytes": res_json["two_hop_inter_node_bytes"]["total"],
    }


def score_plan_phases(plan: Plan, windows: Windows, cost: CostConfig | None = None,
                      batching: BatchConfig | None = None, rule: str = DEFAULT_RULE) -> SimResult:
    """Simulate ``plan`` on the held-out window's scored rows (prefill and decode, the window's arrival order)
    with the replica ``rule``; held-out requests get homes from the plan's grouper, else round-robin."""
    homes = held_out_homes(plan, windows.held, windows.held_signal)
    ev = Plan(plan.placement, plan.cluster, homes, plan.strategy)
    return simulate(scoring_trace(windows.held, windows.held_signal), ev, cost=cost, batching=batching, rule=rule)


def score_plan(plan: Plan, windows: Windows, cost: CostConfig | None = None,
               batching: BatchConfig | None = None, rule: str = DEFAULT_RULE) -> dict:
    """The decode PhaseResult JSON of :func:`score_plan_phases`."""
    return score_plan_phases(plan, windows, cost, batching, rule).decode.to_json()


def planning_balance(plan: Plan, windows: Windows) -> float:
    """Balancedness of ``plan`` replayed by the simulator on the planning window's traffic rows, with its homes."""
    tr = scoring_trace(windows.plan, windows.plan_work.admission_rows)
    ev = Plan(plan.placement, plan.cluster, plan.homes, plan.strategy)
    return simulate(tr, ev).decode.to_json()["balancedness"]["total"]


