"""Small fused kernels of the decoder layer (Triton). Each replaces a chain of torch ops that costs one launch per
op; their references are the torch code in moebius.layers (norm.py, rotary.py, attention.py, moe.py, sampler.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moebius.kernels import DEFAULT_KERNELS, KernelConfig
from moebius.kernels.pdl import enter, pdl, release, wait


@triton.jit
def _add_norm_row(x, R, W, Out, row, N, cols, m, eps, HAS_RES: tl.constexpr):
    """One row of rms_norm(residual + x) (residual updated in place), or of rms_norm(x)."""
    if HAS_RES:  # residual += x, rounded to the storage dtype like the unfused add
        x = (x.to(tl.float32) + tl.load(R + row * N + cols, mask=m, other=0.0).to(tl.float32)).to(R.dtype.element_ty)
        tl.store(R + row * N + cols, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / N
    y = (xf * tl.rsqrt(var + eps)).to(Out.dtype.element_ty)
    w = tl.load(W + cols, mask=m, other=0.0)
    tl.store(Out + row * N + cols, (w.to(tl.float32) * y.to(tl.float32)).to(Out.dtype.element_ty), mask=m)


@triton.jit
def _add_rmsnorm(X, R, W, Out, N, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    _add_norm_row(tl.load(X + row * N + cols, mask=m, other=0.0), R, W, Out, row, N, cols, m, eps, HAS_RES)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """rms_norm(residual + x) (residual updated in place), or rms_norm(x) without a residual. x: [T, N]."""
    out = torch.empty_like(x)
    T, N = x.shape
    if T:
        _add_rmsnorm[(T,)](x, residual if residual is not None else x, weight, out, N, eps,
                           HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(N), num_warps=4, **pdl(x, kc))
    return out


@triton.jit
def _pair_sum(Y, Ids, t, first, E, D, cols, m, K: tl.constexpr, BLOCK: tl.constexpr):
    """Columns `cols` of token t's sum over its local pairs' rows Y[t*K + k] (other rows were never written),
    float32 in k order."""
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(K):
        e = tl.load(Ids + t * K + k) - first
        ok = (e >= 0) & (e < E)
        # where(ok, m, False), not m & ok: the same mask, which Triton 3.9's interpreter rejects in the `&` form
        # (it splats the scalar comparison as an integer)
        acc += tl.load(Y + (t * K + k) * D + cols, mask=tl.where(ok, m, False), other=0.0).to(tl.float32)
    return acc


@triton.jit
def _pair_sum_plus(Y, Ids, Add, t, first, E, D, cols, m, K: tl.constexpr, BLOCK: tl.constexpr,
                   HAS_ADD: tl.constexpr, DT: tl.constexpr):
    """`_pair_sum` rounded once to DT, plus Add[t] (HAS_ADD: the shared experts' output) rounded again: the bits of
    the sum, then the unfused add."""
    y = _pair_sum(Y, Ids, t, first, E, D, cols, m, K, BLOCK).to(DT)
    if HAS_ADD:
        y = (y.to(tl.float32) + tl.load(Add + t * D + cols, mask=m, other=0.0).to(tl.float32)).to(DT)
    return y


def _check_add(add_TD: torch.Tensor | None, T: int, D: int, what: str) -> None:
    if add_TD is not None and not (add_TD.shape == (T, D) and add_TD.is_contiguous()):
        raise ValueError(f"{what} adds a contiguous [{T}, {D}] tensor, not {tuple(add_TD.shape)}")


@triton.jit
def _sum_k_add_rmsnorm(Y, Ids, Add, R, W, Out, first, E, N, eps, K: tl.constexpr, HAS_ADD: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Token t: its local pairs summed (rounded once, as `_sum_k`), plus Add[t] (HAS_ADD, rounded again, as
    `_sum_k`'s), added to the residual and normed (as `_add_rmsnorm`)."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    _add_norm_row(_pair_sum_plus(Y, Ids, Add, t, first, E, N, cols, m, K, BLOCK, HAS_ADD, Y.dtype.element_ty), R,
                  W, Out, t, N, cols, m, eps, True)


def sum_k_add_rmsnorm(y_ND: torch.Tensor, ids_TK: torch.Tensor, first_expert: int, E: int, residual: torch.Tensor,
                      weight: torch.Tensor, eps: float, add_TD: torch.Tensor | None = None, *,
                      kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """`sum_k` (with add_TD where given) then `add_rmsnorm` in one launch (`PairRows.add_rms_norm`), bit for bit:
    the per-token sum never goes through memory (at 8k tokens the two launches read and wrote it once more each)."""
    T, K = ids_TK.shape
    N = y_ND.shape[1]
    out = torch.empty(T, N, dtype=y_ND.dtype, device=y_ND.device)
    _check_add(add_TD, T, N, "sum_k_add_rmsnorm")
    if T:
        _sum_k_add_rmsnorm[(T,)](y_ND, ids_TK, y_ND if add_TD is None else add_TD, residual, weight, out,
                                 first_expert, E, N, eps, K=K, HAS_ADD=add_TD is not None,
                                 BLOCK=triton.next_power_of_2(N), num_warps=4, **pdl(y_ND, kc))
    return out


@triton.jit
def _qk_heads(QKV, QN, KN, Rope, Pos, Slots, Cache, QOut, t, h, eps, H, KVH, stride_t, stride_qt, stride_qh, stride_pg,
              stride_kv, stride_tok, stride_hd, PAGE: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr = True):
    """Rows (token t, head h) (vectors; q heads below H, then k heads; other rows are skipped) of the fused qkv
    projection: RMSNorm with q_norm / k_norm (NORM; QN, KN unread without), RoPE at the token's position; q heads to
    QOut, k heads and their v to the paged cache at the token's slot."""
    half = tl.arange(0, D // 2)
    t2 = t[:, None]
    is_q = (h < H)[:, None]
    is_k = ((h >= H) & (h < H + KVH))[:, None]
    base = QKV + t2 * stride_t + h[:, None] * D + half[None, :]
    x1 = tl.load(base, mask=is_q | is_k, other=0.0).to(tl.float32)
    x2 = tl.load(base + D // 2, mask=is_q | is_k, other=0.0).to(tl.float32)
    dt = QOut.dtype.element_ty
    if NORM:
        var = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D
        r = tl.rsqrt(var + eps)[:, None]
        w1 = tl.where(is_q, tl.load(QN + half)[None, :], tl.load(KN + half)[None, :]).to(tl.float32)
        w2 = tl.where(is_q, tl.load(QN + D // 2 + half)[None, :], tl.load(KN + D // 2 + half)[None, :]).to(tl.float32)
        n1 = (w1 * (x1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        n2 = (w2 * (x2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    else:
        n1, n2 = x1, x2
    pos = tl.load(Pos + t)[:, None]
    cos = tl.load(Rope + pos * D + half[None, :]).to(dt).to(tl.float32)
    sin = tl.load(Rope + pos * D + D // 2 + half[None, :]).to(dt).to(tl.float32)
    o1 = (n1 * cos - n2 * sin).to(dt)
    o2 = (n2 * cos + n1 * sin).to(dt)
    qo = QOut + t2 * stride_qt + h[:, None] * stride_qh + half[None, :]
    tl.store(qo, o1, mask=is_q)
    tl.store(qo + D // 2, o2, mask=is_q)
    kh = (h - H)[:, None]
    slot = tl.load(Slots + t)[:, None]
    dst = Cache + (slot // PAGE) * stride_pg + (slot % PAGE) * stride_tok + kh * stride_hd + half[None, :]
    tl.store(dst, o1, mask=is_k)
    tl.store(dst + D // 2, o2, mask=is_k)
    v = QKV + t2 * stride_t + (H + KVH + kh) * D + half[None, :]
    tl.store(dst + stride_kv, tl.load(v, mask=is_k), mask=is_k)
    tl.store(dst + stride_kv + D // 2, tl.load(v + D // 2, mask=is_k), mask=is_k)


# T unspecialized: one variant for every step's token count (Triton would otherwise compile another where T happens to
# be a multiple of 16, which the start-up warm-up's token counts need not all have met)
@triton.jit(do_not_specialize=["T"])
def _qk_norm_rope_kv(QKV, QN, KN, Rope, Pos, Slots, Cache, QOut, eps, T, H, KVH, stride_t, stride_pg, stride_kv,
                     stride_tok, stride_hd, PAGE: tl.constexpr, D: tl.constexpr, R: tl.constexpr, NORM: tl.constexpr,
                     PDL: tl.constexpr):
    """R consecutive (token, head) rows of the T x (H + KVH) that carry a q or k head: no program holds padding
    heads (a token's 36 heads padded to 64 left 28 of every 64 rows of a token-per-program launch idle)."""
    enter(PDL)
    g = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    heads = H + KVH
    ok = g < T * heads
    t = tl.where(ok, g // heads, 0)
    h = tl.where(ok, g % heads, heads)  # heads: no head
    _qk_heads(QKV, QN, KN, Rope, Pos, Slots, Cache, QOut, t, h, eps, H, KVH, stride_t, H * D, D, stride_pg,
              stride_kv, stride_tok, stride_hd, PAGE, D, NORM)


# (token, head) rows a program of qk_norm_rope_kv, on 4 warps: on H200 faster than the launch it replaced (a token's
# heads padded to a power of two per program) from 256 tokens at the 30B shapes, and near the best of the rows x
# warps searched (a scratch A/B, docs/performance-history.md "q/k norm + RoPE rows"; against one row a program:
# benchmarks/results/h200-qk-rows.json).
QK_ROWS = 16


def qk_norm_rope_kv(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, rope: torch.Tensor,
                    positions: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor, num_heads: int, eps: float, *,
                    kc: KernelConfig = DEFAULT_KERNELS, out: torch.Tensor | None = None) -> torch.Tensor:
    """From the fused qkv projection [T, (H + 2 kvH) d]: per-head RMSNorm of q and k (none where q_norm is None),
    RoPE, k and v written into the paged cache at `slots`; returns q [T, H, d] (in `out` when given: contiguous)."""
    T = qkv.shape[0]
    kvh, D = cache.shape[3], cache.shape[4]
    q = torch.empty(T, num_heads, D, dtype=qkv.dtype, device=qkv.device) if out is None else out
    if T:
        rows = T * (num_heads + kvh)
        _qk_norm_rope_kv[(triton.cdiv(rows, QK_ROWS),)](
            qkv, qkv if q_norm is None else q_norm, qkv if k_norm is None else k_norm, rope, positions, slots, cache,
            q, eps, T, num_heads, kvh, qkv.stride(0), cache.stride(0), cache.stride(1), cache.stride(2),
            cache.stride(3), PAGE=cache.shape[2], D=D, R=QK_ROWS, NORM=q_norm is not None, num_warps=4,
            **pdl(qkv, kc))
    return q


@triton.jit
def _router_partials(X, Wg, Part, T, E, K, stride_x, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     PDL: tl.constexpr):
    """Router logits of up to BT tokens, split over K: program (n, s) writes the float32 partial of experts
    n*BN.. over inputs s*BK.. to Part[s, t, e]."""
    release(PDL)
    rt = tl.arange(0, BT)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mt, mn, mk = rt < T, rn < E, rk < K
    # the router's weights before waiting for the kernel before (which writes only X): their load overlaps it
    w = tl.load(Wg + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
    wait(PDL)
    x = tl.load(X + rt[:, None] * stride_x + rk[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
    acc = tl.dot(x, tl.trans(w))
    tl.store(Part + (tl.program_id(1) * T + rt[:, None]) * E + rn[None, :], acc, mask=mt[:, None] & mn[None, :])


@triton.jit
def _topk_softmax(Logits, W, Ids, T, E, K: tl.constexpr, NORM: tl.constexpr, SPLITS: tl.constexpr,
                  BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Logits [T, E], or (SPLITS > 0) float32 partials [SPLITS, T, E] summed in order and rounded to W's dtype,
    as a GEMM writing W's dtype rounds its float32 sums."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK)
    m = e < E
    if SPLITS == 0:
        x = tl.load(Logits + t * E + e, mask=m, other=float("-inf")).to(tl.float32)
    else:
        x = tl.zeros([BLOCK], tl.float32)
        for s in tl.static_range(SPLITS):
            x += tl.load(Logits + (s * T + t) * E + e, mask=m, other=0.0)
        x = tl.where(m, x.to(W.dtype.element_ty).to(tl.float32), float("-inf"))
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    p = tl.where(m, p, -1.0)
    scale = 1.0
    if NORM:  # a first pass for the sum of the top k, so each weight is stored once, already in W's dtype
        q = p
        total = 0.0
        for _ in tl.static_range(K):
            i = tl.argmax(q, 0)
            total += tl.max(q, 0)
            q = tl.where(e == i, -1.0, q)
        scale = 1.0 / total
    for k in tl.static_range(K):
        i = tl.argmax(p, 0)
        v = tl.max(p, 0)
        tl.store(Ids + t * K + k, i.to(tl.int64))
        tl.store(W + t * K + k, (v * scale).to(W.dtype.element_ty))
        p = tl.where(e == i, -1.0, p)


def _topk(logits: torch.Tensor, T: int, E: int, splits: int, top_k: int, norm: bool, out_dtype: torch.dtype,
          kc: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.empty(T, top_k, dtype=out_dtype, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T:
        # one warp per token: the top-k loop is a chain of small reductions, cheapest within a warp
        _topk_softmax[(T,)](logits, w, ids, T, E, K=top_k, NORM=norm, SPLITS=splits,
                            BLOCK=triton.next_power_of_2(E), num_warps=1, **pdl(logits, kc))
    return w, ids


def topk_softmax(logits_TE: torch.Tensor, top_k: int, norm: bool, out_dtype: torch.dtype = torch.float32, *,
                 kc: KernelConfig = DEFAULT_KERNELS) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (float32), top-k, optional renormalisation: (weights [T, K] in out_dtype, ids [T, K])."""
    T, E = logits_TE.shape
    return _topk(logits_TE, T, E, 0, top_k, norm, out_dtype, kc)


@triton.jit
def _grouped_topk(Logits, Bias, W, Ids, T, E, SPLITS, scale, K: tl.constexpr, SIGMOID: tl.constexpr,
                  HAS_BIAS: tl.constexpr, G: tl.constexpr, TG: tl.constexpr, TOP2: tl.constexpr, NORM: tl.constexpr,
                  BLOCK: tl.constexpr, GP: tl.constexpr, PDL: tl.constexpr):
    """Program t: DeepSeek's / GLM-4.5's routing of one token from its float32 logits (`grouped_moe.route`, its torch
    statement): scores (sigmoid or softmax), the choice (the scores plus the correction bias), the TG best of G
    groups kept (each scored by its best choice, or TOP2 its best two), the others' experts masked (-inf, or 0 for
    softmax scores), the top K of the choice, their unbiased scores renormalised (NORM) and scaled."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK)
    m = e < E
    x = tl.load(Logits + t * E + e, mask=m, other=float("-inf"))
    for s in range(1, SPLITS):  # split-K partials [SPLITS, T, E] (`router_partials_f32`), summed in order
        x += tl.load(Logits + (s * T + t) * E + e, mask=m, other=0.0)
    if SIGMOID:
        scores = tl.where(m, 1.0 / (1.0 + tl.exp(-x)), 0.0)
    else:
        p = tl.exp(x - tl.max(x, 0))
        scores = p / tl.sum(p, 0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(Bias + e, mask=m, other=0.0)
    choice = tl.where(m, choice, float("-inf"))
    if TG < G:  # (keeping every group masks nothing)
        grp = e // (E // G)
        gi = tl.arange(0, GP)
        gscore = tl.full([GP], float("-inf"), tl.float32)
        for g in tl.static_range(G):
            c = tl.where(m & (grp == g), choice, float("-inf"))
            best = tl.max(c, 0)
            if TOP2:
                best += tl.max(tl.where(e == tl.argmax(c, 0), float("-inf"), c), 0)
            gscore = tl.where(gi == g, best, gscore)
        keep = tl.zeros([BLOCK], tl.int1)
        for _ in tl.static_range(TG):
            g = tl.argmax(gscore, 0)
            keep = keep | (grp == g)
            gscore = tl.where(gi == g, float("-inf"), gscore)
        if TOP2:
            choice = tl.where(keep, choice, float("-inf"))
        else:  # (softmax scores are positive: a masked expert at 0 is never picked while kept ones remain)
            choice = tl.where(keep | ~m, choice, 0.0)
    total = 0.0
    if NORM:  # a first pass for the sum of the top k, so each weight is stored once
        q = choice
        for _ in tl.static_range(K):
            i = tl.argmax(q, 0)
            total += tl.sum(tl.where(e == i, scores, 0.0), 0)
            q = tl.where(e == i, float("-inf"), q)
    for k in tl.static_range(K):
        i = tl.argmax(choice, 0)
        w = tl.sum(tl.where(e == i, scores, 0.0), 0)
        if NORM:
            w = w / (total + 1e-20)
        tl.store(Ids + t * K + k, i.to(tl.int64))
        tl.store(W + t * K + k, w * scale)
        choice = tl.where(e == i, float("-inf"), choice)


def grouped_topk(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, top_k: int, sigmoid: bool, n_group: int,
                 topk_group: int, top2: bool, norm: bool, scale: float, *, kc: KernelConfig = DEFAULT_KERNELS
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`models/grouped_moe.route` from float32 logits [T, E], or split-K partials of them [S, T, E]
    (`router_partials_f32`, summed in order first), in one launch: (weights [T, K] float32, ids [T, K] int64), each
    token's ids in descending order of choice."""
    part = logits_TE if logits_TE.dim() == 3 else logits_TE[None]
    S, T, E = part.shape
    if not part.is_contiguous() or part.dtype != torch.float32:
        raise ValueError(f"grouped_topk reads contiguous float32 logits, not {part.dtype} of strides {part.stride()}")
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits_TE.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits_TE.device)
    if T:
        _grouped_topk[(T,)](part, part if bias_E is None else bias_E, w, ids, T, E, S, scale, K=top_k,
                            SIGMOID=sigmoid, HAS_BIAS=bias_E is not None, G=n_group, TG=topk_group, TOP2=top2,
                            NORM=norm, BLOCK=triton.next_power_of_2(E), GP=triton.next_power_of_2(n_group),
                            num_warps=1 if E <= 256 else 2, **pdl(part, kc))
    return w, ids


@triton.jit
def _router_f32(X, Wg, Part, T, E, D, KPER, stride_x, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                PREC: tl.constexpr, PDL: tl.constexpr):
    """Program (i, n, s): float32 router logits of tokens i*BT.. over experts n*BN.., summed over inputs s*KPER ..
    (s+1)*KPER, to Part[s, t, e]: x upcast exactly, dots of precision PREC ("ieee", or "tf32x3": three TF32
    products, float32's precision to a few ulps; plain TF32 would round the router's weights to 10 bits)."""
    enter(PDL)
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mt, mn = rt < T, rn < E
    acc = tl.zeros([BT, BN], tl.float32)
    start = tl.program_id(2) * KPER
    for k0 in range(start, start + KPER, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < D
        x = tl.load(X + rt[:, None].to(tl.int64) * stride_x + rk[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        w = tl.load(Wg + rn[:, None].to(tl.int64) * D + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision=PREC)
    tl.store(Part + (tl.program_id(2) * T + rt[:, None]) * E + rn[None, :], acc, mask=mt[:, None] & mn[None, :])


@dataclass(frozen=True)
class RouterLaunch:
    """`_router_f32`'s launch: token and expert tile (BT at most T's power of two, 16 the least), input chunk, split-K
    until about `programs` programs (cuBLAS's float32 GEMM ran a few tiles on a few SMs), dot precision, warps."""

    BT: int = 64
    BN: int = 64
    BK: int = 64
    programs: int = 256
    # IEEE float32 dots run on the CUDA cores, no faster than cuBLAS (benchmarks/results/
    # h100-p1-decode-profile-deepseek-1024.json); TF32x3's on the tensor cores (benchmarks/results/
    # h100-p1-router-tune.json)
    precision: str = "tf32x3"
    num_warps: int = 4


ROUTER_F32 = RouterLaunch()


def router_partials_f32(x_TD: torch.Tensor, gate_ED: torch.Tensor, *, launch: RouterLaunch = ROUTER_F32,
                        kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """models/grouped_moe.router_logits (x upcast, times the float32 router) as split-K partials [S, T, E] that
    `grouped_topk` sums: one launch, no float32 copy of x."""
    T, D = x_TD.shape
    E = gate_ED.shape[0]
    if x_TD.stride(1) != 1 or not gate_ED.is_contiguous() or gate_ED.dtype != torch.float32:
        raise ValueError("router_partials_f32 takes rows of x with unit column stride and a contiguous float32 router")
    BT, BN, BK = min(launch.BT, max(16, triton.next_power_of_2(T))), launch.BN, launch.BK
    tiles = max(1, triton.cdiv(T, BT) * triton.cdiv(E, BN))  # (a rank may route no tokens in EP)
    chunks = triton.cdiv(D, BK)
    per = triton.cdiv(chunks, max(1, min(chunks, launch.programs // tiles)))
    S = triton.cdiv(chunks, per)
    part = torch.empty(S, T, E, dtype=torch.float32, device=x_TD.device)
    if T:
        _router_f32[(triton.cdiv(T, BT), triton.cdiv(E, BN), S)](
            x_TD, gate_ED, part, T, E, D, per * BK, x_TD.stride(0), BT=BT, BN=BN, BK=BK, PREC=launch.precision,
            num_warps=launch.num_warps, **pdl(x_TD, kc))
    return part


ROUTER_MAX_ROWS = 16  # one tl.dot row tile; more tokens: cuBLAS then topk_softmax
ROUTER_BK = 256


def router_fits(x_TD: torch.Tensor, gate_ED: torch.Tensor) -> bool:
    return (x_TD.shape[0] <= ROUTER_MAX_ROWS and x_TD.stride(1) == 1 and gate_ED.is_contiguous()
            and x_TD.dtype == gate_ED.dtype and x_TD.dtype in (torch.bfloat16, torch.float16))


def route(x_TD: torch.Tensor, gate_ED: torch.Tensor, top_k: int, norm: bool, *, kc: KernelConfig = DEFAULT_KERNELS
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """moebius.layers.moe.route for up to ROUTER_MAX_ROWS tokens (`router_fits`): the logits as float32 partials
    over K-slices from many programs (cuBLAS's tiles leave most SMs idle on this small weight at a few tokens),
    summed in order and rounded by the top-k kernel."""
    T, D = x_TD.shape
    E = gate_ED.shape[0]
    splits = triton.cdiv(D, ROUTER_BK)
    part = torch.empty(splits, T, E, dtype=torch.float32, device=x_TD.device)
    if T:
        BN = 16
        _router_partials[(triton.cdiv(E, BN), splits)](x_TD, gate_ED, part, T, E, D, x_TD.stride(0),
                                                       BT=ROUTER_MAX_ROWS, BN=BN, BK=ROUTER_BK, num_warps=4,
                                                       **pdl(x_TD, kc))
    return _topk(part, T, E, splits, top_k, norm, x_TD.dtype, kc)


@triton.jit(do_not_specialize=["CHUNKS"])  # a count by the step's rows: one variant for all
def _argmax_keys(Scores, Keys, V, stride, first, CHUNKS, BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * CHUNKS * BLOCK
    lane = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    at = start + lane  # per lane: the first of its equal maxima (strict > below)
    for c in range(CHUNKS):
        v = start + c * BLOCK + lane
        x = tl.load(Scores + t * stride + v, mask=v < V, other=float("-inf")).to(tl.float32) + 0.0  # -0.0 -> +0.0
        at = tl.where(x > best, v, at)
        best = tl.maximum(best, x)
    m = tl.max(best, 0)
    i = tl.min(tl.where(best == m, at, 2147483647), 0)
    bits = m.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)  # int order = float order
    low = tl.full([], 0xFFFFFFFF, tl.int64) - (i + first).to(tl.int64)
    # relaxed: nothing in this launch reads the keys after (the default acq_rel fences every program's end)
    tl.atomic_max(Keys + t, (ordered << 32) | low, sem="relaxed")


def argmax_keys(scores_TV: torch.Tensor, first: int, *, kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """moebius.layers.sampler.argmax_keys: a row's vocabulary in parts side by side, each program keeping a best
    per lane over its part (torch's reductions take one block per row at decode sizes, so a vocabulary-wide row
    runs on one SM)."""
    T, V = scores_TV.shape
    keys = torch.full((T,), -(2 ** 63), dtype=torch.int64, device=scores_TV.device)
    if T:
        BLOCK = 2048
        chunks = triton.cdiv(V, BLOCK)
        parts = max(1, min(chunks, 2048 // T))  # ~2k programs in all
        per = triton.cdiv(chunks, parts)
        _argmax_keys[(T, triton.cdiv(chunks, per))](scores_TV, keys, V, scores_TV.stride(0), first, per,
                                                    BLOCK=BLOCK, num_warps=8, **pdl(scores_TV, kc))
    return keys


@triton.jit
def _sum_k(Y, Ids, Add, Out, first, E, D, K: tl.constexpr, BD: tl.constexpr, HAS_ADD: tl.constexpr,
           PDL: tl.constexpr):
    """Out[t] = sum of Y[t*K + k] over the local pairs of token t (other rows were never written), plus Add[t]."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cm = cols < D
    y = _pair_sum_plus(Y, Ids, Add, t, first, E, D, cols, cm, K, BD, HAS_ADD, Out.dtype.element_ty)
    tl.store(Out + t * D + cols, y, mask=cm)


def sum_k(y_ND: torch.Tensor, ids_TK: torch.Tensor, first_expert: int, E: int, add_TD: torch.Tensor | None = None, *,
          kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """The fused MoE's last launch (kernels/fused_moe.py; `PairRows.sum`): [T, D], each token's sum over its pairs'
    rows y_ND[t * K + k] whose expert is one of the E local ones from first_expert, float32 in k order, rounded once;
    plus add_TD (the shared experts' output), rounded again, where given: the bits of `sum_k(...) + add_TD`."""
    T, K = ids_TK.shape
    D = y_ND.shape[1]
    out = torch.empty(T, D, dtype=y_ND.dtype, device=y_ND.device)
    BD = min(1024, triton.next_power_of_2(D))
    _check_add(add_TD, T, D, "sum_k")
    _sum_k[(T, triton.cdiv(D, BD))](y_ND, ids_TK, y_ND if add_TD is None else add_TD, out, first_expert, E, D, K=K,
                                    BD=BD, HAS_ADD=add_TD is not None, num_warps=4, **pdl(y_ND, kc))
    return out


@triton.jit
def silu_mul(g, u, DT: tl.constexpr):
    """silu(g) * u in float32 of g and u held in DT, rounded where torch's two launches round: silu's output (to DT),
    then the product (the caller stores it in DT). The fused MoE's gate_up launch computes it too."""
    return (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32) * u


@triton.jit
def _swiglu(H, Out, F, stride_h, BF: tl.constexpr, PDL: tl.constexpr):
    """Out[t] = silu(H[t, :F]) * H[t, F:], rounded where torch's two launches round: silu's output, the product."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BF + tl.arange(0, BF)
    m = cols < F
    g = tl.load(H + t * stride_h + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(H + t * stride_h + F + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(Out + t * F + cols, silu_mul(g, u, Out.dtype.element_ty).to(Out.dtype.element_ty), mask=m)


def swiglu(h_TF2: torch.Tensor, *, kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """moebius.layers.moe.swiglu in one launch (torch's silu and product are two, each over strided halves): [T, F]
    from rows [T, 2F] of [gate | up]."""
    T, F2 = h_TF2.shape
    F = F2 // 2
    if F2 % 2 or h_TF2.stride(1) != 1:
        raise ValueError(f"swiglu takes rows [gate | up] with unit column stride, not {tuple(h_TF2.shape)}")
    out = torch.empty(T, F, dtype=h_TF2.dtype, device=h_TF2.device)
    BF = min(1024, triton.next_power_of_2(F))
    if T:
        _swiglu[(T, triton.cdiv(F, BF))](h_TF2, out, F, h_TF2.stride(0), BF=BF, num_warps=4, **pdl(h_TF2, kc))
    return out
