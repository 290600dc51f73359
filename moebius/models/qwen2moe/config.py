"""Qwen2-MoE's config.json (transformers' `Qwen2MoeConfig`) as the engine's ModelConfig, the shared expert's size
in its `extra` (`Qwen2MoeFields`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moebius.config import ConfigError, ModelConfig
from moebius.models.hf_fields import cut_layers, optional_int, plain_rope_theta, positive_int

LAYER_TYPES = ("sliding_attention", "full_attention")
FAMILY = "the qwen2moe family (Qwen2MoeForCausalLM)"
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts",
              "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


@dataclass(frozen=True)
class Qwen2MoeFields:
    """What only this family's weight specs and forward read (frozen: part of a ModelConfig, a cache key)."""

    shared_intermediate_size: int  # the shared expert's (shared_expert_intermediate_size)


def parse_config(hf: dict[str, Any], num_layers: int | None = None) -> ModelConfig:
    """A Qwen2-MoE config.json (its architecture checked by the registry) as the engine's ModelConfig; ConfigError
    naming the family and what it cannot serve."""
    shape = {k: positive_int(hf, k, FAMILY) for k in SHAPE_KEYS}
    heads = shape["num_attention_heads"]
    kv_heads = optional_int(hf, "num_key_value_heads", heads, FAMILY)
    head_dim = optional_int(hf, "head_dim", shape["hidden_size"] // heads, FAMILY)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"unsupported hidden_act {act!r} in {FAMILY}: its experts are SwiGLU ('silu')")
    windows = _layer_windows(hf, shape["num_hidden_layers"])
    theta = plain_rope_theta(hf, FAMILY)
    layers = cut_layers(shape["num_hidden_layers"], num_layers)
    sparse_step = positive_int(hf, "decoder_sparse_step", FAMILY) if "decoder_sparse_step" in hf else 1
    dense = tuple(hf.get("mlp_only_layers") or ())
    has_dense = bool(dense) or sparse_step > 1
    cfg = ModelConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=positive_int(hf, "intermediate_size", FAMILY) if has_dense else 0,  # (dense layers only)
        moe_intermediate_size=shape["moe_intermediate_size"],
        num_experts=shape["num_experts"],
        top_k=shape["num_experts_per_tok"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),  # (false in the published configs)
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=positive_int(hf, "max_position_embeddings", FAMILY) if "max_position_embeddings" in hf
        else 32768,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("qkv_bias", True)),  # q|k|v biases (o_proj has none)
        mlp_only_layers=dense,
        decoder_sparse_step=sparse_step,
        layer_windows=windows[:layers] if any(windows) else (),
        family="qwen2moe",
        extra=Qwen2MoeFields(shape["shared_expert_intermediate_size"]),
    )
    cfg.validate()
    return cfg


def _layer_windows(hf: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Each layer's window as transformers' Qwen2MoeConfig sets them: with use_sliding_window, config.json's
    layer_types (transformers 5 writes them) or else its rule (even layers below max_window_layers) slide by
    sliding_window; without it none does, whatever sliding_window says."""
    types = hf.get("layer_types")
    if types is not None and (len(types) != layers or any(t not in LAYER_TYPES for t in types)):
        raise ConfigError(f"{FAMILY}: layer_types must be {layers} of {', '.join(LAYER_TYPES)}, got {types!r}")
    if not hf.get("use_sliding_window"):
        if types is not None and "sliding_attention" in types:
            raise ConfigError(f"{FAMILY}: layer_types name sliding_attention layers but use_sliding_window is false")
        return (None,) * layers
    window = hf.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigError(f"{FAMILY}: use_sliding_window needs sliding_window an integer >= 1, got {window!r}")
    if types is None:
        limit = positive_int(hf, "max_window_layers", FAMILY) if "max_window_layers" in hf else 28
        types = [LAYER_TYPES[0] if i % 2 == 0 and i < limit else LAYER_TYPES[1] for i in range(layers)]
    return tuple(window if t == LAYER_TYPES[0] else None for t in types)
