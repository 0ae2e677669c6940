"""Traces bigger than one machine (issue 26): wall time, tokens x layers per second and peak RSS of ``analyze`` and
``simulate`` at 1x, 10x and 100x a base trace, single process (the baseline a user runs today) against
``--engine ray`` with 2 local workers, outputs checked byte-identical; and the time of ``synth`` for 1,000
DeepSeek-V3 requests, with ``--synth-baseline REV`` against the whole command at an earlier revision (alternated, same
run, traces checked byte-identical).

Traces (all labelled SYNTHETIC in their metadata): the base is ``moeplace synth --preset deepseek-v3`` with
``--base-requests`` requests (L=58, E=256, k=8: 464 expert ids per token); the Nx trace is N tiles of the base's
shards with request ids shifted per tile (the same routing N times: enough to measure streaming, not new
statistics), written by 2 processes in parallel, shard by shard, and renamed into place when complete. The largest
size is cut to what ``--max-gb`` and the free disk allow; the result says so.

Each measured command is a real ``python -m moeplace`` process; its peak RSS is sampled every 0.1 s over the
process and all its descendants (the Ray path's driver, raylet and workers: ``tree_peak_rss_bytes`` sums them,
so shared pages are counted once per process; ``max_process_rss_bytes`` is the largest single process).
``cpu_seconds`` is the CPU time of the reaped descendants (``cpu_per_wall`` near 2 means both cores were used);
``loadavg_at_start`` the 1-minute load average when the command started (the machine is shared).

    python bench/scale.py [--base-requests 600] [--sizes 1,10,25,100] [--max-gb 20] [--work DIR] [--keep]

With ``--json`` the file is rewritten after every measured cell with ``"complete": false`` (a kill keeps what was
measured) and once more at the end with ``"complete": true``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from common import REPO, BenchRun, export_src, positive_int, positive_ints

from moeplace.io import atomic_write_json, make_temp_dir, remove_stale
from moeplace.trace.format import COMPRESSION
from moeplace.trace.reader import num_token_rows, read_meta, read_requests, shard_files
from moeplace.trace.types import META_FILE

SRC = REPO / "src"
MAX_REQUEST_BYTES = 64 << 20  # analyze --max-request-bytes: the per-request vectors' cap binds at 1x already


# ------------------------------------------------------------------------------------------------ measuring


def _tree_rss(root: int) -> tuple[int, int]:
    """(sum, max) of VmRSS in bytes over ``root`` and its descendants (read from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/statm") as fh:
                rss[int(d)] = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    todo, seen = [root], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo.extend(children.get(p, []))
    vals = [rss.get(p, 0) for p in seen]
    return sum(vals), max(vals, default=0)


def run_measured(args: list[str], cwd: Path, timeout: float = 7200, src: Path = SRC) -> dict:
    """Run ``python -m moeplace ARGS`` (the package under ``src``); wall seconds, peak RSS (tree sum and largest
    process), exit status."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    load = os.getloadavg()[0]
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "moeplace", *map(str, args)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = {"sum": 0, "max": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            s, m = _tree_rss(proc.pid)
            peak["sum"], peak["max"] = max(peak["sum"], s), max(peak["max"], m)
            stop.wait(0.1)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate(timeout=timeout)
    wall = time.perf_counter() - t0
    stop.set()
    th.join()
    if proc.returncode != 0:
        raise RuntimeError(f"moeplace {' '.join(map(str, args))} failed ({proc.returncode}): {err[-2000:]}")
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {"wall_seconds": wall, "tree_peak_rss_bytes": peak["sum"], "max_process_rss_bytes": peak["max"],
            "cpu_seconds": cpu, "cpu_per_wall": cpu / wall, "loadavg_at_start": load}


# ------------------------------------------------------------------------------------------------ traces


def _tile_shard(job: tuple[str, str, int, int, str]) -> int:
    """Write one tile's copy of one base shard with request ids shifted by ``shift`` (a worker process)."""
    base, dest, shard, shift, stem = job
    f = shard_files(base)[shard]
    rf = Path(str(f).replace(".tokens.parquet", ".requests.parquet"))
    for src, suffix in ((rf, ".requests.parquet"), (f, ".tokens.parquet")):  # requests first, as the writer does
        t = pq.read_table(src)
        i = t.schema.get_field_index("request_id")
        t = t.set_column(i, "request_id", pa.compute.add(t.column(i), pa.scalar(shift, pa.int64())))
        tmp = Path(dest) / f".{stem}{suffix}.tmp"
        pq.write_table(t, tmp, compression=COMPRESSION, write_page_checksum=True)
        os.replace(tmp, Path(dest) / f"{stem}{suffix}")
    return shard


def tiled_trace(base: Path, dest: Path, tiles: int, procs: int = 2) -> Path:
    """``tiles`` copies of ``base``'s shards, request ids shifted per tile, as one SYNTHETIC trace at ``dest``
    (built beside it, renamed when complete)."""
    remove_stale(dest, "new")  # a killed run's half-built copy
    if dest.exists():
        return dest
    meta = json.loads((base / META_FILE).read_text())
    n = len(shard_files(base))
    span = int(read_requests(base).request_id.max()) + 1
    tmp = make_temp_dir(dest, "new")
    jobs = [(str(base), str(tmp), s, k * span, f"part-{k * n + s:05d}") for k in range(tiles) for s in range(n)]
    with mp.get_context("spawn").Pool(procs) as pool:
        for _ in pool.imap_unordered(_tile_shard, jobs):
            pass
    meta["source"] = f"synthetic: {tiles} tiles of {meta['source']} (request ids shifted per tile); not real routing"
    meta["synthetic"] = True
    meta.setdefault("extra", {})["tiled"] = {"tiles": tiles, "base_requests": span}
    atomic_write_json(meta, tmp / META_FILE, indent=2)
    os.replace(tmp, dest)
    return dest


def trace_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.iterdir() if f.is_file())


# ------------------------------------------------------------------------------------------------ synth speed


def _tree_digest(folder: Path) -> str:
    """sha256 over a trace folder's files (names and bytes), to check two generators wrote the same trace."""
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(f.relative_to(folder).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def synth_ab(rev: str, work: Path, requests: int, reps: int = 2) -> dict:
    """The whole ``synth`` command at git revision ``rev`` (its ``src`` exported from git) and at this checkout,
    alternated ``reps`` times each after a small warm-up run of both (numba caches); median seconds, the ratio,
    and whether both wrote byte-identical traces."""
    old_src = export_src(rev, prefix="synth_old_")
    cmd = ["synth", "--preset", "deepseek-v3", "--requests"]
    runs: dict[str, list[dict]] = {"current": [], "previous": []}
    digests: dict[str, str] = {}
    for name, src in (("current", SRC), ("previous", old_src)):
        d = work / f"synth_warm_{name}.trace"
        run_measured([*cmd, 8, d, "--quiet"], work, src=src)
        shutil.rmtree(d, ignore_errors=True)
    for _ in range(reps):
        for name, src in (("current", SRC), ("previous", old_src)):
            d = work / f"synth_ab_{name}.trace"
            shutil.rmtree(d, ignore_errors=True)
            runs[name].append(run_measured([*cmd, requests, d, "--quiet"], work, src=src))
            digests[name] = _tree_digest(d)
            shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(old_src.parent, ignore_errors=True)
    med = {k: float(np.median([r["wall_seconds"] for r in v])) for k, v in runs.items()}
    return {"requests": requests, "previous_revision": rev, "reps": reps, "runs": runs,
            "current_median_seconds": med["current"], "previous_median_seconds": med["previous"],
            "speedup": med["previous"] / med["current"], "identical_trace": digests["current"] == digests["previous"],
            "target_seconds": 60}


# ------------------------------------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-requests", type=positive_int, default=600,
                    help="requests of the 1x trace (600: 0.2 GB, more than --max-request-bytes tracks)")
    ap.add_argument("--sizes", default="1,10,25,100")
    ap.add_argument("--max-gb", type=float, default=20.0, help="largest trace on disk, GB")
    ap.add_argument("--engines", default="local,ray")
    ap.add_argument("--commands", default="analyze,simulate")
    ap.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                    help="analyze --max-request-bytes: the per-request vectors' cap, so RSS is flat once it binds")
    ap.add_argument("--synth-requests", type=int, default=1000, help="0: skip the synth timing")
    ap.add_argument("--synth-baseline", default=None,
                    help="git revision of the previous generator: the whole synth command A/B against it")
    ap.add_argument("--work", default=None, help="folder for the traces (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the traces")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        sizes = positive_ints(args.sizes)
    except argparse.ArgumentTypeError as e:
        ap.error(f"--sizes: {e}")
    if args.work and Path(args.work).exists() and not Path(args.work).is_dir():
        ap.error(f"--work {args.work}: exists and is not a folder")
    run = BenchRun("scale", baseline="the single-process path (no --engine) on the same trace, same run")
    work = Path(args.work or tempfile.mkdtemp(prefix="moeplace-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    body: dict = {"params": vars(args), "notes": notes, "complete": False, "results": {}}
    per_size: list[dict] = []
    body["results"]["sizes"] = per_size

    def save() -> None:  # after every cell: a killed run keeps what it measured ("complete": false)
        if args.json:
            run.write(body, args.json)

    base = work / "base.trace"
    if not base.exists():
        t = run_measured(["synth", "--preset", "deepseek-v3", "--requests", args.base_requests, base, "--quiet"],
                         work)
        body["results"]["base_synth"] = {**t, "requests": args.base_requests}
    base_gb = trace_bytes(base) / 1e9
    free_gb = shutil.disk_usage(work).free / 1e9
    fit = [n for n in sizes if n * base_gb <= min(args.max_gb, 0.8 * free_gb) or n == 1]
    if fit != sizes:
        notes.append(f"sizes {sorted(set(sizes) - set(fit))}x left out: {base_gb:.2f} GB per 1x, --max-gb "
                     f"{args.max_gb}, {free_gb:.0f} GB free on {work}")
    L = read_meta(base).num_layers
    for n in fit:
        tr = base if n == 1 else tiled_trace(base, work / f"x{n}.trace", n)
        gb = trace_bytes(tr) / 1e9
        tokens = num_token_rows(tr)
        row: dict = {"size": n, "trace_gb": gb, "tokens": tokens, "shards": len(shard_files(tr)), "runs": {}}
        per_size.append(row)
        print(f"{n}x: {gb:.2f} GB, {tokens:,} tokens, {row['shards']} shards", flush=True)
        for cmd in args.commands.split(","):
            outs = {}
            runs = row["runs"].setdefault(cmd, {})
            for eng in args.engines.split(","):
                out = work / f"{cmd}-x{n}-{eng}.json"
                extra = [] if eng == "local" else ["--engine", eng]
                cli = (["analyze", tr, "--json", out, "--no-progress", "--max-request-bytes", args.max_request_bytes]
                       if cmd == "analyze" else ["simulate", tr, "--cluster", "4x8", "--json", out])
                m = run_measured([*cli, *extra], work)
                m["tokens_x_layers_per_second"] = tokens * L / m["wall_seconds"]
                first = per_size[0]["runs"].get(cmd, {}).get(eng) if per_size[0]["size"] == 1 else None
                if first:  # the flatness targets: this size's peaks over the 1x trace's, same command and engine
                    for k in ("tree_peak_rss_bytes", "max_process_rss_bytes"):
                        m[k.replace("_bytes", "_vs_1x")] = m[k] / first[k]
                runs[eng] = m
                outs[eng] = out
                save()
                print(f"  {cmd:8s} {eng:5s} {m['wall_seconds']:8.1f} s  {m['tokens_x_layers_per_second'] / 1e6:7.2f} "
                      f"M tok*layer/s  tree RSS {m['tree_peak_rss_bytes'] / 1e9:.2f} GB", flush=True)
            if "local" in outs and len(outs) > 1:
                ref = json.loads(outs["local"].read_text())
                for eng, p in outs.items():
                    got = json.loads(p.read_text())
                    if cmd == "analyze":
                        ref["meta"].pop("trace", None)
                        got["meta"].pop("trace", None)
                    runs[eng]["identical_to_local"] = got == ref
                    runs[eng]["speedup_vs_local"] = runs["local"]["wall_seconds"] / runs[eng]["wall_seconds"]
                save()
        if n != 1 and not args.keep:
            shutil.rmtree(tr)
    if args.synth_requests:
        d = work / "synth1000.trace"
        shutil.rmtree(d, ignore_errors=True)
        t = run_measured(["synth", "--preset", "deepseek-v3", "--requests", args.synth_requests, d, "--quiet"], work)
        body["results"]["synth"] = {**t, "requests": args.synth_requests, "target_seconds": 60,
                                    "issue_reported_seconds": 324}
        shutil.rmtree(d, ignore_errors=True)
    if args.synth_baseline and args.synth_requests:
        body["results"]["synth_ab"] = synth_ab(args.synth_baseline, work, args.synth_requests)
        save()
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    body["complete"] = True
    run.write(body, args.json)


if __name__ == "__main__":
    main()
