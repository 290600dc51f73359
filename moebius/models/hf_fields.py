"""Reading a family's config.json fields the same way in every family: shape integers (named when missing or
ill-typed), plain RoPE's theta (rope scaling refused), the --num-layers cut. transformers 4.x writes rope_theta /
rope_scaling at the top level, 5.x inside rope_parameters: both are read."""

from __future__ import annotations

from typing import Any

from moebius.config import ConfigError


def positive_int(hf: dict[str, Any], key: str, family: str) -> int:
    """config.json's `key`, an integer >= 1; ConfigError naming it and the family that needs it."""
    v = hf.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"config.json's {key} must be an integer >= 1, got {v!r} ({family} needs it)")
    return v


def optional_int(hf: dict[str, Any], key: str, default: int, family: str) -> int:
    """config.json's `key` where it gives one (an integer >= 1, as `positive_int` checks), else `default` (the
    family's config class's: num_key_value_heads = heads, head_dim = hidden / heads)."""
    return default if hf.get(key) is None else positive_int(hf, key, family)


def rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The rope fields, wherever the file keeps them (rope_parameters first, as transformers 5 reads them)."""
    return {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}


def rope_kind(hf: dict[str, Any]) -> str:
    rope = rope_fields(hf)
    return rope.get("rope_type", rope.get("type")) or "default"


def plain_rope_theta(hf: dict[str, Any], family: str, default: float = 10000.0) -> float:
    """The base of plain RoPE (`default`: the family's config class's where the file has none); ConfigError naming
    the family where the file asks for a scaled rope."""
    kind = rope_kind(hf)
    if kind != "default":
        raise ConfigError(f"unsupported rope scaling {kind!r} in {family}: only plain RoPE (rope_scaling = null) is "
                          "supported")
    return float(rope_fields(hf).get("rope_theta", hf.get("rope_theta", default)))


def cut_layers(layers: int, num_layers: int | None) -> int:
    """The layers served: the model's, or its first --num-layers."""
    if num_layers is None:
        return layers
    if not 1 <= num_layers <= layers:
        raise ConfigError(f"--num-layers {num_layers} must be between 1 and the model's {layers} layers")
    return num_layers
