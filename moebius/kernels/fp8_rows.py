"""FP8 rows: block-FP8 weights (128 x 128 blocks, float8_e4m3fn, a float32 scale a block: the FP8 releases' format,
models/fp8_blocks.py) laid out so that a row carries its own scales. Each weight row is cut in 128-column chunks (the
last zero-padded), and the chunks are laid out in segments: a segment of s chunks is their s * 128 float8 bytes,
then their s float32 scales (each chunk's block's scale, repeated on each of its 128 rows), then zeros to a multiple
of 16 bytes, so that every segment starts 16-byte aligned and the kernels read its values in 16-byte vectors (chunks
of 128 values and the 4-byte scale alone left the kernels single-byte or 4-byte loads: docs/performance.md "FP8 and
MXFP4 on a GPU"). A row some layout cuts by columns (down's, a row-parallel projection's: `whole=False`) takes a
segment a chunk, 144 bytes, so that every cut (whole chunks) carries its scales with its values as one byte range;
a row no layout cuts by columns (gate's and up's, q|k|v's: `whole=True`) is one segment, its values then its
scales, 132 bytes a chunk and 32-byte aligned values (the single-chunk segments' odd chunks start 16 bytes into a
sector and read 1.5x their bytes in L2 sectors: benchmarks/results/h100-p1-moe-fp8-trailer-ncu.json). The row's
width tells the two apart (`segment_chunks`). The load, a switch and an update then move FP8 rows as bytes (uint8
tensors), nothing else. `unpack_rows` is transformers' dequantization of the same blocks; `quantize_groups` the
activations' rounding of the W8A8 GEMMs (`KernelConfig.fp8_activations`).
"""

from __future__ import annotations

import itertools

import torch

BLOCK = (128, 128)  # [rows, columns] a scale covers: every release's weight_block_size

SCALE_BYTES = 16  # after a single chunk's values: its block's float32 scale, then zeros (16-byte aligned chunks)
CHUNK = BLOCK[1] + SCALE_BYTES  # bytes of a segment of one chunk (the rows a layout cuts by columns)
ALIGN = 16  # a segment's bytes are a multiple of this
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def segment_bytes(chunks: int) -> int:
    """Bytes of a segment of `chunks` chunks: their values, their float32 scales, zeros to a multiple of 16."""
    return -(-(BLOCK[1] + 4) * chunks // ALIGN) * ALIGN


def packed_width(cols: int, whole: bool = False) -> int:
    """Bytes of an FP8 row of `cols` columns (the last chunk zero-padded to 128): one segment (`whole`), or a
    segment a chunk."""
    chunks = -(-cols // BLOCK[1])
    return segment_bytes(chunks) if whole else chunks * CHUNK


def widths(cols: int) -> tuple[int, int]:
    """The two widths FP8 rows of `cols` columns may have: a segment a chunk, one segment."""
    return packed_width(cols), packed_width(cols, True)


def segment_chunks(width: int, cols: int) -> int:
    """Chunks a segment of FP8 rows of `width` bytes holding `cols` columns: 1, or the row's chunks (one segment;
    a row of one chunk is the same bytes either way). ValueError for a width that is neither."""
    chunks = -(-cols // BLOCK[1])
    if width == chunks * CHUNK:
        return 1
    if width == segment_bytes(chunks):
        return chunks
    raise ValueError(f"FP8 rows of {width} bytes do not hold {cols} columns (a segment a chunk: {chunks * CHUNK} "
                     f"bytes; one segment: {segment_bytes(chunks)})")


def _parts(rows: torch.Tensor, chunks: int, whole: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of FP8 rows [..., width] as their values [..., chunks, 128] and scales' bytes [..., chunks, 4]."""
    if whole:
        return (rows[..., : chunks * BLOCK[1]].unflatten(-1, (chunks, BLOCK[1])),
                rows[..., chunks * BLOCK[1]: chunks * (BLOCK[1] + 4)].unflatten(-1, (chunks, 4)))
    segments = rows.unflatten(-1, (chunks, CHUNK))
    return segments[..., : BLOCK[1]], segments[..., BLOCK[1]: BLOCK[1] + 4]


def block_scales(w: torch.Tensor) -> torch.Tensor:
    """[..., ceil(R / 128), ceil(C / 128)] float32 scales of w [..., R, C] quantized by blocks (`pack_rows`): each
    block's largest magnitude over float8's largest (1 for an all-zero block), as transformers' FP8 quantizer."""
    *lead, R, C = w.shape
    rb, cb = -(-R // BLOCK[0]), -(-C // BLOCK[1])
    padded = w.new_zeros(*lead, rb * BLOCK[0], cb * BLOCK[1], dtype=torch.float32)
    padded[..., :R, :C] = w.abs()
    amax = padded.unflatten(-1, (cb, BLOCK[1])).unflatten(-3, (rb, BLOCK[0])).amax(dim=(-3, -1))
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def pack_rows(w: torch.Tensor, scale_inv: torch.Tensor | None = None, whole: bool = False) -> torch.Tensor:
    """FP8 rows (uint8 [..., R, packed_width(C, whole)]) of w [..., R, C] (float, or the dequantized values of an
    FP8 checkpoint) quantized by 128 x 128 blocks with `scale_inv` [..., ceil(R / 128), ceil(C / 128)] (the
    checkpoint's: its float8 values come back exactly) or, where None, `block_scales(w)`; in one segment (`whole`:
    a row no layout cuts by columns) or a segment a chunk. A matrix at a time (the rounding's float32 temporaries a
    matrix's, whatever the tensor: a layer's fused experts are GBs)."""
    *lead, R, C = w.shape
    if lead:
        out = torch.empty(*lead, R, packed_width(C, whole), dtype=torch.uint8, device=w.device)
        if w.numel() == 0:  # (the checks' shape-only fetches)
            return out
        for at in itertools.product(*map(range, lead)):
            out[at] = pack_rows(w[at], None if scale_inv is None else scale_inv[at], whole)
        return out
    scale = block_scales(w) if scale_inv is None else scale_inv.float()
    cb = scale.shape[-1]
    row_scale = scale.repeat_interleave(BLOCK[0], -2)[..., :R, :].contiguous()  # [R, cb]: each row its blocks' scales
    padded = w.new_zeros(R, cb * BLOCK[1], dtype=torch.float32)
    padded[..., :C] = w
    q = (padded.unflatten(-1, (cb, BLOCK[1])) / row_scale[..., None]).clamp(-FP8_MAX, FP8_MAX)
    out = torch.zeros(R, packed_width(C, whole), dtype=torch.uint8, device=w.device)
    values, scales = _parts(out, cb, whole)
    values.copy_(q.to(torch.float8_e4m3fn).view(torch.uint8))  # [R, cb, 128]
    scales.copy_(row_scale.view(torch.uint8).unflatten(-1, (cb, 4)))  # [R, cb, 4]
    return out


def unpack_rows(rows: torch.Tensor, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., R, cols] in `dtype` of FP8 rows (`pack_rows`, either layout: `segment_chunks`): each value times its
    block's scale in float32, rounded once to `dtype` (transformers' dequantization of the same blocks)."""
    chunks = -(-cols // BLOCK[1])
    values, scales = _parts(rows, chunks, segment_chunks(rows.shape[-1], cols) > 1)
    q = values.contiguous().view(torch.float8_e4m3fn).float()
    scale = scales.contiguous().view(torch.float32)  # [..., R, chunks, 1]
    return (q * scale).flatten(-2)[..., :cols].to(dtype)


def quantize_groups(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] as the W8A8 GEMMs on FP8 rows read it (kernels/linear.py `quantize_act`, `fp8_dot`;
    `KernelConfig.fp8_activations`): each row's 128-column groups rounded to float8_e4m3fn (to nearest, ties to even)
    with a float32 scale of their own, the group's largest magnitude over float8's largest (1 for an all-zero group),
    then multiplied back and rounded once to x's dtype. Per-token-group (1 x 128) dynamic quantization, as vLLM's
    and SGLang's block-FP8 GEMMs; the CPU's statement of what the GPU computes (the GPU sums the float8 products in
    float32 and scales the sums)."""
    C = x.shape[-1]
    cb = -(-C // BLOCK[1])
    groups = x.new_zeros(*x.shape[:-1], cb * BLOCK[1], dtype=torch.float32)
    groups[..., :C] = x
    groups = groups.unflatten(-1, (cb, BLOCK[1]))
    amax = groups.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return ((groups / scale).to(torch.float8_e4m3fn).float() * scale).flatten(-2)[..., :C].to(x.dtype)


def column_block(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Columns start .. stop of a weight [..., R, C]: of FP8 rows (uint8) in a segment a chunk, whole 128-value
    chunks (`start` a multiple of 128, and `stop` too or the last column), their scales with them (rows in one
    segment, no layout cuts: only all of them, 0 .. C); of a float tensor, those columns."""
    if t.dtype != torch.uint8:
        return t[..., start:stop]
    if start % BLOCK[1]:
        raise ValueError(f"FP8 rows are cut at whole {BLOCK[1]}-column chunks, not at column {start}")
    return t[..., start // BLOCK[1] * CHUNK: -(-stop // BLOCK[1]) * CHUNK]
