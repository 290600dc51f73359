"""What the engine flags name as the model: its config, where its weights come from (a checkpoint directory, or
random weights for a preset or the built-in demo model), its tokenizer and its end-of-sequence ids.

Everything that can be refused from config.json and the checkpoint's file headers is refused here, at the front end,
before a rank process is spawned or a byte of the unified buffer is allocated.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from moebius.config import PRESETS, ConfigError, EngineConfig, ModelConfig, read_hf_config
from moebius.memory.kv_pool import kv_budget
from moebius.models.builtin import builtin_hf_config
from moebius.models.fp8_blocks import FP8
from moebius.models.fp8_blocks import check_config as check_fp8_config
from moebius.models.loader import Checkpoint, check_checkpoint
from moebius.models.registry import FAMILIES, checks_own_keys, family_of, model_config
from moebius.parallel.layout import check_quantized_rows
from moebius.tokenizer import Tokenizer, has_tokenizer, load_generation_eos

log = logging.getLogger("moebius")


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


# Files GPTQ (quantize_config.json) and AWQ (quant_config.json) tools write beside checkpoints whose config.json
# predates quantization_config: their tensors are packed integers all the same.
QUANT_FILES = ("quantize_config.json", "quant_config.json")
# Shapes without which a Qwen3-MoE model is guesswork (transformers fills defaults of another model size).
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
MOE_KEYS = ("num_experts_per_tok", "moe_intermediate_size")
POSITIVE_INTS = (*REQUIRED_KEYS, *MOE_KEYS, "head_dim", "max_position_embeddings", "decoder_sparse_step")


def _quant_method(q: Any) -> str:
    """A quantization_config's method, in words."""
    if not isinstance(q, dict):
        return repr(q)
    method = q.get("quant_method")
    if method is None and (q.get("load_in_4bit") or q.get("load_in_8bit")):
        method = "bitsandbytes"  # transformers' older BitsAndBytesConfig wrote no quant_method
    detail = f", weight_block_size {q['weight_block_size']}" if q.get("weight_block_size") else ""
    return f"quant_method {method!r}{detail}" if method is not None else f"no quant_method ({q!r})"


def _readable() -> str:
    """The quantized formats Moebius reads, each with the architectures it reads it for."""
    where: dict[str, list[str]] = {}
    for family in FAMILIES.values():
        for method in family.packings:
            where.setdefault(method, []).extend(family.architectures)
    return "; ".join(f"{m} for {', '.join(archs)}" for m, archs in where.items()) or "none"


def check_quantization(hf: dict[str, Any], where: str, model_dir: str | None) -> None:
    """ConfigError naming the method of a quantized checkpoint its family does not read (`packings`: GPT-OSS's
    MXFP4, Qwen3-MoE's and DeepSeek's block FP8), and the architecture: its tensors would be read as plain weights;
    and naming a block FP8 setting (weight_block_size, fmt) other than the releases'."""
    archs = hf.get("architectures") or []
    accepted = {m for f in FAMILIES.values() if any(a in f.architectures for a in archs) for m in f.packings}
    refused = (f", and Moebius reads no such one for {archs or hf.get('model_type')!r} (it reads "
               f"{_readable()}); serve the model's unquantized (BF16) release")
    q = hf.get("quantization_config")
    if q is not None and q != {} and not (isinstance(q, dict) and q.get("quant_method") in accepted):
        raise ConfigError(f"{where} has a quantization_config ({_quant_method(q)}): a quantized checkpoint{refused}")
    if isinstance(q, dict) and q.get("quant_method") == FP8.method:  # (the block size its scales' shapes assume)
        check_fp8_config(q, where)
    q = hf.get("compression_config")  # compressed-tensors' older key: no family reads its formats
    if q is not None and q != {}:
        raise ConfigError(f"{where} has a compression_config ({_quant_method(q)}): a quantized checkpoint{refused}")
    files = [os.path.join(model_dir, name) for name in QUANT_FILES] if model_dir is not None else []
    for file in files:
        if os.path.isfile(file):
            raise ConfigError(f"{file} marks a quantized (GPTQ / AWQ) checkpoint{refused}")


def _bad_value(key: str, v: Any) -> str | None:
    """What is wrong with config.json's value of `key`, or None."""
    if key in POSITIVE_INTS or key in ("num_experts", "num_local_experts", "intermediate_size"):
        low = 0 if key in ("num_experts", "num_local_experts", "intermediate_size") else 1
        if v is None and key in ("head_dim", "decoder_sparse_step"):  # null: derived / the default
            return None
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            return f"{key} must be an integer >= {low}, got {v!r}"
    elif key == "mlp_only_layers":
        if v is not None and not (isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                                               and i >= 0 for i in v)):
            return f"mlp_only_layers must be a list of layer indices, got {v!r}"
    elif key in ("rms_norm_eps", "rope_theta"):
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            return f"{key} must be a positive number, got {v!r}"
    return None


def check_hf_config(hf: dict[str, Any], where: str, model_dir: str | None = None) -> None:
    """ConfigError unless config.json (`where`) describes a Qwen3-MoE model Moebius reads as it is meant: not
    quantized (or in a format its family reads, `check_quantization`), every shape key present (all missing ones
    named at once) and of the right type."""
    check_quantization(hf, where, model_dir)
    if checks_own_keys(hf):  # (another family's keys: its parse_config names what is missing)
        return
    missing = [k for k in REQUIRED_KEYS if k not in hf]
    if "num_experts" not in hf and "num_local_experts" not in hf:
        missing.append("num_experts")
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not (isinstance(experts, int) and experts == 0):  # 0 experts: every layer dense, no MoE keys read
        missing += [k for k in MOE_KEYS if k not in hf]
    sparse = hf.get("decoder_sparse_step") or 1
    dense = experts == 0 or bool(hf.get("mlp_only_layers")) or (isinstance(sparse, int) and sparse > 1)
    if dense and "intermediate_size" not in hf:
        missing.append("intermediate_size")
    if missing:
        raise ConfigError(f"{where} lacks {', '.join(missing)}: a Qwen3-MoE model's config.json needs "
                          f"{'them' if len(missing) > 1 else 'it'} (Moebius guesses no shape)")
    keys = (*POSITIVE_INTS, "num_experts", "num_local_experts", "intermediate_size", "mlp_only_layers",
            "rms_norm_eps", "rope_theta")
    bad = [msg for k in keys if k in hf and (msg := _bad_value(k, hf[k])) is not None]
    if bad:
        raise ConfigError(f"{where}: {'; '.join(bad)}")


def _read_config_json(path: str) -> dict[str, Any]:
    """config.json of a model directory as a dict, or ConfigError naming the file (and where its JSON breaks)."""
    file = os.path.join(path, "config.json")
    try:
        hf = read_hf_config(path)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{file} is not UTF-8 text (byte {e.start}): is it a config.json?") from None
    except OSError as e:
        raise ConfigError(f"cannot read {file}: {e.strerror}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{file} holds a JSON {type(hf).__name__}, not an object of model settings")
    return hf


def hf_config_of(name: str | None) -> dict[str, Any]:
    """The HF config.json of what --model names: the built-in model (None), a preset, or a checkpoint directory;
    ConfigError naming what is wrong with it."""
    if name is None:
        hf, where, model_dir = builtin_hf_config(), "the built-in model's config", None
    elif is_preset(name):
        hf, where, model_dir = PRESETS[name], f"preset {name!r}", None
    else:
        hf, where, model_dir = _read_config_json(name), os.path.join(name, "config.json"), name
    check_hf_config(hf, where, model_dir)
    return hf


def check_kv_budget(ecfg: EngineConfig) -> None:
    """A KV token budget that leaves no usable page is refused before any rank is built (the rank sizes the rest:
    GPU memory, the other layout's pages)."""
    device = ecfg.device if ecfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    kv_budget(ecfg.max_total_tokens, ecfg.block_size, device)


def resolve_model(ecfg: EngineConfig) -> ResolvedModel:
    name = ecfg.model
    hf = hf_config_of(name)
    cfg = model_config(hf, ecfg.num_layers)
    q = hf.get("quantization_config") or {}
    if ecfg.quantization is None and ecfg.quantization_scope != "all":
        raise ConfigError(f"--quantization-scope {ecfg.quantization_scope} needs --quantization (the format the "
                          "routed experts are held in)")
    if ecfg.quantization is not None:
        family = family_of(cfg)
        if ecfg.quantization not in family.quantizations:
            raise ConfigError(f"--quantization {ecfg.quantization} is not served for the {family.name} family "
                              f"({', '.join(family.architectures)}): its experts have their own format")
        check_requantization(ecfg.quantization, hf, "a checkpoint",
                             "serve it with --quantization {stored} (where its family serves that) or without "
                             "--quantization (it is then dequantized at load)")
        # what a quantized checkpoint leaves unquantized stays in the dtype (its modules_to_not_convert)
        skip = q.get("modules_to_not_convert") or ()
        experts = [m for m in skip if ".experts" in m]
        if experts:  # (quantized rows are the experts' slots' only form: quantizing them would change the model)
            raise ConfigError(f"--quantization {ecfg.quantization} holds the routed experts quantized, but the "
                              f"checkpoint leaves {experts[0]} unquantized (its modules_to_not_convert): serve it "
                              "without --quantization (it is then dequantized at load)")
        cfg = dataclasses.replace(cfg, quantization=ecfg.quantization, quant_skip=tuple(skip),
                                  quantize_dense=ecfg.quantization_scope == "all")
        check_quantized_rows(cfg)
    elif (stored := q.get("quant_method")) in family_of(cfg).quantizations:  # (vLLM keeps it: say how)
        log.warning("the checkpoint is stored in %s and is dequantized at load to --dtype (more bytes per weight); "
                    "--quantization %s keeps it as stored", stored, stored)
    check_kv_budget(ecfg)
    if name is None:
        tok = Tokenizer.builtin()
        return ResolvedModel(cfg, None, tok, tok.eos_token_ids, True)
    if is_preset(name):
        if ecfg.load_format != "dummy":
            raise ConfigError(f"preset {name!r} has no weights on disk; pass --load-format dummy")
        tok = Tokenizer.from_dir(ecfg.tokenizer) if ecfg.tokenizer else Tokenizer.builtin()
        return ResolvedModel(cfg, None, tok, tok.eos_token_ids, False)
    checkpoint = None if ecfg.load_format == "dummy" else name
    if checkpoint is not None:  # headers only: every tensor read is there, shaped and typed right
        check_checkpoint(Checkpoint(checkpoint), cfg, hf["num_hidden_layers"])
    tok_dir = ecfg.tokenizer or (name if has_tokenizer(name) else None)
    tok = Tokenizer.from_dir(tok_dir) if tok_dir else None
    eos = tuple(dict.fromkeys(load_generation_eos(name) + (tok.eos_token_ids if tok else ())))
    return ResolvedModel(cfg, checkpoint, tok, eos, False)


def check_requantization(quantization: str | None, hf: dict[str, Any], what: str, remedy: str) -> None:
    """ConfigError where an engine holding --quantization's rows would read a checkpoint stored in another quantized
    format (`what`: the checkpoint, in words): its values would be rounded a second time. `remedy`: what to do instead
    ("{stored}": the checkpoint's format)."""
    stored = (hf.get("quantization_config") or {}).get("quant_method")
    if quantization and stored is not None and stored != quantization:
        raise ConfigError(f"--quantization {quantization} would quantize again {what} stored in {stored}: "
                          + remedy.format(stored=stored))


def check_update_checkpoint(path: str, cfg: ModelConfig) -> None:
    """Before a weight update from `path`: a directory of the served model's architecture and shapes. Its config.json,
    where it has one, describes the same model (at least as many layers as are served), and every tensor the weights
    read is there, of its shape and stored as floating point (`check_checkpoint`); ConfigError naming what is not."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a directory name, got {type(path).__name__} {path!r}")
    if not os.path.isdir(path):
        raise ConfigError(f"weight update from {str(path)!r}: no such directory")
    layers = cfg.num_layers
    if os.path.isfile(os.path.join(path, "config.json")):
        hf = hf_config_of(str(path))
        check_requantization(cfg.quantization, hf, f"the weight update's checkpoint {path}",
                             f"update from a float checkpoint or one stored in {cfg.quantization}")
        theirs = model_config(hf)
        layers = theirs.num_layers
        if layers < cfg.num_layers:
            raise ConfigError(f"{path}/config.json has {layers} layers; the engine serves {cfg.num_layers}")
        differ = [f"{f.name} {getattr(theirs, f.name)!r} (the engine's: {getattr(cfg, f.name)!r})"
                  for f in dataclasses.fields(cfg)
                  if f.name not in ("num_layers", "quantization", "quant_skip", "quantize_dense")
                  and getattr(theirs, f.name) != getattr(cfg, f.name)]
        if differ:
            raise ConfigError(f"{path}/config.json describes another model than the one served: {'; '.join(differ)}")
    check_checkpoint(Checkpoint(str(path)), cfg, layers)
