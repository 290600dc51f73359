"""The fused MoE's launches compiled for Hopper (sm_90) on any machine with Triton (no GPU): for every entry of each
format's block-shape table (bf16's `CONFIGS`, FP8 rows' `FP8_CONFIGS` in W8A16 and `W8A8_CONFIGS`, MXFP4 rows'
`MXFP4_CONFIGS`), gate/up's and down's registers, stack (spilled registers), shared memory and K-loop instructions, as
the host launches them (`moebius.bench.sm90.fused_moe_launch`: W8A16's float16 x in decode's blocks, bf16 without
TMA; the shapes are run-time integers, specialized as a launch specializes them). A launch that spills is one to
time before it stays in a table (GPT-OSS's biases and activation on MXFP4 rows: mxfp4_sass.py):

    python benchmarks/kernels/moe_spills.py [--formats fp8 mxfp4]
"""

from __future__ import annotations

import argparse
import re

from moebius.bench.sm90 import FUSED_MOE_ALIGNED, compile_sm90, disassemble, fused_moe_launch, loops
from moebius.kernels import fused_moe

TABLES = {"bf16": ("bf16", fused_moe.CONFIGS, False), "fp8": ("fp8", fused_moe.FP8_CONFIGS, False),
          "fp8-w8a8": ("fp8", fused_moe.W8A8_CONFIGS, True), "mxfp4": ("mxfp4", fused_moe.MXFP4_CONFIGS, False)}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/kernels/moe_spills.py")
    ap.add_argument("--formats", nargs="+", default=list(TABLES), choices=list(TABLES))
    a = ap.parse_args()
    for form in a.formats:
        fmt, table, act8 = TABLES[form]
        for limit, cfg in table:
            for which in ("gate_up", "down"):
                fn, types, consts, warps, stages = fused_moe_launch(fmt, act8, cfg, which)
                k = compile_sm90(fn, types, consts, warps, stages, FUSED_MOE_ALIGNED)
                listing, resources = disassemble(k.asm["cubin"])
                loop = max(loops(listing), key=lambda c: sum(c.values()))
                regs, stack = (re.search(rf"{r}:(\d+)", resources).group(1) for r in ("REG", "STACK"))
                print(f"{form:9} pairs<={limit:<5} BM={cfg.BM:<3} {which:7} BN={consts['BN']:<3} BK={consts['BK']:<3} "
                      f"warps={warps} stages={stages} registers={regs} stack={stack} shared={k.metadata.shared} "
                      f"loop={sum(loop.values())}", flush=True)


if __name__ == "__main__":
    main()
