"""The fused MoE's MXFP4 GEMMs compiled for Hopper (sm_90) on any machine with Triton (no GPU): the instructions of
each kernel's K loop (one MXFP4_BK-column step), by opcode, and its registers and stack, from nvdisasm's listing of
the cubin (the tools ship in Triton's wheel). gpt-oss-20b's experts (biases, the clamped activation); a launch's
specialization (pointers and the row counts 16-byte aligned, as `tests/test_kernels_sm90.compile_sm90`). The
package is whichever `moebius` is imported first:

    python benchmarks/kernels/mxfp4_sass.py --rows 16 64 128
    PYTHONPATH=<an older tree> python benchmarks/kernels/mxfp4_sass.py --rows 16   # the same for its kernels
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moebius.kernels import fused_moe
from moebius.kernels.linear import MXFP4_ROWS

TYPES = dict(X="*bf16", H="*bf16", W13="*u8", W2="*u8", Rows="*i32", BlockExpert="*i32", RouteW="*fp32",
             Out="*bf16", N="i32", D="i32", I="i32", E="i32", first="i32", WS="i32", XS="i32", OS="i32", HS="i32",
             B13="*bf16", B2="*bf16", alpha="fp32", limit="fp32")
ALIGNED = ("N", "D", "I", "first", "XS", "OS", "HS")


def compile_sm90(fn: Any, consts: dict[str, Any], warps: int, stages: int) -> dict[str, Any]:
    sig = {n: "constexpr" if n in consts else TYPES[n] for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (TYPES[n].startswith("*") or n in ALIGNED)}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages}).asm


def disassemble(cubin: bytes) -> tuple[str, str]:
    """nvdisasm's listing and cuobjdump's resource line of a cubin."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    listing = subprocess.run([tools / "nvdisasm", "-c", f.name], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", f.name], capture_output=True, text=True,
                         check=True).stdout
    os.unlink(f.name)
    return listing, (res.strip().splitlines() or [""])[-1].strip()


def loops(listing: str) -> list[collections.Counter[str]]:
    """The opcodes of each backward branch's body (a loop), longest first."""
    lines: list[str] = []
    labels: dict[str, int] = {}
    for line in listing.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(lines)
        elif m := re.match(r"\s+/\*[0-9a-f]+\*/\s+(.*?);", line):
            lines.append(m.group(1))
    out = []
    for j, line in enumerate(lines):
        m = re.search(r"BRA.*?(\.L_x_\d+)", line)
        if m and labels.get(m.group(1), len(lines)) <= j:
            body = lines[labels[m.group(1)]: j + 1]
            out.append(collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", b).split()[0].split(".")[0] for b in body))
    return sorted(out, key=lambda c: -sum(c.values()))


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
                                          FMT=MXFP4_ROWS.value, ACT8=False, BIAS=True, GB=1, PDL=1)
            if fn is fused_moe._gate_up_silu:
                consts.update(K_TOP=4, CLAMPED=True, DT=triton.language.bfloat16)
            asm = compile_sm90(fn, consts, args.warps, args.stages)
            listing, resources = disassemble(asm["cubin"])
            body = loops(listing)[0]
            top = ", ".join(f"{op} {n}" for op, n in body.most_common(8))
            print(f"BM {bm} {name}: K loop {sum(body.values())} instructions ({top}); {resources}")


if __name__ == "__main__":
    main()
