"""GLM-4.5 / 4.6's config.json (transformers' `Glm4MoeConfig`) as the engine's ModelConfig: GQA heads as the KV spec,
the routed experts' fields the engine reads, and the family's own (`GlmConfig`: the rotary width, the q/k norm, the
MoE block shared with DeepSeek) in `ModelConfig.extra`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moebius.config import ConfigError, ModelConfig
from moebius.models.grouped_moe import MoEConfig

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


def _int(hf: dict[str, Any], key: str) -> int:
    v = hf.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"config.json's {key} must be an integer >= 1, got {v!r} (GLM-4.5 needs it)")
    return v


def parse_config(hf: dict[str, Any], num_layers: int | None = None) -> ModelConfig:
    """A GLM-4.5 / 4.6 config.json (its architecture checked by the registry) as the engine's ModelConfig;
    ConfigError naming what is missing or unsupported."""
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok"):
        _int(hf, key)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    # transformers 5 keeps rope fields in rope_parameters, the published (4.x) files at the top level
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type")) or scaling.get("rope_type", scaling.get("type")) or "default"
    if kind != "default":
        raise ConfigError(f"unsupported rope scaling {kind!r} for GLM-4.5; only plain RoPE (rope_scaling = null)")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    # Glm4MoeConfig defaults partial_rotary_factor to 0.5 where neither place gives it
    factor = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)))
    rotary_dim = int(head_dim * factor)
    if not 2 <= rotary_dim <= head_dim or rotary_dim % 2:
        raise ConfigError(f"partial_rotary_factor {factor} of head_dim {head_dim} rotates {rotary_dim} dims; RoPE "
                          f"needs an even number from 2 to head_dim")
    given = {k: v for k, v in hf.items() if v is not None}
    # the router of transformers' Glm4MoeMoE: sigmoid, the bias for the choice, grouped top-k (no moe_layer_freq)
    moe = MoEConfig.read({**MOE_DEFAULTS, **given}, "GLM-4.5", scoring_func="sigmoid", topk_method="noaux_tc")
    # (num_nextn_predict_layers: the multi-token-prediction layer sits past num_hidden_layers, never read)
    layers = hf["num_hidden_layers"]
    if num_layers is not None and not 1 <= num_layers <= layers:
        raise ConfigError(f"--num-layers {num_layers} must be between 1 and the model's {layers} layers")
    # the dense layers over the whole model (not the cut), so that a cut and its full checkpoint compare equal
    dense = tuple(i for i in range(layers) if not moe.is_moe_layer(i))
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=layers if num_layers is None else num_layers,
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
