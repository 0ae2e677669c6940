"""Capture from live transformers MoE models: exact routing per architecture, rows per request, sampling, CLI.

Every model here is a tiny randomly initialised config built offline; nothing is downloaded.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from moeplace.trace import DECODE, PREFILL, TraceWriter, read_trace
from moeplace.trace.capture import (
    NullRecorder,
    RoutingRecorder,
    find_routers,
    load_prompts,
    record_generate,
    sample_mask,
    trace_meta,
)

transformers = pytest.importorskip("transformers")

VOCAB = 64
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


def tiny_config(arch: str):
    """A 3-layer config with hidden 32 and 8 or 16 experts."""
    t = transformers
    if arch == "mixtral":
        return t.MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2)
    if arch == "qwen2_moe":  # layer 1 dense (mlp_only_layers), one gated shared expert
        return t.Qwen2MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=False)
    if arch == "qwen3_moe":
        return t.Qwen3MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                head_dim=8, norm_topk_prob=True)
    if arch == "olmoe":
        return t.OlmoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2, pad_token_id=0, eos_token_id=1)
    if arch == "deepseek_v3":  # first layer dense, 16 experts in 4 groups, 2 groups kept, top-4
        return t.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, n_routed_experts=16,
                                  num_experts_per_tok=4, moe_intermediate_size=32, n_shared_experts=1, n_group=4,
                                  topk_group=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5)
    if arch == "gpt_oss":
        return t.GptOssConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2, head_dim=8, sliding_window=16,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raise AssertionError(arch)


def tiny_model(arch: str, seed: int = 0):
    """Random-init model with random (nonzero) router weights and biases; EOS off so generation runs to the end."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
    with torch.no_grad():
        for _, _, r in find_routers(model):
            r.weight.normal_(0.0, 1.0)
            if getattr(r, "bias", None) is not None:
                r.bias.normal_(0.0, 1.0)
            if hasattr(r, "e_score_correction_bias"):
                r.e_score_correction_bias.normal_(0.0, 0.3)
    model.generation_config.eos_token_id = None
    return model


# --------------------------------------------------------------------------------------------------- reference rules


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def _topk(score: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """ids [N, k] of the k largest scores and the margin between the k-th and (k+1)-th (near-tie detector)."""
    order = np.argsort(-score, axis=-1, kind="stable")
    srt = np.take_along_axis(score, order, -1)
    margin = srt[:, k - 1] - srt[:, k] if score.shape[1] > k else np.full(len(score), np.inf)
    return order[:, :k], margin


def reference_routing(arch: str, router, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each architecture's published rule in numpy: (ids [N, K], weights [N, K], margin [N]) from hidden h [N, H]."""
    W = router.weight.detach().double().numpy()
    k = router.top_k
    logits = h @ W.T
    if arch in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):  # softmax, then top-k
        p = _softmax(logits)
        ids, margin = _topk(p, k)
        w = np.take_along_axis(p, ids, -1)
        if arch == "mixtral" or router.norm_topk_prob:
            w = w / w.sum(-1, keepdims=True)
        return ids, w, margin
    if arch == "deepseek_v3":  # sigmoid + correction bias, group-limited top-k
        s = 1.0 / (1.0 + np.exp(-logits))
        c = s + router.e_score_correction_bias.detach().double().numpy()
        G, TG = router.num_group, router.topk_group
        grouped = np.sort(c.reshape(len(c), G, -1), axis=-1)
        gscore = grouped[..., -2:].sum(-1)  # sum of the two best experts of each group
        gids, gmargin = _topk(gscore, TG)
        allowed = np.zeros_like(gscore, dtype=bool)
        np.put_along_axis(allowed, gids, True, -1)
        c = np.where(np.repeat(allowed, c.shape[1] // G, axis=1), c, -np.inf)
        ids, margin = _topk(c, k)
        w = np.take_along_axis(s, ids, -1)
        if router.norm_topk_prob:
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
        return ids, w * router.routed_scaling_factor, np.minimum(margin, gmargin)
    if arch == "gpt_oss":  # top-k over logits with bias, softmax over the k chosen
        logits = logits + router.bias.detach().double().numpy()
        ids, margin = _topk(logits, k)
        return ids, _softmax(np.take_along_axis(logits, ids, -1)), margin
    raise AssertionError(arch)


ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"]
EXPECTED_MAP = {"qwen2_moe": [0, 2], "deepseek_v3": [1, 2]}


@pytest.mark.parametrize("arch", ARCHS)
def test_recorded_ids_equal_reference_rule(arch):
    model = tiny_model(arch)
    routers = find_routers(model)
    meta = trace_meta(model)
    assert meta.moe_layer_map == EXPECTED_MAP.get(arch, [0, 1, 2])
    assert meta.num_layers == len(meta.moe_layer_map) and meta.hidden_size == 32 and meta.has_weights
    assert (meta.num_experts, meta.top_k) == ((16, 4) if arch == "deepseek_v3" else (8, 2))
    assert meta.num_shared_experts == (1 if arch in ("qwen2_moe", "deepseek_v3") else 0)

    seen: list[list[np.ndarray]] = [[] for _ in routers]  # router inputs per layer, one [N, H] per forward
    handles = [r.register_forward_pre_hook(lambda m, a, slot=i: seen[slot].append(
        a[0].detach().reshape(-1, a[0].shape[-1]).double().numpy())) for i, (_, _, r) in enumerate(routers)]
    B, S, new = 2, 6, 4
    inp = torch.randint(2, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    try:
        with RoutingRecorder(model) as rec:
            rec.begin_batch([10, 11])
            with torch.no_grad():
                out = model.generate(input_ids=inp, attention_mask=torch.ones_like(inp), max_new_tokens=new,
                                     do_sample=False, pad_token_id=0)
            cb = rec.end_batch(out)
    finally:
        for h in handles:
            h.remove()
    tk = cb.tokens
    assert len(tk) == B * S + B * (new - 1)  # unpadded: rows follow the router rows forward by forward
    checked = 0
    for li, (_, _, r) in enumerate(routers):
        h = np.concatenate(seen[li])
        ids, w, margin = reference_routing(arch, r, h)
        clear = margin > 1e-5  # skip numerical near-ties (none expected with random weights)
        assert clear.mean() > 0.9
        got = tk.expert_ids[:, li].astype(np.int64)
        assert np.array_equal(np.sort(got[clear], -1), np.sort(ids[clear], -1)), f"{arch} layer {li}"
        if arch != "deepseek_v3":  # torch.topk sorted: router order is descending score (DeepSeek's is unsorted)
            assert np.array_equal(got[clear], ids[clear])
        # weights follow the ids (compare after aligning by expert id); float16 storage
        og, orf = np.argsort(got, -1), np.argsort(ids, -1)
        gw = np.take_along_axis(tk.expert_weights[:, li].astype(np.float64), og, -1)
        rw = np.take_along_axis(w, orf, -1)
        np.testing.assert_allclose(gw[clear], rw[clear], rtol=2e-3, atol=2e-3)
        checked += int(clear.sum())
    assert checked > 0


# --------------------------------------------------------------------------------------------------- rows per request


@pytest.fixture(scope="module")
def qwen3():
    return tiny_model("qwen3_moe", seed=3)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, n).tolist() for n in lengths]


def test_padded_batch_rows_per_request(qwen3, tmp_path):
    lengths, new = [3, 7, 5, 1], 5
    meta = trace_meta(qwen3, model_name="tiny-qwen3")
    with TraceWriter(tmp_path / "t.trace", meta) as w:
        summary = record_generate(qwen3, None, _prompts(lengths), w, domains=["code", "math", "chat", "code"],
                                  request_ids=[40, 41, 42, 43], max_new_tokens=new, batch_size=4)
    tr = read_trace(tmp_path / "t.trace")
    assert tr.meta.model == "tiny-qwen3" and tr.meta.complete
    rq = tr.requests
    assert rq.request_id.tolist() == [40, 41, 42, 43]
    assert rq.domain.tolist() == ["code", "math", "chat", "code"]
    assert rq.prompt_len.tolist() == lengths and rq.gen_len.tolist() == [new - 1] * 4
    tk = tr.tokens
    for rid, n in zip([40, 41, 42, 43], lengths, strict=True):
        pre = (tk.request_id == rid) & (tk.phase == PREFILL)
        dec = (tk.request_id == rid) & (tk.phase == DECODE)
        assert tk.position[pre].tolist() == list(range(n))
        assert tk.position[dec].tolist() == list(range(n, n + new - 1))
    assert summary["prefill_tokens"] == sum(lengths) and summary["decode_tokens"] == 4 * (new - 1)


def test_padding_does_not_leak_into_rows(qwen3):
    """Routing of a prompt's real tokens in a padded batch equals its routing alone (ids of the same tokens)."""
    p = _prompts([2, 6], seed=5)
    recs = []
    for batch in ([p[0]], p):
        with RoutingRecorder(qwen3) as rec:
            width = max(map(len, batch))
            inp = torch.tensor([[0] * (width - len(t)) + t for t in batch])
            mask = torch.tensor([[0] * (width - len(t)) + [1] * len(t) for t in batch])
            rec.begin_batch(list(range(len(batch))))
            with torch.no_grad():
                qwen3(input_ids=inp, attention_mask=mask)
            recs.append(rec.end_batch())
    alone, padded = recs[0].tokens, recs[1].tokens
    sel = padded.request_id == 0
    assert len(alone) == 2 and sel.sum() == 2
    assert np.array_equal(np.sort(alone.expert_ids, -1), np.sort(padded.expert_ids[sel], -1))
    assert padded.phase.tolist() == [PREFILL] * 8


def test_tokens_after_eos_are_not_recorded(qwen3):
    prompts = _prompts([4, 4, 2], seed=7)
    width = 4
    inp = torch.tensor([[0] * (width - len(t)) + t for t in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(t) for t in prompts])[:, None]).long()
    kw = dict(input_ids=inp, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        free = qwen3.generate(**kw)
    g0 = free[0, width:].tolist()
    stop = next(j for j in range(1, len(g0) - 1) if g0[j] not in g0[:j])  # a token sequence 0 first makes at j
    eos = g0[stop]
    with RoutingRecorder(qwen3, eos_token_id=eos) as rec:
        rec.begin_batch([0, 1, 2], prompt_width=width)
        with torch.no_grad():
            out = qwen3.generate(**kw, eos_token_id=eos)
        cb = rec.end_batch(out)
    gen = out[:, width:].numpy()
    for b in range(3):  # decode rows: generated tokens fed back before EOS, never the last generated one
        hit = np.flatnonzero(gen[b] == eos)
        first = hit[0] if len(hit) else gen.shape[1]
        want = min(first, gen.shape[1] - 1)
        assert cb.gen_len[b] == want
        dec = (cb.tokens.request_id == b) & (cb.tokens.phase == DECODE)
        assert cb.tokens.position[dec].tolist() == list(range(len(prompts[b]), len(prompts[b]) + want))
    assert cb.gen_len[0] == stop < 5


# --------------------------------------------------------------------------------------------------- sampling, no-op


def test_sample_mask_deterministic_and_near_rate():
    ids = np.arange(30000)
    m = sample_mask(ids, 4)
    assert np.array_equal(m, sample_mask(ids, 4))
    assert abs(m.mean() - 0.25) < 0.01
    assert np.array_equal(sample_mask(ids[::-1], 4), m[::-1])  # per id, not per position
    for k in range(4):  # no aliasing with a period-4 pattern of ids
        assert abs(m[k::4].mean() - 0.25) < 0.02
    assert sample_mask([5, 9], 1).all()
    with pytest.raises(ValueError, match="sample_every"):
        sample_mask([1], 0)


def test_sampling_records_one_in_n(qwen3, tmp_path):
    rids = list(range(100, 112))
    meta = trace_meta(qwen3, sample_every=3)
    assert meta.sampling_rate == pytest.approx(1 / 3)
    with TraceWriter(tmp_path / "s.trace", meta) as w:
        s = record_generate(qwen3, None, _prompts([3] * 12), w, request_ids=rids, max_new_tokens=2)
    tr = read_trace(tmp_path / "s.trace")
    want = np.asarray(rids)[sample_mask(rids, 3)]
    assert 0 < len(want) < 12 and tr.requests.request_id.tolist() == want.tolist() and s["requests"] == len(want)
    assert set(np.unique(tr.tokens.request_id).tolist()) == set(want.tolist())
    assert tr.meta.sampling_rate == pytest.approx(1 / 3)


def _hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_null_recorder_adds_no_hooks_and_recorder_removes_its_own(qwen3):
    before = _hook_count(qwen3)
    with NullRecorder(qwen3) as rec:
        assert _hook_count(qwen3) == before
        rec.begin_batch([0])
        qwen3(input_ids=torch.tensor([[3, 4]]))
        assert rec.end_batch() is None
    with RoutingRecorder(qwen3) as rec:
        assert _hook_count(qwen3) == before + len(find_routers(qwen3)) + 2
    assert _hook_count(qwen3) == before


def test_forwards_outside_a_batch_are_not_recorded(qwen3):
    with RoutingRecorder(qwen3) as rec:
        with torch.no_grad():
            qwen3(input_ids=torch.tensor([[3, 4, 5]]))
        rec.begin_batch([1])
        with torch.no_grad():
            qwen3(input_ids=torch.tensor([[3, 4]]))
        cb = rec.end_batch()
    assert len(cb.tokens) == 2 and cb.tokens.position.tolist() == [0, 1]


def test_bad_input_errors(qwen3, tmp_path):
    with pytest.raises(ValueError, match="no MoE router"):
        find_routers(torch.nn.Linear(2, 2))
    with RoutingRecorder(qwen3) as rec:
        with pytest.raises(ValueError, match="repeat"):
            rec.begin_batch([1, 1])
        with pytest.raises(ValueError, match="no batch in progress"):
            rec.end_batch()
    meta = trace_meta(qwen3)
    with TraceWriter(tmp_path / "x.trace", meta) as w:
        with pytest.raises(ValueError, match="max_new_tokens"):
            record_generate(qwen3, None, [[3, 4]], w, max_new_tokens=0)
        with pytest.raises(ValueError, match="text but no tokenizer"):
            record_generate(qwen3, None, ["hello"], w)
        with pytest.raises(ValueError, match="domains has 2 entries"):
            record_generate(qwen3, None, [[3, 4]], w, domains=["a", "b"])


# --------------------------------------------------------------------------------------------------- CLI


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "the a code math chat def return x y z plus minus equals hello world how are you".split()
    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                eos_token="[EOS]")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-mixtral")
    model = tiny_model("mixtral", seed=2)
    model.generation_config.eos_token_id = 1
    model.save_pretrained(d)
    _tiny_tokenizer().save_pretrained(d)
    return d


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_cli_record(model_dir, tmp_path, capsys):
    from moeplace.cli import main

    prompts = _write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "def x return y", "domain": "code"},
        {"prompt": "x plus y equals z", "domain": "math"},
        "",
        {"prompt": "hello how are you", "domain": "chat"},
        {"prompt": "the world"},
    ])
    out = tmp_path / "rec.trace"
    rc = main(["trace", "record", "--model", str(model_dir), "--prompts", str(prompts), "--max-new-tokens", "3",
               "--batch-size", "3", str(out)])
    assert rc == 0, capsys.readouterr().err
    tr = read_trace(out)
    assert tr.meta.num_layers == 3 and tr.meta.num_experts == 8 and tr.meta.top_k == 2 and tr.meta.complete
    assert tr.requests.domain.tolist() == ["code", "math", "chat", "unknown"]
    assert tr.requests.prompt_len.tolist() == [4, 5, 4, 2]
    assert (tr.requests.gen_len <= 2).all()
    captured = capsys.readouterr()
    assert "recorded 4 requests" in captured.out
    assert "4/4 requests" in captured.err and "ETA" in captured.err  # the progress bar estimates the time left
    rc = main(["trace", "record", "--model", str(model_dir), "--prompts", str(prompts), "--max-new-tokens", "3",
               "--max-requests", "2", "--sample-every", "1", str(tmp_path / "two.trace")])
    assert rc == 0, capsys.readouterr().err
    two = read_trace(tmp_path / "two.trace")
    assert two.requests.domain.tolist() == ["code", "math"]  # the first 2 requests, in prompt order
    assert "recorded 2 requests" in capsys.readouterr().out
    assert main(["trace", "record", "--model", str(model_dir), "--prompts", str(prompts), "--max-new-tokens", "3",
                 "--max-requests", "0", str(tmp_path / "none.trace")]) == 2
    assert "--max-requests" in capsys.readouterr().err


def test_cli_help_has_example(capsys):
    from moeplace.cli import main

    assert main(["trace", "record", "--help"]) == 0
    text = capsys.readouterr().out
    assert "example" in text and "--sample-every" in text and "--model reference" in text


@pytest.mark.parametrize("content, message", [
    (None, "no such prompts file"),
    ([{"prompt": "x"}, "{not json"], ":2: invalid JSON"),
    ([{"text": "x"}], ':1: missing "prompt" key'),
    ([], "no prompts (empty file)"),
    ([["x"]], ":1: expected a JSON object"),
])
def test_cli_bad_prompt_files(model_dir, tmp_path, capsys, content, message):
    from moeplace.cli import main

    f = tmp_path / "bad.jsonl"
    if content is not None:
        _write_jsonl(f, content)
    rc = main(["trace", "record", "--model", str(model_dir), "--prompts", str(f), "--max-new-tokens", "2",
               str(tmp_path / "o.trace")])
    err = capsys.readouterr().err
    assert rc == 2 and str(f) in err and message in err
    with pytest.raises(ValueError, match="bad.jsonl"):
        load_prompts(f)


def test_cli_bad_model_dir_and_missing_reference(tmp_path, capsys, monkeypatch):
    from moeplace.cli import main

    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    rc = main(["trace", "record", "--model", str(tmp_path / "nope"), "--prompts", str(prompts),
               "--max-new-tokens", "2", str(tmp_path / "o.trace")])
    assert rc == 2 and "nope" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "moeplace.models.reference", None)  # as if the module were absent
    rc = main(["trace", "record", "--model", "reference", "--prompts", "builtin", "--max-new-tokens", "2",
               str(tmp_path / "o.trace")])
    assert rc == 2 and "reference model is not available" in capsys.readouterr().err


def test_docs_example(model_dir, tmp_path):
    """The tested example of docs/CAPTURE.md runs as written, on the tiny saved model."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "CAPTURE.md").read_text()
    code = re.search(r"<!-- tested-example -->\n```python\n(.*?)```", doc, re.S).group(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ns = {"model": model, "tokenizer": tokenizer, "out_dir": tmp_path}
    exec(compile(code, "docs/CAPTURE.md", "exec"), ns)
    assert ns["summary"]["requests"] == 3
    assert ns["trace"].tokens.expert_ids.shape[1:] == (3, 2)
    assert ns["trace"].requests.domain.tolist() == ["code", "chat", "math"]
