"""MXFP4 rows: weights in the OCP microscaling FP4 format (blocks of 32 e2m1 values sharing one power-of-two e8m0
scale: GPT-OSS's released experts, models/gpt_oss/mxfp4.py) laid out so that a row carries its own scales, as FP8
rows do (kernels/fp8_rows.py). Each weight row is cut in 32-column chunks, each chunk its 16 bytes of e2m1 codes
(two a byte, the low nibble first: the releases' `_blocks`) followed by its scale byte (the exponent biased by 127:
the releases' `_scales`): 17 bytes for 32 values, 0.53 of a byte a value. Every cut the layouts make (rows of gate
and up, whole 32-column chunks of down) carries the scales with the weights, so the load, a switch and an update move
MXFP4 rows as bytes (uint8 tensors). A row's columns are whole chunks: no padding.

`pack_rows` quantizes as the OCP MX specification does (each block's scale 2^(floor(log2(amax)) - 2), e2m1's largest
exponent being 2; each value rounded to the nearest e2m1 value, ties to even, saturating at 6): the values of a
released checkpoint, dequantized, come back exactly (for scales of 2^-124 and up: every release's). `unpack_rows` is
transformers' dequantization of the same blocks (each value times 2^(scale - 127) in float32, rounded once).
"""

from __future__ import annotations

import itertools

import torch

BLOCK = 32  # values a scale covers
CHUNK = BLOCK // 2 + 1  # bytes of a chunk: 16 bytes of codes, one scale byte
SCALE_BIAS = 127
EMAX = 2  # e2m1's largest exponent: the OCP scale puts a block's largest magnitude in [4, 8)
# e2m1's sixteen values by code: sign bit 3, then exponent and mantissa
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MAGNITUDES = FP4_VALUES[:8]


def packed_width(cols: int) -> int:
    """Bytes of an MXFP4 row of `cols` columns (a multiple of 32)."""
    if cols % BLOCK:
        raise ValueError(f"MXFP4 rows hold whole {BLOCK}-value blocks: {cols} columns is not a multiple of {BLOCK}")
    return cols // BLOCK * CHUNK


def values(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., G, 32] in `dtype` of e2m1 codes packed two a byte [..., G, 16] and their blocks' biased exponents
    [..., G] (uint8): each value times its power of two in float32, rounded once (transformers' dequantization)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=codes.device)
    c = codes.to(torch.uint8)
    v = torch.stack([lut[(c & 0x0F).long()], lut[(c >> 4).long()]], dim=-1).flatten(-2)
    return (v * torch.pow(2.0, scales.to(torch.int32) - SCALE_BIAS)[..., None]).to(dtype)


def _codes(x: torch.Tensor) -> torch.Tensor:
    """The e2m1 codes (uint8) of float32 values already divided by their block's scale: the nearest e2m1 magnitude
    (ties to the even code: the one whose mantissa bit is 0), saturating at 6, with the sign bit of x."""
    mags = torch.tensor(_MAGNITUDES, dtype=torch.float32, device=x.device)
    mids = (mags[1:] + mags[:-1]) / 2
    a = x.abs().contiguous()
    down = torch.bucketize(a, mids, right=False, out_int32=True)  # a tie goes to the lower magnitude
    up = torch.bucketize(a, mids, right=True, out_int32=True)  # ... or the upper one
    idx = torch.where((down != up) & (up % 2 == 0), up, down).to(torch.uint8)
    return idx | (torch.signbit(x).to(torch.uint8) << 3)


def _pack(w: torch.Tensor) -> torch.Tensor:
    """MXFP4 rows of a matrix [r, C] (C whole blocks)."""
    blocks = w.float().unflatten(-1, (w.shape[-1] // BLOCK, BLOCK))
    amax = blocks.abs().amax(-1)
    # floor(log2(amax)) exactly (float32's log2 rounds a value just below 2^k up to k): amax = m * 2^e, m in [0.5, 1)
    exp = torch.where(amax > 0, (torch.frexp(amax).exponent - 1 - EMAX).float(), torch.zeros_like(amax))
    exp = exp.clamp(-SCALE_BIAS, SCALE_BIAS)  # e8m0's range (255 is its NaN)
    codes = _codes(blocks / torch.pow(2.0, exp)[..., None])
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scale = (exp + SCALE_BIAS).to(torch.uint8)[..., None]
    return torch.cat([packed, scale], dim=-1).flatten(-2)


# values rounded at a time: the rounding's float32 and int32 temporaries stay tens of MB whatever the tensor (a
# release's fused expert tensors are GBs)
_PIECE = 1 << 22


def pack_rows(w: torch.Tensor) -> torch.Tensor:
    """MXFP4 rows (uint8 [..., R, packed_width(C)]) of w [..., R, C] (float: a float model's weights, or the
    dequantized values of an MXFP4 checkpoint, which come back exactly) quantized by 32-value blocks; a matrix and
    a few rows at a time (`w` may be any strided view: nothing of its size is copied)."""
    *lead, R, C = w.shape
    out = torch.empty(*lead, R, packed_width(C), dtype=torch.uint8, device=w.device)
    if w.numel() == 0:  # (the checks' shape-only fetches)
        return out
    rows = max(1, _PIECE // max(C, 1))
    for at in itertools.product(*map(range, lead)):
        src, dst = w[at], out[at]
        for r in range(0, R, rows):
            dst[r: r + rows] = _pack(src[r: r + rows])
    return out


def unpack_rows(rows: torch.Tensor, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., R, cols] in `dtype` of MXFP4 rows (`pack_rows`)."""
    if rows.shape[-1] != packed_width(cols):
        raise ValueError(f"MXFP4 rows of {rows.shape[-1]} bytes do not hold {cols} columns ({packed_width(cols)})")
    chunks = rows.unflatten(-1, (cols // BLOCK, CHUNK))
    return values(chunks[..., : BLOCK // 2], chunks[..., BLOCK // 2], dtype).flatten(-2)
