"""The switch plan, pure: which bytes each rank sends to each peer and where they land.

Weights. EP rank r holds experts [r*El, (r+1)*El) whole: W13 (El, 2I, D), W2 (El, D, I). TP rank q holds rows
q*I/P .. (q+1)*I/P of the gate and of the up projection of every expert, W13 (E, 2I/P, D), and the same columns of
W2, (E, D, I/P). EP->TP is permute then exchange: rank r packs, for each peer q, its experts' q-th shards; the
chunks from r land at experts r*El.. of q's TP view, which is exactly the all-to-all output order, so nothing is
unpacked. TP->EP is exchange then permute: the chunk for peer r is the contiguous expert block r*El.. of the TP view
(nothing packed); the received shards are interleaved into whole experts.

KV. A request's tokens 0..n-1 sit in pages given by its page table; token t of a page table `pages` is slot
pages[t // bs] * bs + t % bs. EP->TP: each rank sends, for each of its requests in the global order, every token's
K/V restricted to peer q's TP heads; peer q scatters by the TP page tables (identical on every rank). TP->EP: each
request gets a new owner (`partition`); the first rank holding each TP head shard sends it (replicas stay silent),
the new owner scatters into its EP pages at that shard's heads.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import numpy as np
import torch

from moebius.kernels import triton_available
from moebius.parallel.layout import Layout


# ---- weights ----
def _shard_rows(w13_EFD: torch.Tensor, w2_EDF: torch.Tensor, P: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shard q of whole experts as 2-D views with contiguous rows: gate and up apart ([El * 2, I/P * D], rows of one
    (expert, gate|up)) and down ([El * D, I/P])."""
    El, F, D = w13_EFD.shape
    I = F // 2
    return (w13_EFD.view(El * 2, P, I // P * D)[:, q], w2_EDF.view(El * D, P, I // P)[:, q])


def _chunk_rows(t13: torch.Tensor, t2: torch.Tensor, P: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk q (rows q*El ..) of TP-shaped buffers ([P * El, 2I/P, D], [P * El, D, I/P]) as the same 2-D views."""
    PEl, Fp, D = t13.shape
    El = PEl // P
    return (t13.view(P, El * 2, Fp // 2 * D)[q], t2.view(P, El * D, Fp // 2)[q])


# The Triton row copy (kernels/copy.py) for the switch's permutes on the GPU: 2.2x torch's strided copy of these
# views (3.45 against 1.6 TB/s on an H200). MOEBIUS_RESHARD_KERNEL=0 falls back to torch's copies.
RESHARD_KERNEL = os.environ.get("MOEBIUS_RESHARD_KERNEL", "1") == "1"


def _row_kernel(t: torch.Tensor) -> bool:
    return RESHARD_KERNEL and t.is_cuda and triton_available()


def ep_to_tp_pack(w13_EFD: torch.Tensor, w2_EDF: torch.Tensor, P: int, out: tuple[torch.Tensor, torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill the send buffers `out` ([P * El, 2I/P, D] and [P * El, D, I/P], contiguous) and return them: peer q's
    chunk is rows q*El .. (q+1)*El."""
    El, F, D = w13_EFD.shape
    I = F // 2
    s13, s2 = out
    if _row_kernel(s13):
        from moebius.kernels.copy import copy_rows

        for q in range(P):
            for d, s in zip(_chunk_rows(s13, s2, P, q), _shard_rows(w13_EFD, w2_EDF, P, q), strict=True):
                copy_rows(d, s)
        return out
    s13.view(P, El, 2, I // P, D).copy_(w13_EFD.view(El, 2, P, I // P, D).permute(2, 0, 1, 3, 4))
    s2.view(P, El, D, I // P).copy_(w2_EDF.view(El, D, P, I // P).permute(2, 0, 1, 3))
    return out


def tp_to_ep_unpack(r13: torch.Tensor, r2: torch.Tensor, P: int, out13_EFD: torch.Tensor,
                    out2_EDF: torch.Tensor) -> None:
    """Interleave received shards (chunk q = rows q*El..: shard q of my El experts) into whole experts."""
    El, F, D = out13_EFD.shape
    I = F // 2
    if _row_kernel(r13):
        from moebius.kernels.copy import copy_rows

        for q in range(P):
            for d, s in zip(_shard_rows(out13_EFD, out2_EDF, P, q), _chunk_rows(r13, r2, P, q), strict=True):
                copy_rows(d, s)
        return
    out13_EFD.view(El, 2, P, I // P, D).copy_(r13.view(P, El, 2, I // P, D).permute(1, 2, 0, 3, 4))
    out2_EDF.view(El, D, P, I // P).copy_(r2.view(P, El, D, I // P).permute(1, 2, 0, 3))


# ---- requests ----
def partition(lengths: list[int], P: int) -> list[int]:
    """TP->EP owners: by decreasing length, each request to the least-loaded rank (requests, then tokens).
    Deterministic (ties by index and rank), so every rank computes the same partition."""
    load = [(0, 0)] * P
    owner = [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(P), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] = (load[r][0] + 1, load[r][1] + lengths[i])
    return owner


# ---- KV ----
def token_slots(pages: list[int], n: int, bs: int) -> np.ndarray:
    """Cache slot of each of the first n tokens of a page table."""
    return slots_of([pages], [n], bs)


def slots_of(tables: list[list[int]], counts: list[int], bs: int) -> np.ndarray:
    """token_slots of several page tables, concatenated, a page at a time in whole-array steps (128 requests of 576
    tokens: ~0.4 against ~1.5 ms one request at a time on the CPU machine)."""
    n = np.asarray(counts, dtype=np.int64)
    if not len(n) or int(n.sum()) == 0:
        return np.zeros(0, np.int64)
    used = -(-n // bs)  # pages each request's tokens use
    pages = np.fromiter(itertools.chain.from_iterable(t[:k] for t, k in zip(tables, used.tolist(), strict=True)),
                        dtype=np.int64, count=int(used.sum()))
    slots = pages[:, None] * bs + np.arange(bs)  # [pages, bs]: every slot of every used page
    valid = np.full(len(pages), bs, dtype=np.int64)  # tokens on each page: all of them but on a last page
    has = used > 0
    valid[np.cumsum(used)[has] - 1] = n[has] - (used[has] - 1) * bs
    return slots[np.arange(bs) < valid[:, None]]


def _slots(reqs: list[LiveKV], owner: int, dst: bool, bs: int) -> np.ndarray:
    """Slots of the tokens of the requests of one EP owner, in the global order, by target or source tables."""
    mine = [r for r in reqs if r.owner == owner]
    return slots_of([r.dst_pages if dst else r.src_pages for r in mine], [r.num_tokens for r in mine], bs)


@dataclass
class KVMove:
    """One rank's part of a KV migration (identical for every layer).

    send_slots[q]: source-cache slots of the tokens sent to q, in order; send_heads[q]: source heads sent to q.
    recv_slots[s]: destination-cache slots of the tokens received from s, in order; recv_heads[s]: destination
    heads they fill.
    """

    send_slots: list[np.ndarray]
    send_heads: list[range]
    recv_slots: list[np.ndarray]
    recv_heads: list[range]


@dataclass
class LiveKV:
    """A request's KV as the plan sees it: its owner before the switch, KV tokens, page tables."""

    owner: int  # EP owner (for EP->TP) or new EP owner (for TP->EP)
    num_tokens: int
    src_pages: list[int]  # page table in the source layout (meaningful on the ranks that hold it)
    dst_pages: list[int]  # page table in the target layout (meaningful on the ranks that hold it)


def kv_ep_to_tp(reqs: list[LiveKV], me: int, tp: list[Layout], bs: int) -> KVMove:
    """EP->TP at rank `me`; reqs in the global order, tp[q] the TP layout of rank q."""
    P = len(tp)
    send = _slots(reqs, me, False, bs)
    recv = [_slots(reqs, s, True, bs) for s in range(P)]
    all_heads = range(0, tp[me].num_kv_heads)  # a TP rank receives all of its (local) heads
    return KVMove([send] * P, [tp[q].kv_heads for q in range(P)], recv, [all_heads] * P)


def _is_primary(lay: Layout) -> bool:
    """The lowest rank holding a TP KV-head shard sends it; replicas (KV heads < ranks) do not."""
    rep = max(1, lay.world_size // lay.cfg.num_kv_heads)
    return lay.rank % rep == 0


def kv_tp_to_ep(reqs: list[LiveKV], me: int, tp: list[Layout], bs: int) -> KVMove:
    """TP->EP at rank `me`; reqs in the global order with their new owners."""
    P = len(tp)
    empty = np.zeros(0, np.int64)
    local_heads = range(0, tp[me].num_kv_heads)
    send = [_slots(reqs, s, False, bs) if _is_primary(tp[me]) else empty for s in range(P)]
    mine_slots = _slots(reqs, me, True, bs)
    recv = [mine_slots if _is_primary(tp[q]) else empty for q in range(P)]
    return KVMove(send, [local_heads] * P, recv, [tp[q].kv_heads for q in range(P)])
