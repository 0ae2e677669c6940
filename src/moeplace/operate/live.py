"""A live source for the operate loop: routing produced by a model's ``generate`` as it runs, through the capture
hooks of :mod:`moeplace.trace.capture`.

Shape legend: T = token rows, L = MoE layers, K = top-k, Rq = requests.

For each window of ``window_requests`` prompts, :func:`moeplace.trace.capture.record_generate` runs them through
``model.generate`` (greedy, left-padded batches of ``batch_size``, EOS from the model's generation config) with a
:class:`moeplace.trace.capture.RoutingRecorder` on its routers; the recorder hands each batch's rows to a
:class:`WindowCollector` (the writer side of ``record_generate``, kept in memory) instead of a trace folder, and the
window is yielded to the loop as an in-memory trace. The loop then does exactly what it does for a replayed trace:
the same counters (1-in-n sampling of token rows by running index, :mod:`.counters`), the same simulator replay,
the same policy.

Every request is captured (the recorder's own request sampling is 1 in 1): the loop's drops and per-GPU load count
every row, and the counters sample 1 in n themselves. Rows keep the recorder's order (forward, then sequence), the
order ``moeplace trace record`` writes them in, so a recording of the same prompts with the same batch size, replayed
in table order with the same windows, gives the loop the same rows in the same order.

The loop runs between windows in the same thread: generation pauses while a window is counted, replayed and decided
on (``bench/operate_overhead.py`` measures the counters' share of ``generate``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from moeplace.operate.streams import Stream
from moeplace.trace.types import Requests, TokenChunk, Trace, TraceMeta


class WindowCollector:
    """Receives what :func:`moeplace.trace.capture.record_generate` would write to a trace folder (the
    ``add_requests`` / ``add_tokens`` / ``flush`` side of :class:`moeplace.trace.TraceWriter`) and keeps it in
    memory until :meth:`take` turns it into one window."""

    def __init__(self, meta: TraceMeta) -> None:
        self.meta = meta  # the recorder checks L, E, K and has_weights against it
        self._req: list[tuple] = []
        self._tok: list[TokenChunk] = []

    def add_requests(self, request_id, domain=None, source=None, prompt_len=None, gen_len=None) -> None:
        n = len(request_id)
        self._req.append((np.asarray(request_id, np.int64),
                          np.asarray(["unknown"] * n if domain is None else list(domain), dtype=object),
                          np.asarray([""] * n if source is None else list(source), dtype=object),
                          np.asarray(prompt_len, np.int32), np.asarray(gen_len, np.int32)))

    def add_tokens(self, request_id, position, phase, expert_ids, expert_weights=None) -> None:
        self._tok.append(TokenChunk(np.asarray(request_id, np.int64), np.asarray(position, np.int32),
                                    np.asarray(phase, np.int8), np.asarray(expert_ids, np.int16)))

    def flush(self) -> None:
        """Nothing to write: rows stay in memory until :meth:`take`."""

    def take(self) -> Trace:
        """The rows received since the last call as an in-memory trace (rows in the order received)."""
        L, K = self.meta.num_layers, self.meta.top_k
        cols = list(zip(*self._req, strict=True)) if self._req else [[np.zeros(0, np.int64)],
                                                                      [np.zeros(0, object)], [np.zeros(0, object)],
                                                                      [np.zeros(0, np.int32)], [np.zeros(0, np.int32)]]
        req = Requests(*(np.concatenate(c) for c in cols))
        tok = self._tok or [TokenChunk(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int8),
                                       np.zeros((0, L, K), np.int16))]
        tokens = TokenChunk(*(np.concatenate([getattr(t, f) for t in tok])
                              for f in ("request_id", "position", "phase", "expert_ids")))
        self._req, self._tok = [], []
        return Trace(self.meta, req, tokens, None)


def live_stream(model, tokenizer, prompts: Sequence[dict], window_requests: int, max_new_tokens: int,
                batch_size: int = 8, model_name: str | None = None, prompts_name: str = "prompts") -> Stream:
    """A stream whose windows are generated as they are consumed: ``prompts`` [Rq] rows ``{"prompt": str,
    "domain": str (optional), "source": str (optional)}`` (as :func:`moeplace.trace.capture.load_prompts` and
    :func:`moeplace.models.reference.builtin_prompts` return them); request ids are the row order 0..Rq-1.

    A window's prompts run in batches of ``batch_size`` (a window that is not a multiple of it ends with a smaller
    batch). Errors of the model or the prompts (a prompt too long for the model) surface when the window that holds
    them is generated, as ValueError, and the loop stops there with its last plan kept.
    """
    from moeplace.trace.capture import record_generate, trace_meta

    if isinstance(window_requests, bool) or not isinstance(window_requests, int) or window_requests < 1:
        raise ValueError(f"window_requests must be a positive integer, got {window_requests!r}")
    if not prompts:
        raise ValueError(f"{prompts_name}: no prompts")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    meta = trace_meta(model, sample_every=1, model_name=model_name)
    meta = TraceMeta(**{**meta.to_json(), "has_weights": False, "complete": False,
                        "source": f"live generate, {meta.source}"})
    rows = list(prompts)

    def windows() -> Iterator[Trace]:
        sink = WindowCollector(meta)
        for s in range(0, len(rows), window_requests):
            part = rows[s:s + window_requests]
            record_generate(model, tokenizer, [r["prompt"] for r in part], sink,
                            domains=[r.get("domain") or "unknown" for r in part],
                            sources=[r.get("source") or prompts_name for r in part],
                            request_ids=range(s, s + len(part)), max_new_tokens=max_new_tokens,
                            batch_size=batch_size, flush_every=None)
            yield sink.take()

    label = (f"live generate of {meta.model} ({len(rows)} prompts of {prompts_name} in file order, greedy, "
             f"max_new_tokens {max_new_tokens}, batches of {batch_size})")
    info = {"source": "live", "model": meta.model, "prompts": prompts_name, "requests": len(rows),
            "max_new_tokens": max_new_tokens, "batch_size": batch_size}
    return Stream(label, meta, windows(), len(rows), info)


def open_live(model: str, prompts: str, window_requests: int, max_new_tokens: int, batch_size: int = 8,
              max_requests: int | None = None, device: str = "cpu") -> Stream:
    """The live stream ``moeplace operate --source live`` runs: ``model`` is ``reference`` (the bundled reference
    MoE, :func:`moeplace.models.reference.load_reference`) or a local Hugging Face model directory; ``prompts`` is
    ``builtin`` (the reference model's held-out prompts) or a JSONL file (:func:`moeplace.trace.capture.load_prompts`);
    ``max_requests`` keeps the first N prompts."""
    from moeplace.trace.capture import load_prompts

    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    if prompts == "builtin":
        from moeplace.models.reference import builtin_prompts

        rows, pname = builtin_prompts(), "builtin"
    else:
        rows, pname = load_prompts(prompts), Path(prompts).name
    rows = rows[:max_requests] if max_requests is not None else rows
    from moeplace.trace.capture import load_causal_lm

    mdl, tok, name = load_causal_lm(model, device, flag="model")
    return live_stream(mdl, tok, rows, window_requests, max_new_tokens, batch_size, name, pname)
