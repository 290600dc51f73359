"""Mixtral's config.json (transformers' `MixtralConfig`) as the engine's ModelConfig: every layer MoE, the experts'
intermediate size its `intermediate_size`, the renormalised top-k, and the experts' checkpoint names
(`W1W3W2_EXPERTS`) as its `extra`."""

from __future__ import annotations

from typing import Any

from moebius.config import ConfigError, ModelConfig
from moebius.models.hf_fields import cut_layers, optional_int, plain_rope_theta, positive_int
from moebius.models.specs import W1W3W2_EXPERTS

FAMILY = "the mixtral family (MixtralForCausalLM)"
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_local_experts", "num_experts_per_tok")


def parse_config(hf: dict[str, Any], num_layers: int | None = None) -> ModelConfig:
    """A Mixtral config.json (its architecture checked by the registry) as the engine's ModelConfig; ConfigError
    naming the family and what it cannot serve."""
    shape = {k: positive_int(hf, k, FAMILY) for k in SHAPE_KEYS}
    heads = shape["num_attention_heads"]
    kv_heads = optional_int(hf, "num_key_value_heads", heads, FAMILY)
    head_dim = optional_int(hf, "head_dim", shape["hidden_size"] // heads, FAMILY)
    max_pos = positive_int(hf, "max_position_embeddings", FAMILY) if "max_position_embeddings" in hf else 4096 * 32
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"unsupported hidden_act {act!r} in {FAMILY}: its experts are SwiGLU ('silu')")
    window = hf.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ConfigError(f"{FAMILY}: sliding_window must be an integer >= 1 or null, got {window!r}")
    theta = plain_rope_theta(hf, FAMILY, default=1e6)  # MixtralConfig's
    layers = cut_layers(shape["num_hidden_layers"], num_layers)
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
        rope_theta=theta,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # every layer windowed, as transformers' mask (a window as long as the context: none)
        layer_windows=(window,) * layers if window is not None and window < max_pos else (),
        family="mixtral",
        extra=W1W3W2_EXPERTS,
    )
    cfg.validate()
    return cfg
