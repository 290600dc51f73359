"""Paged multi-head latent attention (MLA, DeepSeek-V2 / V3) in Triton, absorbed form: decodes and prompt chunks.

The cache holds one entry a token, [pages, page_size, C + R]: the normalised latent (C = kv_lora_rank) then the roped
rope key (R = qk_rope_head_dim), shared by every head. The caller folds the key up-projection into the query
(q_latent = q_nope @ W_UK per head); here, for each decoding sequence and head, scores = q_latent . latent +
q_rope . rope_key over the sequence's pages through its block table, the softmax with the softmax scale, and the
weighted sum of the latents, [T, H, C]; the caller applies the value up-projection W_UV after. One kernel for both
(`_mla_fwd`): a program takes BM new tokens of one sequence and a block of BH heads (rows = tokens x heads), so the
latent tiles it reads serve all of them (the cache is read once per query block, never expanded), each row causal
to its own position, as kernels/attention.py's chunk launch; a decode is the case of one token (BM = 1, DECODE).
For long decode contexts the keys are split over NUM_SPLITS programs (flash-decoding) and a second kernel merges
the partials, as kernels/attention.py's decode does. No host value is needed at launch beyond the grid (CUDA-graph
safe). The torch reference is `moebius.models.deepseek.mla.absorbed` (and `expanded`, which it equals).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moebius.kernels import DEFAULT_KERNELS, KernelConfig
from moebius.kernels.pdl import enter, pdl

# heads a program takes: tl.dot needs at least 16 rows compiled; more would hold a [BH, C] float32 accumulator of
# C = 512 (every published DeepSeek config) past the registers of 4 warps
HEAD_BLOCK = 16
# heads a decode program takes where a rank holds this many or more (DeepSeek-V3's 128 in EP), on 8 warps: each
# latent tile then serves 4x the rows (benchmarks/results/h100-p1-mla-tune-128-heads.json: 1.9x faster at batch 128)
WIDE_HEAD_BLOCK = 64
# programs a decode launch's keys are split up to (`layers.attention.num_splits_for`): GQA's split table gives 33
# sequences and more one program each, which left a latent launch far from HBM's rate with most SMs idle. About one
# program an SM: two an SM measured slower from batch 64 (benchmarks/results/h100-p1-mla-tune.json)
DECODE_MIN_PROGRAMS = 128
# latent values a program of the splits' merge takes: a program a token's head left the merge slow at batch 1
# (benchmarks/results/h200-p1-decode-profiles.json)
MERGE_BLOCK = 128


@triton.jit
def _latent_tile(q_lat, q_rope, Cache, BlockTables, b, stride_bt, stride_pg, stride_tok, start, hi, qpos, c, cv, r,
                 rv, m_i, l_i, acc, scale2, C: tl.constexpr, CP: tl.constexpr, R: tl.constexpr, RP: tl.constexpr,
                 BN: tl.constexpr, PAGE: tl.constexpr, PREC: tl.constexpr, MASK: tl.constexpr,
                 CAUSAL: tl.constexpr):
    """One KV tile of the online softmax (base 2) for every row (query token x head). MASK: the tile may hold keys
    at or past `hi`; CAUSAL (with MASK): or past a row's own position `qpos`."""
    j = start + tl.arange(0, BN)
    jv = j < hi
    if MASK:
        page = tl.load(BlockTables + b * stride_bt + j // PAGE, mask=jv, other=0)
    else:
        page = tl.load(BlockTables + b * stride_bt + j // PAGE)
    key = Cache + page.to(tl.int64) * stride_pg + (j % PAGE) * stride_tok  # each key's entry
    if MASK:
        # masked to 0 past the sequence's end: a page's unwritten rest may hold NaN (0 * NaN is NaN in the dots)
        lat = tl.load(key[:, None] + c[None, :], mask=jv[:, None] & cv[None, :], other=0.0)
        rope = tl.load(key[:, None] + C + r[None, :], mask=jv[:, None] & rv[None, :], other=0.0)
    elif CP == C and RP == R:  # (every published config: no mask at all)
        lat = tl.load(key[:, None] + c[None, :])
        rope = tl.load(key[:, None] + C + r[None, :])
    else:
        lat = tl.load(key[:, None] + c[None, :], mask=cv[None, :], other=0.0)
        rope = tl.load(key[:, None] + C + r[None, :], mask=rv[None, :], other=0.0)
    s = (tl.dot(q_lat, tl.trans(lat), input_precision=PREC)
         + tl.dot(q_rope, tl.trans(rope), input_precision=PREC))
    if MASK:
        if CAUSAL:
            s = tl.where(jv[None, :] & (j[None, :] <= qpos[:, None]), s, float("-inf"))
        else:
            s = tl.where(jv[None, :], s, float("-inf"))
    return _softmax_step(s, lat, m_i, l_i, acc, scale2, PREC)


@triton.jit
def _softmax_step(s, lat, m_i, l_i, acc, scale2, PREC: tl.constexpr):
    """The online softmax (base 2) over one tile's scores s [rows, keys] (-inf where masked) and the weighted sum of
    its latents lat [keys, C] into acc [rows, C]; returns the new (max, sum, acc)."""
    # scaled after the row max (scale2 > 0), so each score takes one fused multiply-add before exp2
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale2)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * scale2 - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    # the probabilities in the cache's dtype before the latent sum, as the torch reference rounds them
    acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _mla_fwd(QLat, QRope, Cache, Out, PartAcc, PartML, BlockTables, SeqLens, QStart, scale, H,
             stride_lt, stride_lh, stride_rt, stride_rh, stride_ot, stride_oh, stride_pg, stride_tok, stride_bt,
             C: tl.constexpr, R: tl.constexpr, CP: tl.constexpr, RP: tl.constexpr, NUM_SPLITS: tl.constexpr,
             BH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PAGE: tl.constexpr, PREC: tl.constexpr,
             DECODE: tl.constexpr, WHOLE: tl.constexpr, PDL: tl.constexpr):
    """Program (head block x split, sequence, query block): the online softmax (base 2) over this split's keys of
    the sequence for BM of its new tokens x BH heads (rows: token-major), each row causal to its own position.
    DECODE: one new token a sequence (BM == 1, one query block); WHOLE (with DECODE): its whole tiles unmasked as a
    chunk's are, else every tile masked. CP, RP: C and R rounded up to powers of two (Triton's ranges), the rest
    masked."""
    enter(PDL)
    # head blocks (and splits) vary fastest: the programs of one sequence run side by side and read its pages together
    hblk = tl.program_id(0) // NUM_SPLITS
    split = tl.program_id(0) % NUM_SPLITS
    b = tl.program_id(1)
    # a chunk's last query blocks (the longest KV walks) are scheduled first, so the launch does not end on them
    mblk = tl.num_programs(2) - 1 - tl.program_id(2)
    q0 = tl.load(QStart + b).to(tl.int64)
    if DECODE:
        qlen = 1
    else:
        qlen = (tl.load(QStart + b + 1) - q0).to(tl.int32)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    m0 = mblk * BM
    if m0 < qlen:
        kv_end = seq_len - qlen + tl.minimum(m0 + BM, qlen)  # causal: no row of the block looks past this
        per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BN) * BN
        lo = split * per_split
        hi = tl.minimum(kv_end, lo + per_split)
        rows = tl.arange(0, BM * BH)
        tok = m0 + rows // BH
        h = hblk * BH + rows % BH
        valid = (h < H) & (tok < qlen)
        qpos = seq_len - qlen + tok
        t = q0 + tok
        c = tl.arange(0, CP)
        cv = c < C
        r = tl.arange(0, RP)
        rv = r < R
        q_lat = tl.load(QLat + t[:, None] * stride_lt + h[:, None] * stride_lh + c[None, :],
                        mask=valid[:, None] & cv[None, :], other=0.0)
        q_rope = tl.load(QRope + t[:, None] * stride_rt + h[:, None] * stride_rh + r[None, :],
                         mask=valid[:, None] & rv[None, :], other=0.0)
        m_i = tl.full([BM * BH], float("-inf"), tl.float32)
        l_i = tl.zeros([BM * BH], tl.float32)
        acc = tl.zeros([BM * BH, CP], tl.float32)
        scale2 = scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e)): the partial maxima are in log2 units
        if DECODE and not WHOLE:
            # one loop, every tile masked (kernels/attention.py's decode: there its last-tile loop cost a memory-bound
            # decode more than the masks saved; here whole tiles measured faster, `DECODE_WHOLE_TILES`)
            for start in range(lo, hi, BN):
                m_i, l_i, acc = _latent_tile(q_lat, q_rope, Cache, BlockTables, b, stride_bt, stride_pg, stride_tok,
                                             start, hi, qpos, c, cv, r, rv, m_i, l_i, acc, scale2, C, CP, R, RP, BN,
                                             PAGE, PREC, True, False)
        else:
            # keys up to the block's first query position are visible to every row: whole tiles there skip the mask
            # (a decode's WHOLE: every tile but its split's last, fewer instructions a tile where the kernel rather
            # than HBM bounds it)
            full = lo + tl.maximum(tl.minimum(hi, seq_len - qlen + m0 + 1) - lo, 0) // BN * BN
            for start in range(lo, full, BN):
                m_i, l_i, acc = _latent_tile(q_lat, q_rope, Cache, BlockTables, b, stride_bt, stride_pg, stride_tok,
                                             start, hi, qpos, c, cv, r, rv, m_i, l_i, acc, scale2, C, CP, R, RP, BN,
                                             PAGE, PREC, False, True)
            for start in range(full, hi, BN):
                m_i, l_i, acc = _latent_tile(q_lat, q_rope, Cache, BlockTables, b, stride_bt, stride_pg, stride_tok,
                                             start, hi, qpos, c, cv, r, rv, m_i, l_i, acc, scale2, C, CP, R, RP, BN,
                                             PAGE, PREC, True, True)
        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(Out + t[:, None] * stride_ot + h[:, None] * stride_oh + c[None, :],
                     out.to(Out.dtype.element_ty), mask=valid[:, None] & cv[None, :])
        else:
            # partials of token t, head h, split s at ((t * H + h) * NUM_SPLITS + s)
            idx = (t * H + h) * NUM_SPLITS + split
            tl.store(PartAcc + idx[:, None] * C + c[None, :], acc, mask=valid[:, None] & cv[None, :])
            tl.store(PartML + idx * 2, m_i, mask=valid)
            tl.store(PartML + idx * 2 + 1, l_i, mask=valid)


@triton.jit
def _mla_merge(PartAcc, PartML, Out, stride_ot, stride_oh, H, C: tl.constexpr, CB: tl.constexpr,
               NUM_SPLITS: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr):
    """Program (token, head, CB latent values): the splits' partial sums rescaled to the largest maximum and
    normalised. SP: NUM_SPLITS rounded up to a power of two."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SP)
    sv = s < NUM_SPLITS
    idx = (t * H + h) * NUM_SPLITS + s
    m = tl.load(PartML + idx * 2, mask=sv, other=float("-inf"))
    l = tl.load(PartML + idx * 2 + 1, mask=sv, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max)))  # log2 units
    L = tl.sum(l * w, 0)
    c = tl.program_id(2) * CB + tl.arange(0, CB)
    cv = c < C
    acc = tl.load(PartAcc + idx[:, None] * C + c[None, :], mask=sv[:, None] & cv[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(L > 0, L, 1.0)
    tl.store(Out + t * stride_ot + h * stride_oh + c, out.to(Out.dtype.element_ty), mask=cv)


@triton.jit
def _rope_pair(X, i, INTERLEAVE: tl.constexpr, R: tl.constexpr, mask):
    """The rope dims of rows X (pointers to each row's first rope value) as the rotation's two halves: pairs (2i,
    2i + 1) where the checkpoint interleaves them, else [first half | second half]."""
    if INTERLEAVE:
        return (tl.load(X + 2 * i[None, :], mask=mask, other=0.0),
                tl.load(X + 2 * i[None, :] + 1, mask=mask, other=0.0))
    return tl.load(X + i[None, :], mask=mask, other=0.0), tl.load(X + R // 2 + i[None, :], mask=mask, other=0.0)


@triton.jit
def _rotate(x1, x2, cos, sin, dt: tl.constexpr):
    """[x1 cos - x2 sin | x2 cos + x1 sin] rounded to dt after each product and each sum, as the torch reference's
    ops in dt (`layers.rotary.apply_rope`)."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    o1 = ((x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)).to(dt)
    return o1, o2


@triton.jit
def _rope_latent(Q, KV, NormW, Rope, Pos, Slots, Cache, QRope, H, eps, stride_qt, stride_kvt, stride_ot,
                 stride_oh, stride_pg, stride_tok, N: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
                 CP: tl.constexpr, HB: tl.constexpr, PAGE: tl.constexpr, INTERLEAVE: tl.constexpr,
                 PDL: tl.constexpr):
    """Program (token, block): blocks below cdiv(H, HB) rotate HB heads' rope query into QRope; the last one
    normalises the token's latent (RMSNorm, NormW), rotates its rope key and writes both, the cache entry, at the
    token's slot."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    dt = QRope.dtype.element_ty
    i = tl.arange(0, R // 2)
    pos = tl.load(Pos + t)
    cos = tl.load(Rope + pos * R + i).to(dt).to(tl.float32)[None, :]
    sin = tl.load(Rope + pos * R + R // 2 + i).to(dt).to(tl.float32)[None, :]
    if blk < tl.cdiv(H, HB):
        h = blk * HB + tl.arange(0, HB)
        hv = (h < H)[:, None]
        x1, x2 = _rope_pair(Q + t * stride_qt + h[:, None] * (N + R) + N, i, INTERLEAVE, R, hv)
        o1, o2 = _rotate(x1, x2, cos, sin, dt)
        out = QRope + t * stride_ot + h[:, None] * stride_oh + i[None, :]
        tl.store(out, o1, mask=hv)
        tl.store(out + R // 2, o2, mask=hv)
    else:
        slot = tl.load(Slots + t)
        dst = Cache + (slot // PAGE) * stride_pg + (slot % PAGE) * stride_tok
        c = tl.arange(0, CP)
        cv = c < C
        x = tl.load(KV + t * stride_kvt + c, mask=cv, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, 0) / C + eps)
        w = tl.load(NormW + c, mask=cv, other=0.0).to(tl.float32)
        tl.store(dst + c, (w * (x * r).to(dt).to(tl.float32)).to(dt), mask=cv)
        one = tl.full([1], 1, tl.int1)
        k1, k2 = _rope_pair(KV + t * stride_kvt + C + tl.zeros([1], tl.int64), i, INTERLEAVE, R, one[:, None])
        ko1, ko2 = _rotate(k1, k2, cos, sin, dt)  # (names apart from the queries': Triton types each per branch)
        tl.store(dst + C + i[None, :], ko1)
        tl.store(dst + C + R // 2 + i[None, :], ko2)


# heads a program of `rope_latent` rotates
ROPE_HEADS = 16


def rope_latent(q_TX: torch.Tensor, kv_TA: torch.Tensor, norm_C: torch.Tensor, rope: torch.Tensor,
                positions: torch.Tensor, slots: torch.Tensor, cache_PSA: torch.Tensor, num_heads: int, nope: int,
                eps: float, interleave: bool, *, kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """MLA's step between its projections and its attention in one launch: from q [T, H (N + R)] (each head's N
    nope then R rope values) and kv_a's output [T, C + R] (the latent, then the rope key), the rope queries
    [T, H, R] rotated at each token's position, and each token's cache entry (the latent
    RMSNorm-ed with `norm_C`, the rotated rope key) written at its slot; `models/deepseek/mla.project` and
    `write_latent` are the torch statement of it (their ops' roundings included)."""
    T = q_TX.shape[0]
    R = rope.shape[1]
    C = kv_TA.shape[1] - R
    if cache_PSA.shape[2] != C + R or q_TX.shape[1] != num_heads * (nope + R):
        raise ValueError(f"rope_latent: q {tuple(q_TX.shape)} is not {num_heads} heads of {nope} + {R}, or the "
                         f"cache's entries {cache_PSA.shape[2]} are not kv's {C} + {R}")
    out = torch.empty(T, num_heads, R, dtype=q_TX.dtype, device=q_TX.device)
    if T:
        _rope_latent[(T, triton.cdiv(num_heads, ROPE_HEADS) + 1)](
            q_TX, kv_TA, norm_C, rope, positions, slots, cache_PSA, out, num_heads, eps, q_TX.stride(0),
            kv_TA.stride(0), out.stride(0), out.stride(1), cache_PSA.stride(0), cache_PSA.stride(1), N=nope, C=C,
            R=R, CP=triton.next_power_of_2(C), HB=ROPE_HEADS, PAGE=cache_PSA.shape[1], INTERLEAVE=interleave,
            num_warps=4, **pdl(q_TX, kc))
    return out


@functools.cache
def _hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def decode_head_block(heads: int, cache: torch.Tensor) -> int:
    """Heads a decode program takes of a rank's `heads` over this latent cache (the runner's split units are its
    blocks): WIDE_HEAD_BLOCK from that many heads in bf16 / fp16 where a program's shared memory holds the wide
    launch's tiles (216 KB at 2 stages: Hopper's 227 KB a block, not an A100's 163; test_kernels_sm90.py), else
    HEAD_BLOCK (float32, the tests' oracle runs: its tiles twice the bytes)."""
    wide = heads >= WIDE_HEAD_BLOCK and cache.element_size() <= 2
    return WIDE_HEAD_BLOCK if wide and (not cache.is_cuda or _hopper(cache.device.index or 0)) else HEAD_BLOCK


def decode_tiles(C: int, element_size: int, batch: int, head_blocks: int, head_block: int = HEAD_BLOCK
                 ) -> tuple[int, int, int]:
    """(KV tile, warps, pipeline stages) of a decode launch of `batch` sequences of `head_blocks` blocks of
    `head_block` heads. bf16, searched by benchmarks/kernels/mla_tune.py (benchmarks/results/h100-p1-mla-tune.json):
    up to about one program an SM before splits, 64-key tiles on 8 warps; past it 4 warps, and 32-key tiles where a
    sequence has one head block (its programs stream the cache from HBM) while several head blocks (reading a
    sequence's latents through L2) keep 64. Wide head blocks: 64-key tiles, 8 warps, 3 stages, the best at batch 128
    and within 4% of it at 32 (h100-p1-mla-tune-128-heads.json). float32 (the tests' oracle runs): a [16, C] tile,
    the bytes of bf16's 32."""
    if element_size > 2:
        return 16, 8 if C >= 256 else 4, 2
    if head_block > HEAD_BLOCK:
        return 64, 8, 3
    if batch * head_blocks <= DECODE_MIN_PROGRAMS:
        return 64, 8, 2
    return 32 if head_blocks == 1 else 64, 4, 2


class DecodeLaunch(NamedTuple):
    """A decode launch's shape: heads a program, KV tile, warps, pipeline stages, and whether the whole KV tiles go
    unmasked (`_mla_fwd`'s WHOLE)."""

    head_block: int
    BN: int
    warps: int
    stages: int
    whole: bool


# decode's whole KV tiles unmasked (the split's last one masked): fewer instructions in the sm_90 loop, and faster on
# an H100 at every batch searched with the launch's own shape, in the kernel and in DeepSeek-V2-Lite's step
# (benchmarks/results/h100-p1-mla-tune-whole.json, -whole-mid.json; h100-p1-deepseek-v2-lite-sweep-whole.json against
# -masked.json). False: every tile masked (mla_tune.py's baseline)
DECODE_WHOLE_TILES = True


def decode_launch(C: int, H: int, B: int, cache: torch.Tensor) -> DecodeLaunch:
    """The decode launch of B sequences of H heads over this latent cache of latent width C (`decode_head_block`,
    `decode_tiles`)."""
    BH = decode_head_block(H, cache)
    return DecodeLaunch(BH, *decode_tiles(C, cache.element_size(), B, triton.cdiv(H, BH), BH), DECODE_WHOLE_TILES)


def chunk_tiles(C: int, element_size: int) -> tuple[int, int, int, int]:
    """(query tokens a program, KV tile, warps, pipeline stages) of a launch with prompt chunks: not tuned yet (no
    GPU run of it so far). 4 tokens x HEAD_BLOCK heads = 64 rows, whose [64, C] float32 accumulator at C = 512 is
    what 8 warps hold in registers (FlashMLA's tile is 64 rows of the same latent); every row reuses each latent
    tile, so the cache is read once a query block of 4 tokens x 16 heads. A [BN, C] latent tile of bf16 at C = 512
    is 32 KiB a stage at BN = 32, float32 half the tokens for the same bytes."""
    return 4, 32 if element_size <= 2 else 16, 8 if C >= 256 else 4, 2


def latent_decode_attention(q_latent_THC: torch.Tensor, q_rope_THR: torch.Tensor, cache_PSA: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            scale: float, num_splits: int = 1, *, kc: KernelConfig = DEFAULT_KERNELS,
                            out: torch.Tensor | None = None, launch: DecodeLaunch | None = None) -> torch.Tensor:
    """Decode (one new token a sequence: T == B) over the paged latent cache, absorbed form: q_latent [T, H, C]
    (q_nope through W_UK), q_rope [T, H, R] (roped), cache [pages, page_size, C + R] (the last dim contiguous),
    block_tables [B, max_pages] int32, seq_lens [B] (keys of each sequence, its new token's included; the new
    entry already written), query_start_loc [B + 1]. Returns the weighted latent sums [T, H, C] in q_latent's dtype
    (in `out` when given); the caller applies W_UV. num_splits > 1: each sequence's keys split over that many
    programs, then merged. launch: another shape than the kernel's own (`decode_launch`; benchmarks/kernels/
    mla_tune.py searches them)."""
    T, B = q_latent_THC.shape[0], seq_lens.shape[0]
    if T != B:
        raise ValueError(f"latent_decode_attention takes one token a sequence: {T} tokens for {B} sequences")
    return _launch(q_latent_THC, q_rope_THR, cache_PSA, block_tables, seq_lens, query_start_loc, 1, scale,
                   num_splits, kc, out, launch)


def latent_chunk_attention(q_latent_THC: torch.Tensor, q_rope_THR: torch.Tensor, cache_PSA: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           max_query_len: int, scale: float, *, kc: KernelConfig = DEFAULT_KERNELS,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Prompt chunks (and any decodes among them) over the paged latent cache, absorbed form, causal: sequence b's
    new tokens are q rows query_start_loc[b] .. [b + 1], the last ones of its seq_lens[b] keys (its cached tokens
    before them, then the chunk's own, whose entries are already written), each attending to the keys up to its
    own position. Arguments and result as `latent_decode_attention`'s; max_query_len: the longest chunk (a host
    value: the grid's query blocks)."""
    return _launch(q_latent_THC, q_rope_THR, cache_PSA, block_tables, seq_lens, query_start_loc, max_query_len,
                   scale, 1, kc, out, None)


def _launch(q_latent_THC: torch.Tensor, q_rope_THR: torch.Tensor, cache_PSA: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
            scale: float, num_splits: int, kc: KernelConfig, out: torch.Tensor | None, launch: DecodeLaunch | None
            ) -> torch.Tensor:
    """One launch of _mla_fwd: decode tiles (and KV splits) when max_query_len == 1 (`launch`, or the kernel's
    own), else chunk tiles, one split."""
    T, H, C = q_latent_THC.shape
    R = q_rope_THR.shape[2]
    B = seq_lens.shape[0]
    if cache_PSA.shape[2] != C + R:
        raise ValueError(f"the latent cache's entries hold {cache_PSA.shape[2]} values, not C + R = {C} + {R}")
    if cache_PSA.stride(2) != 1 or q_latent_THC.stride(2) != 1 or q_rope_THR.stride(2) != 1:
        raise ValueError("the cache's, q_latent's and q_rope's last dims must be contiguous")
    if num_splits > 1 and max_query_len > 1:
        raise ValueError("KV splits are for decode (max_query_len == 1) only")
    out = torch.empty_like(q_latent_THC) if out is None else out
    if T == 0:
        return out
    if B > 65535:
        raise ValueError(f"latent attention takes at most 65535 sequences a launch (the grid's y axis), not {B}")
    decode = max_query_len == 1
    if decode:
        BM, (BH, BN, warps, stages, whole) = 1, launch or decode_launch(C, H, B, cache_PSA)
    else:
        (BM, BN, warps, stages), BH, whole = chunk_tiles(C, cache_PSA.element_size()), HEAD_BLOCK, True
    CP, RP = triton.next_power_of_2(C), max(16, triton.next_power_of_2(R))  # (tl.dot's K of at least 16)
    if num_splits > 1:
        part_acc = torch.empty(T * H * num_splits, C, dtype=torch.float32, device=q_latent_THC.device)
        part_ml = torch.empty(T * H * num_splits, 2, dtype=torch.float32, device=q_latent_THC.device)
    else:
        part_acc = part_ml = out
    grid = (triton.cdiv(H, BH) * num_splits, B, triton.cdiv(max_query_len, BM))
    _mla_fwd[grid](q_latent_THC, q_rope_THR, cache_PSA, out, part_acc, part_ml, block_tables, seq_lens,
                   query_start_loc, scale, H,
                   q_latent_THC.stride(0), q_latent_THC.stride(1), q_rope_THR.stride(0), q_rope_THR.stride(1),
                   out.stride(0), out.stride(1), cache_PSA.stride(0), cache_PSA.stride(1), block_tables.stride(0),
                   C=C, R=R, CP=CP, RP=RP, NUM_SPLITS=num_splits, BH=BH, BM=BM, BN=BN,
                   PAGE=cache_PSA.shape[1], PREC="ieee" if q_latent_THC.dtype == torch.float32 else "tf32",
                   DECODE=decode, WHOLE=whole, num_warps=warps, num_stages=stages, **pdl(q_latent_THC, kc))
    if num_splits > 1:  # (a program a block of latent values: a token's heads alone left most SMs idle at batch 1)
        _mla_merge[(T, H, triton.cdiv(C, MERGE_BLOCK))](part_acc, part_ml, out, out.stride(0), out.stride(1), H, C=C,
                                                        CB=min(MERGE_BLOCK, CP), NUM_SPLITS=num_splits,
                                                        SP=triton.next_power_of_2(num_splits), **pdl(q_latent_THC, kc))
    return out
