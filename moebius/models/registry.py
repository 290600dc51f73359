"""The model families Moebius serves, found by a checkpoint's `architectures` (config.json), and a ModelConfig's
family. Adding a family: its folder under moebius/models/ exposing a `Family`, and one line in FAMILIES."""

from __future__ import annotations

from typing import Any

from moebius.config import ConfigError, ModelConfig
from moebius.models import deepseek, glm4_moe, gpt_oss, mixtral, olmoe, qwen2moe, qwen3_moe
from moebius.models.specs import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (qwen3_moe.FAMILY, deepseek.FAMILY, olmoe.FAMILY,
                                                    mixtral.FAMILY, qwen2moe.FAMILY, glm4_moe.FAMILY, gpt_oss.FAMILY)}


def family_for(hf: dict[str, Any]) -> Family:
    """The family of a config.json, by its `architectures`; ConfigError naming the architectures served."""
    archs = hf.get("architectures") or []
    for family in FAMILIES.values():
        if any(a in family.architectures for a in archs):
            return family
    served = [a for f in FAMILIES.values() for a in f.architectures]
    raise ConfigError(f"unsupported architecture {archs or hf.get('model_type')!r} in config.json; Moebius serves "
                      f"{', '.join(served)}")


def model_config(hf: dict[str, Any], num_layers: int | None = None) -> ModelConfig:
    """A config.json (and --num-layers) parsed by its family; ConfigError naming what cannot be served."""
    return family_for(hf).parse_config(hf, num_layers)


def family_of(cfg: ModelConfig) -> Family:
    return FAMILIES[cfg.family]


def checks_own_keys(hf: dict[str, Any]) -> bool:
    """Whether the family of a config.json (by its `architectures`; False for none served) refuses missing or
    ill-typed shape keys itself, in its parse_config."""
    archs = hf.get("architectures") or []
    return any(f.checks_own_keys and any(a in f.architectures for a in archs) for f in FAMILIES.values())
