"""The expert-parallel dispatcher: where each token's hidden vector goes, and back.

Shape legend: T = this GPU's tokens, K = top-k, H = hidden size, W = ranks (GPUs), G = GPUs per node,
S = slots per GPU, N = rows (one hidden vector sent to one peer), N1 / N2 = rows received in stage 1 / 2.

One-hop (per-GPU dedup, the standard all-to-all): a token's vector goes once to every GPU serving at least one
of its (token, k) pairs; the combine sends one weighted partial sum back per row.

Two-hop (per-node dedup, DeepEP style): a token goes directly to the GPUs of its own node that serve it, and at
most once to each remote node, to the *proxy* GPU with the same local index as the sender (``n * G + rank % G``,
rail-aligned); the proxy forwards it inside its node to the other GPUs serving it. The combine runs in reverse:
forwarded partial sums return to the proxy, which adds them to its own and sends one vector back per node.

Every exchange sends counts first (``all_to_all_single`` on an int64 [W] tensor) and then the rows with uneven
split sizes. Dispatch returns a frozen :class:`DispatchMeta` that combine consumes; the dispatcher keeps no
per-call state. Bytes actually handed to ``all_to_all_single`` are added to a :class:`TrafficRecorder`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

STAGES = ("dispatch", "combine")


class TrafficRecorder:
    """Bytes this rank passes to ``all_to_all_single`` per destination rank, kept apart per stage.

    ``payload[stage]``: int64 [W] hidden-vector bytes (what MODEL.md's cost model counts); ``meta``: int64 [W]
    routing metadata bytes (slot ids and weights sent beside the rows); ``counts``: int64 [W] count exchanges.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.reset()

    def reset(self) -> None:
        W = self.world_size
        self.payload = {s: np.zeros(W, np.int64) for s in STAGES}
        self.meta = np.zeros(W, np.int64)
        self.counts = np.zeros(W, np.int64)

    def add_payload(self, stage: str, rows_per_peer: list[int], row_bytes: int) -> None:
        self.payload[stage] += np.asarray(rows_per_peer, np.int64) * row_bytes

    def add_meta(self, rows_per_peer: list[int], row_bytes: int) -> None:
        self.meta += np.asarray(rows_per_peer, np.int64) * row_bytes

    def add_counts(self, row_bytes: int) -> None:
        self.counts += row_bytes

    def take(self) -> dict[str, np.ndarray]:
        """The bytes since the last take (``dispatch``, ``combine``, ``meta``, ``counts``: int64 [W]); resets."""
        out = {**{s: v.copy() for s, v in self.payload.items()}, "meta": self.meta.copy(),
               "counts": self.counts.copy()}
        self.reset()
        return out


class NullTrafficRecorder(TrafficRecorder):
    """A recorder that records nothing (instrumentation off)."""

    def __init__(self, world_size: int = 0) -> None:
        super().__init__(world_size)

    def add_payload(self, stage: str, rows_per_peer: list[int], row_bytes: int) -> None:
        pass

    def add_meta(self, rows_per_peer: list[int], row_bytes: int) -> None:
        pass

    def add_counts(self, row_bytes: int) -> None:
        pass


@dataclass(frozen=True)
class DispatchMeta:
    """What combine needs to undo one dispatch. Split sizes are rows per peer rank, host lists of length W."""

    num_tokens: int  # T
    send_token: torch.Tensor  # int64 [N_send]: local token of each stage-1 row sent, in send order
    send_splits: tuple[int, ...]  # [W] stage-1 rows sent to each peer
    recv_splits: tuple[int, ...]  # [W] stage-1 rows received from each peer (N1 = sum)
    fwd_row: torch.Tensor  # int64 [N_fwd]: stage-1 received row of each forwarded row (two-hop; else empty)
    fwd_send_splits: tuple[int, ...]  # [W] stage-2 rows forwarded to each peer (all zeros for one-hop)
    fwd_recv_splits: tuple[int, ...]  # [W] stage-2 rows received from each peer (N2 = sum)


@dataclass(frozen=True)
class Received:
    """Rows delivered to this GPU's experts, and the metadata to send their results back."""

    x: torch.Tensor  # [N1 + N2, H]
    local_slot: torch.Tensor  # int64 [N1 + N2, K]: local slot (0..S-1) per entry, -1 where not served here
    weight: torch.Tensor  # float32 [N1 + N2, K]: routing weight per entry
    meta: DispatchMeta


def plan_rows(dest: torch.Tensor, world_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Group (token, k) entries into rows: one row per distinct (token, destination), ordered by destination.

    dest: int64 [T, K] destination rank of each entry, -1 for entries that go nowhere.
    Returns (row_token int64 [N], row_dest int64 [N], entry_row int64 [T, K] (row of each entry, -1 if none),
    splits: rows per destination, list of length W).
    """
    T, K = dest.shape
    valid = dest >= 0
    key = torch.where(valid, dest * max(T, 1) + torch.arange(T, device=dest.device)[:, None], -1)  # [T, K]
    uniq = torch.unique(key[valid])  # sorted: by destination, then token
    row_dest, row_token = uniq // max(T, 1), uniq % max(T, 1)
    entry_row = torch.where(valid, torch.searchsorted(uniq, key.clamp(min=0)), -1)
    # host waits for the device here: split sizes are host integers
    splits = torch.bincount(row_dest, minlength=world_size).tolist()
    return row_token, row_dest, entry_row, splits


def plan_rows_loop(dest: np.ndarray, world_size: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Plain for-loop reference of :func:`plan_rows`: (row_token [N], row_dest [N], splits [W])."""
    rows = sorted({(int(d), t) for t in range(dest.shape[0]) for d in dest[t] if d >= 0})
    row_dest = np.array([d for d, _ in rows], np.int64)
    row_token = np.array([t for _, t in rows], np.int64)
    return row_token, row_dest, np.bincount(row_dest, minlength=world_size).tolist()


class Dispatcher:
    """Moves rows between the W ranks of a process group for an expert-parallel layer.

    rank: this process's rank; gpus_per_node: G (node of rank g is g // G); slots_per_gpu: S (slot p lives on
    rank p // S); two_hop: per-node dedup with forwarding inside the node (else per-GPU dedup).
    """

    def __init__(self, rank: int, world_size: int, gpus_per_node: int, slots_per_gpu: int, two_hop: bool = False,
                 group: dist.ProcessGroup | None = None, recorder: TrafficRecorder | None = None) -> None:
        if world_size < 1 or gpus_per_node < 1 or world_size % gpus_per_node:
            raise ValueError(f"dispatcher: world_size {world_size} is not a multiple of gpus_per_node "
                             f"{gpus_per_node}")
        if not 0 <= rank < world_size:
            raise ValueError(f"dispatcher: rank {rank} outside [0, {world_size})")
        if slots_per_gpu < 1:
            raise ValueError(f"dispatcher: slots_per_gpu must be >= 1, got {slots_per_gpu}")
        self.rank, self.world_size, self.G, self.S = rank, world_size, gpus_per_node, slots_per_gpu
        self.two_hop = two_hop
        self.group = group
        self.recorder = recorder if recorder is not None else NullTrafficRecorder(world_size)

    # -- exchanges
    def _exchange_counts(self, send_splits: list[int], device: torch.device) -> list[int]:
        send = torch.tensor(send_splits, dtype=torch.int64, device=device)  # [W]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        self.recorder.add_counts(send.element_size())
        # host waits for the device (and the peers) here: the receive buffers are sized from the counts
        return recv.tolist()

    def _exchange_rows(self, stage: str, x: torch.Tensor, send_splits: list[int],
                       recv_splits: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(recv_splits),
                               input_split_sizes=list(send_splits), group=self.group)
        row_bytes = x.element_size() * math.prod(x.shape[1:])
        if stage == "meta":
            self.recorder.add_meta(send_splits, row_bytes)
        else:
            self.recorder.add_payload(stage, send_splits, row_bytes)
        return out

    def _send(self, x: torch.Tensor, row_token: torch.Tensor, row_slot: torch.Tensor, row_weight: torch.Tensor,
              splits: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """Counts, then rows [N, H] and their metadata [N, 2K]; returns received (x, slot, weight, recv_splits)."""
        recv_splits = self._exchange_counts(splits, x.device)
        K = row_slot.shape[1]
        meta = torch.cat([row_slot.to(torch.float32), row_weight.to(torch.float32)], dim=1)  # [N, 2K]
        rx = self._exchange_rows("dispatch", x[row_token], splits, recv_splits)
        rmeta = self._exchange_rows("meta", meta, splits, recv_splits)
        return rx, rmeta[:, :K].round().long(), rmeta[:, K:], recv_splits

    # -- public
    def dispatch(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> Received:
        """x: [T, H] this rank's tokens; slots: int [T, K] physical slot serving each pair (-1: none);
        weights: [T, K] routing weights. Returns the rows this rank's experts must run."""
        T, K = slots.shape
        if x.shape[0] != T or weights.shape != slots.shape:
            raise ValueError(f"dispatch: x {tuple(x.shape)}, slots {tuple(slots.shape)} and weights "
                             f"{tuple(weights.shape)} disagree on [T, K]")
        slots = slots.to(x.device).long()
        weights = weights.to(x.device)
        gpu = torch.where(slots >= 0, slots // self.S, -1)  # [T, K]
        if self.two_hop:
            node, my_node = gpu // self.G, self.rank // self.G
            proxy = node * self.G + self.rank % self.G
            dest = torch.where((gpu >= 0) & (node != my_node), proxy, gpu)  # [T, K]
        else:
            dest = gpu
        row_token, row_dest, entry_row, splits = plan_rows(dest, self.world_size)
        N = len(row_token)
        row_slot = torch.full((N, K), -1, dtype=torch.int64, device=x.device)
        row_weight = torch.zeros((N, K), dtype=torch.float32, device=x.device)
        m = entry_row >= 0
        k_idx = torch.arange(K, device=x.device)[None, :].expand(T, K)
        row_slot[entry_row[m], k_idx[m]] = slots[m]
        row_weight[entry_row[m], k_idx[m]] = weights[m].to(torch.float32)
        x1, slot1, w1, recv_splits = self._send(x, row_token, row_slot, row_weight, splits)

        empty = torch.zeros(0, dtype=torch.int64, device=x.device)
        fwd_row, fwd_send, fwd_recv = empty, [0] * self.world_size, [0] * self.world_size
        xs, slots_all, ws = [x1], [slot1], [w1]
        if self.two_hop:
            gpu1 = torch.where(slot1 >= 0, slot1 // self.S, -1)  # [N1, K]
            dest2 = torch.where((gpu1 >= 0) & (gpu1 != self.rank), gpu1, -1)  # entries served by a node peer
            fwd_row, _, entry_row2, fwd_send = plan_rows(dest2, self.world_size)
            N2s = len(fwd_row)
            slot2 = torch.full((N2s, K), -1, dtype=torch.int64, device=x.device)
            w2 = torch.zeros((N2s, K), dtype=torch.float32, device=x.device)
            m2 = entry_row2 >= 0
            k2 = torch.arange(K, device=x.device)[None, :].expand_as(slot1)
            slot2[entry_row2[m2], k2[m2]] = slot1[m2]
            w2[entry_row2[m2], k2[m2]] = w1[m2]
            x2, slot2r, w2r, fwd_recv = self._send(x1, fwd_row, slot2, w2, fwd_send)
            xs.append(x2)
            slots_all.append(slot2r)
            ws.append(w2r)
        slot_all = torch.cat(slots_all)
        mine = (slot_all >= 0) & (slot_all // self.S == self.rank)
        local_slot = torch.where(mine, slot_all - self.rank * self.S, -1)
        meta = DispatchMeta(T, row_token, tuple(splits), tuple(recv_splits), fwd_row, tuple(fwd_send),
                            tuple(fwd_recv))
        return Received(torch.cat(xs), local_slot, torch.cat(ws), meta)

    def combine(self, y: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        """y: [N1 + N2, H] weighted partial sums per received row -> [T, H] outputs of this rank's tokens."""
        N1 = sum(meta.recv_splits)
        if y.shape[0] != N1 + sum(meta.fwd_recv_splits):
            raise ValueError(f"combine: got {y.shape[0]} rows, dispatch delivered {N1 + sum(meta.fwd_recv_splits)}")
        y1 = y[:N1]
        if self.two_hop:
            back = self._exchange_rows("combine", y[N1:], list(meta.fwd_recv_splits), list(meta.fwd_send_splits))
            y1 = y1.clone().index_add_(0, meta.fwd_row, back)  # proxy adds its node peers' partial sums
        back = self._exchange_rows("combine", y1, list(meta.recv_splits), list(meta.send_splits))
        out = torch.zeros((meta.num_tokens, y.shape[1]), dtype=y.dtype, device=y.device)
        return out.index_add_(0, meta.send_token, back)
