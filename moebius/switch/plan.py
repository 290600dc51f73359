"""The switch plan, pure: which bytes each rank sends to each peer and where they land.

Weights. EP rank r holds experts [r*El, (r+1)*El) whole: W13 (El, 2I, D), W2 (El, D, I). TP rank q holds rows
q*I/P .. (q+1)*I/P of the gate and of the up projection of every expert, W13 (E, 2I/P, D), and the same columns of
W2, (E, D, I/P). EP->TP is permute then exchange: rank r packs, for each peer q, its experts' q-th shards; the
chunks from r land at experts r*El.. of q's TP view, which is exactly the all-to-all output order, so nothing is
unpacked. TP->EP is exchange then permute: the chunk for peer r is the contiguous expert block r*El.. of the TP view
(nothing packed); the received shards are interleaved into whole experts. The views on either side are the layout's
expert shard geometry (`parallel/layout.py`: `expert_shard`, `expert_block`), which loading uses too.

KV. A request's tokens 0..n-1 sit in pages given by its page table; token t of a page table `pages` is slot
pages[t // bs] * bs + t % bs. EP->TP: each rank sends, for each of its requests in the global order, every token's
K/V restricted to peer q's TP heads; peer q scatters by the TP page tables (identical on every rank). TP->EP: each
request gets a new owner (`parallel/placement.py`); the first rank holding each TP head shard sends it (replicas
stay silent), the new owner scatters into its EP pages at that shard's heads. Requests of one target rank whose
leading pages hold the same tokens share those target pages (prefix caching); only the first of them in the global
order moves them (`LiveKV.start`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from moebius.kernels import triton_available
from moebius.parallel.layout import Layout, expert_block, expert_shard


# ---- weights ----
def _copy(dst: torch.Tensor, src: torch.Tensor, row_kernel: bool) -> None:
    if row_kernel and dst.is_cuda and triton_available():
        from moebius.kernels.copy import copy_rows

        copy_rows(dst, src)
    else:
        dst.copy_(src)


def ep_to_tp_pack(w13_EFD: torch.Tensor, w2_EDF: torch.Tensor, P: int, out: tuple[torch.Tensor, torch.Tensor],
                  row_kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill the send buffers `out` ([P * El, 2I/P, D] and [P * El, D, I/P], contiguous) and return them: peer q's
    chunk is rows q*El .. (q+1)*El, shard q of my whole experts. row_kernel: on the GPU, the Triton row copy
    (kernels/copy.py) instead of torch's strided copies."""
    for q in range(P):
        for d, s in zip(expert_block(*out, P, q), expert_shard(w13_EFD, w2_EDF, P, q), strict=True):
            _copy(d, s, row_kernel)
    return out


def tp_to_ep_unpack(r13: torch.Tensor, r2: torch.Tensor, P: int, out13_EFD: torch.Tensor, out2_EDF: torch.Tensor,
                    row_kernel: bool = True) -> None:
    """Interleave received shards (chunk q = rows q*El..: shard q of my El experts) into whole experts."""
    for q in range(P):
        for d, s in zip(expert_shard(out13_EFD, out2_EDF, P, q), expert_block(r13, r2, P, q), strict=True):
            _copy(d, s, row_kernel)


# ---- KV ----
def token_slots(pages: list[int], n: int, bs: int) -> np.ndarray:
    """Cache slot of each of the first n tokens of a page table."""
    return slots_of([pages], [n], bs)


def slots_of(tables: list[list[int]], counts: list[int], bs: int, starts: list[int] | None = None) -> np.ndarray:
    """token_slots of several page tables, concatenated, a page at a time in whole-array steps (quicker than one
    request at a time: benchmarks/results/cpu-switch-host.json); with `starts` (whole pages), each table's tokens
    from its start on."""
    if starts is not None and any(starts):
        pages = [t[s // bs:] for t, s in zip(tables, starts, strict=True)]
        return slots_of(pages, [c - s for c, s in zip(counts, starts, strict=True)], bs)
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
    return slots_of([r.dst_pages if dst else r.src_pages for r in mine], [r.num_tokens for r in mine], bs,
                    [r.start for r in mine])


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
    # tokens before this (whole pages) are in target pages an earlier request of the same target shares (prefix
    # caching): that request's move fills them, this one's moves only the rest
    start: int = 0


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
