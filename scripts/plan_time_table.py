"""Print the markdown table of ``bench/plan_time.py`` results with figure markers (scripts/readme_figures.py fills
and checks every number from the result files).

Usage:
  python scripts/plan_time_table.py plan_time_decode plan_time_prefill_ds ...   # names under bench/results/
  python scripts/plan_time_table.py --split plan_time_decode ...   # where the time goes (multi-node settings)

One row per (workload, profile, phase) that the data fills: the pool it ran on (and the profile's own size), the
tokens of a full micro-batch, the strongest baseline and its layer time, the room the balanced bound leaves below
it (1 - eplb's balanced bound / baseline), and per strategy the ratio to the baseline with its 95% interval; joint's
gap closed, then the reachable bound (any placement within the slots, moeplace.simulate.bounds) and joint's share
of the gap to it. Settings the data cannot fill are listed after the table with their counts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def fig(name: str, path: str, fmt: str, value: float, scale: float | None = None) -> str:
    v = value * scale if scale is not None else value
    sc = f":{scale:g}" if scale is not None else ""
    return f"<!-- fig {name}:{path}:{fmt}{sc} -->{format(v, fmt)}<!-- /fig -->"


def table(names: list[str]) -> str:
    head = ("| workload | phase | profile | pool (profile's) | tokens / micro-batch | strongest baseline | baseline us "
            "| room to the balanced bound | eplb | activation-clusters | joint | joint gap closed | reachable bound us "
            "| joint gap closed (reachable) |")
    lines = [head, "|" + "---|" * 14]
    skipped = []
    for name in names:
        d = json.loads((RESULTS / f"{name}.json").read_text())
        for key, r in d["results"].items():
            base = f"results/{key}"
            cells = [r["workload"], r["phase"], r["profile"],
                     f"{r['cluster']} ({r['profile_nodes']} nodes)",
                     fig(name, f"{base}/tokens_per_microbatch", ",d", r["tokens_per_microbatch"]),
                     f"`{r['baseline']}`",
                     fig(name, f"{base}/baseline_layer_time_s", ".1f", r["baseline_layer_time_s"], 1e6)]
            e = r["strategies"].get("eplb")
            if e:
                room = 1 - e["bound_balanced_s"] / r["baseline_layer_time_s"]
                cells.append(f"{room:.0%} (eplb's bound "
                             + fig(name, f"{base}/strategies/eplb/bound_balanced_s", ".1f", e["bound_balanced_s"], 1e6)
                             + " us)")
            else:
                cells.append("-")
            for n in ("eplb", "activation-clusters", "joint"):
                b = r["strategies"].get(n)
                if not b:
                    cells.append("-")
                    continue
                p = f"{base}/strategies/{n}"
                mark = "" if b["decided"] else " ~"
                cells.append(fig(name, f"{p}/ratio_to_baseline", ".3f", b["ratio_to_baseline"]) + " ["
                             + fig(name, f"{p}/ci95/0", ".3f", b["ci95"][0]) + ", "
                             + fig(name, f"{p}/ci95/1", ".3f", b["ci95"][1]) + "]" + mark)
            j = r["strategies"].get("joint")
            cells.append(fig(name, f"{base}/strategies/joint/gap_closed", "+.2f", j["gap_closed"])
                         if j and j.get("gap_closed") is not None else "-")
            # the reachable bound (moeplace.simulate.bounds); result files from before it have none
            cells.append(fig(name, f"{base}/strategies/joint/bound_reachable_s", ".1f", j["bound_reachable_s"], 1e6)
                         if j and j.get("bound_reachable_s") is not None else "-")
            cells.append(fig(name, f"{base}/strategies/joint/gap_closed_reachable", "+.2f", j["gap_closed_reachable"])
                         if j and j.get("gap_closed_reachable") is not None else "-")
            lines.append("| " + " | ".join(cells) + " |")
        skipped += [f"`{k}`" for k in d.get("skipped", {})]
    out = "\n".join(lines)
    if skipped:
        out += ("\n\nNot filled by the data (fewer than 20 full micro-batches per split seed even on one node, or no "
                "data here; the counts are in the result files' `skipped`): " + ", ".join(skipped) + ".")
    return out


def split_table(names: list[str]) -> str:
    """Where the layer time goes, per multi-node setting: dispatch, expert and combine (µs per layer per
    micro-batch) and the inter-node imbalance (busiest GPU's inter-node sends over their mean per GPU) of the
    strongest baseline and of joint. Settings on one node (no inter-node sends) and result files from before
    the split are left out."""
    head = ("| workload | phase | profile | pool | strongest baseline: dispatch / expert / combine us "
            "| its inter-node imbalance | joint: dispatch / expert / combine us | joint's inter-node imbalance |")
    lines = [head, "|" + "---|" * 8]
    for name in names:
        d = json.loads((RESULTS / f"{name}.json").read_text())
        for key, r in d["results"].items():
            j = r["strategies"].get("joint")
            if not j or not j.get("time_split") or j["time_split"].get("inter_imbalance") is None:
                continue
            cells = [r["workload"], r["phase"], r["profile"], r["cluster"]]
            for who in ("baseline_time_split", "time_split"):
                p = f"results/{key}/strategies/joint/{who}"
                cells.append(" / ".join(fig(name, f"{p}/{part}_s", ".0f", j[who][f"{part}_s"], 1e6)
                                        for part in ("dispatch", "expert", "combine")))
                cells.append(fig(name, f"{p}/inter_imbalance", ".2f", j[who]["inter_imbalance"]) + "x")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--split"]:
        print(split_table(args[1:]))
    else:
        print(table(args))
