"""Importers: real files from ../shared/data (skipped when absent) and small dumps built in the engines' layouts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import shared_data
from spec_sglang_recorder import LOGITS as SGL_LOGITS
from spec_sglang_recorder import PER_TOKEN as SGL_PER_TOKEN
from spec_sglang_recorder import STAT as SGL_STAT
from spec_sglang_recorder import TRUTH as SGL_TRUTH
from spec_sglang_recorder import check_imports as check_sglang_imports
from spec_sglang_recorder import load_truth

from moeplace.cli import main
from moeplace.trace import DECODE, PREFILL, TraceError, read_counts, read_meta, read_trace
from moeplace.trace.importers import (
    IMPORTERS,
    gpt_oss_domain,
    import_gpt_oss_npz,
    import_gpt_oss_summaries,
    import_olmoe_npz,
    import_sglang_per_token,
    import_sglang_stat,
    import_trace,
    import_vllm_routed,
)

# --------------------------------------------------------------------------------------------------- real data


@pytest.mark.shared_data
def test_gpt_oss_npz_matches_independent_read(tmp_path):
    src = shared_data("gpt-oss-20b")
    pick = [3, 0, 100, 527]
    out = import_gpt_oss_npz(src, tmp_path / "g.trace", select=pick)
    t = read_trace(out)
    z = np.load(src / "decode_routing.npz")
    off = z["example_offsets"]
    rows = [json.loads(x) for x in open(src / "decode_routing_meta.jsonl")]
    assert (t.meta.num_layers, t.meta.num_experts, t.meta.top_k, t.meta.hidden_size) == (24, 32, 4, 2880)
    assert t.meta.has_weights and t.meta.extra["license"] == "Apache-2.0"
    assert t.requests.request_id.tolist() == [rows[i]["example_index"] for i in pick]
    assert (t.tokens.phase == DECODE).all()
    for i in pick:
        rid = rows[i]["example_index"]
        m = t.tokens.request_id == rid
        sl = slice(off[i], off[i + 1])
        np.testing.assert_array_equal(t.tokens.expert_ids[m], z["expert_ids"][sl])
        np.testing.assert_array_equal(t.tokens.expert_weights[m], z["expert_probs"][sl])
        np.testing.assert_array_equal(t.tokens.position[m], z["token_position"][sl])
        k = t.requests.request_id.tolist().index(rid)
        assert t.requests.source[k] == f"{rows[i]['dataset']}/{rows[i]['category']}"
        assert t.requests.domain[k] == gpt_oss_domain(rows[i]["dataset"], rows[i]["category"])
        assert t.requests.prompt_len[k] == rows[i]["prompt_len_tokens"]


@pytest.mark.shared_data
def test_gpt_oss_npz_limit_via_cli(tmp_path, capsys):
    src = shared_data("gpt-oss-20b")
    out = tmp_path / "g.trace"
    assert main(["trace", "import", "--format", "gpt-oss-npz", str(src), str(out), "--limit", "2", "--no-weights"]) == 0
    t = read_trace(out)
    off = np.load(src / "decode_routing.npz")["example_offsets"]
    assert len(t.requests) == 2 and len(t.tokens) == off[2] and not t.meta.has_weights
    assert "requests   2" in capsys.readouterr().out
    assert main(["trace", "import", "--format", "gpt-oss-npz", str(src), str(out), "--limit", "1"]) == 2
    assert "already exists" in capsys.readouterr().err


@pytest.mark.shared_data
def test_gpt_oss_summaries(tmp_path):
    src = shared_data("gpt-oss-20b")
    c = read_counts(import_gpt_oss_summaries(src, tmp_path / "s.trace"))
    z = np.load(src / "domain_summaries.npz")
    groups = json.loads((src / "domain_summaries_meta.json").read_text())
    n_answer = sum(g["num_answer_tokens"] is not None for g in groups)
    assert len(c) == len(groups) + n_answer and (c.phase == DECODE).all()
    g = groups[0]
    name = f"{g['dataset']}/{g['category']}/{g['bucket']}/think"
    k = c.group.tolist().index(name)
    n = g["sample_count"] * g["num_think_tokens"]
    assert c.num_tokens[k] == pytest.approx(n)
    np.testing.assert_allclose(c.counts[k], z["think_count_frequency"][0].astype(np.float64) * n)


@pytest.mark.shared_data
@pytest.mark.parametrize("model,E,K", [("olmoe", 64, 8), ("mistral", 8, 2)])
def test_olmoe_npz(tmp_path, model, E, K):
    src = shared_data("olmoe-mixtral", f"{model}.npz")
    out = import_olmoe_npz(src, tmp_path / "o.trace")
    meta, c = read_meta(out), read_counts(out)
    z = np.load(src)
    assert (meta.num_layers, meta.num_experts, meta.top_k, meta.moe_layer_map) == (3, E, K, [0, 7, 15])
    assert (c.phase == PREFILL).all()
    for g, d, n, cnt in zip(c.group, c.domain, c.num_tokens, c.counts, strict=True):
        corpus = g.split("/", 1)[1]
        np.testing.assert_array_equal(cnt, z[f"expert_counts__{corpus}"])
        assert n == cnt[0].sum() / K
        assert d == {"github": "code", "tulu": "chat"}.get(corpus, "general")


def test_gpt_oss_domain_mapping():
    assert gpt_oss_domain("mmlu_test", "college_mathematics") == "math"
    assert gpt_oss_domain("mmlu_pro_test", "physics") == "math"
    assert gpt_oss_domain("gpqa_main", "Genetics") == "math"
    assert gpt_oss_domain("sorry_bench_base", "Animal-related Crimes") == "chat"
    assert gpt_oss_domain("tulu3_persona_if", "instruction-following") == "chat"
    assert gpt_oss_domain("mmlu_dev", "world_religions") == "general"
    assert gpt_oss_domain("Polyglot-or-Not_Fact-Completion", "fact_checking") == "general"


# --------------------------------------------------------------------------------------------------- vLLM


def _vllm_requests():
    """Two requests, 3 model layers (layer 0 dense: all zeros, as vLLM's zero-filled buffer), K=2."""
    rng = np.random.default_rng(1)

    def rows(n):
        ids = np.stack([np.stack([rng.choice(6, 2, replace=False) for _ in range(3)]) for _ in range(n)])
        ids[:, 0, :] = 0
        return ids.astype(np.int16)

    p0 = rows(5)
    p0[:2] = -1  # two prefix-cached prompt positions
    return [
        dict(request_id="cmpl-a", domain="code", prompt_routed_experts=p0, routed_experts=rows(3)),
        dict(request_id="cmpl-b", prompt_routed_experts=rows(4), routed_experts=rows(2)),
    ]


def _write_vllm_jsonl(path, reqs):
    with open(path, "w") as fh:
        for r in reqs:
            fh.write(json.dumps({k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in r.items()}) + "\n")
    return path


def _write_vllm_npz(path, reqs):
    arrs = {"request_ids": np.array([r["request_id"] for r in reqs]),
            "domains": np.array([r.get("domain", "unknown") for r in reqs])}
    for i, r in enumerate(reqs):
        arrs[f"req{i}_prompt"] = r["prompt_routed_experts"]
        arrs[f"req{i}_decode"] = r["routed_experts"]
    np.savez(path, **arrs)
    return path


@pytest.mark.parametrize("kind", ["jsonl", "npz"])
def test_vllm_routed(tmp_path, kind):
    reqs = _vllm_requests()
    src = (_write_vllm_jsonl if kind == "jsonl" else _write_vllm_npz)(tmp_path / f"r.{kind}", reqs)
    out = import_vllm_routed(src, tmp_path / "v.trace", model="m", num_experts=6, hidden_size=64)
    t = read_trace(out)
    assert (t.meta.num_layers, t.meta.num_experts, t.meta.top_k) == (2, 6, 2)
    assert t.meta.moe_layer_map == [1, 2] and t.meta.extra["prefix_cached_rows_dropped"] == 2
    assert t.requests.domain.tolist() == ["code", "unknown"]
    assert t.requests.source.tolist() == ["vllm request_id=cmpl-a", "vllm request_id=cmpl-b"]
    assert t.requests.prompt_len.tolist() == [5, 4] and t.requests.gen_len.tolist() == [3, 2]
    for i, r in enumerate(reqs):
        m = t.tokens.request_id == i
        p, d = r["prompt_routed_experts"], r["routed_experts"]
        keep = ~(p < 0).any(axis=(1, 2))
        want = np.concatenate([p[keep], d])[:, 1:, :]
        np.testing.assert_array_equal(t.tokens.expert_ids[m], want)
        np.testing.assert_array_equal(t.tokens.position[m],
                                      np.concatenate([np.arange(len(p))[keep], len(p) + np.arange(len(d))]))
        np.testing.assert_array_equal(t.tokens.phase[m], [PREFILL] * int(keep.sum()) + [DECODE] * len(d))


def test_vllm_errors(tmp_path):
    reqs = _vllm_requests()
    src = _write_vllm_jsonl(tmp_path / "r.jsonl", reqs)
    with pytest.raises(TraceError, match=r"r.jsonl: expert id 5 out of range \[0, 4\)"):
        import_vllm_routed(src, tmp_path / "a.trace", num_experts=4)
    bad = [dict(reqs[0]), reqs[1]]
    bad[0]["routed_experts"] = bad[0]["routed_experts"].copy()
    bad[0]["routed_experts"][1, 2, 0] = -1
    with pytest.raises(TraceError, match="row 1 has -1 in some layers only"):
        import_vllm_routed(_write_vllm_jsonl(tmp_path / "b.jsonl", bad), tmp_path / "b.trace")
    bad = [reqs[0], dict(reqs[1], routed_experts=np.zeros((2, 4, 2), np.int16))]
    with pytest.raises(TraceError, match=r"cmpl-b\): prompt_routed_experts has \[layers, k\] = \[3, 2\] but "
                                         r"routed_experts \[4, 2\]"):
        import_vllm_routed(_write_vllm_jsonl(tmp_path / "c.jsonl", bad), tmp_path / "c.trace")
    (tmp_path / "d.jsonl").write_text('{"request_id": 1, "prompt": [1]}\n')
    with pytest.raises(TraceError, match=r"d.jsonl: line 1 \(request 1\): needs routed_experts"):
        import_vllm_routed(tmp_path / "d.jsonl", tmp_path / "d.trace")
    (tmp_path / "e.jsonl").write_text('{"routed_experts": [[1, 2]], "prompt_len": 1}\n')
    with pytest.raises(TraceError, match=r"expected shape \[tokens, layers, k\]"):
        import_vllm_routed(tmp_path / "e.jsonl", tmp_path / "e.trace")
    with pytest.raises(TraceError, match="nope.jsonl: no such file"):
        import_vllm_routed(tmp_path / "nope.jsonl", tmp_path / "f.trace")


VLLM_032 = Path(__file__).parent / "fixtures" / "vllm_routed_0.32.jsonl"


def test_vllm_032_real_array_splits_at_the_prompt(tmp_path):
    """vLLM 0.32's one array per request (made by vLLM's own capture/trim/base64 code, tests/fixtures/README.md):
    rows are positions start .. prompt + generated - 2; those below the prompt length are prefill."""
    truth = json.loads(VLLM_032.with_suffix(".truth.json").read_text())
    recs = [json.loads(line) for line in VLLM_032.read_text().splitlines()]
    assert truth["vllm"] == "0.32.0" and all(r["dtype"] == "uint8" for r in truth["requests"])
    t = read_trace(import_vllm_routed(VLLM_032, tmp_path / "v.trace", model="reference", num_experts=32))
    assert (t.meta.num_layers, t.meta.num_experts, t.meta.top_k) == (8, 32, 4)
    assert t.meta.moe_layer_map == list(range(8)) and t.meta.extra["prefix_cached_rows_dropped"] == 0
    for i, (rec, tr) in enumerate(zip(recs, truth["requests"], strict=True)):
        P, G, s = len(rec["prompt_token_ids"]), len(rec["output_token_ids"]), rec["routed_experts_prompt_start"]
        assert tr["shape"][0] == P + G - 1 - s  # vLLM never routes the last generated token
        m = t.tokens.request_id == i
        assert int((t.tokens.phase[m] == PREFILL).sum()) == P - s
        assert int((t.tokens.phase[m] == DECODE).sum()) == G - 1
        np.testing.assert_array_equal(t.tokens.position[m], np.arange(s, P + G - 1))
        np.testing.assert_array_equal(t.tokens.expert_ids[m], np.asarray(tr["ids"]))
        assert (t.requests.prompt_len[i], t.requests.gen_len[i]) == (P, G)


def test_vllm_032_refuses_what_it_cannot_place(tmp_path):
    rec = json.loads(VLLM_032.read_text().splitlines()[0])  # prompt 9, generated 9, start 0 -> 17 rows

    def run(**change):
        d = {k: v for k, v in {**rec, **change}.items() if v is not None}
        (tmp_path / "x.jsonl").write_text(json.dumps(d) + "\n")
        return import_vllm_routed(tmp_path / "x.jsonl", tmp_path / "x.trace", overwrite=True)

    with pytest.raises(TraceError, match="give prompt_token_ids or prompt_len"):
        run(prompt_token_ids=None)
    with pytest.raises(TraceError, match="where the rows start is ambiguous"):
        run(output_token_ids=None, routed_experts_prompt_start=None)
    with pytest.raises(TraceError, match="has 17 rows, but a 9-token prompt with 8 generated tokens gives 16; if the "
                                         "request set routed_experts_prompt_start"):
        run(output_token_ids=rec["output_token_ids"][:8], routed_experts_prompt_start=None)
    with pytest.raises(TraceError, match=r"gives 15 \(routed_experts_prompt_start=2\)"):
        run(routed_experts_prompt_start=2)
    with pytest.raises(TraceError, match=r"routed_experts_prompt_start=10 is outside \[0, 9\]"):
        run(routed_experts_prompt_start=10)
    with pytest.raises(TraceError, match="prompt_len=8 but prompt_token_ids has 9"):
        run(prompt_len=8)
    with pytest.raises(TraceError, match="not a base64-encoded .npy"):
        run(routed_experts="bm90IGFuIG5weQ==")
    # prompt_len and routed_experts_prompt_start alone place the rows (generated length follows from them)
    t = read_trace(run(prompt_token_ids=None, prompt_len=9, output_token_ids=None))
    assert t.requests.gen_len.tolist() == [9] and int((t.tokens.phase == PREFILL).sum()) == 9


def test_vllm_032_npz_layout(tmp_path):
    rows = np.random.default_rng(0).integers(0, 32, (10, 3, 2)).astype(np.uint8)
    np.savez(tmp_path / "r.npz", req0_routed=rows, prompt_lens=np.array([6]), gen_lens=np.array([5]))
    t = read_trace(import_vllm_routed(tmp_path / "r.npz", tmp_path / "t.trace", num_experts=32))
    assert t.tokens.phase.tolist() == [PREFILL] * 6 + [DECODE] * 4
    np.testing.assert_array_equal(t.tokens.expert_ids, rows)
    np.savez(tmp_path / "b.npz", req0_routed=rows)
    with pytest.raises(TraceError, match="give prompt_token_ids or prompt_len"):
        import_vllm_routed(tmp_path / "b.npz", tmp_path / "b.trace")


def test_vllm_021_zero_filled_cached_rows_are_dropped(tmp_path):
    """vLLM 0.21 zero-fills prompt rows it took from the prefix cache: they are unknown, not expert 0."""
    rng = np.random.default_rng(2)
    pr = np.stack([np.stack([rng.choice(np.arange(1, 8), 2, replace=False) for _ in range(2)]) for _ in range(5)])
    pr[:3] = 0
    dc = rng.integers(1, 8, (2, 2, 2))
    dc[..., 1] = (dc[..., 0] % 7) + 1  # distinct pair
    src = _write_vllm_jsonl(tmp_path / "z.jsonl", [dict(request_id="a", prompt_routed_experts=pr.astype(np.int16),
                                                        routed_experts=dc.astype(np.int16))])
    t = read_trace(import_vllm_routed(src, tmp_path / "z.trace", num_experts=8))
    assert t.meta.extra["prefix_cached_rows_dropped"] == 3
    assert t.tokens.position.tolist() == [3, 4, 5, 6] and not (t.tokens.expert_ids == 0).any()
    np.testing.assert_array_equal(np.bincount(t.tokens.expert_ids.ravel(), minlength=8)[0], 0)
    src = _write_vllm_jsonl(tmp_path / "k1.jsonl", [dict(prompt_routed_experts=pr[:, :, :1].astype(np.int16))])
    with pytest.raises(TraceError, match="all-zero rows and k = 1"):
        import_vllm_routed(src, tmp_path / "k1.trace")


# --------------------------------------------------------------------------------------------------- SGLang

# Model with 3 layers (layer 0 dense), 4 logical experts, 6 physical slots: replicas of 3 and 1 in layer 1,
# of 0 and 2 in layer 2. A wrong (or skipped) physical->logical mapping changes the ids.
P2L = torch.tensor([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 3, 1], [1, 0, 3, 2, 0, 2]], dtype=torch.int64)
EXTEND, DECODE_MODE, MIXED, IDLE, TARGET_VERIFY = 1, 2, 3, 4, 5


def _record(rng, n, mode, extend_seq_lens=None, pass_id=0):
    topk = torch.full((3, n, 8), -1, dtype=torch.int32)  # SGLang pads to 8 columns with -1
    for layer in (1, 2):
        for t in range(n):
            while True:  # two physical slots of one token hold different logical experts, as in SGLang
                c = rng.choice(6, 2, replace=False)
                if P2L[layer, c[0]] != P2L[layer, c[1]]:
                    break
            topk[layer, t, :2] = torch.from_numpy(c)
    return dict(forward_pass_id=pass_id, rank=0, gatherer_key="primary", input_ids=list(range(n)),
                positions=list(range(100, 100 + n)), extend_seq_lens=extend_seq_lens, forward_mode=mode,
                topk_ids_of_layer=topk, misc_objects=[])


def _per_token_dump(path):
    rng = np.random.default_rng(2)
    records = [
        _record(rng, 5, EXTEND, [3, 2], 0),
        _record(rng, 4, DECODE_MODE, None, 1),
        _record(rng, 0, IDLE, None, 2),
        _record(rng, 3, TARGET_VERIFY, None, 3),
        _record(rng, 4, MIXED, [3, 1], 4),
    ]
    torch.save(dict(records=records, last_physical_to_logical_map=P2L), path)
    return records


def test_sglang_per_token_maps_physical_to_logical(tmp_path):
    records = _per_token_dump(tmp_path / "expert_distribution_recorder_1.0_0.pt")
    out = import_sglang_per_token(tmp_path / "expert_distribution_recorder_1.0_0.pt", tmp_path / "s.trace",
                                  model="toy", hidden_size=32)
    t = read_trace(out)
    assert (t.meta.num_layers, t.meta.num_experts, t.meta.top_k, t.meta.moe_layer_map) == (2, 4, 2, [1, 2])
    assert t.meta.extra["skipped_records_by_forward_mode"] == {str(TARGET_VERIFY): 1}
    # plain-loop reference: logical = P2L[layer, physical], records EXTEND, DECODE, MIXED in order
    want = []
    for rec in (records[0], records[1], records[4]):
        topk = rec["topk_ids_of_layer"]
        for tok in range(topk.shape[1]):
            want.append([[int(P2L[layer, int(topk[layer, tok, j])]) for j in range(2)] for layer in (1, 2)])
    np.testing.assert_array_equal(t.tokens.expert_ids, np.array(want))
    np.testing.assert_array_equal(t.tokens.position, list(range(100, 105)) + list(range(100, 104)) +
                                  list(range(100, 104)))
    # requests: extend [3, 2] -> 2 prefill; decode 4 tokens -> 4 requests; mixed [3, 1] -> prefill 3 + decode 1
    assert len(t.requests) == 8
    np.testing.assert_array_equal(t.tokens.request_id, [0, 0, 0, 1, 1, 2, 3, 4, 5, 6, 6, 6, 7])
    np.testing.assert_array_equal(t.tokens.phase, [0] * 5 + [1] * 4 + [0, 0, 0, 1])
    assert t.requests.prompt_len.tolist() == [3, 2, 0, 0, 0, 0, 3, 0]
    assert t.requests.gen_len.tolist() == [0, 0, 1, 1, 1, 1, 0, 1]


def test_sglang_per_token_errors(tmp_path):
    rng = np.random.default_rng(3)
    f = tmp_path / "d.pt"
    torch.save(dict(records=[_record(rng, 2, EXTEND)]), f)
    with pytest.raises(TraceError, match="d.pt: missing key 'last_physical_to_logical_map'"):
        import_sglang_per_token(f, tmp_path / "a.trace")
    rec = _record(rng, 2, EXTEND)
    rec["topk_ids_of_layer"][1, 0, 0] = 6
    torch.save(dict(records=[rec], last_physical_to_logical_map=P2L), f)
    with pytest.raises(TraceError, match=r"d.pt: record 0: physical expert id 6 out of range \[0, 6\)"):
        import_sglang_per_token(f, tmp_path / "b.trace")
    rec = _record(rng, 2, EXTEND)
    rec["topk_ids_of_layer"] = rec["topk_ids_of_layer"][:2]
    torch.save(dict(records=[rec], last_physical_to_logical_map=P2L), f)
    with pytest.raises(TraceError, match=r"record 0: topk_ids_of_layer must be an integer \[3, tokens, k\]"):
        import_sglang_per_token(f, tmp_path / "c.trace")
    torch.save(dict(records=[_record(rng, 2, EXTEND)], last_physical_to_logical_map=P2L), f)
    with pytest.raises(TraceError, match=r"last_physical_to_logical_map: expert id 3 out of range \[0, 3\)"):
        import_sglang_per_token(f, tmp_path / "d.trace", num_experts=3)
    f.write_bytes(b"not a torch file")
    with pytest.raises(TraceError, match="d.pt: not a readable torch.save file"):
        import_sglang_per_token(f, tmp_path / "e.trace")
    torch.save(dict(rank=0, logical_count=torch.zeros(2, 3, 4)), f)
    with pytest.raises(TraceError, match="per_token dump.*sglang-stat"):
        import_sglang_per_token(f, tmp_path / "f.trace")


def _stat_dump(path):
    c = torch.zeros(4, 3, 5, dtype=torch.int32)  # buffer rows x model layers x logical experts
    gen = torch.Generator().manual_seed(0)
    for row in (0, 1, 3):  # row 2: unused buffer slot; layer 0: dense
        for layer in (1, 2):
            c[row, layer] = torch.randint(1, 9, (5,), generator=gen)
    torch.save(dict(rank=0, logical_count=c, average_utilization_rate_over_window=None), path)
    return c.numpy()


def test_sglang_stat(tmp_path):
    c = _stat_dump(tmp_path / "stat.pt")
    out = import_sglang_stat(tmp_path / "stat.pt", tmp_path / "s.trace", model="toy", top_k=2)
    meta, got = read_meta(out), read_counts(out)
    assert meta.kind == "counts" and (meta.num_layers, meta.num_experts, meta.top_k) == (2, 5, 2)
    assert meta.moe_layer_map == [1, 2] and meta.extra["empty_buffer_rows_dropped"] == 1
    assert got.group.tolist() == ["pass0", "pass1", "pass3"] and (got.phase == -1).all()
    np.testing.assert_array_equal(got.counts, c[[0, 1, 3]][:, 1:, :])
    np.testing.assert_allclose(got.num_tokens, c[[0, 1, 3]][:, 1:, :].sum(axis=2).max(axis=1) / 2)
    no_k = read_counts(import_sglang_stat(tmp_path / "stat.pt", tmp_path / "n.trace"))
    assert np.isnan(no_k.num_tokens).all()


def test_sglang_stat_errors(tmp_path):
    f = tmp_path / "s.pt"
    torch.save(dict(rank=0, logical_count=torch.zeros(3, 4)), f)
    with pytest.raises(TraceError, match=r"s.pt: logical_count must be a numeric \[buffer, layers, experts\]"):
        import_sglang_stat(f, tmp_path / "a.trace")
    torch.save(dict(rank=0, logical_count=torch.zeros(2, 3, 4)), f)
    with pytest.raises(TraceError, match="all zeros"):
        import_sglang_stat(f, tmp_path / "b.trace")
    torch.save(dict(records=[], last_physical_to_logical_map=P2L), f)
    with pytest.raises(TraceError, match="missing key 'logical_count'.*sglang-per-token"):
        import_sglang_stat(f, tmp_path / "c.trace")


def test_sglang_recorder_dumps_from_sglang_itself(tmp_path):
    """Dumps written by SGLang 0.5.23's own recorder (per_token and stat; committed fixtures, made by
    tests/interop/sglang_engine.py record): ids, phases, requests and counts are the top-k of the logits the
    engine was given, through a placement with redundant replicas and 2 dense layers."""
    truth, logits = load_truth(SGL_TRUTH, SGL_LOGITS)
    seen = check_sglang_imports(SGL_PER_TOKEN, SGL_STAT, truth, logits, tmp_path)
    assert seen["per_token"]["tokens"] == 19 and seen["stat"]["passes"] == 4


# --------------------------------------------------------------------------------------------------- errors, CLI


def test_npz_errors(tmp_path):
    d = tmp_path / "g"
    d.mkdir()
    with pytest.raises(TraceError, match="decode_routing.npz: no such file"):
        import_gpt_oss_npz(d, tmp_path / "a.trace")
    np.savez(d / "decode_routing.npz", example_offsets=np.array([0, 2]), expert_ids=np.zeros((2, 24, 4), np.uint8))
    (d / "decode_routing_meta.jsonl").write_text(json.dumps(dict(dataset="mmlu_dev", category="x",
                                                                 prompt_len_tokens=3)) + "\n")
    with pytest.raises(TraceError, match="decode_routing.npz: missing array 'expert_probs'"):
        import_gpt_oss_npz(d, tmp_path / "b.trace")
    ids = np.zeros((2, 24, 4), np.uint8)
    ids[1, 3, 2] = 32
    np.savez(d / "decode_routing.npz", example_offsets=np.array([0, 2]), expert_ids=ids,
             expert_probs=np.zeros((2, 24, 4), np.float16), token_position=np.array([3, 4], np.int32))
    with pytest.raises(TraceError, match=r"expert_ids: expert id 32 out of range \[0, 32\)"):
        import_gpt_oss_npz(d, tmp_path / "c.trace")
    np.savez(d / "decode_routing.npz", example_offsets=np.array([0, 2]), expert_ids=np.zeros((2, 12, 4), np.uint8),
             expert_probs=np.zeros((2, 12, 4), np.float16), token_position=np.array([3, 4], np.int32))
    with pytest.raises(TraceError, match=r"expert_ids must have shape \[tokens, 24, 4\]"):
        import_gpt_oss_npz(d, tmp_path / "d.trace")
    np.savez(tmp_path / "mistral.npz", expert_counts__c4=np.zeros((3, 64)))
    with pytest.raises(TraceError, match=r"expert_counts__c4 must have shape \[3, 8\]"):
        import_olmoe_npz(tmp_path / "mistral.npz", tmp_path / "e.trace")
    np.savez(tmp_path / "other.npz", expert_counts__c4=np.zeros((3, 8)))
    with pytest.raises(TraceError, match="other.npz: unknown model 'other'"):
        import_olmoe_npz(tmp_path / "other.npz", tmp_path / "f.trace")
    (tmp_path / "olmoe.npz").write_text("junk")
    with pytest.raises(TraceError, match="olmoe.npz: not a readable .npz archive"):
        import_olmoe_npz(tmp_path / "olmoe.npz", tmp_path / "g.trace")


def test_import_trace_registry_and_cli(tmp_path, capsys):
    assert set(IMPORTERS) == {"gpt-oss-npz", "gpt-oss-summaries", "olmoe-npz", "vllm-routed", "sglang-per-token",
                            "sglang-stat"}
    with pytest.raises(TraceError, match="unknown import format 'x'; known formats: gpt-oss-npz, "):
        import_trace("x", tmp_path, tmp_path / "o")
    src = _write_vllm_jsonl(tmp_path / "r.jsonl", _vllm_requests())
    with pytest.raises(TraceError, match="'vllm-routed' does not take --top-k"):
        import_trace("vllm-routed", src, tmp_path / "o", top_k=2)
    out = tmp_path / "v.trace"
    assert main(["trace", "import", "--format", "vllm-routed", str(src), str(out), "--model", "m",
                 "--num-experts", "8"]) == 0
    assert read_meta(out).num_experts == 8 and "imported" in capsys.readouterr().out
    assert main(["trace", "import", "--format", "vllm-routed", str(src), str(out), "--overwrite"]) == 0
    assert read_meta(out).num_experts == 6
    capsys.readouterr()
    assert main(["trace", "import", "--format", "bogus", str(src), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "unknown import format 'bogus'" in err and "sglang-per-token" in err
    assert main(["trace", "import", "--format", "sglang-stat", str(tmp_path / "missing.pt"), str(tmp_path / "c")]) == 2
    assert "missing.pt: no such file" in capsys.readouterr().err
