"""Qwen3-MoE forward (transformers' Qwen3MoeForCausalLM semantics), reading weight views handed to it.

The math is the same in every layout: head counts come from the weight shapes, and cross-rank sums/routing go
through the `Communicator` passed in. Shapes: T tokens, D hidden, H heads, d head dim, E experts, F rows of a
[gate | up] stack, K top-k, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moebius.config import ModelConfig
from moebius.layers.attention import AttentionMetadata, paged_attention, write_kv
from moebius.layers.moe import dense_mlp, experts, route
from moebius.layers.norm import rms_norm
from moebius.layers.rotary import apply_rope
from moebius.parallel.dispatch import Communicator


@dataclass
class AttnWeights:
    qkv_QD: torch.Tensor  # [(H + 2 * kvH) * d, D]: this rank's q heads, then k heads, then v heads
    qkv_bias: torch.Tensor | None
    o_DQ: torch.Tensor  # [D, H * d]
    q_norm: torch.Tensor  # [d]
    k_norm: torch.Tensor  # [d]


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
    attn: AttnWeights
    mlp: MoEWeights | DenseWeights


@dataclass
class ModelWeights:
    embed_VD: torch.Tensor
    lm_head_VD: torch.Tensor
    norm: torch.Tensor
    rope: torch.Tensor  # [max_pos, d] cos|sin table
    layers: list[LayerWeights]


def attention(x_TD: torch.Tensor, w: AttnWeights, cache: torch.Tensor, meta: AttentionMetadata,
              cfg: ModelConfig, rope: torch.Tensor, comm: Communicator) -> torch.Tensor:
    d = cfg.head_dim
    kvh = cache.shape[3]
    qkv = F.linear(x_TD, w.qkv_QD, w.qkv_bias)
    q, k, v = qkv.split([qkv.shape[1] - 2 * kvh * d, kvh * d, kvh * d], dim=-1)
    q = apply_rope(rms_norm(q.unflatten(-1, (-1, d)), w.q_norm, cfg.rms_norm_eps), meta.positions, rope)
    k = apply_rope(rms_norm(k.unflatten(-1, (-1, d)), w.k_norm, cfg.rms_norm_eps), meta.positions, rope)
    write_kv(cache, k, v.unflatten(-1, (-1, d)), meta)
    o = paged_attention(q, cache, meta, d ** -0.5)
    return comm.reduce(F.linear(o.flatten(1), w.o_DQ))


def moe(x_TD: torch.Tensor, w: MoEWeights, cfg: ModelConfig, comm: Communicator) -> torch.Tensor:
    w_TK, ids_TK = route(x_TD, w.gate_ED, cfg.top_k, cfg.norm_topk_prob)
    x, w_TK, ids_TK, handle = comm.dispatch(x_TD, w_TK, ids_TK)
    return comm.combine(experts(x, w_TK, ids_TK, w.w13_EFD, w.w2_EDF, w.first_expert), handle)


def mlp(x_TD: torch.Tensor, w: MoEWeights | DenseWeights, cfg: ModelConfig, comm: Communicator) -> torch.Tensor:
    if isinstance(w, MoEWeights):
        return moe(x_TD, w, cfg, comm)
    return comm.reduce(dense_mlp(x_TD, w.w13_FD, w.w2_DF))


def forward(input_ids_T: torch.Tensor, meta: AttentionMetadata, weights: ModelWeights, kv: list[torch.Tensor],
            cfg: ModelConfig, comm: Communicator) -> torch.Tensor:
    """Final-normed hidden states [T, D] of the new tokens; their K/V are written into `kv` (one cache per layer)."""
    x = F.embedding(input_ids_T, weights.embed_VD)
    for layer, cache in zip(weights.layers, kv, strict=True):
        x = x + attention(rms_norm(x, layer.input_norm, cfg.rms_norm_eps), layer.attn, cache, meta, cfg,
                          weights.rope, comm)
        x = x + mlp(rms_norm(x, layer.post_norm, cfg.rms_norm_eps), layer.mlp, cfg, comm)
    return rms_norm(x, weights.norm, cfg.rms_norm_eps)


def logits(hidden_TD: torch.Tensor, weights: ModelWeights) -> torch.Tensor:
    return F.linear(hidden_TD, weights.lm_head_VD)
