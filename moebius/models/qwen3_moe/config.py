"""Qwen3-MoE's config.json: the fields of transformers' `Qwen3MoeConfig` the math uses."""

from __future__ import annotations

from typing import Any

from moebius.config import ConfigError, ModelConfig
from moebius.models.hf_fields import cut_layers, plain_rope_theta


def parse_config(hf: dict[str, Any], num_layers: int | None = None) -> ModelConfig:
    """A Qwen3-MoE config.json (its architecture checked by the registry) as the engine's ModelConfig; ConfigError
    naming what is unsupported."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"unsupported hidden_act {act!r}; Qwen3-MoE uses 'silu'")
    theta = plain_rope_theta(hf, "Qwen3-MoE")
    if hf.get("use_sliding_window"):
        raise ConfigError("sliding-window attention (use_sliding_window = true) is not supported")
    layers = cut_layers(hf["num_hidden_layers"], num_layers)
    heads = hf["num_attention_heads"]
    num_experts = hf.get("num_experts", hf.get("num_local_experts", 0))
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf.get("intermediate_size", 0),
        moe_intermediate_size=hf.get("moe_intermediate_size", 0),
        num_experts=num_experts,
        top_k=hf.get("num_experts_per_tok", 1),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1) or 1,
    )
    cfg.validate()
    return cfg

