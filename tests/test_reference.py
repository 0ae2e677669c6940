"""The reference MoE model: training pipeline at toy size, the committed model, its prompts and its corpus split."""

from __future__ import annotations

import json
import re
from fractions import Fraction

import numpy as np
import pytest
import torch

from moeplace.models import corpus as C
from moeplace.models.reference import (
    HELDOUT_PROMPTS_FILE,
    MANIFEST_FILE,
    REFERENCE_DIR,
    builtin_prompts,
    load_reference,
    preset,
)

COMMITTED_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                         "tokenizer_config.json")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from moeplace.models.train import train_reference

    out = tmp_path_factory.mktemp("ref-tiny")
    metrics = train_reference(preset("tiny"), out, seed=0, progress=False, log=lambda _: None)
    return out, metrics


@pytest.mark.slow
def test_tiny_training_writes_a_loadable_model(tiny_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, metrics = tiny_run
    for name in (*COMMITTED_MODEL_FILES, HELDOUT_PROMPTS_FILE, MANIFEST_FILE, "train_metrics.json", "loss_curve.png"):
        assert (out / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert model.config.model_type == "qwen3_moe"
    ids = tok("def add(a, b):", return_tensors="pt")
    gen = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] > ids["input_ids"].shape[1]
    cfg = preset("tiny")
    assert metrics["steps"] == cfg.steps and len(metrics["history"]["loss"]) == cfg.steps
    assert all(np.isfinite(v) for v in metrics["heldout_ce_saved_weights"].values())
    rows = builtin_prompts(out)
    assert [r["domain"] for r in rows] == [d for d in C.DOMAINS for _ in range(cfg.prompts_per_domain)]


@pytest.mark.slow
def test_tiny_training_is_seeded(tiny_run, tmp_path):
    from moeplace.models.train import train_reference

    out, metrics = tiny_run
    again = train_reference(preset("tiny", steps=2, eval_every=1), tmp_path, seed=0, progress=False,
                            log=lambda _: None)
    assert again["history"]["loss"] == metrics["history"]["loss"][:2]
    assert (tmp_path / HELDOUT_PROMPTS_FILE).read_text() == (out / HELDOUT_PROMPTS_FILE).read_text()


def test_loss_includes_the_architecture_aux_loss():
    """The training loss (our per-sequence CE + coef * aux_loss) equals Qwen3MoeForCausalLM's own loss."""
    from transformers import Qwen3MoeForCausalLM

    from moeplace.models.train import sequence_ce

    torch.manual_seed(0)
    cfg = preset("tiny", router_aux_loss_coef=0.5)
    model = Qwen3MoeForCausalLM(cfg.qwen3_config(eos_token_id=0))
    ids = torch.randint(1, cfg.vocab_size, (3, 16))
    res = model(input_ids=ids, labels=ids, output_router_logits=True)
    assert res.aux_loss is not None and res.aux_loss.item() > 0
    ours = sequence_ce(res.logits, ids).mean() + model.router_aux_loss_coef * res.aux_loss
    torch.testing.assert_close(ours, res.loss)
    no_aux = model(input_ids=ids, labels=ids, output_router_logits=False).loss
    assert (res.loss - no_aux).item() == pytest.approx(0.5 * res.aux_loss.item(), rel=1e-4)


def test_committed_reference_loads_and_generates():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(REFERENCE_DIR, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(REFERENCE_DIR, local_files_only=True)
    c = model.config
    assert c.model_type == "qwen3_moe"
    assert c.num_hidden_layers >= 6 and not c.mlp_only_layers and c.decoder_sparse_step == 1
    assert c.num_experts >= 32 and c.num_experts_per_tok >= 4
    assert c.router_aux_loss_coef > 0
    model, tok = load_reference()
    ids = tok("Problem: What is 12 + 30?\nSolution:", return_tensors="pt")
    gen = model.generate(**ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(gen[0, ids["input_ids"].shape[1]:])
    assert gen.shape[1] == ids["input_ids"].shape[1] + 12 or tok.eos_token_id in gen[0].tolist()
    assert text.strip()


def test_committed_files_fit_the_size_budget():
    total = sum((REFERENCE_DIR / n).stat().st_size for n in COMMITTED_MODEL_FILES)
    assert total <= 25 * 1024 * 1024, f"{total / 2**20:.1f} MiB"


def test_default_trace_is_the_reference_on_its_heldout_prompts():
    from moeplace.trace.reader import trace_info

    path = REFERENCE_DIR.parent / "reference-default.trace"
    info = trace_info(path)
    assert info["model"] == "moeplace-reference" and not info["synthetic"] and info["complete"]
    assert (info["num_layers"], info["num_experts"], info["top_k"]) == (8, 32, 4)
    assert info["domains"] == {d: 250 for d in sorted(C.DOMAINS)}
    assert info["num_tokens"]["decode"] > 0 and info["size_bytes"] < 5 * 2**20


def test_builtin_prompts_cover_four_domains():
    rows = builtin_prompts()
    counts = {d: sum(r["domain"] == d for r in rows) for d in C.DOMAINS}
    assert set(r["domain"] for r in rows) == set(C.DOMAINS)
    assert all(n >= 200 for n in counts.values()), counts
    assert all(isinstance(r["prompt"], str) and r["prompt"].strip() for r in rows)
    assert len({r["doc_id"] for r in rows}) == len(rows)  # one prompt per held-out document


def test_heldout_prompts_come_from_heldout_documents():
    """Every prompt's document is in the manifest's held-out split, never in the training split, and both splits
    follow the recorded rule (a seed-free hash of the document id)."""
    manifest = json.loads((REFERENCE_DIR / MANIFEST_FILE).read_text())
    assert manifest["salt"] == C.SPLIT_SALT
    for dom, d in manifest["domains"].items():
        train, held = set(C.expand_ids(d["train_ids"])), set(C.expand_ids(d["heldout_ids"]))
        assert len(train) == d["train_documents"] and len(held) == d["heldout_documents"]
        assert not train & held, dom
        frac = d["heldout_fraction"]
        assert all(C.heldout_score(i) < frac for i in held)
        assert all(C.heldout_score(i) >= frac for i in train)
    for r in builtin_prompts():
        d = manifest["domains"][r["domain"]]
        assert r["doc_id"].startswith(r["domain"] + ":")
        assert r["doc_id"] in set(C.expand_ids(d["heldout_ids"]))


def test_heldout_prompt_text_is_not_in_the_training_text():
    """Rebuild the corpus from the installed packages: no chat, general or math prompt occurs verbatim in its
    domain's training documents (duplicates are dropped and chat is grouped by opening turn before the split).
    Code may share a few boilerplate lines across standard library files; at most 1% of its prompts do."""
    cfg = preset("default")
    corpus = C.build_corpus(dict(cfg.heldout_fraction), cfg.math_problems, cfg.data_seed)
    rows = builtin_prompts()
    for dom in C.DOMAINS:
        blob = "\x00".join(d.text for d in corpus.train[dom])
        found = sum(r["prompt"] in blob for r in rows if r["domain"] == dom)
        assert found <= (cfg.prompts_per_domain // 100 if dom == "code" else 0), (dom, found)
        held = {d.doc_id for d in corpus.heldout[dom]}
        assert all(r["doc_id"] in held for r in rows if r["domain"] == dom)


def test_duplicates_are_dropped_and_chat_grouped_by_opening_turn(tmp_path):
    (tmp_path / "a.yml").write_text(
        "conversations:\n- [Hi there, Hello]\n- [Hi there, Hello]\n- [hi  there, Hey you]\n- [How are you?, Fine]\n")
    docs, src = C.load_chat_documents(tmp_path)
    assert [d.doc_id for d in docs] == ["chat:a/0", "chat:a/3"]
    assert docs[0].text == "User: Hi there\nBot: Hello\n\nUser: hi there\nBot: Hey you"
    assert "1 exact duplicates dropped" in src.notes
    kept, dropped = C.drop_duplicates([C.Document("x:1", "x", "a"), C.Document("x:2", "x", "a")])
    assert [d.doc_id for d in kept] == ["x:1"] and dropped == 1


def test_split_is_independent_of_document_order_and_caps():
    docs = [C.Document(f"math:{i}", "math", "x") for i in range(500)]
    tr, he = C.split_documents(docs, 0.2)
    tr2, he2 = C.split_documents(docs[::-1], 0.2)
    assert [d.doc_id for d in he] == [d.doc_id for d in he2]
    assert {d.doc_id for d in tr} == {d.doc_id for d in tr2}
    with pytest.raises(ValueError, match="fraction"):
        C.split_documents(docs, 1.5)


def test_compress_ids_roundtrip():
    ids = ["math:0", "math:1", "math:2", "math:7", "chat:ai/3", "chat:ai/4", "code:json/decoder.py"]
    packed = C.compress_ids(ids)
    assert "math:0..2" in packed and "code:json/decoder.py" in packed
    assert sorted(C.expand_ids(packed)) == sorted(ids)


def _check_math(text: str) -> bool:
    """Recompute the answer of the problem kinds whose statement fully fixes it."""
    q = text.split("\n")[0]
    ans = text.split("\nAnswer: ")[1]
    if m := re.fullmatch(r"Problem: What is (-?\d+) ([+-]) (-?\d+)\?", q):
        a, b = int(m[1]), int(m[3])
        return int(ans) == (a + b if m[2] == "+" else a - b)
    if m := re.fullmatch(r"Problem: Compute (\d+) \* (\d+)\.", q):
        return int(ans) == int(m[1]) * int(m[2])
    if m := re.fullmatch(r"Problem: What is (\d+)% of (\d+)\?", q):
        return Fraction(ans) == Fraction(int(m[1]) * int(m[2]), 100)
    if m := re.fullmatch(r"Problem: Compute (\d+(?:/\d+)?) ([-+*]) (\d+(?:/\d+)?)\.", q):
        x, y = Fraction(m[1]), Fraction(m[3])
        return Fraction(ans) == {"+": x + y, "-": x - y, "*": x * y}[m[2]]
    if m := re.fullmatch(r"Problem: Solve x\^2(.*) = 0\.", q):
        roots = [int(v) for v in re.findall(r"x = (-?\d+)", ans)]
        poly = "x**2" + m[1].replace("x", "*x").replace(" *x", " 1*x")
        return all(eval(poly, {"x": r}) == 0 for r in roots)  # noqa: S307 (our own generated text)
    if m := re.fullmatch(r"Problem: Solve for x: (.*) = (.*)\.", q):
        x = int(ans.removeprefix("x = "))
        side = [eval(re.sub(r"(\d)x", r"\1*x", s), {"x": x}) for s in (m[1], m[2])]  # noqa: S307
        return side[0] == side[1]
    return True


def test_math_problems_have_correct_answers():
    docs = C.generate_math_problems(600, seed=3)
    assert len({d.text.split("\n")[0] for d in docs}) == 600
    assert all(_check_math(d.text) for d in docs)
    assert C.generate_math_problems(50, seed=3) == docs[:50]


def test_cli_registered():
    from moeplace.cli import build_parser, main

    args = build_parser().parse_args(["train-reference", "--config", "tiny", "--steps", "3", "--out", "x"])
    assert args.steps == 3 and args.config == "tiny"
    assert main(["train-reference", "--steps", "0", "--out", "x"]) == 2


def test_structure_script_on_a_trace_with_known_answers(tmp_path):
    """Each domain routes to its own two experts: the script must find perfect domain accuracy, the largest JSD
    (1 bit) and perfect prefill-decode agreement, and balanced load across the layer."""
    from conftest import load_script

    from moeplace.trace.types import Requests, TokenChunk, Trace, TraceMeta
    from moeplace.trace.writer import write_trace

    mod = load_script("reference_structure")

    rng = np.random.default_rng(0)
    doms, n_req, n_pre, n_dec = C.DOMAINS, 12, 6, 4
    rid, pos, phase, ids = [], [], [], []
    for r in range(len(doms) * n_req):
        d = r % len(doms)
        for t in range(n_pre + n_dec):
            rid.append(r)
            pos.append(t)
            phase.append(0 if t < n_pre else 1)
            ids.append([rng.permutation([2 * d, 2 * d + 1]) for _ in range(2)])  # [L=2, K=2]
    R = len(doms) * n_req
    trace = Trace(
        TraceMeta(model="synthetic", num_layers=2, num_experts=8, top_k=2, synthetic=True),
        Requests(np.arange(R), np.array([doms[r % 4] for r in range(R)], dtype=object),
                 np.array(["test"] * R, dtype=object), np.full(R, n_pre, np.int32), np.full(R, n_dec, np.int32)),
        TokenChunk(np.array(rid, np.int64), np.array(pos, np.int32), np.array(phase, np.int8),
                   np.array(ids, np.int16)),
    )
    write_trace(tmp_path / "t.trace", trace)
    s = mod.structure(str(tmp_path / "t.trace"))
    assert s["load"]["mean_max_over_mean"] == pytest.approx(1.0)
    assert s["domain"]["nearest_centroid_accuracy"] == 1.0
    assert s["domain"]["softmax_regression_accuracy"] == 1.0
    assert s["domain"]["jsd_bits_mean"] == pytest.approx(1.0)
    assert s["prefill_decode"]["pearson_mean"] == pytest.approx(1.0)
    assert "| majority baseline | 0.250 |" in mod.markdown(s)


def test_trace_record_on_the_reference_model_tags_every_request(tmp_path):
    """`moeplace trace record --model reference` gives prefill and decode rows for every request, domain tagged."""
    import json

    import numpy as np

    from moeplace.cli import main
    from moeplace.trace import PREFILL, read_trace

    rows = builtin_prompts()
    picked = [next(r for r in rows if r["domain"] == d) for d in sorted(C.DOMAINS)] * 2
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"], "domain": r["domain"]}) + "\n" for r in picked))
    out = tmp_path / "rec.trace"
    assert main(["trace", "record", "--model", "reference", "--prompts", str(prompts), "--max-new-tokens", "4",
                 "--batch-size", "4", str(out)]) == 0
    tr = read_trace(out)
    assert len(tr.requests) == len(picked)
    assert sorted(tr.requests.domain.tolist()) == sorted(r["domain"] for r in picked)
    for rid, dom, plen in zip(tr.requests.request_id, tr.requests.domain, tr.requests.prompt_len, strict=True):
        mine = tr.tokens.request_id == rid
        pre = mine & (tr.tokens.phase == PREFILL)
        assert pre.sum() == plen > 0, f"request {rid} ({dom})"
        assert (mine & ~pre).sum() >= 1, f"request {rid} ({dom}) has no decode rows"
        np.testing.assert_array_equal(np.sort(tr.tokens.position[pre]), np.arange(plen))


def test_trace_record_bad_prompt_file_is_a_clear_error(tmp_path, capsys):
    from moeplace.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "def f():", "domain": "code"}\n{"domain": "math"}\n')
    assert main(["trace", "record", "--model", "reference", "--prompts", str(bad), "--max-new-tokens", "2",
                 str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err and "prompt" in err
