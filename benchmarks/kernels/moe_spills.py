"""The fused MoE's launches compiled for Hopper (sm_90) on any machine with Triton (no GPU): for every entry of each
format's block-shape table (bf16's `CONFIGS`, FP8 rows' `FP8_CONFIGS` in W8A16 and `W8A8_CONFIGS`, MXFP4 rows on
`CONFIGS`), gate/up's and down's registers, stack (spilled registers), shared memory and K-loop instructions, as
the host launches them (`fused_moe._row_tiles`; W8A16's float16 x in decode's blocks, `CHUNK_DOTS_MAX_BM`; bf16
without TMA; the shapes are run-time integers, specialized as a launch specializes them). A launch that spills
is one to time before it stays in a table (GPT-OSS's biases and activation on MXFP4 rows: mxfp4_sass.py):

    python benchmarks/kernels/moe_spills.py [--formats fp8 mxfp4]
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import torch
import triton

from moebius.bench.sm90 import FUSED_MOE_TYPES, compile_sm90, disassemble, loops
from moebius.kernels import DEFAULT_KERNELS, fused_moe
from moebius.kernels.linear import PLAIN
from moebius.kernels.rows import FORMATS

ALIGNED = ("N", "D", "I", "first", "WS", "XS", "OS", "HS")
TABLES = {"bf16": (fused_moe.CONFIGS, False), "fp8": (fused_moe.FP8_CONFIGS, False),
          "fp8-w8a8": (fused_moe.W8A8_CONFIGS, True), "mxfp4": (fused_moe.CONFIGS, False)}


def launch(form: str, cfg: fused_moe.MoEConfig, which: str, D: int = 2048, I: int = 768) -> tuple:
    """(kernel, argument types, constexprs, warps, stages) of one launch as the host makes it (D, I: the experts'
    hidden and intermediate columns, for the rows' widths the format reads them by)."""
    table_fmt, (_, act8) = form.split("-")[0], TABLES[form]
    tile = getattr(cfg, which)
    cols = D if which == "gate_up" else I
    types = dict(FUSED_MOE_TYPES)
    if table_fmt == "bf16":
        c, fmt = dataclasses.replace(tile, tma=False), PLAIN.value
        types.update(W13="*bf16", W2="*bf16")
    else:
        n = 2 * I if which == "gate_up" else D
        w = torch.empty(4, n, FORMATS[table_fmt].width(cols, True), dtype=torch.uint8, device="meta")
        c, fmt, _ = fused_moe._row_tiles(tile, w, cols, dataclasses.replace(DEFAULT_KERNELS, fp8_activations=act8))
    consts = dict(BM=cfg.BM, BN=c.BN, BK=c.BK, TMA=False, DIRECT=False, FMT=fmt, ACT8=act8, BIAS=False, GB=1,
                  HALVES=False, PDL=1)
    if which == "gate_up":
        fn = fused_moe._gate_up_silu
        consts.update(K_TOP=8, CLAMPED=False, DT=triton.language.bfloat16, BN=128 if act8 else c.BN)
        if act8:
            types.update(X="*u8", Out="*u8")
        elif table_fmt == "fp8" and cfg.BM <= fused_moe.CHUNK_DOTS_MAX_BM:
            types.update(X="*fp16")
    else:
        fn = fused_moe._down
        consts.update(TMA_H=False)
        if act8:
            types.update(H="*u8")
    return fn, types, {k: v for k, v in consts.items() if k in fn.arg_names}, c.num_warps, c.num_stages


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/kernels/moe_spills.py")
    ap.add_argument("--formats", nargs="+", default=list(TABLES), choices=list(TABLES))
    a = ap.parse_args()
    for form in a.formats:
        for limit, cfg in TABLES[form][0]:
            for which in ("gate_up", "down"):
                fn, types, consts, warps, stages = launch(form, cfg, which)
                k = compile_sm90(fn, types, consts, warps, stages, ALIGNED)
                listing, resources = disassemble(k.asm["cubin"])
                loop = max(loops(listing), key=lambda c: sum(c.values()))
                regs, stack = (re.search(rf"{r}:(\d+)", resources).group(1) for r in ("REG", "STACK"))
                print(f"{form:9} pairs<={limit:<5} BM={cfg.BM:<3} {which:7} BN={consts['BN']:<3} BK={consts['BK']:<3} "
                      f"warps={warps} stages={stages} registers={regs} stack={stack} shared={k.metadata.shared} "
                      f"loop={sum(loop.values())}", flush=True)


if __name__ == "__main__":
    main()
