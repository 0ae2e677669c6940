"""scripts/prefill_trace.py end to end at a tiny --target-tokens: prefill rows only, the requested token count,
held-out documents only, resumable pieces, an existing output skipped."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from moeplace.trace import PREFILL, read_trace

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("prefill_trace", ROOT / "scripts" / "prefill_trace.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture()
def cached_corpus(monkeypatch):
    """Build the fine-grained corpus once for all runs of this test (it takes seconds)."""
    import moeplace.models.train as train

    monkeypatch.setattr(train, "corpus_of", functools.lru_cache(maxsize=2)(train.corpus_of))


def test_prefill_trace_end_to_end_resume_and_skip(script, cached_corpus, tmp_path, capsys, monkeypatch):
    import moeplace.trace.capture as capture
    from moeplace.models.corpus import expand_ids

    out = tmp_path / "fg-prefill.trace"
    argv = ["--model", "reference-fg", "--target-tokens", "3000", "--piece-tokens", "1000", "--out", str(out)]
    real, calls = capture.record_prefill, []

    def stop_after_first(*a, **k):  # a kill during the second piece
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(capture, "record_prefill", stop_after_first)
    assert script.main(argv) == 130
    assert "rerun the same command to resume" in capsys.readouterr().err
    assert not out.exists()  # atomic: nothing at the output until it is complete
    build = tmp_path / ".fg-prefill.trace.build"
    assert script.complete_trace(build / "piece-00000.trace")

    calls.clear()
    monkeypatch.setattr(capture, "record_prefill", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    assert script.main(argv) == 0
    log = capsys.readouterr().out
    assert "resuming:" in log and "ETA" in log and "not shipped" in log
    pieces = int(log.split(" pieces\n")[0].rsplit(";", 1)[1])
    assert len(calls) == pieces - 1  # the finished piece was reused
    assert not build.exists()

    tr = read_trace(out)
    assert tr.meta.complete and len(tr.tokens) == 3000 and int(tr.requests.prompt_len.sum()) == 3000
    assert (tr.tokens.phase == PREFILL).all() and (tr.requests.gen_len == 0).all()
    assert tr.tokens.expert_weights is None and tr.meta.num_layers == 12 and tr.meta.top_k == 6
    assert tr.requests.request_id.tolist() == list(range(len(tr.requests)))
    assert set(tr.requests.domain) == {"code", "chat", "general", "math"}  # a tiny target still mixes domains
    assert tr.requests.prompt_len[:-1].min() >= 128 and tr.requests.prompt_len.max() <= 256
    for rid, n in zip(tr.requests.request_id, tr.requests.prompt_len, strict=True):
        np.testing.assert_array_equal(tr.tokens.position[tr.tokens.request_id == rid], np.arange(n))
    info = tr.meta.extra["prefill_trace"]
    assert info["shipped"] is False and info["prompt_tokens"] == 3000 and info["target_tokens"] == 3000
    assert "not shipped" in (out / "README.md").read_text()
    manifest = json.loads((ROOT / "src/moeplace/data/reference-fg/corpus_manifest.json").read_text())
    docs = json.loads((out / "docs.json").read_text())
    for dom, d in docs.items():  # every document used was held out of training
        used = set(expand_ids(d["without_shipped_prompt"] + d["with_shipped_prompt"]))
        assert used and used <= set(expand_ids(manifest["domains"][dom]["heldout_ids"]))
    assert info["documents_without_shipped_prompt"] > info["documents_with_shipped_prompt"]

    assert script.main(argv) == 0  # already built: skipped, nothing loaded
    assert "already built" in capsys.readouterr().out


def test_prefill_trace_bad_input_is_one_line(script, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        script.main(["--min-tokens", "300", "--max-tokens", "200", "--out", str(tmp_path / "x.trace")])
    assert e.value.code == 2 and "--min-tokens 300 exceeds --max-tokens 200" in capsys.readouterr().err
    assert script.main(["--max-tokens", "600", "--out", str(tmp_path / "x.trace")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exceeds the model's 512 positions" in err[0]
    (tmp_path / "junk.trace").mkdir()
    (tmp_path / "junk.trace" / "f").write_text("x")
    assert script.main(["--out", str(tmp_path / "junk.trace")]) == 2
    assert "not a complete trace" in capsys.readouterr().err


def test_prefill_trace_refuses_a_second_run_on_the_same_output(script, tmp_path, capsys):
    out = tmp_path / "x.trace"
    held = script.lock(out)  # as if another run were building it
    try:
        assert script.main(["--out", str(out)]) == 2
        assert "another prefill_trace.py" in capsys.readouterr().err
    finally:
        held.close()
