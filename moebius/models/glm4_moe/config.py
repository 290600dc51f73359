"""GLM-4.5 / 4.6's config.json (transformers' `Glm4MoeConfig`) as the engine's ModelConfig: GQA heads as the KV spec,
the routed experts' fields the engine reads, and the family's own (`GlmConfig`: the rotary width, the q/k norm, the
MoE block shared with DeepSeek) in `ModelConfig.extra`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moebius.config import ConfigError, ModelConfig
from moebius.models.grouped_moe import MoEConfig
from moebius.models.hf_fields import cut_layers, plain_rope_theta, positive_int, rope_fields

# transformers' Glm4MoeConfig defaults of the MoE fields a config.json may leave out (its router always scores by
# sigmoid with the correction bias and keeps topk_group of n_group groups)
MOE_DEFAULTS: dict[str, Any] = dict(n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                                    n_shared_experts=1, first_k_dense_replace=1)


@dataclass(frozen=True)
class GlmConfig:
    """What only this family's forward and weight specs read (frozen: part of a ModelConfig, a cache key)."""

    rotary_dim: int  # the first dims of each head RoPE rotates (head_dim * partial_rotary_factor)
    qk_norm: bool  # use_qk_norm: per-head RMSNorm of q and k before RoPE
    moe: MoEConfig


def parse_config(hf: dict[str, Any], num_layers: int | None = None) -> ModelConfig:
    """A GLM-4.5 / 4.6 config.json (its architecture checked by the registry) as the engine's ModelConfig;
    ConfigError naming what is missing or unsupported."""
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok"):
        positive_int(hf, key, "GLM-4.5")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    theta = plain_rope_theta(hf, "GLM-4.5")
    # Glm4MoeConfig defaults partial_rotary_factor to 0.5 where neither place gives it
    factor = float(rope_fields(hf).get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)))
    rotary_dim = int(head_dim * factor)
    if not 2 <= rotary_dim <= head_dim or rotary_dim % 2:
        raise ConfigError(f"partial_rotary_factor {factor} of head_dim {head_dim} rotates {rotary_dim} dims; RoPE "
                          f"needs an even number from 2 to head_dim")
    given = {k: v for k, v in hf.items() if v is not None}
    # the router of transformers' Glm4MoeMoE: sigmoid, the bias for the choice, grouped top-k (no moe_layer_freq)
    moe = MoEConfig.read({**MOE_DEFAULTS, **given}, "GLM-4.5", scoring_func="sigmoid", topk_method="noaux_tc")
    # (num_nextn_predict_layers: the multi-token-prediction layer sits past num_hidden_layers, never read)
    layers = hf["num_hidden_layers"]
    served = cut_layers(layers, num_layers)
    # the dense layers over the whole model (not the cut), so that a cut and its full checkpoint compare equal
    dense = tuple(i for i in range(layers) if not moe.is_moe_layer(i))
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=served,
        num_heads=heads,
        num_kv_heads=hf["num_key_value_heads"],
        head_dim=head_dim,
        intermediate_size=moe.intermediate_size,
        moe_intermediate_size=moe.moe_intermediate_size,
        num_experts=moe.num_experts,
        top_k=moe.top_k,
        norm_topk_prob=moe.norm_topk_prob,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        max_position_embeddings=hf.get("max_position_embeddings", 131072),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_only_layers=dense,  # ModelConfig.is_moe_layer answers first_k_dense_replace through them
        decoder_sparse_step=1,
        family="glm4_moe",
        extra=GlmConfig(rotary_dim=rotary_dim, qk_norm=bool(hf.get("use_qk_norm", False)), moe=moe),
    )
    cfg.validate()
    return cfg
