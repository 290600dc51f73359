"""Paged causal attention with GQA in Triton: one kernel for prefill chunks and decodes, reading block tables.

A program handles BM query tokens of one sequence and all G query heads of one KV head (rows = token x head), and
walks the sequence's KV in tiles of BN tokens gathered through the block table (online softmax). For decode, the
KV range is split over NUM_SPLITS programs (flash-decoding) and a second kernel merges the partial results, so a
small batch still fills the GPU. No host value is needed at launch beyond the grid, so it can run inside a CUDA
graph. The torch reference is `moebius.layers.attention.paged_attention`. A long first chunk of a prompt alone in
its step, at a length the start-up warm-up runs, goes to cuDNN's fused attention instead (`fresh_chunk`), which is
faster there (benchmarks/results/h200-attn-prefill-default.json). Where FlashAttention-4 is installed
(KernelConfig.flash_prefill, kernels/flash.py) it takes every step with prompt chunks instead of both, the lone fresh
chunk on K and V gathered contiguous; decodes stay here.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from moebius.kernels import DEFAULT_KERNELS, KernelConfig
from moebius.kernels.fused import _qk_heads
from moebius.kernels.pdl import enter, pdl


@triton.jit
def _tile(q, Cache, BlockTables, b, stride_bt, stride_pg, stride_kv, stride_tok, kvh, stride_hd, start, hi, qpos, d,
          m_i, l_i, acc, scale2, window, BN: tl.constexpr, PAGE: tl.constexpr, PREC: tl.constexpr,
          MASK: tl.constexpr, WINDOW: tl.constexpr):
    """One KV tile of the online softmax (base 2); MASK: the tile may hold keys past `hi` or past a row's position
    (WINDOW: or before a row's last `window` keys)."""
    j = start + tl.arange(0, BN)
    jv = j < hi
    page = tl.load(BlockTables + b * stride_bt + j // PAGE, mask=jv, other=0)
    base = page.to(tl.int64) * stride_pg + (j % PAGE) * stride_tok + kvh * stride_hd
    if MASK:
        k = tl.load(Cache + base[:, None] + d[None, :], mask=jv[:, None], other=0.0)
        v = tl.load(Cache + stride_kv + base[:, None] + d[None, :], mask=jv[:, None], other=0.0)
    else:
        k = tl.load(Cache + base[:, None] + d[None, :])
        v = tl.load(Cache + stride_kv + base[:, None] + d[None, :])
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if MASK:
        seen = jv[None, :] & (j[None, :] <= qpos[:, None])
        if WINDOW:
            seen = seen & (j[None, :] > qpos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
    # scaled after the row max (scale2 > 0), so each score takes one fused multiply-add before exp2
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale2)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * scale2 - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _attn_fwd(Q, Cache, Out, PartAcc, PartML, BlockTables, SeqLens, QStart, QBlocks, scale,
              stride_qt, stride_qh, stride_ot, stride_oh, stride_pg, stride_kv, stride_tok, stride_hd, stride_bt,
              QKV, QN, KN, Rope, Pos, Slots, eps, H, stride_t, window, Sinks,
              NUM_SPLITS: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
              PAGE: tl.constexpr, PREC: tl.constexpr, QK: tl.constexpr, TABLE: tl.constexpr, DECODE: tl.constexpr,
              WINDOW: tl.constexpr, SINKS: tl.constexpr, PDL: tl.constexpr):
    """QK (decode only): Q receives q here, from the fused qkv projection (q/k RMSNorm, RoPE; the new k and v go to
    the cache), so the step has no separate launch for it; QKV .. stride_t are its inputs, unused otherwise.
    TABLE: program p takes query block QBlocks[p] = (sequence, block) (`query_blocks`); else a grid of every
    sequence x its longest chunk's blocks, whose programs past a shorter chunk's end exit at once.
    DECODE: one query token a sequence (max_query_len == 1). WINDOW: each query sees its last `window` keys (itself
    included): the walk starts at the block's first query's window, every tile masked. SINKS: each head's learned
    logit Sinks[h] joins its softmax's denominator (applied where the split results are merged)."""
    enter(PDL)
    # KV heads (and splits) vary fastest: the heads of one sequence run side by side, so the rows of a page (every
    # head of a token is one run of bytes) are read together
    kvh = tl.program_id(0) // NUM_SPLITS
    split = tl.program_id(0) % NUM_SPLITS
    if TABLE:
        b = tl.load(QBlocks + 2 * tl.program_id(1)).to(tl.int32)
        mblk = tl.load(QBlocks + 2 * tl.program_id(1) + 1).to(tl.int32)
    else:
        # the blocks of a sequence's last queries (the longest KV walks) are scheduled first, so the launch does
        # not end on a wave of its longest programs
        mblk = tl.num_programs(1) - 1 - tl.program_id(1)
        b = tl.program_id(2)
    q0 = tl.load(QStart + b)
    qlen = tl.load(QStart + b + 1) - q0
    seq_len = tl.load(SeqLens + b)
    m0 = mblk * BM
    if m0 < qlen:
        kv_end = seq_len - qlen + tl.minimum(m0 + BM, qlen)  # causal: no row looks past this
        kv_start = 0
        if WINDOW:  # no row looks before its window: the block's first query's is the earliest
            kv_start = tl.maximum(seq_len - qlen + m0 - window + 1, 0)
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), BN) * BN
        lo = kv_start + split * per_split
        hi = tl.minimum(kv_end, lo + per_split)
        if QK:  # one new token: this KV head's q heads, and (the split holding its position) its k and v
            writer = (lo < seq_len) & (seq_len <= hi)
            r = tl.arange(0, 2 * G)
            KVH = tl.num_programs(0) // NUM_SPLITS
            h = tl.where(r < G, kvh * G + r, tl.where((r == G) & writer, H + kvh, H + KVH))  # H + KVH: no head
            t = q0.to(tl.int64) + tl.zeros_like(r)  # the token of every row
            _qk_heads(QKV, QN, KN, Rope, Pos, Slots, Cache, Q, t, h, eps, H, KVH, stride_t, stride_qt, stride_qh,
                      stride_pg, stride_kv, stride_tok, stride_hd, PAGE, D)
            tl.debug_barrier()  # q (and the new k, v) stored before this program reads them
        rows = tl.arange(0, BM * G)
        tok = m0 + rows // G
        head = kvh * G + rows % G
        valid = tok < qlen
        qpos = seq_len - qlen + tok
        d = tl.arange(0, D)
        q = tl.load(Q + (q0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=valid[:, None], other=0.0)
        m_i = tl.full([BM * G], float("-inf"), tl.float32)
        l_i = tl.zeros([BM * G], tl.float32)
        acc = tl.zeros([BM * G, D], tl.float32)
        scale2 = scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e)): the partial maxima are in log2 units
        if DECODE:
            # one loop, every tile masked: a second loop for the last, partial tile drains the first one's software
            # pipeline and waits for its own loads unhidden, which cost a memory-bound decode more than the masks
            # it saves (benchmarks/results/h200-decode-attention-loop.json)
            for start in range(lo, hi, BN):
                m_i, l_i, acc = _tile(q, Cache, BlockTables, b, stride_bt, stride_pg, stride_kv, stride_tok, kvh,
                                      stride_hd, start, hi, qpos, d, m_i, l_i, acc, scale2, window, BN, PAGE, PREC,
                                      True, WINDOW)
        elif WINDOW:  # every tile masked (a window's lower edge crosses the tiles of the block's rows)
            for start in range(lo, hi, BN):
                m_i, l_i, acc = _tile(q, Cache, BlockTables, b, stride_bt, stride_pg, stride_kv, stride_tok, kvh,
                                      stride_hd, start, hi, qpos, d, m_i, l_i, acc, scale2, window, BN, PAGE, PREC,
                                      True, True)
        else:
            # keys up to the block's first query position are visible to every row: whole tiles there skip the mask
            full = lo + tl.maximum(tl.minimum(hi, seq_len - qlen + m0 + 1) - lo, 0) // BN * BN
            for start in range(lo, full, BN):
                m_i, l_i, acc = _tile(q, Cache, BlockTables, b, stride_bt, stride_pg, stride_kv, stride_tok, kvh,
                                      stride_hd, start, hi, qpos, d, m_i, l_i, acc, scale2, window, BN, PAGE, PREC,
                                      False, False)
            for start in range(full, hi, BN):
                m_i, l_i, acc = _tile(q, Cache, BlockTables, b, stride_bt, stride_pg, stride_kv, stride_tok, kvh,
                                      stride_hd, start, hi, qpos, d, m_i, l_i, acc, scale2, window, BN, PAGE, PREC,
                                      True, False)
        if NUM_SPLITS == 1:
            if SINKS:  # the sink's exp beside the keys' (log2 units, relative to the row's max)
                sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634
                l_i = l_i + tl.exp2(sink - tl.where(m_i == float("-inf"), 0.0, m_i))
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(Out + (q0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(Out.dtype.element_ty), mask=valid[:, None])
        else:
            # partials of token t, head h, split s at ((t * H + h) * NUM_SPLITS + s)
            idx = ((q0 + tok) * H + head) * NUM_SPLITS + split
            tl.store(PartAcc + idx[:, None] * D + d[None, :], acc, mask=valid[:, None])
            tl.store(PartML + idx * 2, m_i, mask=valid)
            tl.store(PartML + idx * 2 + 1, l_i, mask=valid)


@triton.jit
def _merge_splits(PartAcc, PartML, Out, stride_ot, stride_oh, H, Sinks, NUM_SPLITS: tl.constexpr, D: tl.constexpr,
                  SINKS: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    idx = (t * H + h) * NUM_SPLITS + s
    m = tl.load(PartML + idx * 2)
    l = tl.load(PartML + idx * 2 + 1)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max)))  # log2 units
    L = tl.sum(l * w, 0)
    if SINKS:
        L = L + tl.exp2(tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
                        - tl.where(m_max == float("-inf"), 0.0, m_max))
    d = tl.arange(0, D)
    acc = tl.load(PartAcc + idx[:, None] * D + d[None, :])
    out = tl.sum(acc * w[:, None], 0) / tl.where(L > 0, L, 1.0)
    tl.store(Out + t * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty))


def _decode_tiles(seq_heads: int, num_splits: int, D: int) -> tuple[int, int]:
    """(KV tile, pipeline stages) of a decode launch, tuned on H200 at the 30B shapes: short splits of a small
    batch favour small tiles and two stages; a batch of about one wave of (request, KV head) programs, each walking
    its whole sequence, favours long tiles (`python benchmarks/kernels/attn_tune.py`)."""
    if D > 128:
        return 32, 2 if num_splits > 1 else 3
    if num_splits >= 32:
        return 32, 2
    if num_splits > 1:
        return 64, 2
    return (128, 3) if seq_heads <= 132 else (64, 3)


def query_block_tokens(D: int, G: int) -> int:
    """Query tokens per program of a launch with prompt chunks (its query rows hold every head of a KV head's group
    G for each token): the block `layers.attention.query_blocks` tables are built in."""
    return max(1, prefill_tiles(D)[0] // G)


def prefill_tiles(D: int) -> tuple[int, int, int, int]:
    """(query rows = tokens x heads of one KV head, KV tile, warps, pipeline stages) of a launch with prompt chunks.
    128 x 128 tiles with 8 warps were the fastest at 8k chunks (alone and after a prefix) on H200 at the 30B shapes
    and near the best at 2k (`python benchmarks/kernels/attn_prefill_tune.py`,
    benchmarks/results/h200-attn-prefill-tiles.json)."""
    return (128, 128, 8, 3) if D <= 128 else (64, 32, 4, 3)


# A step that is one prompt chunk with nothing cached before it, at one of the runtime's `fresh_chunk_lengths`
# (KernelConfig: from 2048 tokens, the whole-prompt lengths the warm-up runs), takes cuDNN's fused attention
# (through torch SDPA) instead of the kernel above: on H200 at the 30B shapes it was the fastest backend on such a
# chunk from 2k tokens, and torch's FlashAttention-2 backend was slower than the kernel above
# (`python benchmarks/kernels/attn_prefill_tune.py --default-only`, benchmarks/results/h200-attn-prefill-default.json).
# Chunks after a prefix, and other lengths, keep the paged kernel.
def fresh_chunk(block_tables: torch.Tensor, max_query_len: int, max_seq_len: int, lengths: frozenset[int]) -> bool:
    """Whether a step's attention is one sequence's first chunk (no cached prefix) of one of `lengths` tokens: host
    values only, so asking costs no device round trip."""
    return block_tables.shape[0] == 1 and max_seq_len == max_query_len and max_query_len in lengths


@functools.cache
def cudnn_attention_works(device_index: int) -> bool:
    """cuDNN's fused attention runs on this GPU in this build: tried once on a tiny causal GQA problem (where it
    does not, the paged kernel serves every step)."""
    x = torch.zeros(1, 4, 64, 128, dtype=torch.bfloat16, device=f"cuda:{device_index}")
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            scaled_dot_product_attention(x, x[:, :2], x[:, :2], is_causal=True, enable_gqa=True)
    except RuntimeError:
        return False
    return True


def fresh_kv(cache: torch.Tensor, block_tables: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of one sequence's first T tokens, gathered from its pages: contiguous [T, kvh, d] each."""
    pages = block_tables[0, : triton.cdiv(T, cache.shape[2])].long()
    k, v = (cache[pages, i].flatten(0, 1)[:T] for i in (0, 1))
    return k, v


def fresh_chunk_attention(q_THd: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, scale: float,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one sequence's first chunk (q [T, H, d]; its keys and values are already in the pages
    of block_tables[0]) through cuDNN, the KV heads shared by their query heads (GQA) inside the kernel."""
    k, v = (t.transpose(0, 1).unsqueeze(0) for t in fresh_kv(cache, block_tables, q_THd.shape[0]))  # [1, kvh, T, d]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = scaled_dot_product_attention(q_THd.transpose(0, 1).unsqueeze(0), k, v, is_causal=True, scale=scale,
                                         enable_gqa=True)
    o = o[0].transpose(0, 1)
    return o if out is None else out.copy_(o)  # SDPA has no output argument


def paged_attention(q_THd: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, max_query_len: int, scale: float, num_splits: int = 1,
                    max_seq_len: int = 0, *, kc: KernelConfig = DEFAULT_KERNELS, out: torch.Tensor | None = None,
                    q_blocks: torch.Tensor | None = None, decodes: int = 0,
                    chunk_lens: tuple[torch.Tensor, torch.Tensor] | None = None, window: int | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, d]; cache [pages, 2, page, kvh, d]. num_splits > 1 only for decode (max_query_len == 1).
    max_seq_len: the longest sequence (a host value), for `fresh_chunk`. out: where to write the result ([T, H, d],
    the last dim contiguous; a new tensor when None). q_blocks: [N, 2] (sequence, query block) of
    `query_block_tokens` tokens, one program each (a launch with prompt chunks: no programs for blocks past a
    shorter chunk's end). decodes (with q_blocks or kc.flash_prefill): the first `decodes` sequences have one token
    each and attend in a decode launch of their own, with num_splits; the chunks' launch covers the rest.
    chunk_lens (kc.flash_prefill): int32 query starts (from 0) and KV lengths of the sequences after the decodes,
    made once a step (AttentionMetadata.chunk_lens); derived here when None. window / sinks: a sliding window (each
    query's last `window` keys) and learned sink logits [H] (GPT-OSS's): this kernel only (cuDNN's and
    FlashAttention's paths take neither)."""
    plain = window is None and sinks is None
    fresh = (plain and fresh_chunk(block_tables, max_query_len, max_seq_len, kc.fresh_chunk_lengths)
             and q_THd.dtype in (torch.bfloat16, torch.float16))
    if kc.flash_prefill and max_query_len > 1 and plain:  # (only ever set for half precision: flash.use_flash)
        from moebius.kernels import flash

        out = torch.empty_like(q_THd) if out is None else out
        if fresh:
            return flash.fresh_chunk_attention(q_THd, *fresh_kv(cache, block_tables, q_THd.shape[0]), scale, out)
        if decodes:
            _launch(q_THd[:decodes], cache, block_tables[:decodes], seq_lens[:decodes],
                    query_start_loc[:decodes + 1], 1, scale, num_splits, None, kc, out[:decodes])
        starts, lens = chunk_lens if chunk_lens is not None else flash_lens(query_start_loc, seq_lens, decodes)
        flash.chunk_attention(q_THd[decodes:], cache, block_tables[decodes:], starts, lens, max_query_len, scale,
                              out[decodes:])
        return out
    if fresh and cudnn_attention_works(q_THd.device.index or 0):
        return fresh_chunk_attention(q_THd, cache, block_tables, scale, out)
    if decodes and q_blocks is not None and max_query_len > 1:
        out = torch.empty_like(q_THd) if out is None else out
        _launch(q_THd[:decodes], cache, block_tables[:decodes], seq_lens[:decodes], query_start_loc[:decodes + 1], 1,
                scale, num_splits, None, kc, out[:decodes], window=window, sinks=sinks)
        num_splits = 1
    return _launch(q_THd, cache, block_tables, seq_lens, query_start_loc, max_query_len, scale, num_splits, None, kc,
                   out, q_blocks, window, sinks)


def flash_lens(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, decodes: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's varlen arguments for the sequences after the leading `decodes` one-token ones: int32 query
    starts from 0 and KV lengths."""
    return (query_start_loc[decodes:] - decodes).int(), seq_lens[decodes:].int()


# Decode steps up to this many tokens take q/k norm + RoPE + cache write inside the attention launch: there the
# separate launch (and the gap before the next) outweighs the prologue each attention program gains; at large
# batches every one of B x KV-head programs would carry it while the separate kernel streams. Measured on whole
# decode steps (benchmarks/results/h200x2-qk-decode-attention.json).
QK_FUSED_MAX_TOKENS = 64


def qk_decode_attention(qkv_TQ: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, rope: torch.Tensor,
                        positions: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor, num_heads: int, eps: float,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        scale: float, num_splits: int = 1, *, kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """Decode (one new token a sequence): fused.qk_norm_rope_kv then paged_attention, in one launch."""
    T, D = qkv_TQ.shape[0], cache.shape[4]
    q = torch.empty(T, num_heads, D, dtype=qkv_TQ.dtype, device=qkv_TQ.device)
    return _launch(q, cache, block_tables, seq_lens, query_start_loc, 1, scale, num_splits,
                   (qkv_TQ, q_norm, k_norm, rope, positions, slots, eps), kc)


def _launch(q_THd: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
            query_start_loc: torch.Tensor, max_query_len: int, scale: float, num_splits: int,
            qk: tuple | None, kc: KernelConfig, out: torch.Tensor | None = None,
            q_blocks: torch.Tensor | None = None, window: int | None = None,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    T, H, D = q_THd.shape
    B = seq_lens.shape[0]
    kvh, page = cache.shape[3], cache.shape[2]
    G = H // kvh
    out = torch.empty_like(q_THd) if out is None else out
    if T == 0:
        return out
    if max_query_len == 1:
        BM, (BN, stages), warps = max(1, 16 // G), _decode_tiles(B * kvh, num_splits, D), 4
    else:
        _, BN, warps, stages = prefill_tiles(D)
        BM = query_block_tokens(D, G)  # the block the host's q_blocks table is cut in
    if q_THd.element_size() > 2:  # float32 (the tests' oracle runs): twice a tile's bytes; the tuned bf16 tiles
        BN, stages = min(BN, 32), min(stages, 2)  # (a prefill's 128 x 128 in 3 stages) overflow shared memory
    if B > 65535:
        raise ValueError(f"paged attention takes at most 65535 sequences a launch (the grid's third axis), not {B}")
    table = q_blocks is not None and max_query_len > 1 and q_blocks.shape[0] <= 65535  # (the grid's y axis)
    grid = (kvh * num_splits, q_blocks.shape[0], 1) if table else (kvh * num_splits, triton.cdiv(max_query_len, BM), B)
    if num_splits > 1:
        part_acc = torch.empty(T * H * num_splits, D, dtype=torch.float32, device=q_THd.device)
        part_ml = torch.empty(T * H * num_splits, 2, dtype=torch.float32, device=q_THd.device)
    else:
        part_acc = part_ml = out
    qkv, q_norm, k_norm, rope, positions, slots, eps = qk if qk is not None else (q_THd,) * 6 + (0.0,)
    _attn_fwd[grid](q_THd, cache, out, part_acc, part_ml, block_tables, seq_lens, query_start_loc,
                    q_blocks if table else seq_lens, scale,
                    q_THd.stride(0), q_THd.stride(1), out.stride(0), out.stride(1), cache.stride(0), cache.stride(1),
                    cache.stride(2), cache.stride(3), block_tables.stride(0),
                    qkv, q_norm, k_norm, rope, positions, slots, eps, H, qkv.stride(0), window or 0,
                    q_THd if sinks is None else sinks,
                    NUM_SPLITS=num_splits, G=G, BM=BM, BN=BN, D=D, PAGE=page,
                    PREC="ieee" if q_THd.dtype == torch.float32 else "tf32", QK=qk is not None, TABLE=table,
                    DECODE=max_query_len == 1, WINDOW=window is not None, SINKS=sinks is not None, num_warps=warps,
                    num_stages=stages, **pdl(q_THd, kc))
    if num_splits > 1:
        _merge_splits[(T, H)](part_acc, part_ml, out, out.stride(0), out.stride(1), H,
                              q_THd if sinks is None else sinks, NUM_SPLITS=num_splits, D=D, SINKS=sinks is not None,
                              **pdl(q_THd, kc))
    return out
