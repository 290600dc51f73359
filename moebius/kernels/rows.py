"""Quantized rows: the formats a weight is held in with its scales inside each row (uint8 tensors), so that every cut
the layouts make carries the scales with the weights and the load, a switch and an update move bytes: FP8 rows
(block FP8, kernels/fp8_rows.py; --quantization fp8) and MXFP4 rows (kernels/mxfp4_rows.py; --quantization mxfp4).
`row_format` gives the format of a --quantization, `format_of` the one a tensor is held in (told apart by the row's
bytes: an FP8 row takes more than a byte a column, an MXFP4 row about half of one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moebius.kernels import fp8_rows, mxfp4_rows


@dataclass(frozen=True)
class RowFormat:
    name: str  # its --quantization value
    title: str  # in words, for messages
    scale_rows: int  # rows one scale covers: a TP cut of [gate | up] rows keeps whole multiples
    chunk_cols: int  # columns of a chunk: a column cut (down's by TP) takes whole chunks
    experts_only: bool  # holds the routed experts alone (MXFP4, as the releases), or the dense Linear weights too
    pads: bool  # a row's last chunk zero-padded (FP8), or a row must be whole chunks (MXFP4)
    # float [..., R, C], whole -> rows quantized with their own scales; whole: rows no layout cuts by columns, which
    # a format may lay out apart (FP8: one segment, kernels/fp8_rows.py)
    pack: Callable[[torch.Tensor, bool], torch.Tensor]
    unpack: Callable[[torch.Tensor, int, torch.dtype], torch.Tensor]  # rows, C, dtype -> [..., R, C]
    width: Callable[[int, bool], int]  # bytes of a row of C columns (whole, as `pack`)
    # HBM bytes a value of the released format (its values and block scales): what any engine reads, the floor's
    # (bench/floor.py); the rows themselves add the scale repeated on each row and padding (`width`)
    release_bytes_per_value: float

    def rows_of(self, w: torch.Tensor, whole: bool = False) -> torch.Tensor:
        """Float w [..., C] as this format's rows, quantized with its own scales (`whole`: rows no layout cuts by
        columns); a meta tensor (an update that leaves the tensor, a shape-only check) as a meta tensor of the rows'
        shape."""
        if w.is_meta:
            return torch.empty(*w.shape[:-1], self.width(w.shape[-1], whole), dtype=torch.uint8, device="meta")
        return self.pack(w, whole)

    @property
    def tp_what(self) -> str:
        """What `tp_unit` counts: rows of gate and up (FP8's blocks span rows), or down's columns."""
        return "row" if self.scale_rows > 1 else "column"

    @property
    def tp_unit(self) -> int:
        """What a TP shard of an expert's intermediate rows (and so of down's columns) must be a multiple of."""
        return max(self.scale_rows, self.chunk_cols)


FP8 = RowFormat("fp8", "block FP8", fp8_rows.BLOCK[0], fp8_rows.BLOCK[1], False, True,
                lambda w, whole: fp8_rows.pack_rows(w, whole=whole), fp8_rows.unpack_rows, fp8_rows.packed_width,
                1 + 4 / (fp8_rows.BLOCK[0] * fp8_rows.BLOCK[1]))  # a float8 byte a value, a float32 a block
MXFP4 = RowFormat("mxfp4", "MXFP4", 1, mxfp4_rows.BLOCK, True, False,
                  lambda w, whole: mxfp4_rows.pack_rows(w), mxfp4_rows.unpack_rows,  # (one layout: 17-byte chunks)
                  lambda cols, whole: mxfp4_rows.packed_width(cols),
                  mxfp4_rows.CHUNK / mxfp4_rows.BLOCK)  # the release's own: 16 bytes of codes and a scale byte a block
FORMATS = {f.name: f for f in (FP8, MXFP4)}


def row_format(quantization: str | None) -> RowFormat | None:
    """The rows of a --quantization value (None, or "": the dtype)."""
    return FORMATS[quantization] if quantization else None


def holds(f: RowFormat, cols: int) -> bool:
    """Whether format `f` holds rows of `cols` columns."""
    return f.pads or cols % f.chunk_cols == 0


def format_of(w: torch.Tensor, cols: int) -> RowFormat:
    """The format of quantized rows `w` (uint8 [..., width]) holding `cols` columns (either of its layouts)."""
    for f in FORMATS.values():
        if holds(f, cols) and w.shape[-1] in (f.width(cols, False), f.width(cols, True)):
            return f
    widths = {f.name: " or ".join(map(str, sorted({f.width(cols, False), f.width(cols, True)})))
              for f in FORMATS.values() if holds(f, cols)}
    raise ValueError(f"uint8 rows of {w.shape[-1]} bytes hold {cols} columns in no quantized format ("
                     + ", ".join(f"{name}: {n} bytes" for name, n in widths.items()) + ")")
