"""Linear projections: F.linear, or on the GPU for a few rows kernels that start while the kernel before them is still
running (moebius/kernels/linear.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moebius.kernels import DEFAULT_KERNELS, KernelConfig, triton_available
from moebius.kernels.fp8_rows import unpack_rows


def linear(x_TD: torch.Tensor, w_ND: torch.Tensor, bias_N: torch.Tensor | None = None, *,
           kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    if w_ND.dtype == torch.uint8:  # FP8 rows (--quantization fp8): read as stored by the kernel (W8A8 or W8A16)
        if x_TD.is_cuda and triton_available() and x_TD.dtype in (torch.bfloat16, torch.float16):
            from moebius.kernels import linear as kl

            x = x_TD.reshape(-1, x_TD.shape[-1]).contiguous()
            run = kl.linear_fp8_rows if kl.fits_fp8_rows(x, w_ND, kc) else kl.linear_fp8
            return run(x, w_ND, bias_N, kc=kc).unflatten(0, x_TD.shape[:-1])
        return F.linear(x_TD, unpack_rows(w_ND, x_TD.shape[-1], x_TD.dtype), bias_N)  # the CPU's reference
    if x_TD.is_cuda and triton_available():
        from moebius.kernels import linear as kl

        if kl.fits(x_TD, w_ND, kc):
            return kl.linear(x_TD, w_ND, bias_N, kc=kc)
        if kl.fits_mma(x_TD, w_ND):
            return kl.linear_mma(x_TD, w_ND, bias_N, kc=kc)
    return F.linear(x_TD, w_ND, bias_N)
