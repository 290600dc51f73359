"""OLMoE's config.json (transformers' `OlmoeConfig`) as the engine's ModelConfig: every layer MoE (its experts'
width is `intermediate_size`), GQA heads of hidden_size / num_attention_heads, and the family's own field
(`OlmoeFields`: clip_qkv) in `ModelConfig.extra`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moebius.config import ConfigError, ModelConfig
from moebius.models.hf_fields import cut_layers, optional_int, plain_rope_theta, positive_int

# Shapes transformers would fill with OLMoE-1B-7B's defaults when absent: Moebius guesses none of them
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "num_experts", "num_experts_per_tok")


@dataclass(frozen=True)
class OlmoeFields:
    """What only this family's forward reads (frozen: part of a ModelConfig, a cache key)."""

    clip_qkv: float | None  # |q|, |k| (after their norms) and |v| clamped to it; None: no clamp


def _positive_number(hf: dict[str, Any], key: str, default: float) -> float:
    v = hf.get(key, default)
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"config.json's {key} must be a positive number, got {v!r}")
    return float(v)


def parse_config(hf: dict[str, Any], num_layers: int | None = None) -> ModelConfig:
    """An OLMoE config.json (its architecture checked by the registry) as the engine's ModelConfig; ConfigError
    naming what is missing or unsupported."""
    missing = [k for k in REQUIRED if k not in hf]
    if missing:
        raise ConfigError(f"config.json lacks {', '.join(missing)}: an OLMoE model's config.json needs "
                          f"{'them' if len(missing) > 1 else 'it'} (Moebius guesses no shape)")
    shapes = {k: positive_int(hf, k, "OLMoE") for k in REQUIRED}
    heads, hidden = shapes["num_attention_heads"], shapes["hidden_size"]
    kv_heads = optional_int(hf, "num_key_value_heads", heads, "OLMoE")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"unsupported hidden_act {act!r}; OLMoE uses 'silu'")
    if hf.get("attention_bias"):
        raise ConfigError("OLMoE with attention_bias = true (q/k/v/o_proj biases) is not supported; the OLMoE "
                          "releases have none")
    if hf.get("sliding_window") is not None:
        raise ConfigError(f"OLMoE with sliding_window = {hf['sliding_window']!r} is not supported")
    # q_norm spans hidden_size and k_norm (hidden_size / heads) * kv heads in transformers: a head is that wide
    if hidden % heads:
        raise ConfigError(f"OLMoE's hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    head_dim = hidden // heads
    if hf.get("head_dim") not in (None, head_dim):
        raise ConfigError(f"OLMoE with head_dim {hf['head_dim']!r} is not supported: its q/k norms span "
                          f"hidden_size, so a head is hidden_size / num_attention_heads = {head_dim} wide")
    clip = hf.get("clip_qkv")
    if clip is not None:
        clip = _positive_number(hf, "clip_qkv", 0.0)
    theta = plain_rope_theta(hf, "OLMoE")
    if not math.isfinite(theta) or theta <= 0:
        raise ConfigError(f"config.json's rope_theta must be a positive number, got {theta!r}")
    layers = cut_layers(shapes["num_hidden_layers"], num_layers)
    cfg = ModelConfig(
        vocab_size=shapes["vocab_size"],
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=0,  # no dense MLP layer
        moe_intermediate_size=shapes["intermediate_size"],  # OLMoE's experts are intermediate_size wide
        num_experts=shapes["num_experts"],
        top_k=shapes["num_experts_per_tok"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        rms_norm_eps=_positive_number(hf, "rms_norm_eps", 1e-5),
        rope_theta=theta,
        max_position_embeddings=positive_int(hf, "max_position_embeddings", "OLMoE") if "max_position_embeddings" in hf
        else 4096,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        family="olmoe",
        extra=OlmoeFields(clip),
    )
    cfg.validate()
    return cfg
