"""Prototype latent decode kernels (DeepSeek-V2-Lite's 16 heads, context 1024) against kernels/mla's in the same
call, all one kernel, `_mla_paged`: `cur2` (kernels/mla's layout, heads as the MMA's rows, with whole tiles unmasked
and each row's address its page's base plus offsets fixed for the launch), `swap2` (the same addressing, the keys as
the rows: a warpgroup MMA from 64 keys), `swap_tma` (keys as rows over pages of 64 keys, each page one TMA load).
--modes l2: every sequence reads the same pages, from L2: each kernel's ceiling where HBM is not the limit (an H200's
bandwidth is over an H100's kernel rate). Results: benchmarks/results/h100-p1-mla-variants*.json (the b05ee39
record's `tma` and `swap` rows: kernels of this script at 32e6972, since dropped), docs/performance.md.
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
def _tile(q_lat, q_rope, lat, rope, m_i, l_i, acc, scale2, jv, MASK: tl.constexpr, SWAP: tl.constexpr):
    """One tile of the online softmax (base 2): heads as the MMA's rows (q [BH, C], acc [BH, C]), or SWAP the keys
    (q^T [C, BH], acc^T [C, BH]: a warpgroup MMA from 64 keys)."""
    if SWAP:
        s = tl.dot(lat, q_lat) + tl.dot(rope, q_rope)
        if MASK:
            s = tl.where(jv[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0) * scale2)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s * scale2 - m_safe[None, :])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(lat), p.to(lat.dtype))
    else:  # kernels/mla's layout and step
        s = tl.dot(q_lat, tl.trans(lat)) + tl.dot(q_rope, tl.trans(rope))
        if MASK:
            s = tl.where(jv[None, :], s, float("-inf"))
        m_new, l_i, acc = M._softmax_step(s, lat, m_i, l_i, acc, scale2, "tf32")
    return m_new, l_i, acc


@triton.jit
def _mla_paged(QLat, QRope, LatDesc, RopeDesc, Cache, Out, BlockTables, SeqLens, scale, H,
               stride_lt, stride_lh, stride_rt, stride_rh, stride_ot, stride_oh, stride_pg, stride_tok, stride_bt,
               C: tl.constexpr, R: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, PAGE: tl.constexpr,
               SWAP: tl.constexpr, TMA: tl.constexpr):
    """Program (head block, sequence): whole BN-key tiles unmasked, each row's address its page's base plus offsets
    fixed for the launch (`_mla_cur2`: heads as rows; `_mla_swap2`: SWAP, keys as rows), or (TMA, BN == PAGE) each
    whole page one TMA load (`_mla_swap_tma`); the last, partial tile through masked pointers."""
    hblk = tl.program_id(0)
    b = tl.program_id(1)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    h = hblk * BH + tl.arange(0, BH)
    hv = h < H
    c = tl.arange(0, C)
    r = tl.arange(0, R)
    if SWAP:  # q^T, acc^T
        q_lat = tl.load(QLat + b * stride_lt + h[None, :] * stride_lh + c[:, None], mask=hv[None, :], other=0.0)
        q_rope = tl.load(QRope + b * stride_rt + h[None, :] * stride_rh + r[:, None], mask=hv[None, :], other=0.0)
        acc = tl.zeros([C, BH], tl.float32)
    else:
        q_lat = tl.load(QLat + b * stride_lt + h[:, None] * stride_lh + c[None, :], mask=hv[:, None], other=0.0)
        q_rope = tl.load(QRope + b * stride_rt + h[:, None] * stride_rh + r[None, :], mask=hv[:, None], other=0.0)
        acc = tl.zeros([BH, C], tl.float32)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    scale2 = scale * 1.4426950408889634
    t = tl.arange(0, BN)
    off_lat = (t % PAGE)[:, None] * stride_tok + c[None, :]
    off_rope = (t % PAGE)[:, None] * stride_tok + C + r[None, :]
    full = (seq_len - 1) // BN * BN  # whole tiles before the last (which may be partial)
    Table = BlockTables + b * stride_bt
    for start in range(0, full, BN):
        if TMA:
            pg = tl.load(Table + start // PAGE)
            lat = LatDesc.load([pg * PAGE, 0])
            rope = RopeDesc.load([pg * PAGE, C])
        else:
            base = Cache + tl.load(Table + (start + t) // PAGE).to(tl.int64) * stride_pg
            lat = tl.load(base[:, None] + off_lat)
            rope = tl.load(base[:, None] + off_rope)
        m_i, l_i, acc = _tile(q_lat, q_rope, lat, rope, m_i, l_i, acc, scale2, t, False, SWAP)
    # the last tile: keys past the sequence's end masked to 0 (an unwritten slot may hold NaN)
    j = full + t
    jv = j < seq_len
    base = Cache + tl.load(Table + j // PAGE, mask=jv, other=0).to(tl.int64) * stride_pg
    lat = tl.load(base[:, None] + off_lat, mask=jv[:, None], other=0.0)
    rope = tl.load(base[:, None] + off_rope, mask=jv[:, None], other=0.0)
    m_i, l_i, acc = _tile(q_lat, q_rope, lat, rope, m_i, l_i, acc, scale2, jv, True, SWAP)
    if SWAP:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[None, :]
        tl.store(Out + b * stride_ot + h[None, :] * stride_oh + c[:, None], out.to(Out.dtype.element_ty),
                 mask=hv[None, :])
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + b * stride_ot + h[:, None] * stride_oh + c[None, :], out.to(Out.dtype.element_ty),
                 mask=hv[:, None])


# the variants: (SWAP, TMA)
VARIANTS = {"cur2": (False, False), "swap2": (True, False), "swap_tma": (True, True)}


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
        else:
            swap, tma = VARIANTS[kind]
            _mla_paged[(triton.cdiv(H, 16), B)](
                q_lat, q_rope, lat_desc, rope_desc, cache, o, bt, seq, scale, H, *common, C=C, R=R, BH=16,
                BN=cache.shape[1] if tma else kw["BN"], PAGE=cache.shape[1], SWAP=swap, TMA=tma, num_warps=kw["nw"],
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
