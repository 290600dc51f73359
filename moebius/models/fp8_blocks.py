"""Block FP8, the format of the FP8 releases (Qwen3-30B-A3B-FP8, Qwen3-235B-A22B-FP8, DeepSeek-V3 / R1; transformers'
FineGrainedFP8): config.json's quantization_config {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128,
128], "activation_scheme": "dynamic"} (Qwen3's with "modules_to_not_convert", DeepSeek's without). Each quantized
Linear weight `X.weight` [out, in] is stored as float8_e4m3fn beside `X.weight_scale_inv` float32 [ceil(out / 128),
ceil(in / 128)], one scale a 128 x 128 block (the last block of a dim no multiple of 128 is ragged, cut to the
weight), dequantized = weight * the scale of its block, in float32 and rounded once to the engine's dtype, as
transformers' Fp8Dequantize does; what the checkpoint leaves unquantized (embeddings, lm_head, norms, routers,
modules_to_not_convert) has no scale beside it and is read as stored.

Without --quantization fp8 the weights are dequantized to the engine's dtype at load, and the math is the float
model's. With it the routed experts stay in block FP8 in their layer slots, as FP8 rows (kernels/fp8_rows.py: each
row with its blocks' scales), a checkpoint's float8 values exactly (`fp8_rows_fetch`); the CPU computes on them as
transformers on the dequantized model (dequantize, then the float math); the GPU reads them in the fused MoE and
`kernels/linear.linear_fp8`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from moebius.config import ConfigError
from moebius.kernels.fp8_rows import BLOCK, pack_rows
from moebius.kernels.rows import FP8 as FP8_ROWS

SCALE = "_scale_inv"  # appended to a quantized weight's name: its scales' name
FMT = "e4m3"


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[out, in] in `dtype` from a float8 weight and its per-block scales (the edge blocks cut to the weight)."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(BLOCK[1], 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def check_config(q: dict[str, Any], where: str) -> None:
    """ConfigError naming what a block-FP8 quantization_config sets that this packing does not read as it means."""
    block = q.get("weight_block_size", list(BLOCK))  # (transformers' default when absent; null: one scale a tensor)
    if not isinstance(block, list | tuple) or list(block) != list(BLOCK):
        raise ConfigError(f"{where} has a quantization_config (quant_method 'fp8') with weight_block_size {block}: "
                          f"Moebius reads block FP8 with weight_block_size {list(BLOCK)} only (every release's)")
    if q.get("fmt", FMT) != FMT:
        raise ConfigError(f"{where} has a quantization_config (quant_method 'fp8') with fmt {q['fmt']!r}: Moebius "
                          f"reads block FP8 of fmt {FMT!r} (float8_e4m3fn) only")


class BlockFp8Packing:
    """How a block-FP8 checkpoint (quant_method "fp8") stores a float tensor: a Linear weight [out, in] as itself in
    float8_e4m3fn beside `<name>_scale_inv` float32 [ceil(out / 128), ceil(in / 128)]; a tensor stored without
    scales as it is (the loader tells them apart by the scales, or a float8 weight, being stored)."""

    method = "fp8"

    def pieces(self, name: str) -> tuple[str, ...] | None:
        """The stored names of float tensor `name`: itself and its scales (None: not a weight the format packs)."""
        return (name, name + SCALE) if name.endswith(".weight") else None

    def base_of(self, name: str) -> str | None:
        """The weight a stored scales tensor `name` belongs to (None otherwise: the float8 weight is its own name)."""
        base = name.removesuffix(SCALE)
        return base if base != name and self.pieces(base) is not None else None

    def stored(self, shape: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """The weight's and its scales' shapes and dtypes for a float tensor of `shape`; ValueError where the format
        cannot hold it."""
        if len(shape) != 2:
            raise ValueError(f"block FP8 packs [out, in] Linear weights, not {shape}")
        grid = tuple(-(-n // b) for n, b in zip(shape, BLOCK, strict=True))
        return (tuple(shape), torch.float8_e4m3fn), (grid, torch.float32)

    def unpack(self, pieces: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The float tensor of its pieces (weight, scales), in `dtype`."""
        weight, scale_inv = pieces
        return dequantize(weight, scale_inv, dtype)


FP8 = BlockFp8Packing()


def fp8_rows_fetch(fetch: Callable[[str, tuple[int, ...]], torch.Tensor], gate_up: bool, whole: bool
                   ) -> Callable[[str, tuple[int, ...]], torch.Tensor]:
    """A weight-spec fetch whose tensors come as FP8 rows (kernels/fp8_rows.py, uint8 [..., packed_width(C, whole)];
    whole: rows no layout cuts by columns) of what `fetch` gives (a float tensor: an FP8 checkpoint's dequantized
    values): quantized with the scales stored beside it (`<name>_scale_inv`, read through `fetch`: its float8 values
    come back exactly), else with its own blocks'. A fused experts' tensor [E, R, C] is quantized expert by expert,
    gate_up: its gate rows and up rows apart (as the checkpoints quantize gate_proj and up_proj). A meta tensor (an
    update that leaves the tensor) stays one."""

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        w = fetch(name, shape)
        if w.is_meta:
            return FP8_ROWS.rows_of(w, whole)
        scale = None
        if w.dim() == 2:  # a checkpoint's own weight: its scales, where it stores them
            try:
                scale = fetch(name + SCALE, tuple(-(-n // b) for n, b in zip(shape, BLOCK, strict=True)))
            except KeyError:
                pass
            scale = None if scale is None or scale.is_meta else scale.to(w.device)
        if w.dim() == 3 and gate_up:
            return pack_rows(w.unflatten(1, (2, w.shape[1] // 2)), whole=whole).flatten(1, 2)
        return pack_rows(w, scale, whole)

    return get
