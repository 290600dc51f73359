"""The quantized-row GPU kernels compiled for Hopper (sm_90) on a CPU machine: FP8 and MXFP4 rows in the fused MoE's
two GEMMs, FP8 rows in the dense projections. Triton's NVIDIA backend lowers each through ptxas without a GPU, so a
kernel that cannot compile (a type, a layout, a constexpr path the interpreter tests do not see) fails in CI rather
than on a lent GPU. The tile configs are the launches' own (`fused_moe.CONFIGS` through `_row_tiles`, sorted and
direct blocks); the numbers these kernels compute are the interpreter tests' (test_kernels_interpreter.py) and the
GPU tests' (test_gpu.py)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")
nvidia = pytest.importorskip("triton.backends.nvidia.compiler", reason="this Triton has no NVIDIA backend")

from moebius.bench import sm90  # noqa: E402
from moebius.bench.sm90 import FUSED_MOE_TYPES as MOE_TYPES  # noqa: E402
from moebius.kernels import DEFAULT_KERNELS, fused_moe, linear  # noqa: E402
from moebius.kernels.rows import FORMATS  # noqa: E402

HOPPER_SHARED = 232448  # bytes of shared memory a block may use on H100 / H200 (what a launch checks, 227 KiB)
D, I, E = 2880, 2880, 4  # gpt-oss's hidden and expert sizes: whole MXFP4 chunks, FP8 blocks with a ragged last one


def compile_sm90(fn: Any, types: dict[str, str], consts: dict[str, Any], num_warps: int, num_stages: int,
                 aligned: tuple[str, ...] = ()) -> dict[str, Any]:
    """`sm90.compile_sm90`, skipped where Triton has no ptxas, checked to make a cubin within Hopper's shared memory;
    its assembly by kind (ptx, cubin)."""
    try:  # (a Triton wheel ships ptxas; a source build may not)
        nvidia.get_ptxas(90)
    except Exception as e:
        pytest.skip(f"no ptxas for sm_90: {e}")
    k = sm90.compile_sm90(fn, types, consts, num_warps, num_stages, aligned)
    assert k.asm["cubin"], f"{fn.__name__}: no cubin"
    # (a launch refuses a kernel that needs more: OutOfResources on the GPU, never seen at compile time)
    assert k.metadata.shared <= HOPPER_SHARED, (fn.__name__, consts, num_stages, k.metadata.shared)
    return k.asm


def rows(fmt: str, n: int, cols: int, whole: bool = False) -> torch.Tensor:
    """Shape-only quantized rows ([E, n, width]; `whole`: FP8's one segment a row) for `_row_tiles` to tell the format
    by."""
    return torch.empty(E, n, FORMATS[fmt].width(cols, whole), dtype=torch.uint8, device="meta")


WHOLE, CHUNKS = linear.FP8_WHOLE.value, linear.FP8_ROWS.value  # FP8 rows' layouts (kernels/fp8_rows.py)


# W8A8: the fused MoE's activations (x, and h between its GEMMs) as FP8 rows, gate_up's output among them
W8A8_TYPES = {"gate_up": dict(MOE_TYPES, X="*u8", Out="*u8"), "down": dict(MOE_TYPES, H="*u8")}
# (FP8 rows' gate_up in W8A16 in decode's blocks takes x as `linear.scaled_f16` rows)
W8A16_TYPES = dict(MOE_TYPES, X="*fp16")
# the projections on FP8 rows' argument types (Triton's signature strings)
LINEAR_TYPES = dict(X="*bf16", W="*u8", B="*bf16", Out="*bf16", T="i32", N="i32", K="i32", WS="i32", stride_x="i32",
                    stride_o="i32")

# (format, W8A8, biases and GPT-OSS's clamped activation): FP8 for the families FP8 serves (no expert biases), MXFP4
# with and without GPT-OSS's biases and activation
VARIANTS = [("fp8", False, False), ("fp8", True, False), ("mxfp4", False, False), ("mxfp4", False, True)]
# (format, W8A8, biases, config, direct blocks): every variant with bf16's table, FP8 rows with their own too
CASES = [(*v, c, False) for v in VARIANTS
         for _, c in fused_moe.CONFIGS + (fused_moe.FP8_CONFIGS if v[0] == "fp8" else [])]
CASES += [(*v, fused_moe.CONFIGS[0][1], True) for v in VARIANTS]
CASES += [("fp8", True, False, fused_moe.FP8_CONFIGS[0][1], True)]


@pytest.mark.parametrize("fmt,act8,gpt_oss,cfg,direct", CASES, ids=[
    f"{f}{'-w8a8' if a else ''}{'-gpt-oss' if g else ''}-{i}-BM{c.BM}{'-direct' if d else ''}"
    for i, (f, a, g, c, d) in enumerate(CASES)])
def test_the_fused_moe_on_quantized_rows_compiles_for_hopper(fmt: str, act8: bool, gpt_oss: bool,
                                                             cfg: fused_moe.MoEConfig, direct: bool) -> None:
    kc = dataclasses.replace(DEFAULT_KERNELS, fp8_activations=act8)
    w13, w2 = rows(fmt, 2 * I, D, whole=True), rows(fmt, D, I)  # (as ranks that TP may cut hold them)
    for name, fn, tile, w, K in (("gate_up", fused_moe._gate_up_silu, cfg.gate_up, w13, D),
                                 ("down", fused_moe._down, cfg.down, w2, I)):
        c, f, a8 = fused_moe._row_tiles(tile, w, K, kc)
        assert not c.tma and a8 == act8, (name, c, a8)
        consts: dict[str, Any] = dict(BM=cfg.BM, BN=c.BN, BK=c.BK, TMA=False, DIRECT=direct, FMT=f, ACT8=a8,
                                      BIAS=gpt_oss, GB=c.group, HALVES=False, PDL=1)
        if fn is fused_moe._gate_up_silu:
            consts.update(K_TOP=4, CLAMPED=gpt_oss, DT=triton.language.bfloat16)
        else:
            consts.update(TMA_H=False)
        dots = name == "gate_up" and fused_moe.chunk_dots(f, a8, cfg.BM)  # (the host's float16 x: `gate_up`)
        types = W8A8_TYPES[name] if a8 else W8A16_TYPES if dots else MOE_TYPES
        if a8 and name == "gate_up" and c.BN != 128:  # (h in bf16, quantized after the launch: `gate_up`)
            types = dict(types, Out="*bf16")
        compile_sm90(fn, types, consts, c.num_warps, c.num_stages, aligned=("N", "D", "I", "first", "WS", "XS", "OS",
                                                                             "HS"))


HALF_CONFIGS = [c for _, c in fused_moe.CONFIGS + [r for t in fused_moe.SHAPE_CONFIGS.values() for r in t]
                if c.BM >= 32]


@pytest.mark.parametrize("cfg", HALF_CONFIGS, ids=[f"{i}-BM{c.BM}" for i, c in enumerate(HALF_CONFIGS)])
def test_the_fused_moe_half_blocks_compile_for_hopper(cfg: fused_moe.MoEConfig) -> None:
    """The bf16 fused MoE's two GEMMs with half blocks (`TileConfig.halves`: both K loops, the whole block's and its
    first half's, in one kernel) at the sorted configs' tiles (CONFIGS', the shape tables'; weights through pointers:
    a TMA descriptor's type is not a signature string): within Hopper's shared memory, each kernel with its two K
    loops (their numbers: test_kernels_interpreter.py, test_gpu.py)."""
    plain = dict(MOE_TYPES, W13="*bf16", W2="*bf16")
    for fn, tile in ((fused_moe._gate_up_silu, cfg.gate_up), (fused_moe._down, cfg.down)):
        consts: dict[str, Any] = dict(BM=cfg.BM, BN=tile.BN, BK=tile.BK, TMA=False, DIRECT=False,
                                      FMT=linear.PLAIN.value, ACT8=False, BIAS=False, GB=1, HALVES=True, PDL=1)
        if fn is fused_moe._gate_up_silu:
            consts.update(K_TOP=4, CLAMPED=False, DT=triton.language.bfloat16)
        else:
            consts.update(TMA_H=False)
        asm = compile_sm90(fn, plain, consts, tile.num_warps, tile.num_stages, aligned=("N", "D", "I", "first", "WS"))
        k_loops = [n for n in map(sum, (c.values() for c in sm90.loops(sm90.disassemble(asm["cubin"])[0]))) if n > 20]
        assert len(k_loops) == 2, (fn.__name__, k_loops)


LAUNCHES = [(act8, most, launch) for act8, table in linear.FP8_LAUNCHES.items() for most, launch in table]


@pytest.mark.parametrize("act8,most,launch", LAUNCHES, ids=[f"{'w8a8' if a else 'w8a16'}-{min(m, 4096)}"
                                                            for a, m, _ in LAUNCHES])
def test_the_dense_projection_on_fp8_rows_compiles_for_hopper(act8: bool, most: int, launch: tuple) -> None:
    """Every launch shape of `linear.FP8_LAUNCHES` (their BT for a step of the bucket's most rows, 2048 at most; the
    splits of Qwen3-30B-A3B's o projection, 4096 columns)."""
    BM, BT, warps, stages, splits, token_rows = linear.fp8_launch(min(most, 2048), 4096, act8)
    assert (BM, warps, stages, splits) == (launch[0], launch[2], launch[3], 4096 // launch[4] if launch[4] else 1)
    for fmt in (WHOLE, CHUNKS):
        compile_sm90(linear._linear_fp8, LINEAR_TYPES, dict(HAS_BIAS=True, BT=BT, BM=BM, ACT8=act8,
                                                            TOKEN_ROWS=token_rows, SPLITS=splits, FMT=fmt, PDL=1),
                     warps, stages, aligned=("N", "K", "WS", "stride_x", "stride_o"))


@pytest.mark.parametrize("act8", [False, True], ids=["w8a16", "w8a8"])
def test_the_split_k_projection_on_fp8_rows_compiles_for_hopper(act8: bool) -> None:
    """`_linear_fp8` with its K split (float32 partials, a runtime chunk range a program) reads as the whole-K launch
    does (the weights in 16-byte asynchronous copies: the chunk loop keeps k0's alignment), and `_sum_splits`
    compiles."""
    kinds = [global_loads(compile_sm90(linear._linear_fp8, {**LINEAR_TYPES, "Out": out},
                                       dict(HAS_BIAS=False, BT=64, BM=64, ACT8=act8, TOKEN_ROWS=act8, SPLITS=splits,
                                            FMT=CHUNKS, PDL=2), 4, 4,
                                       aligned=("N", "K", "WS", "stride_x", "stride_o"))["ptx"])
             for splits, out in ((1, "*bf16"), (4, "*fp32"))]
    assert "cp16" in kinds[1] and kinds[0] == kinds[1], kinds
    compile_sm90(linear._sum_splits, dict(Part="*fp32", B="*bf16", Out="*bf16", T="i32", N="i32", stride_o="i32"),
                 dict(HAS_BIAS=True, SPLITS=4, BN=1024, PDL=2), 4, 1, aligned=("N", "stride_o"))


@pytest.mark.parametrize("fmt", [WHOLE, CHUNKS], ids=["whole", "chunks"])
def test_the_fp8_unpack_compiles_for_hopper_without_byte_loads(fmt: int) -> None:
    """`linear._unpack_fp8` (W8A16's weight at prompt sizes) reads a chunk's FP8 bytes in 16-byte loads, never one
    byte at a time (its scale in 4), stores in 16-byte vectors, and compiles with PDL, in either row layout."""
    ptx = compile_sm90(linear._unpack_fp8, dict(W="*u8", Out="*bf16", N="i32", K="i32", WS="i32"),
                       dict(BR=32, FMT=fmt, PDL=1), 4, 1, aligned=("N", "K", "WS"))["ptx"]
    assert global_loads(ptx) == {"ld32"} and "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx, global_loads(ptx)


@pytest.mark.parametrize("token_rows", [True, False], ids=["token-rows", "weight-rows"])
def test_w8a8_dots_with_the_weight_rows_as_their_rows_take_float8_warpgroup_mmas(token_rows: bool) -> None:
    """W8A8's projection at 16 token rows a program (`_linear_fp8`'s decode tile): with the weight rows as the dot's
    rows (128 of them) it multiplies in Hopper's warpgroup MMA on float8 tiles; with the tokens as the dot's rows
    Triton takes Ampere's MMA, which on sm_90 converts each float8 pair to f16 first."""
    ptx = compile_sm90(linear._linear_fp8, LINEAR_TYPES, dict(HAS_BIAS=False, BT=16, BM=128, ACT8=True,
                                                              TOKEN_ROWS=token_rows, SPLITS=1, FMT=WHOLE, PDL=1), 8, 3,
                       aligned=("N", "K", "WS", "stride_x", "stride_o"))["ptx"]
    wgmma = bool(re.search(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx))
    assert wgmma != token_rows and ("cvt.rn.f16x2.e4m3x2" in ptx) == token_rows, (token_rows, wgmma)


def test_w8a16_token_rows_read_the_weights_in_16_byte_copies() -> None:
    """W8A16 on FP8 rows at 64 x 64 tiles: with the tokens as the dot's rows the weight tile streams in 16-byte
    copies (and its scales in 4). (With the weight rows as the dot's rows, their tile then an operand from registers,
    Triton 3.6 copies it 8 bytes at a time.)"""
    for fmt in (WHOLE, CHUNKS):
        kinds = global_loads(compile_sm90(linear._linear_fp8, LINEAR_TYPES, dict(
            HAS_BIAS=False, BT=64, BM=64, ACT8=False, TOKEN_ROWS=True, SPLITS=1, FMT=fmt, PDL=1), 4, 4,
            aligned=("N", "K", "WS", "stride_x", "stride_o"))["ptx"])
        assert kinds == {"cp16", "cp4"}, (fmt, kinds)


def test_w8a16_gate_up_takes_float16_dots_on_the_chunks_values() -> None:
    """The fused MoE's gate/up on FP8 rows in W8A16 at decode's tiles (FP8_CONFIGS' 16-row blocks, 64-column tiles):
    float16 MMAs on each chunk's float8 values, converted a pair an instruction, and the block scales on the
    products, so nothing else a value in the K loop (the tile dequantized to bf16 as loaded took a float32 multiply
    and three conversions a value: 667 instructions a K step against 322; docs/performance.md)."""
    cfg = fused_moe.FP8_CONFIGS[1][1]
    tile = cfg.gate_up
    consts: dict[str, Any] = dict(BM=cfg.BM, BN=tile.BN, BK=128, TMA=False, DIRECT=False, FMT=WHOLE, ACT8=False,
                                  BIAS=False, GB=1, HALVES=False, PDL=1, K_TOP=8, CLAMPED=False,
                                  DT=triton.language.bfloat16)
    asm = compile_sm90(fused_moe._gate_up_silu, W8A16_TYPES, consts, tile.num_warps, tile.num_stages,
                       aligned=("N", "D", "I", "first", "WS", "XS", "OS", "HS"))
    listing = sm90.disassemble(asm["cubin"])[0]
    loop = max(sm90.loops(listing), key=lambda c: sum(c.values()))
    values = 2 * tile.BN * 128 // (32 * tile.num_warps)  # a thread's float8 values a K step (gate and up)
    assert loop["F2FP"] == values // 2 and "FMUL" not in loop and "HADD2" not in loop, dict(loop.most_common(12))
    assert set(re.findall(r"HMMA\.\S+", listing)) == {"HMMA.16816.F32"}, set(re.findall(r"HMMA\.\S+", listing))


@pytest.mark.parametrize("which", ["gate_up", "down"])
@pytest.mark.parametrize("entry", range(len(fused_moe.FP8_CONFIGS)))
def test_w8a16_launches_do_not_spill(entry: int, which: str) -> None:
    """Every FP8_CONFIGS launch in W8A16 as the host makes it (x as float16 rows in decode's blocks,
    `CHUNK_DOTS_MAX_BM`) spills at most a few registers, and gate/up in the 64- and 128-row blocks (prompt sizes)
    dequantizes each weight tile to bf16 once for all the block's rows, into bf16 warpgroup MMAs: a float32 product a
    chunk beside its two accumulators (decode's float16 dots) spilled 168 and 1488 bytes of stack there (24 on this
    form's 128-row blocks)."""
    cfg = fused_moe.FP8_CONFIGS[entry][1]
    dots = cfg.BM <= fused_moe.CHUNK_DOTS_MAX_BM  # (decode's 16-row blocks; the table's 64 and 128 rows not)
    fn, types, consts, warps, stages = sm90.fused_moe_launch("fp8", False, cfg, which)
    assert (types["X"] == "*fp16") == (which == "gate_up" and dots) and stages <= fused_moe.FP8_MAX_STAGES
    asm = compile_sm90(fn, types, consts, warps, stages, sm90.FUSED_MOE_ALIGNED)
    listing, resources = sm90.disassemble(asm["cubin"])
    assert int(re.search(r"STACK:(\d+)", resources).group(1)) <= 32, resources
    if which == "gate_up" and not dots:
        assert {m.split(".")[-1] for m in re.findall(r"HGMMA\.\S+", listing)} == {"BF16"}, listing[:200]
        assert "HMMA" not in listing


@pytest.mark.parametrize("which", ["gate_up", "down"])
@pytest.mark.parametrize("entry", range(len(fused_moe.W8A8_CONFIGS)))
def test_w8a8_launches_read_a_scale_a_tile_and_do_not_spill(entry: int, which: str) -> None:
    """Every W8A8_CONFIGS launch loads its weight tile's block scale as one value a K step (`linear.tile_scale`),
    not a scale a row in the dot's layout: the K loop's register loads are the activations' scales and those few
    (a row's scales took 34 loads a step in the 64-row gate/up, 255 registers and 64 bytes of stack), and no launch
    spills; the 64-row gate/up takes float8 warpgroup MMAs."""
    cfg = fused_moe.W8A8_CONFIGS[entry][1]
    fn, types, consts, warps, stages = sm90.fused_moe_launch("fp8", True, cfg, which)
    asm = compile_sm90(fn, types, consts, warps, stages, sm90.FUSED_MOE_ALIGNED)
    listing, resources = sm90.disassemble(asm["cubin"])
    assert int(re.search(r"STACK:(\d+)", resources).group(1)) == 0, resources
    loop = max(sm90.loops(listing), key=lambda c: sum(c.values()))
    assert loop["LDG"] <= 4, loop
    if cfg.BM >= 64 and which == "gate_up":
        assert loop["QGMMA"] > 0, loop


@pytest.mark.parametrize("which", ["gate_up", "down"])
@pytest.mark.parametrize("entry", range(len(fused_moe.MXFP4_CONFIGS) - 1))
def test_mxfp4_launches_below_prompt_sizes_do_not_spill(entry: int, which: str) -> None:
    """MXFP4_CONFIGS' launches up to its 128-row blocks of 96 pairs an expert, as the host makes them, spill no
    registers: CONFIGS' 32-row blocks (12-24 pairs an expert) spilled 224 and 416 bytes of stack at 4 warps, where
    16-row blocks take the codes straight into the dots. (Its prompt-size entry, CONFIGS' last, spills 112 in
    gate/up: untimed, `benchmarks/kernels/moe_spills.py`.)"""
    cfg = fused_moe.MXFP4_CONFIGS[entry][1]
    fn, types, consts, warps, stages = sm90.fused_moe_launch("mxfp4", False, cfg, which)
    asm = compile_sm90(fn, types, consts, warps, stages, sm90.FUSED_MOE_ALIGNED)
    assert int(re.search(r"STACK:(\d+)", sm90.disassemble(asm["cubin"])[1]).group(1)) == 0


def global_loads(ptx: str) -> set[str]:
    """The kinds of global memory reads in a kernel's PTX: `ld.global.b8`-style loads by width, and the asynchronous
    copies into shared memory (`cp.async.ca` of 4 or 8 bytes, `cp.async.cg` of 16) by their byte count."""
    loads = set(re.findall(r"ld\.global(?:\.[a-z]+\d*)*?\.[bsuf](8|16|32|64|128)\b", ptx))
    copies = set(re.findall(r"cp\.async\.c[ag]\.shared\.global[^,]*,[^,]*,\s*(0x[0-9a-f]+|\d+)", ptx))
    return {f"ld{w}" for w in loads} | {f"cp{int(n, 0)}" for n in copies}


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "chunks"])
@pytest.mark.parametrize("name", ["gate_up", "down", "qkv", "o"])
def test_fp8_rows_are_read_in_16_byte_copies(name: str, whole: bool) -> None:
    """Qwen3-30B-A3B's shapes on FP8 rows (hidden 2048, experts' 768, 32 query heads of 128), specialized as a launch
    is (a row's bytes a multiple of 16 or not): the weights stream into shared memory in 16-byte asynchronous copies,
    no single-byte or 4-byte reads. With 132-byte chunks (no padding to 16) down read bytes one at a time and gate/up
    in 4-byte copies: 17 and 2 times their HBM time at batch 64 on an H200 (docs/performance.md "FP8 and MXFP4 on a
    GPU"). Either row layout (kernels/fp8_rows.py: one segment a row, or a segment a chunk)."""
    f = FORMATS["fp8"]
    kc = dataclasses.replace(DEFAULT_KERNELS, fp8_activations=True)
    hidden, inter, heads = 2048, 768, 32
    if name in ("qkv", "o"):
        K = hidden if name == "qkv" else heads * 128
        BM, BT, warps, stages, splits, token_rows = linear.fp8_launch(64, K, True)
        consts = dict(HAS_BIAS=False, BT=BT, BM=BM, ACT8=True, TOKEN_ROWS=token_rows, SPLITS=splits,
                      FMT=WHOLE if whole else CHUNKS, PDL=1)
        asm = compile_sm90(linear._linear_fp8, LINEAR_TYPES, consts, warps, stages,
                           aligned=("N", "K", "stride_x", "stride_o") + (("WS",) if f.width(K, whole) % 16 == 0
                                                                         else ()))
    else:
        cfg = fused_moe.CONFIGS[-1][1]
        fn, tile, n, K = ((fused_moe._gate_up_silu, cfg.gate_up, 2 * inter, hidden) if name == "gate_up"
                          else (fused_moe._down, cfg.down, hidden, inter))
        c, fmt, a8 = fused_moe._row_tiles(tile, torch.empty(E, n, f.width(K, whole), dtype=torch.uint8, device="meta"),
                                          K, kc)
        assert fmt == (WHOLE if whole else CHUNKS), fmt
        consts: dict[str, Any] = dict(BM=cfg.BM, BN=c.BN, BK=c.BK, TMA=False, DIRECT=False, FMT=fmt, ACT8=a8,
                                      BIAS=False, GB=c.group, HALVES=False, PDL=1)
        if fn is fused_moe._gate_up_silu:
            consts.update(K_TOP=8, CLAMPED=False, DT=triton.language.bfloat16, BN=128)
        else:
            consts.update(TMA_H=False)
        asm = compile_sm90(fn, W8A8_TYPES[name], consts, c.num_warps, c.num_stages,
                           aligned=("N", "D", "I", "first", "XS", "OS", "HS")
                           + (("WS",) if f.width(K, whole) % 16 == 0 else ()))
    kinds = global_loads(asm["ptx"])
    assert "cp16" in kinds and not kinds & {"ld8", "ld16", "cp4", "cp8"}, (name, kinds)


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "halves"])
def test_the_mla_rope_and_latent_write_compiles_for_hopper(interleave: bool) -> None:
    """`kernels/mla._rope_latent` at DeepSeek's shapes (nope 128, latent 512, rope 64, pages of 16) in bf16: a GPU
    path the CPU's torch statement of it never compiles (its numbers: test_kernels_interpreter.py)."""
    from moebius.kernels import mla

    types = dict(Q="*bf16", KV="*bf16", NormW="*bf16", Rope="*fp32", Pos="*i64", Slots="*i64", Cache="*bf16",
                 QRope="*bf16", H="i32", eps="fp32", stride_qt="i32", stride_kvt="i32", stride_ot="i32",
                 stride_oh="i32", stride_pg="i32", stride_tok="i32")
    compile_sm90(mla._rope_latent, types, dict(N=128, C=512, R=64, CP=512, HB=mla.ROPE_HEADS, PAGE=16,
                                               INTERLEAVE=interleave, PDL=1), 4, 1,
                 aligned=("H", "stride_qt", "stride_kvt", "stride_ot", "stride_oh", "stride_pg", "stride_tok"))


@pytest.mark.parametrize("heads,batch", [(16, 8), (16, 1024), (128, 128)], ids=["16-heads-few", "16-heads-many",
                                                                          "wide"])
def test_the_latent_decode_launches_compile_for_hopper(heads: int, batch: int) -> None:
    """`kernels/mla._mla_fwd`'s decode launches at DeepSeek's shapes (latent 512, rope 64, pages of 16) in bf16, as
    `_launch` picks them on Hopper (`decode_launch`): each fits its shared memory (its numbers:
    test_kernels_interpreter.py, the GPU tests)."""
    from moebius.kernels import mla

    BH, BN, warps, stages, whole = mla.decode_launch(512, heads, batch,
                                                     torch.empty(0, 16, 576, dtype=torch.bfloat16))
    assert BH == (mla.WIDE_HEAD_BLOCK if heads >= mla.WIDE_HEAD_BLOCK else mla.HEAD_BLOCK)
    types = dict(QLat="*bf16", QRope="*bf16", Cache="*bf16", Out="*bf16", PartAcc="*fp32", PartML="*fp32",
                 BlockTables="*i32", SeqLens="*i64", QStart="*i64", scale="fp32", H="i32",
                 **{n: "i32" for n in ("stride_lt", "stride_lh", "stride_rt", "stride_rh", "stride_ot", "stride_oh",
                                       "stride_pg", "stride_tok", "stride_bt")})
    for w in {whole, True}:  # (the whole-tile loop as mla_tune.py times it)
        consts = dict(C=512, R=64, CP=512, RP=64, NUM_SPLITS=1, BH=BH, BM=1, BN=BN, PAGE=16, PREC="tf32",
                      DECODE=True, WHOLE=w, PDL=1)
        compile_sm90(mla._mla_fwd, types, consts, warps, stages, aligned=tuple(n for n in types if "stride" in n))


@pytest.mark.parametrize("E,K,G,TG,sigmoid", [(64, 6, 1, 1, False), (160, 6, 8, 3, False), (256, 8, 8, 4, True),
                                              (384, 8, 1, 1, True)], ids=["v2-lite", "v2", "v3", "kimi-k2"])
def test_grouped_routing_compiles_for_hopper(E: int, K: int, G: int, TG: int, sigmoid: bool) -> None:
    """`kernels/fused._grouped_topk` at the DeepSeek family's routings (its numbers: test_kernels_interpreter.py)."""
    from moebius.kernels import fused

    types = dict(Logits="*fp32", Bias="*fp32", W="*fp32", Ids="*i64", T="i32", E="i32", SPLITS="i32", scale="fp32")
    compile_sm90(fused._grouped_topk, types, dict(K=K, SIGMOID=sigmoid, HAS_BIAS=sigmoid, G=G, TG=TG, TOP2=sigmoid,
                                                  NORM=sigmoid, BLOCK=triton.next_power_of_2(E),
                                                  GP=triton.next_power_of_2(G), PDL=1), 1 if E <= 256 else 2, 1)


@pytest.mark.parametrize("BT", [16, 64])
@pytest.mark.parametrize("prec", ["ieee", "tf32x3"])
def test_the_float32_router_compiles_for_hopper(BT: int, prec: str) -> None:
    """`kernels/fused._router_f32` (DeepSeek's and GLM-4.5's float32 router, IEEE float32 dots of upcast bf16 rows;
    its numbers: test_kernels_interpreter.py)."""
    from moebius.kernels import fused

    types = dict(X="*bf16", Wg="*fp32", Part="*fp32", T="i32", E="i32", D="i32", KPER="i32", stride_x="i32")
    compile_sm90(fused._router_f32, types, dict(BT=BT, BN=64, BK=64, PREC=prec, PDL=1), 4, 3,
                 aligned=("E", "D", "KPER", "stride_x"))


@pytest.mark.parametrize("fmt", [WHOLE, CHUNKS], ids=["whole", "chunks"])
@pytest.mark.parametrize("act8", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("K", [2048, 4096])
def test_the_fp8_row_projection_compiles_for_hopper_in_registers(act8: bool, K: int, fmt: int) -> None:
    """`kernels/linear._linear_fp8_rows` at Qwen3-30B-A3B's q|k|v and o widths: its weight rows in 16-byte loads
    and held in registers without spilling to local memory (its point: loaded before the wait for the kernel before)."""
    CB = triton.next_power_of_2(K // 128)
    consts = dict(HAS_BIAS=True, BN=max(1, linear.TILE_ELEMS // (CB * 128)), CB=CB, ACT8=act8, FMT=fmt, PDL=1)
    asm = compile_sm90(linear._linear_fp8_rows, LINEAR_TYPES, consts, 8, 1,
                       aligned=("N", "K", "WS", "stride_x", "stride_o"))
    assert "ld.global.v4" in asm["ptx"] and not re.search(r"\b(ld|st)\.local", asm["ptx"])


def test_the_align_and_argmax_atomics_are_relaxed() -> None:
    """The fused MoE's align passes (`_align`, `_align_scatter`: a pair claims its row) and the argmax's per-program
    maximum issue relaxed atomics: Triton's default acq_rel compiles each into a GPU-wide fence, the atomic and an L1
    invalidation, one pair after another, in launches on every MoE layer's and every step's path."""
    from moebius.kernels import fused

    align_types = dict(Ids="*i64", N="i32", first="i32", E="i32", SortedIds="*i32", BlockExpert="*i32",
                       Cursor="*i32", num_rows="i32", max_blocks="i32", Ends="*i32")
    kernels = [(fused_moe._align, align_types, dict(BM=16, EB=256, CHUNK=1024, PDL=1)),
               (fused_moe._align_scatter, align_types, dict(BM=16, EB=256, CHUNK=1024, PDL=1)),
               (fused._argmax_keys, dict(Scores="*bf16", Keys="*i64", V="i32", stride="i32", first="i32",
                                         CHUNKS="i32"), dict(BLOCK=2048, PDL=1))]
    for fn, types, consts in kernels:
        ptx = compile_sm90(fn, types, consts, 8, 1)["ptx"]
        atomics = re.findall(r"\b(?:atom|red)\.global\.\S+", ptx)
        assert atomics and all(".relaxed." in a for a in atomics), (fn.__name__, sorted(set(atomics)))
