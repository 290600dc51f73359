"""The switch's permuted copies (Triton): one expert shard between whole experts and the TP-shaped staging, as rows
copied from one strided 2-D view into another, at nearly the HBM's rate: torch's copy of the same permuted views
measured far slower, and a switch moves every expert of the rank (`python benchmarks/switch/reshard_copy.py`;
benchmarks/results/h200-reshard-copy.json). The reference is `dst.copy_(src)`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# program size and column tile: every setting tried measured close to the others; these were the best
# (benchmarks/results/h200-reshard-copy.json)
ELEMS_PER_PROGRAM = 16384
NUM_WARPS = 8
DIVISOR_COLS = False  # column tile: the largest power of two dividing C (no masked lanes) instead of C's next


@triton.jit
def _copy_rows(Src, Dst, R, C, src_stride, dst_stride, col_tiles, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    r = (pid // col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = (pid % col_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (r[:, None] < R) & (c[None, :] < C)
    r64 = r.to(tl.int64)[:, None]
    x = tl.load(Src + r64 * src_stride + c[None, :], mask=m)
    tl.store(Dst + r64 * dst_stride + c[None, :], x, mask=m)


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[r, c] = src[r, c] for 2-D views of the same shape and dtype whose rows are contiguous (any row stride)."""
    if dst.shape != src.shape or dst.dim() != 2 or dst.dtype != src.dtype:
        raise ValueError(f"copy_rows needs two 2-D views of one shape and dtype, got {tuple(dst.shape)} "
                         f"{dst.dtype} and {tuple(src.shape)} {src.dtype}")
    if dst.stride(1) != 1 or src.stride(1) != 1:
        raise ValueError("copy_rows needs rows with contiguous columns")
    R, C = src.shape
    if R == 0 or C == 0:
        return
    BLOCK_C = min(1024, triton.next_power_of_2(C))
    if DIVISOR_COLS and C & -C >= 16:
        BLOCK_C = min(1024, C & -C)
    BLOCK_R = max(1, ELEMS_PER_PROGRAM // BLOCK_C)
    col_tiles = triton.cdiv(C, BLOCK_C)
    grid = (triton.cdiv(R, BLOCK_R) * col_tiles,)
    _copy_rows[grid](src, dst, R, C, src.stride(0), dst.stride(0), col_tiles, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C,
                     num_warps=NUM_WARPS)
