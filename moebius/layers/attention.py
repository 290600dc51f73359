"""Paged causal attention with GQA over a flat batch of variable-length chunks (prefill chunks and decodes mixed).

This is the torch reference path (CPU and tests); it reads the block tables directly. Fast kernels will share
`AttentionMetadata`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from moebius.kernels import DEFAULT_KERNELS, KernelConfig, triton_available
from moebius.layers.norm import rms_norm
from moebius.layers.rotary import apply_rope


class AttentionCut(Protocol):
    """Where a step's forward is cut at each layer's attention (worker/cuda_graphs.StepPieces: the parts between
    are CUDA graphs, attention runs eagerly between them, its launch depending on the step's sequences)."""

    def q_buffer(self, T: int) -> torch.Tensor:
        """The static [T, H, q_dim] buffer the layer's q is written into (`AttentionGeometry`)."""
        ...

    def attend(self, q_THd: torch.Tensor, cache: torch.Tensor, scale: float, kc: KernelConfig, *, group: int = 0,
               window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's attention output [T, H, o_dim] (a static buffer, written between the graphs); group: the
        layer's KV group (its metadata's `kv_group`), window / sinks: a sliding window's, learned sink logits."""
        ...


@dataclass(frozen=True)
class AttentionGeometry:
    """What the runner asks of a family's attention on a rank (its forward module's `attention_geometry`): the
    static buffers between step pieces hold q [T, heads, q_dim] and the output [T, heads, o_dim]; a decoding
    sequence runs `split_units` programs before KV splits (its KV heads; MLA: its head blocks); `group`: query
    heads a KV head, for the query-block table of kernels/attention.py's chunk launch (None: the family's kernels
    take no such table); `min_programs`: programs a decode launch is split up to where the split table leaves
    fewer (`num_splits_for`; 0: the table alone)."""

    heads: int
    q_dim: int
    o_dim: int
    split_units: int
    group: int | None
    min_programs: int = 0


@dataclass
class AttentionMetadata:
    """One step's batch: B sequences contributing T new tokens in total (the tokens of sequence b are contiguous)."""

    positions: torch.Tensor  # [T] int64, position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, page * block_size + offset where each new token's K/V is written
    query_start_loc: torch.Tensor  # [B + 1] int64, prefix sums of new tokens per sequence
    seq_lens: torch.Tensor  # [B] int64, tokens in each sequence's KV after this step
    block_tables: torch.Tensor  # [B, max_pages] int32, page ids of each sequence (padding is page 0)
    token_seq: torch.Tensor  # [T] int64, sequence index of each new token
    token_qpos: torch.Tensor  # [T] int64, index of each new token within its sequence's chunk
    max_query_len: int
    max_seq_len: int
    block_size: int
    num_splits: int = 1  # decode on the GPU: KV splits of the flash-decoding kernel
    cut: AttentionCut | None = None  # a forward being captured in pieces around attention (worker/cuda_graphs.py)
    q_blocks: torch.Tensor | None = None  # GPU, prompt chunks: [N, 2] int64 (sequence, query block), `query_blocks`
    decodes: int = 0  # GPU, prompt chunks: leading one-token sequences that attend in their own decode launch
    # (num_splits is theirs); q_blocks then holds only the sequences after them
    # the other KV groups' metadata (ModelConfig.kv_groups[1:]: sliding-window layers with page tables of their own),
    # the same step with their block_tables and slot_mapping
    groups: tuple[AttentionMetadata, ...] = ()
    kv_group: int = 0  # the KV group this metadata is (a cut's attention finds its group's metadata by it)

    def group(self, g: int) -> AttentionMetadata:
        """The metadata layers of KV group g read (`ModelConfig.kv_group_of`)."""
        return self.groups[g - 1] if g else self

    @functools.cached_property
    def chunk_lens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """FlashAttention's varlen arguments (int32 query starts from 0, KV lengths) of the sequences after the
        leading decodes: made on a step's first layer, read by the rest."""
        from moebius.kernels.attention import flash_lens

        return flash_lens(self.query_start_loc, self.seq_lens, self.decodes)


# (most sequence x KV-head pairs, KV splits) for decode, tuned on H200 (132 SMs) at the 30B TP and EP shards, the
# merge pass included (`python benchmarks/kernels/attn_tune.py`, benchmarks/results/h200-attn-splits.json); not
# monotonic, so a table. From 33 pairs the batch alone fills the GPU well enough that the merge pass costs more than
# the extra programs gain. At 16 pairs 4 splits beat 16 in the attention alone but made whole decode steps slower, so
# 16 stay (benchmarks/results/h200x2-attn-splits-in-step.json).
SPLITS = [(2, 32), (4, 16), (8, 32), (16, 16), (32, 8)]


def num_splits_for(batch: int, kv_heads: int, sms: int = 132, min_programs: int = 0) -> int:
    """Decode on the GPU: KV splits (flash-decoding) for `batch` sequences of `kv_heads` KV heads (programs each
    before splits); where that leaves fewer than `min_programs` programs, the power of two of splits up to it."""
    pairs = batch * kv_heads * 132 / sms
    splits = next((splits for most, splits in SPLITS if pairs <= most), 1)
    fill = min_programs // max(1, batch * kv_heads)
    return max(splits, min(32, 1 << (fill.bit_length() - 1))) if fill > 1 else splits


def query_blocks(q_lens: np.ndarray, seq_lens: np.ndarray, block: int, first: int = 0) -> np.ndarray:
    """[N, 2] (sequence, block) of every `block`-token query block of a step's chunks (of the sequences from
    `first` on), the one whose last query sees the most keys first (so the attention launch does not end on a wave
    of its longest programs); the GPU kernel runs one program per block, none for blocks past a shorter chunk's
    end. Host-side, O(blocks)."""
    n = -(-q_lens // block)
    n[:first] = 0
    seq = np.repeat(np.arange(len(q_lens), dtype=np.int64), n)
    m = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    keys = (seq_lens - q_lens)[seq] + np.minimum((m + 1) * block, q_lens[seq])
    order = np.argsort(-keys, kind="stable")
    return np.stack([seq[order], m[order]], axis=1)


def leading_decodes(q_lens: np.ndarray) -> int:
    """How many of a step's first sequences have one new token each (a decode's, or a prompt's last chunk of one)."""
    other = np.flatnonzero(q_lens != 1)
    return int(other[0]) if other.size else len(q_lens)


def write_kv(cache: torch.Tensor, k_THd: torch.Tensor, v_THd: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store this step's keys/values in their pages. cache: [pages, 2, block_size, kv_heads, head_dim]."""
    if k_THd.shape[0] == 0:
        return
    page = meta.slot_mapping // meta.block_size
    off = meta.slot_mapping % meta.block_size
    cache[page, 0, off] = k_THd
    cache[page, 1, off] = v_THd


def triton_qk(qkv_TQ: torch.Tensor, rope: torch.Tensor, head_dim: int) -> bool:
    """Whether the Triton q/k kernel takes a step's q and k (with per-head q/k norms or none): on the GPU, for rope
    over the whole head (partial rotary takes the torch ops)."""
    return qkv_TQ.is_cuda and triton_available() and rope.shape[-1] == head_dim


def qk_norm_rope_kv(qkv_TQ: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                    rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, eps: float, *,
                    kc: KernelConfig = DEFAULT_KERNELS, out: torch.Tensor | None = None) -> torch.Tensor:
    """Split the fused q|k|v projection into heads, RMS-normalise q and k per head (where the norms are given),
    rotate them by position (the rope table's width of each head: partial rotary where narrower), and store k and
    v in the paged cache. Returns q [T, H, d] (in `out` when given). One Triton kernel where `triton_qk`."""
    kvh, d = cache.shape[3], cache.shape[4]
    num_heads = qkv_TQ.shape[1] // d - 2 * kvh
    if triton_qk(qkv_TQ, rope, d):
        from moebius.kernels.fused import qk_norm_rope_kv as fast

        return fast(qkv_TQ, q_norm, k_norm, rope, meta.positions, meta.slot_mapping, cache, num_heads, eps, kc=kc,
                    out=out)
    q, k, v = qkv_TQ.split([num_heads * d, kvh * d, kvh * d], dim=-1)
    q, k = q.unflatten(-1, (-1, d)), k.unflatten(-1, (-1, d))
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = apply_rope(q, meta.positions, rope), apply_rope(k, meta.positions, rope)
    write_kv(cache, k, v.unflatten(-1, (-1, d)), meta)
    return q if out is None else out.copy_(q)


def qkv_attention(qkv_TQ: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                  rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, eps: float, scale: float, *,
                  kc: KernelConfig = DEFAULT_KERNELS, sinks: torch.Tensor | None = None,
                  window: int | None = None) -> torch.Tensor:
    """Attention from the fused q|k|v projection: `qk_norm_rope_kv` (k and v into the cache) then `paged_attention`.
    Returns [T, H, d]. On the GPU a decode step (one new token a sequence) of up to QK_FUSED_MAX_TOKENS with
    per-head q/k norms (Qwen3's attention, where `triton_qk`) does both in one Triton launch. A forward captured in
    pieces (`meta.cut`) leaves attention itself to run between them. q_norm / k_norm None: no q/k norm. sinks /
    window: `paged_attention`'s."""
    plain = sinks is None and window is None
    if meta.cut is not None:
        q = qk_norm_rope_kv(qkv_TQ, q_norm, k_norm, rope, cache, meta, eps, kc=kc,
                            out=meta.cut.q_buffer(qkv_TQ.shape[0]))
        return meta.cut.attend(q, cache, scale, kc, group=meta.kv_group, window=window, sinks=sinks)
    if plain and q_norm is not None and triton_qk(qkv_TQ, rope, cache.shape[4]) and meta.max_query_len == 1:
        from moebius.kernels.attention import QK_FUSED_MAX_TOKENS, qk_decode_attention

        if qkv_TQ.shape[0] <= QK_FUSED_MAX_TOKENS:
            kvh, d = cache.shape[3], cache.shape[4]
            return qk_decode_attention(qkv_TQ, q_norm, k_norm, rope, meta.positions, meta.slot_mapping, cache,
                                       qkv_TQ.shape[1] // d - 2 * kvh, eps, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, scale, meta.num_splits, kc=kc)
    q = qk_norm_rope_kv(qkv_TQ, q_norm, k_norm, rope, cache, meta, eps, kc=kc)
    return paged_attention(q, cache, meta, scale, kc=kc, sinks=sinks, window=window)


def paged_attention(q_THd: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                    kc: KernelConfig = DEFAULT_KERNELS, out: torch.Tensor | None = None,
                    sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v for every new token over its sequence's cached keys (causal). Returns [T, H, d]
    (in `out` when given). The Triton kernel on the GPU, the torch reference elsewhere; sinks and window as
    `paged_attention_ref` takes them."""
    if q_THd.is_cuda and triton_available():
        from moebius.kernels.attention import paged_attention as fast

        return fast(q_THd, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len, scale,
                    meta.num_splits, meta.max_seq_len, kc=kc, out=out, q_blocks=meta.q_blocks, decodes=meta.decodes,
                    chunk_lens=meta.chunk_lens if kc.flash_prefill and meta.max_query_len > 1 else None,
                    window=window, sinks=sinks)
    o = paged_attention_ref(q_THd, cache, meta, scale, sinks=sinks, window=window)
    return o if out is None else out.copy_(o)


def select_sequences(meta: AttentionMetadata, sel: torch.Tensor) -> tuple[AttentionMetadata, torch.Tensor]:
    """The metadata of the sequences `sel` [B] bool picks, and which of the step's tokens are theirs."""
    idx = sel.nonzero().flatten()
    q_len = (meta.query_start_loc[1:] - meta.query_start_loc[:-1])[idx]
    rows = sel[meta.token_seq]
    renumber = torch.full_like(sel, -1, dtype=torch.int64)
    renumber[idx] = torch.arange(idx.numel(), device=idx.device)
    qsl = torch.zeros(idx.numel() + 1, dtype=meta.query_start_loc.dtype, device=idx.device)
    qsl[1:] = q_len.cumsum(0)
    sub = replace(meta, positions=meta.positions[rows], slot_mapping=meta.slot_mapping[rows], query_start_loc=qsl,
                  seq_lens=meta.seq_lens[idx], block_tables=meta.block_tables[idx],
                  token_seq=renumber[meta.token_seq[rows]], token_qpos=meta.token_qpos[rows],
                  max_query_len=int(q_len.max()), max_seq_len=int(meta.seq_lens[idx].max()))
    return sub, rows


def paged_attention_ref(q_THd: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                        sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """The torch reference: gathers each sequence's KV through its block table into a padded batch (decodes and
    prompt chunks apart, so that no decode is padded to a chunk's length).
    sinks: [H] learned logits, one more column of each head's softmax that takes probability and gives no value
    (GPT-OSS). window: each query sees only its last `window` keys, itself included (transformers' sliding window:
    key position > query position - window); the pages before a sequence's window may be freed (a sliding-window
    KV group's table names page 0 there)."""
    T, H, d = q_THd.shape
    if T == 0:  # a rank with no requests this step (EP) still runs the layer for its collectives
        return q_THd.new_zeros(0, H, d)
    decode = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]) == 1
    if meta.max_query_len > 1 and bool(decode.any()):
        out = torch.empty_like(q_THd)
        for sel in (decode, ~decode):
            sub, rows = select_sequences(meta, sel)
            out[rows] = paged_attention_ref(q_THd[rows], cache, sub, scale, sinks=sinks, window=window)
        return out
    B, L, Q = meta.seq_lens.shape[0], meta.max_seq_len, meta.max_query_len
    kvh = cache.shape[3]
    g = H // kvh
    j = torch.arange(L, device=q_THd.device)
    pages = meta.block_tables[:, j // meta.block_size].long()  # [B, L]
    kv = cache[pages, :, j % meta.block_size]  # [B, L, 2, kvh, d]
    # positions past a sequence's end hold whatever the page had, and so do a window's freed pages (read as page 0):
    # select them away (a 0 weight times NaN is NaN)
    held = j[None, :] < meta.seq_lens[:, None]
    q_len = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    if window is not None:
        held &= j[None, :] > (meta.seq_lens - q_len - window)[:, None]  # the first query's window on
    kv = torch.where(held[:, :, None, None, None], kv, 0)
    k_BLhd, v_BLhd = kv[:, :, 0], kv[:, :, 1]
    q_BQHd = q_THd.new_zeros(B, Q, H, d)
    q_BQHd[meta.token_seq, meta.token_qpos] = q_THd
    qpos_BQ = (meta.seq_lens - q_len)[:, None] + torch.arange(Q, device=q_THd.device)[None, :]
    mask_BQL = j[None, None, :] <= qpos_BQ[:, :, None]
    if window is not None:
        mask_BQL &= j[None, None, :] > qpos_BQ[:, :, None] - window
    q5 = q_BQHd.view(B, Q, kvh, g, d)
    scores = torch.einsum("bqhgd,blhd->bhgql", q5, k_BLhd).float() * scale
    scores.masked_fill_(~mask_BQL[:, None, None], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1).to(q_THd.dtype)
    else:  # the sink's column joins the softmax, then is dropped
        sink = sinks.float().view(1, kvh, g, 1, 1).expand(B, kvh, g, Q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(q_THd.dtype)
    out = torch.einsum("bhgql,blhd->bqhgd", probs, v_BLhd).reshape(B, Q, H, d)
    return out[meta.token_seq, meta.token_qpos]
