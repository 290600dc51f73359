"""The quantized-row GPU kernels compiled for Hopper (sm_90) on a CPU machine: FP8 and MXFP4 rows in the fused MoE's
two GEMMs, FP8 rows in the dense projections. Triton's NVIDIA backend lowers each through ptxas without a GPU, so a
kernel that cannot compile (a type, a layout, a constexpr path the interpreter tests do not see) fails in CI rather
than on a lent GPU. The tile configs are the launches' own (`fused_moe.CONFIGS` through `_row_tiles`, sorted and
direct blocks); the numbers these kernels compute are the interpreter tests' (test_kernels_interpreter.py) and the
GPU tests' (test_gpu.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")
nvidia = pytest.importorskip("triton.backends.nvidia.compiler", reason="this Triton has no NVIDIA backend")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moebius.kernels import DEFAULT_KERNELS, fused_moe, linear  # noqa: E402
from moebius.kernels.rows import FORMATS  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
HOPPER_SHARED = 232448  # bytes of shared memory a block may use on H100 / H200 (what a launch checks, 227 KiB)
D, I, E = 2880, 2880, 4  # gpt-oss's hidden and expert sizes: whole MXFP4 chunks, FP8 blocks with a ragged last one


def compile_sm90(fn: Any, types: dict[str, str], consts: dict[str, Any], num_warps: int, num_stages: int,
                 aligned: tuple[str, ...] = ()) -> bytes:
    """`fn` compiled for sm_90 with its arguments' types (Triton's signature strings) and constexprs, specialized as
    a launch specializes them: every pointer 16-byte aligned and the `aligned` integers multiples of 16 (what lets
    Triton pipeline the loads through shared memory); the cubin."""
    try:  # (a Triton wheel ships ptxas; a source build may not)
        nvidia.get_ptxas(HOPPER.arch)
    except Exception as e:
        pytest.skip(f"no ptxas for sm_90: {e}")
    sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (types[n].startswith("*") or n in aligned)}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=HOPPER,
                       options={"num_warps": num_warps, "num_stages": num_stages})
    assert k.asm["cubin"], f"{fn.__name__}: no cubin"
    # (a launch refuses a kernel that needs more: OutOfResources on the GPU, never seen at compile time)
    assert k.metadata.shared <= HOPPER_SHARED, (fn.__name__, consts, num_stages, k.metadata.shared)
    return k.asm["cubin"]


def rows(fmt: str, n: int, cols: int) -> torch.Tensor:
    """Shape-only quantized rows ([E, n, width]) for `_row_tiles` to tell the format by."""
    return torch.empty(E, n, FORMATS[fmt].width(cols), dtype=torch.uint8, device="meta")


# (format, W8A8, biases and GPT-OSS's clamped activation): FP8 for the families FP8 serves (no expert biases), MXFP4
# with and without GPT-OSS's biases and activation
VARIANTS = [("fp8", False, False), ("fp8", True, False), ("mxfp4", False, False), ("mxfp4", False, True)]
TILES = [(c, False) for _, c in fused_moe.CONFIGS] + [(fused_moe.CONFIGS[0][1], True)]  # (config, direct blocks)


@pytest.mark.parametrize("fmt,act8,gpt_oss", VARIANTS, ids=[f"{f}{'-w8a8' if a else ''}{'-gpt-oss' if g else ''}"
                                                            for f, a, g in VARIANTS])
@pytest.mark.parametrize("cfg,direct", TILES, ids=[f"BM{c.BM}{'-direct' if d else ''}" for c, d in TILES])
def test_the_fused_moe_on_quantized_rows_compiles_for_hopper(fmt: str, act8: bool, gpt_oss: bool,
                                                             cfg: fused_moe.MoEConfig, direct: bool) -> None:
    kc = dataclasses.replace(DEFAULT_KERNELS, fp8_activations=act8)
    w13, w2 = rows(fmt, 2 * I, D), rows(fmt, D, I)
    for name, fn, tile, w, K in (("gate_up", fused_moe._gate_up_silu, cfg.gate_up, w13, D),
                                 ("down", fused_moe._down, cfg.down, w2, I)):
        c, f, a8 = fused_moe._row_tiles(tile, w, K, kc)
        assert not c.tma and a8 == act8, (name, c, a8)
        types = dict(X="*bf16", H="*bf16", W13="*u8", W2="*u8", Rows="*i32", BlockExpert="*i32", RouteW="*fp32",
                     Out="*bf16", N="i32", D="i32", I="i32", E="i32", first="i32", WS="i32", B13="*bf16",
                     B2="*bf16", alpha="fp32", limit="fp32")
        consts: dict[str, Any] = dict(BM=cfg.BM, BN=c.BN, BK=c.BK, TMA=False, DIRECT=direct, FMT=f, ACT8=a8,
                                      BIAS=gpt_oss, PDL=1)
        if fn is fused_moe._gate_up_silu:
            consts.update(K_TOP=4, CLAMPED=gpt_oss)
        compile_sm90(fn, types, consts, c.num_warps, c.num_stages, aligned=("N", "D", "I", "first", "WS"))


@pytest.mark.parametrize("act8", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("BT", [16, linear.FP8_MAX_BT])
def test_the_dense_projection_on_fp8_rows_compiles_for_hopper(act8: bool, BT: int) -> None:
    types = dict(X="*bf16", W="*u8", B="*bf16", Out="*bf16", T="i32", N="i32", K="i32", WS="i32", stride_x="i32",
                 stride_o="i32")
    compile_sm90(linear._linear_fp8, types, dict(HAS_BIAS=True, BT=BT, BM=linear.FP8_BM, ACT8=act8, PDL=1), 4, 3,
                 aligned=("N", "K", "WS", "stride_x", "stride_o"))
