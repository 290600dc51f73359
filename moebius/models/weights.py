"""The weight views a family's forward reads, in the form the engine also knows: the switch moves each MoE layer's
expert views (`MoEWeights.w13_EFD` / `w2_EDF`), the diagnostics digest them; the attention weights are the
family's own (`LayerWeights.attn`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


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
