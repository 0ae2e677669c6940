"""Build a prefill-scale held-out routing trace of a trained reference model (produced here, never shipped).

The shipped traces of the reference models (``src/moeplace/data/reference-fg.trace``, ``reference-ds.trace``) hold
8,350 short prompts (16-96 tokens). This script records the prefill routing of far more held-out text: prompts of
``--min-tokens``..``--max-tokens`` tokens cut from the documents the model's corpus split held out of training
(the split is seed-free, so it is the model's own; every document used is checked against the model's
``corpus_manifest.json``), until ``--target-tokens`` prompt tokens (default 2,000,000). The result is far over
the 25 MB a shipped file may take, so it goes to a cache folder (default ``out/cache/<model>-prefill.trace``)
and is rebuilt on demand; its ``README.md``, ``meta.json`` (``extra.prefill_trace``) and ``docs.json`` say how it
was made and which documents it used.

Usage::

    OMP_NUM_THREADS=1 nice -n 5 python scripts/prefill_trace.py --model reference-fg > out/cache/fg-prefill.log 2>&1 &
    python scripts/prefill_trace.py --model reference-ds --target-tokens 500000 --out /tmp/ds-prefill.trace

Prompts: per sub-domain (chat's 21 small topics pooled into one), the held-out documents in split-score order,
those that none of the shipped ``heldout_prompts.jsonl`` rows was cut from first, each followed by EOS as in
training, are cut into consecutive windows of a seeded random length. Domains take turns (always the one with the
fewest tokens so far), and so do the sub-domains of a domain, so a small target still mixes them all. The last
window is cut short so the trace holds exactly ``--target-tokens`` prompt tokens (fewer only when the held-out
text runs out, which the script says). Routing is recorded by :func:`moeplace.trace.capture.record_prefill`
(batched forwards, no generate; prefill rows only).

Resumable and atomic: the requests are recorded in pieces of about ``--piece-tokens`` tokens, each a complete trace
in a hidden build folder beside the output (``.<name>.build``), and merged into the output with the trace writer,
which renames it into place only when complete. A rerun with the same settings reuses the pieces already built;
a finished output is skipped unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import random
import shutil
import signal
import sys
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"reference-fg": "fine-grained", "reference-ds": "deepseek-v3-shape"}  # model folder -> training preset
PLAN_FILE = "plan.json"
NOT_SHIPPED = ("produced locally by scripts/prefill_trace.py, not shipped: at this size the trace exceeds the "
               "25 MB a shipped file may take")


class _Terminated(Exception):
    """Raised by SIGTERM, so the piece being written is discarded cleanly (the finished pieces stay)."""


def _terminate(signum, frame) -> None:
    raise _Terminated()


def _fmt_time(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def complete_trace(path: Path) -> bool:
    """Whether ``path`` holds a moeplace trace marked complete."""
    from moeplace.trace.reader import read_meta
    from moeplace.trace.types import TraceError

    try:
        return bool(read_meta(path).complete)
    except TraceError:
        return False


# --------------------------------------------------------------------------------------------------- prompts


class _Group:
    """One sub-domain's held-out stream, cut lazily into windows (only the documents needed are tokenized)."""

    def __init__(self, key: str, domain: str, docs: list, shipped: set[str], tokenizer, eos: int, seed: int,
                 lo: int, hi: int) -> None:
        self.key, self.domain = key, domain
        self.docs = deque(docs)
        self.shipped, self.tokenizer, self.eos = shipped, tokenizer, eos
        self.rng = random.Random(f"prefill-trace:{seed}:{key}")
        self.lo, self.hi = lo, hi
        self.buf: deque = deque()  # [doc_id, token array] still to cut, in stream order
        self.have = 0

    def next_window(self):
        """(tokens int64 [n], [(doc_id, tokens from it)]) or None when the stream has no window of lo tokens left."""
        import numpy as np

        from moeplace.models.train import token_stream

        need = self.rng.randint(self.lo, self.hi)
        while self.have < need and self.docs:
            d = self.docs.popleft()
            t = token_stream(self.tokenizer, [d.text], self.eos)  # the document then EOS, as in training
            self.buf.append([d.doc_id, t])
            self.have += len(t)
        n = min(need, self.have)
        if n < self.lo:
            return None
        parts, spans, left = [], [], n
        while left:
            doc_id, t = self.buf[0]
            take = min(left, len(t))
            parts.append(t[:take])
            spans.append((doc_id, take))
            if take == len(t):
                self.buf.popleft()
            else:
                self.buf[0][1] = t[take:]
            left -= take
        self.have -= n
        return np.concatenate(parts), spans


def build_requests(corpus, manifest: dict, shipped: set[str], tokenizer, eos: int, target: int, lo: int, hi: int,
                   seed: int) -> tuple[list[dict], dict]:
    """The prompts: rows {"tokens", "domain", "source", "docs": [(doc_id, n)]}, and notes for the metadata."""
    from moeplace.models.corpus import DOMAINS, expand_ids

    groups: dict[str, list[_Group]] = {}
    dropped = 0
    for dom in DOMAINS:
        held = set(expand_ids(manifest["domains"][dom]["heldout_ids"]))
        docs = [d for d in corpus.heldout[dom] if d.doc_id in held]  # never a document the model trained on
        dropped += len(corpus.heldout[dom]) - len(docs)
        docs = [d for d in docs if d.doc_id not in shipped] + [d for d in docs if d.doc_id in shipped]
        by_key: dict[str, list] = {}
        for d in docs:
            by_key.setdefault(dom if dom == "chat" else f"{dom}/{d.subdomain}", []).append(d)
        groups[dom] = [_Group(k, dom, v, shipped, tokenizer, eos, seed, lo, hi) for k, v in sorted(by_key.items())]
    dom_tokens = dict.fromkeys(DOMAINS, 0)
    key_tokens: dict[str, int] = {}
    rows, total = [], 0
    while total < target:
        doms = [d for d in DOMAINS if groups[d]]
        if not doms:
            break
        dom = min(doms, key=lambda d: (dom_tokens[d], DOMAINS.index(d)))
        g = min(groups[dom], key=lambda g: (key_tokens.get(g.key, 0), g.key))
        w = g.next_window()
        if w is None:
            groups[dom].remove(g)
            continue
        tokens, spans = w
        if total + len(tokens) > target:  # the last prompt is cut short: exactly `target` tokens in all
            tokens = tokens[: target - total]
            kept, left = [], len(tokens)
            for doc_id, n in spans:
                if left:
                    kept.append((doc_id, min(n, left)))
                    left -= min(n, left)
            spans = kept
        rows.append({"tokens": tokens, "domain": dom, "source": g.key, "docs": spans})
        total += len(tokens)
        dom_tokens[dom] += len(tokens)
        key_tokens[g.key] = key_tokens.get(g.key, 0) + len(tokens)
    notes = {"tokens_by_domain": {d: n for d, n in dom_tokens.items() if n},
             "tokens_by_source": dict(sorted(key_tokens.items())),
             "heldout_documents_not_in_manifest_skipped": dropped}
    return rows, notes


def doc_summary(rows: list[dict], shipped: set[str]) -> tuple[dict, dict]:
    """(docs.json content, counts for the metadata): the documents used, by domain, with or without a shipped
    prompt, and the tokens taken from each kind."""
    from moeplace.models.corpus import compress_ids

    used: dict[str, dict[str, int]] = {}
    tok_free = tok_shared = 0
    for r in rows:
        for doc_id, n in r["docs"]:
            dom = doc_id.split(":", 1)[0]
            used.setdefault(dom, {})
            used[dom][doc_id] = used[dom].get(doc_id, 0) + n
            if doc_id in shipped:
                tok_shared += n
            else:
                tok_free += n
    docs = {}
    for dom, ids in sorted(used.items()):
        free = [i for i in ids if i not in shipped]
        shared = [i for i in ids if i in shipped]
        docs[dom] = {"documents": len(ids), "without_shipped_prompt": compress_ids(free),
                     "with_shipped_prompt": compress_ids(shared)}
    n_docs = sum(len(v) for v in used.values())
    n_shared = sum(1 for v in used.values() for i in v if i in shipped)
    counts = {"documents": n_docs, "documents_without_shipped_prompt": n_docs - n_shared,
              "documents_with_shipped_prompt": n_shared, "tokens_from_documents_without_shipped_prompt": tok_free,
              "tokens_from_documents_with_shipped_prompt": tok_shared}
    return docs, counts


def fingerprint(settings: dict, rows: list[dict]) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for r in rows:
        h.update(r["tokens"].astype("<i8").tobytes())
        h.update(f"{r['domain']}|{r['source']}".encode())
    return h.hexdigest()


def cut_pieces(rows: list[dict], piece_tokens: int) -> list[tuple[int, int, int]]:
    """Consecutive request ranges [start, stop) of about ``piece_tokens`` tokens: (start, stop, tokens)."""
    out, start, n = [], 0, 0
    for i, r in enumerate(rows):
        n += len(r["tokens"])
        if n >= piece_tokens:
            out.append((start, i + 1, n))
            start, n = i + 1, 0
    if start < len(rows):
        out.append((start, len(rows), n))
    return out


# --------------------------------------------------------------------------------------------------- README


def readme(name: str, info: dict) -> str:
    by_dom = ", ".join(f"{d} {n:,}" for d, n in info["tokens_by_domain"].items())
    return f"""# {name}-prefill.trace: prefill routing of held-out text ({info['prompt_tokens']:,} prompt tokens)

**Produced, not shipped.** {NOT_SHIPPED}. Rebuild it with

    python scripts/prefill_trace.py --model {name} --target-tokens {info['target_tokens']} \\
        --min-tokens {info['min_tokens']} --max-tokens {info['max_tokens']} --seed {info['seed']}

- Model: `src/moeplace/data/{name}` (training preset `{info['preset']}`), recorded on {info['device']} in float32
  by `moeplace.trace.capture.record_prefill` (batched forwards, no generate): prefill rows only, every prompt token
  of every request, gen_len 0{', with top-k weights' if info['has_weights'] else ', expert ids only (no weights)'}.
- {info['requests']:,} requests, {info['prompt_tokens']:,} prompt tokens (target {info['target_tokens']:,}):
  {by_dom}. Prompt lengths {info['min_tokens']}..{info['max_tokens']} tokens (seeded, seed {info['seed']}; the
  last prompt may be shorter), positions from 0.
- Text: the documents that the model's corpus split (variant `{info['corpus_variant']}`, salt `{info['split_salt']}`)
  held out of training, each checked against the model's `corpus_manifest.json`. Per sub-domain (request `source`,
  e.g. `code/python`; chat's topics pooled as `chat`) the documents are joined by EOS as in training, in split-score
  order, the ones no shipped `heldout_prompts.jsonl` prompt was cut from first, and cut into consecutive windows;
  domains and sub-domains take turns by tokens so far.
- Documents: {info['documents']:,} ({info['documents_without_shipped_prompt']:,} with no shipped prompt,
  {info['documents_with_shipped_prompt']:,} that a shipped prompt was also cut from); tokens
  {info['tokens_from_documents_without_shipped_prompt']:,} from the former,
  {info['tokens_from_documents_with_shipped_prompt']:,} from the latter (the held-out split of this corpus has
  about 3.0 M tokens, of which only about 0.5 M come from documents without a shipped prompt). `docs.json` lists
  them per domain.
- The model was trained on {info['train_seq_len']}-token windows and has {info['max_positions']} positions;
  prompts longer than {info['train_seq_len']} tokens reach positions it never trained on.
"""


# --------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Build a prefill-scale held-out routing trace of a reference model into a cache folder. The "
                    "result is produced here, not shipped (it exceeds the 25 MB a shipped file may take).",
        epilog="example: OMP_NUM_THREADS=1 nice -n 5 python scripts/prefill_trace.py --model reference-fg "
               "> out/cache/fg-prefill.log 2>&1 &", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="reference-fg", help="reference model folder")
    ap.add_argument("--target-tokens", type=int, default=2_000_000, help="prompt tokens to record")
    ap.add_argument("--min-tokens", type=int, default=128, help="shortest prompt")
    ap.add_argument("--max-tokens", type=int, default=256,
                    help="longest prompt (the models trained on 256-token windows; at most 512, their positions)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the prompt lengths")
    ap.add_argument("--weights", action="store_true", help="record the top-k weights too (about 4x the bytes)")
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="padded tokens per forward (default: record_prefill's, 1024)")
    ap.add_argument("--piece-tokens", type=int, default=65536,
                    help="tokens per resumable piece (a kill loses at most one piece)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", type=Path, default=None,
                    help="output trace folder (default out/cache/<model>-prefill.trace)")
    ap.add_argument("--overwrite", action="store_true", help="rebuild an existing output (or a build with other "
                                                             "settings)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = ROOT / "out" / "cache" / f"{args.model}-prefill.trace"
    for name in ("target_tokens", "min_tokens", "max_tokens", "piece_tokens", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.batch_tokens is not None and args.batch_tokens < 1:
        ap.error(f"--batch-tokens must be >= 1, got {args.batch_tokens}")
    if args.min_tokens > args.max_tokens:
        ap.error(f"--min-tokens {args.min_tokens} exceeds --max-tokens {args.max_tokens}")
    return args


def lock(out: Path):
    """An exclusive lock on building ``out`` (the hidden ``.<name>.lock`` beside it), held while the returned file
    stays open; ValueError when another run holds it (two runs would write the same pieces)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.parent / f".{out.name}.lock"
    f = open(path, "a+")  # held open for the whole run
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        who = f.read().strip() or "?"
        f.close()
        raise ValueError(f"another prefill_trace.py (pid {who}) is building {out}; wait for it or stop it") from None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out
    build = out.parent / f".{out.name}.build"
    try:
        held = lock(out)
    except (ValueError, OSError) as e:
        print(f"prefill_trace: error: {e}", file=sys.stderr)
        return 2
    try:
        return _main(args, out, build)
    finally:
        held.close()


def _main(args: argparse.Namespace, out: Path, build: Path) -> int:
    if out.exists() and not args.overwrite:
        if complete_trace(out):
            print(f"prefill_trace: {out} is already built (use --overwrite to rebuild)")
            return 0
        print(f"prefill_trace: error: {out} exists and is not a complete trace; remove it or use --overwrite",
              file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _build(args, out, build)
    except (ValueError, OSError) as e:
        print(f"prefill_trace: error: {e}", file=sys.stderr)
        return 2
    except (_Terminated, KeyboardInterrupt) as e:
        print(f"prefill_trace: stopped; the finished pieces are kept in {build} (rerun the same command to resume)",
              file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(e, _Terminated) else signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _build(args: argparse.Namespace, out: Path, build: Path) -> int:
    import torch

    from moeplace.models.reference import EOS_TOKEN, HELDOUT_PROMPTS_FILE, MANIFEST_FILE, load_reference, preset
    from moeplace.models.train import corpus_of
    from moeplace.trace import TraceWriter
    from moeplace.trace.capture import record_prefill, trace_meta
    from moeplace.trace.capture_spec import DEFAULT_PREFILL_BATCH_TOKENS
    from moeplace.trace.reader import iter_token_chunks, read_requests

    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    mdir = ROOT / "src" / "moeplace" / "data" / args.model
    cfg = preset(MODELS[args.model])
    if args.max_tokens > cfg.max_position_embeddings:
        raise ValueError(f"--max-tokens {args.max_tokens} exceeds the model's {cfg.max_position_embeddings} positions")
    model, tokenizer = load_reference(path=mdir)
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    manifest = json.loads((mdir / MANIFEST_FILE).read_text())
    shipped = {json.loads(line)["doc_id"] for line in (mdir / HELDOUT_PROMPTS_FILE).read_text().splitlines()
               if line.strip()}
    print(f"building the held-out corpus of {args.model} (preset {MODELS[args.model]}) ...", flush=True)
    corpus = corpus_of(cfg)
    rows, notes = build_requests(corpus, manifest, shipped, tokenizer, eos, args.target_tokens, args.min_tokens,
                                 args.max_tokens, args.seed)
    if not rows:
        raise ValueError("no held-out prompt of --min-tokens tokens could be cut")
    total = sum(len(r["tokens"]) for r in rows)
    docs, doc_counts = doc_summary(rows, shipped)
    batch_tokens = args.batch_tokens or DEFAULT_PREFILL_BATCH_TOKENS
    settings = {"model": args.model, "target_tokens": args.target_tokens, "min_tokens": args.min_tokens,
                "max_tokens": args.max_tokens, "seed": args.seed, "weights": args.weights,
                "piece_tokens": args.piece_tokens, "model_bytes": (mdir / "model.safetensors").stat().st_size}
    fp = fingerprint(settings, rows)
    pieces = cut_pieces(rows, args.piece_tokens)
    by_dom = ", ".join(f"{d} {n:,}" for d, n in notes["tokens_by_domain"].items())
    print(f"{len(rows):,} requests, {total:,} prompt tokens ({by_dom}) "
          f"from {doc_counts['documents']:,} held-out documents; {len(pieces)} pieces", flush=True)
    if total < args.target_tokens:
        print(f"note: the held-out text gives only {total:,} tokens of prompts, short of --target-tokens "
              f"{args.target_tokens:,}; recording all of it", flush=True)

    plan = build / PLAN_FILE
    if build.exists():
        old = None
        try:
            old = json.loads(plan.read_text()).get("fingerprint")
        except (OSError, ValueError):
            pass
        if old != fp:
            if not args.overwrite:
                raise ValueError(f"{build} holds a build with other settings; rerun with --overwrite to discard it")
            shutil.rmtree(build)
    build.mkdir(parents=True, exist_ok=True)
    from moeplace.io import atomic_write_json

    atomic_write_json({"fingerprint": fp, "settings": settings, "pieces": pieces}, plan, indent=1)

    name = f"src/moeplace/data/{args.model}"
    meta = trace_meta(model, model_name=name, record_weights=args.weights)
    meta.extra["phases"] = "prefill only (moeplace.trace.capture.record_prefill: batched forwards, no generate)"
    done = sum(n for i, (_, _, n) in enumerate(pieces) if complete_trace(build / f"piece-{i:05d}.trace"))
    if done:
        print(f"resuming: {done:,} of {total:,} tokens already recorded in {build}", flush=True)
    t_rec, n_rec = time.perf_counter(), 0
    for i, (a, b, n) in enumerate(pieces):
        piece = build / f"piece-{i:05d}.trace"
        if complete_trace(piece):
            continue
        t0 = time.perf_counter()
        with TraceWriter(piece, meta, overwrite=True, keep_partial=False) as w:
            s = record_prefill(model, tokenizer, [r["tokens"] for r in rows[a:b]], w,
                               domains=[r["domain"] for r in rows[a:b]], sources=[r["source"] for r in rows[a:b]],
                               request_ids=range(a, b), batch_tokens=batch_tokens, flush_every=None)
        if s["prefill_tokens"] != n:
            raise ValueError(f"piece {i}: recorded {s['prefill_tokens']} tokens, expected {n}")
        dt = time.perf_counter() - t0
        done += n
        n_rec += n
        rate = n_rec / (time.perf_counter() - t_rec)
        print(f"piece {i + 1}/{len(pieces)}: {n:,} tokens in {dt:.1f} s ({n / dt:,.0f} tok/s); "
              f"{done:,}/{total:,} tokens ({done / total:.1%}), elapsed {_fmt_time(time.perf_counter() - t_start)}, "
              f"ETA {_fmt_time((total - done) / rate)} at {rate:,.0f} tok/s", flush=True)

    info = {"produced_by": "scripts/prefill_trace.py", "shipped": False, "note": NOT_SHIPPED,
            "preset": MODELS[args.model],
            "corpus_variant": cfg.corpus, "split_salt": corpus.salt, "target_tokens": args.target_tokens,
            "prompt_tokens": total, "requests": len(rows), "min_tokens": args.min_tokens,
            "max_tokens": args.max_tokens, "seed": args.seed, "train_seq_len": cfg.seq_len,
            "max_positions": cfg.max_position_embeddings, "has_weights": args.weights, "device": "CPU",
            "batch_tokens": batch_tokens, **notes, **doc_counts, "documents_file": "docs.json",
            "fingerprint": fp}
    meta.extra["prefill_trace"] = info
    print(f"merging {len(pieces)} pieces into {out} ...", flush=True)
    with TraceWriter(out, meta, overwrite=args.overwrite, keep_partial=False) as w:
        n_tok = n_req = 0
        for i in range(len(pieces)):
            piece = build / f"piece-{i:05d}.trace"
            req = read_requests(piece)
            w.add_requests(req.request_id, req.domain, req.source, req.prompt_len, req.gen_len)
            n_req += len(req)
            for c in iter_token_chunks(piece, chunk_tokens=1 << 18, columns_weights=args.weights):
                w.add_tokens(c.request_id, c.position, c.phase, c.expert_ids, c.expert_weights)
                n_tok += len(c)
        if (n_req, n_tok) != (len(rows), total):
            raise ValueError(f"merged {n_req} requests / {n_tok} tokens, expected {len(rows)} / {total}")
        atomic_write_json(docs, w.path / "docs.json", indent=1)  # inside the folder before it is renamed into place
        (w.path / "README.md").write_text(readme(args.model, info), encoding="utf-8")
    shutil.rmtree(build, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"built {out}: {len(rows):,} requests, {total:,} prefill tokens, {size / 1e6:.1f} MB, in "
          f"{_fmt_time(time.perf_counter() - t_start)} ({NOT_SHIPPED})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
