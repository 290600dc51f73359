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
import torch.nn.functional as F

from moebius.config import ModelConfig
from moebius.kernels import KernelConfig
from moebius.layers.attention import AttentionMetadata
from moebius.layers.moe import dense_mlp
from moebius.layers.norm import add_rms_norm
from moebius.layers.rotary import rope_table
from moebius.models.glm4_moe.weights import glm_extra
from moebius.models.gqa import attend, attention, attention_geometry  # noqa: F401  (the family's)
from moebius.models.grouped_moe import GroupedMoEWeights, moe
from moebius.models.weights import DenseWeights, ModelWeights, MoEWeights, logits  # noqa: F401  (the family's)
from moebius.parallel.dispatch import Communicator


def family_rope_table(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """The region "rope": [max_position_embeddings, rotary_dim] float32, plain RoPE over the rotated dims (its
    frequencies theta^(-2j / rotary_dim), as transformers' default rope with partial_rotary_factor)."""
    return rope_table(glm_extra(cfg).rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, device)


def forward(input_ids_T: torch.Tensor, meta: AttentionMetadata, weights: ModelWeights, kv: list[torch.Tensor],
            cfg: ModelConfig, comm: Communicator, kc: KernelConfig, routed_TLK: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Final-normed hidden states [T, D] of the new tokens; their K/V are written into `kv` (one cache per layer).
    Each sublayer's output is summed over ranks (attention: `reduce_add_norm`; experts: `combine_add_norm`), added
    to the residual and normed for the next sublayer. routed_TLK: a [>= T, MoE layers, K] integer buffer the
    router's expert ids of every MoE layer are written into."""
    moe_cfg, eps = glm_extra(cfg).moe, cfg.rms_norm_eps
    residual = F.embedding(input_ids_T, weights.embed_VD)
    h, residual = add_rms_norm(residual, None, weights.layers[0].input_norm, eps, kc=kc)
    norms = [layer.input_norm for layer in weights.layers[1:]] + [weights.norm]
    j = 0  # the MoE layer's index among the MoE layers (dense layers route nothing)
    for layer, cache, next_norm in zip(weights.layers, kv, norms, strict=True):
        a = attention(h, layer.attn, cache, meta, cfg, weights.rope, kc)
        h, residual = comm.reduce_add_norm(a, residual, layer.post_norm, eps, kc=kc)
        if isinstance(layer.mlp, GroupedMoEWeights):
            record = None
            if routed_TLK is not None:
                record, j = routed_TLK[:, j], j + 1
            y, handle = moe(h, layer.mlp, moe_cfg, comm, kc, record)
        else:
            assert isinstance(layer.mlp, DenseWeights)
            y, handle = dense_mlp(h, layer.mlp.w13_FD, layer.mlp.w2_DF, kc=kc), None  # no dispatch: nothing to combine
        h, residual = comm.combine_add_norm(y, handle, residual, next_norm, eps, kc=kc)
    return h


def num_moe_layers(weights: ModelWeights) -> int:
    """Layers with routed experts (the second dim of `forward`'s routed_TLK)."""
    return sum(isinstance(layer.mlp, MoEWeights) for layer in weights.layers)
