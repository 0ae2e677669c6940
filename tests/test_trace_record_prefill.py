"""`moeplace trace record --max-new-tokens 0`: prefill-only recording through batched forwards (record_prefill).

The rows must be the ones the generate path records for the prompt tokens: same requests, positions, expert ids.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moeplace.trace import PREFILL, TraceWriter, read_trace
from moeplace.trace.capture import prefill_batches, record_generate, record_prefill, trace_meta

transformers = pytest.importorskip("transformers")


def _rows(path):
    """(request ids, positions, expert ids sorted within each token's top-k, weights) of the prefill rows, in
    (request, position) order."""
    t = read_trace(path).tokens
    pre = t.phase == PREFILL
    o = np.lexsort((t.position[pre], t.request_id[pre]))
    w = None if t.expert_weights is None else t.expert_weights[pre][o]
    return t.request_id[pre][o], t.position[pre][o], t.expert_ids[pre][o], w


@pytest.fixture(scope="module")
def reference():
    from moeplace.models.reference import builtin_prompts, load_reference

    torch.set_num_threads(1)
    model, tokenizer = load_reference()
    rows = builtin_prompts()
    picked = [next(r for r in rows if r["domain"] == d) for d in ("code", "chat", "general", "math")]
    return model, tokenizer, picked


def test_prefill_path_routes_exactly_as_the_generate_path(reference, tmp_path):
    """Four held-out prompts of different lengths through the shipped reference model: generate (left-padded
    batch of 4) and record_prefill (right-padded, length-sorted forwards of 2 sequences) give identical rows."""
    model, tokenizer, picked = reference
    prompts = [r["prompt"] for r in picked]
    lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
    assert len(set(lengths)) > 1  # padding really happens
    meta = trace_meta(model)
    with TraceWriter(tmp_path / "gen.trace", meta) as w:
        record_generate(model, tokenizer, prompts, w, max_new_tokens=2, batch_size=4)
    with TraceWriter(tmp_path / "pre.trace", meta) as w:
        s = record_prefill(model, tokenizer, prompts, w, batch_size=2, flush_every=3)
    assert s["prefill_tokens"] == sum(lengths) and s["decode_tokens"] == 0 and s["forwards"] == 3
    gen, pre = _rows(tmp_path / "gen.trace"), _rows(tmp_path / "pre.trace")
    np.testing.assert_array_equal(gen[0], pre[0])
    np.testing.assert_array_equal(gen[1], pre[1])
    np.testing.assert_array_equal(gen[2], pre[2])  # expert ids, exactly, in router order
    np.testing.assert_allclose(gen[3].astype(np.float32), pre[3].astype(np.float32), atol=2e-3)
    tr = read_trace(tmp_path / "pre.trace")
    assert (tr.tokens.phase == PREFILL).all() and (tr.requests.gen_len == 0).all()
    assert tr.requests.request_id.tolist() == [0, 1, 2, 3] and tr.requests.prompt_len.tolist() == lengths
    assert np.all(np.diff(tr.tokens.request_id) >= 0)  # written in request order, whatever the forward order
    assert tr.meta.complete


def test_prefill_batches_sort_by_length_and_respect_both_limits():
    lengths = [5, 40, 7, 39, 6, 100]
    got = prefill_batches(lengths, batch_tokens=80)
    assert [b.tolist() for b in got] == [[5], [1, 3], [2, 4, 0]]  # longest first; 100 > 80 gets its own forward
    assert all(len(b) * max(lengths[i] for i in b) <= 80 for b in got[1:])
    assert [len(b) for b in prefill_batches(lengths, batch_tokens=10_000, batch_size=4)] == [4, 2]
    assert sorted(np.concatenate(got).tolist()) == list(range(6))


def test_record_prefill_sampling_and_bad_input(reference, tmp_path):
    model, tokenizer, picked = reference
    prompts = [r["prompt"] for r in picked] * 3
    with TraceWriter(tmp_path / "s.trace", trace_meta(model, sample_every=2, record_weights=False)) as w:
        s = record_prefill(model, tokenizer, prompts, w)
    from moeplace.trace.capture import sample_mask

    want = np.flatnonzero(sample_mask(np.arange(len(prompts)), 2))
    assert read_trace(tmp_path / "s.trace").requests.request_id.tolist() == want.tolist()
    assert s["requests"] == len(want)
    with TraceWriter(tmp_path / "x.trace", trace_meta(model)) as w:
        with pytest.raises(ValueError, match="batch_tokens"):
            record_prefill(model, tokenizer, prompts, w, batch_tokens=0)
        with pytest.raises(ValueError, match="no prompts"):
            record_prefill(model, tokenizer, [], w)
        with pytest.raises(ValueError, match="512 positions"):
            record_prefill(model, None, [[3] * 513], w)
        with pytest.raises(ValueError, match="request_ids repeat"):
            record_prefill(model, tokenizer, prompts[:2], w, request_ids=[1, 1])


def test_cli_prefill_only(reference, tmp_path, capsys):
    from moeplace.cli import main

    _, tokenizer, picked = reference
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": r["prompt"], "domain": r["domain"]}) + "\n" for r in picked))
    out = tmp_path / "pre.trace"
    rc = main(["trace", "record", "--model", "reference", "--prompts", str(f), "--max-new-tokens", "0",
               "--no-weights", "--batch-tokens", "64", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    tr = read_trace(out)
    lengths = [len(tokenizer(r["prompt"])["input_ids"]) for r in picked]
    assert tr.requests.prompt_len.tolist() == lengths and (tr.requests.gen_len == 0).all()
    assert len(tr.tokens) == sum(lengths) and (tr.tokens.phase == PREFILL).all() and tr.meta.complete
    assert "prefill only" in tr.meta.extra["phases"]
    assert f"recorded 4 requests ({sum(lengths)} prefill + 0 decode tokens" in captured.out
    assert "prompt tokens/s" in captured.out
    assert "tokens |" in captured.err and "ETA" in captured.err and "4/4 requests" in captured.err
    # one line, exit 2: --batch-tokens without --max-new-tokens 0, and a negative --max-new-tokens
    assert main(["trace", "record", "--model", "reference", "--prompts", str(f), "--max-new-tokens", "2",
                 "--batch-tokens", "64", str(tmp_path / "o.trace")]) == 2
    assert "--batch-tokens applies to --max-new-tokens 0 only" in capsys.readouterr().err
    assert main(["trace", "record", "--model", "reference", "--prompts", str(f), "--max-new-tokens", "-1",
                 str(tmp_path / "o.trace")]) == 2
    assert "--max-new-tokens" in capsys.readouterr().err
