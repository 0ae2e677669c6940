"""FoE routing in traces: a tiny trained FoE model (H = 2) recorded through ``moeplace trace record``.

The recorded trace is read back with pyarrow alone (not moeplace's reader) and checked against the group contract
of docs/TRACE_FORMAT.md and against ``router_expert_ids`` of a plain forward of each prompt; analyze and plan run
on it; broken FoE traces are refused with one line naming the file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

torch = pytest.importorskip("torch")

from moeplace.cli import main  # noqa: E402
from moeplace.simulate.foe import trace_groups  # noqa: E402
from moeplace.trace import TraceMeta, read_meta  # noqa: E402
from moeplace.trace.types import TraceError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
H = 2
MAX_NEW = 6


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "moeplace", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def run_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """The command line in this process (cheaper than a fresh interpreter for the read-only commands)."""
    capsys.readouterr()
    rc = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), rc, out.out, out.err)


@pytest.fixture(scope="module")
def foe_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("foe") / "model"
    res = run_cli("train-reference", "--config", "tiny", "--kv-heads", "2", "--foe-groups", str(H), "--threads", "1",
                  "--quiet", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def foe_trace(foe_model: Path) -> Path:
    out = foe_model.parent / "foe.trace"
    res = run_cli("trace", "record", "--model", str(foe_model), "--prompts", str(foe_model / "heldout_prompts.jsonl"),
                  "--max-new-tokens", str(MAX_NEW), "--batch-size", "4", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"FoE groups H={H}" in res.stdout
    return out


def raw_tokens(trace: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """meta.json and the token columns read with pyarrow only: expert_ids [T, L, K]."""
    meta = json.loads((trace / "meta.json").read_text())
    t = pa.concat_tables([pq.read_table(f) for f in sorted(trace.glob("part-*.tokens.parquet"))])
    ids = np.asarray(t["expert_ids"].combine_chunks().flatten()).reshape(-1, meta["num_layers"], meta["top_k"])
    cols = {k: t[k].to_numpy() for k in ("request_id", "position", "phase")}
    return meta, {**cols, "expert_ids": ids}


def test_meta_records_the_groups(foe_trace: Path, capsys):
    meta = read_meta(foe_trace)
    assert meta.foe_groups == H and trace_groups(meta) == H
    assert meta.extra["router_class"] == "FoeGroupTopKRouter" and meta.has_weights
    assert json.loads((foe_trace / "meta.json").read_text())["foe_groups"] == H
    info = run_main(capsys, "trace", "info", str(foe_trace))
    assert info.returncode == 0 and f"FoE groups: {H}" in info.stdout
    assert json.loads(run_main(capsys, "trace", "info", str(foe_trace), "--json").stdout)["foe_groups"] == H


def test_every_column_holds_an_expert_of_its_group(foe_trace: Path):
    meta, tok = raw_tokens(foe_trace)
    E, K = meta["num_experts"], meta["top_k"]
    ids = tok["expert_ids"]
    assert len(ids) > 0
    for t in range(len(ids)):  # plain loop: group h owns experts [h*E/H, (h+1)*E/H) and columns [h*K/H, (h+1)*K/H)
        for layer in range(meta["num_layers"]):
            for h in range(H):
                for e in ids[t, layer, h * K // H:(h + 1) * K // H]:
                    assert h * E // H <= e < (h + 1) * E // H, (t, layer, h, e)


def test_prefill_ids_equal_a_plain_forward(foe_model: Path, foe_trace: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import moeplace.models.foe  # noqa: F401  (registers qwen3_foe)

    model = AutoModelForCausalLM.from_pretrained(foe_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(foe_model)
    prompts = [json.loads(line)["prompt"] for line in (foe_model / "heldout_prompts.jsonl").read_text().splitlines()
               if line.strip()]
    _, tok = raw_tokens(foe_trace)
    for r, prompt in enumerate(prompts):
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
        # router_expert_ids: per layer [S, H, K/H]; group by group along K is the trace's column order
        want = np.stack([e.reshape(len(ids), -1).numpy() for e in out.router_expert_ids], axis=1)  # [S, L, K]
        sel = (tok["request_id"] == r) & (tok["phase"] == 0)
        order = np.argsort(tok["position"][sel])
        assert np.array_equal(tok["position"][sel][order], np.arange(len(ids)))
        np.testing.assert_array_equal(tok["expert_ids"][sel][order], want, err_msg=f"request {r}")


def test_decode_tokens_follow_the_prompt(foe_trace: Path):
    meta, tok = raw_tokens(foe_trace)
    dec = tok["phase"] == 1
    assert dec.sum() > 0
    for r in np.unique(tok["request_id"]):
        pre = (tok["request_id"] == r) & ~dec
        d = (tok["request_id"] == r) & dec
        n_pre = int(pre.sum())
        assert d.sum() <= MAX_NEW - 1  # the last generated token is never fed back (nor an EOS and what follows)
        assert np.array_equal(np.sort(tok["position"][d]), n_pre + np.arange(int(d.sum())))


def test_analyze_runs_on_an_foe_trace_and_plain_moe_planning_is_refused(foe_trace: Path, tmp_path: Path, capsys):
    """analyze reads an FoE trace; a plain MoE strategy (its placement ignores the groups) is one line, no plan."""
    a = run_main(capsys, "analyze", str(foe_trace), "--no-progress", "--json", str(tmp_path / "a.json"))
    assert a.returncode == 0, a.stderr[-2000:]
    assert json.loads((tmp_path / "a.json").read_text())["meta"]["num_tokens"]["total"] > 0
    p = run_main(capsys, "plan", str(foe_trace), "--strategy", "eplb", "--cluster", "2x2",
                 "--out", str(tmp_path / "p.json"))
    assert "--strategy foe" in _one_line_error(p, "FoE trace")
    assert not (tmp_path / "p.json").exists()


def _broken_copy(foe_trace: Path, tmp_path: Path) -> Path:
    t = tmp_path / "bad.trace"
    shutil.copytree(foe_trace, t)
    return t


def _one_line_error(res: subprocess.CompletedProcess, names: str) -> str:
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert names in lines[0], lines[0]
    return lines[0]


def test_groups_not_dividing_are_refused(foe_trace: Path, tmp_path: Path, capsys):
    t = _broken_copy(foe_trace, tmp_path)
    meta = json.loads((t / "meta.json").read_text())
    (t / "meta.json").write_text(json.dumps({**meta, "foe_groups": 3}))
    for cmd in (["trace", "info", str(t)], ["analyze", str(t), "--no-progress"]):
        line = _one_line_error(run_main(capsys, *cmd), "meta.json")
        assert "foe_groups" in line


def test_ids_outside_their_group_are_refused(foe_trace: Path, tmp_path: Path, capsys):
    t = _broken_copy(foe_trace, tmp_path)
    shard = sorted(t.glob("part-*.tokens.parquet"))[0]
    tab = pq.read_table(shard)
    meta = json.loads((t / "meta.json").read_text())
    L, K = meta["num_layers"], meta["top_k"]
    ids = np.asarray(tab["expert_ids"].combine_chunks().flatten()).reshape(-1, L, K).copy()
    ids[3, L - 1] = ids[3, L - 1, ::-1]  # group 1's expert in column 0: distinct ids, in range, wrong order
    col = pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), L * K)
    pq.write_table(tab.set_column(tab.schema.get_field_index("expert_ids"), "expert_ids", col), shard)
    line = _one_line_error(run_cli("analyze", str(t), "--no-progress"), shard.name)  # a fresh process
    assert "FoE group" in line
    a = run_main(capsys, "analyze", str(foe_trace), "--no-progress")  # the untouched trace still reads
    assert a.returncode == 0, a.stderr[-2000:]


def test_meta_validation_and_old_traces():
    base = dict(model="m", num_layers=2, num_experts=8, top_k=4)
    assert TraceMeta(**base).foe_groups == 1
    assert TraceMeta(**base, foe_groups=4).foe_groups == 4
    for bad in (0, 3, 8, True, "2", 2.0):
        with pytest.raises(TraceError, match="foe_groups"):
            TraceMeta(**base, foe_groups=bad)
    old = {**TraceMeta(**base).to_json()}
    del old["foe_groups"]  # a trace written before the field existed
    assert TraceMeta.from_json(old).foe_groups == 1


@pytest.mark.filterwarnings("ignore:synth. asked")  # short requests: the pilot cannot reach every target
def test_synth_sets_the_groups(tmp_path: Path, capsys):
    for h, want in ((4, 4), (0, 1)):
        out = tmp_path / f"s{h}.trace"
        res = run_main(capsys, "synth", "--preset", "gpt-oss-20b", "--requests", "4", "--prompt-len", "6",
                       "--gen-len", "3", "--foe-groups", str(h), "--seed", "1", "--quiet", str(out))
        assert res.returncode == 0, res.stderr[-2000:]
        meta, tok = raw_tokens(out)
        assert meta["foe_groups"] == want
        if want > 1:  # E=32, K=4: column j holds an expert of [8j, 8j+8)
            assert (tok["expert_ids"] // 8 == np.arange(4)).all()
