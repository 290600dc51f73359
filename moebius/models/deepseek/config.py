"""DeepSeek-V2 / V3's config.json as the engine's ModelConfig: MLA's one latent "head" a token as the KV spec, the
routed experts' fields the engine reads, and the family's own (`DeepseekConfig`: an MLAConfig and a MoEConfig) in
`ModelConfig.extra`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moebius.config import ModelConfig
from moebius.models.deepseek.mla import MLAConfig
from moebius.models.deepseek.moe import MoEConfig
from moebius.models.hf_fields import cut_layers, positive_int


@dataclass(frozen=True)
class DeepseekConfig:
    """What only this family's forward and weight specs read (frozen: part of a ModelConfig, a cache key)."""

    mla: MLAConfig
    moe: MoEConfig


def parse_config(hf: dict[str, Any], num_layers: int | None = None) -> ModelConfig:
    """A DeepSeek-V2 / V3 config.json (its architecture checked by the registry) as the engine's ModelConfig;
    ConfigError naming what is missing or unsupported."""
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        positive_int(hf, key, "DeepSeek-V2 / V3")
    mla, moe = MLAConfig.from_hf(hf), MoEConfig.from_hf(hf)
    # (num_nextn_predict_layers: the multi-token-prediction layers sit past num_hidden_layers, never read)
    layers = hf["num_hidden_layers"]
    served = cut_layers(layers, num_layers)
    # the dense layers over the whole model (not the cut), so that a cut and its full checkpoint compare equal
    dense = tuple(i for i in range(layers) if not moe.is_moe_layer(i))
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=served,
        num_heads=hf["num_attention_heads"],
        num_kv_heads=1,  # one latent a token, replicated on every TP rank like GQA heads below P
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim,  # a head's q.k width
        intermediate_size=moe.intermediate_size,
        moe_intermediate_size=moe.moe_intermediate_size,
        num_experts=moe.num_experts,
        top_k=moe.top_k,
        norm_topk_prob=moe.norm_topk_prob,
        rms_norm_eps=mla.rms_norm_eps,
        rope_theta=mla.rope_theta,
        max_position_embeddings=mla.max_position_embeddings,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=mla.attention_bias,
        mlp_only_layers=dense,  # ModelConfig.is_moe_layer answers DeepSeek's rule through them
        decoder_sparse_step=1,
        family="deepseek",
        kv_parts=1,
        kv_dim=mla.cache_dim,
        extra=DeepseekConfig(mla, moe),
    )
    cfg.validate()
    return cfg
