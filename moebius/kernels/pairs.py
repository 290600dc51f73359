"""Expert outputs per (token, k) pair, before the sum over k: what the fused GPU experts (kernels/fused_moe.py) hand
to the sublayer-end exchange, which sums them as it reads them (kernels/symmetric.py) or has them summed first
(`PairRows.sum`). No Triton here: the layers and communicators that pass these along import it on any machine."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moebius.kernels import DEFAULT_KERNELS, KernelConfig


@dataclass(frozen=True)
class PairRows:
    """Row t * K + k holds pair (t, k)'s weighted output when its expert is one of the `num_local` from
    `first_expert`; other rows are never written. add_TD: a per-token output of the same tokens added after the
    sum (the shared experts'), in the launch that sums."""

    y_ND: torch.Tensor  # [T * K, D]
    ids_TK: torch.Tensor
    first_expert: int
    num_local: int
    add_TD: torch.Tensor | None = None  # [T, D]

    def plus(self, add_TD: torch.Tensor) -> PairRows:
        """These pairs with add_TD added after their sum (`sum`, `add_rms_norm`)."""
        if self.add_TD is not None:
            raise ValueError("these pairs already carry a per-token output to add")
        return replace(self, add_TD=add_TD)

    def sum(self, *, kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
        """[T, D]: each token's sum over its local pairs (float32 in k order, rounded once), plus add_TD where it
        is carried (in the same launch: the bits of the sum, then `+ add_TD`)."""
        from moebius.kernels.fused import sum_k

        return sum_k(self.y_ND, self.ids_TK, self.first_expert, self.num_local, self.add_TD, kc=kc)

    def add_rms_norm(self, residual_TD: torch.Tensor, weight: torch.Tensor, eps: float, *,
                     kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
        """rms_norm(residual + `sum`), residual updated in place: the sum and the fused add + norm in one launch, the
        same bits."""
        from moebius.kernels.fused import sum_k_add_rmsnorm

        return sum_k_add_rmsnorm(self.y_ND, self.ids_TK, self.first_expert, self.num_local, residual_TD, weight, eps,
                                 self.add_TD, kc=kc)
