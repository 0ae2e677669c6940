"""Run an engine's own EPLB on a batch of loads: executed with an engine venv's python (scripts/interop_venvs.sh),
never with moeplace's. bench/eplb_next_window.py writes the jobs and reads the answers.

Usage: <engine venv>/bin/python bench/engine_eplb.py {vllm|sglang} JOBS.npz OUT.npz

JOBS.npz: ``params`` (int [J, 4]: slots, groups, nodes, GPUs per job) and ``load_<j>`` (float [L, E]) per job.
OUT.npz: ``p2l_<j>`` (int [L, P]) per job and ``meta`` (JSON text: engine, version, function, seconds per job).
Functions: vLLM's ``vllm.distributed.eplb.policy.default.DefaultEplbPolicy.rebalance_experts`` (no previous map),
SGLang's ``sglang.srt.eplb.eplb_algorithms.deepseek.rebalance_experts`` (``enable_hierarchical`` set the way
SGLang's ``EplbAlgorithm.deepseek`` does: when the groups divide among the nodes).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch


def engine_fn(name: str):
    """(fn(load [L, E] tensor, P, groups, N, W) -> phy2log tensor [L, P], version, qualified name)."""
    if name == "vllm":
        import vllm
        from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

        def fn(w, P, g, N, W):
            return DefaultEplbPolicy.rebalance_experts(w, P, g, N, W)
        return fn, vllm.__version__, "vllm.distributed.eplb.policy.default.DefaultEplbPolicy.rebalance_experts"
    if name == "sglang":
        import sglang
        from sglang.srt.eplb.eplb_algorithms import deepseek

        def fn(w, P, g, N, W):
            out = deepseek.rebalance_experts(w, P, g, N, W, enable_hierarchical=g % N == 0)
            return out[0] if isinstance(out, tuple) else out
        return fn, sglang.__version__, "sglang.srt.eplb.eplb_algorithms.deepseek.rebalance_experts"
    raise SystemExit(f"engine_eplb.py: unknown engine {name!r} (vllm or sglang)")


def main() -> int:
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    fn, version, qual = engine_fn(sys.argv[1])
    torch.set_num_threads(1)
    with np.load(sys.argv[2], allow_pickle=False) as z:
        params = z["params"]
        loads = [z[f"load_{j}"] for j in range(len(params))]
    out, secs = {}, []
    for j, (P, g, N, W) in enumerate(params.tolist()):
        t = time.perf_counter()
        p2l = fn(torch.from_numpy(np.ascontiguousarray(loads[j], np.float64)).float(), P, g, N, W)
        secs.append(time.perf_counter() - t)
        out[f"p2l_{j}"] = np.asarray(p2l.cpu().numpy(), np.int64)
    meta = {"engine": sys.argv[1], "version": version, "function": qual, "seconds": secs}
    np.savez(sys.argv[3], meta=np.array(json.dumps(meta)), **out)
    print(json.dumps({"engine": sys.argv[1], "version": version, "jobs": len(params)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
