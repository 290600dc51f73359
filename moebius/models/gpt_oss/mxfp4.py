"""MXFP4, the releases' expert format: `*_blocks` [E, R, G, 16] uint8 (32 e2m1 values a block, two a byte, the low
nibble first) and `*_scales` [E, R, G] uint8 (a block's power-of-two exponent, biased by 127), dequantized as
transformers' integrations/mxfp4.py `convert_moe_packed_tensors` does: value = e2m1 * 2^(scale - 127), each row's
G blocks concatenated, the matrix transposed to the float checkpoint's layout ([E, G * 32, R]: gate_up_proj's
[E, D, 2I] from R = 2I rows of D / 32 blocks, down_proj's [E, I, D] from R = D rows of I / 32).

`MXFP4` is the format as the loader asks it of a quantized checkpoint (models/loader.py's `Packing`): which float
tensors are stored packed (the experts' two projections, what transformers' Mxfp4GptOssExperts holds; the biases,
attention, router and embeddings stay float), the pieces and their shapes, and the dequantization.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moebius.kernels.mxfp4_rows import BLOCK, values

PACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # the float names (suffixes) stored as pieces
PIECES = ("_blocks", "_scales")  # appended to a packed float name, in the order `unpack` takes them


def dequantize(blocks_ERGB: torch.Tensor, scales_ERG: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[E, G * 32, R] in `dtype` from MXFP4 blocks and scales (one expert at a time: no float32 copy of a whole
    layer's experts; the values as `kernels.mxfp4_rows.values` gives them, transformers' rounding)."""
    E, R, G, B = blocks_ERGB.shape
    if scales_ERG.shape != (E, R, G):
        raise ValueError(f"MXFP4 scales of shape {tuple(scales_ERG.shape)} do not match blocks {(E, R, G, B)}")
    out = torch.empty(E, G * B * 2, R, dtype=dtype, device=blocks_ERGB.device)
    for e in range(E):
        out[e] = values(blocks_ERGB[e], scales_ERG[e], dtype).flatten(-2).t()
    return out


class Mxfp4Packing:
    """How an MXFP4 checkpoint (quantization_config's quant_method "mxfp4") stores a float tensor: each expert
    projection [E, K, R] as `<name>_blocks` [E, R, K / 32, 16] and `<name>_scales` [E, R, K / 32], both uint8;
    every other tensor as it is."""

    method = "mxfp4"

    def pieces(self, name: str) -> tuple[str, ...] | None:
        """The stored names of float tensor `name` (None: the format does not pack it)."""
        return tuple(name + s for s in PIECES) if name.endswith(PACKED) else None

    def base_of(self, name: str) -> str | None:
        """The float tensor a stored piece `name` is part of (None: no piece of this format)."""
        for suffix in PIECES:
            base = name.removesuffix(suffix)
            if base != name and self.pieces(base) is not None:
                return base
        return None

    def stored(self, shape: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """Each piece's shape and dtype for a float tensor of `shape`; ValueError where the format cannot hold it."""
        if len(shape) != 3 or shape[1] % BLOCK:
            raise ValueError(f"MXFP4 packs [experts, K, rows] tensors with K a multiple of {BLOCK}, not {shape}")
        E, K, R = shape
        return ((E, R, K // BLOCK, BLOCK // 2), torch.uint8), ((E, R, K // BLOCK), torch.uint8)

    def unpack(self, pieces: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The float tensor of its pieces (in `pieces` order), in `dtype`."""
        blocks, scales = pieces
        return dequantize(blocks, scales, dtype)


MXFP4 = Mxfp4Packing()
