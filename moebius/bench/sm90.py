"""Triton kernels compiled for Hopper (sm_90) on any machine: Triton's NVIDIA backend lowers a kernel through ptxas
without a GPU. tests/test_kernels_sm90.py checks that the GPU paths compile (and what they compile to);
benchmarks/kernels/mxfp4_sass.py counts a kernel's loop instructions from nvdisasm's listing."""

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
