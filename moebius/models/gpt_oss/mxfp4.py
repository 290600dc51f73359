"""MXFP4, the releases' expert format: `*_blocks` [E, R, G, 16] uint8 (32 e2m1 values a block, two a byte, the low
nibble first) and `*_scales` [E, R, G] uint8 (a block's power-of-two exponent, biased by 127), dequantized as
transformers' integrations/mxfp4.py `convert_moe_packed_tensors` does: value = e2m1 * 2^(scale - 127), each row's
G blocks concatenated, the matrix transposed to the float checkpoint's layout ([E, G * 32, R]: gate_up_proj's
[E, D, 2I] from R = 2I rows of D / 32 blocks, down_proj's [E, I, D] from R = D rows of I / 32)."""

from __future__ import annotations

import torch

# e2m1's sixteen values by code: sign bit 3, then exponent and mantissa
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize(blocks_ERGB: torch.Tensor, scales_ERG: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[E, G * 32, R] in `dtype` from MXFP4 blocks and scales (one expert at a time: no float32 copy of a whole
    layer's experts)."""
    E, R, G, B = blocks_ERGB.shape
    if scales_ERG.shape != (E, R, G):
        raise ValueError(f"MXFP4 scales of shape {tuple(scales_ERG.shape)} do not match blocks {(E, R, G, B)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks_ERGB.device)
    out = torch.empty(E, G * B * 2, R, dtype=dtype, device=blocks_ERGB.device)
    for e in range(E):
        blk = blocks_ERGB[e].to(torch.uint8)
        vals = torch.stack([lut[(blk & 0x0F).long()], lut[(blk >> 4).long()]], dim=-1).flatten(-2)  # [R, G, 32]
        # (float32 until the end, as transformers' ldexp: exact powers of two, one rounding to dtype)
        vals = vals * torch.pow(2.0, scales_ERG[e].to(torch.int32) - SCALE_BIAS)[..., None]
        out[e] = vals.flatten(-2).t()
    return out
