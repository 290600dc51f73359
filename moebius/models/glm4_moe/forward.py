"""GLM-4.5 / 4.6 forward (transformers' Glm4MoeForCausalLM semantics), reading weight views handed to it, over the
`Communicator`: the same math in every layout (head counts and the shared experts' shard from the weight shapes).

Attention is the shared GQA's (models/gqa.py) with q|k|v bias, optional per-head q/k norms and partial rotary: the
rope table is `rotary_dim` wide, so `layers/rotary.apply_rope` rotates each head's first `rotary_dim` dims, by
halves within them (rotate-half, as transformers' Glm4Moe apply_rotary_pos_emb), and passes the rest through. The
MoE block is DeepSeek-V3's (models/grouped_moe.py).
Shapes: T tokens, D hidden, K top-k.
"""

from __future__ import annotations

import torch

from moebius.config import ModelConfig
from moebius.kernels import KernelConfig
from moebius.layers.attention import AttentionMetadata
from moebius.layers.rotary import rope_table
from moebius.models.decoder import decoder, num_moe_layers  # noqa: F401  (the family's)
from moebius.models.glm4_moe.weights import glm_extra
from moebius.models.gqa import attend, attention, attention_geometry  # noqa: F401  (the family's)
from moebius.models.grouped_moe import moe
from moebius.models.weights import DenseWeights, ModelWeights, MoEWeights, logits  # noqa: F401  (the family's)
from moebius.parallel.dispatch import Communicator


def family_rope_table(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """The region "rope": [max_position_embeddings, rotary_dim] float32, plain RoPE over the rotated dims (its
    frequencies theta^(-2j / rotary_dim), as transformers' default rope with partial_rotary_factor)."""
    return rope_table(glm_extra(cfg).rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, device)


def forward(input_ids_T: torch.Tensor, meta: AttentionMetadata, weights: ModelWeights, kv: list[torch.Tensor],
            cfg: ModelConfig, comm: Communicator, kc: KernelConfig, routed_TLK: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Final-normed hidden states [T, D] of the new tokens (`decoder`); GLM-4.5's layers: GQA with partial rotary,
    DeepSeek-V3's grouped MoE block with shared experts (or a dense MLP)."""
    moe_cfg = glm_extra(cfg).moe
    return decoder(input_ids_T, weights, kv, cfg, comm, kc, routed_TLK,
                   lambda i, h, w, cache: attention(h, w, cache, meta, cfg, weights.rope, kc),
                   lambda h, w, record: moe(h, w, moe_cfg, comm, kc, record))

