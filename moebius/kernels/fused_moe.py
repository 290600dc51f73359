"""Fused MoE in Triton: (token, k) pairs grouped by expert into BM-row blocks; one kernel computes each block's
gate and up projections with SwiGLU applied on the way out, a second the down projection scaled by the routing
weight; a sum over k finishes. Each block reads only its expert's weights, so a decode batch that hits 8 experts
reads 8 experts. Everything stays on the device (grid sizes are upper bounds fixed by the pair count), so it runs
inside CUDA graphs. The torch reference is `moebius.layers.moe.experts_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def align(ids_TK: torch.Tensor, first_expert: int, E: int, BM: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Group the pairs by local expert in blocks of BM rows. Returns (sorted pair ids [max_rows], padded with N;
    expert of each block [max_blocks], E for unused blocks; max_blocks)."""
    N = ids_TK.numel()
    dev = ids_TK.device
    local = ids_TK.flatten() - first_expert
    valid = (local >= 0) & (local < E)
    key = torch.where(valid, local, E)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:E] + BM - 1) // BM * BM
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(key, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(N, device=dev)
    first = torch.cumsum(counts, 0) - counts  # first sorted index of each key
    starts = ends - padded
    max_blocks = (N + E * (BM - 1)) // BM + 1
    dest = torch.where(valid, starts[key.clamp(max=E - 1)] + rank - first[key], max_blocks * BM)
    sorted_ids = torch.full((max_blocks * BM + 1,), N, dtype=torch.int64, device=dev)
    sorted_ids.scatter_(0, dest, torch.arange(N, device=dev))
    block_start = torch.arange(max_blocks, device=dev) * BM
    block_expert = torch.searchsorted(ends, block_start, right=True)
    return sorted_ids[: max_blocks * BM], block_expert, max_blocks


@triton.jit
def _gate_up_silu(X, W13, SortedIds, BlockExpert, Out, N, D, I, E, K_TOP: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr):
    blk = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(BlockExpert + blk)
    if e < E:  # blocks past the last expert's are padding
        rows = blk * BM + tl.arange(0, BM)
        pair = tl.load(SortedIds + rows)
        ok = pair < N
        tok = tl.where(ok, pair // K_TOP, 0).to(tl.int64)
        n = nb * BN + tl.arange(0, BN)
        nm = n < I
        kk = tl.arange(0, BK)
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        wbase = W13 + e.to(tl.int64) * 2 * I * D
        for k0 in range(0, D, BK):
            km = k0 + kk < D
            a = tl.load(X + tok[:, None] * D + (k0 + kk)[None, :], mask=ok[:, None] & km[None, :], other=0.0)
            g = tl.load(wbase + n[:, None] * D + (k0 + kk)[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            u = tl.load(wbase + (I + n)[:, None] * D + (k0 + kk)[None, :], mask=nm[:, None] & km[None, :],
                        other=0.0)
            acc_g = tl.dot(a, tl.trans(g), acc_g)
            acc_u = tl.dot(a, tl.trans(u), acc_u)
        gb = acc_g.to(Out.dtype.element_ty).to(tl.float32)  # round like the unfused bf16 GEMM output
        ub = acc_u.to(Out.dtype.element_ty).to(tl.float32)
        h = (gb / (1.0 + tl.exp(-gb))).to(Out.dtype.element_ty).to(tl.float32) * ub
        tl.store(Out + rows.to(tl.int64)[:, None] * I + n[None, :], h.to(Out.dtype.element_ty),
                 mask=ok[:, None] & nm[None, :])


@triton.jit
def _down(H, W2, SortedIds, BlockExpert, RouteW, Out, N, D, I, E, BM: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr):
    blk = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(BlockExpert + blk)
    if e < E:
        rows = blk * BM + tl.arange(0, BM)
        pair = tl.load(SortedIds + rows)
        ok = pair < N
        n = nb * BN + tl.arange(0, BN)
        nm = n < D
        kk = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], tl.float32)
        wbase = W2 + e.to(tl.int64) * D * I
        for k0 in range(0, I, BK):
            km = k0 + kk < I
            a = tl.load(H + rows.to(tl.int64)[:, None] * I + (k0 + kk)[None, :], mask=ok[:, None] & km[None, :],
                        other=0.0)
            b = tl.load(wbase + n[:, None] * I + (k0 + kk)[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
        w = tl.load(RouteW + tl.where(ok, pair, 0), mask=ok, other=0.0).to(tl.float32)
        y = acc.to(Out.dtype.element_ty).to(tl.float32) * w[:, None]
        tl.store(Out + tl.where(ok, pair, 0).to(tl.int64)[:, None] * D + n[None, :], y.to(Out.dtype.element_ty),
                 mask=ok[:, None] & nm[None, :])


def fused_experts(x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor, w13_EFD: torch.Tensor,
                  w2_EDF: torch.Tensor, first_expert: int) -> torch.Tensor:
    T, D = x_TD.shape
    K = ids_TK.shape[1]
    E, F, _ = w13_EFD.shape
    I = F // 2
    N = T * K
    if N == 0:
        return torch.zeros_like(x_TD)
    BM = 16 if N <= 1024 else 64
    sorted_ids, block_expert, max_blocks = align(ids_TK, first_expert, E, BM)
    h = torch.empty(max_blocks * BM, I, dtype=x_TD.dtype, device=x_TD.device)
    BN, BK = 64, 128
    _gate_up_silu[(max_blocks, triton.cdiv(I, BN))](x_TD, w13_EFD, sorted_ids, block_expert, h, N, D, I, E,
                                                      K_TOP=K, BM=BM, BN=BN, BK=BK, num_warps=4)
    out = torch.zeros(N, D, dtype=x_TD.dtype, device=x_TD.device)
    _down[(max_blocks, triton.cdiv(D, BN))](h, w2_EDF, sorted_ids, block_expert, w_TK.reshape(-1).contiguous(), out,
                                             N, D, I, E, BM=BM, BN=BN, BK=BK, num_warps=4)
    return out.view(T, K, D).sum(1, dtype=torch.float32).to(x_TD.dtype)
