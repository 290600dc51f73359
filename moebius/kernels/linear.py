"""Projections of a few rows (decode at a few tokens a rank), two kernels:
- one or two rows (`fits`, `linear`): each program holds BN whole weight rows in registers, loaded before it waits
  for the kernel before it (programmatic dependent launch, kernels/pdl.py), so the weight stream overlaps that kernel
  instead of following it. cuBLAS picks narrow column tiles here (few programs for a 30B TP qkv shard, most SMs
  idle) and starts only once the previous kernel has finished, so a projection takes several times what its weight
  bytes take of HBM. `fits` takes them only in the LATE release order (`KernelConfig.release`), which the runner
  picks for the steps that use them (`moebius.kernels.release_order_for`): in the EARLY one these programs sit on
  the SMs, registers full, while the expert kernels of the layer before still run.
- 3 to 32 rows (`fits_mma`, `linear_mma`): tensor-core tiles of MMA_BM weight rows against the rows (padded to 16
  or 32), K streamed through shared memory; launched with PDL like every kernel of the step, which cuBLAS is not.
  Their steps run in the LATE order too.
And FP8 rows (--quantization fp8, kernels/fp8_rows.py) at any row count (`linear_fp8`): the same tensor-core tiles,
so a projection reads its FP8 bytes once instead of a bf16 copy made for each call; one or two rows in the LATE order
as the first kernel does, weight rows in registers before the wait (`linear_fp8_rows`). By default each weight tile is
dequantized in registers as it is loaded (W8A16: `weight_tile`; the fused MoE's gate/up instead takes each chunk's
float8 values as float16 against x in float16 rows times a power of two a row, the block scales on the products:
`scaled_f16`, `fp8_chunk_product`); with kc.fp8_activations each 128-column group of a
row's activations is quantized to float8 with a scale of its own and the tensor cores take float8 on both sides
(W8A8: `quantize_act`, `fp8_dot`). The fused MoE reads its experts through the same helpers, and MXFP4 rows
(--quantization mxfp4, kernels/mxfp4_rows.py) through `mx4_dot` (W4A16: decode's codes in two dots a chunk, a
dequantized tile past 16 rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moebius import kernels
from moebius.kernels import DEFAULT_KERNELS, KernelConfig
from moebius.kernels.fp8_rows import CHUNK, packed_width, segment_chunks, widths
from moebius.kernels.pdl import enter, pdl, release, wait

# The weight formats `weight_tile` reads (a kernel's FMT constexpr; host code passes `.value`): plain values of the
# activations' dtype, FP8 rows (kernels/fp8_rows.py), MXFP4 rows (kernels/mxfp4_rows.py)
# FP8_ROWS: a segment a chunk; FP8_WHOLE: a row one segment, its values then its scales (kernels/fp8_rows.py)
PLAIN, FP8_ROWS, MXFP4_ROWS, FP8_WHOLE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
FP8_CHUNK = tl.constexpr(CHUNK)  # bytes of an FP8 row's 128-column chunk (a multiple of 16: aligned vector loads)

# Each row costs every program a cross-thread sum of BN x K products: from 4 rows cuBLAS was faster; 2 rows pay
# only at small weights (`kernels.prefetch_rows`; benchmarks/results/h200x2-prefetch-rows.json).
MAX_ROWS = kernels.PREFETCH_ROWS
# Weight elements a program holds: 32 KiB of bf16, ~100 registers a thread at 8 warps, so two programs fit an SM
# (twice that took one program an SM and more programs than SMs for a 30B TP qkv shard: slower steps;
# benchmarks/results/h200x2-linear-pdl.json).
TILE_ELEMS = 8 * 2048
MAX_K = 8192


def fp8_form(w: torch.Tensor, K: int) -> int:
    """FP8_ROWS or FP8_WHOLE: the layout of FP8 rows `w` holding K columns (`fp8_rows.segment_chunks`)."""
    return (FP8_WHOLE if segment_chunks(w.shape[-1], K) > 1 else FP8_ROWS).value


@triton.jit
def chunk_values(W, rows, rm, k0, K, WS, FMT: tl.constexpr):
    """The float8 values [rows, 128] of the chunk of columns k0 .. k0 + 128 (< K) of FP8 rows `rows` (mask rm) of WS
    bytes in layout FMT (FP8_ROWS or FP8_WHOLE, kernels/fp8_rows.py), as stored."""
    kk = tl.arange(0, 128)
    m = rm[:, None] & (k0 + kk < K)[None, :]
    if FMT == FP8_WHOLE:
        at = W + rows.to(tl.int64)[:, None] * WS + k0
    else:
        at = W + rows.to(tl.int64)[:, None] * WS + (k0 // 128) * FP8_CHUNK
    return tl.load(at + kk[None, :], mask=m, other=0).to(tl.float8e4nv, bitcast=True)


@triton.jit
def chunk_scales(W, rows, rm, k0, K, WS, FMT: tl.constexpr):
    """The float32 block scale [rows] of that chunk of each row: after its values (FP8_ROWS), or after the row's
    values with the other chunks' (FP8_WHOLE)."""
    if FMT == FP8_WHOLE:
        at = W + rows.to(tl.int64) * WS + tl.cdiv(K, 128) * 128 + (k0 // 128) * 4
    else:
        at = W + rows.to(tl.int64) * WS + (k0 // 128) * FP8_CHUNK + 128
    return tl.load(at.to(tl.pointer_type(tl.float32)), mask=rm, other=0.0)


@triton.jit
def tile_scale(W, row, k0, K, WS, FMT: tl.constexpr):
    """The float32 block scale (a scalar) of the chunk at column k0 of FP8 row `row`, laid out as `chunk_scales`
    reads it: a whole tile's where all its rows lie in one 128-row block (the fused MoE's: each expert's gate, up and
    down rows are blocks from their first row, `fp8_rows.pack_rows`), one load a K step where a scale a row in the
    dot's layout took one a row (a 64-column tile: 16 loads and their addresses a thread, and W8A8's 64-row gate/up
    spilled: tests/test_kernels_sm90.py)."""
    if FMT == FP8_WHOLE:
        at = W + row.to(tl.int64) * WS + tl.cdiv(K, 128) * 128 + (k0 // 128) * 4
    else:
        at = W + row.to(tl.int64) * WS + (k0 // 128) * FP8_CHUNK + 128
    return tl.load(at.to(tl.pointer_type(tl.float32)))


@triton.jit
def fp8_chunk_product(a, W, rows, rm, k0, K, WS, sw, FMT: tl.constexpr):
    """W8A16's product [BM, rows] of an activation tile a [BM, 128] (float16 rows of `scaled_f16`, or float32)
    and the chunk at column k0 of FP8 rows `rows` (mask rm) of WS bytes in layout FMT: the chunk's float8 values
    exactly in a's dtype (every float8 value is a float16 one: a conversion a pair of values, nothing else a value),
    the block scale sw (the tile's, `tile_scale`, which a caller loads a chunk ahead) on the float32 product. Half the
    instructions a value of a tile dequantized to bf16 as loaded (docs/performance.md)."""
    return tl.dot(a, tl.trans(chunk_values(W, rows, rm, k0, K, WS, FMT).to(a.dtype))) * sw


@triton.jit
def e2m1_f16(q):
    """float16 values of e2m1 codes q (int32, low 4 bits: sign bit 3, exponent bits 2..1, mantissa bit 0) times
    2^-14, exact: the code's bits in float16's places (exponent e, mantissa bit on top) make 2^(e - 15) * (1 + m / 2)
    and for e == 0 float16's subnormal m * 2^-15, e2m1's value times 2^-14 either way; -0.0 kept."""
    bits = ((q & 7) << 9) | ((q & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def mx4_pow2(s):
    """2^(s - 127) in float32 of MXFP4 scale bytes s (int32), built from their bits: exact, 2^-127 a subnormal."""
    return tl.where(s > 0, s << 23, 1 << 22).to(tl.float32, bitcast=True)


@triton.jit
def mx4_scale(W, rows, rm, col, K, WS):
    """The scale (`mx4_pow2`) in float32 [rows] of the chunk at column `col` (a multiple of 32) of MXFP4 rows `rows`
    (mask rm) of WS bytes; a chunk from K on reads 0."""
    s = tl.load(W + rows.to(tl.int64) * WS + col // 32 * 17 + 16, mask=rm & (col + 0 * rows < K), other=0)
    return mx4_pow2(s.to(tl.int32))


@triton.jit
def mx4_dot(X, xrows, xm, XS, W, rows, rm, k0, K, WS, acc, BK: tl.constexpr):
    """acc [xrows, rows] plus rows `xrows` (mask xm, row stride XS) of X times MXFP4 rows `rows` (mask rm) of WS
    bytes (kernels/mxfp4_rows.py) over columns k0 .. k0 + BK (k0 and BK multiples of 32: whole chunks; K whole
    chunks, those from K on left out). For 16 rows of X or fewer (decode) each code byte is read once: its low
    nibble holds an even column, its high one the odd column after, two tiles of e2m1 values (`e2m1_f16`: times
    2^-14) each in a dot with X's columns of that parity, and each chunk's 2^(scale - 127) (with the 2^14 back:
    exact, as `unpack_rows`) multiplies the float32 partial of its two dots. Larger blocks dequantize a tile
    (`mx4_tile`) into one dot: codes into dots took 1.4x its time at batch 256 (benchmarks/results/
    h100-p1-gpt-oss-20b-mxfp4-sweep-ab.json against -ab-41c9a22.json)."""
    if xrows.shape[0] <= 16:
        i = tl.arange(0, 16)
        for c in tl.static_range(BK // 32):
            col = k0 + c * 32
            cm = col + 2 * i < K  # (the chunk's, every column alike)
            xp = X + xrows.to(tl.int64)[:, None] * XS + (col + 2 * i)[None, :]
            x_lo = tl.load(xp, mask=xm[:, None] & cm[None, :], other=0.0)
            x_hi = tl.load(xp + 1, mask=xm[:, None] & cm[None, :], other=0.0)
            at = W + rows.to(tl.int64) * WS + col // 32 * 17
            b = tl.load(at[:, None] + i[None, :], mask=rm[:, None] & cm[None, :], other=0).to(tl.int32)
            scale = mx4_scale(W, rows, rm, col, K, WS)
            lo = e2m1_f16(b).to(x_lo.dtype)
            hi = e2m1_f16(b >> 4).to(x_lo.dtype)
            part = tl.dot(x_hi, tl.trans(hi), tl.dot(x_lo, tl.trans(lo)))
            acc += part * 16384.0 * scale[None, :]
    else:
        kk = k0 + tl.arange(0, BK)
        x = tl.load(X + xrows.to(tl.int64)[:, None] * XS + kk[None, :], mask=xm[:, None] & (kk < K)[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(mx4_tile(W, rows, rm, k0, K, WS, BK, x.dtype)), acc)
    return acc


@triton.jit
def mx4_tile(W, rows, rm, k0, K, WS, BK: tl.constexpr, DT: tl.constexpr):
    """Columns k0 .. k0 + BK (k0 and BK multiples of 32: whole chunks) of MXFP4 rows `rows` (mask rm) of WS bytes
    in DT, columns from K on 0 (K is whole chunks, so a chunk's mask is its columns'): each e2m1 value
    (`e2m1_f16`) times its chunk's scale (`mx4_pow2`) in float32, exact, rounded once to DT as `unpack_rows` rounds."""
    j = k0 + tl.arange(0, BK)  # the tile's columns: column j is nibble j % 2 of its chunk's byte (j % 32) // 2
    at = W + rows.to(tl.int64)[:, None] * WS + (j // 32 * 17)[None, :]  # [rows, columns]: its chunk's first byte
    m = rm[:, None] & (j < K)[None, :]
    q = tl.load(at + (j % 32 // 2)[None, :], mask=m, other=0).to(tl.int32)  # (each byte read for both its columns)
    scale = mx4_pow2(tl.load(at + 16, mask=m, other=0).to(tl.int32))  # the chunk's scale byte
    # (2D [rows, columns] throughout: Triton 3.6 cannot lay out a joined [rows, bytes, 2] tile in shared memory for
    # Hopper's dot (Illegal shared layout), which 3.9 can)
    return ((e2m1_f16(q >> (j % 2 * 4)[None, :]).to(tl.float32) * 16384.0) * scale).to(DT)


@triton.jit
def weight_tile(W, rows, rm, k0, K, WS, BK: tl.constexpr, FMT: tl.constexpr, DT: tl.constexpr):
    """Rows `rows` (mask rm) of a weight, columns k0 .. k0 + BK (< K), in DT, by format FMT: PLAIN values of row
    stride WS; FP8_ROWS or FP8_WHOLE of WS bytes (BK == 128, one chunk: its float8 values times the row's block
    scale, rounded once to DT as `unpack_rows` rounds). (MXFP4 rows: `mx4_dot`.)"""
    tl.static_assert(FMT != MXFP4_ROWS, "MXFP4 rows are read by mx4_dot, not as weight tiles")
    if FMT == PLAIN:
        kk = tl.arange(0, BK)
        m = rm[:, None] & (k0 + kk < K)[None, :]
        return tl.load(W + rows.to(tl.int64)[:, None] * WS + (k0 + kk)[None, :], mask=m, other=0.0)
    else:
        q = chunk_values(W, rows, rm, k0, K, WS, FMT).to(tl.float32)
        return (q * chunk_scales(W, rows, rm, k0, K, WS, FMT)[:, None]).to(DT)


@triton.jit
def quantize_act(a):
    """An activation tile [BM, 128] (one 128-column group of BM rows) as float8 values and a float32 scale a row: the
    row's largest magnitude over 448, float8_e4m3fn's largest (1 for an all-zero row): `fp8_rows.quantize_groups`."""
    af = a.to(tl.float32)
    amax = tl.max(tl.abs(af), axis=1)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    return (af / scale[:, None]).to(tl.float8e4nv), scale


@triton.jit
def fp8_dot(aq, sa, W, rows, rm, k0, K, WS, sw, acc, W_ROWS: tl.constexpr, FMT: tl.constexpr):
    """acc plus the W8A8 product of an activation tile quantized by `quantize_act` (aq [BM, 128], sa) and the chunk at
    column k0 of FP8 rows `rows` in layout FMT as stored (`chunk_values`; sw: its block scales as the product's shape
    takes them, a row's `chunk_scales` as [1, rows] ([rows, 1] with W_ROWS) or one `tile_scale`, which a caller may
    load a chunk ahead: Triton's pipelining copies a dot's operands ahead, not what scales its result): float8
    operands into the tensor cores, float32 sums, times both scales (vLLM's and SGLang's block-FP8 GEMMs). acc is
    [BM, rows], or with W_ROWS [rows, BM]: the weight rows the dot's rows (on Hopper a dot of fewer than 64 rows takes
    Ampere's MMA, which converts both float8 tiles to f16 first; 64 weight rows make a warpgroup MMA on float8:
    tests/test_kernels_sm90.py)."""
    wq = chunk_values(W, rows, rm, k0, K, WS, FMT)
    if W_ROWS:
        out = acc + tl.dot(wq, tl.trans(aq)) * (sw * sa[None, :])
    else:
        out = acc + tl.dot(aq, tl.trans(wq)) * (sa[:, None] * sw)
    return out


@triton.jit
def store_chunk(Out, rows, rm, c, WS, x):
    """x [rows, 128] quantized (`quantize_act`) into chunk c of FP8 rows `rows` (mask rm) of WS bytes, a segment a
    chunk (FP8_ROWS, as every quantized activation): its float8 values, then its scale."""
    q, s = quantize_act(x)
    at = Out + rows.to(tl.int64) * WS + c * FP8_CHUNK
    tl.store(at[:, None] + tl.arange(0, 128)[None, :], q.to(tl.uint8, bitcast=True), mask=rm[:, None])
    tl.store((at + 128).to(tl.pointer_type(tl.float32)), s, mask=rm)


@triton.jit
def _quantize_rows(X, Out, T, K, stride_x, WS, BR: tl.constexpr, PDL: tl.constexpr):
    """Out = X [T, K] as FP8 rows of WS bytes, each row's 128-column group quantized with a scale of its own
    (`store_chunk`), this program's BR rows of one chunk."""
    enter(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = rows < T
    k0 = tl.program_id(1) * 128
    kk = tl.arange(0, 128)
    x = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + (k0 + kk)[None, :],
                mask=rm[:, None] & (k0 + kk < K)[None, :], other=0.0)
    store_chunk(Out, rows, rm, tl.program_id(1), WS, x)


@triton.jit
def _scaled_f16(X, Out, Scale, K, stride_x, BK: tl.constexpr, PDL: tl.constexpr):
    """Out[t] = X[t] / Scale[t] in float16 for this program's row t: Scale[t] the power of two that brings the row's
    largest magnitude into [2^14, 2^15), from its float32 exponent bits (exact: a bf16 value's 8 mantissa bits fit
    float16's 11, and a power of two only moves the exponent)."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, BK)
    x = tl.load(X + t * stride_x + kk, mask=kk < K, other=0.0).to(tl.float32)
    e = (tl.max(tl.abs(x), axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF  # amax < 2^(e - 126)
    s = tl.minimum(tl.maximum(e - 141, -126), 126)  # amax / 2^s in [2^14, 2^15) (a row of zeros: 2^-126)
    tl.store(Scale + t, ((s + 127) << 23).to(tl.float32, bitcast=True))
    tl.store(Out + t * K + kk, (x * ((127 - s) << 23).to(tl.float32, bitcast=True)).to(tl.float16), mask=kk < K)


def scaled_f16(x_TD: torch.Tensor, *, kc: KernelConfig = DEFAULT_KERNELS) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (bf16 or float16) as float16 rows [T, K] and a float32 power of two a row [T] (`_scaled_f16`): x_t =
    out_t * scale_t, exactly (values under 2^-31 of their row's largest aside, which float16's subnormals round), so
    W8A16's dots can take float16 operands (`fp8_chunk_product`) whatever the activations' range. One launch."""
    T, K = x_TD.shape
    out = torch.empty(T, K, dtype=torch.float16, device=x_TD.device)
    scale = torch.empty(T, dtype=torch.float32, device=x_TD.device)
    if T:
        _scaled_f16[(T,)](x_TD, out, scale, K, x_TD.stride(0), BK=triton.next_power_of_2(K), num_warps=4,
                          **pdl(x_TD, kc))
    return out, scale


def quantize_rows(x_TD: torch.Tensor, *, kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """x [T, K] as FP8 rows (uint8 [T, packed_width(K)]) of per-token 128-column groups, each with a float32 scale of
    its own (W8A8's activations: `quantize_act`'s values, `fp8_rows.quantize_groups` once unpacked), one launch."""
    T, K = x_TD.shape
    out = torch.empty(T, packed_width(K), dtype=torch.uint8, device=x_TD.device)
    BR = 32
    _quantize_rows[(triton.cdiv(T, BR), triton.cdiv(K, 128))](x_TD, out, T, K, x_TD.stride(0), out.shape[1], BR=BR,
                                                               num_warps=4, **pdl(x_TD, kc))
    return out


def fits(x_TD: torch.Tensor, w_ND: torch.Tensor, kc: KernelConfig) -> bool:
    return (x_TD.is_cuda and 0 < x_TD.shape[0] <= MAX_ROWS and x_TD.shape[1] <= MAX_K and x_TD.stride(1) == 1
            and w_ND.shape[1] == x_TD.shape[1] and w_ND.is_contiguous() and x_TD.dtype == w_ND.dtype
            and x_TD.dtype in (torch.bfloat16, torch.float16)  # anything else: F.linear (and its shape errors)
            and kc.release == kernels.LATE)  # in EARLY it holds the SMs (module docstring)


@triton.jit
def _linear_rows(X, W, B, Out, T, N, K, stride_x, stride_o, HAS_BIAS: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, WAIT_FIRST: tl.constexpr, PDL: tl.constexpr):
    """Out[t, n] = sum_k X[t, k] * W[n, k] (+ B[n]) for this program's BN rows n, float32 sums rounded once."""
    release(PDL)
    if WAIT_FIRST:
        wait(PDL)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mn, mk = rn < N, rk < K
    w = tl.load(W + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
    if HAS_BIAS:
        b = tl.load(B + rn, mask=mn, other=0.0).to(tl.float32)
    if not WAIT_FIRST:
        wait(PDL)  # only X comes from the kernel before
    for t in range(T):  # the engine sends up to MAX_ROWS rows; more only from direct callers
        x = tl.load(X + t * stride_x + rk, mask=mk, other=0.0)
        acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        if HAS_BIAS:
            acc += b
        tl.store(Out + t * stride_o + rn, acc.to(Out.dtype.element_ty), mask=mn)


def linear(x_TD: torch.Tensor, w_ND: torch.Tensor, bias_N: torch.Tensor | None = None, wait_first: bool = False,
           *, kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """F.linear for any x [T, K] with K <= MAX_K (`fits` says where it is the faster one). wait_first: load the
    weights only after the wait, as a kernel must whose weights the kernel before picks (the stand-ins for the expert
    projections in `python benchmarks/kernels/boundary_bench.py`)."""
    T, K = x_TD.shape
    N = w_ND.shape[0]
    out = torch.empty(T, N, dtype=x_TD.dtype, device=x_TD.device)
    BK = triton.next_power_of_2(K)
    BN = max(1, TILE_ELEMS // BK)
    _linear_rows[(triton.cdiv(N, BN),)](x_TD, w_ND, w_ND if bias_N is None else bias_N, out, T, N, K,
                                        x_TD.stride(0), out.stride(0), HAS_BIAS=bias_N is not None, BN=BN, BK=BK,
                                        WAIT_FIRST=wait_first, num_warps=8, **pdl(x_TD, kc))
    return out


def fits_fp8_rows(x_TD: torch.Tensor, w_NC: torch.Tensor, kc: KernelConfig) -> bool:
    """Where `linear_fp8_rows` takes a projection on FP8 rows: `fits`'s rows and order (in EARLY these programs sit
    on the SMs, registers full, while the kernels before still run)."""
    return (x_TD.is_cuda and 0 < x_TD.shape[0] <= MAX_ROWS and x_TD.shape[1] <= MAX_K and x_TD.stride(1) == 1
            and x_TD.dtype in (torch.bfloat16, torch.float16) and w_NC.is_contiguous()
            and w_NC.shape[1] in widths(x_TD.shape[1])
            and kc.release == kernels.LATE)


@triton.jit
def _linear_fp8_rows(X, W, B, Out, T, N, K, WS, stride_x, stride_o, HAS_BIAS: tl.constexpr, BN: tl.constexpr,
                     CB: tl.constexpr, ACT8: tl.constexpr, FMT: tl.constexpr, PDL: tl.constexpr):
    """`_linear_rows` on FP8 rows: this program's BN weight rows, every 128-column chunk (CB, a power of two, at
    least the row's), held as float8 with their block scales, loaded before the wait; then each row t of X. ACT8:
    each 128-column group of X quantized (`quantize_act`) and the float8 products summed in float32 a chunk, times
    both scales (`fp8_dot`'s sums); else each chunk dequantized to X's dtype (`weight_tile`) and multiplied."""
    release(PDL)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    c = tl.arange(0, CB)
    kk = tl.arange(0, 128)
    mn = rn < N
    col = c[:, None] * 128 + kk[None, :]  # [CB, 128]: each chunk's columns
    mcol = col < K
    row = W + rn.to(tl.int64)[:, None, None] * WS
    if FMT == FP8_WHOLE:  # (kernels/fp8_rows.py: the row's values, then its chunks' scales)
        at, sat = col, tl.cdiv(K, 128) * 128 + c * 4
    else:
        at, sat = c[:, None] * FP8_CHUNK + kk[None, :], c * FP8_CHUNK + 128
    wq = tl.load(row + at[None, :, :], mask=mn[:, None, None] & mcol[None, :, :], other=0)
    wq = wq.to(tl.float8e4nv, bitcast=True)
    sw = tl.load((W + rn.to(tl.int64)[:, None] * WS + sat[None, :]).to(tl.pointer_type(tl.float32)),
                 mask=mn[:, None] & (c * 128 < K)[None, :], other=0.0)  # [BN, CB]
    if HAS_BIAS:
        b = tl.load(B + rn, mask=mn, other=0.0).to(tl.float32)
    wait(PDL)  # only X comes from the kernel before
    for t in range(T):
        x = tl.load(X + t * stride_x + col, mask=mcol, other=0.0)  # [CB, 128]
        if ACT8:
            xq, sx = quantize_act(x)
            part = tl.sum(wq.to(tl.float32) * xq.to(tl.float32)[None, :, :], axis=2)  # [BN, CB]
            acc = tl.sum(part * sw * sx[None, :], axis=1)
        else:
            wd = (wq.to(tl.float32) * sw[:, :, None]).to(X.dtype.element_ty).to(tl.float32)
            acc = tl.sum(tl.sum(wd * x.to(tl.float32)[None, :, :], axis=2), axis=1)
        if HAS_BIAS:
            acc += b
        tl.store(Out + t * stride_o + rn, acc.to(Out.dtype.element_ty), mask=mn)


def linear_fp8_rows(x_TD: torch.Tensor, w_NC: torch.Tensor, bias_N: torch.Tensor | None = None, *,
                    kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """`linear_fp8` for one or two rows (`fits_fp8_rows`): weight rows held in registers before the wait, as
    `linear`'s (the tensor-core tiles of `linear_fp8` leave most SMs idle at a row: few programs, each streaming its
    rows through K)."""
    T, K = x_TD.shape
    N = w_NC.shape[0]
    out = torch.empty(T, N, dtype=x_TD.dtype, device=x_TD.device)
    CB = triton.next_power_of_2(triton.cdiv(K, 128))
    BN = max(1, TILE_ELEMS // (CB * 128))
    _linear_fp8_rows[(triton.cdiv(N, BN),)](x_TD, w_NC, w_NC if bias_N is None else bias_N, out, T, N, K,
                                            w_NC.shape[1], x_TD.stride(0), out.stride(0), HAS_BIAS=bias_N is not None,
                                            BN=BN, CB=CB, ACT8=kc.fp8_activations, FMT=fp8_form(w_NC, K),
                                            num_warps=8, **pdl(x_TD, kc))
    return out


# Tensor-core tiles for 3 to 32 rows (`kernels.MMA_MIN_ROWS`, `MMA_MAX_ROWS`): weight rows a program x K a stage,
# stages. One shape for every row count: measured near the best one at each count on the 30B TP-2 and EP shapes
# (benchmarks/results/h200-few-row-projections.json); 64 rows of tokens would not fit the shared memory.
MMA_MIN_ROWS, MMA_MAX_ROWS = kernels.MMA_MIN_ROWS, kernels.MMA_MAX_ROWS
MMA_BM, MMA_BK, MMA_STAGES = 64, 256, 4


def fits_mma(x_TD: torch.Tensor, w_ND: torch.Tensor) -> bool:
    return (x_TD.is_cuda and MMA_MIN_ROWS <= x_TD.shape[0] <= MMA_MAX_ROWS and x_TD.stride(1) == 1
            and w_ND.shape[1] == x_TD.shape[1] and w_ND.is_contiguous() and x_TD.dtype == w_ND.dtype
            and x_TD.dtype in (torch.bfloat16, torch.float16))


@triton.jit
def _linear_mma(X, W, B, Out, T, N, K, stride_x, stride_o, HAS_BIAS: tl.constexpr, BT: tl.constexpr,
                BM: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    """Out[t, n] for this program's BM rows n and every row t: W[n, :] . X[t, :] as one [BM, BT] tile, float32 sums
    rounded once."""
    enter(PDL)
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    mm, mt = rm < N, rt < T
    acc = tl.zeros([BM, BT], tl.float32)
    for k0 in range(0, K, BK):
        mk = k0 + rk < K
        w = tl.load(W + rm[:, None].to(tl.int64) * K + (k0 + rk)[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        x = tl.load(X + rt[None, :] * stride_x + (k0 + rk)[:, None], mask=mt[None, :] & mk[:, None], other=0.0)
        acc = tl.dot(w, x, acc)
    if HAS_BIAS:
        acc += tl.load(B + rm, mask=mm, other=0.0).to(tl.float32)[:, None]
    tl.store(Out + rt[None, :] * stride_o + rm[:, None], acc.to(Out.dtype.element_ty), mask=mm[:, None] & mt[None, :])


def linear_mma(x_TD: torch.Tensor, w_ND: torch.Tensor, bias_N: torch.Tensor | None = None, *,
               kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """F.linear for any x [T, K] (`fits_mma` says where it is the faster one)."""
    T, K = x_TD.shape
    N = w_ND.shape[0]
    out = torch.empty(T, N, dtype=x_TD.dtype, device=x_TD.device)
    _linear_mma[(triton.cdiv(N, MMA_BM),)](x_TD, w_ND, w_ND if bias_N is None else bias_N, out, T, N, K,
                                           x_TD.stride(0), out.stride(0), HAS_BIAS=bias_N is not None,
                                           BT=max(16, triton.next_power_of_2(T)), BM=MMA_BM, BK=MMA_BK, num_warps=4,
                                           num_stages=MMA_STAGES, **pdl(x_TD, kc))
    return out


# FP8 rows: one 128-column chunk a K step (its scale covers exactly those columns). Launch shapes (weight rows a
# program, token rows a program, warps, stages, K columns a split, token rows) by the most rows a step brings, for
# W8A16 and W8A8. K splits: programs that each sum a contiguous share of the chunks into float32 partials, summed in
# split order by `_sum_splits` (more programs where N / BM x T / BT leaves SMs idle); a projection of K columns takes
# K // (columns a split) of them (0: K whole). Token rows: the dot with the tokens as its rows and the weight tile
# as the other operand (as the fused MoE's), where W8A16's weight tiles come in 16-byte copies; else the weight rows
# are the dot's rows (W8A16's tile then feeds the tensor cores from registers, copied in 8 bytes:
# tests/test_kernels_sm90.py). W8A16's decode rows from the search with splits at Qwen3-30B-A3B's q|k|v and o on an
# H100 (benchmarks/kernels/linear_fp8_tune.py; benchmarks/results/h100-p1-linear-fp8-split-tune.json: a split per
# 1024 columns and one launch a bucket for both shapes, near each shape's own best); prompt rows (where W8A16 unpacks
# its weight instead, `UNPACK_ROWS`: this launch is the search's comparison) and W8A8's from the search before splits
# (h100-p1-linear-fp8-tune.json), its 17 to 256 rows since with the weight rows as the dot's rows (faster at 64 and
# 256 rows: h100-p1-linear-fp8-w8a8-orientation.json).
FP8_LAUNCHES: dict[bool, list[tuple[int, tuple[int, int, int, int, int, bool]]]] = {
    False: [(16, (64, 16, 4, 4, 1024, True)), (64, (32, 64, 4, 4, 1024, True)), (256, (128, 128, 8, 4, 1024, False)),
            (1 << 62, (128, 128, 8, 3, 0, False))],
    True: [(16, (128, 16, 8, 3, 0, True)), (256, (64, 64, 4, 3, 0, False)), (1 << 62, (128, 64, 4, 3, 0, True))],
}


def fp8_launch(T: int, K: int, act8: bool) -> tuple[int, int, int, int, int, bool]:
    """(BM, BT, warps, stages, splits, token rows) of `_linear_fp8` for T rows of K columns (BT at most T's power of
    two, 16 the least)."""
    BM, BT, warps, stages, cols, token_rows = next(launch for most, launch in FP8_LAUNCHES[act8] if T <= most)
    return BM, min(BT, max(16, triton.next_power_of_2(T))), warps, stages, max(1, K // cols) if cols else 1, token_rows


@triton.jit
def _linear_fp8(X, W, B, Out, T, N, K, WS, stride_x, stride_o, HAS_BIAS: tl.constexpr, BT: tl.constexpr,
                BM: tl.constexpr, ACT8: tl.constexpr, TOKEN_ROWS: tl.constexpr, SPLITS: tl.constexpr,
                FMT: tl.constexpr, PDL: tl.constexpr):
    """Out[t, n] for this program's BM weight rows n and BT rows t: W[n, :] . X[t, :] with W as FP8 rows, float32
    sums rounded once. ACT8: each [BT, 128] tile of X quantized per row (`quantize_act`), FP8 dots (`fp8_dot`); else
    each weight tile's float8 values times its rows' block scales rounded to X's dtype (as `unpack_rows`). The dot's
    rows the tokens (TOKEN_ROWS) or the weight rows.
    SPLITS > 1: program_id(2) sums only its share of the chunks, into float32 partials Out[split, t, n] (row stride
    stride_o; no bias: `_sum_splits` adds it)."""
    enter(PDL)
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rt = tl.program_id(1) * BT + tl.arange(0, BT)
    rk = tl.arange(0, 128)
    mm, mt = rm < N, rt < T
    chunks = tl.cdiv(K, 128)
    share = tl.cdiv(chunks, SPLITS)
    c_lo = tl.program_id(2) * share
    c_hi = tl.minimum(chunks, c_lo + share)  # (k0 as chunk x 128: Triton sees its alignment, 16-byte copies)
    if ACT8:  # each [BT, 128] tile of X quantized per token row; the weight scales loaded a chunk ahead (`fp8_dot`)
        if TOKEN_ROWS:
            acc8 = tl.zeros([BT, BM], tl.float32)
        else:
            acc8 = tl.zeros([BM, BT], tl.float32)
        sw = chunk_scales(W, rm, mm, tl.minimum(c_lo * 128, K - 1), K, WS, FMT)
        for c in range(c_lo, c_hi):
            k0 = c * 128
            sw_next = chunk_scales(W, rm, mm, tl.minimum(k0 + 128, K - 1), K, WS, FMT)  # (past the last: the last)
            x = tl.load(X + rt[:, None].to(tl.int64) * stride_x + (k0 + rk)[None, :],
                        mask=mt[:, None] & (k0 + rk < K)[None, :], other=0.0)
            xq, sx = quantize_act(x)
            sw_b = sw[None, :] if TOKEN_ROWS else sw[:, None]  # (q|k|v's tiles may span two blocks: a scale a row)
            acc8 = fp8_dot(xq, sx, W, rm, mm, k0, K, WS, sw_b, acc8, not TOKEN_ROWS, FMT)
            sw = sw_next
        if TOKEN_ROWS:
            acc = tl.trans(acc8)
        else:
            acc = acc8
    elif TOKEN_ROWS:
        acc_TM = tl.zeros([BT, BM], tl.float32)
        for c in range(c_lo, c_hi):
            k0 = c * 128
            x = tl.load(X + rt[:, None].to(tl.int64) * stride_x + (k0 + rk)[None, :],
                        mask=mt[:, None] & (k0 + rk < K)[None, :], other=0.0)
            w = weight_tile(W, rm, mm, k0, K, WS, 128, FMT, X.dtype.element_ty)
            acc_TM = tl.dot(x, tl.trans(w), acc_TM)
        acc = tl.trans(acc_TM)
    else:
        acc = tl.zeros([BM, BT], tl.float32)
        for c in range(c_lo, c_hi):
            k0 = c * 128
            w = weight_tile(W, rm, mm, k0, K, WS, 128, FMT, X.dtype.element_ty)
            x = tl.load(X + rt[None, :].to(tl.int64) * stride_x + (k0 + rk)[:, None],
                        mask=mt[None, :] & (k0 + rk < K)[:, None], other=0.0)
            acc = tl.dot(w, x, acc)
    if SPLITS == 1 and HAS_BIAS:
        acc += tl.load(B + rm, mask=mm, other=0.0).to(tl.float32)[:, None]
    at = Out + tl.program_id(2).to(tl.int64) * T * stride_o  # (SPLITS == 1: split 0, Out itself)
    tl.store(at + rt[None, :].to(tl.int64) * stride_o + rm[:, None], acc.to(Out.dtype.element_ty),
             mask=mm[:, None] & mt[None, :])


@triton.jit
def _sum_splits(Part, B, Out, T, N, stride_o, HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr, BN: tl.constexpr,
                PDL: tl.constexpr):
    """Out[t, n] = the float32 partials Part[0 .. SPLITS, t, n] (rows of N) summed in split order (+ B[n]), rounded
    once: row t, this program's BN columns."""
    enter(PDL)
    t = tl.program_id(0)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = rn < N
    at = Part + t.to(tl.int64) * N + rn
    acc = tl.load(at, mask=mn, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(at + s * T * N, mask=mn, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=mn, other=0.0).to(tl.float32)
    tl.store(Out + t.to(tl.int64) * stride_o + rn, acc.to(Out.dtype.element_ty), mask=mn)


@triton.jit
def _unpack_fp8(W, Out, N, K, WS, BR: tl.constexpr, FMT: tl.constexpr, PDL: tl.constexpr):
    """Out [N, K] = the FP8 rows W (WS bytes each) in Out's dtype, rounded as `unpack_rows` rounds (`weight_tile`):
    this program's BR rows, one 128-column chunk."""
    enter(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = rows < N
    k0 = tl.program_id(1) * 128
    kk = k0 + tl.arange(0, 128)
    tile = weight_tile(W, rows, rm, k0, K, WS, 128, FMT, Out.dtype.element_ty)
    tl.store(Out + rows.to(tl.int64)[:, None] * K + kk[None, :], tile, mask=rm[:, None] & (kk < K)[None, :])


# Rows past which W8A16 on FP8 rows unpacks the weight in one pass (`unpack_fp8`) and multiplies through torch
# (cuBLAS): prompt sizes are compute-bound, where the FP8 kernels took about twice the unpack and cuBLAS together
# (benchmarks/results/h200-p1-linear-fp8-unpack.json); decode steps keep the FP8 kernels (an unpack each step would
# move five bytes through HBM for each FP8 byte).
UNPACK_ROWS = 256


def unpack_fp8(w_NC: torch.Tensor, K: int, dtype: torch.dtype, *, kc: KernelConfig = DEFAULT_KERNELS
               ) -> torch.Tensor:
    """`fp8_rows.unpack_rows(w_NC, K, dtype)` of FP8 rows on the GPU, one launch: [N, K] in dtype."""
    N = w_NC.shape[0]
    out = torch.empty(N, K, dtype=dtype, device=w_NC.device)
    BR = 32
    _unpack_fp8[(triton.cdiv(N, BR), triton.cdiv(K, 128))](w_NC, out, N, K, w_NC.shape[1], BR=BR,
                                                            FMT=fp8_form(w_NC, K), num_warps=4, **pdl(w_NC, kc))
    return out


def linear_fp8(x_TD: torch.Tensor, w_NC: torch.Tensor, bias_N: torch.Tensor | None = None, *,
               kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """F.linear(x, unpack_rows(w_NC, K, x.dtype), bias) for any x [T, K] and FP8 rows w_NC [N, packed_width(K)]; with
    kc.fp8_activations x as `quantize_groups(x)` (W8A8). W8A16 past UNPACK_ROWS rows: literally that (the weight
    unpacked by `unpack_fp8`, the product cuBLAS's)."""
    T, K = x_TD.shape
    N = w_NC.shape[0]
    if w_NC.shape[1] not in widths(K) or not w_NC.is_contiguous() or x_TD.stride(1) != 1:
        raise ValueError(f"linear_fp8: FP8 rows {tuple(w_NC.shape)} do not hold rows of {K} columns "
                         f"({' or '.join(map(str, widths(K)))} bytes), or a tensor is not row-major")
    if T > UNPACK_ROWS and not kc.fp8_activations:
        return torch.nn.functional.linear(x_TD, unpack_fp8(w_NC, K, x_TD.dtype, kc=kc), bias_N)
    out = torch.empty(T, N, dtype=x_TD.dtype, device=x_TD.device)
    launch_fp8(x_TD, w_NC, bias_N, out, *fp8_launch(T, K, kc.fp8_activations), kc=kc)
    return out


def launch_fp8(x_TD: torch.Tensor, w_NC: torch.Tensor, bias_N: torch.Tensor | None, out: torch.Tensor, BM: int,
               BT: int, warps: int, stages: int, splits: int, token_rows: bool, *,
               kc: KernelConfig = DEFAULT_KERNELS) -> None:
    """`_linear_fp8` into out [T, N] at one launch shape (`fp8_launch`'s, or a search's), its splits (at most one a
    128-column chunk) summed by `_sum_splits`."""
    T, K = x_TD.shape
    N = w_NC.shape[0]
    splits = max(1, min(splits, triton.cdiv(K, 128)))
    part = out if splits == 1 else torch.empty(splits, T, N, dtype=torch.float32, device=x_TD.device)
    _linear_fp8[(triton.cdiv(N, BM), triton.cdiv(T, BT), splits)](
        x_TD, w_NC, w_NC if bias_N is None else bias_N, part, T, N, K, w_NC.shape[1], x_TD.stride(0), part.stride(-2),
        HAS_BIAS=bias_N is not None, BT=BT, BM=BM, ACT8=kc.fp8_activations, TOKEN_ROWS=token_rows, SPLITS=splits,
        FMT=fp8_form(w_NC, K), num_warps=warps, num_stages=stages, **pdl(x_TD, kc))
    if splits > 1:
        BN = min(1024, triton.next_power_of_2(N))
        _sum_splits[(T, triton.cdiv(N, BN))](part, part if bias_N is None else bias_N, out, T, N, out.stride(0),
                                            HAS_BIAS=bias_N is not None, SPLITS=splits, BN=BN, num_warps=4,
                                            **pdl(x_TD, kc))
