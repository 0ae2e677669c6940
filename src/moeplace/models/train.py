"""Train a reference model from scratch: corpus -> tokenizer -> Qwen3-MoE or DeepSeek-V3 -> saved folder.

Shape legend: B = sequences per batch, S = tokens per sequence (seq_len), V = vocabulary, N = tokens of a stream.

Everything is seeded: the corpus and its split do not depend on ``seed`` (see :mod:`moeplace.models.corpus`);
``seed`` sets the weight init, the document order of the training streams and the batch windows. The loss is the
architecture's own: token cross-entropy plus ``router_aux_loss_coef`` times the load-balancing loss that
``Qwen3MoeForCausalLM`` returns as ``aux_loss`` when ``output_router_logits=True`` (the same sum its ``loss`` holds
when given labels; tests/test_reference.py checks the two agree). A DeepSeek-V3 config (``arch="deepseek_v3"``,
the fine-grained model) has no auxiliary loss: its loss is the cross-entropy alone, and after every optimizer step
each router's selection bias moves by ``bias_update_speed`` against that step's expert load
(:mod:`moeplace.models.balancing`).

The output folder holds what :func:`moeplace.models.reference.load_reference` reads (config.json,
generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json), plus heldout_prompts.jsonl,
corpus_manifest.json, train_metrics.json and loss_curve.png.
"""

from __future__ import annotations

import json
import math
import platform
import random
import shutil
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from moeplace.models.balancing import RoutedLoadCounter, bias_routers, max_over_mean, update_router_biases
from moeplace.models.corpus import DOMAINS, Corpus, build_corpus, corpus_manifest, heldout_prompts, heldout_score
from moeplace.models.reference import (
    EOS_TOKEN,
    HELDOUT_PROMPTS_FILE,
    MANIFEST_FILE,
    METRICS_FILE,
    ReferenceConfig,
)

LOSS_CURVE_FILE = "loss_curve.png"


# ------------------------------------------------------------------------------------------------ tokenizer


def train_tokenizer(corpus: Corpus, cfg: ReferenceConfig):
    """A byte-level BPE (GPT-2 style pre-tokenizer) learnt from the training split only, up to
    ``cfg.tokenizer_bytes`` of text per domain so no domain dominates the merges. Returns a
    ``PreTrainedTokenizerFast`` whose bos/eos/pad token is ``<|endoftext|>`` (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts: list[str] = []
    for dom in DOMAINS:
        used = 0
        for doc in sorted(corpus.train[dom], key=lambda d: heldout_score(d.doc_id)):
            if used >= cfg.tokenizer_bytes:
                break
            texts.append(doc.text)
            used += len(doc.text.encode())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ValueError(f"tokenizer learnt {tok.get_vocab_size()} tokens, more than vocab_size={cfg.vocab_size}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
        model_max_length=cfg.max_position_embeddings, clean_up_tokenization_spaces=False,
    )


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


def token_stream(tokenizer, texts: list[str], eos_id: int) -> np.ndarray:
    """The documents' tokens, each followed by eos: int64 [N]."""
    out: list[int] = []
    for ids in _encode(tokenizer, texts):
        out.extend(ids)
        out.append(eos_id)
    return np.asarray(out, dtype=np.int64)


def first_windows(texts: list[str], tokenizer, cfg: ReferenceConfig, eos_id: int) -> torch.Tensor:
    """The first ``eval_seqs`` non-overlapping windows of ``seq_len`` tokens of the texts' stream (documents joined
    by EOS; only as many encoded as the windows need): int64 [n, S], n = 0 when the text is shorter than one."""
    parts, have, want = [], 0, cfg.eval_seqs * cfg.seq_len
    for i in range(0, len(texts), 16):
        parts.append(token_stream(tokenizer, texts[i:i + 16], eos_id))
        have += len(parts[-1])
        if have >= want:
            break
    stream = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    n = min(cfg.eval_seqs, len(stream) // cfg.seq_len)
    return torch.from_numpy(stream[: n * cfg.seq_len].reshape(n, cfg.seq_len))


def eval_batches(corpus: Corpus, tokenizer, cfg: ReferenceConfig, eos_id: int) -> dict[str, torch.Tensor]:
    """Per domain, the first ``eval_seqs`` non-overlapping windows of the held-out stream: int64 [n, S]."""
    out = {}
    for dom in DOMAINS:
        out[dom] = first_windows([d.text for d in corpus.heldout[dom]], tokenizer, cfg, eos_id)
        if not len(out[dom]):
            raise ValueError(f"domain {dom!r}: held-out text has fewer tokens than seq_len={cfg.seq_len}")
    return out


def subdomain_eval_batches(corpus: Corpus, tokenizer, cfg: ReferenceConfig, eos_id: int,
                           pooled: tuple[str, ...] = ("chat",)) -> dict[str, torch.Tensor]:
    """Per held-out sub-domain (key ``"<domain>/<subdomain>"``), :func:`first_windows` of its held-out documents:
    int64 [n, S]; domains in ``pooled`` (chat: 21 small topics) give one key, the domain. A sub-domain shorter than
    one window is left out."""
    groups: dict[str, list[str]] = {}
    for dom in DOMAINS:
        for d in corpus.heldout[dom]:
            groups.setdefault(dom if dom in pooled else f"{dom}/{d.subdomain}", []).append(d.text)
    out = {key: first_windows(groups[key], tokenizer, cfg, eos_id) for key in sorted(groups)}
    return {k: v for k, v in out.items() if len(v)}


def corpus_of(cfg: ReferenceConfig) -> Corpus:
    """The corpus ``cfg`` trains on (variant, math problems, data seed; the split is seed-free)."""
    return build_corpus(dict(cfg.heldout_fraction), cfg.math_problems, cfg.data_seed, cfg.max_train_docs,
                        variant=cfg.corpus)


def heldout_ce_by_subdomain(model_dir: str | Path, cfg: ReferenceConfig) -> dict:
    """Held-out cross-entropy (nats/token) of a saved model per sub-domain, on the held-out documents of the corpus
    ``cfg`` builds (the split is seed-free, so it is the split the model was trained on), with the saved tokenizer.
    Returns ``{"heldout_ce": {key: ce}, "windows": {key: n}, "seq_len": S}``."""
    from moeplace.models.reference import load_reference

    torch.set_num_threads(cfg.threads)
    model, tokenizer = load_reference(path=model_dir)  # first: a wrong folder fails before the corpus is built
    corpus = corpus_of(cfg)
    batches = subdomain_eval_batches(corpus, tokenizer, cfg, tokenizer.eos_token_id)
    with torch.no_grad():
        ce = evaluate(model, batches)
    return {"heldout_ce": ce, "windows": {k: int(len(v)) for k, v in batches.items()}, "seq_len": cfg.seq_len}


def subdomain_streams(corpus: Corpus, tokenizer, cfg: ReferenceConfig, eos_id: int, rng: np.random.Generator,
                      domains: list[str]) -> dict[str, dict[str, np.ndarray]]:
    """Per domain of ``domains`` and sub-domain, the training documents' tokens in a seeded order: int64 [N].

    Sub-domains with no more than ``seq_len`` tokens (a window does not fit; e.g. small chat topics) are joined
    into one stream named ``"(small)"``, dropped only if that too is no longer than ``seq_len``; a domain left
    with no stream raises ValueError.
    """
    out: dict[str, dict[str, np.ndarray]] = {}
    for dom in domains:
        by_sub: dict[str, list[str]] = {}
        docs = corpus.train[dom]
        for i in rng.permutation(len(docs)):
            by_sub.setdefault(docs[i].subdomain, []).append(docs[i].text)
        subs = {sub: token_stream(tokenizer, texts, eos_id) for sub, texts in sorted(by_sub.items())}
        out[dom] = {sub: s for sub, s in subs.items() if len(s) > cfg.seq_len}
        small = [s for s in subs.values() if len(s) <= cfg.seq_len]
        if small and sum(len(s) for s in small) > cfg.seq_len:
            out[dom]["(small)"] = np.concatenate(small)
        if not out[dom]:
            raise ValueError(f"domain {dom!r}: no sub-domain has more than seq_len={cfg.seq_len} training tokens")
    return out


def sample_windows(streams: dict[str, np.ndarray], n: int, seq_len: int, alpha: float, rng: np.random.Generator
                   ) -> list[np.ndarray]:
    """``n`` windows of ``seq_len`` tokens: each picks a sub-domain with probability proportional to its token
    count to the power ``alpha`` (1: by size, 0: uniform), then a uniform start in its stream. -> n x int64 [S]."""
    names = list(streams)
    w = np.array([len(streams[k]) for k in names], dtype=np.float64) ** alpha
    picks = rng.choice(len(names), size=n, p=w / w.sum())
    out = []
    for j in picks:
        s = streams[names[j]]
        a = int(rng.integers(0, len(s) - seq_len))
        out.append(s[a:a + seq_len])
    return out


# ------------------------------------------------------------------------------------------------ losses


def sequence_ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of each sequence. logits [B, S, V], ids [B, S] -> [B]."""
    b, s, v = logits.shape
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, v).float(), ids[:, 1:].reshape(-1), reduction="none")
    return ce.view(b, s - 1).mean(dim=1)


@torch.no_grad()
def evaluate(model, batches: dict[str, torch.Tensor], chunk: int = 8) -> dict[str, float]:
    """Held-out cross-entropy (nats per token) per domain."""
    was_training = model.training
    model.eval()
    out = {}
    for dom, ids in batches.items():
        losses = [sequence_ce(model(input_ids=ids[i:i + chunk], output_router_logits=False).logits, ids[i:i + chunk])
                  for i in range(0, len(ids), chunk)]
        out[dom] = float(torch.cat(losses).mean())
    model.train(was_training)
    return out


def lr_at(step: int, cfg: ReferenceConfig) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def _param_groups(model, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# ------------------------------------------------------------------------------------------------ plot


def plot_loss_curve(history: dict, path: Path, title: str) -> None:
    """Train cross-entropy per domain (EMA over steps) and held-out cross-entropy per domain; below, the aux loss
    (or, for a bias-balanced model, the routed load's max/mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    steps = np.asarray(history["step"])
    for i, dom in enumerate(DOMAINS):
        color = f"C{i}"
        tr = np.asarray(history["train_ce"][dom])
        ema, smooth = tr[0], []
        for v in tr:
            ema = 0.95 * ema + 0.05 * v
            smooth.append(ema)
        ax.plot(steps + 1, smooth, color=color, lw=1.2, alpha=0.8, label=f"{dom} train (EMA)")
        ev = history["eval"]
        ax.plot([e["step"] for e in ev], [e["heldout_ce"][dom] for e in ev], color=color, ls="--", marker="o",
                ms=3, label=f"{dom} held-out")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(ncol=2, fontsize=8)
    ax.set_title(textwrap.fill(title, 95), fontsize=10)
    if history.get("max_over_mean") is not None:  # bias-balanced (DeepSeek-V3): the routed load itself
        ax2.plot(steps + 1, history["max_over_mean"], color="k", lw=0.8)
        ax2.axhline(1.0, color="gray", ls=":", lw=1)
        ax2.set_ylabel("max/mean expert load\n(mean over layers)", fontsize=8)
    else:
        ax2.plot(steps + 1, history["aux_loss"], color="k", lw=0.8)
        ax2.axhline(history["aux_balanced"], color="gray", ls=":", lw=1)
        ax2.set_ylabel("load-balance loss\n(balanced = top-k)", fontsize=8)
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ main


def _save_model(model, cfg: ReferenceConfig, tokenizer, out: Path) -> None:
    from transformers import GenerationConfig

    eos = tokenizer.eos_token_id
    model.config.output_router_logits = False  # inference default; training sets it per forward
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    model.to(getattr(torch, cfg.save_dtype))
    for r in model.modules():  # routing biases stay float32 (transformers keeps them so: _keep_in_fp32_modules_strict)
        if isinstance(getattr(r, "e_score_correction_bias", None), torch.Tensor):
            r.e_score_correction_bias.data = r.e_score_correction_bias.data.float()
    model.save_pretrained(out)
    model.to(torch.float32)
    tokenizer.save_pretrained(out)
    from moeplace.io import file_mode

    for f in out.iterdir():  # transformers writes the weights through a 0600 temporary file: give the user's umask
        if f.is_file():
            f.chmod(file_mode())


@torch.no_grad()
def _samples(model, tokenizer, prompts: list[dict], new_tokens: int) -> list[dict]:
    out = []
    for dom in DOMAINS:
        row = next(r for r in prompts if r["domain"] == dom)
        ids = tokenizer(row["prompt"], return_tensors="pt")
        gen = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
        out.append({"domain": dom, "prompt": row["prompt"],
                    "completion": tokenizer.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=False)})
    return out


def train_reference(cfg: ReferenceConfig, out_dir: str | Path, seed: int = 0, progress: bool = True,
                    log: Callable[[str], None] = print) -> dict:
    """Build the corpus, train the tokenizer and the model, and write the model folder to ``out_dir``.

    Returns the metrics written to train_metrics.json (config, history, held-out loss of the saved weights,
    wall time, tokens seen).
    """
    from moeplace.io import folder_output_problem, make_temp_dir, mark_tree, move_folder_into_place, remove_stale

    t_start = time.perf_counter()
    final = Path(out_dir)
    problem = folder_output_problem(final)  # before any work: never over a folder of the user's files
    if problem:
        raise ValueError(problem)
    remove_stale(final, "new")  # what a killed run left
    out = make_temp_dir(final, "new")  # built aside, swapped in whole when complete; removed on any failure
    try:
        metrics = _train_into(cfg, out, seed, progress, log, t_start)
        mark_tree(out)
        problem = folder_output_problem(final)  # changed while training?
        if problem:
            raise ValueError(problem)
        move_folder_into_place(out, final)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    log(f"wrote the model folder {final}")
    return metrics


def _train_into(cfg: ReferenceConfig, out: Path, seed: int, progress: bool, log: Callable[[str], None],
                t_start: float) -> dict:
    """:func:`train_reference`'s work, writing the model folder into ``out`` (a fresh temporary folder)."""
    from tqdm import tqdm
    from transformers import Qwen3MoeForCausalLM

    torch.set_num_threads(cfg.threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    log("building the corpus ...")
    corpus = corpus_of(cfg)
    log("training the tokenizer ...")
    tokenizer = train_tokenizer(corpus, cfg)
    eos = tokenizer.eos_token_id
    rng = np.random.default_rng(seed)
    streams = {}
    for dom in DOMAINS:
        order = rng.permutation(len(corpus.train[dom]))
        streams[dom] = token_stream(tokenizer, [corpus.train[dom][i].text for i in order], eos)
        if len(streams[dom]) <= cfg.seq_len:
            raise ValueError(f"domain {dom!r}: {len(streams[dom])} training tokens, need more than seq_len")
    alpha = {d: a for d, a in cfg.subdomain_alpha if a < 1.0}
    sub_streams = subdomain_streams(corpus, tokenizer, cfg, eos, rng, sorted(alpha))
    heldout = eval_batches(corpus, tokenizer, cfg, eos)
    # Prompts before training, so a corpus too small for them fails in seconds, not after the run.
    counts = dict(cfg.prompt_counts) if cfg.prompt_counts else cfg.prompts_per_domain
    prompts = heldout_prompts(corpus, tokenizer, counts, cfg.prompt_min_tokens, cfg.prompt_max_tokens,
                              cfg.data_seed, per_code_doc=cfg.prompts_per_code_doc)
    t_data = time.perf_counter() - t_start
    log("training tokens per domain: " + ", ".join(f"{d} {len(s):,}" for d, s in streams.items()))

    deepseek = cfg.arch == "deepseek_v3"
    if deepseek:  # fine-grained: group-limited routing, shared experts, bias balancing (moeplace.models.balancing)
        from transformers import DeepseekV3ForCausalLM

        model = DeepseekV3ForCausalLM(cfg.deepseek_config(eos))
    elif cfg.foe_groups > 1:  # Federation of Experts: same parameters, grouped wiring (moeplace.models.foe)
        from moeplace.models.foe import FoeForCausalLM, foe_config

        model = FoeForCausalLM(foe_config(cfg.qwen3_config(eos, output_router_logits=True), cfg.foe_groups))
    else:
        model = Qwen3MoeForCausalLM(cfg.qwen3_config(eos, output_router_logits=True))
    model.train()
    counter = RoutedLoadCounter(model).__enter__() if deepseek else None
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    mix = dict(cfg.batch_mix)
    dom_of_row = [d for d in DOMAINS for _ in range(mix[d])]
    history: dict = {"step": [], "lr": [], "loss": [], "aux_loss": [], "train_ce": {d: [] for d in DOMAINS},
                     "eval": [], "aux_balanced": float(cfg.top_k)}
    if deepseek:  # no aux loss; the balance panel shows the routed load's max/mean instead (1 = balanced)
        history.update(aux_loss=None, aux_balanced=None, max_over_mean=[], max_over_mean_per_layer=[])
    t_train = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc="train-reference", disable=not progress, mininterval=5.0, unit="step")
    for step in bar:
        rows = []
        for dom in DOMAINS:
            if dom in sub_streams:
                rows.extend(sample_windows(sub_streams[dom], mix[dom], cfg.seq_len, alpha[dom], rng))
                continue
            s = streams[dom]
            starts = rng.integers(0, len(s) - cfg.seq_len, size=mix[dom])
            rows.extend(s[a:a + cfg.seq_len] for a in starts)
        ids = torch.from_numpy(np.stack(rows))  # [B, S]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        if deepseek:
            counter.reset()
            res = model(input_ids=ids)
            ce = sequence_ce(res.logits, ids)  # [B]
            loss = ce.mean()
        else:
            res = model(input_ids=ids, output_router_logits=True)
            ce = sequence_ce(res.logits, ids)  # [B]
            loss = ce.mean() + model.router_aux_loss_coef * res.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()

        ce_d = ce.detach()
        history["step"].append(step)
        history["lr"].append(lr_at(step, cfg))
        history["loss"].append(loss.item())
        if deepseek:
            load = counter.load  # [L, E] routed pairs of this step
            if cfg.bias_update_speed > 0:
                update_router_biases(counter.routers, load, cfg.bias_update_speed)
            imb = max_over_mean(load)
            history["max_over_mean"].append(float(imb.mean()))
            history["max_over_mean_per_layer"].append([round(float(v), 4) for v in imb])
        else:
            history["aux_loss"].append(res.aux_loss.item())
        for dom in DOMAINS:
            history["train_ce"][dom].append(float(ce_d[[i for i, d in enumerate(dom_of_row) if d == dom]].mean()))
        bar.set_postfix(loss=f"{history['loss'][-1]:.3f}", **(
            {"max/mean": f"{history['max_over_mean'][-1]:.2f}"} if deepseek else
            {"aux": f"{history['aux_loss'][-1]:.3f}"}))
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            ev = evaluate(model, heldout)
            history["eval"].append({"step": step + 1, "heldout_ce": ev, "seconds": time.perf_counter() - t_train})
            msg = " ".join(f"{d} {v:.3f}" for d, v in ev.items())
            (bar.write if progress else log)(f"step {step + 1}: held-out CE {msg}")
    t_train = time.perf_counter() - t_train
    if counter is not None:
        counter.__exit__(None, None, None)

    log("saving the model ...")
    _save_model(model, cfg, tokenizer, out)
    from moeplace.models.reference import load_reference

    saved, saved_tok = load_reference(path=out)
    final = evaluate(saved, heldout)
    with open(out / HELDOUT_PROMPTS_FILE, "w", encoding="utf-8") as f:
        for row in prompts:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (out / MANIFEST_FILE).write_text(json.dumps(corpus_manifest(corpus), indent=1) + "\n", encoding="utf-8")

    import transformers

    tokens_per_step = cfg.batch_size * cfg.seq_len
    metrics = {
        "config": cfg.to_json(),
        "seed": seed,
        "parameters": sum(p.numel() for p in saved.parameters()),
        "expert_parameters": sum(p.numel() for n, p in saved.named_parameters() if ".experts." in n),
        "active_parameters_per_token": _active_params(saved, cfg),
        "steps": cfg.steps,
        "tokens_per_step": tokens_per_step,
        "train_tokens": cfg.steps * tokens_per_step,
        "train_tokens_per_domain": {d: cfg.steps * mix[d] * cfg.seq_len for d in DOMAINS},
        "stream_tokens_per_domain": {d: int(len(s)) for d, s in streams.items()},
        "epochs_per_domain": {d: cfg.steps * mix[d] * cfg.seq_len / len(s) for d, s in streams.items()},
        "heldout_tokens_per_domain": {d: int(b.numel()) for d, b in heldout.items()},
        "heldout_ce_saved_weights": final,
        "train_ce_last_100": {d: float(np.mean(history["train_ce"][d][-100:])) for d in DOMAINS},
        "moe_layers": cfg.num_moe_layers,
        "weights_bytes": (out / "model.safetensors").stat().st_size,
        **({"max_over_mean_last_100": float(np.mean(history["max_over_mean"][-100:])),
            "router_bias": [[round(float(v), 5) for v in r.e_score_correction_bias] for r in bias_routers(saved)]}
           if deepseek else {"aux_loss_last_100": float(np.mean(history["aux_loss"][-100:]))}),
        "seconds_data": t_data,
        "seconds_train": t_train,
        "seconds_total": time.perf_counter() - t_start,
        "threads": cfg.threads,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "samples": _samples(saved, saved_tok, prompts, cfg.sample_tokens),
        "history": history,
    }
    (out / METRICS_FILE).write_text(json.dumps(metrics, indent=1) + "\n", encoding="utf-8")
    shape = (f"{cfg.num_moe_layers} MoE layers x {cfg.num_experts} experts (top-{cfg.top_k}"
             + (f" in {cfg.topk_groups} of {cfg.expert_groups} groups, {cfg.num_shared_experts} shared)"
                if deepseek else ")"))
    plot_loss_curve(history, out / LOSS_CURVE_FILE,
                    f"reference MoE: {shape}, {cfg.steps} steps, {metrics['train_tokens'] / 1e6:.1f}M tokens, "
                    f"seed {seed}")
    log(f"done in {metrics['seconds_total'] / 60:.1f} min; held-out CE of the saved weights: "
        + ", ".join(f"{d} {v:.3f}" for d, v in final.items()))
    return metrics


def _active_params(model, cfg: ReferenceConfig) -> int:
    """Parameters one token uses: everything except the experts it does not select."""
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return int(total - experts + experts * cfg.top_k / cfg.num_experts)
