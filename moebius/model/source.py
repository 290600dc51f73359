"""What the engine flags name as the model: its config, where its weights come from (a checkpoint directory, or
random weights for a preset or the built-in demo model), its tokenizer and its end-of-sequence ids."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from moebius.config import PRESETS, ConfigError, EngineConfig, ModelConfig, read_hf_config
from moebius.model.builtin import builtin_hf_config
from moebius.tokenizer import Tokenizer, load_generation_eos


@dataclass(frozen=True)
class ResolvedModel:
    """What the flags name: the model config, where weights come from, and the tokenizer."""

    config: ModelConfig
    checkpoint: str | None
    tokenizer: Tokenizer | None  # (the front end's: text is decoded there only)
    eos_token_ids: tuple[int, ...]
    is_builtin: bool


def is_preset(name: str) -> bool:
    """A preset name (random weights of its shapes), unless a directory of that name exists."""
    return name in PRESETS and not os.path.isdir(name)


def hf_config_of(name: str | None) -> dict[str, Any]:
    """The HF config.json of what --model names: the built-in model (None), a preset, or a checkpoint directory."""
    if name is None:
        return builtin_hf_config()
    return PRESETS[name] if is_preset(name) else read_hf_config(name)


def resolve_model(ecfg: EngineConfig) -> ResolvedModel:
    name = ecfg.model
    cfg = ModelConfig.from_hf(hf_config_of(name), ecfg.num_layers)
    if name is None:
        tok = Tokenizer.builtin()
        return ResolvedModel(cfg, None, tok, tok.eos_token_ids, True)
    if is_preset(name):
        if ecfg.load_format != "dummy":
            raise ConfigError(f"preset {name!r} has no weights on disk; pass --load-format dummy")
        tok = Tokenizer.from_dir(ecfg.tokenizer) if ecfg.tokenizer else Tokenizer.builtin()
        return ResolvedModel(cfg, None, tok, tok.eos_token_ids, False)
    tok_dir = ecfg.tokenizer or (name if os.path.isfile(os.path.join(name, "tokenizer.json")) else None)
    tok = Tokenizer.from_dir(tok_dir) if tok_dir else None
    eos = tuple(dict.fromkeys(load_generation_eos(name) + (tok.eos_token_ids if tok else ())))
    checkpoint = None if ecfg.load_format == "dummy" else name
    return ResolvedModel(cfg, checkpoint, tok, eos, False)
