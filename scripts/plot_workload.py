"""Plot the domain mix over time of the documented example stream (docs/WORKLOADS.md).

The example: the bundled reference trace's 1,000 requests (real routing of the reference model, 4 domains) ordered
into one day at 500 requests an hour (12,000 arrivals, seed 0): code-heavy and chat-heavy hours alternate, a daily
cycle moves chat up in the (stream's) morning and code up in the evening, and a math burst takes half of the
arrivals for 30 minutes at 14:00. The plot shows the schedule's probability of each domain (lines) and the share
drawn in each 15-minute bin (dots).

    python scripts/plot_workload.py                       # writes docs/workload_mix.png
    python scripts/plot_workload.py --out mix.png --seed 3
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from moeplace.operate.workloads import Burst, DailyCycle, MixSchedule, Phase, order_pool
from moeplace.trace import read_requests

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "src" / "moeplace" / "data" / "reference-default.trace"
RATE = 500  # requests per hour
HOURS = 24


def example_schedule(rate: int = RATE) -> MixSchedule:
    """The example of docs/WORKLOADS.md: alternating code-heavy and chat-heavy hours, a daily cycle, a burst."""
    code_hour = Phase(rate, {"code": 0.55, "chat": 0.15, "general": 0.15, "math": 0.15})
    chat_hour = Phase(rate, {"chat": 0.55, "code": 0.15, "general": 0.15, "math": 0.15})
    cycle = DailyCycle.from_hours(HOURS, rate, {"chat": 0.6, "code": 0.6}, {"code": 0.5})
    burst = Burst(14 * rate, rate // 2, "math", 0.5)
    return MixSchedule(phases=(code_hour, chat_hour), cycle=cycle, bursts=(burst,))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "workload_mix.png")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pool = read_requests(REFERENCE).domain
    sched = example_schedule()
    N = HOURS * RATE
    idx = order_pool(pool, sched, N, seed=args.seed)  # [N] indices into the reference trace's requests
    keys = sorted(set(pool.tolist()))
    p = sched.probabilities(keys, np.arange(N))  # [N, D]
    hours = np.arange(N) / RATE
    bin_n = RATE // 4
    drawn = pool[idx].reshape(-1, bin_n)
    mid = (np.arange(drawn.shape[0]) + 0.5) * bin_n / RATE

    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=100)
    for j, k in enumerate(keys):
        line, = ax.plot(hours, p[:, j], lw=1.2, label=k)
        ax.plot(mid, (drawn == k).mean(axis=1), ".", ms=3.5, color=line.get_color())
    ax.set_xlim(0, HOURS)
    ax.set_ylim(0, 1)
    ax.set_xticks(range(0, HOURS + 1, 2))
    ax.set_xlabel(f"hour of the stream ({RATE} requests/h; {N:,} arrivals)")
    ax.set_ylabel("share of arrivals")
    ax.set_title(f"reference-default.trace re-ordered (real routing, seed {args.seed}): "
                 "lines = schedule, dots = drawn per 15 min", fontsize=9)
    ax.legend(loc="upper right", fontsize=8, ncol=4)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"{args.out}: {sched.describe()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
