"""The fused MoE's MXFP4 GEMMs compiled for Hopper (sm_90) on any machine with Triton (no GPU): the instructions of
each kernel's K loop (one MXFP4_BK-column step), by opcode, and its registers and stack, from nvdisasm's listing of
the cubin (the tools ship in Triton's wheel). gpt-oss-20b's experts (biases, the clamped activation); a launch's
specialization (pointers and the row counts 16-byte aligned: `moebius.bench.sm90.compile_sm90`). The
package is whichever `moebius` is imported first:

    python benchmarks/kernels/mxfp4_sass.py --rows 16 64 128
    PYTHONPATH=<an older tree> python benchmarks/kernels/mxfp4_sass.py --rows 16   # the same for its kernels
"""

from __future__ import annotations

import argparse
from typing import Any

import triton

from moebius.bench.sm90 import FUSED_MOE_TYPES, compile_sm90, disassemble, loops
from moebius.kernels import fused_moe
from moebius.kernels.linear import MXFP4_ROWS

ALIGNED = ("N", "D", "I", "first", "XS", "OS", "HS")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/kernels/mxfp4_sass.py")
    ap.add_argument("--rows", type=int, nargs="+", default=[16], help="rows a block (BM)")
    ap.add_argument("--gate-up-cols", type=int, default=64, help="gate_up's columns a program (BN)")
    ap.add_argument("--down-cols", type=int, default=128, help="down's columns a program (BN)")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    args = ap.parse_args()
    print(fused_moe.__file__, "triton", triton.__version__)
    for bm in args.rows:
        for name, fn, bn in (("gate_up", fused_moe._gate_up_silu, args.gate_up_cols),
                             ("down", fused_moe._down, args.down_cols)):
            consts: dict[str, Any] = dict(BM=bm, BN=bn, BK=fused_moe.MXFP4_BK, TMA=False, DIRECT=False,
                                          FMT=MXFP4_ROWS.value, ACT8=False, BIAS=True, GB=1, HALVES=False,
                                          PDL=1)
            if fn is fused_moe._gate_up_silu:
                consts.update(K_TOP=4, CLAMPED=True, DT=triton.language.bfloat16)
            else:
                consts.update(TMA_H=False)
            asm = compile_sm90(fn, FUSED_MOE_TYPES, consts, args.warps, args.stages, ALIGNED).asm
            listing, resources = disassemble(asm["cubin"])
            body = loops(listing)[0]
            top = ", ".join(f"{op} {n}" for op, n in body.most_common(8))
            print(f"BM {bm} {name}: K loop {sum(body.values())} instructions ({top}); {resources}")


if __name__ == "__main__":
    main()
