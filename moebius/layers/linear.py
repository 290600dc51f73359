"""Linear projections: F.linear, or on the GPU for a few rows kernels that start while the kernel before them is still
running (moebius/kernels/linear.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moebius.kernels import DEFAULT_KERNELS, KernelConfig, triton_available
from moebius.kernels.fp8_rows import unpack_rows


def linear(x_TD: torch.Tensor, w_ND: torch.Tensor, bias_N: torch.Tensor | None = None, *,
           kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    if w_ND.dtype == torch.uint8:  # FP8 rows (--quantization fp8): dequantized, then the float math (on the GPU
        # too for now: no FP8 linear kernel yet, so these read more bytes than bf16 weights would)
        return F.linear(x_TD, unpack_rows(w_ND, x_TD.shape[-1], x_TD.dtype), bias_N)
    if x_TD.is_cuda and triton_available():
        from moebius.kernels import linear as kl

        if kl.fits(x_TD, w_ND, kc):
            return kl.linear(x_TD, w_ND, bias_N, kc=kc)
        if kl.fits_mma(x_TD, w_ND):
            return kl.linear_mma(x_TD, w_ND, bias_N, kc=kc)
    return F.linear(x_TD, w_ND, bias_N)
