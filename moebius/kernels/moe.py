"""MoE expert compute on the GPU: (token, k) pairs sorted by expert, two grouped GEMMs (torch._grouped_mm),
weighted scatter back. No host sync (group offsets stay on the device), so it runs inside CUDA graphs. It serves
bf16 where `KernelConfig.moe_backend` is "grouped_mm" (else kernels/fused_moe.py does).
The torch reference is `moebius.layers.moe.experts`."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def experts(x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor, w13_EFD: torch.Tensor,
            w2_EDF: torch.Tensor, first_expert: int) -> torch.Tensor:
    E = w13_EFD.shape[0]
    T, K = ids_TK.shape
    local = ids_TK.flatten() - first_expert
    valid = (local >= 0) & (local < E)
    key = torch.where(valid, local, E)  # pairs of other ranks' experts sort last and are not computed
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int32, device=x_TD.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offs = torch.cumsum(counts[:E], 0, dtype=torch.int32)
    tok = order // K
    h = torch._grouped_mm(x_TD[tok], w13_EFD.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2_EDF.transpose(1, 2), offs=offs)
    keep = valid[order]
    # rows past the last group are not written by the GEMM: select, never multiply, so garbage cannot leak
    y = torch.where(keep[:, None], y * w_TK.flatten()[order][:, None].to(y.dtype), 0)
    return torch.zeros_like(x_TD).index_add_(0, tok, y)


def experts_dense(x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor, w13_EFD: torch.Tensor,
                  w2_EDF: torch.Tensor, first_expert: int, *,
                  act: Callable[[torch.Tensor], torch.Tensor] | None = None, b13_EF: torch.Tensor | None = None,
                  b2_ED: torch.Tensor | None = None) -> torch.Tensor:
    """Any dtype, no host sync (so CUDA graphs can capture it): every local expert runs on every token and the
    routing weight (0 for tokens not routed to it) scales the result. E times the work of the grouped path: for
    small float32 models (tests), where torch._grouped_mm (bf16 only) does not apply. act (silu(gate) * up unless
    given) and the biases as `layers.moe.experts_ref` takes them."""
    y = torch.zeros_like(x_TD)
    for e in range(w13_EFD.shape[0]):
        gate = (w_TK * (ids_TK == first_expert + e)).sum(-1, keepdim=True)
        h = F.linear(x_TD, w13_EFD[e], None if b13_EF is None else b13_EF[e])
        if act is None:
            g, u = h.chunk(2, dim=-1)
            h = F.silu(g) * u
        else:
            h = act(h)
        y += F.linear(h, w2_EDF[e], None if b2_ED is None else b2_ED[e]) * gate
    return y
