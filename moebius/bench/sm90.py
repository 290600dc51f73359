"""Triton kernels compiled for Hopper (sm_90) on any machine: Triton's NVIDIA backend lowers a kernel through ptxas
without a GPU. tests/test_kernels_sm90.py checks that the GPU paths compile (and what they compile to);
benchmarks/kernels/mxfp4_sass.py counts a kernel's loop instructions from nvdisasm's listing, moe_spills.py every
table's fused MoE launches (`fused_moe_launch`)."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

# the fused MoE's two GEMMs' argument types (Triton's signature strings; kernels/fused_moe.py)
FUSED_MOE_TYPES = dict(X="*bf16", XR="*fp32", H="*bf16", W13="*u8", W2="*u8", Rows="*i32", BlockExpert="*i32",
                       RouteW="*fp32", Out="*bf16", N="i32", D="i32", I="i32", E="i32", first="i32", WS="i32",
                       XS="i32", OS="i32", HS="i32", B13="*bf16", B2="*bf16", alpha="fp32", limit="fp32")


# the aligned integers of the fused MoE's launches (row counts and strides: multiples of 16 as the engine's are)
FUSED_MOE_ALIGNED = ("N", "D", "I", "first", "WS", "XS", "OS", "HS")


def fused_moe_launch(fmt: str, act8: bool, cfg: Any, which: str, D: int = 2048, I: int = 768
                     ) -> tuple[Any, dict[str, str], dict[str, Any], int, int]:
    """(kernel, argument types, constexprs, warps, stages) of one fused MoE GEMM ("gate_up" or "down") of block
    config `cfg` (a `fused_moe.MoEConfig`) as the host launches it: on bf16 experts (`fmt` "bf16", without TMA) or
    quantized rows of format `fmt` (`fused_moe._row_tiles`; act8: FP8's W8A8; W8A16's float16 x where
    `fused_moe.chunk_dots`). D, I: the experts' hidden and intermediate columns (the rows' widths the format reads)."""
    import dataclasses

    import torch
    import triton

    from moebius.kernels import DEFAULT_KERNELS, fused_moe
    from moebius.kernels.linear import PLAIN
    from moebius.kernels.rows import FORMATS

    tile = getattr(cfg, which)
    types = dict(FUSED_MOE_TYPES)
    if fmt == "bf16":
        c, form = dataclasses.replace(tile, tma=False), PLAIN.value
        types.update(W13="*bf16", W2="*bf16")
    else:
        n, cols = (2 * I, D) if which == "gate_up" else (D, I)
        w = torch.empty(4, n, FORMATS[fmt].width(cols, True), dtype=torch.uint8, device="meta")
        c, form, _ = fused_moe._row_tiles(tile, w, cols, dataclasses.replace(DEFAULT_KERNELS, fp8_activations=act8))
    consts: dict[str, Any] = dict(BM=cfg.BM, BN=c.BN, BK=c.BK, TMA=False, DIRECT=False, FMT=form, ACT8=act8,
                                  BIAS=False, GB=1, HALVES=False, PDL=1)
    if which == "gate_up":
        fn = fused_moe._gate_up_silu
        consts.update(K_TOP=8, CLAMPED=False, DT=triton.language.bfloat16)
        if act8:
            types.update(X="*u8", Out="*u8" if c.BN == 128 else "*bf16")
        elif fused_moe.chunk_dots(form, act8, cfg.BM):
            types.update(X="*fp16")
    else:
        fn = fused_moe._down
        consts.update(TMA_H=False)
        if act8:
            types.update(H="*u8")
    return fn, types, {k: v for k, v in consts.items() if k in fn.arg_names}, c.num_warps, c.num_stages


def compile_sm90(fn: Any, types: dict[str, str], consts: dict[str, Any], num_warps: int, num_stages: int,
                 aligned: tuple[str, ...] = ()) -> Any:
    """`fn` compiled for sm_90 (Triton's compiled kernel: `.asm` by kind, `.metadata`) with its arguments' types and
    constexprs, specialized as a launch specializes them: every pointer 16-byte aligned and the `aligned` integers
    multiples of 16 (what lets Triton pipeline the loads through shared memory)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (types[n].startswith("*") or n in aligned)}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def disassemble(cubin: bytes) -> tuple[str, str]:
    """nvdisasm's listing and cuobjdump's resource line of a cubin (the tools ship in Triton's wheel)."""
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        listing = subprocess.run([tools / "nvdisasm", "-c", f.name], capture_output=True, text=True,
                                 check=True).stdout
        res = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    finally:
        os.unlink(f.name)
    return listing, (res.strip().splitlines() or [""])[-1].strip()


def loops(listing: str) -> list[collections.Counter[str]]:
    """The opcodes of each backward branch's body (a loop) in an nvdisasm listing, longest first."""
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
