"""Fused MoE in Triton, four launches per layer at decode sizes: `_align` groups the (token, k) pairs by local expert
into BM-row blocks (a counting sort; three passes over chunks for many pairs); `_gate_up_silu` computes each block's
gate and up projections with SwiGLU applied on the way out; `_down` the down projection scaled by the routing weight,
one row per pair (`PairRows`); `sum_k` (kernels/fused.py, `PairRows.sum`) adds each token's local pairs in float32,
unless the sublayer-end exchange sums them as it reads them (kernels/symmetric.py). A handful of pairs skips the sort
(`direct`: one pair per block). Each block reads only its expert's weights, so a decode batch that hits 8 experts reads
8 experts. Everything stays on the device (grid sizes are upper bounds fixed by the pair count), so it runs inside CUDA
graphs. Block shapes per size come from `CONFIGS`; at large sizes the weight tiles come in through TMA. A GEMM's
programs are one 1-D grid over (column block, block), its blocks taken in groups (`TileConfig.group`, `_program_tile`)
so that an expert's blocks can read a weight tile back to back. Quantized experts (uint8 rows, kernels/rows.py) are read
as they are held: FP8 rows a 128-column chunk a K step (W8A8, or W8A16), MXFP4 rows in decode's blocks a chunk's codes
at a time into two dots, its low and high nibbles, in larger ones a dequantized tile (W4A16, `linear.mx4_dot`). The
torch reference is `moebius.layers.moe.experts_ref`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from moebius import kernels
from moebius.kernels.fp8_rows import BLOCK, packed_width
from moebius.kernels.fused import silu_mul
from moebius.kernels.linear import (
    FP8_ROWS,
    FP8_WHOLE,
    MXFP4_ROWS,
    PLAIN,
    chunk_scales,
    chunk_values,
    fp8_chunk_product,
    fp8_dot,
    fp8_form,
    mx4_dot,
    quantize_rows,
    scaled_f16,
    store_chunk,
    tile_scale,
    unpack_fp8,
    weight_tile,
)
from moebius.kernels.pairs import PairRows
from moebius.kernels.pdl import enter, pdl
from moebius.kernels.rows import FP8, MXFP4, format_of

_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}  # kernels' DT


@dataclass(frozen=True)
class TileConfig:
    """One GEMM launch's tile shape."""

    BN: int
    BK: int
    num_warps: int
    num_stages: int
    tma: bool = False  # weight tiles (and down's activation tiles) through TMA descriptors, where the GPU has TMA
    # blocks whose programs interleave (`_program_tile`): an expert's blocks in one group read each weight tile at
    # about the same time, the second read from L2; 1: each block's column blocks in turn
    group: int = 1
    # a sorted block (of 32 rows or more) whose second half holds no pair, an expert's last, multiplies its first
    # BM / 2 rows only (`_gate_up_silu`'s HALVES): the padding's FLOPs halved where an expert's pairs just pass a
    # block (down's activation tiles then through pointers, not TMA)
    halves: bool = False




@dataclass(frozen=True)
class MoEConfig:
    BM: int  # rows (pairs) per block: every block belongs to one expert
    gate_up: TileConfig
    down: TileConfig


# (largest mean pairs per hit expert, config), tuned on H200 for Qwen3-30B-A3B shards at decode sizes
# (`python benchmarks/kernels/moe_tune.py`): few pairs per expert stream weights through narrow column blocks; many
# pairs per expert need taller blocks so each weight tile is read fewer times.
CONFIGS: list[tuple[float, MoEConfig]] = [
    (2.5, MoEConfig(16, TileConfig(32, 128, 4, 4), TileConfig(128, 128, 4, 3))),
    (12.0, MoEConfig(16, TileConfig(64, 128, 4, 3), TileConfig(128, 128, 4, 3))),
    (24.0, MoEConfig(32, TileConfig(64, 128, 4, 3), TileConfig(128, 64, 4, 3))),
    (64.0, MoEConfig(64, TileConfig(64, 64, 4, 3), TileConfig(128, 64, 8, 3))),
    # one 128-row block an expert up to 96 pairs (each weight tile read once): faster than 64-row blocks in the search
    # at DeepSeek-V2-Lite's batch 1024 (benchmarks/results/h100-p1-moe-tune-deepseek-v2-lite-db85cbd.json)
    (96.0, MoEConfig(128, TileConfig(64, 64, 8, 3), TileConfig(128, 128, 8, 3, tma=True))),
    # TMA only for the largest blocks: it measured faster at many thousands of pairs and no better below
    # (`python benchmarks/kernels/moe_tune.py --no-search`; benchmarks/results/h200-moe-tma.json)
    (float("inf"), MoEConfig(128, TileConfig(128, 64, 8, 4, tma=True), TileConfig(128, 64, 8, 3, tma=True))),
]


@functools.cache
def tma_available(device_index: int) -> bool:
    """Hopper or newer, and a Triton with host-side tensor descriptors."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def _descriptor(t: torch.Tensor, block: list[int]) -> object:
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


def _use_tma(c: TileConfig, *tensors: torch.Tensor) -> bool:
    """TMA wants contiguous tensors (viewed as 2-D) with 16-byte aligned bases and rows."""
    return c.tma and tensors[0].is_cuda and tma_available(tensors[0].device.index or 0) and all(
        t.is_contiguous() and t.data_ptr() % 16 == 0 and t.shape[-1] * t.element_size() % 16 == 0 for t in tensors)


# Up to this many pairs the GEMMs take one pair per block, unsorted (`direct`): no align launch
DIRECT_MAX_PAIRS = 32

# W8A16's gate/up takes float16 dots on each chunk's float8 values, the block scales on the products
# (`fp8_chunk_product`), in blocks of up to this many rows (decode's); larger blocks dequantize the weight tile
# once for all their rows, where a product a chunk beside the two accumulators spills (compiled for sm_90: 1488 bytes
# of stack at 128-row blocks; tests/test_kernels_sm90.py)
CHUNK_DOTS_MAX_BM = 32
_CHUNK_DOTS_MAX_BM = tl.constexpr(CHUNK_DOTS_MAX_BM)


def chunk_dots(fmt: int, act8: bool, BM: int) -> bool:
    """Whether gate/up on weights of format `fmt` (`_row_tiles`) in BM-row blocks takes the chunk dots (W8A16 on FP8
    rows in decode's blocks: `_gate_up_rows`' CHUNK_DOTS, the kernel's side of this rule), x then as `scaled_f16`
    rows where it is 16-bit."""
    return fmt in (FP8_ROWS.value, FP8_WHOLE.value) and not act8 and BM <= CHUNK_DOTS_MAX_BM


# FP8 rows' own table (their BK and stages are the format's, `_row_tiles`: BN, warps and BM are what differ), searched
# on an H100 at Qwen3-30B-A3B's shapes (moe_tune.py --quantization fp8, benchmarks/results/h100-p1-moe-tune-fp8.json):
# bf16's 128-row TMA blocks were slower than 64-row blocks at prompt sizes, and bf16's 32-row blocks lost to 16
# at 16 pairs an expert. From 64 pairs an expert, 128-row blocks without TMA: faster than 64-row ones at 128 and 256
# pairs, slower at 32 (benchmarks/results/h100-p1-fp8-prefill-moe.json, `fp8_direct`). W8A8's (`table_for`) keeps
# 64-row blocks: 128-row ones (gate/up 64 columns wide) were no faster with one scale a tile
# (benchmarks/results/h100-p1-moe-fp8-tile-scale.json, `v128a`). Its gate/up tiles are 128 columns, each row of h one
# quantization group quantized as stored (narrower ones leave h to `quantize_rows`: `gate_up`).
_FP8_BM64 = MoEConfig(64, TileConfig(128, 128, 8, 3), TileConfig(128, 128, 4, 3))
FP8_CONFIGS: list[tuple[float, MoEConfig]] = [
    (2.5, MoEConfig(16, TileConfig(32, 128, 4, 3), TileConfig(64, 128, 4, 3))),
    (12.0, MoEConfig(16, TileConfig(64, 128, 4, 3), TileConfig(64, 128, 4, 3))),
    (24.0, MoEConfig(16, TileConfig(32, 128, 4, 3), TileConfig(128, 128, 4, 3))),
    (64.0, _FP8_BM64),
    (float("inf"), MoEConfig(128, TileConfig(128, 128, 8, 3), TileConfig(128, 128, 4, 3))),
]
W8A8_CONFIGS: list[tuple[float, MoEConfig]] = [
    (12.0, MoEConfig(16, TileConfig(128, 128, 4, 3), TileConfig(64, 128, 4, 3))),
    (24.0, MoEConfig(16, TileConfig(128, 128, 4, 3), TileConfig(128, 128, 4, 3))),
    (float("inf"), _FP8_BM64),
]

# MXFP4 rows' own table: CONFIGS with decode's 16-row blocks up to 24 pairs an expert, where their codes go straight
# into the dots; CONFIGS' 32-row blocks dequantize a tile, spill (benchmarks/kernels/moe_spills.py) and were slower
# in the search at gpt-oss-20b's batch 128 (benchmarks/results/h100-p1-moe-tune-mxfp4-128.json; docs/performance.md).
MXFP4_CONFIGS: list[tuple[float, MoEConfig]] = [CONFIGS[0], (24.0, CONFIGS[1][1]), *CONFIGS[3:]]

# bf16 experts of a shape searched on its own, by (intermediate columns a rank holds, hidden columns): CONFIGS up to 24
# pairs an expert and past the search's sizes (prompts), the search's best between. GPT-OSS's (2880, 2880) on one
# rank, searched on an H100 (`moe_tune.py --preset gpt-oss-20b`): from 48 pairs an expert one 128-row block an expert
# (each weight tile read once) beat CONFIGS' 64-row blocks; half blocks were no slower there
# (benchmarks/results/h100-p1-moe-halves-gpt-oss-20b.json, docs/performance.md).
SHAPE_CONFIGS: dict[tuple[int, int], list[tuple[float, MoEConfig]]] = {
    (2880, 2880): [*CONFIGS[:3],
                   (48.0, MoEConfig(64, TileConfig(64, 128, 4, 4), TileConfig(64, 64, 4, 4))),
                   (96.0, MoEConfig(128, TileConfig(128, 64, 8, 4, tma=True, halves=True),
                                    TileConfig(128, 64, 8, 3, halves=True))),
                   (192.0, MoEConfig(128, TileConfig(64, 64, 4, 3, halves=True),
                                     TileConfig(128, 64, 4, 3, tma=True, halves=True))),
                   CONFIGS[-1]],
}


def pick_config(pairs_per_expert: float, table: list[tuple[float, MoEConfig]] = CONFIGS) -> MoEConfig:
    return next(c for limit, c in table if pairs_per_expert <= limit)


def config_for(num_pairs: int, num_experts: int, num_ranks_sharing: int = 1,
               table: list[tuple[float, MoEConfig]] = CONFIGS) -> MoEConfig:
    """num_pairs: all (token, k) pairs handed in; about 1/num_ranks_sharing of them are local (EP). table: the
    weights' format's (`table_for`)."""
    local = num_pairs / num_ranks_sharing
    hit = num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** local) if local else 1.0
    return pick_config(local / max(hit, 1.0), table)


def table_for(w13_EFD: torch.Tensor, D: int, act8: bool = False) -> list[tuple[float, MoEConfig]]:
    """The block-shape table of experts held as `w13_EFD` with D input columns: FP8 rows' own (act8, W8A8:
    `W8A8_CONFIGS`), MXFP4 rows' own; bf16 ones of a shape searched on its own, its own (`SHAPE_CONFIGS`); else
    `CONFIGS`."""
    if w13_EFD.dtype != torch.uint8:
        return SHAPE_CONFIGS.get((w13_EFD.shape[1] // 2, D), CONFIGS)
    if format_of(w13_EFD, D) is FP8:
        return W8A8_CONFIGS if act8 else FP8_CONFIGS
    return MXFP4_CONFIGS


@triton.jit
def _local_keys(Ids, offs, N, first, E):
    key = tl.load(Ids + offs, mask=offs < N, other=-1).to(tl.int32) - first
    ok = (offs < N) & (key >= 0) & (key < E)
    return tl.where(ok, key, 0), ok


@triton.jit
def _block_experts(first, blocks, bins, E, BlockExpert, max_blocks, part, parts, CHUNK: tl.constexpr):
    """BlockExpert of the experts e with e % parts == part (first: each expert's first block, blocks: its count,
    0 past E), all of them at once a block of theirs at a time (as many rounds as the most blocks one has: a few at
    decode sizes), and E in this part's share of the blocks past the last expert's. Comparing every block with every
    expert's end instead cost most of the one-program pass at 128 experts
    (benchmarks/results/h100-p1-align-phases-f6f3178.json; this way: h100-p1-align-phases.json)."""
    mine = tl.where(bins % parts == part, blocks, 0)
    for j in range(0, tl.max(mine, 0)):
        tl.store(BlockExpert + first + j, bins, mask=j < mine)
    for b0 in range(tl.sum(blocks, 0) + part * CHUNK, max_blocks, parts * CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        tl.store(BlockExpert + b, E, mask=b < max_blocks)


@triton.jit
def _plan_blocks(counts, bins, E, BlockExpert, SortedIds, N, num_rows, max_blocks, BM: tl.constexpr,
                 CHUNK: tl.constexpr):
    """From per-expert pair counts [EB]: write BlockExpert and pad SortedIds with N; return each expert's first
    row (a multiple of BM)."""
    blocks = tl.where(bins < E, (counts + BM - 1) // BM, 0)
    first = tl.cumsum(blocks, 0) - blocks
    _block_experts(first, blocks, bins, E, BlockExpert, max_blocks, 0, 1, CHUNK)
    for r0 in range(0, num_rows, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        tl.store(SortedIds + r, N, mask=r < num_rows)
    return first * BM


# The align passes take step-sized counts (pairs, rows, blocks, chunks) unspecialized: Triton would otherwise compile
# another variant wherever one happens to be 1 or a multiple of 16, which the start-up warm-up's token counts
# cannot all foresee (block and chunk counts are not linear in the tokens), and a request would wait for it.
@triton.jit(do_not_specialize=["N", "num_rows", "max_blocks"])
def _align(Ids, N, first, E, SortedIds, BlockExpert, Cursor, num_rows, max_blocks, BM: tl.constexpr,
           EB: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """All pairs in one program (N <= CHUNK). Pairs of local expert e get rows [start_e, start_e + count_e) of
    SortedIds; unused rows hold N. BlockExpert[b] is the expert of rows [b*BM, (b+1)*BM), E past the last."""
    enter(PDL)
    bins = tl.arange(0, EB)
    offs = tl.arange(0, CHUNK)
    key, ok = _local_keys(Ids, offs, N, first, E)
    starts = _plan_blocks(tl.histogram(key, EB, mask=ok), bins, E, BlockExpert, SortedIds, N, num_rows,
                          max_blocks, BM, CHUNK)
    tl.store(Cursor + bins, starts)
    tl.debug_barrier()  # cursors and padding are written before any pair claims a row
    # rows within an expert are claimed in any order: each pair's result depends only on its own row. Relaxed (the
    # barrier orders the cursors' stores before; the rows are read by later launches): the default acq_rel puts a
    # GPU-wide fence and an L1 invalidation around every pair's atomic, one after another
    row = tl.atomic_add(Cursor + key, 1, mask=ok, sem="relaxed")
    tl.store(SortedIds + row, offs, mask=ok)


@triton.jit(do_not_specialize=["N", "num_rows"])
def _align_count(Ids, N, first, E, Partial, SortedIds, num_rows, EB: tl.constexpr, CHUNK: tl.constexpr,
                 PDL: tl.constexpr):
    """Many chunks, first pass: each program counts its chunk's pairs per expert and pads its strip of SortedIds
    with N (the scatter pass, a later launch, overwrites the rows pairs claim)."""
    enter(PDL)
    c = tl.program_id(0)
    key, ok = _local_keys(Ids, c * CHUNK + tl.arange(0, CHUNK), N, first, E)
    tl.store(Partial + c * EB + tl.arange(0, EB), tl.histogram(key, EB, mask=ok))
    strip = tl.cdiv(num_rows, tl.num_programs(0))
    for r0 in range(c * strip, tl.minimum((c + 1) * strip, num_rows), CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        tl.store(SortedIds + r, N, mask=r < tl.minimum((c + 1) * strip, num_rows))


@triton.jit(do_not_specialize=["num_chunks"])
def _align_plan(Partial, num_chunks, E, Cursor, Ends, BM: tl.constexpr, EB: tl.constexpr, CB: tl.constexpr,
                PDL: tl.constexpr):
    """Second pass (one program, expert-sized work only): the experts' padded ends and each chunk's first row per
    expert."""
    enter(PDL)
    bins = tl.arange(0, EB)
    counts = tl.zeros([EB], tl.int32)
    for c0 in range(0, num_chunks, CB):
        c = c0 + tl.arange(0, CB)
        counts += tl.sum(tl.load(Partial + c[:, None] * EB + bins[None, :], mask=(c < num_chunks)[:, None],
                                 other=0), axis=0)
    padded = tl.where(bins < E, (counts + BM - 1) // BM * BM, 0)
    ends = tl.cumsum(padded, 0)
    tl.store(Ends + bins, ends)
    run = ends - padded
    for c0 in range(0, num_chunks, CB):
        c = c0 + tl.arange(0, CB)
        part = tl.load(Partial + c[:, None] * EB + bins[None, :], mask=(c < num_chunks)[:, None], other=0)
        tl.store(Cursor + c[:, None] * EB + bins[None, :], run[None, :] + tl.cumsum(part, 0) - part,
                 mask=(c < num_chunks)[:, None])
        run += tl.sum(part, axis=0)


@triton.jit(do_not_specialize=["N", "max_blocks"])
def _align_scatter(Ids, N, first, E, Cursor, SortedIds, Ends, BlockExpert, max_blocks, BM: tl.constexpr,
                   EB: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Third pass: each chunk's pairs claim rows from the chunk's own cursors (no contention across programs), and
    each program writes the blocks of every num_programs-th expert and its share of those past the last (E)."""
    enter(PDL)
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    key, ok = _local_keys(Ids, offs, N, first, E)
    row = tl.atomic_add(Cursor + c * EB + key, 1, mask=ok, sem="relaxed")  # (relaxed: as `_align`'s)
    tl.store(SortedIds + row, offs, mask=ok)
    bins = tl.arange(0, EB)
    ends = tl.load(Ends + bins)
    starts = tl.load(Ends + bins - 1, mask=bins > 0, other=0)
    _block_experts(starts // BM, (ends - starts) // BM, bins, E, BlockExpert, max_blocks, c, tl.num_programs(0),
                   CHUNK)


@triton.jit
def _block(Rows, BlockExpert, blk, N, first, BM: tl.constexpr, DIRECT: tl.constexpr, ROWS: tl.constexpr):
    """Block blk's expert (local index; outside [0, E): nothing to do), the pair of each of its first ROWS rows (N:
    none) and the rows they own of the buffer between the GEMMs. Sorted: Rows holds the sorted pair ids. DIRECT: one
    pair per block, no sort; Rows holds the routing's expert ids."""
    i = tl.arange(0, ROWS)
    if DIRECT:
        e = tl.load(Rows + blk).to(tl.int32) - first
        return e, tl.where(i == 0, blk, N), tl.where(i == 0, blk, 0)
    else:
        rows = blk * BM + i
        return tl.load(BlockExpert + blk), tl.load(Rows + rows), rows


@triton.jit
def _program_tile(NB, GB: tl.constexpr):
    """(column block, block) of this program in a 1-D grid of NB column blocks x the blocks: the blocks in groups of
    GB, a group's blocks varying fastest, then its column blocks (matmul's grouped ordering): blocks of one expert
    in a group take the same weight tile one after another. The used (low) blocks are scheduled first."""
    pid = tl.program_id(0)
    blocks = tl.num_programs(0) // NB
    first = pid // (GB * NB) * GB
    size = tl.minimum(blocks - first, GB)
    within = pid - first * NB
    return within // size, first + within % size


@triton.jit
def _gate_up_silu(X, XR, W13, Rows, BlockExpert, Out, N, D, I, E, first, WS, XS, OS, B13, alpha, limit,
                  K_TOP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr,
                  DIRECT: tl.constexpr, FMT: tl.constexpr, ACT8: tl.constexpr, DT: tl.constexpr, BIAS: tl.constexpr,
                  CLAMPED: tl.constexpr, GB: tl.constexpr, HALVES: tl.constexpr, PDL: tl.constexpr):
    """W13: the [E * 2I, D] weights (row stride WS), as a pointer or (TMA) a descriptor of [BN, BK] tiles; FMT: their
    format (`weight_tile`: plain, or FP8 or MXFP4 rows of WS bytes). X [T, D] and Out [rows, I] in DT, but for FP8
    rows in W8A16 in blocks of up to CHUNK_DOTS_MAX_BM rows, where X is float16 rows times XR's powers of two a row
    (`linear.scaled_f16`; or float32) and each K step is the chunk's exact float8 values in X's dtype, its product
    times the block scales (`fp8_chunk_product`; larger blocks take the dequantized tile); ACT8 (FP8 rows only,
    W8A8): X is FP8 rows of XS bytes (each token's 128-column groups quantized once, `quantize_rows`), float8 dots,
    and Out FP8 rows of OS bytes (uint8: each row of this program's 128-column output tile one group, quantized as
    it is stored) or, where `gate_up` gave narrower tiles, values in DT that it quantizes after the launch.
    BIAS: B13 [E, 2I] added to gate and up. CLAMPED: GPT-OSS's activation (`ClampedSwiGLU`: gate
    clamped above at `limit`, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)) instead of
    silu(gate) * up. HALVES (sorted blocks): a block whose second half holds no pair multiplies its first half only
    (an expert's pairs fill its rows from the first, `_align`, so its row BM / 2 tells)."""
    enter(PDL)
    nb, blk = _program_tile(tl.cdiv(I, BN), GB)
    if HALVES and (tl.load(Rows + blk * BM + BM // 2) >= N):
        _gate_up_rows(X, XR, W13, Rows, BlockExpert, Out, N, D, I, E, first, WS, XS, OS, B13, alpha, limit, nb, blk,
                      K_TOP, BM, BM // 2, BN, BK, TMA, DIRECT, FMT, ACT8, DT, BIAS, CLAMPED)
    else:
        _gate_up_rows(X, XR, W13, Rows, BlockExpert, Out, N, D, I, E, first, WS, XS, OS, B13, alpha, limit, nb, blk,
                      K_TOP, BM, BM, BN, BK, TMA, DIRECT, FMT, ACT8, DT, BIAS, CLAMPED)


@triton.jit
def _gate_up_rows(X, XR, W13, Rows, BlockExpert, Out, N, D, I, E, first, WS, XS, OS, B13, alpha, limit, nb, blk,
                  K_TOP: tl.constexpr, BM: tl.constexpr, ROWS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  TMA: tl.constexpr, DIRECT: tl.constexpr, FMT: tl.constexpr, ACT8: tl.constexpr, DT: tl.constexpr,
                  BIAS: tl.constexpr, CLAMPED: tl.constexpr):
    """`_gate_up_silu`'s column block nb of block blk's first ROWS rows."""
    e, pair, rows = _block(Rows, BlockExpert, blk, N, first, BM, DIRECT, ROWS)
    if (e >= 0) & (e < E):  # sorted: blocks past the last expert's are padding; direct: another rank's expert
        ok = pair < N
        tok = tl.where(ok, pair // K_TOP, 0).to(tl.int64)
        n = nb * BN + tl.arange(0, BN)
        nm = n < I
        kk = tl.arange(0, BK)
        acc_g = tl.zeros([ROWS, BN], tl.float32)
        acc_u = tl.zeros([ROWS, BN], tl.float32)
        FP8: tl.constexpr = FMT == FP8_ROWS or FMT == FP8_WHOLE
        # (a tile's gate rows lie in one 128-row block, and so do its up rows: one scale each, `tile_scale`)
        tl.static_assert(not FP8 or 128 % BN == 0, "FP8 rows' tiles are whole 128-row blocks or parts of one")
        r0 = nb * BN
        CHUNK_DOTS: tl.constexpr = FP8 and not ACT8 and BM <= _CHUNK_DOTS_MAX_BM
        if CHUNK_DOTS:  # W8A16: float16 (or float32) dots on the chunks' exact values, the scales a chunk ahead
            wbase = W13 + e.to(tl.int64) * 2 * I * WS
            sg, su = tile_scale(wbase, r0, 0, D, WS, FMT), tile_scale(wbase, I + r0, 0, D, WS, FMT)
            for k0 in range(0, D, BK):
                kn = tl.minimum(k0 + BK, D - 1)  # (past the last chunk: the last)
                sg_n, su_n = tile_scale(wbase, r0, kn, D, WS, FMT), tile_scale(wbase, I + r0, kn, D, WS, FMT)
                a = tl.load(X + tok[:, None] * D + (k0 + kk)[None, :], mask=ok[:, None] & (k0 + kk < D)[None, :],
                            other=0.0)
                acc_g += fp8_chunk_product(a, wbase, n, nm, k0, D, WS, sg, FMT)
                acc_u += fp8_chunk_product(a, wbase, I + n, nm, k0, D, WS, su, FMT)
                sg, su = sg_n, su_n
            if X.dtype.element_ty == tl.float16:  # the rows' powers of two (`scaled_f16`)
                r = tl.load(XR + tok, mask=ok, other=1.0)[:, None]
                acc_g, acc_u = acc_g * r, acc_u * r
        else:
            for k0 in range(0, D, BK):
                if ACT8:  # the tokens' quantized groups, one tile for both halves
                    wbase = W13 + e.to(tl.int64) * 2 * I * WS
                    aq = chunk_values(X, tok, ok, k0, D, XS, FP8_ROWS)
                    sa = chunk_scales(X, tok, ok, k0, D, XS, FP8_ROWS)
                    acc_g = fp8_dot(aq, sa, wbase, n, nm, k0, D, WS, tile_scale(wbase, r0, k0, D, WS, FMT), acc_g,
                                    False, FMT)
                    acc_u = fp8_dot(aq, sa, wbase, I + n, nm, k0, D, WS, tile_scale(wbase, I + r0, k0, D, WS, FMT),
                                    acc_u, False, FMT)
                elif FMT == MXFP4_ROWS:
                    wbase = W13 + e.to(tl.int64) * 2 * I * WS
                    acc_g = mx4_dot(X, tok, ok, D, wbase, n, nm, k0, D, WS, acc_g, BK)
                    acc_u = mx4_dot(X, tok, ok, D, wbase, I + n, nm, k0, D, WS, acc_u, BK)
                else:
                    km = k0 + kk < D
                    a = tl.load(X + tok[:, None] * D + (k0 + kk)[None, :], mask=ok[:, None] & km[None, :], other=0.0)
                    if TMA:  # rows past this expert's gate (or up) half only reach masked-off columns
                        g = W13.load([e * 2 * I + nb * BN, k0])
                        u = W13.load([e * 2 * I + I + nb * BN, k0])
                    else:
                        wbase = W13 + e.to(tl.int64) * 2 * I * WS
                        g = weight_tile(wbase, n, nm, k0, D, WS, BK, FMT, DT)
                        u = weight_tile(wbase, I + n, nm, k0, D, WS, BK, FMT, DT)
                    acc_g = tl.dot(a, tl.trans(g), acc_g)
                    acc_u = tl.dot(a, tl.trans(u), acc_u)
        if BIAS:
            bb = B13 + e.to(tl.int64) * 2 * I
            acc_g += tl.load(bb + n, mask=nm, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(bb + I + n, mask=nm, other=0.0).to(tl.float32)[None, :]
        gb = acc_g.to(DT).to(tl.float32)  # round like the unfused bf16 GEMM output
        ub = acc_u.to(DT).to(tl.float32)
        if CLAMPED:
            gc = tl.minimum(gb, limit)
            uc = tl.minimum(tl.maximum(ub, -limit), limit)
            h = (uc + 1.0) * (gc / (1.0 + tl.exp(-alpha * gc)))
        else:
            h = silu_mul(gb, ub, DT)
        if Out.dtype.element_ty == tl.uint8:  # a row of the tile one group (masked columns hold 0: its scale stays)
            tl.static_assert(ACT8 and BN == 128, "h is quantized as stored by W8A8's 128-column tiles only")
            store_chunk(Out, rows, ok, nb, OS, h.to(DT))
        else:
            tl.store(Out + rows.to(tl.int64)[:, None] * I + n[None, :], h.to(DT), mask=ok[:, None] & nm[None, :])


@triton.jit
def _down(H, W2, Rows, BlockExpert, RouteW, Out, N, D, I, E, first, WS, HS, B2, BM: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr, TMA_H: tl.constexpr, DIRECT: tl.constexpr,
          FMT: tl.constexpr, ACT8: tl.constexpr, BIAS: tl.constexpr, GB: tl.constexpr, HALVES: tl.constexpr,
          PDL: tl.constexpr):
    """H [rows, I] and W2 [E * D, I] (row stride WS): pointers, or descriptors (W2: TMA, of [BN, BK] tiles; H: TMA_H,
    sorted blocks, of [BM, BK] tiles); FMT: W2's format (`weight_tile`: plain, or FP8 or MXFP4 rows of WS bytes);
    ACT8 (FP8 rows only, W8A8): H is FP8 rows of HS bytes (`_gate_up_silu` quantized them), float8 dots. BIAS: B2
    [E, D] added before the routing weight. HALVES: as `_gate_up_silu`'s."""
    enter(PDL)
    nb, blk = _program_tile(tl.cdiv(D, BN), GB)
    if HALVES and (tl.load(Rows + blk * BM + BM // 2) >= N):
        _down_rows(H, W2, Rows, BlockExpert, RouteW, Out, N, D, I, E, first, WS, HS, B2, nb, blk, BM, BM // 2, BN,
                   BK, TMA, TMA_H, DIRECT, FMT, ACT8, BIAS)
    else:
        _down_rows(H, W2, Rows, BlockExpert, RouteW, Out, N, D, I, E, first, WS, HS, B2, nb, blk, BM, BM, BN, BK,
                   TMA, TMA_H, DIRECT, FMT, ACT8, BIAS)


@triton.jit
def _down_rows(H, W2, Rows, BlockExpert, RouteW, Out, N, D, I, E, first, WS, HS, B2, nb, blk, BM: tl.constexpr,
               ROWS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr, TMA_H: tl.constexpr,
               DIRECT: tl.constexpr, FMT: tl.constexpr, ACT8: tl.constexpr, BIAS: tl.constexpr):
    """`_down`'s column block nb of block blk's first ROWS rows."""
    e, pair, rows = _block(Rows, BlockExpert, blk, N, first, BM, DIRECT, ROWS)
    if (e >= 0) & (e < E):
        ok = pair < N
        n = nb * BN + tl.arange(0, BN)
        nm = n < D
        kk = tl.arange(0, BK)
        acc = tl.zeros([ROWS, BN], tl.float32)
        tl.static_assert(not ACT8 or 128 % BN == 0, "FP8 rows' tiles are whole 128-row blocks or parts of one")
        for k0 in range(0, I, BK):
            if TMA_H:  # padding rows of H hold garbage: their results are never stored
                a = H.load([blk * BM, k0])
            elif FMT != MXFP4_ROWS and not ACT8:
                km = k0 + kk < I
                a = tl.load(H + rows.to(tl.int64)[:, None] * I + (k0 + kk)[None, :], mask=ok[:, None] & km[None, :],
                            other=0.0)
            if TMA:
                b = W2.load([e * D + nb * BN, k0])
            elif FMT == MXFP4_ROWS:
                acc = mx4_dot(H, rows, ok, I, W2 + e.to(tl.int64) * D * WS, n, nm, k0, I, WS, acc, BK)
            elif not ACT8:
                b = weight_tile(W2 + e.to(tl.int64) * D * WS, n, nm, k0, I, WS, BK, FMT, a.dtype)
            if ACT8:
                aq = chunk_values(H, rows, ok, k0, I, HS, FP8_ROWS)
                sa = chunk_scales(H, rows, ok, k0, I, HS, FP8_ROWS)
                w2base = W2 + e.to(tl.int64) * D * WS
                acc = fp8_dot(aq, sa, w2base, n, nm, k0, I, WS, tile_scale(w2base, nb * BN, k0, I, WS, FMT), acc,
                              False, FMT)
            elif FMT != MXFP4_ROWS:
                acc = tl.dot(a, tl.trans(b), acc)
        if BIAS:
            acc += tl.load(B2 + e.to(tl.int64) * D + n, mask=nm, other=0.0).to(tl.float32)[None, :]
        w = tl.load(RouteW + tl.where(ok, pair, 0), mask=ok, other=0.0).to(tl.float32)
        y = acc.to(Out.dtype.element_ty).to(tl.float32) * w[:, None]
        tl.store(Out + tl.where(ok, pair, 0).to(tl.int64)[:, None] * D + n[None, :], y.to(Out.dtype.element_ty),
                 mask=ok[:, None] & nm[None, :])


@dataclass
class Blocks:
    """The GEMMs' work: programs of BM rows, each row a (token, k) pair of the block's expert."""

    rows: torch.Tensor  # sorted: pair ids [max_blocks * BM] int32 (N: unused row); direct: expert ids [N]
    block_expert: torch.Tensor | None  # sorted: [max_blocks] int32, E past the last used block; direct: None
    max_blocks: int
    BM: int
    first_expert: int = 0  # direct: the first local expert id

    @property
    def direct(self) -> bool:
        return self.block_expert is None

    @property
    def table(self) -> torch.Tensor:
        """The kernels' BlockExpert argument (direct: unread, the rows stand in)."""
        return self.rows if self.block_expert is None else self.block_expert

    @property
    def num_rows(self) -> int:
        """Rows of the buffer between the GEMMs (direct: one per pair)."""
        return self.rows.numel() if self.direct else self.max_blocks * self.BM


def direct(ids_TK: torch.Tensor, first_expert: int, BM: int) -> Blocks:
    """One block per pair, no sort (nothing to launch): for a handful of pairs, where the sort would cost more
    than reading an expert twice when two pairs share it (never within a token: its top-k are distinct)."""
    return Blocks(ids_TK.reshape(-1), None, ids_TK.numel(), BM, first_expert)


def align(ids_TK: torch.Tensor, first_expert: int, E: int, BM: int, *,
          kc: kernels.KernelConfig = kernels.DEFAULT_KERNELS) -> Blocks:
    """Pairs grouped by local expert into BM-row blocks: sorted pair ids, N for unused rows; the expert of each
    block, E for unused blocks. max_blocks bounds the blocks any routing of these pairs can need. One program when
    the pairs fit one chunk; else count, plan and scatter passes over chunks (a single program's atomics would
    wait on each other chunk after chunk); the chunk passes spread the padding and the block table over their
    programs, leaving the one-program pass only expert-sized work."""
    N = ids_TK.numel()
    max_blocks = (N + min(E, N) * (BM - 1)) // BM
    dev = ids_TK.device
    sorted_ids = torch.empty(max_blocks * BM, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    EB = triton.next_power_of_2(E + 1)
    CHUNK = 1024
    chunks = triton.cdiv(N, CHUNK)
    if chunks == 1:
        cursor = torch.empty(EB, dtype=torch.int32, device=dev)
        _align[(1,)](ids_TK, N, first_expert, E, sorted_ids, block_expert, cursor, max_blocks * BM, max_blocks,
                     BM=BM, EB=EB, CHUNK=CHUNK, num_warps=8, **pdl(ids_TK, kc))
    else:
        partial = torch.empty(chunks, EB, dtype=torch.int32, device=dev)
        cursor = torch.empty(chunks, EB, dtype=torch.int32, device=dev)
        ends = torch.empty(EB, dtype=torch.int32, device=dev)
        _align_count[(chunks,)](ids_TK, N, first_expert, E, partial, sorted_ids, max_blocks * BM, EB=EB,
                                CHUNK=CHUNK, num_warps=8, **pdl(ids_TK, kc))
        _align_plan[(1,)](partial, chunks, E, cursor, ends, BM=BM, EB=EB, CB=max(1, min(16, 4096 // EB)),
                          num_warps=8, **pdl(ids_TK, kc))
        _align_scatter[(chunks,)](ids_TK, N, first_expert, E, cursor, sorted_ids, ends, block_expert, max_blocks,
                                  BM=BM, EB=EB, CHUNK=CHUNK, num_warps=8, **pdl(ids_TK, kc))
    return Blocks(sorted_ids, block_expert, max_blocks, BM)


# MXFP4 rows' K step: two 32-column chunks. A multiple of 32 (whole chunks: a chunk's mask is its columns'), it
# divides GPT-OSS's hidden size 2880 (45 steps, no masked tail, where 128 would leave half a tile), and a step's
# decoded tiles are half those of BK = 128: compiled for sm_90 (Triton 3.6), the decode-size configs spill no registers
# at 64 and spill at 128. Not yet tuned on a GPU (moe_tune.py).
MXFP4_BK = 64
FP8_MAX_STAGES = 3


def _row_tiles(c: TileConfig, w: torch.Tensor, K: int, kc: kernels.KernelConfig) -> tuple[TileConfig, int, bool]:
    """The tile config for weights `w` of K reduction columns, their format (`weight_tile`'s FMT) and whether the
    activations are quantized to float8 too (FP8 rows with kc.fp8_activations). Quantized rows (uint8, format by
    row width: `kernels.rows.format_of`) go without TMA: FP8 rows one 128-column chunk a K step, MXFP4 rows MXFP4_BK."""
    if w.dtype != torch.uint8:
        return c, PLAIN.value, False
    f = format_of(w, K)
    if f is FP8:  # (a 128-column chunk a step doubles the tuned 64-column tiles: four stages of them outgrow
        # Hopper's shared memory where the rows' stride lets Triton copy them ahead, tests/test_kernels_sm90.py)
        return (replace(c, BK=BLOCK[1], num_stages=min(c.num_stages, FP8_MAX_STAGES), tma=False), fp8_form(w, K),
                kc.fp8_activations)
    assert f is MXFP4, f
    return replace(c, BK=MXFP4_BK, tma=False), MXFP4_ROWS.value, False


def gate_up(x_TD: torch.Tensor, w13_EFD: torch.Tensor, blocks: Blocks, K: int, c: TileConfig, *,
            kc: kernels.KernelConfig = kernels.DEFAULT_KERNELS, b13_EF: torch.Tensor | None = None,
            clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """h [rows, I] of the blocks' pairs. clamp: (alpha, limit) of GPT-OSS's activation (`_gate_up_silu`'s CLAMPED);
    None: silu(gate) * up. FP8 rows in W8A8 (kc.fp8_activations): x quantized once (`linear.quantize_rows`), and h
    returned as FP8 rows of I columns (`down` takes them with cols=I), quantized as stored by 128-column tiles (a row
    of a tile one group), after the launch by `quantize_rows` for narrower ones (the same values); in W8A16 in blocks
    of up to CHUNK_DOTS_MAX_BM rows a 16-bit x as float16 rows and a power of two a row (`linear.scaled_f16`), for the
    dots on the chunks' exact values."""
    E, F, WS = w13_EFD.shape
    D, I = x_TD.shape[1], F // 2
    c, fmt, act8 = _row_tiles(c, w13_EFD, D, kc)
    if act8:
        x = quantize_rows(x_TD, kc=kc)
        h = (torch.empty(blocks.num_rows, packed_width(I), dtype=torch.uint8, device=x_TD.device)
             if c.BN == BLOCK[1] else torch.empty(blocks.num_rows, I, dtype=x_TD.dtype, device=x_TD.device))
        xr = x_TD
    elif chunk_dots(fmt, act8, blocks.BM) and x_TD.dtype != torch.float32:  # float16 dots
        x, xr = scaled_f16(x_TD, kc=kc)
        h = torch.empty(blocks.num_rows, I, dtype=x_TD.dtype, device=x_TD.device)
    else:
        x = xr = x_TD
        h = torch.empty(blocks.num_rows, I, dtype=x_TD.dtype, device=x_TD.device)
    tma = _use_tma(c, w13_EFD)
    w = _descriptor(w13_EFD.view(E * F, D), [c.BN, c.BK]) if tma else w13_EFD
    _gate_up_silu[(triton.cdiv(I, c.BN) * blocks.max_blocks,)](
        x, xr, w, blocks.rows, blocks.table, h, x_TD.shape[0] * K, D, I, E, blocks.first_expert, WS, x.stride(0),
        h.stride(0), x_TD if b13_EF is None else b13_EF, *(clamp or (1.0, 0.0)), K_TOP=K, BM=blocks.BM, BN=c.BN,
        BK=c.BK, TMA=tma, DIRECT=blocks.direct, FMT=fmt, ACT8=act8, DT=_TL[x_TD.dtype], BIAS=b13_EF is not None,
        CLAMPED=clamp is not None, GB=c.group, HALVES=_halves(c, blocks), num_warps=c.num_warps,
        num_stages=c.num_stages, **pdl(x_TD, kc))
    return quantize_rows(h, kc=kc) if act8 and h.dtype != torch.uint8 else h


def _halves(c: TileConfig, blocks: Blocks) -> bool:
    """Whether a launch at config c takes half blocks (`TileConfig.halves`): sorted blocks whose halves are rows
    enough for a dot (16)."""
    return c.halves and not blocks.direct and blocks.BM >= 32


def down(h: torch.Tensor, w2_EDF: torch.Tensor, blocks: Blocks, w_TK: torch.Tensor, c: TileConfig, *,
         kc: kernels.KernelConfig = kernels.DEFAULT_KERNELS, b2_ED: torch.Tensor | None = None,
         out: torch.Tensor | None = None, cols: int | None = None, dtype: torch.dtype | None = None
         ) -> torch.Tensor:
    """The pairs' weighted outputs [N, D] (row t * K + k), into `out` where given: only the blocks' pairs' rows are
    written. h as `gate_up` returns it: [rows, I] in the activations' dtype, or (W8A8) FP8 rows of cols = I columns,
    the outputs then in `dtype`, the activations'."""
    E, D, WS = w2_EDF.shape
    N = w_TK.numel()
    quantized = h.dtype == torch.uint8
    if quantized and (cols is None or dtype is None):
        raise ValueError("down: h is FP8 rows (W8A8's gate_up): pass cols (its columns) and dtype (the outputs')")
    I = cols if quantized else h.shape[1]
    c, fmt, act8 = _row_tiles(c, w2_EDF, I, kc)
    if act8 != quantized:
        raise ValueError(f"down: h is {'FP8 rows' if quantized else h.dtype} where the weights and kc ask for "
                         f"{'W8A8 (FP8 rows)' if act8 else 'values'}")
    y = torch.empty(N, D, dtype=dtype if quantized else h.dtype, device=h.device) if out is None else out
    tma = not blocks.direct and _use_tma(c, h, w2_EDF)  # direct blocks' rows are not contiguous BM-row tiles
    halves = _halves(c, blocks)
    tma_h = tma and not halves  # (a half block's rows are not the descriptor's BM-row tile)
    hs = h.stride(0)
    if tma:
        w2_EDF = _descriptor(w2_EDF.view(E * D, I), [c.BN, c.BK])
    if tma_h:
        h = _descriptor(h, [blocks.BM, c.BK])
    _down[(triton.cdiv(D, c.BN) * blocks.max_blocks,)](
        h, w2_EDF, blocks.rows, blocks.table, w_TK, y, N, D, I, E,
        blocks.first_expert, WS, hs, y if b2_ED is None else b2_ED, BM=blocks.BM, BN=c.BN, BK=c.BK, TMA=tma,
        TMA_H=tma_h, DIRECT=blocks.direct, FMT=fmt, ACT8=act8, BIAS=b2_ED is not None, GB=c.group, HALVES=halves,
        num_warps=c.num_warps, num_stages=c.num_stages, **pdl(y, kc))
    return y


# Mean (token, k) pairs an expert of the model from which FP8 rows in W8A16 are unpacked to the activations' dtype
# (`linear.unpack_fp8`) and multiplied by the bf16 kernels, a share of the experts at a time: prompt sizes are
# compute-bound, and the copies cost a pass over the bf16 bytes. The FP8 kernels' 128-row blocks were faster at 256
# pairs an expert, the unpacked experts at 512 (benchmarks/results/h100-p1-fp8-prefill-moe.json).
UNPACK_PAIRS = 512
# The unpacked experts held at once (outside the unified buffer, in what --mem-fraction leaves): every pass adds its
# launches to a prompt step, and with several passes a layer the whole-request prompt steps never let the host wait
# on the device and took longer than in one pass (benchmarks/results/h100-p1-qwen3-30b-fp8-throughput-rerun.json,
# -rerun-onepass.json; docs/performance.md).
UNPACK_BYTES = 2 << 30


def unpack_share(E: int, I: int, D: int, itemsize: int) -> int:
    """The experts a pass of `_unpacked_pairs` unpacks, of E held with I intermediate and D hidden columns, unpacked
    to `itemsize`-byte values (all of Qwen3-30B-A3B's on one rank: one pass)."""
    return max(1, min(E, UNPACK_BYTES // (3 * I * D * itemsize)))


def _unpacked_pairs(x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor, w13_EFD: torch.Tensor,
                    w2_EDF: torch.Tensor, first_expert: int, c: MoEConfig, kc: kernels.KernelConfig,
                    b13_EF: torch.Tensor | None, b2_ED: torch.Tensor | None, clamp: tuple[float, float] | None
                    ) -> PairRows:
    """The pairs' outputs of experts held as FP8 rows, UNPACK_BYTES of them at a time unpacked to x's dtype and run
    through the plain kernels at config c, each pass writing its experts' pairs into one buffer (summed once, as the
    one-pass kernels' pairs are)."""
    T, K = ids_TK.shape
    E, F, _ = w13_EFD.shape
    D, I = x_TD.shape[1], F // 2
    share = unpack_share(E, I, D, x_TD.element_size())
    y = torch.empty(T * K, D, dtype=x_TD.dtype, device=x_TD.device)
    for e0 in range(0, E, share):
        n = min(share, E - e0)
        w13 = unpack_fp8(w13_EFD[e0:e0 + n].flatten(0, 1), D, x_TD.dtype, kc=kc).unflatten(0, (n, F))
        w2 = unpack_fp8(w2_EDF[e0:e0 + n].flatten(0, 1), I, x_TD.dtype, kc=kc).unflatten(0, (n, D))
        blocks = align(ids_TK, first_expert + e0, n, c.BM, kc=kc)
        h = gate_up(x_TD, w13, blocks, K, c.gate_up, kc=kc, clamp=clamp,
                    b13_EF=None if b13_EF is None else b13_EF[e0:e0 + n])
        down(h, w2, blocks, w_TK, c.down, kc=kc, b2_ED=None if b2_ED is None else b2_ED[e0:e0 + n], out=y)
    return PairRows(y, ids_TK, first_expert, E)


def fused_experts(x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor, w13_EFD: torch.Tensor,
                  w2_EDF: torch.Tensor, first_expert: int, num_experts: int | None = None,
                  config: MoEConfig | None = None, keep_pairs: bool = False, *,
                  kc: kernels.KernelConfig = kernels.DEFAULT_KERNELS, b13_EF: torch.Tensor | None = None,
                  b2_ED: torch.Tensor | None = None, clamp: tuple[float, float] | None = None
                  ) -> torch.Tensor | PairRows:
    """num_experts: the model's expert count (local pairs ~ pairs * E_local / num_experts, for block shapes).
    keep_pairs: return the outputs per pair, for a consumer that sums them itself (no `sum_k` launch).
    b13_EF / b2_ED: the experts' biases; clamp: GPT-OSS's activation's (alpha, limit) (`gate_up`). FP8 rows in W8A16
    from UNPACK_PAIRS pairs an expert: unpacked a share at a time, through the plain kernels (`_unpacked_pairs`)."""
    T, K = ids_TK.shape
    E = w13_EFD.shape[0]
    if T == 0:
        return torch.zeros_like(x_TD)
    total = num_experts or E
    table = table_for(w13_EFD, x_TD.shape[1], kc.fp8_activations)
    unpacked = config is None and table is FP8_CONFIGS and T * K >= UNPACK_PAIRS * total
    c = config or config_for(T * K, E, max(1, total // E), CONFIGS if unpacked else table)
    w_TK = w_TK.reshape(-1)
    if not w_TK.is_contiguous():
        w_TK = w_TK.contiguous()
    if unpacked:
        pairs = _unpacked_pairs(x_TD, w_TK, ids_TK, w13_EFD, w2_EDF, first_expert, c, kc, b13_EF, b2_ED, clamp)
        return pairs if keep_pairs else pairs.sum(kc=kc)
    if T * K <= DIRECT_MAX_PAIRS:
        blocks = direct(ids_TK, first_expert, c.BM)
    else:
        blocks = align(ids_TK, first_expert, E, c.BM, kc=kc)
    h = gate_up(x_TD, w13_EFD, blocks, K, c.gate_up, kc=kc, b13_EF=b13_EF, clamp=clamp)
    y = down(h, w2_EDF, blocks, w_TK, c.down, kc=kc, b2_ED=b2_ED, cols=w13_EFD.shape[1] // 2, dtype=x_TD.dtype)
    pairs = PairRows(y, ids_TK, first_expert, E)
    return pairs if keep_pairs else pairs.sum(kc=kc)
