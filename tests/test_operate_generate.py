"""moeplace operate --source live: routing of the reference model's generate, captured as it happens, through the
same loop as a replayed trace. Checked against an independent recording of the same prompts by
``moeplace trace record`` (another process): the loop sees the same rows, and its counters equal plain counts of the
recorded routing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from moeplace.cli import main
from moeplace.deploy import parse_cluster
from moeplace.operate import OperateConfig, operate, trace_stream
from moeplace.simulate import BatchConfig
from moeplace.trace import read_trace

pytest.importorskip("torch")
reference = pytest.importorskip("moeplace.models.reference")
if not (reference.REFERENCE_DIR / "model.safetensors").is_file():
    pytest.skip("the reference model is not shipped in this checkout", allow_module_level=True)

WINDOW = 8  # requests per window = generate batch = decode batch
NEW = 4  # max_new_tokens
SAMPLE = 16
HORIZON = 10**9  # steps: the threshold trigger moves whenever its evidence bound is positive (a change to compare)
# one torch thread in every process: the same float reductions, so the same routing, and no thread oversubscription
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}


def cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moeplace", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """16 held-out prompts, 4 per domain interleaved; recorded by `trace record` and run live by `operate`, in
    parallel processes."""
    d = tmp_path_factory.mktemp("live")
    rows = reference.builtin_prompts()
    by_dom: dict[str, list[dict]] = {}
    for r in rows:
        by_dom.setdefault(r["domain"], []).append(r)
    pick = [by_dom[dom][i] for i in range(4) for dom in by_dom]
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"], "domain": r["domain"]}) + "\n" for r in pick))
    common = ["--window-requests", str(WINDOW), "--decode-batch", str(WINDOW), "--cluster", "2x4",
              "--model-preset", "gpt-oss-20b", "--sample-every", str(SAMPLE), "--policy", "threshold",
              "--threshold", "0.99", "--horizon-steps", str(HORIZON)]
    rec = cli("trace", "record", "--model", "reference", "--prompts", str(prompts), "--max-new-tokens", str(NEW),
              "--batch-size", str(WINDOW), str(d / "rec.trace"))
    live = cli("operate", "--source", "live", "--model", "reference", "--prompts", str(prompts), "--max-new-tokens",
               str(NEW), "--batch-size", str(WINDOW), *common, "--json", str(d / "live.json"), "--out",
               str(d / "plans"))
    for p in (rec, live):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    return d, len(pick), live


def test_live_loop_equals_replay_of_the_recorded_trace(runs):
    d, n, _ = runs
    live = json.loads((d / "live.json").read_text())
    assert live["params"]["stream"]["source"] == "live" and live["stream"].startswith("live generate of ")
    cfg = OperateConfig(parse_cluster("2x4", None), 0, WINDOW, SAMPLE, model_preset="gpt-oss-20b",
                        batching=BatchConfig(WINDOW, BatchConfig().prefill_tokens))
    rep = operate(trace_stream(d / "rec.trace", WINDOW, "table"), cfg, "threshold", threshold=0.99,
                  horizon_steps=HORIZON).to_json()
    assert len(live["windows"]) == n // WINDOW
    assert live["windows"] == rep["windows"]
    assert live["rebalances"] >= 1 and (d / "plans" / "changes" / "0001" / "migration.json").is_file()


def test_live_counters_equal_plain_counts_of_the_recording(runs):
    d, n, _ = runs
    live = json.loads((d / "live.json").read_text())
    tr = read_trace(d / "rec.trace")
    tk, req = tr.tokens, tr.requests
    L, E, K = tr.meta.num_layers, tr.meta.num_experts, tr.meta.top_k
    dom_of = dict(zip(req.request_id.tolist(), req.domain.tolist(), strict=True))
    win_of = {int(r): i // WINDOW for i, r in enumerate(req.request_id)}  # table order = prompt order
    rows_by_win: dict[int, list[int]] = {}
    for t in range(len(tk)):  # rows in the order the recorder wrote them
        rows_by_win.setdefault(win_of[int(tk.request_id[t])], []).append(t)
    running = 0
    for w, rep in enumerate(live["windows"]):
        rows = rows_by_win[w]
        doms: dict[str, int] = {}
        for t in rows:
            doms[dom_of[int(tk.request_id[t])]] = doms.get(dom_of[int(tk.request_id[t])], 0) + 1
        assert rep["domains"] == doms and rep["tokens"] == len(rows) and rep["pairs"] == len(rows) * L * K
        sampled = np.zeros((L, E), int)
        for i, t in enumerate(rows):
            if (running + i) % SAMPLE == 0:
                for li in range(L):
                    for e in tk.expert_ids[t, li]:
                        sampled[li, e] += 1
        running += len(rows)
        share = max(sampled[li].max() / sampled[li].sum() for li in range(L))
        assert rep["top_expert_share"] == pytest.approx(share)
        if w == 0:  # the linear plan (no redundant slots): expert e on GPU e // (E / 8)
            load = np.zeros(8)
            for t in rows:
                for li in range(L):
                    for e in tk.expert_ids[t, li]:
                        load[int(e) // (E // 8)] += 1
            assert rep["gpu_load"] == load.tolist()


def test_live_source_needs_a_model_and_prompts(capsys):
    assert main(["operate", "--source", "live", "--prompts", "builtin", "--cluster", "2x4"]) == 2
    assert "--source live takes --model and --prompts" in capsys.readouterr().err
    assert main(["operate", "--cluster", "2x4"]) == 2
    assert "give a STREAM" in capsys.readouterr().err
