"""Plot bench/scale.py's curve: wall time and peak RSS against trace size, one process and Ray (2 local workers),
for ``analyze`` and ``simulate``, from the result file only (every point is a measured cell; a size whose cell is
missing, e.g. a run stopped early, is left out of that line).

    python scripts/plot_scale.py                                   # bench/results/scale.json -> docs/scale.png
    python scripts/plot_scale.py --json other.json --out other.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STYLE = {("analyze", "local"): ("tab:blue", "-"), ("analyze", "ray"): ("tab:blue", "--"),
         ("simulate", "local"): ("tab:orange", "-"), ("simulate", "ray"): ("tab:orange", "--")}


def curves(result: dict) -> dict[tuple[str, str], list[tuple[float, float, float]]]:
    """(command, engine) -> [(trace GB, wall seconds, peak tree RSS GB)] over the measured sizes, smallest first."""
    out: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for row in sorted(result["results"]["sizes"], key=lambda r: r["trace_gb"]):
        for cmd, engines in row["runs"].items():
            for eng, m in engines.items():
                out.setdefault((cmd, eng), []).append(
                    (row["trace_gb"], m["wall_seconds"], m["tree_peak_rss_bytes"] / 1e9))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "scale.json")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "scale.png")
    args = ap.parse_args(argv)
    from moeplace.io import OutputError, check_output_path, input_output_clash

    clash = input_output_clash([("--out", args.out)], [("--json", args.json)])
    try:
        if clash:
            raise OutputError(clash)
        check_output_path(args.out, "--out")
    except OutputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = json.loads(args.json.read_text())
        lines = curves(result)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: {args.json}: not a bench/scale.py result ({e.__class__.__name__}: {e})", file=sys.stderr)
        return 2
    if not lines:
        print(f"error: {args.json}: no measured cell to plot", file=sys.stderr)
        return 2

    import matplotlib

    from moeplace.io import atomic_write_with

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=100)
    for (cmd, eng), pts in sorted(lines.items()):
        color, ls = STYLE.get((cmd, eng), ("gray", ":"))
        gb, wall, rss = zip(*pts, strict=True)
        label = f"{cmd}, {'one process' if eng == 'local' else 'Ray, 2 workers'}"
        ax_t.plot(gb, wall, ls, marker="o", ms=4, color=color, label=label)
        ax_m.plot(gb, rss, ls, marker="o", ms=4, color=color, label=label)
    sizes = sorted({p[0] for pts in lines.values() for p in pts})
    for ax in (ax_t, ax_m):
        ax.set_xscale("log")
        ax.set_xticks(sizes, [f"{g:.1f}" for g in sizes])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("trace on disk (GB, SYNTHETIC DeepSeek-V3-shaped)")
        ax.grid(alpha=0.3, which="both")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("wall seconds")
    ax_m.set_ylabel("peak RSS, process tree (GB)")
    ax_m.set_ylim(bottom=0)
    ax_t.legend(fontsize=8)
    commit = (result.get("git_commit") or "?")[:7]
    done = "" if result.get("complete", True) else ", run incomplete"
    fig.suptitle(f"bench/scale.py at {commit} on {result.get('cpu_count')} cores{done}", fontsize=9)
    fig.tight_layout()
    atomic_write_with(args.out, lambda tmp: fig.savefig(tmp, format="png"), "--out")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
