"""MoE math: top-k softmax router and SwiGLU experts over a routed batch (torch reference path)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moebius.kernels import DEFAULT_KERNELS, KernelConfig, triton_available
from moebius.kernels.moe import experts as fast_experts
from moebius.kernels.moe import experts_dense, grouped_mm_available
from moebius.kernels.pairs import PairRows
from moebius.kernels.rows import format_of
from moebius.layers.linear import linear
from moebius.layers.norm import add_rms_norm


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device, priority=-1)  # (high: its blocks take the SMs the routed experts free)


def beside(fn: Callable[[], torch.Tensor], like: torch.Tensor, kc: KernelConfig) -> Callable[[], torch.Tensor]:
    """fn() (kernels on `like`'s inputs) queued on the GPU's side stream where kc.shared_stream, so that it overlaps
    the kernels the caller queues next; call the result to make the current stream wait for it and take its output
    (inside CUDA graphs the fork and join are captured as edges). Elsewhere fn() runs at once."""
    if not (kc.shared_stream and like.is_cuda):
        out = fn()
        return lambda: out
    main, side = torch.cuda.current_stream(like.device), _side_stream(like.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = fn()

    def join() -> torch.Tensor:
        main.wait_stream(side)
        out.record_stream(main)  # (allocated on the side stream: not reused there before the main stream is done)
        return out

    return join


def plus(y: torch.Tensor | PairRows, add_TD: torch.Tensor | None) -> torch.Tensor | PairRows:
    """Expert outputs plus a per-token output of the same tokens (the shared experts'): pairs carry it to the launch
    that sums them (`PairRows.plus`: the sum's, or the next norm's, `summed_add_rms_norm`), a tensor adds it now."""
    if add_TD is None:
        return y
    return y.plus(add_TD) if isinstance(y, PairRows) else y + add_TD


def summed(y: torch.Tensor | PairRows, add_TD: torch.Tensor | None = None, *, kc: KernelConfig = DEFAULT_KERNELS
           ) -> torch.Tensor:
    """Expert outputs per token: y itself, or its pairs summed over k (`PairRows.sum`); plus add_TD (the shared
    experts' output) where given, inside the sum's launch for pairs."""
    y = plus(y, add_TD)
    return y.sum(kc=kc) if isinstance(y, PairRows) else y


def summed_add_rms_norm(y: torch.Tensor | PairRows, residual_TD: torch.Tensor, weight: torch.Tensor, eps: float, *,
                        kc: KernelConfig = DEFAULT_KERNELS) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm` of the expert outputs per token; pairs are summed inside the norm's launch (`PairRows` only
    comes from the fused GPU kernels)."""
    if isinstance(y, PairRows):
        return y.add_rms_norm(residual_TD, weight, eps, kc=kc), residual_TD
    return add_rms_norm(y, residual_TD, weight, eps, kc=kc)


def route(x_TD: torch.Tensor, gate_ED: torch.Tensor, top_k: int, norm_topk_prob: bool, *,
          kc: KernelConfig = DEFAULT_KERNELS) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, K] (in x's dtype) and expert ids [T, K], as transformers' Qwen3MoeTopKRouter."""
    if x_TD.is_cuda and triton_available():
        from moebius.kernels import fused

        if fused.router_fits(x_TD, gate_ED):
            return fused.route(x_TD, gate_ED, top_k, norm_topk_prob, kc=kc)
        return fused.topk_softmax(F.linear(x_TD, gate_ED), top_k, norm_topk_prob, x_TD.dtype, kc=kc)
    logits = F.linear(x_TD, gate_ED)
    probs = torch.softmax(logits.float(), dim=-1)
    w_TK, ids_TK = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        w_TK = w_TK / w_TK.sum(dim=-1, keepdim=True)
    return w_TK.to(x_TD.dtype), ids_TK


def swiglu(h_TF2: torch.Tensor, *, kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """silu(gate) * up, where the last dim stacks [gate | up] (on the GPU in 16 bits one Triton launch, the same
    roundings: `kernels.fused.swiglu`)."""
    if h_TF2.is_cuda and h_TF2.dim() == 2 and h_TF2.dtype in (torch.bfloat16, torch.float16) and triton_available():
        from moebius.kernels import fused

        return fused.swiglu(h_TF2, kc=kc)
    gate, up = h_TF2.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's experts' activation: gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate); the last dim stacks [gate | up] (a TP shard of each: elementwise).
    The fused MoE kernel computes it too (its `CLAMPED` form)."""

    alpha: float
    limit: float

    def __call__(self, h_TF: torch.Tensor) -> torch.Tensor:
        gate, up = h_TF.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


Activation = Callable[[torch.Tensor], torch.Tensor]  # [gate | up] rows -> the down projection's input


def dense_mlp(x_TD: torch.Tensor, w13_FD: torch.Tensor, w2_DF: torch.Tensor, *, kc: KernelConfig = DEFAULT_KERNELS
              ) -> torch.Tensor:
    return linear(swiglu(linear(x_TD, w13_FD, kc=kc), kc=kc), w2_DF, kc=kc)


def experts(x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor, w13_EFD: torch.Tensor,
            w2_EDF: torch.Tensor, first_expert: int, num_experts: int | None = None, keep_pairs: bool = False, *,
            kc: KernelConfig = DEFAULT_KERNELS, act: Activation = swiglu, b13_EF: torch.Tensor | None = None,
            b2_ED: torch.Tensor | None = None) -> torch.Tensor | PairRows:
    """Grouped GEMMs on the GPU (bf16: kc.moe_backend picks the fused Triton kernel or torch._grouped_mm; quantized
    rows, FP8 or MXFP4 (kernels/rows.py): the fused kernel, which reads them as held); a sync-free dense loop on the GPU
    in other dtypes; the torch reference on the CPU.
    num_experts (the model's, when only some are local) picks the fused kernel's block shapes.
    keep_pairs: the fused kernel's outputs may come back per pair (`PairRows`), unsummed. act / b13_EF / b2_ED:
    `experts_ref`'s (the fused kernel takes `swiglu` and `ClampedSwiGLU`, and the biases)."""
    if x_TD.is_cuda:
        quantized = w13_EFD.dtype == torch.uint8  # FP8 or MXFP4 rows: only the fused kernel's tiles read them
        plain = act is swiglu and b13_EF is None and b2_ED is None  # (torch._grouped_mm's path takes neither)
        if quantized and not (x_TD.dtype == torch.bfloat16 and triton_available()):
            raise NotImplementedError("quantized experts (FP8 or MXFP4 rows) on a GPU run in the fused Triton kernel, "
                                      "on bfloat16 activations")
        if (x_TD.dtype == torch.bfloat16 and (kc.moe_backend == "triton" or quantized or not plain)
                and triton_available()):
            from moebius.kernels.fused_moe import fused_experts

            if not (act is swiglu or isinstance(act, ClampedSwiGLU)):
                raise NotImplementedError(f"the fused MoE kernel has no activation {act!r}")
            clamp = (act.alpha, act.limit) if isinstance(act, ClampedSwiGLU) else None
            return fused_experts(x_TD, w_TK, ids_TK, w13_EFD, w2_EDF, first_expert, num_experts,
                                 keep_pairs=keep_pairs, kc=kc, b13_EF=b13_EF, b2_ED=b2_ED, clamp=clamp)
        if x_TD.dtype == torch.bfloat16 and grouped_mm_available() and plain:
            return fast_experts(x_TD, w_TK, ids_TK, w13_EFD, w2_EDF, first_expert)
        return experts_dense(x_TD, w_TK, ids_TK, w13_EFD, w2_EDF, first_expert, act=act, b13_EF=b13_EF,
                             b2_ED=b2_ED)
    return experts_ref(x_TD, w_TK, ids_TK, w13_EFD, w2_EDF, first_expert, act=act, b13_EF=b13_EF, b2_ED=b2_ED)


def experts_ref(x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor, w13_EFD: torch.Tensor,
                w2_EDF: torch.Tensor, first_expert: int, *, act: Activation = swiglu,
                b13_EF: torch.Tensor | None = None, b2_ED: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k w_tk * expert_{id_tk}(x_t) over the (token, k) pairs whose expert is local.

    Local experts are ids first_expert .. first_expert + E_local - 1; other pairs contribute nothing (they are
    computed on the rank that owns the expert). Pairs are sorted by expert so each expert runs one matmul. An expert
    is down(act(gate_up(x) + b13)) + b2: act of its [gate | up] rows (SwiGLU unless given), biases where given.
    Quantized rows (uint8 weights, kernels/rows.py: FP8 or MXFP4) are dequantized an expert at a time, then the same
    math.
    """
    E = w13_EFD.shape[0]
    y_TD = torch.zeros_like(x_TD)
    local_TK = ids_TK - first_expert
    flat = local_TK.flatten()
    valid = (flat >= 0) & (flat < E)
    pair = torch.nonzero(valid).flatten()
    if pair.numel() == 0:
        return y_TD
    order = pair[torch.argsort(flat[pair], stable=True)]
    counts = torch.bincount(flat[order], minlength=E).tolist()
    tok = order // ids_TK.shape[1]
    weight = w_TK.flatten()[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = slice(start, start + n)
        b13 = None if b13_EF is None else b13_EF[e]
        b2 = None if b2_ED is None else b2_ED[e]
        w13, w2 = w13_EFD[e], w2_EDF[e]
        if w13.dtype == torch.uint8:  # quantized rows: gate|up rows of D columns, down rows of I_local columns
            D, Il = x_TD.shape[1], w13.shape[0] // 2
            w13, w2 = format_of(w13, D).unpack(w13, D, x_TD.dtype), format_of(w2, Il).unpack(w2, Il, x_TD.dtype)
        h = linear(act(linear(x_TD[tok[sel]], w13, b13)), w2, b2)
        y_TD.index_add_(0, tok[sel], h * weight[sel, None])
        start += n
    return y_TD
