"""GPT-OSS's config.json as the engine's ModelConfig: GQA heads of head_dim as the KV spec, the routed experts'
fields the engine reads, the sliding layers' windows (`ModelConfig.layer_windows`), and the family's own
(`GptOssConfig`: the clamped SwiGLU, YaRN) in `ModelConfig.extra`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moebius.config import ConfigError, ModelConfig
from moebius.layers.moe import ClampedSwiGLU
from moebius.layers.rotary import YarnScaling
from moebius.models.hf_fields import cut_layers, positive_int

# transformers' GptOssConfig when config.json has no rope_parameters / rope_scaling (the released models' values)
DEFAULT_ROPE: dict[str, Any] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 4096}
DEFAULT_THETA = 150000.0
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class GptOssConfig:
    """What only this family's forward and weight specs read (frozen: part of a ModelConfig, a cache key)."""

    swiglu_alpha: float  # the experts' sigmoid gain
    swiglu_limit: float  # gate clamped above, up clamped both sides
    yarn: YarnScaling | None  # None: plain rope

    @property
    def activation(self) -> ClampedSwiGLU:
        return ClampedSwiGLU(self.swiglu_alpha, self.swiglu_limit)


def parse_config(hf: dict[str, Any], num_layers: int | None = None) -> ModelConfig:
    """A GPT-OSS config.json (its architecture checked by the registry) as the engine's ModelConfig; ConfigError
    naming what is missing or unsupported. (Its quantization_config is models/source.py's to check, against the
    family's `packings`: an MXFP4 checkpoint is the same model.)"""
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "num_local_experts", "num_experts_per_tok"):
        positive_int(hf, key, "GPT-OSS")
    layers = hf["num_hidden_layers"]
    served = cut_layers(layers, num_layers)
    types = hf.get("layer_types") or [LAYER_TYPES[(i + 1) % 2] for i in range(layers)]  # transformers' default
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(f"config.json's layer_types must be {layers} of {', '.join(LAYER_TYPES)}, got {types!r}")
    window = hf.get("sliding_window", 128)
    if "sliding_attention" in types and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ConfigError(f"config.json's sliding_window must be an integer >= 1 for its sliding layers, got "
                          f"{window!r}")
    max_pos = positive_int(hf, "max_position_embeddings", "GPT-OSS") if "max_position_embeddings" in hf else 131072
    # transformers 5 writes rope_parameters (with rope_theta), 4.x and the releases rope_scaling and rope_theta
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or DEFAULT_ROPE)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ConfigError(f"rope scaling {kind!r} is not supported for GPT-OSS (only default and yarn)")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", DEFAULT_THETA)))
    ext = GptOssConfig(
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        yarn=YarnScaling.from_rope(rope, max_pos) if kind == "yarn" else None)
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=served,
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        head_dim=hf["head_dim"],
        intermediate_size=0,  # no dense MLP layers
        moe_intermediate_size=hf["intermediate_size"],  # one expert's
        num_experts=hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        norm_topk_prob=True,  # (the softmax over the top-k logits sums to one)
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", True)),
        layer_windows=tuple(window if t == "sliding_attention" else None for t in types[:served]),
        family="gpt_oss",
        extra=ext,
    )
    cfg.validate()
    return cfg
