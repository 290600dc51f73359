"""Writes a variant of the fused MoE (a folder with its `fused_moe.py` and `linear.py`, for moe_fp8_variants.py) whose
W8A16 down takes float16 dots in decode's blocks, as gate/up does: each K step's h tile as float16 rows times a power
of two a row (`f16_rows`, exact for bf16 values), the chunk's float8 values as they are, and the products times the
row's power of two and the tile's one block scale (`linear.tile_scale`). The tree's down dequantizes each weight tile
to bf16 as loaded, three instructions a weight value. Compiled for sm_90 the variant's down loop takes 305
instructions a K step where the tree's takes 368 (64-column tiles, 16-row blocks), and 421 where it takes 655
(128-column tiles: Qwen3-30B-A3B's batch 256); the twenty-fifth session's form of it (a scale a row in the dot's
layout, 343 against 368) was no faster on an H100. Under Triton's interpreter it passes the tree's W8A16 cases
(tests/test_kernels_interpreter.py, the folder's files copied over the package's). Not yet timed:

    python benchmarks/kernels/fp8_down_dots_variant.py /tmp/vdown
    python benchmarks/kernels/moe_fp8_variants.py out.json --variants tree=moebius/kernels vdown=/tmp/vdown \\
        --bf16 tree --batches 8 64 128 256 512
"""

from __future__ import annotations

import argparse
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "moebius" / "kernels"

F16_ROWS = '''@triton.jit
def f16_rows(x):
    """x [R, C] (float32 of bf16 or float16 values) as float16 rows [R, C] and a power of two a row [R], x = rows *
    scale: each row's largest magnitude brought into [2^14, 2^15) (from its float32 exponent bits), so the conversion
    is exact for bf16 values (values under 2^-31 of their row's largest aside)."""
    e = (tl.max(tl.abs(x), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF  # amax < 2^(e - 126)
    s = tl.minimum(tl.maximum(e - 141, -126), 126)
    rows = (x * ((127 - s) << 23).to(tl.float32, bitcast=True)[:, None]).to(tl.float16)
    return rows, ((s + 127) << 23).to(tl.float32, bitcast=True)


'''

LOOP = "        for k0 in range(0, I, BK):\n            if TMA_H:"
DOTS = '''        DOTS: tl.constexpr = (FMT == FP8_ROWS or FMT == FP8_WHOLE) and not ACT8 and BM <= _CHUNK_DOTS_MAX_BM
        if DOTS:
            w2base = W2 + e.to(tl.int64) * D * WS
            sw = tile_scale(w2base, nb * BN, 0, I, WS, FMT)
            for k0 in range(0, I, BK):
                sw_n = tile_scale(w2base, nb * BN, tl.minimum(k0 + BK, I - 1), I, WS, FMT)  # (a chunk ahead)
                a = tl.load(H + rows.to(tl.int64)[:, None] * I + (k0 + kk)[None, :],
                            mask=ok[:, None] & (k0 + kk < I)[None, :], other=0.0)
                if H.dtype.element_ty == tl.float32:
                    acc += fp8_chunk_product(a, w2base, n, nm, k0, I, WS, sw, FMT)
                else:
                    a16, sa = f16_rows(a.to(tl.float32))
                    wq = chunk_values(w2base, n, nm, k0, I, WS, FMT).to(tl.float16)
                    acc += tl.dot(a16, tl.trans(wq)) * (sa * sw)[:, None]
                sw = sw_n
        for k0 in range(0, 0 if DOTS else I, BK):
            if TMA_H:'''


def write(out: Path) -> None:
    """The variant's two files into `out`, from the tree's (each edit asserted to apply once)."""
    linear = (KERNELS / "linear.py").read_text()
    anchor = "@triton.jit\ndef e2m1_f16(q):"
    assert linear.count(anchor) == 1, "linear.py: e2m1_f16 not found once"
    fused = (KERNELS / "fused_moe.py").read_text()
    assert fused.count(LOOP) == 1, "fused_moe.py: down's K loop not found once"
    fused = fused.replace(LOOP, DOTS).replace("    fp8_form,\n", "    f16_rows,\n    fp8_form,\n", 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "linear.py").write_text(linear.replace(anchor, F16_ROWS + anchor))
    (out / "fused_moe.py").write_text(fused)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/kernels/fp8_down_dots_variant.py")
    ap.add_argument("out", type=Path, help="the variant's folder (created)")
    write(ap.parse_args().out)


if __name__ == "__main__":
    main()
