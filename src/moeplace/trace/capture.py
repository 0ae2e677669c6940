"""Capture routing from live Hugging Face transformers MoE models through forward hooks on their routers.

Shape legend: T = token rows, L = MoE layers, K = top-k, E = logical experts, B = sequences in a batch,
S = token columns one forward processes per sequence, N = B * S router rows of one forward.

In transformers 5.x every supported MoE block calls a router module that returns
``(router_logits, topk_weights, topk_indices)`` and hands exactly ``topk_indices`` [N, K] and ``topk_weights``
[N, K] to its experts module. A forward hook on each router therefore sees the routing the model executes, in
router order, whatever the rule (softmax top-k, DeepSeek-V3's biased group-limited top-k, gpt-oss's top-k over
logits). Supported router classes: :data:`ROUTER_CLASSES`; other ``*TopKRouter`` classes with the same contract
are picked up too.

Three levels of API:

- :func:`trace_meta` builds the :class:`TraceMeta` of a model (L, E, K, shared experts, hidden size, MoE layer map).
- :class:`RoutingRecorder` is a context manager that hooks the routers; bracket each batch with
  :meth:`RoutingRecorder.begin_batch` / :meth:`RoutingRecorder.end_batch` around ``model.generate`` (or plain
  forwards). :class:`NullRecorder` has the same methods and adds no hooks at all.
- :func:`record_generate` runs prompts through ``model.generate`` in left-padded batches and writes a trace.

Per forward the hooks only keep references (router outputs, the attention mask's last S columns); the
conversion to numpy happens once per batch in ``end_batch``, which is where the host waits for the device.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moeplace.io import DuplicateKeyError, unique_keys
from moeplace.trace.capture_spec import (
    DEFAULT_FLUSH_EVERY,
    DEFAULT_PREFILL_BATCH_TOKENS,
    DEFAULT_PREFILL_FLUSH_EVERY,
    REFERENCE_NAME,
    ROUTER_CLASSES,
)
from moeplace.trace.types import DECODE, PREFILL, TokenChunk, TraceError, TraceMeta
from moeplace.trace.writer import TraceWriter


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGTERM and SIGINT (main thread only) for the block; a signal that arrives meanwhile is delivered after.

    Used where a request's rows are handed to the writer, so a termination never splits a request.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


_ROUTER_NAME = re.compile(r"Top[Kk]Router$")
_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


# --------------------------------------------------------------------------------------------------- model inspection


def find_routers(model: torch.nn.Module) -> list[tuple[int, str, torch.nn.Module]]:
    """The router modules of ``model`` as ``(model_layer_index, module_name, module)``, in layer order.

    A router is a module whose class is in :data:`ROUTER_CLASSES` or whose class name ends in ``TopKRouter``
    (the transformers 5.x contract). Raises ValueError when the model has none.
    """
    found = []
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if cls not in ROUTER_CLASSES and not _ROUTER_NAME.search(cls):
            continue
        m = _LAYER_INDEX.search(name)
        if m is None:
            raise ValueError(f"router {name!r} ({cls}): cannot tell its layer index from the module name")
        found.append((int(m.group(1)), name, mod))
    if not found:
        raise ValueError(
            f"{type(model).__name__}: no MoE router found (supported router classes: {', '.join(ROUTER_CLASSES)})"
        )
    found.sort(key=lambda t: t[0])
    layers = [t[0] for t in found]
    if len(set(layers)) != len(layers):
        raise ValueError(f"{type(model).__name__}: several routers share a layer index ({layers})")
    return found


def _text_config(model: torch.nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def trace_meta(model: torch.nn.Module, sample_every: int = 1, model_name: str | None = None,
               record_weights: bool = True) -> TraceMeta:
    """The :class:`TraceMeta` for routing captured from ``model`` (``has_weights`` = ``record_weights``).

    ``sample_every``: record 1 in n requests (sampling rate 1/n). ``model_name`` defaults to the name or path the
    model was loaded from, else its class name. The MoE-layer map comes from the router module names, so dense
    layers (DeepSeek-V3's ``first_k_dense_replace``, Qwen's ``mlp_only_layers``) are left out of L.
    ``foe_groups`` is the config's ``foe_groups`` (a Federation-of-Experts model, :mod:`moeplace.models.foe`), else 1.
    A group-limited router (DeepSeek-V3's ``n_group`` > 1) is recorded in ``extra`` as ``expert_groups`` (contiguous
    blocks of E / n_group experts) and ``topk_groups`` (the most groups one token may use), so the trace alone can
    be checked against the rule.
    """
    n = _check_sample_every(sample_every)
    routers = find_routers(model)
    e_k = {(int(r.num_experts), int(r.top_k)) for _, _, r in routers}
    if len(e_k) != 1:
        raise ValueError(f"{type(model).__name__}: routers disagree on (num_experts, top_k): {sorted(e_k)}")
    (E, K), = e_k
    cfg = _text_config(model)
    shared = getattr(cfg, "n_shared_experts", None) or getattr(cfg, "num_shared_experts", None)
    if shared is None:  # Qwen2-MoE: one gated shared expert when its intermediate size is nonzero
        shared = 1 if getattr(cfg, "shared_expert_intermediate_size", 0) else 0
    name = model_name or getattr(model.config, "name_or_path", "") or type(model).__name__
    foe_groups = getattr(cfg, "foe_groups", None) or 1  # FoE (moeplace.models.foe): the router orders ids by group
    import transformers

    extra = {
        "architecture": type(model).__name__,
        "router_class": type(routers[0][2]).__name__,
        "expert_weights": "top-k weights the router hands to the experts module (after any normalisation "
                          "and scaling)",
        "gen_len": "decode tokens fed through the model; the last generated token and tokens after EOS are not",
    }
    n_group, topk_group = getattr(cfg, "n_group", None), getattr(cfg, "topk_group", None)
    if isinstance(n_group, int) and n_group > 1 and E % n_group == 0 and isinstance(topk_group, int):
        extra["expert_groups"] = n_group
        extra["topk_groups"] = topk_group
    return TraceMeta(
        model=str(name),
        num_layers=len(routers),
        num_experts=E,
        top_k=K,
        num_shared_experts=int(shared),
        hidden_size=getattr(cfg, "hidden_size", None),
        moe_layer_map=[layer for layer, _, _ in routers],
        sampling_rate=1.0 / n,
        has_weights=bool(record_weights),
        foe_groups=int(foe_groups),
        source=f"moeplace.trace.capture (transformers {transformers.__version__}, {type(model).__name__})",
        extra=extra,
    )


# --------------------------------------------------------------------------------------------------- sampling


def _check_sample_every(sample_every: int) -> int:
    if isinstance(sample_every, bool) or not isinstance(sample_every, (int, np.integer)) or sample_every < 1:
        raise ValueError(f"sample_every must be a positive integer (record 1 in n requests), got {sample_every!r}")
    return int(sample_every)


def sample_mask(request_ids: Sequence[int] | np.ndarray, sample_every: int) -> np.ndarray:
    """Which requests are recorded when recording 1 in ``sample_every``: bool [R].

    Deterministic in the request id alone (a splitmix64 hash modulo n), so the same request is always in or out,
    whatever batch it lands in, and ids that follow a pattern (every 4th request a code prompt) are not aliased.
    """
    n = _check_sample_every(sample_every)
    rid = np.asarray(request_ids, dtype=np.int64).astype(np.uint64)
    if n == 1:
        return np.ones(rid.shape, dtype=bool)
    with np.errstate(over="ignore"):
        z = rid + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(n)) == 0


# --------------------------------------------------------------------------------------------------- recorder


def check_writer(model: torch.nn.Module, writer: TraceWriter, record_weights: bool) -> None:
    """ValueError when ``writer.meta`` does not fit ``model`` (L, E, k) or wants weights that are not recorded."""
    meta = trace_meta(model)
    wm = writer.meta
    if (wm.num_layers, wm.num_experts, wm.top_k) != (meta.num_layers, meta.num_experts, meta.top_k):
        raise ValueError(
            f"writer metadata (L={wm.num_layers}, E={wm.num_experts}, k={wm.top_k}) does not match the "
            f"model (L={meta.num_layers}, E={meta.num_experts}, k={meta.top_k})"
        )
    if wm.has_weights and not record_weights:
        raise ValueError("writer metadata has has_weights=True but record_weights=False")


@dataclass
class CapturedBatch:
    """What one batch produced: token rows of the sampled requests and their request rows."""

    tokens: TokenChunk  # rows ordered by forward, then sequence, then position
    request_id: np.ndarray  # int64 [R] sampled requests of the batch
    domain: list[str]  # [R]
    source: list[str]  # [R]
    prompt_len: np.ndarray  # int32 [R]: prefill rows (prompt tokens without padding)
    gen_len: np.ndarray  # int32 [R]: decode rows


@dataclass
class _Step:
    """One forward of the top-level model: device tensors, converted in end_batch."""

    ids: torch.Tensor  # int16 [L, N, K]
    weights: torch.Tensor | None  # float16 [L, N, K]
    tokens: torch.Tensor | None  # int64 [B, S] input ids (None when the forward got inputs_embeds)
    real: torch.Tensor | None  # bool [B, S] attention mask of the new columns (None: all real)
    position: torch.Tensor | None  # int32 [B, S] index of each new column in its unpadded sequence
    width: int  # S


class RoutingRecorder:
    """Record per-token routing of a transformers MoE model while it runs.

    Use as a context manager (hooks are attached on enter and removed on exit)::

        meta = trace_meta(model)
        with TraceWriter("out.trace", meta) as w, RoutingRecorder(model, writer=w) as rec:
            rec.begin_batch([7, 8], domains=["code", "math"], prompt_width=enc.input_ids.shape[1])
            out = model.generate(**enc, max_new_tokens=16)
            rec.end_batch(out)          # rows of requests 7 and 8 (real tokens only) go to the writer

    Columns of the batch below ``prompt_width`` are prefill, later ones decode (default: the first forward is the
    prefill). Rows are kept for real tokens only (``attention_mask`` == 1); a decode token equal to an EOS id and
    everything after it in that sequence are dropped (a serving engine stops the request there), and so is a token
    the forwards fed that ``sequences`` does not contain. Forwards outside begin/end are not recorded.

    ``sample_every``: record 1 in n requests (:func:`sample_mask`); a batch with no sampled request costs one
    Python check per hook. ``record_weights=False`` skips the top-k weights.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        writer: TraceWriter | None = None,
        sample_every: int = 1,
        record_weights: bool = True,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> None:
        self.model = model
        self.routers = find_routers(model)
        self.num_layers = len(self.routers)
        self.sample_every = _check_sample_every(sample_every)
        self.record_weights = record_weights
        self.writer = writer
        if writer is not None:
            check_writer(model, writer, record_weights)
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        self.eos_token_ids = np.asarray(list(eos), dtype=np.int64)
        self._multi_device = len({p.device for _, _, r in self.routers for p in r.parameters()}) > 1
        self._handles: list = []
        self._active = False
        self._batch: dict | None = None
        self._steps: list[_Step] = []
        self._cur_ids: list[torch.Tensor | None] = [None] * self.num_layers
        self._cur_w: list[torch.Tensor | None] = [None] * self.num_layers
        self._cur_inputs: tuple | None = None

    # -- hooks
    def attach(self) -> RoutingRecorder:
        """Register the hooks (one per router plus a pre- and post-hook on the top-level model)."""
        if self._handles:
            return self
        for slot, (_, _, router) in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._router_hook(slot)))
        self._handles.append(self.model.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._post_forward))
        return self

    def detach(self) -> None:
        """Remove every hook this recorder added."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> RoutingRecorder:
        return self.attach()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.detach()
        self._active = False
        self._batch = None
        self._steps = []

    def _router_hook(self, slot: int):
        ids_of, w_of = self._cur_ids, self._cur_w

        def hook(module, args, out):
            if not self._active:
                return
            if not (isinstance(out, tuple) and len(out) == 3):
                raise TraceError(
                    f"{type(module).__name__}: expected the router to return (logits, topk_weights, topk_indices)"
                )
            ids_of[slot] = out[2]
            w_of[slot] = out[1]

        return hook

    def _pre_forward(self, module, args, kwargs) -> None:
        if not self._active:
            return
        for i in range(self.num_layers):
            self._cur_ids[i] = self._cur_w[i] = None
        tokens = kwargs.get("input_ids", args[0] if args else None)
        self._cur_inputs = (tokens, kwargs.get("attention_mask"))

    @torch.no_grad()
    def _post_forward(self, module, args, out) -> None:
        if not self._active or self._cur_inputs is None:
            return
        if any(t is None for t in self._cur_ids):
            missing = [self.routers[i][1] for i, t in enumerate(self._cur_ids) if t is None]
            raise TraceError(f"routers {missing} did not run in this forward; cannot record routing")
        cur_ids, cur_w = self._cur_ids, self._cur_w
        if self._multi_device:  # layers spread over devices (device_map="auto"): gather on the first
            dev = cur_ids[0].device
            cur_ids = [t.to(dev, non_blocking=True) for t in cur_ids]
            cur_w = [t.to(dev, non_blocking=True) for t in cur_w]
        ids = torch.stack(cur_ids).to(torch.int16)  # [L, N, K]
        w = torch.stack(cur_w).detach().to(torch.float16) if self.record_weights else None
        tokens, mask = self._cur_inputs
        self._cur_inputs = None
        B = self._batch["n"]
        if ids.shape[1] % B:
            raise TraceError(f"a forward routed {ids.shape[1]} rows, not a multiple of the batch's {B} sequences "
                             "(beam search and num_return_sequences > 1 are not supported)")
        S = ids.shape[1] // B
        real = pos = None
        if mask is not None:
            if mask.dim() != 2 or mask.shape[0] != B:
                raise TraceError(f"attention_mask of shape {tuple(mask.shape)}: expected 2-D [{B}, columns]")
            real = mask[:, -S:] != 0  # a new tensor: a view would keep the whole mask alive
            if S == 1:  # decode: the new token's position is the count of real columns before it
                pos = (mask.sum(-1, keepdim=True) - 1).to(torch.int32)
            else:
                pos = (mask.cumsum(-1)[:, -S:] - 1).to(torch.int32)
        if tokens is not None:
            if tokens.dim() != 2 or tokens.shape[0] != B:
                raise TraceError(f"input_ids of shape {tuple(tokens.shape)}: expected [{B}, columns] "
                                 "(one row per request of the batch)")
            tokens = tokens[:, -S:].clone()  # a view would keep generate's whole [B, columns] tensor alive
        self._steps.append(_Step(ids, w, tokens, real, pos, S))
        for i in range(self.num_layers):
            self._cur_ids[i] = self._cur_w[i] = None

    # -- batches
    def begin_batch(
        self,
        request_ids: Sequence[int] | np.ndarray,
        domains: Sequence[str] | None = None,
        sources: Sequence[str] | None = None,
        prompt_width: int | None = None,
    ) -> None:
        """Start recording a batch whose sequences are the requests ``request_ids`` [B], in batch order.

        ``prompt_width``: padded prompt length (columns of the prefill); default: the first forward's columns.
        """
        if self._batch is not None:
            raise TraceError("begin_batch: the previous batch was not ended (call end_batch first)")
        rid = np.asarray(request_ids, dtype=np.int64).reshape(-1)
        if len(rid) == 0:
            raise ValueError("begin_batch: request_ids is empty")
        if len(np.unique(rid)) != len(rid):
            raise ValueError(f"begin_batch: request_ids repeat within the batch: {rid.tolist()}")
        n = len(rid)
        dom = ["unknown"] * n if domains is None else [str(d) for d in domains]
        src = [""] * n if sources is None else [str(s) for s in sources]
        if len(dom) != n or len(src) != n:
            raise ValueError(f"begin_batch: domains/sources need {n} entries like request_ids")
        if prompt_width is not None and prompt_width < 1:
            raise ValueError(f"begin_batch: prompt_width must be >= 1, got {prompt_width}")
        keep = sample_mask(rid, self.sample_every)
        self._batch = dict(n=n, rid=rid, domain=dom, source=src, keep=keep, prompt_width=prompt_width)
        self._steps = []
        self._cur_inputs = None
        self._active = bool(keep.any()) and bool(self._handles)

    def end_batch(self, sequences: torch.Tensor | np.ndarray | None = None) -> CapturedBatch | None:
        """Finish the batch: convert the recorded forwards to token rows (and write them if a writer was given).

        ``sequences`` [B, columns]: what ``generate`` returned; when given, a decode token is kept only if the
        output holds it and a later token was generated from it. Returns None when no request was sampled.
        """
        if self._batch is None:
            raise TraceError("end_batch: no batch in progress (call begin_batch first)")
        batch, steps = self._batch, self._steps
        self._batch, self._steps, self._active = None, [], False
        if not batch["keep"].any():
            return None
        if not self._handles:
            raise TraceError("end_batch: the recorder is not attached (use it as a context manager)")
        seqs = None
        if sequences is not None:
            seqs = (sequences.detach().cpu().numpy() if isinstance(sequences, torch.Tensor)
                    else np.asarray(sequences))
            if seqs.ndim != 2 or seqs.shape[0] != batch["n"]:
                raise ValueError(f"end_batch: sequences of shape {seqs.shape}, expected [{batch['n']}, columns]")
        cb = self._rows(batch, steps, seqs)
        if self.writer is not None:
            with signals_held():  # a SIGTERM here would leave a request row without its tokens
                self.writer.add_requests(cb.request_id, cb.domain, cb.source, cb.prompt_len, cb.gen_len)
                t = cb.tokens
                self.writer.add_tokens(t.request_id, t.position, t.phase, t.expert_ids,
                                       t.expert_weights if self.writer.meta.has_weights else None)
        return cb

    def _rows(self, batch: dict, steps: list[_Step], seqs: np.ndarray | None) -> CapturedBatch:
        B, L = batch["n"], self.num_layers
        width = batch["prompt_width"] or (steps[0].width if steps else 0)
        # The host waits for the device here: one copy per kind of tensor for the whole batch.
        ids_all = _to_host([st.ids for st in steps])  # [L, N, K] per step
        w_all = _to_host([st.weights for st in steps])
        real_all = _to_host([st.real for st in steps])  # [B, S] per step
        pos_all = _to_host([st.position for st in steps])
        tok_all = _to_host([st.tokens for st in steps])
        finished = np.zeros(B, dtype=bool)
        keep_req = batch["keep"]
        col0 = 0
        parts_rid, parts_pos, parts_ph, parts_ids, parts_w = [], [], [], [], []
        n_pre = np.zeros(B, np.int64)
        n_dec = np.zeros(B, np.int64)
        for i, st in enumerate(steps):
            S = st.width
            cols = col0 + np.arange(S)  # [S] column of each new token in the padded batch
            col0 += S
            real = np.ones((B, S), bool) if real_all[i] is None else real_all[i]
            if pos_all[i] is None:  # no attention mask: nothing is padding, positions are columns
                pos = np.broadcast_to(cols[None, :], (B, S)).astype(np.int32)
            else:
                pos = pos_all[i]
            decode = cols >= width  # [S]
            keep = real & keep_req[:, None]
            tokens = tok_all[i]
            if decode.any():
                if seqs is not None:
                    fed_ok = cols < seqs.shape[1] - 1  # the last output token is never fed back
                    keep &= fed_ok[None, :] | ~decode[None, :]
                    if tokens is not None:
                        inside = cols < seqs.shape[1]
                        if not np.array_equal(tokens[:, inside], seqs[:, cols[inside]]):
                            raise TraceError("end_batch: the tokens fed to the model differ from `sequences` "
                                             "(beam search or reordered outputs are not supported)")
                if tokens is not None and len(self.eos_token_ids):
                    for j in np.flatnonzero(decode):  # S is 1 per decode forward of generate
                        finished |= np.isin(tokens[:, j], self.eos_token_ids)
                        keep[:, j] &= ~finished
            b_idx, j_idx = np.nonzero(keep)  # row-major: sequence, then column
            if len(b_idx) == 0:
                continue
            phase = np.where(decode[j_idx], DECODE, PREFILL).astype(np.int8)
            np.add.at(n_pre, b_idx[phase == PREFILL], 1)
            np.add.at(n_dec, b_idx[phase == DECODE], 1)
            flat = b_idx * S + j_idx  # router row of each kept token
            parts_ids.append(ids_all[i][:, flat].transpose(1, 0, 2))
            if w_all[i] is not None:
                parts_w.append(w_all[i][:, flat].transpose(1, 0, 2))
            parts_rid.append(batch["rid"][b_idx])
            parts_pos.append(pos[b_idx, j_idx].astype(np.int32))
            parts_ph.append(phase)
        K = steps[0].ids.shape[2] if steps else self.routers[0][2].top_k
        if parts_rid:
            chunk = TokenChunk(
                np.concatenate(parts_rid), np.concatenate(parts_pos), np.concatenate(parts_ph),
                np.concatenate(parts_ids).astype(np.int16),
                np.concatenate(parts_w).astype(np.float16) if self.record_weights else None,
            )
        else:
            chunk = TokenChunk(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int8),
                               np.zeros((0, L, K), np.int16),
                               np.zeros((0, L, K), np.float16) if self.record_weights else None)
        sel = np.flatnonzero(keep_req)
        return CapturedBatch(
            tokens=chunk,
            request_id=batch["rid"][sel],
            domain=[batch["domain"][i] for i in sel],
            source=[batch["source"][i] for i in sel],
            prompt_len=n_pre[sel].astype(np.int32),
            gen_len=n_dec[sel].astype(np.int32),
        )


def _to_host(tensors: list[torch.Tensor | None]) -> list[np.ndarray | None]:
    """Copy tensors to numpy, in one transfer when they share a device and dtype; None stays None."""
    present = [t for t in tensors if t is not None]
    if not present:
        return [None] * len(tensors)
    if len({t.device for t in present}) > 1 or len({t.dtype for t in present}) > 1:
        host = iter([t.cpu().numpy() for t in present])
    else:
        whole = torch.cat([t.reshape(-1) for t in present]).cpu().numpy()
        parts = np.split(whole, np.cumsum([t.numel() for t in present])[:-1])
        host = iter([p.reshape(tuple(t.shape)) for p, t in zip(parts, present, strict=True)])
    return [None if t is None else next(host) for t in tensors]


class NullRecorder:
    """The no-op twin of :class:`RoutingRecorder`: same methods, no hooks, nothing recorded, no cost."""

    def __init__(self, model: torch.nn.Module | None = None, *args, **kwargs) -> None:
        self.model = model

    def attach(self) -> NullRecorder:
        return self

    def detach(self) -> None:
        pass

    def __enter__(self) -> NullRecorder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        pass

    def begin_batch(self, request_ids, domains=None, sources=None, prompt_width=None) -> None:
        pass

    def end_batch(self, sequences=None) -> None:
        return None


# --------------------------------------------------------------------------------------------------- generate


def _resolve_eos(model: torch.nn.Module, tokenizer, eos_token_id) -> list[int]:
    if eos_token_id is None:
        gc = getattr(model, "generation_config", None)
        eos_token_id = getattr(gc, "eos_token_id", None) if gc is not None else None
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = getattr(tokenizer, "eos_token_id", None)
    if eos_token_id is None:
        return []
    return [int(eos_token_id)] if isinstance(eos_token_id, (int, np.integer)) else [int(e) for e in eos_token_id]


def _tokenize(tokenizer, prompts: Sequence) -> list[list[int]]:
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"prompt {i} is text but no tokenizer was given (pass a tokenizer or token ids)")
            ids = tokenizer(p)["input_ids"]
        else:
            ids = p.tolist() if isinstance(p, (np.ndarray, torch.Tensor)) else list(p)
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty after tokenization")
        out.append([int(t) for t in ids])
    return out


def _select_requests(caller: str, model, tokenizer, prompts, writer: TraceWriter, domains, request_ids, sources,
                     flush_every: int | None, max_requests: int | None, max_new_tokens: int):
    """Check the arguments shared by :func:`record_generate` and :func:`record_prefill`; tokenize the sampled
    requests. Returns (request ids [R], domains [R], sources [R], chosen indices, token lists of chosen, n)."""
    R = len(prompts)
    if R == 0:
        raise ValueError(f"{caller}: no prompts")
    if flush_every is not None and flush_every < 1:
        raise ValueError(f"flush_every must be >= 1, got {flush_every}")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    rids = np.arange(R, dtype=np.int64) if request_ids is None else np.asarray(request_ids, dtype=np.int64)
    dom = ["unknown"] * R if domains is None else list(domains)
    src = [""] * R if sources is None else list(sources)
    for name, v in (("request_ids", rids), ("domains", dom), ("sources", src)):
        if len(v) != R:
            raise ValueError(f"{caller}: {name} has {len(v)} entries, prompts has {R}")
    if len(np.unique(rids)) != R:
        raise ValueError(f"{caller}: request_ids repeat")
    rate = float(writer.meta.sampling_rate)
    sample_every = int(round(1.0 / rate))
    if abs(1.0 / sample_every - rate) > 1e-9:
        raise ValueError(f"writer sampling_rate {rate} is not 1/n for an integer n")
    chosen = np.flatnonzero(sample_mask(rids, sample_every))[:max_requests]
    ids = _tokenize(tokenizer, [prompts[i] for i in chosen])
    max_pos = getattr(_text_config(model), "max_position_embeddings", None)
    if isinstance(max_pos, int) and max_pos > 0:
        for j, t in enumerate(ids):
            if len(t) + max_new_tokens > max_pos:
                raise ValueError(f"request {int(rids[chosen[j]])}: prompt of {len(t)} tokens + max_new_tokens "
                                 f"{max_new_tokens} exceeds the model's {max_pos} positions "
                                 "(max_position_embeddings); shorten the prompt or lower max_new_tokens")
    return rids, dom, src, chosen, ids, sample_every


def _pad_id(model, tokenizer, eos: list[int]) -> int:
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if pad is None:
        pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    return int(pad)


def record_generate(
    model: torch.nn.Module,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    writer: TraceWriter,
    domains: Sequence[str] | None = None,
    request_ids: Sequence[int] | None = None,
    sources: Sequence[str] | None = None,
    max_new_tokens: int = 32,
    batch_size: int = 8,
    eos_token_id: int | Sequence[int] | None = None,
    generate_kwargs: dict | None = None,
    progress: bool = False,
    flush_every: int | None = DEFAULT_FLUSH_EVERY,
    max_requests: int | None = None,
) -> dict:
    """Run ``prompts`` through ``model.generate`` in left-padded batches and write their routing to ``writer``.

    ``prompts`` [R]: texts (tokenized with ``tokenizer``) or token id lists (``tokenizer`` may be None).
    ``domains``/``sources`` [R] tag the request rows (default "unknown" / ""); ``request_ids`` [R] default 0..R-1.
    The sampling rate is ``writer.meta.sampling_rate`` (build it with ``trace_meta(model, sample_every=n)``):
    requests that are not sampled are not generated at all. Decoding is greedy unless ``generate_kwargs`` says
    otherwise; EOS defaults to the model's generation config, else the tokenizer's.
    ``flush_every``: write a shard after at least this many requests (after the batch that reaches it), so a
    kill loses at most that many; None flushes only when the writer's shard is full.
    ``max_requests``: record only the first this many sampled requests (in prompt order); None records all.
    ``progress`` shows a bar on stderr with requests done, elapsed time, the estimated time left and the rate.
    A prompt whose length plus ``max_new_tokens`` exceeds the model's ``max_position_embeddings`` is refused
    (ValueError naming the request) before anything runs: the model was never trained on such positions.
    The top-k weights are recorded when ``writer.meta.has_weights`` (``trace_meta(..., record_weights=False)``
    leaves them out: ids only, about a quarter of the bytes).
    Returns a summary: requests, prefill_tokens, decode_tokens, seconds.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens} (record_prefill records prompts "
                         "without generating)")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rids, dom, src, chosen, ids, sample_every = _select_requests(
        "record_generate", model, tokenizer, prompts, writer, domains, request_ids, sources, flush_every,
        max_requests, max_new_tokens)
    eos = _resolve_eos(model, tokenizer, eos_token_id)
    pad = _pad_id(model, tokenizer, eos)
    device = next(model.parameters()).device
    gen_kw = dict(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad,
                  eos_token_id=eos if eos else None)
    gen_kw.update(generate_kwargs or {})
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(chosen), unit="req", desc="recording", dynamic_ncols=True,
                   bar_format="{desc} {n_fmt}/{total_fmt} requests |{bar}| {elapsed} elapsed, ETA {remaining} "
                              "({rate_fmt}){postfix}")
    n_pre = n_dec = 0
    since_flush = 0
    t0 = time.perf_counter()
    try:
        with RoutingRecorder(model, writer=writer, sample_every=sample_every, eos_token_id=eos,
                             record_weights=bool(writer.meta.has_weights)) as rec:
            for s in range(0, len(chosen), batch_size):
                idx = chosen[s:s + batch_size]
                toks = ids[s:s + batch_size]
                width = max(len(t) for t in toks)
                inp = torch.full((len(toks), width), pad, dtype=torch.long)
                mask = torch.zeros((len(toks), width), dtype=torch.long)
                for b, t in enumerate(toks):  # left padding: the prompt ends at the last column
                    inp[b, width - len(t):] = torch.tensor(t)
                    mask[b, width - len(t):] = 1
                rec.begin_batch(rids[idx], [dom[i] for i in idx], [src[i] for i in idx], prompt_width=width)
                with torch.no_grad():
                    out = model.generate(input_ids=inp.to(device), attention_mask=mask.to(device), **gen_kw)
                seqs = out.sequences if hasattr(out, "sequences") else out
                cb = rec.end_batch(seqs)
                n_pre += int(cb.prompt_len.sum())
                n_dec += int(cb.gen_len.sum())
                since_flush += len(idx)
                if flush_every is not None and since_flush >= flush_every:
                    with signals_held():
                        writer.flush()  # a kill from here on loses nothing recorded so far
                    since_flush = 0
                if bar is not None:
                    bar.set_postfix_str(f"{n_pre:,} prefill + {n_dec:,} decode tokens", refresh=False)
                    bar.update(len(idx))
    finally:
        if bar is not None:
            bar.close()
    return dict(requests=int(len(chosen)), prefill_tokens=n_pre, decode_tokens=n_dec,
                seconds=time.perf_counter() - t0)


def prefill_batches(lengths: Sequence[int] | np.ndarray, batch_tokens: int,
                    batch_size: int | None = None) -> list[np.ndarray]:
    """Indices into ``lengths`` [R] grouped into forwards: longest first, each forward at most ``batch_size``
    sequences and ``batch_tokens`` padded tokens (sequences x its longest length; a prompt longer than
    ``batch_tokens`` gets a forward of its own). Sorting by length keeps the padding small."""
    n = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-n, kind="stable")
    out, cur, width = [], [], 0
    for i in order:
        if cur and ((len(cur) + 1) * width > batch_tokens or (batch_size is not None and len(cur) >= batch_size)):
            out.append(np.asarray(cur))
            cur = []
        if not cur:
            width = int(n[i])
        cur.append(int(i))
    if cur:
        out.append(np.asarray(cur))
    return out


def _forward_kwargs(model: torch.nn.Module) -> dict:
    """What a prefill-only forward can leave out: the KV cache, logits beyond one column, router logits."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    kw = {}
    if "use_cache" in params:
        kw["use_cache"] = False
    if "logits_to_keep" in params:
        kw["logits_to_keep"] = 1
    if "output_router_logits" in params:
        kw["output_router_logits"] = False  # no auxiliary loss either; the routers run the same
    return kw


def _merge_batches(parts: list[CapturedBatch]) -> CapturedBatch:
    """One CapturedBatch from several, requests and token rows in request-id order (positions stay ascending)."""
    rid = np.concatenate([c.request_id for c in parts])
    order = np.argsort(rid, kind="stable")
    t = [c.tokens for c in parts]
    trid = np.concatenate([c.request_id for c in t])
    torder = np.argsort(trid, kind="stable")  # each request's rows come from one forward, in position order
    w = None if t[0].expert_weights is None else np.concatenate([c.expert_weights for c in t])[torder]
    tokens = TokenChunk(trid[torder], np.concatenate([c.position for c in t])[torder],
                        np.concatenate([c.phase for c in t])[torder],
                        np.concatenate([c.expert_ids for c in t])[torder], w)
    dom = [d for c in parts for d in c.domain]
    src = [x for c in parts for x in c.source]
    return CapturedBatch(tokens=tokens, request_id=rid[order], domain=[dom[i] for i in order],
                         source=[src[i] for i in order],
                         prompt_len=np.concatenate([c.prompt_len for c in parts])[order],
                         gen_len=np.concatenate([c.gen_len for c in parts])[order])


def record_prefill(
    model: torch.nn.Module,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    writer: TraceWriter,
    domains: Sequence[str] | None = None,
    request_ids: Sequence[int] | None = None,
    sources: Sequence[str] | None = None,
    batch_tokens: int = DEFAULT_PREFILL_BATCH_TOKENS,
    batch_size: int | None = None,
    progress: bool = False,
    flush_every: int | None = DEFAULT_PREFILL_FLUSH_EVERY,
    max_requests: int | None = None,
) -> dict:
    """Record the prefill routing of ``prompts`` with plain batched forwards (no ``generate``, no decode).

    Same arguments and guarantees as :func:`record_generate` (sampling from ``writer.meta``, ``max_requests``,
    refusal of prompts longer than ``max_position_embeddings``, flushes, weights), but every request gets prefill
    rows only (``gen_len`` 0). The requests are taken in windows of ``flush_every`` requests (default 256; None: 256
    the writer flushes when its shard is full); inside a window they are sorted by length and cut into forwards of
    at most ``batch_size`` sequences and ``batch_tokens`` padded tokens (:func:`prefill_batches`), right-padded
    with an attention mask, so a real token attends only to its own earlier tokens and sits at its own position:
    the rows equal those the generate path records for the same prompts (tests/test_trace_record_prefill.py). The
    window's rows are written in request-id order and flushed, so a kill loses at most one window. Each forward
    skips the KV cache and all logits but one column (when the model's forward takes ``use_cache`` /
    ``logits_to_keep``). ``progress`` shows a bar on stderr with prompt tokens done, elapsed time, the estimated
    time left and the rate. Returns a summary: requests, prefill_tokens, decode_tokens (0), seconds, forwards.
    """
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rids, dom, src, chosen, ids, sample_every = _select_requests(
        "record_prefill", model, tokenizer, prompts, writer, domains, request_ids, sources, flush_every,
        max_requests, 0)
    pad = _pad_id(model, tokenizer, _resolve_eos(model, tokenizer, None))
    device = next(model.parameters()).device
    fwd_kw = _forward_kwargs(model)
    window = flush_every if flush_every is not None else 256
    lengths = np.asarray([len(t) for t in ids], dtype=np.int64)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=int(lengths.sum()), unit="tok", unit_scale=True, desc="recording prefill",
                   dynamic_ncols=True, bar_format="{desc} {n_fmt}/{total_fmt} tokens |{bar}| {elapsed} elapsed, "
                                                  "ETA {remaining} ({rate_fmt}){postfix}")
    n_pre = n_req = forwards = 0
    t0 = time.perf_counter()
    try:
        with RoutingRecorder(model, writer=None, sample_every=sample_every,
                             record_weights=bool(writer.meta.has_weights)) as rec:
            check_writer(model, writer, rec.record_weights)
            for w0 in range(0, len(chosen), window):
                parts = []
                for b in prefill_batches(lengths[w0:w0 + window], batch_tokens, batch_size):
                    pos = w0 + b  # indices into chosen / ids
                    toks = [ids[j] for j in pos]
                    width = max(len(t) for t in toks)
                    inp = torch.full((len(toks), width), pad, dtype=torch.long)
                    mask = torch.zeros((len(toks), width), dtype=torch.long)
                    for r, t in enumerate(toks):  # right padding: the prompt starts at column 0
                        inp[r, :len(t)] = torch.tensor(t)
                        mask[r, :len(t)] = 1
                    idx = chosen[pos]
                    rec.begin_batch(rids[idx], [dom[i] for i in idx], [src[i] for i in idx], prompt_width=width)
                    with torch.no_grad():
                        model(input_ids=inp.to(device), attention_mask=mask.to(device), **fwd_kw)
                    parts.append(rec.end_batch())
                    forwards += 1
                    if bar is not None:
                        bar.update(int(lengths[pos].sum()))
                cb = _merge_batches(parts)
                with signals_held():  # a SIGTERM here would leave a request row without its tokens
                    writer.add_requests(cb.request_id, cb.domain, cb.source, cb.prompt_len, cb.gen_len)
                    t = cb.tokens
                    writer.add_tokens(t.request_id, t.position, t.phase, t.expert_ids,
                                      t.expert_weights if writer.meta.has_weights else None)
                    if flush_every is not None:
                        writer.flush()  # a kill from here on loses nothing recorded so far
                n_pre += int(cb.prompt_len.sum())
                n_req += len(cb.request_id)
                if bar is not None:
                    bar.set_postfix_str(f"{n_req:,}/{len(chosen):,} requests", refresh=False)
    finally:
        if bar is not None:
            bar.close()
    return dict(requests=int(len(chosen)), prefill_tokens=n_pre, decode_tokens=0,
                seconds=time.perf_counter() - t0, forwards=forwards)


# --------------------------------------------------------------------------------------------------- prompt files


def prompt_source(row: dict) -> str | None:
    """The trace ``source`` of a prompt row: its ``"source"``, else ``"<domain>/<subdomain>"`` when it has a
    sub-domain (the reference models' held-out prompts, e.g. ``"code/c"``), else None."""
    if row.get("source"):
        return str(row["source"])
    if row.get("subdomain"):
        return f"{row.get('domain') or 'unknown'}/{row['subdomain']}"
    return None


def load_prompts(path: str | os.PathLike) -> list[dict]:
    """Read a JSONL prompt file: one ``{"prompt": str, "domain": str, "subdomain": str, "source": str}`` a line
    (all but "prompt" optional). A row's ``source`` is :func:`prompt_source` (so a sub-domain reaches the trace).

    Blank lines are skipped. Raises ValueError naming the file and line for anything else.
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{p}: no such prompts file")
    if not p.is_file():
        raise ValueError(f"{p}: not a file (expected JSONL with one {{\"prompt\": ...}} per line)")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not UTF-8 text ({e})") from None
    rows = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line, object_pairs_hook=unique_keys)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{n}: invalid JSON ({e.msg})") from None
        except DuplicateKeyError as e:
            raise ValueError(f"{p}:{n}: invalid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{p}:{n}: expected a JSON object like {{\"prompt\": ..., \"domain\": ...}}")
        if "prompt" not in obj:
            raise ValueError(f"{p}:{n}: missing \"prompt\" key")
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ValueError(f"{p}:{n}: \"prompt\" must be a non-empty string, got {obj['prompt']!r}")
        for key in ("domain", "subdomain", "source"):
            if key in obj and not isinstance(obj[key], str):
                raise ValueError(f"{p}:{n}: \"{key}\" must be a string, got {obj[key]!r}")
        rows.append({"prompt": obj["prompt"], "domain": obj.get("domain", "unknown"),
                     "subdomain": obj.get("subdomain"), "source": prompt_source(obj)})
    if not rows:
        raise ValueError(f"{p}: no prompts (empty file)")
    return rows


def load_causal_lm(spec: str, device: str = "cpu", dtype: str = "auto", flag: str = "--model"):
    """(model in eval mode on ``device``, tokenizer, model name) for ``spec``: ``reference`` (the bundled
    reference MoE, :func:`moeplace.models.reference.load_reference`) or a local Hugging Face model directory (an
    FoE folder included). The one model loader of ``trace record`` and ``operate --source live``; ValueError
    naming ``flag`` when the model cannot be loaded."""
    if spec == "reference":
        try:
            from moeplace.models.reference import load_reference
        except ImportError as e:
            raise ValueError(f"the reference model is not available (moeplace.models.reference: {e})") from None
        kw = {} if dtype == "auto" else {"dtype": dtype}
        try:
            model, tokenizer = load_reference(device=device, **kw)
        except FileNotFoundError as e:
            raise ValueError(f"the reference model is not available ({e})") from None
        return model, tokenizer, REFERENCE_NAME
    d = Path(spec)
    if not d.is_dir():
        raise ValueError(f"{flag} {spec}: not a directory (expected a local Hugging Face model directory or "
                         "'reference')")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import moeplace.models.foe  # noqa: F401  (registers model_type "qwen3_foe", so a saved FoE folder loads)

    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(d, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True, dtype=torch_dtype)
    except Exception as e:  # transformers and tokenizers raise OSError, KeyError, ValueError, a bare Exception...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ValueError(f"{flag} {spec}: cannot load a model and tokenizer from this directory "
                         f"({type(e).__name__}: {first})") from None
    return model.to(device).eval(), tokenizer, str(d)
