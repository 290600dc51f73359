"""Prototype latent decode kernels (DeepSeek-V2-Lite's 16 heads, context 1024) against kernels/mla's in the same
call: `_mla_tma` (whole pages through TMA descriptors, two a rescale), `_mla_swap` (the keys as the MMA's rows: a
warpgroup MMA from 64 keys), `_mla_swap2` (that, whole tiles unmasked, each row's address a page's base plus offsets
fixed for the launch), `_mla_cur2` (kernels/mla's layout with `_mla_swap2`'s addressing). --l2: every sequence reads
the same pages, from L2: each kernel's ceiling where HBM is not the limit (an H200's bandwidth is over an H100's
kernel rate). Results: benchmarks/results/h100-p1-mla-variants*.json, docs/performance.md.

    python benchmarks/kernels/mla_proto.py out.json [--batches 256 1024] [--modes hbm l2] [--replot]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

from moebius.bench.graph_timing import graph_time_us
from moebius.bench.results import load_result, save_result
from moebius.kernels import mla as M

PAGE, C, R, CTX = 16, 512, 64, 1024


@triton.jit
def _step(q_lat, q_rope, lat, rope, m_i, l_i, acc, scale2, jv):
    s = tl.dot(q_lat, tl.trans(lat)) + tl.dot(q_rope, tl.trans(rope))
    s = tl.where(jv[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale2)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * scale2 - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat)
    return m_new, l_i, acc


@triton.jit
def _step2(q_lat, q_rope, lat, rope, lat2, rope2, m_i, l_i, acc, scale2):
    """Two whole pages: one rescale."""
    s = tl.dot(q_lat, tl.trans(lat)) + tl.dot(q_rope, tl.trans(rope))
    s2 = tl.dot(q_lat, tl.trans(lat2)) + tl.dot(q_rope, tl.trans(rope2))
    m_new = tl.maximum(m_i, tl.maximum(tl.max(s, 1), tl.max(s2, 1)) * scale2)
    p = tl.exp2(s * scale2 - m_new[:, None])
    p2 = tl.exp2(s2 * scale2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1) + tl.sum(p2, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat)
    acc = acc + tl.dot(p2.to(lat.dtype), lat2)
    return m_new, l_i, acc


@triton.jit
def _mla_tma(QLat, QRope, LatDesc, RopeDesc, Cache, Out, BlockTables, SeqLens, scale, H,
             stride_lt, stride_lh, stride_rt, stride_rh, stride_ot, stride_oh, stride_pg, stride_tok, stride_bt,
             C: tl.constexpr, R: tl.constexpr, BH: tl.constexpr, PAGE: tl.constexpr, PAIR: tl.constexpr,
             TMA: tl.constexpr):
    """Program (head block, sequence): whole pages through TMA descriptors (or pointers), PAIR pages a rescale;
    the last page (partial) through masked pointer loads."""
    hblk = tl.program_id(0)
    b = tl.program_id(1)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    h = hblk * BH + tl.arange(0, BH)
    hv = h < H
    c = tl.arange(0, C)
    r = tl.arange(0, R)
    q_lat = tl.load(QLat + b * stride_lt + h[:, None] * stride_lh + c[None, :], mask=hv[:, None], other=0.0)
    q_rope = tl.load(QRope + b * stride_rt + h[:, None] * stride_rh + r[None, :], mask=hv[:, None], other=0.0)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, C], tl.float32)
    scale2 = scale * 1.4426950408889634
    full = (seq_len - 1) // PAGE  # whole pages before the last (which may be partial)
    t = tl.arange(0, PAGE)
    if PAIR == 2:
        for p in range(0, full // 2 * 2, 2):
            pg = tl.load(BlockTables + b * stride_bt + p)
            pg2 = tl.load(BlockTables + b * stride_bt + p + 1)
            if TMA:
                lat = LatDesc.load([pg * PAGE, 0])
                rope = RopeDesc.load([pg * PAGE, C])
                lat2 = LatDesc.load([pg2 * PAGE, 0])
                rope2 = RopeDesc.load([pg2 * PAGE, C])
            else:
                base = pg.to(tl.int64) * stride_pg + t * stride_tok
                base2 = pg2.to(tl.int64) * stride_pg + t * stride_tok
                lat = tl.load(Cache + base[:, None] + c[None, :])
                rope = tl.load(Cache + C + base[:, None] + r[None, :])
                lat2 = tl.load(Cache + base2[:, None] + c[None, :])
                rope2 = tl.load(Cache + C + base2[:, None] + r[None, :])
            m_i, l_i, acc = _step2(q_lat, q_rope, lat, rope, lat2, rope2, m_i, l_i, acc, scale2)
        first = full // 2 * 2
    else:
        first = 0
    for p in range(first, full):
        pg = tl.load(BlockTables + b * stride_bt + p)
        if TMA:
            lat = LatDesc.load([pg * PAGE, 0])
            rope = RopeDesc.load([pg * PAGE, C])
        else:
            base = pg.to(tl.int64) * stride_pg + t * stride_tok
            lat = tl.load(Cache + base[:, None] + c[None, :])
            rope = tl.load(Cache + C + base[:, None] + r[None, :])
        m_i, l_i, acc = _step(q_lat, q_rope, lat, rope, m_i, l_i, acc, scale2, t >= 0)
    # the last page: keys past the sequence's end masked to 0 (an unwritten slot may hold NaN)
    j = full * PAGE + t
    jv = j < seq_len
    pg = tl.load(BlockTables + b * stride_bt + full)
    base = pg.to(tl.int64) * stride_pg + t * stride_tok
    lat = tl.load(Cache + base[:, None] + c[None, :], mask=jv[:, None], other=0.0)
    rope = tl.load(Cache + C + base[:, None] + r[None, :], mask=jv[:, None], other=0.0)
    m_i, l_i, acc = _step(q_lat, q_rope, lat, rope, m_i, l_i, acc, scale2, jv)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + b * stride_ot + h[:, None] * stride_oh + c[None, :], out.to(Out.dtype.element_ty),
             mask=hv[:, None])


@triton.jit
def _mla_swap(QLat, QRope, Cache, Out, BlockTables, SeqLens, scale, H,
              stride_lt, stride_lh, stride_rt, stride_rh, stride_ot, stride_oh, stride_pg, stride_tok, stride_bt,
              C: tl.constexpr, R: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, PAGE: tl.constexpr):
    """Program (head block, sequence), transposed: scores^T = latent tile [BN, C] @ q^T [C, BH] (the keys as the
    MMA's rows: a warpgroup MMA from BN = 64), acc^T [C, BH] += latent^T @ p^T."""
    hblk = tl.program_id(0)
    b = tl.program_id(1)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    h = hblk * BH + tl.arange(0, BH)
    hv = h < H
    c = tl.arange(0, C)
    r = tl.arange(0, R)
    q_lat = tl.load(QLat + b * stride_lt + h[None, :] * stride_lh + c[:, None], mask=hv[None, :], other=0.0)
    q_rope = tl.load(QRope + b * stride_rt + h[None, :] * stride_rh + r[:, None], mask=hv[None, :], other=0.0)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([C, BH], tl.float32)
    scale2 = scale * 1.4426950408889634
    for start in range(0, seq_len, BN):
        j = start + tl.arange(0, BN)
        jv = j < seq_len
        pg = tl.load(BlockTables + b * stride_bt + j // PAGE, mask=jv, other=0)
        base = pg.to(tl.int64) * stride_pg + (j % PAGE) * stride_tok
        lat = tl.load(Cache + base[:, None] + c[None, :], mask=jv[:, None], other=0.0)
        rope = tl.load(Cache + C + base[:, None] + r[None, :], mask=jv[:, None], other=0.0)
        s = tl.dot(lat, q_lat) + tl.dot(rope, q_rope)
        s = tl.where(jv[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0) * scale2)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s * scale2 - m_safe[None, :])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(lat), p.to(lat.dtype))
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[None, :]
    tl.store(Out + b * stride_ot + h[None, :] * stride_oh + c[:, None], out.to(Out.dtype.element_ty),
             mask=hv[None, :])


@triton.jit
def _swap_tile(q_lat, q_rope, lat, rope, m_i, l_i, acc, scale2, jv, MASK: tl.constexpr):
    s = tl.dot(lat, q_lat) + tl.dot(rope, q_rope)
    if MASK:
        s = tl.where(jv[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0) * scale2)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * scale2 - m_safe[None, :])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 0)
    acc = acc * alpha[None, :] + tl.dot(tl.trans(lat), p.to(lat.dtype))
    return m_new, l_i, acc


@triton.jit
def _mla_swap2(QLat, QRope, Cache, Out, BlockTables, SeqLens, scale, H,
               stride_lt, stride_lh, stride_rt, stride_rh, stride_ot, stride_oh, stride_pg, stride_tok, stride_bt,
               C: tl.constexpr, R: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, PAGE: tl.constexpr):
    """`_mla_swap` with whole tiles unmasked and their addresses a page's base (one table read a page) plus
    offsets fixed for the launch; the last, partial tile masked."""
    hblk = tl.program_id(0)
    b = tl.program_id(1)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    h = hblk * BH + tl.arange(0, BH)
    hv = h < H
    c = tl.arange(0, C)
    r = tl.arange(0, R)
    q_lat = tl.load(QLat + b * stride_lt + h[None, :] * stride_lh + c[:, None], mask=hv[None, :], other=0.0)
    q_rope = tl.load(QRope + b * stride_rt + h[None, :] * stride_rh + r[:, None], mask=hv[None, :], other=0.0)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([C, BH], tl.float32)
    scale2 = scale * 1.4426950408889634
    t = tl.arange(0, BN)
    off_lat = (t % PAGE)[:, None] * stride_tok + c[None, :]
    off_rope = (t % PAGE)[:, None] * stride_tok + C + r[None, :]
    full = seq_len // BN * BN
    Table = BlockTables + b * stride_bt
    for start in range(0, full, BN):
        pg = tl.load(Table + (start + t) // PAGE)
        base = Cache + pg.to(tl.int64) * stride_pg
        lat = tl.load(base[:, None] + off_lat)
        rope = tl.load(base[:, None] + off_rope)
        m_i, l_i, acc = _swap_tile(q_lat, q_rope, lat, rope, m_i, l_i, acc, scale2, t, False)
    if full < seq_len:
        j = full + t
        jv = j < seq_len
        pg = tl.load(Table + j // PAGE, mask=jv, other=0)
        base = Cache + pg.to(tl.int64) * stride_pg
        lat = tl.load(base[:, None] + off_lat, mask=jv[:, None], other=0.0)
        rope = tl.load(base[:, None] + off_rope, mask=jv[:, None], other=0.0)
        m_i, l_i, acc = _swap_tile(q_lat, q_rope, lat, rope, m_i, l_i, acc, scale2, jv, True)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[None, :]
    tl.store(Out + b * stride_ot + h[None, :] * stride_oh + c[:, None], out.to(Out.dtype.element_ty),
             mask=hv[None, :])


@triton.jit
def _cur2_tile(q_lat, q_rope, lat, rope, m_i, l_i, acc, scale2, jv, MASK: tl.constexpr):
    s = tl.dot(q_lat, tl.trans(lat)) + tl.dot(q_rope, tl.trans(rope))
    if MASK:
        s = tl.where(jv[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale2)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * scale2 - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat)
    return m_new, l_i, acc


@triton.jit
def _mla_cur2(QLat, QRope, Cache, Out, BlockTables, SeqLens, scale, H,
              stride_lt, stride_lh, stride_rt, stride_rh, stride_ot, stride_oh, stride_pg, stride_tok, stride_bt,
              C: tl.constexpr, R: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, PAGE: tl.constexpr):
    """kernels/mla's layout (heads as the MMA's rows) with `_mla_swap2`'s addressing: whole tiles unmasked, a
    page's base plus offsets fixed for the launch; the last, partial tile masked."""
    hblk = tl.program_id(0)
    b = tl.program_id(1)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    h = hblk * BH + tl.arange(0, BH)
    hv = h < H
    c = tl.arange(0, C)
    r = tl.arange(0, R)
    q_lat = tl.load(QLat + b * stride_lt + h[:, None] * stride_lh + c[None, :], mask=hv[:, None], other=0.0)
    q_rope = tl.load(QRope + b * stride_rt + h[:, None] * stride_rh + r[None, :], mask=hv[:, None], other=0.0)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, C], tl.float32)
    scale2 = scale * 1.4426950408889634
    t = tl.arange(0, BN)
    off_lat = (t % PAGE)[:, None] * stride_tok + c[None, :]
    off_rope = (t % PAGE)[:, None] * stride_tok + C + r[None, :]
    full = seq_len // BN * BN
    Table = BlockTables + b * stride_bt
    for start in range(0, full, BN):
        pg = tl.load(Table + (start + t) // PAGE)
        base = Cache + pg.to(tl.int64) * stride_pg
        lat = tl.load(base[:, None] + off_lat)
        rope = tl.load(base[:, None] + off_rope)
        m_i, l_i, acc = _cur2_tile(q_lat, q_rope, lat, rope, m_i, l_i, acc, scale2, t, False)
    if full < seq_len:
        j = full + t
        jv = j < seq_len
        pg = tl.load(Table + j // PAGE, mask=jv, other=0)
        base = Cache + pg.to(tl.int64) * stride_pg
        lat = tl.load(base[:, None] + off_lat, mask=jv[:, None], other=0.0)
        rope = tl.load(base[:, None] + off_rope, mask=jv[:, None], other=0.0)
        m_i, l_i, acc = _cur2_tile(q_lat, q_rope, lat, rope, m_i, l_i, acc, scale2, jv, True)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + b * stride_ot + h[:, None] * stride_oh + c[None, :], out.to(Out.dtype.element_ty),
             mask=hv[:, None])


@triton.jit
def _mla_swap_tma(QLat, QRope, LatDesc, RopeDesc, Cache, Out, BlockTables, SeqLens, scale, H,
                  stride_lt, stride_lh, stride_rt, stride_rh, stride_ot, stride_oh, stride_pg, stride_tok, stride_bt,
                  C: tl.constexpr, R: tl.constexpr, BH: tl.constexpr, PAGE: tl.constexpr, WS: tl.constexpr,
                  NS: tl.constexpr):
    """`_mla_swap` over pages of 64 or more keys: each whole page one TMA load (a tile of PAGE keys), optionally
    warp-specialized (a producer warp issuing the loads NS pages ahead); the last page through masked pointers."""
    hblk = tl.program_id(0)
    b = tl.program_id(1)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    h = hblk * BH + tl.arange(0, BH)
    hv = h < H
    c = tl.arange(0, C)
    r = tl.arange(0, R)
    q_lat = tl.load(QLat + b * stride_lt + h[None, :] * stride_lh + c[:, None], mask=hv[None, :], other=0.0)
    q_rope = tl.load(QRope + b * stride_rt + h[None, :] * stride_rh + r[:, None], mask=hv[None, :], other=0.0)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([C, BH], tl.float32)
    scale2 = scale * 1.4426950408889634
    t = tl.arange(0, PAGE)
    full = (seq_len - 1) // PAGE
    Table = BlockTables + b * stride_bt
    for p in tl.range(0, full, warp_specialize=WS, num_stages=NS):
        pg = tl.load(Table + p)
        lat = LatDesc.load([pg * PAGE, 0])
        rope = RopeDesc.load([pg * PAGE, C])
        m_i, l_i, acc = _swap_tile(q_lat, q_rope, lat, rope, m_i, l_i, acc, scale2, t, False)
    j = full * PAGE + t
    jv = j < seq_len
    pg = tl.load(Table + full)
    base = Cache + pg.to(tl.int64) * stride_pg + t * stride_tok
    lat = tl.load(base[:, None] + c[None, :], mask=jv[:, None], other=0.0)
    rope = tl.load(base[:, None] + C + r[None, :], mask=jv[:, None], other=0.0)
    m_i, l_i, acc = _swap_tile(q_lat, q_rope, lat, rope, m_i, l_i, acc, scale2, jv, True)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[None, :]
    tl.store(Out + b * stride_ot + h[None, :] * stride_oh + c[:, None], out.to(Out.dtype.element_ty),
             mask=hv[None, :])


def plot(result: dict, png: str) -> None:
    """Cache TB/s of each launch at each batch, from HBM and from L2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    keys = sorted({(r["mode"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 6), squeeze=False)
    for ax, (mode, B) in zip(axes[0], keys, strict=True):
        rs = [r for r in rows if (r["mode"], r["batch"]) == (mode, B)]
        labels = [f"{i}: {r['kind']} " + "/".join(str(r[k]) for k in ("page", "BN", "pair", "nw", "st") if k in r)
                  for i, r in enumerate(rs)]
        ax.barh(labels, [r["tbps"] for r in rs])
        ax.set_title(f"batch {B}, cache from {mode.upper()} ({result.get('gpu', '')})", fontsize=9)
        ax.set_xlabel("latent cache TB/s")
    fig.tight_layout()
    fig.savefig(png, dpi=80)


def run(B: int, H: int, l2: bool) -> list[dict]:
    """Every case's row at one batch (cases that fail to compile are left out); each case on its pages' size."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    dev = torch.device("cuda")
    q_lat = torch.randn(B, H, C, device=dev, dtype=torch.bfloat16)
    q_rope = torch.randn(B, H, R, device=dev, dtype=torch.bfloat16)
    seq = torch.full((B,), CTX + 1, device=dev, dtype=torch.int64)
    qsl = torch.arange(B + 1, device=dev, dtype=torch.int64)
    scale = (128 + R) ** -0.5
    nbytes = B * (CTX + 1) * (C + R) * 2
    strides = (q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1))
    caches: dict[int, tuple] = {}

    def paged(page: int) -> tuple:
        """The cache in pages of `page` keys, its block table, descriptors of a page's latent and rope parts, and
        kernels/mla's output on it (the reference)."""
        if page not in caches:
            caches.clear()  # (one cache at a time: batch 1024's is 1.2 GB)
            torch.cuda.empty_cache()
            pages_per = -(-(CTX + 1) // page)
            npages = B * pages_per + 1
            cache = torch.randn(npages, page, C + R, device=dev, dtype=torch.bfloat16)
            bt = (torch.randperm(npages - 1, device=dev)[: B * pages_per] + 1).view(B, pages_per).int().contiguous()
            if l2:  # every sequence reads the first one's pages
                bt = bt[:1].expand(B, pages_per).contiguous()
            flat = cache.view(npages * page, C + R)
            descs = TensorDescriptor.from_tensor(flat, [page, C]), TensorDescriptor.from_tensor(flat, [page, R])
            ref = M.latent_decode_attention(q_lat, q_rope, cache, bt, seq, qsl, scale, 1)
            caches[page] = cache, bt, descs, ref
        return caches[page]

    def launch(kind: str, kw: dict, o: torch.Tensor) -> None:
        cache, bt, (lat_desc, rope_desc), _ = paged(kw.get("page", PAGE))
        common = (*strides, o.stride(0), o.stride(1), cache.stride(0), cache.stride(1), bt.stride(0))
        if kind == "current":
            M._mla_fwd[(triton.cdiv(H, M.HEAD_BLOCK), B, 1)](
                q_lat, q_rope, cache, o, o, o, bt, seq, qsl, scale, H, *common, C=C, R=R, CP=C, RP=R, NUM_SPLITS=1,
                BH=M.HEAD_BLOCK, BM=1, BN=kw["BN"], PAGE=cache.shape[1], PREC="tf32", DECODE=True, PDL=0,
                num_warps=kw["nw"], num_stages=kw["st"])
        elif kind == "tma":
            _mla_tma[(triton.cdiv(H, 16), B)](
                q_lat, q_rope, lat_desc, rope_desc, cache, o, bt, seq, scale, H, *common, C=C, R=R, BH=16, PAGE=PAGE,
                PAIR=kw["pair"], TMA=True, num_warps=kw["nw"], num_stages=kw["st"])
        elif kind == "swap_tma":
            _mla_swap_tma[(triton.cdiv(H, 16), B)](
                q_lat, q_rope, lat_desc, rope_desc, cache, o, bt, seq, scale, H, *common, C=C, R=R, BH=16,
                PAGE=cache.shape[1], WS=False, NS=kw["st"], num_warps=kw["nw"], num_stages=kw["st"])
        else:
            kern = dict(swap=_mla_swap, swap2=_mla_swap2, cur2=_mla_cur2)[kind]
            kern[(triton.cdiv(H, 16), B)](q_lat, q_rope, cache, o, bt, seq, scale, H, *common, C=C, R=R, BH=16,
                                          BN=kw["BN"], PAGE=cache.shape[1], num_warps=kw["nw"],
                                          num_stages=kw["st"])

    rows = []
    for kind, kw in CASES:
        o = torch.empty_like(q_lat)
        try:
            us = graph_time_us(lambda kind=kind, kw=kw, o=o: launch(kind, kw, o))
        except Exception as e:  # noqa: BLE001 - shapes past shared memory fail to compile
            print(kind, B, kw, "failed:", str(e)[:200], flush=True)
            continue
        err = (o.float() - paged(kw.get("page", PAGE))[3].float()).abs().max().item()
        rows.append(dict(kind=kind, mode="l2" if l2 else "hbm", batch=B, heads=H, **{"page": PAGE, **kw}, us=us,
                         tbps=nbytes / us / 1e6, err=err))
        print(rows[-1], flush=True)
    return rows


CASES = ([("current", dict(BN=BN, nw=nw, st=st)) for BN, nw, st in ((32, 4, 2), (32, 4, 3), (64, 4, 3))]
         + [("current", dict(page=64, BN=BN, nw=4, st=st)) for BN, st in ((32, 2), (64, 2), (64, 3))]
         + [(name, dict(BN=BN, nw=4, st=st)) for name, BN, st in (("cur2", 32, 2), ("cur2", 64, 2), ("swap2", 64, 2))]
         + [("cur2", dict(page=64, BN=64, nw=4, st=st)) for st in (2, 3)]
         + [("swap_tma", dict(page=64, nw=4, st=st)) for st in (2, 3)])


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/kernels/mla_proto.py")
    ap.add_argument("output")
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--modes", nargs="+", default=["hbm", "l2"], choices=["hbm", "l2"],
                    help="l2: every sequence reads the same pages, from L2 (each kernel's ceiling where HBM is not "
                    "the limit)")
    ap.add_argument("--replot", action="store_true", help="draw the plot of the result at OUTPUT and stop")
    args = ap.parse_args()
    if args.replot:
        plot(load_result(args.output), os.path.splitext(args.output)[0] + ".png")
        return
    rows = [r for mode in args.modes for B in args.batches for r in run(B, args.heads, mode == "l2")]
    save_result(args.output, plot, rows=rows, gpu=torch.cuda.get_device_name(),
                command="python benchmarks/kernels/mla_proto.py " + " ".join(sys.argv[1:]),
                params=dict(heads=args.heads, context=CTX + 1, page=PAGE, latent=C, rope=R),
                note="latent decode attention: us per call inside a CUDA graph, the cache bytes' rate (tbps); mode "
                     "l2: every sequence reads the same pages; err: max abs difference to kernels/mla's own launch")


if __name__ == "__main__":
    main()
