"""Triton kernels on the CPU under the Triton interpreter, against their torch references, in float32 (the interpreter's
bf16 dots are not exact): the fused MoE (moebius/kernels/fused_moe.py: direct blocks for a handful of pairs, the one-
program align and the chunked align passes, all local experts and a slice of them as in EP), paged attention
(moebius/kernels/attention.py: decode with and without KV splits, prefill, mixed chunks, over shuffled block tables;
prompt chunks also from the host's query-block table, a step's leading decodes also in a launch of their own),
the few-row linears (moebius/kernels/linear.py), the switch's reshard copies (moebius/kernels/copy.py), the q/k
norm + RoPE + cache write, the router (K-split logits, then top-k), the vocabulary argmax keys and the add + norm
with and without the expert pairs summed inside it (moebius/kernels/fused.py). MLA's paged latent attention
(moebius/kernels/mla.py: decodes, and causal prompt chunks beside them) against DeepSeek's torch absorbed and
expanded forms. The fused MoE on MXFP4 rows (and its weights as its dots take them, bit for bit) in bf16, over the
interpreter's bf16 dots and casts made the GPU's (`_bf16_as_the_gpu`). The interpreter is chosen when Triton
defines the kernels, so the cases run in a fresh interpreter (this file as a script). Needs Triton (the `gpu` extra);
skipped without it. tests/test_gpu.py runs the same kernels compiled, in bf16. (The symmetric-memory kernels:
tests/test_symmetric_protocol.py.)"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

# (tokens, experts of the model, local experts, first local expert): top-4, so 4 * tokens pairs
CASES = [(1, 16, 16, 0), (6, 16, 8, 8), (8, 16, 16, 0), (40, 16, 8, 8), (300, 16, 16, 0), (700, 8, 8, 0)]


def moe_cases() -> None:
    from moebius.kernels import fused_moe as fm
    from moebius.layers.moe import experts_ref

    g = torch.Generator().manual_seed(0)
    K, D, I = 4, 64, 32
    kinds: set[str] = set()  # the blocks the half-block launches took
    for T, E_all, E, first in CASES:
        x = torch.randn(T, D, generator=g)
        ids = torch.stack([torch.randperm(E_all, generator=g)[:K] for _ in range(T)])
        w = torch.rand(T, K, generator=g).softmax(-1)
        w13 = torch.randn(E, 2 * I, D, generator=g) * 0.1
        w2 = torch.randn(E, D, I, generator=g) * 0.1
        ref = experts_ref(x, w, ids, w13, w2, first)
        out = fm.fused_experts(x, w, ids, w13, w2, first, E_all)
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < 1e-5, (T, E, first, err)
        # blocks interleaved in groups (`_program_tile`; 3: the last group short), sorted blocks of several an expert
        cfg = fm.config_for(T * K, E, E_all // E)
        grouped = fm.MoEConfig(8, *(dataclasses.replace(c, group=3) for c in (cfg.gate_up, cfg.down)))
        out = fm.fused_experts(x, w, ids, w13, w2, first, E_all, config=grouped)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5, (T, E, first, "grouped")
        # half blocks (`TileConfig.halves`): 32-row blocks, an expert's last taking its first 16 rows where its
        # pairs end there, beside whole ones
        halves = fm.MoEConfig(32, *(dataclasses.replace(c, halves=True) for c in (cfg.gate_up, cfg.down)))
        out = fm.fused_experts(x, w, ids, w13, w2, first, E_all, config=halves)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5, (T, E, first, "halves")
        if T * K > fm.DIRECT_MAX_PAIRS:
            used = fm.align(ids, first, E, 32).rows.view(-1, 32) < T * K
            kinds |= {"half" if u[0] and not u[16] else "whole" for u in used.tolist() if u[0]}
    assert kinds == {"half", "whole"}, kinds


def moe_biased_cases() -> None:
    """The fused MoE with GPT-OSS's experts (biases on [gate | up] and down, the clamped activation) against the
    torch reference: direct and sorted blocks, all local experts and EP's slice, and TP's rank without the down
    bias."""
    from moebius.kernels import fused_moe as fm
    from moebius.layers.moe import ClampedSwiGLU, experts_ref

    g = torch.Generator().manual_seed(3)
    K, D, I = 4, 64, 32
    act = ClampedSwiGLU(alpha=1.702, limit=2.0)
    for (T, E_all, E, first), down_bias in zip([(6, 16, 8, 8), (40, 16, 16, 0), (300, 16, 8, 0)],
                                               [True, True, False], strict=True):
        x = torch.randn(T, D, generator=g)
        ids = torch.stack([torch.randperm(E_all, generator=g)[:K] for _ in range(T)])
        w = torch.rand(T, K, generator=g).softmax(-1)
        w13 = torch.randn(E, 2 * I, D, generator=g) * 0.3  # (large enough that the clamps bite)
        w2 = torch.randn(E, D, I, generator=g) * 0.1
        b13 = torch.randn(E, 2 * I, generator=g)
        b2 = torch.randn(E, D, generator=g) if down_bias else None
        out = fm.fused_experts(x, w, ids, w13, w2, first, E_all, b13_EF=b13, b2_ED=b2, clamp=(act.alpha, act.limit))
        ref = experts_ref(x, w, ids, w13, w2, first, act=act, b13_EF=b13, b2_ED=b2)
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < 1e-5, (T, E, first, down_bias, err)
        h = torch.cat([x @ w13[0, :I].T + b13[0, :I], x @ w13[0, I:].T + b13[0, I:]], -1)
        assert (h[:, :I] > act.limit).any() and (h[:, I:].abs() > act.limit).any()  # both clamps take part


def attention_window_cases() -> None:
    """The paged kernel with a sliding window and sink logits (GPT-OSS's layers) against the torch reference, in the
    launches the engine makes (decodes with and without KV splits, prompt chunks on the grid and from the host's
    query-block table, decodes apart); each sequence's pages before its first query's window are a page of NaN (a
    window group's freed pages read as page 0): the kernel never reads them."""
    import numpy as np
    from attention_cases import paged_metadata

    from moebius.config import first_live_page
    from moebius.kernels.attention import paged_attention, query_block_tokens
    from moebius.layers.attention import leading_decodes, paged_attention_ref, query_blocks

    g = torch.Generator().manual_seed(2)
    bs, pages, heads, kvh, d = 16, 96, 8, 2, 64
    for window, with_sinks in [(5, True), (40, False), (33, True)]:
        sinks = torch.randn(heads, generator=g) if with_sinks else None
        for ctx, q_lens in [([1, 17, 100, 64], [1] * 4), ([150, 70], [130, 1]), ([30, 47, 100, 64, 12],
                                                                               [1, 1, 1, 40, 1])]:
            meta = paged_metadata(q_lens, ctx, bs, pages, "cpu", seed=len(ctx) + window)
            cache = torch.randn(pages, 2, bs, kvh, d, generator=g)
            cache[0] = float("nan")
            for b, (c, n) in enumerate(zip(ctx, q_lens, strict=True)):
                meta.block_tables[b, : first_live_page(c - n, window, bs)] = 0
            q = torch.randn(sum(q_lens), heads, d, generator=g)
            ref = paged_attention_ref(q, cache, meta, d ** -0.5, sinks=sinks, window=window)
            launches = [dict(num_splits=s) for s in ([1, 4] if max(q_lens) == 1 else [1])]
            if max(q_lens) > 1:
                lens = np.array(q_lens)
                dec = leading_decodes(lens)
                blocks = query_blocks(lens, np.array(ctx), query_block_tokens(d, heads // kvh), dec)
                launches.append(dict(q_blocks=torch.from_numpy(blocks.reshape(-1, 2)), decodes=dec, num_splits=2))
            for kw in launches:
                out = paged_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                      meta.max_query_len, d ** -0.5, window=window, sinks=sinks, **kw)
                err = ((out - ref).norm() / ref.norm()).item()
                assert err < 1e-5, (window, with_sinks, q_lens, kw.keys(), err)


# (tokens, experts of the model, local experts, first local expert), (hidden, intermediate) of the FP8 cases: widths
# of whole and ragged 128-column chunks, direct and sorted blocks, all local experts and EP's slice
FP8_CASES = [((6, 16, 8, 8), (192, 160)), ((40, 16, 8, 8), (128, 256)), ((300, 16, 16, 0), (200, 128))]


def _fp8_moe_inputs(g: torch.Generator, T: int, E_all: int, E: int, D: int, I: int, K: int = 4,
                    whole: tuple[bool, bool] = (True, False)) -> tuple:
    """x, routing ids and weights, and FP8 rows w13 [E, 2I, .] and w2 [E, D, .] of one FP8 case, each in one segment
    or a segment a chunk (`whole`; by default as the engine holds them where TP over ranks may cut down's columns,
    `specs.whole_rows`)."""
    from moebius.kernels.fp8_rows import pack_rows

    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E_all, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g).softmax(-1)
    w13 = pack_rows(torch.randn(E, 2, I, D, generator=g) * 0.1, whole=whole[0]).flatten(1, 2)
    w2 = pack_rows(torch.randn(E, D, I, generator=g) * 0.1, whole=whole[1])
    assert w13.dtype == w2.dtype == torch.uint8
    return x, ids, w, w13, w2


def _nearest_even_fp8_casts() -> None:
    """Triton's interpreter rounds float32 -> float8 wrongly (triton-lang/triton#8322: up whenever the guard bit is
    set, a mantissa carry OR'd into the exponent, subnormals truncated); the GPU rounds to nearest even, as torch does,
    so the W8A8 cases cast through torch."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    cast = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self: interpreter.InterpreterBuilder, src: interpreter.TensorHandle, dst_type: tl.dtype,
                        rounding_mode: object) -> interpreter.TensorHandle:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            q = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.float8_e4m3fn).view(torch.uint8)
            return interpreter.TensorHandle(q.numpy(), tl.float8e4nv)
        return cast(self, src, dst_type, rounding_mode)

    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp


def moe_fp8_cases() -> None:
    """The fused MoE on FP8 rows (kernels/fp8_rows.py) in W8A16 (the default, kc.fp8_activations off: each weight
    tile dequantized as loaded) against the torch reference, which dequantizes them."""
    from moebius.kernels import KernelConfig
    from moebius.kernels import fused_moe as fm
    from moebius.layers.moe import experts_ref

    g = torch.Generator().manual_seed(1)
    for (T, E_all, E, first), (D, I) in FP8_CASES:
        x, ids, w, w13, w2 = _fp8_moe_inputs(g, T, E_all, E, D, I)
        out = fm.fused_experts(x, w, ids, w13, w2, first, E_all, kc=KernelConfig(fp8_activations=False))
        ref = experts_ref(x, w, ids, w13, w2, first)
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < 1e-5, (T, E, first, D, I, err)
    # prompt sizes (from UNPACK_PAIRS pairs an expert, lowered here to any): the experts unpacked a share at a time
    # (UNPACK_BYTES lowered to three experts': passes of 3, 3, 2 of EP's 8 and 3 x 5 + 1 of 16) and through the plain
    # kernels, each pass writing its pairs
    passes: list[int] = []
    unpack, saved = fm.unpack_fp8, (fm.UNPACK_PAIRS, fm.UNPACK_BYTES)

    def counted(w: torch.Tensor, *a: object, **kw: object) -> torch.Tensor:
        passes.append(w.shape[0])
        return unpack(w, *a, **kw)

    fm.unpack_fp8 = counted
    try:
        for (T, E_all, E, first), (D, I) in FP8_CASES[1:]:
            fm.UNPACK_PAIRS, fm.UNPACK_BYTES = 1, 3 * (3 * I * D * 4)
            x, ids, w, w13, w2 = _fp8_moe_inputs(g, T, E_all, E, D, I)
            passes.clear()
            out = fm.fused_experts(x, w, ids, w13, w2, first, E_all)
            ref = experts_ref(x, w, ids, w13, w2, first)
            assert passes == [n * rows for n in [3] * (E // 3) + [E % 3] * (E % 3 > 0) for rows in (2 * I, D)], passes
            err = ((out - ref).norm() / ref.norm()).item()
            assert err < 1e-5, (T, E, first, D, I, err)
    finally:
        fm.unpack_fp8, (fm.UNPACK_PAIRS, fm.UNPACK_BYTES) = unpack, saved


def moe_fp8_f16_cases() -> None:
    """W8A16's gate/up as a GPU runs it in 16 bits: x as float16 rows times a power of two a row
    (`linear.scaled_f16`: exact, in range for bf16 rows past float16's 65504 and for tiny ones), float16 dots on the
    chunks' exact float8 values, the block scales on the products. Its h against float32 math on the dequantized
    weights rounded where the kernel rounds (gate and up, silu's output, the product: test_gpu.py's `fused_act`, here
    toward zero in bf16 as the interpreter rounds) within a last bit on either side of some elements (1e-3 in float16,
    1e-2 in bf16), in bf16 with rows 2^20 times larger and smaller than the rest too (unscaled, float16 overflows
    the first and rounds the second to a few bits); and in float16 the whole MoE against float32 math within 20 times
    that (its roundings of h and of the output on top). The interpreter's bf16 dots, which down's W8A16 tiles take in
    bf16, are not exact (test_gpu.py runs the whole MoE in bf16 on a GPU). Blocks past decode's
    (`CHUNK_DOTS_MAX_BM`: the 300-token case's 128 rows) take the tile dequantized to x's own dtype, no float16 rows
    (checked in float16, each weight rounded there as the reference rounds it)."""
    import torch.nn.functional as F

    from moebius.kernels import fused_moe as fm
    from moebius.kernels.fp8_rows import unpack_rows
    from moebius.kernels.linear import scaled_f16
    from moebius.layers.moe import experts_ref

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(5, 300, generator=g) * torch.tensor([1.0, 3e5, 1e-30, 0.0, 7e4])[:, None]).bfloat16()
    x16, scale = scaled_f16(x)
    amax = x16.float().abs().amax(1)
    assert torch.equal(scale.log2().round().exp2(), scale), scale  # powers of two
    assert list(amax >= 2 ** 14) == [True, True, True, False, True] and (amax < 2 ** 15).all(), amax
    assert list(scale > 1) == [False, True, False, False, True] and scale[3] == 2.0 ** -126, scale
    assert torch.equal(x16.float() * scale[:, None], x.float())
    K = 4
    def trunc_bf16(t: torch.Tensor) -> torch.Tensor:  # (the interpreter's float32 -> bf16: toward zero, not nearest)
        return (t.view(torch.int32) & -65536).view(torch.float32)

    for dt, tol in ((torch.float16, 1e-3), (torch.bfloat16, 1e-2)):
        def act(gu: torch.Tensor, dt: torch.dtype = dt) -> torch.Tensor:
            r = (lambda t: t.half().float()) if dt == torch.float16 else trunc_bf16
            gate, up = r(gu).chunk(2, dim=-1)
            return r(r(F.silu(gate)) * up)

        for (T, E_all, E, first), (D, I) in FP8_CASES:
            x, ids, wk, w13, w2 = _fp8_moe_inputs(g, T, E_all, E, D, I, K)
            x = x.to(dt)
            if dt == torch.bfloat16:
                x[0] *= 2.0 ** 20
                x[-1] *= 2.0 ** -20
            c = fm.config_for(T * K, E, E_all // E)
            if dt == torch.bfloat16 and c.BM > fm.CHUNK_DOTS_MAX_BM:  # (bf16 tiles take the interpreter's bf16 dots)
                continue
            blocks = fm.direct(ids, first, c.BM) if T * K <= fm.DIRECT_MAX_PAIRS else fm.align(ids, first, E, c.BM)
            calls: list[torch.Tensor] = []
            fm.scaled_f16 = lambda x, calls=calls, **kw: calls.append(x) or scaled_f16(x, **kw)
            try:
                h = fm.gate_up(x, w13, blocks, K, c.gate_up).float()
            finally:
                fm.scaled_f16 = scaled_f16
            assert len(calls) == (c.BM <= fm.CHUNK_DOTS_MAX_BM), (T, c.BM, len(calls))
            w = unpack_rows(w13, D, torch.float32)
            if c.BM > fm.CHUNK_DOTS_MAX_BM:  # (the dequantized tile: each weight rounded to x's float16)
                w = w.half().float()
            for pair in range(T * K):
                e = ids.flatten()[pair].item() - first
                if not 0 <= e < E:  # (another rank's expert: no row)
                    continue
                row = pair if blocks.direct else torch.nonzero(blocks.rows == pair).item()
                want = act(x[pair // K].float() @ w[e].T)
                err = ((h[row] - want).norm() / want.norm()).item()
                assert torch.isfinite(h[row]).all() and err < tol, (dt, T, E, first, D, I, pair, err)
            if dt == torch.bfloat16:  # (down's W8A16 tiles, dequantized to bf16, take bf16 dots: not the interpreter's)
                continue
            out = fm.fused_experts(x, wk.to(dt), ids, w13, w2, first, E_all).float()  # the whole MoE
            ref = experts_ref(x.float(), wk, ids, w13, w2, first)
            hit = ref.norm(dim=1) > 0  # (tokens with a local expert)
            err = ((out - ref).norm(dim=1)[hit] / ref.norm(dim=1)[hit]).max().item()
            assert torch.isfinite(out).all() and err < 20 * tol, (dt, T, E, first, D, I, err)


def fp8_layouts_cases() -> None:
    """The fused MoE on FP8 rows in either layout (kernels/fp8_rows.py: one segment a row, or a segment a chunk) gives
    the same outputs bit for bit, W8A16 and W8A8: the same values read from other bytes (a wrong scale offset fails
    it)."""
    from moebius.kernels import KernelConfig
    from moebius.kernels import fused_moe as fm
    from moebius.kernels.fp8_rows import unpack_rows

    _nearest_even_fp8_casts()
    for act8 in (False, True):
        kc = KernelConfig(fp8_activations=act8)
        for (T, E_all, E, first), (D, I) in FP8_CASES:
            outs, w13s = [], []
            for whole in ((False, False), (True, True)):
                g = torch.Generator().manual_seed(3)  # (the same values in both layouts)
                x, ids, w, w13, w2 = _fp8_moe_inputs(g, T, E_all, E, D, I, whole=whole)
                w13s.append(unpack_rows(w13, D, torch.float32))
                outs.append(fm.fused_experts(x, w, ids, w13, w2, first, E_all, kc=kc))
            assert torch.equal(*w13s) and torch.equal(*outs), (act8, T, E, first, D, I)


def moe_w8a8_cases() -> None:
    """The fused MoE on FP8 rows in W8A8 (kc.fp8_activations: float8 dots of activations quantized per token and
    128-column group, x once by `quantize_rows`, h by the gate_up launch as it stores it) against torch's statement
    of it: `quantize_groups` on the activations, float32 math on the dequantized weights. The down launch is checked
    on the h the gate_up launch wrote to 1e-5, gate_up's quantized h within float8 steps (two float32 sums a last
    bit apart round a step apart where they straddle a midpoint: a few elements in 10^5), and the whole
    `fused_experts` against `experts_ref` so quantized, within such steps. The W8A16 results, and a down on the
    unquantized h, differ by percents (a fallback fails)."""
    from moebius.kernels import KernelConfig
    from moebius.kernels import fused_moe as fm
    from moebius.kernels.fp8_rows import quantize_groups, unpack_rows
    from moebius.layers.moe import experts_ref, swiglu

    W8A8 = KernelConfig(fp8_activations=True)
    _nearest_even_fp8_casts()
    g = torch.Generator().manual_seed(1)
    K = 4
    for (T, E_all, E, first), (D, I) in FP8_CASES:
        x, ids, w, w13, w2 = _fp8_moe_inputs(g, T, E_all, E, D, I, K)
        c = fm.config_for(T * K, E, E_all // E)
        blocks = fm.direct(ids, first, c.BM) if T * K <= fm.DIRECT_MAX_PAIRS else fm.align(ids, first, E, c.BM)
        h8 = fm.gate_up(x, w13, blocks, K, c.gate_up, kc=W8A8)  # FP8 rows, quantized as stored
        y = fm.down(h8, w2, blocks, w.reshape(-1), c.down, kc=W8A8, cols=I, dtype=x.dtype)
        h = unpack_rows(h8, I, torch.float32)
        row = torch.arange(T * K)  # each pair's row of h (direct: its own; sorted: where the align put it)
        if not blocks.direct:
            used = blocks.rows < T * K
            row[blocks.rows[used].long()] = torch.nonzero(used).flatten()
        local = ids.flatten() - first
        stages = {"h": ([], [], []), "y": ([], [], [])}  # the kernel's, the W8A8 reference's, the W8A16 one's
        for e in range(E):
            p = torch.nonzero(local == e).flatten()
            w13_e, w2_e = unpack_rows(w13[e], D, torch.float32), unpack_rows(w2[e], I, torch.float32)
            x_p, h_p, w_p = x[p // K], h[row[p]], w.flatten()[p, None]
            h_f = swiglu(quantize_groups(x_p) @ w13_e.T)  # h before its quantization
            for name, *results in (("h", h_p, quantize_groups(h_f), swiglu(x_p @ w13_e.T)),
                                   ("y", y[p], w_p * (h_p @ w2_e.T), w_p * (h_f @ w2_e.T))):
                for kept, r in zip(stages[name], results, strict=True):
                    kept.append(r)
        for name, results in stages.items():
            got, want, a16 = (torch.cat(r) for r in results)
            err, apart = ((got - want).norm() / want.norm()).item(), ((a16 - want).norm() / want.norm()).item()
            assert err < (1e-5 if name == "y" else 2e-4) and apart > 1e-2, (name, T, E, first, D, I, err, apart)
        out = fm.fused_experts(x, w, ids, w13, w2, first, E_all, kc=W8A8)
        ref = experts_ref(quantize_groups(x), w, ids, w13, w2, first, act=lambda gu: quantize_groups(swiglu(gu)))
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < 2e-4, (T, E, first, D, I, err)


def _bf16_as_the_gpu() -> None:
    """Triton's interpreter holds bfloat16 as its bits (uint16): its dots multiply those bits as integers, and its
    float32 -> bfloat16 casts truncate (subnormals lost). The GPU's tensor cores multiply bf16 values exactly and sum
    in float32, and its casts round to nearest even as torch does: so the bf16 cases dot and cast through torch."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    dot, cast = builder.create_dot, builder.cast_impl

    def widened(h: interpreter.TensorHandle) -> interpreter.TensorHandle:
        if h.dtype.scalar != tl.bfloat16:
            return h
        v = torch.from_numpy(np.array(h.data).view(np.int16)).view(torch.bfloat16).float()
        return interpreter.TensorHandle(v.numpy(), tl.float32)

    def create_dot(self: interpreter.InterpreterBuilder, a: interpreter.TensorHandle, b: interpreter.TensorHandle,
                   d: interpreter.TensorHandle, *args: object) -> interpreter.TensorHandle:
        return dot(self, widened(a), widened(b), d, *args)

    def cast_impl(self: interpreter.InterpreterBuilder, src: interpreter.TensorHandle, dst_type: tl.dtype
                  ) -> interpreter.TensorHandle:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            q = torch.from_numpy(np.array(src.data, dtype=np.float32)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(q.numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl


if importlib.util.find_spec("triton") is not None:  # (the interpreter runs a kernel in its module's globals)
    import triton
    import triton.language as tl

    from moebius.kernels.linear import mx4_dot

    @triton.jit
    def _mxfp4_weights(X, W, Out, R, K, WS, stride_o, BR: tl.constexpr, BK: tl.constexpr, XB: tl.constexpr):
        """Out[r, k] = what `mx4_dot` makes of MXFP4 rows r against X, an identity of Out's row stride, XB of its
        rows a program: row r's weights, each the one product in its sum, every K step taken."""
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        k = tl.program_id(1) * XB + tl.arange(0, XB)
        acc = tl.zeros([XB, BR], tl.float32)
        for k0 in range(0, K, BK):
            acc = mx4_dot(X, k, k < K, stride_o, W, r, r < R, k0, K, WS, acc, BK)
        tl.store(Out + r[None, :] * stride_o + k[:, None], acc.to(Out.dtype.element_ty))


def mxfp4_tile_cases() -> None:
    """The fused MoE's MXFP4 dots (`linear.mx4_dot`: for 16 rows of X each chunk's codes as two tiles of e2m1 values,
    its scale on the float32 partial; for more a dequantized tile, `mx4_tile`) against `unpack_rows`, bit for bit
    (zeros of either sign alike: a dot's sum of zeros is +0), in bf16: through an identity X 16 rows and a step's
    columns at a time (both forms), every byte of codes, scale bytes from 0 (2^-127: subnormal values) to 252
    (6 * 2^125, near float32's largest; 254's inf weights would make the identity's zeros NaN, as in any product), K
    steps of 32, 64 and 128 columns over rows of 160 (the last step ragged), masked rows and columns 0."""
    from moebius.kernels.mxfp4_rows import CHUNK, pack_rows, unpack_rows

    _bf16_as_the_gpu()
    g = torch.Generator().manual_seed(5)
    R, C, dt = 13, 160, torch.bfloat16
    w = pack_rows(torch.randn(R, C, generator=g) * torch.logspace(-100, 20, R, base=2)[:, None])
    chunks = w.view(R, -1, CHUNK)
    chunks[:4, :, :16] = (torch.arange(4 * 5 * 16) % 256).to(torch.uint8).view(4, 5, 16)  # every byte of codes
    chunks[:4, :, 16] = torch.tensor([0, 1, 2, 127, 252], dtype=torch.uint8)
    want = unpack_rows(w, C, dt) + 0.0  # (-0.0 as +0.0)
    assert want.isfinite().all() and want.abs().max() == 6 * 2.0**125
    for BK, XB in itertools.product((32, 64, 128), (16, 0)):
        XB = XB or BK
        cols = triton.cdiv(C, BK) * BK
        eye = torch.eye(cols, dtype=dt)
        out = torch.full((32, cols), float("nan"), dtype=dt)  # two programs of 16 rows: the last 19 masked
        _mxfp4_weights[(2, cols // XB)](eye, w, out, R, C, w.shape[1], cols, BR=16, BK=BK, XB=XB)
        assert torch.equal((out[:R, :C] + 0.0).view(torch.int16), want.view(torch.int16)), (BK, XB)
        assert (out[R:] == 0).all() and (out[:, C:] == 0).all(), (BK, XB)


# (tokens, experts of the model, local experts, first local expert), (hidden, intermediate), GPT-OSS's experts (biases,
# the clamped activation) of the MXFP4 cases: widths of 1.5 and 2.5 K steps (fused_moe.MXFP4_BK = 64) and whole ones,
# direct blocks, sorted blocks (one-program and chunked align), all local experts and EP's slice
MXFP4_CASES = [((6, 16, 8, 8), (96, 160), False), ((8, 16, 8, 8), (160, 96), True), ((40, 16, 16, 0), (160, 96), True),
               ((40, 16, 8, 8), (96, 64), False), ((300, 16, 8, 0), (96, 64), True)]


def moe_mxfp4_cases() -> None:
    """The fused MoE on MXFP4 rows (kernels/mxfp4_rows.py; W4A16: each weight tile decoded to bf16 as loaded) on bf16
    activations against `experts_ref` on the same rows (dequantized by `unpack_rows`: the same bf16 weights). Each
    pair's output (keep_pairs) against the reference run on that pair alone, and the pairs summed in float32 against
    those summed so, to 1e-4 (observed 0 to 2e-5: the weights equal, the rounding points the same, only the float32
    summation order differs, flipping a last bf16 bit in ~1e-4 of the elements); the whole against `experts_ref`,
    which adds the pairs in bf16, to 1e-2 (~4e-3 apart). GPT-OSS's activation in the pairs' reference as the kernel
    computes it: in float32 on the bf16-rounded gate and up, rounded once (bf16 torch rounds after each op)."""
    from moebius.kernels import fused_moe as fm
    from moebius.kernels.mxfp4_rows import pack_rows, unpack_rows
    from moebius.layers.moe import ClampedSwiGLU, experts_ref, swiglu

    def rel(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got.float() - want.float()).norm() / want.float().norm()).item()

    clamped = ClampedSwiGLU(alpha=1.702, limit=2.0)

    def clamped_f32(gu_PF: torch.Tensor) -> torch.Tensor:
        return clamped(gu_PF.float()).to(gu_PF.dtype)

    _bf16_as_the_gpu()
    g = torch.Generator().manual_seed(4)
    K, bf16 = 4, torch.bfloat16
    for (T, E_all, E, first), (D, I), gpt_oss in MXFP4_CASES:
        x = torch.randn(T, D, generator=g).to(bf16)
        ids = torch.stack([torch.randperm(E_all, generator=g)[:K] for _ in range(T)])
        w = torch.rand(T, K, generator=g).softmax(-1).to(bf16)
        w13 = pack_rows(torch.randn(E, 2 * I, D, generator=g) * (0.3 if gpt_oss else 0.1))  # (0.3: the clamps bite)
        w2 = pack_rows(torch.randn(E, D, I, generator=g) * 0.1)
        assert w13.dtype == w2.dtype == torch.uint8 and w13.shape[-1] == D // 32 * 17
        biases = dict(b13_EF=torch.randn(E, 2 * I, generator=g).to(bf16),
                      b2_ED=torch.randn(E, D, generator=g).to(bf16)) if gpt_oss else {}
        clamp = (clamped.alpha, clamped.limit) if gpt_oss else None
        pairs = fm.fused_experts(x, w, ids, w13, w2, first, E_all, keep_pairs=True, clamp=clamp, **biases)
        mine = (ids.flatten() >= first) & (ids.flatten() < first + E)
        p = torch.arange(T * K)  # each pair alone: its output is one bf16 row, no sum
        want = experts_ref(x[p // K], w.reshape(-1, 1), ids.reshape(-1, 1), w13, w2, first,
                           act=clamped_f32 if gpt_oss else swiglu, **biases)
        got_sum, want_sum = pairs.sum(), (want.float() * mine[:, None]).view(T, K, D).sum(1).to(bf16)
        assert rel(pairs.y_ND[mine], want[mine]) < 1e-4, (T, E, first, D, I, gpt_oss, rel(pairs.y_ND[mine], want[mine]))
        assert rel(got_sum, want_sum) < 1e-4, (T, E, first, D, I, gpt_oss, rel(got_sum, want_sum))
        ref = experts_ref(x, w, ids, w13, w2, first, act=clamped if gpt_oss else swiglu, **biases)
        assert rel(got_sum, ref) < 1e-2, (T, E, first, D, I, gpt_oss, rel(got_sum, ref))
        if gpt_oss:  # both clamps take part
            h = x.float() @ unpack_rows(w13[0], D, torch.float32).T + biases["b13_EF"][0].float()
            assert (h[:, :I] > clamped.limit).any() and (h[:, I:].abs() > clamped.limit).any()


def attention_cases() -> None:
    import numpy as np
    from attention_cases import paged_metadata

    from moebius.kernels.attention import paged_attention, query_block_tokens
    from moebius.layers.attention import leading_decodes, paged_attention_ref, query_blocks

    g = torch.Generator().manual_seed(0)
    bs, pages = 16, 96
    for heads, kvh, d in [(8, 2, 64), (4, 4, 32)]:
        for ctx, q_lens in [([1, 17, 100, 64], [1] * 4), ([5, 40], [5, 40]), ([40, 33, 90, 9], [1, 20, 1, 9]),
                            ([150, 70], [130, 1]),  # many query blocks: unmasked tiles below each block's diagonal
                            ([30, 47, 100, 64, 12], [1, 1, 1, 40, 1])]:  # decodes, then a chunk, then a decode
            meta = paged_metadata(q_lens, ctx, bs, pages, "cpu", seed=len(ctx) + heads)
            cache = torch.randn(pages, 2, bs, kvh, d, generator=g)
            q = torch.randn(sum(q_lens), heads, d, generator=g)
            ref = paged_attention_ref(q, cache, meta, d ** -0.5)
            for splits in [1, 4] if max(q_lens) == 1 else [1]:
                out = paged_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                      meta.max_query_len, d ** -0.5, splits)
                err = ((out - ref).norm() / ref.norm()).item()
                assert err < 1e-5, (heads, kvh, q_lens, splits, err)
            if max(q_lens) > 1:  # one program per query block from the host's table
                blocks = query_blocks(np.array(q_lens), np.array(ctx), query_block_tokens(d, heads // kvh))
                out = paged_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                      meta.max_query_len, d ** -0.5, q_blocks=torch.from_numpy(blocks))
                err = ((out - ref).norm() / ref.norm()).item()
                assert err < 1e-5, (heads, kvh, q_lens, "table", err)
                decodes = leading_decodes(np.array(q_lens))
                if decodes:  # the leading decodes in their own launch (KV splits), the table over the rest
                    blocks = query_blocks(np.array(q_lens), np.array(ctx), query_block_tokens(d, heads // kvh),
                                          decodes)
                    out = paged_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                          meta.max_query_len, d ** -0.5, 4, q_blocks=torch.from_numpy(blocks),
                                          decodes=decodes)
                    err = ((out - ref).norm() / ref.norm()).item()
                    assert err < 1e-5, (heads, kvh, q_lens, "decodes apart", err)


def align_cases() -> None:
    """fused_moe.align's one-program pass (up to 1024 pairs) and its chunked passes against what the GEMMs rely on:
    every local pair in exactly one row, each row's block the pair's expert, blocks past the last used one E, unused
    rows N, each expert's rows a BM-aligned run starting where the one before ended. Routings: uniform, all pairs to
    one expert (one expert owns many blocks, the rest none), half the experts idle, an EP rank's slice of them."""
    from moebius.kernels import fused_moe as fm

    g = torch.Generator().manual_seed(0)
    for T, E_all, E, first, K, BM, skew in [(8, 128, 128, 0, 8, 16, "uniform"), (64, 64, 64, 0, 6, 16, "uniform"),
                                            (64, 128, 128, 0, 8, 16, "one"), (100, 32, 32, 0, 4, 64, "half"),
                                            (48, 16, 8, 8, 2, 32, "uniform"), (300, 64, 32, 32, 6, 16, "one"),
                                            (200, 64, 64, 0, 8, 16, "half"), (600, 128, 128, 0, 8, 16, "uniform"),
                                            (700, 128, 64, 64, 8, 64, "one")]:
        scores = torch.rand(T, E_all, generator=g)
        if skew == "one":  # every token's first choice the same expert of this rank
            scores[:, first + 3] += 2.0
        elif skew == "half":  # only every other expert ever chosen
            scores[:, 1::2] -= 2.0
        ids = scores.topk(K, -1).indices
        b = fm.align(ids, first, E, BM)
        flat, rows = ids.flatten(), b.rows.long()
        used = rows < flat.numel()
        local = torch.nonzero((flat >= first) & (flat < first + E)).flatten()
        assert torch.equal(rows[used].sort().values, local), (T, E, skew, "not every local pair once")
        experts = b.block_expert.long()
        assert torch.equal(flat[rows[used]] - first, experts.repeat_interleave(BM)[used]), (T, E, skew)
        counts = torch.bincount(flat[local] - first, minlength=E)
        blocks = (counts + BM - 1) // BM
        want = torch.cat([torch.full((int(n),), e) for e, n in enumerate(blocks)] +
                         [torch.full((b.max_blocks - int(blocks.sum()),), E)])
        assert torch.equal(experts, want), (T, E, skew, experts.tolist(), want.tolist())


def argmax_cases() -> None:
    from moebius.kernels.fused import argmax_keys
    from moebius.layers.sampler import key_ids

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 9000, generator=g)  # three vocabulary chunks a row
    x[1] = -x[1].abs() - 1.0  # all negative
    x[2, [10, 8500]] = 9.0  # a tie across chunks: the lower id
    x[3] = 0.0
    x[3, 4100] = -0.0  # -0.0 equals 0.0: still the first id
    x[4, 8999] = float("inf")
    assert torch.equal(key_ids(argmax_keys(x, 0)), x.argmax(-1))
    assert torch.equal(key_ids(argmax_keys(x, 1000)), x.argmax(-1) + 1000)
    y = torch.randn(600, 9000, generator=g)  # many rows: each program takes several chunks of its row
    y[0, [100, 2100, 4100]] = 9.0  # ties inside one program's part and across parts
    y[1] = float("-inf")
    assert torch.equal(key_ids(argmax_keys(y, 0)), y.argmax(-1))


def qk_cases() -> None:
    from attention_cases import qk_norm_rope_kv_errors

    for heads, kv_heads in [(16, 2), (4, 1)]:
        for T in (1, 45, 100, 700):  # a program's rows within one token, across two, across many programs
            for norm in (True, False):  # (False: no q/k norms, as GPT-OSS's and Mixtral's attention)
                q_err, k_err, v_same = qk_norm_rope_kv_errors(heads, kv_heads, T, 64, "cpu", torch.float32, norm)
                assert q_err < 1e-5 and k_err < 1e-5 and v_same, (heads, kv_heads, T, norm)


def qk_attention_cases() -> None:
    from attention_cases import paged_metadata

    from moebius.kernels.attention import qk_decode_attention
    from moebius.layers.attention import paged_attention_ref, qk_norm_rope_kv
    from moebius.layers.rotary import rope_table

    g = torch.Generator().manual_seed(0)
    bs, pages = 16, 96
    for heads, kvh, d in [(8, 2, 64), (4, 4, 32)]:
        ctx = [1, 17, 100, 64, 33]
        meta = paged_metadata([1] * len(ctx), ctx, bs, pages, "cpu", seed=heads)
        rope = rope_table(d, 4096, 1e6, "cpu")
        qkv = torch.randn(len(ctx), (heads + 2 * kvh) * d, generator=g)
        qn, kn = (torch.rand(d, generator=g) + 0.5 for _ in range(2))
        cache = torch.randn(pages, 2, bs, kvh, d, generator=g)
        want_cache = cache.clone()
        want = paged_attention_ref(qk_norm_rope_kv(qkv, qn, kn, rope, want_cache, meta, 1e-6), want_cache, meta,
                                   d ** -0.5)
        for splits in (1, 4):  # the new token's k and v: stored by the split that holds its position
            got_cache = cache.clone()
            got = qk_decode_attention(qkv, qn, kn, rope, meta.positions, meta.slot_mapping, got_cache, heads, 1e-6,
                                      meta.block_tables, meta.seq_lens, meta.query_start_loc, d ** -0.5, splits)
            assert torch.allclose(got_cache, want_cache, atol=1e-5), (heads, kvh, splits)
            err = ((got - want).norm() / want.norm()).item()
            assert err < 1e-5, (heads, kvh, splits, err)


def test_decode_attention_from_qkv_under_the_interpreter() -> None:
    _run("qk_attention")


def test_grouped_routing_under_the_interpreter() -> None:
    """kernels/fused.py's `grouped_topk` (DeepSeek's and GLM-4.5's routing in one launch) against
    models/grouped_moe.py's torch `route`: softmax greedy and group-limited (groups not a power of two), sigmoid
    noaux_tc with the correction bias and renormalisation, one group of 384: the same experts and weights."""
    _run("grouped_route")


def test_qk_norm_rope_kv_under_the_interpreter() -> None:
    _run("qk")


def grouped_route_cases() -> None:
    from moebius.kernels.fused import grouped_topk, router_partials_f32
    from moebius.models.grouped_moe import MoEConfig, route, router_logits

    g = torch.Generator().manual_seed(0)
    # (experts, top k, scoring, method, groups, kept groups, norm, scaling): DeepSeek-V2-Lite, V2's grouped softmax
    # (160 experts: groups of 20, not a power of two), V3 / GLM-4.5's noaux_tc, Kimi K2's 384 in one group
    for E, K, scoring, method, G, TG, norm, scale in [(64, 6, "softmax", "greedy", 1, 1, False, 1.0),
                                                      (160, 6, "softmax", "group_limited_greedy", 8, 3, False, 16.0),
                                                      (256, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5),
                                                      (384, 8, "sigmoid", "noaux_tc", 1, 1, True, 2.827)]:
        cfg = MoEConfig(num_experts=E, top_k=K, scoring_func=scoring, topk_method=method, n_group=G, topk_group=TG,
                        norm_topk_prob=norm, routed_scaling_factor=scale, n_shared_experts=1,
                        moe_intermediate_size=8, intermediate_size=8)
        bias = torch.randn(E, generator=g) * 0.1 if scoring == "sigmoid" else None
        logits = torch.randn(37, E, generator=g) * 2
        want_w, want_ids = route(logits, cfg, bias)
        got_w, got_ids = grouped_topk(logits, bias, K, scoring == "sigmoid", G, TG, method == "noaux_tc", norm, scale)
        # the same experts with the same weights; the kernel's come in descending order of choice
        order_w, order_g = want_ids.argsort(1), got_ids.argsort(1)
        assert torch.equal(want_ids.gather(1, order_w), got_ids.gather(1, order_g)), (E, method)
        assert torch.allclose(want_w.gather(1, order_w), got_w.gather(1, order_g), rtol=1e-5, atol=1e-6), (E, method)
        choice = (logits.sigmoid() if scoring == "sigmoid" else logits.softmax(-1)) + (0 if bias is None else bias)
        picked = choice.gather(1, got_ids)
        assert (picked[:, :-1] >= picked[:, 1:]).all(), (E, method)
    # the float32 router as split-K partials, summed inside the routing launch (`route_tokens` on the GPU)
    # no tokens (an EP rank's empty step); one split; D not a multiple of 64; 2 token tiles
    for T, D, E in [(0, 256, 64), (1, 256, 64), (37, 200, 160), (70, 448, 64)]:
        cfg = MoEConfig(num_experts=E, top_k=6, scoring_func="softmax", topk_method="greedy", n_group=1,
                        topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, n_shared_experts=1,
                        moe_intermediate_size=8, intermediate_size=8)
        x, gate = torch.randn(T, D, generator=g), torch.randn(E, D, generator=g) * D ** -0.5
        part = router_partials_f32(x, gate)
        assert torch.allclose(part.sum(0), router_logits(x, gate), atol=1e-5), (T, D, E)
        got_w, got_ids = grouped_topk(part, None, 6, False, 1, 1, False, False, 1.0)
        want_w, want_ids = route(part.sum(0), cfg)
        order_w, order_g = want_ids.argsort(1), got_ids.argsort(1)
        assert torch.equal(want_ids.gather(1, order_w), got_ids.gather(1, order_g)), (T, D, E)
        assert torch.allclose(want_w.gather(1, order_w), got_w.gather(1, order_g), rtol=1e-5, atol=1e-6), (T, D, E)


def router_cases() -> None:
    import torch.nn.functional as F

    from moebius.kernels.fused import route

    g = torch.Generator().manual_seed(0)
    for T, E, D, K in [(1, 128, 512, 8), (5, 60, 300, 4), (16, 16, 256, 2)]:  # D: whole and partial K-slices
        x = torch.randn(T, D, generator=g)
        gate = torch.randn(E, D, generator=g)
        for norm in (True, False):
            w, ids = route(x, gate, K, norm)
            want_w, want_ids = torch.topk(torch.softmax(F.linear(x, gate), -1), K, dim=-1)
            if norm:
                want_w = want_w / want_w.sum(-1, keepdim=True)
            assert torch.equal(ids, want_ids), (T, E, D)
            assert torch.allclose(w, want_w, rtol=1e-5, atol=1e-6), (T, E, D)


def test_router_under_the_interpreter() -> None:
    _run("router")


def linear_cases() -> None:
    import torch.nn.functional as F

    from moebius.kernels.linear import linear, linear_mma

    g = torch.Generator().manual_seed(0)
    # (rows, N, K): partial row tiles, K under a power of two, the widest K (4 rows a program); the tensor-core
    # kernel: partial weight-row and K tiles, rows padded to 16 and to 32
    cases = [(linear, 1, 40, 300), (linear, 4, 33, 2048), (linear, 3, 7, 8192), (linear_mma, 3, 100, 300),
             (linear_mma, 5, 64, 512), (linear_mma, 17, 70, 1000)]
    for fn, T, N, K in cases:
        x = torch.randn(T, K, generator=g)
        w = torch.randn(N, K, generator=g)
        b = torch.randn(N, generator=g)
        for bias in (None, b):
            want = F.linear(x, w, bias)
            got = fn(x, w, bias)
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-3), (fn.__name__, T, N, K, (got - want).abs().max())


def test_few_row_linear_under_the_interpreter() -> None:
    _run("linear")


def linear_fp8_cases() -> None:
    """kernels/linear.py's projection on FP8 rows against F.linear on their dequantized weights (`unpack_rows`): one
    row to a prompt's many (several token tiles), whole and ragged 128-column chunks, partial weight-row tiles. W8A16
    (the default) on x, W8A8 (kc.fp8_activations) on `quantize_groups(x)`, to 1e-5; the two differ by percents (a
    fallback fails)."""
    import torch.nn.functional as F

    from moebius.kernels import KernelConfig
    from moebius.kernels.fp8_rows import pack_rows, quantize_groups, unpack_rows
    from moebius.kernels.linear import linear_fp8, linear_fp8_rows

    _nearest_even_fp8_casts()
    g = torch.Generator().manual_seed(3)
    # the tensor-core tiles at any row count (W8A16 past UNPACK_ROWS: the weight unpacked, then F.linear); one or
    # two rows held in registers (`linear_fp8_rows`, the LATE order's)
    for run, cases in ((linear_fp8, [(1, 40, 256), (5, 130, 300), (70, 64, 128), (150, 90, 200), (300, 40, 260)]),
                       (linear_fp8_rows, [(1, 40, 256), (2, 19, 300), (2, 70, 1000)])):
        for i, (T, N, K) in enumerate(cases):
            x = torch.randn(T, K, generator=g)
            w = pack_rows(torch.randn(N, K, generator=g) * 0.1, whole=i % 2 == 1)  # (both layouts, in turn)
            b = torch.randn(N, generator=g)
            for bias in (None, b):
                want = F.linear(x, unpack_rows(w, K, x.dtype), bias)
                got = run(x, w, bias)
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (run, T, N, K, (got - want).abs().max())
                want8 = F.linear(quantize_groups(x), unpack_rows(w, K, x.dtype), bias)
                err = ((run(x, w, bias, kc=KernelConfig(fp8_activations=True)) - want8).norm() / want8.norm()).item()
                assert err < 1e-5, (run, T, N, K, bias is None, err)
                assert ((want - want8).norm() / want8.norm()).item() > 1e-3, (T, N, K)
    # the one-pass unpack: exactly `unpack_rows` (ragged last chunk, partial row blocks; in float32, since the
    # interpreter's bf16 casts truncate: bf16 in tests/test_gpu.py)
    from moebius.kernels.linear import unpack_fp8

    for N, K, whole in ((40, 260, False), (40, 260, True), (33, 128, True)):
        w = pack_rows(torch.randn(N, K, generator=g) * 0.1, whole=whole)
        assert torch.equal(unpack_fp8(w, K, torch.float32), unpack_rows(w, K, torch.float32)), (N, K, whole)
    # W8A8's activations quantized once (`quantize_rows`, the fused MoE's x): `quantize_groups`' values, a zero row
    # and a ragged last group included
    from moebius.kernels.linear import quantize_rows

    for T, K in ((40, 260), (33, 128)):
        x = torch.randn(T, K, generator=g) * 3
        x[1] = 0
        assert torch.equal(unpack_rows(quantize_rows(x), K, torch.float32), quantize_groups(x)), (T, K)
    # K split into float32 partials summed in split order (`launch_fp8`'s splits, at most one a chunk: 8 asks for 3
    # at 300 columns), the bias added once; W8A16 and W8A8 with either operand as the dot's rows (`token_rows`)
    from moebius.kernels.linear import launch_fp8

    for T, N, K, splits in [(5, 130, 300, 2), (70, 64, 300, 8), (3, 40, 1000, 4), (20, 50, 260, 1)]:
        x = torch.randn(T, K, generator=g)
        w = pack_rows(torch.randn(N, K, generator=g) * 0.1)
        b = torch.randn(N, generator=g)
        for act8, token_rows in ((False, False), (False, True), (True, False), (True, True)):
            kc = KernelConfig(fp8_activations=act8)
            want = linear_fp8(x, w, b, kc=kc)
            got = torch.empty_like(want)
            launch_fp8(x, w, b, got, 32, 16, 4, 2, splits, token_rows, kc=kc)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (T, N, K, splits, act8, token_rows,
                                                                      (got - want).abs().max())


def test_fp8_linear_under_the_interpreter() -> None:
    """--quantization fp8's dense projections on the GPU (the attention's and dense layers' FP8 rows)."""
    _run("linear_fp8")


def test_argmax_keys_under_the_interpreter() -> None:
    _run("argmax")


def test_moe_align_under_the_interpreter() -> None:
    _run("align")


def test_fused_experts_under_the_interpreter() -> None:
    from moebius.kernels import fused_moe as fm

    pairs = [4 * c[0] for c in CASES]
    assert min(pairs) <= fm.DIRECT_MAX_PAIRS < max(pairs)  # both block kinds
    assert max(pairs) > 1024  # the chunked align passes (one program takes up to 1024 pairs)
    _run("moe")


def test_fused_experts_on_fp8_rows_under_the_interpreter() -> None:
    """--quantization fp8's default GPU path (W8A16): each weight
    tile's float8 values times its rows' block scales, rounded to the activations' dtype, then the same GEMMs."""
    _run("moe_fp8")


def test_w8a16_gate_up_in_float16_dots_under_the_interpreter() -> None:
    _run("moe_fp8_f16")


def test_the_fused_moe_reads_both_fp8_row_layouts_alike_under_the_interpreter() -> None:
    _run("fp8_layouts")


def test_fused_experts_w8a8_on_fp8_rows_under_the_interpreter() -> None:
    """--quantization fp8 --fp8-activations's GPU path (W8A8): the activations quantized per token and 128-column
    group, float8 dots scaled by both sides' scales."""
    _run("moe_w8a8")


def test_mxfp4_tile_decode_equals_unpack_rows_under_the_interpreter() -> None:
    """--quantization mxfp4's weights as the fused MoE's dots take them (`mx4_dot`, through an identity): `unpack_rows`'
    values, bit for bit."""
    _run("mxfp4_tile")


def test_fused_experts_on_mxfp4_rows_under_the_interpreter() -> None:
    """--quantization mxfp4's GPU path (W4A16, written, not yet run on a GPU): the experts' MXFP4 rows decoded a tile
    at a time to the activations' bf16, then the same GEMMs; GPT-OSS's biases and clamped activation, EP's slice."""
    from moebius.kernels import fused_moe as fm

    pairs = [4 * c[0][0] for c in MXFP4_CASES]
    assert min(pairs) <= fm.DIRECT_MAX_PAIRS < max(pairs) and max(pairs) > 1024  # direct, one-program and chunked
    assert any(D % fm.MXFP4_BK and I % fm.MXFP4_BK for _, (D, I), _ in MXFP4_CASES)  # ragged last K steps
    _run("moe_mxfp4")


def test_fused_experts_with_biases_and_the_clamped_activation_under_the_interpreter() -> None:
    _run("moe_biased")


def test_paged_attention_with_windows_and_sinks_under_the_interpreter() -> None:
    _run("attention_window")


def test_paged_attention_under_the_interpreter() -> None:
    _run("attention")


def test_only_a_long_fresh_chunk_alone_takes_cudnn() -> None:
    """The step shapes kernels.attention.fresh_chunk sends to cuDNN: one sequence, no cached prefix, a length the
    runtime allows (KernelConfig.fresh_chunk_lengths; which those are: tests/test_warmup.py)."""
    from moebius.kernels import FRESH_CHUNK_MIN_TOKENS as N
    from moebius.kernels.attention import fresh_chunk

    allowed = frozenset({N, 2 * N, 8192})
    one, two = torch.zeros(1, 8, dtype=torch.int32), torch.zeros(2, 8, dtype=torch.int32)
    assert fresh_chunk(one, N, N, allowed) and fresh_chunk(one, 8192, 8192, allowed)
    assert not fresh_chunk(one, 3000, 3000, allowed)  # a length the warm-up did not meet: cuDNN would build a graph
    assert not fresh_chunk(one, N, N + 16, allowed)  # after a prefix (a later chunk, or a cached prefix)
    assert not fresh_chunk(two, N, N, allowed)  # several sequences (or a padded batch)
    assert not fresh_chunk(one, 1, 0, allowed)  # a decode
    assert not fresh_chunk(one, N, N, frozenset())  # the default KernelConfig: never


def norm_cases() -> None:
    from moebius.kernels.fused import add_rmsnorm
    from moebius.kernels.pairs import PairRows
    from moebius.layers.norm import rms_norm

    g = torch.Generator().manual_seed(0)
    for T, D, first, local in [(3, 48, 0, 16), (9, 100, 4, 8)]:  # D under a power of two; a slice of the experts
        x, res, w = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g), torch.rand(D, generator=g) + 0.5
        got_res = res.clone()
        assert torch.allclose(add_rmsnorm(x, got_res, w, 1e-6), rms_norm(res + x, w, 1e-6), atol=1e-5)
        assert torch.allclose(got_res, res + x) and torch.allclose(add_rmsnorm(x, None, w, 1e-6), rms_norm(x, w, 1e-6),
                                                                   atol=1e-5)
        ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(T)])
        mine = (ids >= first) & (ids < first + local)
        y = torch.randn(T * 4, D, generator=g)
        want_sum = (y.view(T, 4, D) * mine[..., None]).sum(1)
        y[~mine.flatten()] = float("nan")  # another rank's pairs: never written
        got_res = res.clone()
        got = PairRows(y, ids, first, local).add_rms_norm(got_res, w, 1e-6)
        assert torch.allclose(got_res, res + want_sum, atol=1e-5), (T, D)
        assert torch.allclose(got, rms_norm(res + want_sum, w, 1e-6), atol=1e-5), (T, D)
        shared = torch.randn(T, D, generator=g)  # the shared experts' output, added inside the sum's launch
        with_shared = PairRows(y, ids, first, local).plus(shared)
        assert torch.allclose(with_shared.sum(), want_sum + shared, atol=1e-5), (T, D)
        # ... or inside the next norm's, as the combine of one rank takes them (`summed_add_rms_norm`): the bits of
        # the sum's launch, then the add + norm's
        from moebius.layers.moe import summed_add_rms_norm

        got_res, want_res = res.clone(), res.clone()
        got, _ = summed_add_rms_norm(with_shared, got_res, w, 1e-6)
        want = add_rmsnorm(with_shared.sum(), want_res, w, 1e-6)
        assert torch.equal(got, want) and torch.equal(got_res, want_res), (T, D)


def test_add_rmsnorm_and_pairs_summed_inside_it_under_the_interpreter() -> None:
    _run("norm")


def swiglu_cases() -> None:
    import torch.nn.functional as F

    from moebius.kernels.fused import swiglu

    g = torch.Generator().manual_seed(0)
    for T, I in [(1, 8), (5, 1408), (3, 1500)]:  # one block a row; several, the last partial
        h = torch.randn(T, 2 * I, generator=g) * 4
        assert torch.allclose(swiglu(h), F.silu(h[:, :I]) * h[:, I:], atol=1e-5), (T, I)
        wide = torch.randn(T, 2 * I + 6, generator=g)[:, : 2 * I]  # rows strided in a wider buffer
        assert torch.allclose(swiglu(wide), F.silu(wide[:, :I]) * wide[:, I:], atol=1e-5), (T, I)


def test_swiglu_under_the_interpreter() -> None:
    """The dense MLPs' and shared experts' activation in one launch (kernels/fused.py `swiglu`)."""
    _run("swiglu")


def reshard_cases() -> None:
    from moebius.kernels.copy import copy_rows
    from moebius.parallel.layout import expert_block, expert_shard

    g = torch.Generator().manual_seed(0)
    # rows of many columns (gate/up shards: several column tiles) and of few (down shards: masked tiles), P = 2 and 4
    for El, I, D, P in [(3, 48, 40, 2), (2, 64, 24, 4), (5, 8, 1100, 2)]:
        w13 = torch.randn(El, 2 * I, D, generator=g)
        w2 = torch.randn(El, D, I, generator=g)
        for q in range(P):
            for s in expert_shard(w13, w2, P, q):
                d = torch.full_like(s, float("nan"))
                copy_rows(d, s)
                assert torch.equal(d, s)
        # the switch's two directions through the kernel equal the torch permutes (the reference) and round-trip
        pack_ref = (w13.view(El, 2, P, I // P, D).permute(2, 0, 1, 3, 4).reshape(P * El, 2 * I // P, D),
                    w2.view(El, D, P, I // P).permute(2, 0, 1, 3).reshape(P * El, D, I // P))
        out = (torch.full((P * El, 2 * I // P, D), float("nan")), torch.full((P * El, D, I // P), float("nan")))
        for q in range(P):
            for d, s in zip(expert_block(*out, P, q), expert_shard(w13, w2, P, q), strict=True):
                copy_rows(d, s)
        assert torch.equal(out[0], pack_ref[0]) and torch.equal(out[1], pack_ref[1])
        back13, back2 = torch.full_like(w13, float("nan")), torch.full_like(w2, float("nan"))
        for q in range(P):
            for d, s in zip(expert_shard(back13, back2, P, q), expert_block(*out, P, q), strict=True):
                copy_rows(d, s)
        assert torch.equal(back13, w13) and torch.equal(back2, w2)
    try:
        copy_rows(torch.empty(4, 3), torch.empty(3, 4))
    except ValueError as e:
        assert "one shape" in str(e)
    else:
        raise AssertionError("mismatched shapes were copied")


def test_switch_reshard_copies_under_the_interpreter() -> None:
    _run("reshard")


def mla_rope_cases() -> None:
    from attention_cases import paged_metadata

    from moebius.kernels.mla import rope_latent
    from moebius.models.deepseek.mla import (
        LATENT_NORM_EPS,
        MLAConfig,
        MLAWeights,
        project,
        projections,
        rope_table,
        write_latent,
    )

    g = torch.Generator().manual_seed(0)
    bs, pages, D = 4, 16, 32
    # (heads, nope N, latent C, rope R): one head block; two, the second partial, C under a power of two
    for H, N, C, R in [(4, 8, 16, 16), (20, 12, 24, 8)]:
        for interleave in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                meta = paged_metadata([1, 3, 1], [5, 9, 2], bs, pages, "cpu", seed=H)
                T = int(meta.positions.shape[0])
                cfg = MLAConfig.from_hf(dict(hidden_size=D, kv_lora_rank=C, qk_rope_head_dim=R, qk_nope_head_dim=N,
                                             v_head_dim=N, q_lora_rank=None, num_attention_heads=H,
                                             rope_interleave=interleave))
                w = MLAWeights(None, None, None, torch.randn(H * (N + R), D, generator=g).to(dtype),
                               torch.randn(C + R, D, generator=g).to(dtype), None,
                               (torch.rand(C, generator=g) + 0.5).to(dtype), torch.zeros(0), torch.zeros(0), None)
                x = torch.randn(T, D, generator=g).to(dtype)
                table = rope_table(cfg, 64)
                want_cache = torch.randn(pages, bs, C + R, generator=g).to(dtype)
                got_cache = want_cache.clone()
                _, want_rope, entry = project(x, w, cfg, meta.positions, table)
                write_latent(want_cache, entry, meta)
                q, kv = projections(x, w)
                got_rope = rope_latent(q, kv, w.kv_a_norm, table, meta.positions, meta.slot_mapping, got_cache, H, N,
                                       LATENT_NORM_EPS, interleave)
                # float32 as torch (the rope bit for bit); bfloat16 within a few of its roundings at the values'
                # scale (the interpreter rounds float32 to bfloat16 toward zero, the GPU and torch to nearest: after
                # each op, and a difference of two near products keeps their error)
                for what, a, b in (("q rope", got_rope, want_rope), ("cache", got_cache, want_cache)):
                    atol = 2 ** -5 * b.float().abs().max().item() if dtype == torch.bfloat16 else 1e-5
                    assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=atol), (H, interleave, dtype, what)


def mla_cases() -> None:
    from attention_cases import paged_metadata

    import moebius.kernels.mla as M
    from moebius.kernels.mla import latent_decode_attention
    from moebius.layers.attention import select_sequences
    from moebius.models.deepseek.mla import absorbed, absorbed_kernel

    g = torch.Generator().manual_seed(0)
    bs, pages, N, V = 4, 64, 8, 12
    ctx = [1, 4, 5, 17, 38]  # one key, a whole page, one past it, several pages (38: an empty fourth split of 4)
    tol = dict(rtol=1e-4, atol=1e-4)
    # (heads, latent C, rope R): one head block; two, the second partial, with C and R under powers of two; each
    # with every tile masked and with whole tiles unmasked (`DECODE_WHOLE_TILES`)
    own_whole = M.DECODE_WHOLE_TILES
    for (H, C, R), whole in itertools.product([(4, 16, 16), (20, 24, 8)], (False, True)):
        M.DECODE_WHOLE_TILES = whole
        meta = paged_metadata([1] * len(ctx), ctx, bs, pages, "cpu", seed=H)
        cache = torch.randn(pages, bs, C + R, generator=g)
        for b, n in enumerate(ctx):  # a last page's unwritten rest holds NaN: never read
            cache[meta.block_tables[b, (n - 1) // bs], (n - 1) % bs + 1:] = float("nan")
        q_nope, q_rope = torch.randn(len(ctx), H, N, generator=g), torch.randn(len(ctx), H, R, generator=g)
        kv_b = torch.randn(H * (N + V), C, generator=g) * C ** -0.5
        scale = 1.3 * (N + R) ** -0.5
        want = absorbed(q_nope, q_rope, cache, kv_b, meta, scale)
        for splits in (1, 3, 4):
            meta.num_splits = splits
            got = absorbed_kernel(q_nope, q_rope, cache, kv_b, meta, scale)
            assert torch.allclose(got, want, **tol), (H, C, R, splits, whole, (got - want).abs().max())
            for h0, h1 in [(0, H // 2), (H // 2, H)]:  # TP shards: a leading slice of heads, kv_b's rows of them
                got = absorbed_kernel(q_nope[:, h0:h1], q_rope[:, h0:h1], cache, kv_b[h0 * (N + V): h1 * (N + V)],
                                      meta, scale)
                assert torch.allclose(got, want[:, h0:h1], **tol), (H, splits, h0, h1)
        # the kernel's own output, the weighted latent sums: the reference with W_UV = identity (V = C) returns them
        wk = torch.randn(H, N, C, generator=g) * C ** -0.5
        kv_id = torch.cat([wk, torch.eye(C).expand(H, C, C)], dim=1).flatten(0, 1)
        want = absorbed(q_nope, q_rope, cache, kv_id, meta, scale)
        for splits in (1, 4):
            got = latent_decode_attention(torch.einsum("thn,hnc->thc", q_nope, wk), q_rope, cache,
                                          meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, splits)
            assert torch.allclose(got, want, **tol), (H, C, R, splits, whole, "latent sums")
    M.DECODE_WHOLE_TILES = own_whole
    # a rank's heads past WIDE_HEAD_BLOCK (DeepSeek-V3's 128 in EP): wide head blocks, the second partial (bf16's
    # launch: the interpreter's bf16 dots are not exact, so float32 through the same head block)
    H, C, R = M.WIDE_HEAD_BLOCK + 8, 16, 16
    bf16, f32 = torch.empty(0, dtype=torch.bfloat16), torch.empty(0)
    assert [M.decode_head_block(h, c) for h, c in ((H, bf16), (M.WIDE_HEAD_BLOCK - 1, bf16), (H, f32))] == [
        M.WIDE_HEAD_BLOCK, M.HEAD_BLOCK, M.HEAD_BLOCK]
    meta = paged_metadata([1] * len(ctx), ctx, bs, pages, "cpu", seed=H)
    cache = torch.randn(pages, bs, C + R, generator=g)
    q_lat, q_rope = (torch.randn(len(ctx), H, n, generator=g) for n in (C, R))
    kv_id = torch.eye(C).repeat(2, 1).expand(H, 2 * C, C).flatten(0, 1)  # W_UK, W_UV identities: the latent sums
    want = absorbed(q_lat, q_rope, cache, kv_id, meta, 0.2)
    own = M.decode_head_block
    M.decode_head_block = lambda heads, cache: M.WIDE_HEAD_BLOCK
    try:
        for splits in (1, 3):
            got = latent_decode_attention(q_lat, q_rope, cache, meta.block_tables, meta.seq_lens,
                                          meta.query_start_loc, 0.2, splits)
            assert torch.allclose(got, want, **tol), (splits, (got - want).abs().max())
    finally:
        M.decode_head_block = own
    # a mixed step's decodes, as latent_attention hands them to the kernel on CUDA (their own metadata)
    H, C, R = 4, 16, 16
    q_lens, ctx = [1, 6, 1, 1], [9, 6, 30, 2]
    meta = paged_metadata(q_lens, ctx, bs, pages, "cpu", seed=7)
    cache = torch.randn(pages, bs, C + R, generator=g)
    q_nope, q_rope = torch.randn(sum(q_lens), H, N, generator=g), torch.randn(sum(q_lens), H, R, generator=g)
    kv_b = torch.randn(H * (N + V), C, generator=g) * C ** -0.5
    sub, rows = select_sequences(meta, (meta.query_start_loc[1:] - meta.query_start_loc[:-1]) == 1)
    want = absorbed(q_nope, q_rope, cache, kv_b, meta, 0.3)[rows]
    got = absorbed_kernel(q_nope[rows], q_rope[rows], cache, kv_b, sub, 0.3)
    assert torch.allclose(got, want, **tol), "mixed step's decodes"


def test_mla_rope_and_latent_write_under_the_interpreter() -> None:
    """kernels/mla.py's `rope_latent` (the rope queries, the latent's norm and the cache entry in one launch) against
    models/deepseek/mla.py's torch `project` + `write_latent`: interleaved and halved rope dims, a partial head block,
    float32 and bfloat16."""
    _run("mla_rope")


def test_latent_decode_attention_under_the_interpreter() -> None:
    """kernels/mla.py (DeepSeek's MLA decode, absorbed form, over a paged latent cache) against
    models/deepseek/mla.py's torch `absorbed`: with and without KV splits, TP shards of heads, a mixed step's
    decodes, and its raw weighted latent sums."""
    _run("mla")


def mla_chunk_cases() -> None:
    from attention_cases import paged_metadata

    from moebius.kernels.mla import latent_chunk_attention
    from moebius.layers.attention import select_sequences
    from moebius.models.deepseek.mla import absorbed, absorbed_kernel, expanded

    g = torch.Generator().manual_seed(1)
    bs, pages, N, V = 4, 96, 8, 12
    tol = dict(rtol=1e-4, atol=1e-4)
    # (new tokens, keys after the step) a sequence: chunks from position 0 (5 over two pages, 9 over three query
    # blocks of 4), chunks after cached tokens (6 from position 11, 11 from 19, both crossing pages), decodes beside
    # them (one with a single key), and a one-token prompt
    q_lens, ctx = [5, 1, 9, 6, 1, 11, 1], [5, 9, 9, 17, 2, 30, 1]
    for H, C, R in [(4, 16, 16), (20, 24, 8)]:  # one head block; two, the second partial, C and R not powers of 2
        meta = paged_metadata(q_lens, ctx, bs, pages, "cpu", seed=H)  # random (shuffled) distinct pages
        cache = torch.randn(pages, bs, C + R, generator=g)
        for b, n in enumerate(ctx):  # a last page's unwritten rest holds NaN: never read
            cache[meta.block_tables[b, (n - 1) // bs], (n - 1) % bs + 1:] = float("nan")
        T = sum(q_lens)
        q_nope, q_rope = torch.randn(T, H, N, generator=g), torch.randn(T, H, R, generator=g)
        kv_b = torch.randn(H * (N + V), C, generator=g) * C ** -0.5
        scale = 1.3 * (N + R) ** -0.5
        want = expanded(q_nope, q_rope, cache, kv_b, meta, scale)
        assert torch.allclose(absorbed(q_nope, q_rope, cache, kv_b, meta, scale), want, **tol)
        # the whole mixed step in the chunk launch (its decodes as one-token chunks)
        got = absorbed_kernel(q_nope, q_rope, cache, kv_b, meta, scale)
        assert torch.isfinite(got).all() and torch.allclose(got, want, **tol), (H, C, R, (got - want).abs().max())
        # as latent_attention splits it on CUDA: the decodes in the decode launch (with splits), the chunks apart
        decode_B = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]) == 1
        parts = torch.empty_like(want)
        for sel, splits in ((decode_B, 3), (~decode_B, 1)):
            sub, rows = select_sequences(meta, sel)
            sub.num_splits = splits
            parts[rows] = absorbed_kernel(q_nope[rows], q_rope[rows], cache, kv_b, sub, scale)
            if splits == 1:
                assert sub.max_query_len == 11 and torch.allclose(
                    parts[rows], expanded(q_nope[rows], q_rope[rows], cache, kv_b, sub, scale), **tol), "chunks only"
        assert torch.allclose(parts, want, **tol), (H, "decodes apart")
        for h0, h1 in [(0, H // 2), (H // 2, H)]:  # TP shards: a leading slice of heads, kv_b's rows of them
            got = absorbed_kernel(q_nope[:, h0:h1], q_rope[:, h0:h1], cache, kv_b[h0 * (N + V): h1 * (N + V)], meta,
                                  scale)
            assert torch.allclose(got, want[:, h0:h1], **tol), (H, h0, h1)
        # the kernel's own output, the weighted latent sums: the reference with W_UV = identity (V = C) returns them
        wk = torch.randn(H, N, C, generator=g) * C ** -0.5
        kv_id = torch.cat([wk, torch.eye(C).expand(H, C, C)], dim=1).flatten(0, 1)
        want = absorbed(q_nope, q_rope, cache, kv_id, meta, scale)
        got = latent_chunk_attention(torch.einsum("thn,hnc->thc", q_nope, wk), q_rope, cache, meta.block_tables,
                                     meta.seq_lens, meta.query_start_loc, meta.max_query_len, scale)
        assert torch.allclose(got, want, **tol), (H, C, R, "latent sums")


def test_latent_chunk_attention_under_the_interpreter() -> None:
    """kernels/mla.py's causal prompt-chunk launch (DeepSeek's MLA, absorbed form, over a paged latent cache with
    shuffled pages and NaN past each sequence's end) against models/deepseek/mla.py's torch `expanded` and
    `absorbed`: chunks from position 0 and after cached tokens, crossing pages and query blocks, beside decodes in
    one mixed step (in the chunk launch, and apart as latent_attention runs them on CUDA), TP shards of heads, and
    its raw weighted latent sums."""
    _run("mla_chunk")


def _run(case: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, os.path.abspath(__file__), case], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


if __name__ == "__main__":
    cases = {"moe": moe_cases, "moe_fp8": moe_fp8_cases, "moe_fp8_f16": moe_fp8_f16_cases,
             "fp8_layouts": fp8_layouts_cases, "moe_w8a8": moe_w8a8_cases,
             "moe_biased": moe_biased_cases,
             "mxfp4_tile": mxfp4_tile_cases, "moe_mxfp4": moe_mxfp4_cases,
             "attention": attention_cases,
             "attention_window": attention_window_cases, "argmax": argmax_cases, "align": align_cases,
             "qk": qk_cases, "router": router_cases, "grouped_route": grouped_route_cases,
             "qk_attention": qk_attention_cases, "linear": linear_cases,
             "linear_fp8": linear_fp8_cases,
             "reshard": reshard_cases, "norm": norm_cases, "swiglu": swiglu_cases, "mla": mla_cases,
             "mla_rope": mla_rope_cases,
             "mla_chunk": mla_chunk_cases}
    cases[sys.argv[1]]()
