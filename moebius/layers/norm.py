"""RMSNorm, computed in float32 like transformers' Qwen3MoeRMSNorm."""

from __future__ import annotations

import torch

from moebius.kernels import DEFAULT_KERNELS, KernelConfig, triton_available


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise over the last dim; `weight` scales after the cast back (transformers' order of operations)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                 kc: KernelConfig = DEFAULT_KERNELS) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): the residual stream's add and the next norm, fused on the GPU
    (where `residual` is updated in place). Without a residual: (rms_norm(x), x), one launch on the GPU."""
    if x.is_cuda and triton_available():
        from moebius.kernels.fused import add_rmsnorm

        return add_rmsnorm(x, residual, weight, eps, kc=kc), (x if residual is None else residual)
    residual = x if residual is None else residual + x
    return rms_norm(residual, weight, eps), residual
