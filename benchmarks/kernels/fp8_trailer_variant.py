"""Write a variant of the fused MoE (for `moe_fp8_variants.py --variants trail=<folder>`) that reads FP8 rows laid out
with a row's values first and its chunks' float32 scales after them, [values (128 a chunk) | scales (4 bytes a
chunk) | zeros to a multiple of 32 bytes], where kernels/fp8_rows.py interleaves them (each chunk's 128 values, its
scale, 12 zeros: 144 bytes). The question it answers: Nsight Compute counted 1.5x the FP8 rows' bytes in L2 sectors
read by the W8A16 launches (an odd chunk's 128 values start 16 bytes into a sector and span 5 sectors, and each
chunk's scale is a request of its own; benchmarks/results/h100-p1-moe-fp8-shapes-ncu.json), where bf16's tiles read
about 1.0x (2% of their L2 reads hit: benchmarks/results/h100-p1-moe-fp8-ncu.json); with the values of every chunk
32-byte aligned and 8 chunks' scales in one sector (cached in L1 across the K steps) the launches read ~1.03x. The
variant is the tree's fused_moe.py and linear.py with `chunk_values` and `chunk_scales` reading the trailer layout
and a `repack_rows` the harness applies to the tree's FP8 rows; only W8A16 (`weight_tile`) is meant to run on it.

    python benchmarks/kernels/fp8_trailer_variant.py /tmp/trail
    python benchmarks/kernels/moe_fp8_variants.py out.json --variants tree=moebius/kernels trail=/tmp/trail
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "moebius" / "kernels"

CHUNKS = '''@triton.jit
def chunk_values(W, rows, rm, k0, K, WS):
    """(trailer layout) The float8 values [rows, 128] of columns k0 .. k0 + 128: a row's values first."""
    kk = tl.arange(0, 128)
    m = rm[:, None] & (k0 + kk < K)[None, :]
    at = W + rows.to(tl.int64)[:, None] * WS + k0
    return tl.load(at + kk[None, :], mask=m, other=0).to(tl.float8e4nv, bitcast=True)


@triton.jit
def chunk_scales(W, rows, rm, k0, WS):
    """(trailer layout) The float32 scale [rows] of that chunk: after the row's values (WS // 132 chunks of 128), 8
    chunks' in one sector, kept in L1 across the K steps."""
    at = W + rows.to(tl.int64) * WS + (WS // 132) * 128 + (k0 // 128) * 4
    return tl.load(at.to(tl.pointer_type(tl.float32)), mask=rm, other=0.0, cache_modifier=".ca")
'''

REPACK = '''

def repack_rows(rows: torch.Tensor, cols: int) -> torch.Tensor:
    """The tree's FP8 rows (kernels/fp8_rows.py, [..., chunks * 144] bytes) in the trailer layout: [..., chunks * 128
    values | chunks * 4 scale bytes | zeros to a multiple of 32]."""
    from moebius.kernels.fp8_rows import CHUNK

    cb = rows.shape[-1] // CHUNK
    chunks = rows.unflatten(-1, (cb, CHUNK))
    width = -(-cb * 132 // 32) * 32
    out = torch.zeros(*rows.shape[:-1], width, dtype=torch.uint8, device=rows.device)
    out[..., : cb * 128] = chunks[..., :128].flatten(-2)
    out[..., cb * 128: cb * 132] = chunks[..., 128:132].flatten(-2)
    return out


def format_of(w: torch.Tensor, cols: int):  # noqa: F811 - the trailer rows' width is FP8's here
    """(trailer layout) FP8 for rows of the trailer's width, else the package's answer."""
    from moebius.kernels import rows as _rows

    chunks = -(-cols // 128)
    if w.shape[-1] == -(-chunks * 132 // 32) * 32:
        return _rows.FP8
    return _rows.format_of(w, cols)
'''


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/kernels/fp8_trailer_variant.py")
    ap.add_argument("folder", help="where to write the variant's fused_moe.py and linear.py")
    a = ap.parse_args()
    out = Path(a.folder)
    out.mkdir(parents=True, exist_ok=True)
    lin = (KERNELS / "linear.py").read_text()
    pattern = r"@triton\.jit\ndef chunk_values\(.*?\n\n\n@triton\.jit\ndef chunk_scales\(.*?\n\n\n"
    lin, n = re.subn(pattern, CHUNKS + "\n\n", lin, count=1, flags=re.S)
    if n != 1:
        raise SystemExit("linear.py: chunk_values / chunk_scales not found where expected")
    (out / "linear.py").write_text(lin)
    (out / "fused_moe.py").write_text((KERNELS / "fused_moe.py").read_text() + REPACK)
    print(f"wrote {out}/linear.py and {out}/fused_moe.py")


if __name__ == "__main__":
    main()
