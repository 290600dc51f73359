"""Mixtral's config.json (transformers' `MixtralConfig`) as the engine's ModelConfig: every layer MoE, the experts'
intermediate size its `intermediate_size`, the renormalised top-k, and the experts' checkpoint names
(`W1W3W2_EXPERTS`) as its `extra`."""

from __future__ import annotations

from typing import Any

from moebius.config import ConfigError, ModelConfig
from moebius.models.specs import W1W3W2_EXPERTS

FAMILY = "the mixtral family (MixtralForCausalLM)"
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_local_experts", "num_experts_per_tok")


def _positive_int(hf: dict[str, Any], key: str) -> int:
    v = hf.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"config.json's {key} must be an integer >= 1, got {v!r} ({FAMILY} needs it)")
    return v


def parse_config(hf: dict[str, Any], num_layers: int | None = None) -> ModelConfig:
    """A Mixtral config.json (its architecture checked by the registry) as the engine's ModelConfig; ConfigError
    naming the family and what it cannot serve."""
    shape = {k: _positive_int(hf, k) for k in SHAPE_KEYS}
    heads = shape["num_attention_heads"]
    kv_heads = _positive_int(hf, "num_key_value_heads") if hf.get("num_key_value_heads") is not None else heads
    head_dim = _positive_int(hf, "head_dim") if hf.get("head_dim") is not None else shape["hidden_size"] // heads
    max_pos = _positive_int(hf, "max_position_embeddings") if "max_position_embeddings" in hf else 4096 * 32
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"unsupported hidden_act {act!r} in {FAMILY}: its experts are SwiGLU ('silu')")
    window = hf.get("sliding_window")
    if window is not None and (not isinstance(window, int) or window < max_pos):  # (as long as the context: none)
        raise ConfigError(f"{FAMILY}: sliding_window {window} is shorter than max_position_embeddings {max_pos}; "
                          "sliding-window attention is not supported yet (Mixtral's releases have sliding_window "
                          "null)")
    # transformers 4.x writes rope_theta / rope_scaling, 5.x rope_parameters
    rope, scaling = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type")) or scaling.get("rope_type", scaling.get("type")) or "default"
    if kind != "default":
        raise ConfigError(f"unsupported rope scaling {kind!r} in {FAMILY}: only plain RoPE is supported")
    layers = shape["num_hidden_layers"]
    if num_layers is not None:
        if not 1 <= num_layers <= layers:
            raise ConfigError(f"--num-layers {num_layers} must be between 1 and the model's {layers} layers")
        layers = num_layers
    cfg = ModelConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=shape["intermediate_size"],  # (no dense layer reads it)
        moe_intermediate_size=shape["intermediate_size"],  # one expert's
        num_experts=shape["num_local_experts"],
        top_k=shape["num_experts_per_tok"],
        norm_topk_prob=True,  # MixtralTopKRouter divides the top-k softmax weights by their sum, always
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 1e6))),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        family="mixtral",
        extra=W1W3W2_EXPERTS,
    )
    cfg.validate()
    return cfg
