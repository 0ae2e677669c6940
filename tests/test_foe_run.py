"""FoE placement (``plan --strategy foe``) and FoE execution (``run-ep`` on an FoE trace): real processes, outputs
against a one-process MoE, bytes against the simulator's FoE replay and the closed forms of docs/MODEL.md."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from moeplace.placement import Cluster, Placement, Plan
from moeplace.placement.foe import FoeLayout, ring_chunks, ring_send_rows, ring_steps
from moeplace.plan import make_plan
from moeplace.plan.base import workload_from_tokens
from moeplace.run.foe_replay import foe_batches, foe_replay
from moeplace.run.replay import ReplayConfig, reference_outputs, select_window
from moeplace.simulate import BatchConfig
from moeplace.simulate.synth import SynthConfig, generate_batches
from moeplace.trace.reader import read_meta
from moeplace.trace.types import Requests, TokenChunk, Trace
from moeplace.trace.writer import write_trace


def foe_trace(H: int, requests: int = 24, seed: int = 3, preset: str = "gpt-oss-20b") -> Trace:
    """A synthetic FoE-structured trace (labelled synthetic by synth), meta.foe_groups = H."""
    cfg = SynthConfig(num_requests=requests, prompt_len=12, gen_len=6, foe_groups=H, seed=seed, calibrate=False)
    meta, it = generate_batches(preset, cfg)
    batches = list(it)
    rid, pos, ph, ids = (np.concatenate([b[1][i] for b in batches]) for i in range(4))
    pl, gl = (np.concatenate([b[0][k] for b in batches]).astype(np.int32) for k in ("prompt_len", "gen_len"))
    n = len(pl)
    req = Requests(np.arange(n), np.array(["code", "chat"] * (n // 2) + ["code"] * (n % 2), object),
                   np.array([""] * n, object), pl, gl)
    meta = dataclasses.replace(meta, foe_groups=H, num_layers=meta.num_layers)
    return Trace(meta, req, TokenChunk(rid, pos, ph, ids[:, :, :]))


def small(tr: Trace, layers: int = 3) -> Trace:
    """The first ``layers`` MoE layers only (keeps the real-process runs short)."""
    tk = tr.tokens
    meta = dataclasses.replace(tr.meta, num_layers=layers, moe_layer_map=None)
    return Trace(meta, tr.requests, TokenChunk(tk.request_id, tk.position, tk.phase, tk.expert_ids[:, :layers]))


# ------------------------------------------------------------------------------------------------ layout, ring


@pytest.mark.parametrize("H,N,G", [(2, 2, 2), (2, 1, 4), (4, 2, 2), (4, 1, 2), (8, 2, 4), (2, 2, 4)])
def test_layout_against_its_definition(H, N, G):
    W = N * G
    lay = FoeLayout(H, W, G)
    E = 32
    S = E // W
    for g in range(W):
        experts = set(range(g * S, (g + 1) * S))
        groups = {e // (E // H) for e in experts}
        assert groups == set(lay.gpu_groups(g))  # GPU g's slots hold exactly its groups' experts
        blk = lay.block(g)
        assert all(set(lay.gpu_groups(x)) == groups for x in blk)  # a block shares its groups ...
        assert len({x // G for x in blk}) == 1  # ... and lies in one node
        ring = lay.ring(g)
        covered = sorted(h for x in ring for h in lay.gpu_groups(x))
        assert covered == list(range(H))  # a ring holds every group once
        assert len(ring) == min(W, H) and all(lay.ring_index(x) == lay.ring_index(g) for x in ring)


def test_layout_refuses_a_group_across_nodes():
    with pytest.raises(ValueError, match="one node"):
        FoeLayout(2, 4, 1)  # 4x1: a group would span 2 single-GPU nodes
    with pytest.raises(ValueError, match="divide"):
        FoeLayout(3, 4, 2)


@pytest.mark.parametrize("rows,p", [(0, 2), (1, 2), (7, 2), (10, 4), (13, 3), (5, 8)])
def test_ring_schedule(rows, p):
    chunks = ring_chunks(rows, p)
    assert chunks.sum() == rows and chunks.max() - chunks.min() <= 1
    # each step moves every chunk once (a permutation), so the whole ring sends 2(p-1) * rows rows
    for _, c in ring_steps(p):
        assert sorted(c.tolist()) == list(range(p))
    assert ring_send_rows(rows, p).sum() == 2 * (p - 1) * rows
    # after the reduce steps, position j has received every other position's share of chunk (j+1) % p
    held = {j: {j: {j}} for j in range(p)}  # held[j][chunk] = positions whose contribution j has summed
    held = {j: {c: {j} for c in range(p)} for j in range(p)}
    for stage, c in ring_steps(p):
        if stage != "reduce":
            break
        new = {j: {k: set(v) for k, v in held[j].items()} for j in range(p)}
        for j in range(p):
            new[(j + 1) % p][int(c[j])] |= held[j][int(c[j])]
        held = new
    assert all(held[j][(j + 1) % p] == set(range(p)) for j in range(p))


# ------------------------------------------------------------------------------------------------ plan --strategy foe


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeplace", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def foe2_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("foe") / "foe2.trace"
    write_trace(d, small(foe_trace(2)))
    return d


def test_plan_foe_cli(foe2_dir, tmp_path):
    out = tmp_path / "p.json"
    r = run_cli("plan", str(foe2_dir), "--strategy", "foe", "--cluster", "2x2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    plan = Plan.load(out)
    assert plan.foe_groups == 2 and json.loads(out.read_text())["foe_groups"] == 2
    assert (plan.placement.phy2log == np.arange(32)).all()
    assert set(plan.homes.values()) <= {0, 1}  # ring indices of block 0
    assert Plan.from_json(json.loads(out.read_text())).to_json() == plan.to_json()
    # refusals, one line each, exit 2
    for args, want in ((["--cluster", "4x1"], "one node"), (["--cluster", "2x2", "--redundant", "4"], "redundant")):
        r = run_cli("plan", str(foe2_dir), "--strategy", "foe", *args, "--out", str(tmp_path / "x.json"))
        assert r.returncode == 2 and want in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_plan_foe_refuses_a_plain_moe_trace(tmp_path):
    tr = small(foe_trace(2))
    plain = Trace(dataclasses.replace(tr.meta, foe_groups=1), tr.requests, tr.tokens)
    write_trace(tmp_path / "moe.trace", plain)
    r = run_cli("plan", str(tmp_path / "moe.trace"), "--strategy", "foe", "--cluster", "2x2", "--out",
                str(tmp_path / "p.json"))
    assert r.returncode == 2 and "plain" in r.stderr and "Traceback" not in r.stderr


def test_ring_indices_balance_tokens():
    tr = foe_trace(2, requests=40)
    tk = tr.tokens
    work = dataclasses.replace(workload_from_tokens(tk.request_id, tk.phase, tk.expert_ids, 32), foe_groups=2)
    plan = make_plan("foe", work, Cluster(1, 8))  # W=8 > H=2: block of 4, rings 0..3
    ring = plan.home_of(work.request_ids)
    tokens = np.bincount(work.token_request, minlength=work.num_requests)
    per_ring = np.bincount(ring, weights=tokens, minlength=4)
    assert per_ring.max() - per_ring.min() <= tokens.max()  # greedy largest-first: within one request


# ------------------------------------------------------------------------------------------------ execution


CASES = [("2x2", 2), ("1x2", 4), ("2x2", 4), ("1x4", 2)]  # W > H across nodes; W < H; W = H; W > H in one node


@pytest.mark.parametrize("spec,H", CASES)
def test_foe_run_matches_reference_and_simulator(spec, H):
    from moeplace.run.foe_replay import summarize_foe
    from moeplace.run.replay import replay_cost
    from moeplace.simulate.foe import replay_foe

    tr = small(foe_trace(H))
    cluster = Cluster.parse(spec)
    tk = tr.tokens
    work = dataclasses.replace(workload_from_tokens(tk.request_id, tk.phase, tk.expert_ids, 32), foe_groups=H)
    plan = make_plan("foe", work, cluster)
    batching = BatchConfig(decode_batch=16, prefill_tokens=64)
    cfg = ReplayConfig(hidden=16, repeats=1, return_outputs=True, timeout=180)
    sub, rows = select_window(tr, plan, batching, "decode", 2)
    batches = foe_batches(sub, rows, plan)
    res = foe_replay(plan, batches, cfg)
    lay = FoeLayout(H, cluster.world_size, cluster.gpus_per_node)
    for b, mb in enumerate(batches):
        ref = reference_outputs(mb, b, 32, cfg)  # [T, L, H]: one process, all K experts of every token
        seen = np.zeros(len(mb), int)
        for rank_out in res.outputs:
            idx, got = rank_out[b]
            np.testing.assert_allclose(got, ref[idx], rtol=1e-4, atol=1e-4)
            seen[idx] += 1
        assert (seen == lay.ring_size).all()  # every token ends on every member of its ring
    m = summarize_foe(res)
    p = replay_foe(sub, rows, plan, replay_cost(cfg), batching)
    for k in ("inter_node_bytes", "intra_node_bytes", "allreduce_inter_node_bytes", "allreduce_intra_node_bytes"):
        assert m[k]["total"] == p[k]["total"], k
    T, L = sum(len(r) for r in rows), tr.meta.num_layers
    ar = m["allreduce_inter_node_bytes"]["total"] + m["allreduce_intra_node_bytes"]["total"]
    assert ar == 2 * (lay.ring_size - 1) * T * L * 16 * 4  # closed form: 2(p-1) vectors per token over a ring
    if cluster.world_size // H <= cluster.gpus_per_node:
        assert m["inter_node_bytes"]["total"] == 0  # each group inside one node: the all-to-all stays there
    if cluster.world_size <= H:
        assert m["intra_node_bytes"]["total"] == 0  # whole groups per GPU: no all-to-all at all
    if spec == "2x2":
        assert m["allreduce_intra_node_bytes"]["total"] == (0 if H == 2 else ar // 2)


def test_run_ep_cli_on_an_foe_trace(foe2_dir, tmp_path):
    plan = tmp_path / "p.json"
    assert run_cli("plan", str(foe2_dir), "--strategy", "foe", "--cluster", "2x2", "--out", str(plan)).returncode == 0
    out = tmp_path / "run.json"
    r = run_cli("run-ep", str(foe2_dir), "--plan", str(plan), "--cluster", "2x2", "--hidden-size", "32",
                "--microbatches", "2", "--repeats", "1", "--batch-tokens", "16", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["foe"]["groups"] == 2 and rep["bytes_match_simulator"] and rep["allreduce_matches_closed_form"]
    assert rep["inter_node_bytes"]["total"] == 0 and rep["allreduce_inter_node_bytes"]["total"] > 0
    M, L = rep["window"]["num_microbatches"], len(rep["layer_time_s"]["per_layer"])
    assert rep["layer_time_us_per_microbatch"]["decode"] == pytest.approx(rep["layer_time_s"]["total"] / (M * L) * 1e6)
    assert "measured" in r.stdout and "µs" in r.stdout and "replayed" in r.stdout
    # a plain MoE strategy on an FoE trace is refused (issue 25), and an FoE trace with a plain plan made elsewhere
    # is refused before any process starts
    moe_plan = tmp_path / "moe.json"
    r = run_cli("plan", str(foe2_dir), "--strategy", "linear", "--cluster", "2x2", "--out", str(moe_plan))
    assert r.returncode == 2 and "--strategy foe" in r.stderr and not moe_plan.exists()
    meta = read_meta(foe2_dir)
    Plan(Placement.linear(meta.num_layers, meta.num_experts, 4), Cluster(2, 2)).save(moe_plan)
    r = run_cli("run-ep", str(foe2_dir), "--plan", str(moe_plan), "--cluster", "2x2")
    assert r.returncode == 2 and "strategy foe" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_foe_plan_json_is_validated(foe2_dir, tmp_path):
    from moeplace.schema import SchemaError

    out = tmp_path / "p.json"
    assert run_cli("plan", str(foe2_dir), "--strategy", "foe", "--cluster", "2x2", "--out", str(out)).returncode == 0
    good = json.loads(out.read_text())
    for change, want in (({"foe_groups": 3}, "divide"), ({"foe_groups": 0}, "foe_groups"),
                         ({"phy2log": [list(reversed(r)) for r in good["phy2log"]]}, "slot e")):
        with pytest.raises(SchemaError, match=want):
            Plan.from_json({**good, **change}, where="p.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**good, "foe_groups": 3}))
    r = run_cli("run-ep", str(foe2_dir), "--plan", str(bad), "--cluster", "2x2")
    assert r.returncode == 2 and "bad.json" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_simulate_refuses_an_foe_plan(foe2_dir, tmp_path):
    out = tmp_path / "p.json"
    assert run_cli("plan", str(foe2_dir), "--strategy", "foe", "--cluster", "2x2", "--out", str(out)).returncode == 0
    r = run_cli("simulate", str(foe2_dir), "--plan", str(out))
    assert r.returncode == 2 and "FoE plan" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_shipped_foe_trace():
    from moeplace.data import FOE_TRACE
    from moeplace.trace import read_trace

    tr = read_trace(FOE_TRACE)  # the validating reader also checks the group order of every row
    assert tr.meta.foe_groups == 2 and not tr.meta.synthetic and tr.meta.complete
    assert len(tr.requests) == 1000 and set(np.unique(tr.tokens.phase)) == {0, 1}
    ids = tr.tokens.expert_ids.astype(int)
    assert ((ids // 16) == (np.arange(4) // 2)).all()  # group h's K/H = 2 experts among its E/H = 16, in order
    assert set(tr.requests.domain.tolist()) == {"code", "chat", "general", "math"}


def test_run_ep_refuses_two_hop_on_an_foe_trace(foe2_dir, tmp_path):
    out = tmp_path / "p.json"
    assert run_cli("plan", str(foe2_dir), "--strategy", "foe", "--cluster", "2x2", "--out", str(out)).returncode == 0
    r = run_cli("run-ep", str(foe2_dir), "--plan", str(out), "--cluster", "2x2", "--two-hop")
    assert r.returncode == 2 and "--two-hop" in r.stderr and len(r.stderr.strip().splitlines()) == 1
