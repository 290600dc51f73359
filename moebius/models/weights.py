"""The weight views a family's forward reads, in the form the engine also knows: the switch moves each MoE layer's
expert views (`MoEWeights.w13_EFD` / `w2_EDF`), the diagnostics digest them; the attention weights are the
family's own (`LayerWeights.attn`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class MoEWeights:
    gate_ED: torch.Tensor  # router, [E, D], every expert
    w13_EFD: torch.Tensor  # [E_local, 2 * I_local, D], gate rows then up rows
    w2_EDF: torch.Tensor  # [E_local, D, I_local]
    first_expert: int


@dataclass
class DenseWeights:
    w13_FD: torch.Tensor  # [2 * I_local, D]
    w2_DF: torch.Tensor  # [D, I_local]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: Any  # the family's attention weights (its model module's AttnWeights)
    mlp: MoEWeights | DenseWeights


@dataclass
class ModelWeights:
    embed_VD: torch.Tensor
    lm_head_VD: torch.Tensor  # TP: this rank's vocabulary slice (comm.vocab_argmax / gather_vocab)
    norm: torch.Tensor
    rope: torch.Tensor  # [max_pos, d] cos|sin table
    layers: list[LayerWeights]


def logits(hidden_TD: torch.Tensor, weights: ModelWeights, fp32: bool = False) -> torch.Tensor:
    """[T, V] logits (TP: this rank's vocabulary slice). fp32 (--lm-head-dtype float32): accumulated and returned
    in float32 whatever the model's dtype, from the weights as they are (an fp32 copy would go stale on a weight
    update): on the GPU one matmul with a float32 output, elsewhere through float32 copies."""
    w = weights.lm_head_VD
    if not fp32 or w.dtype == torch.float32:
        return F.linear(hidden_TD, w)
    if hidden_TD.is_cuda:
        try:
            return torch.mm(hidden_TD, w.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # a torch without mm's out_dtype for these dtypes
            pass
    return F.linear(hidden_TD.float(), w.float())
