"""``moeplace trace record``: run prompts through a local Hugging Face MoE model and record its routing."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from pathlib import Path

from moeplace.cli import device_spec, int_in, output_dir
from moeplace.trace.capture_spec import (
    DEFAULT_FLUSH_EVERY,
    DEFAULT_PREFILL_BATCH_TOKENS,
    DEFAULT_PREFILL_FLUSH_EVERY,
    ROUTER_CLASSES,
)

EPILOG = """examples:
  moeplace trace record --model ./Qwen3-30B-A3B --prompts prompts.jsonl --max-new-tokens 64 out.trace
  moeplace trace record --model reference --prompts builtin --max-new-tokens 32 --sample-every 2 ref.trace
  moeplace trace record --model reference --prompts builtin --max-new-tokens 16 --max-requests 24 quick.trace
  moeplace trace record --model src/moeplace/data/reference-fg \
      --prompts src/moeplace/data/reference-fg/heldout_prompts.jsonl --max-new-tokens 33 --min-new-tokens 33 \
      --no-weights --sample-every 2 --batch-size 64 reference-fg.trace
  moeplace trace record --model src/moeplace/data/reference-fg \
      --prompts src/moeplace/data/reference-fg/heldout_prompts.jsonl --max-new-tokens 0 --no-weights prefill.trace

--max-new-tokens 0 records the prompts' prefill only, without generate: plain forwards of length-sorted,
right-padded batches of at most --batch-tokens padded tokens (and --batch-size sequences, if given), with the
same rows the generate path records for the prompt tokens, and faster (measured in docs/CAPTURE.md).
scripts/prefill_trace.py builds a large held-out prefill trace of a reference model this way.

PROMPTS is JSONL, one {"prompt": "...", "domain": "code"} per line ("domain", "subdomain" and "source" optional;
without "source", a row with a "subdomain" is recorded with source "<domain>/<subdomain>", e.g. "code/c").
Request ids are the line order (0, 1, ...); --sample-every n records the requests whose id hashes to 1 in n.
--counts-only WINDOW keeps per-window expert counts only (docs/PRIVACY.md: what a per-token trace reveals).
A shard is flushed every --flush-every requests and on SIGTERM or Ctrl-C, so a killed recording keeps what was
flushed (meta.json then says "complete": false); see docs/RELIABILITY.md.
Supported routers: """ + ", ".join(ROUTER_CLASSES) + " (see docs/CAPTURE.md)."


def _reference(what: str, **kwargs):
    """Call ``moeplace.models.reference.<what>`` (imported lazily), or say clearly that it is not available."""
    try:
        reference = importlib.import_module("moeplace.models.reference")
    except ImportError as e:
        raise ValueError(f"the reference model is not available (moeplace.models.reference: {e})") from None
    try:
        return getattr(reference, what)(**kwargs)
    except FileNotFoundError as e:
        raise ValueError(f"the reference model is not available ({e})") from None


def _load_model(spec: str, device: str, dtype: str):
    from moeplace.trace.capture import load_causal_lm

    return load_causal_lm(spec, device, dtype, "--model")


class _Terminated(Exception):
    """Raised in the main thread by SIGTERM, so the writer flushes what it holds before the process exits."""


def _terminate(signum, frame) -> None:
    raise _Terminated()


def check_device(device: str) -> None:
    """ValueError when torch cannot use ``device`` on this machine (before any model is loaded)."""
    import torch

    kind, _, index = device.partition(":")
    if kind == "cpu":
        return
    backend = getattr(torch, kind, None)
    if backend is None or not backend.is_available():
        raise ValueError(f"--device {device}: this torch build has no usable {kind} device (use --device cpu)")
    if index and int(index) >= backend.device_count():
        raise ValueError(f"--device {device}: only {backend.device_count()} {kind} device(s) here")


def cmd_record(args: argparse.Namespace) -> int:
    from moeplace.trace.capture import (  # imports torch
        load_prompts,
        prompt_source,
        record_generate,
        record_prefill,
        trace_meta,
    )

    prefill_only = args.max_new_tokens == 0
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.batch_tokens < 1:
        raise ValueError(f"--batch-tokens must be >= 1, got {args.batch_tokens}")
    if args.batch_tokens != DEFAULT_PREFILL_BATCH_TOKENS and not prefill_only:
        raise ValueError("--batch-tokens applies to --max-new-tokens 0 only (generate batches are --batch-size "
                         "requests)")
    if args.sample_every < 1:
        raise ValueError(f"--sample-every must be >= 1, got {args.sample_every}")
    if args.min_new_tokens > args.max_new_tokens:
        raise ValueError(f"--min-new-tokens {args.min_new_tokens} exceeds --max-new-tokens {args.max_new_tokens}")
    if args.flush_every is None:
        args.flush_every = DEFAULT_PREFILL_FLUSH_EVERY if prefill_only else DEFAULT_FLUSH_EVERY
    if args.flush_every < 1:
        raise ValueError(f"--flush-every must be >= 1, got {args.flush_every}")
    if args.prompts == "builtin":
        rows = _reference("builtin_prompts")
    else:
        rows = load_prompts(args.prompts)
    if args.model != "reference" and not Path(args.model).is_dir():
        raise ValueError(f"--model {args.model}: not a directory (expected a local Hugging Face model directory "
                         "or 'reference')")
    check_device(args.device)
    model, tokenizer, name = _load_model(args.model, args.device, args.dtype)
    meta = trace_meta(model, sample_every=args.sample_every, model_name=name, record_weights=not args.no_weights)
    if prefill_only:
        meta.extra["phases"] = ("prefill only: --max-new-tokens 0, batched forwards without generate "
                                "(moeplace.trace.capture.record_prefill)")
    if args.counts_only is not None:
        from moeplace.trace.capture_counts import counts_meta

        meta = counts_meta(meta, args.counts_only)
    default_source = "builtin" if args.prompts == "builtin" else Path(args.prompts).name
    from moeplace.trace.writer import TraceWriter

    inputs = [p for p in (args.prompts, args.model) if p not in ("builtin", "reference")]
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        with TraceWriter(args.out, meta, overwrite=args.overwrite, inputs=inputs) as w:
            sink = None
            if args.counts_only is not None:
                from moeplace.trace.capture_counts import CountsSink

                sink = w = CountsSink(w, args.counts_only)
            common = dict(domains=[r.get("domain") or "unknown" for r in rows],
                          sources=[prompt_source(r) or default_source for r in rows], progress=True,
                          flush_every=args.flush_every, max_requests=args.max_requests)
            if prefill_only:
                s = record_prefill(model, tokenizer, [r["prompt"] for r in rows], w, batch_tokens=args.batch_tokens,
                                   batch_size=args.batch_size, **common)
            else:
                s = record_generate(
                    model, tokenizer, [r["prompt"] for r in rows], w,
                    max_new_tokens=args.max_new_tokens, batch_size=args.batch_size or 8,
                    generate_kwargs={"min_new_tokens": args.min_new_tokens} if args.min_new_tokens else None,
                    **common,
                )
            if sink is not None:
                sink.close()
    except _Terminated:
        print(f"moeplace trace record: terminated; the requests flushed so far are in {args.out} "
              "(marked incomplete)", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    foe = f", FoE groups H={meta.foe_groups}" if meta.foe_groups > 1 else ""
    if sink is not None:
        foe += f"; counts only: {sink.windows_written} windows of {args.counts_only} requests, no token rows"
    rate = f", {s['prefill_tokens'] / s['seconds']:,.0f} prompt tokens/s" if prefill_only and s["seconds"] > 0 else ""
    print(f"recorded {s['requests']} requests ({s['prefill_tokens']} prefill + {s['decode_tokens']} decode tokens; "
          f"L={meta.num_layers}, E={meta.num_experts}, k={meta.top_k}{foe}) in {s['seconds']:.1f} s{rate} "
          f"-> {args.out}")
    return 0


def register(tsub: argparse._SubParsersAction) -> None:
    """Add the ``record`` subcommand to ``moeplace trace``."""
    p = tsub.add_parser(
        "record", help="record routing from a local Hugging Face MoE model",
        description="Run prompts through model.generate (greedy, left-padded batches) and record every token's "
                    "routed experts per MoE layer, with prefill and decode told apart; with --max-new-tokens 0, "
                    "record the prefill only, through batched forwards (no generate).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, metavar="DIR",
                   help="local Hugging Face model directory (loaded offline), or 'reference'")
    p.add_argument("--prompts", required=True, metavar="FILE",
                   help="JSONL prompt file, or 'builtin' (the reference prompt set)")
    p.add_argument("--max-new-tokens", type=int_in(0, 1 << 20), required=True, metavar="N",
                   help="tokens to generate per request; 0: prefill only, batched forwards without generate")
    p.add_argument("--min-new-tokens", type=int_in(0, 1 << 20), default=0, metavar="N",
                   help="generate at least N tokens (EOS is masked until then, as transformers' min_new_tokens "
                        "and a serving benchmark's ignore-eos do; default 0: stop at EOS)")
    p.add_argument("--batch-size", type=int_in(1, 4096), default=None, metavar="B",
                   help="requests per generate call (default 8); with --max-new-tokens 0, at most B requests per "
                        "forward (default: as many as --batch-tokens allows)")
    p.add_argument("--batch-tokens", type=int_in(1, 1 << 24), default=DEFAULT_PREFILL_BATCH_TOKENS, metavar="N",
                   help="--max-new-tokens 0 only: padded tokens per forward (requests sorted by length; default "
                        f"{DEFAULT_PREFILL_BATCH_TOKENS}, the fastest on a 2-core CPU; raise it on a GPU)")
    p.add_argument("--sample-every", type=int_in(1, 1 << 20), default=1, metavar="n",
                   help="record 1 in n requests, chosen by request id (default 1: all)")
    p.add_argument("--max-requests", type=int_in(1, 1 << 30), default=None, metavar="N",
                   help="record only the first N (sampled) requests of PROMPTS, for a quick look (default: all)")
    p.add_argument("--device", type=device_spec, default="cpu", help="torch device, e.g. cpu or cuda:0 (default cpu)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="weights dtype (default auto: as saved)")
    p.add_argument("--no-weights", action="store_true",
                   help="record expert ids only, not the routers' top-k weights (about a quarter of the bytes)")
    p.add_argument("--flush-every", type=int_in(1, 1 << 20), default=None, metavar="N",
                   help=f"write a shard every N requests, so a kill loses at most N (default {DEFAULT_FLUSH_EVERY}; "
                        f"{DEFAULT_PREFILL_FLUSH_EVERY} with --max-new-tokens 0, where N is also the window sorted "
                        "by length)")
    p.add_argument("--counts-only", type=int_in(1, 1 << 30), default=None, metavar="WINDOW",
                   help="write per-window counts instead of per-token routing: each WINDOW consecutive requests "
                        "become one count row per phase (per layer and expert); no token rows, request ids or "
                        "lengths (a counts trace for plan --strategy eplb; docs/PRIVACY.md)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it is a moeplace trace (the new one is swapped in when complete)")
    p.add_argument("out", metavar="OUT", type=output_dir, help="trace directory to write")
    p.set_defaults(func=cmd_record)
