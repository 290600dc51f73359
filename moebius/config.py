"""The frozen configuration tree: what the model is (ModelConfig) and how the engine runs it (EngineConfig).

Both are built once (from a Hugging Face config.json / a preset, and from CLI flags or LLM keyword arguments)
and never mutated. Values derived at run time (number of KV pages, EOS ids, ...) live in runtime state.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, TypeVar

# Published Qwen3-MoE configs (Hugging Face config.json of the releases); weights come from --load-format dummy.
E = TypeVar("E")  # a family's own config fields (ModelConfig.extra)

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
        attention_bias=False, mlp_only_layers=[], decoder_sparse_step=1, hidden_act="silu",
        bos_token_id=151643, eos_token_id=151645,
    ),
    "qwen3-235b-a22b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
        attention_bias=False, mlp_only_layers=[], decoder_sparse_step=1, hidden_act="silu",
        bos_token_id=151643, eos_token_id=151645,
    ),
    # The DeepSeek-V2 / V3 family's releases, their config.json fields as published on Hugging Face (written from
    # memory, not copied from the files: values marked "uncertain" were not checked against them). The checkpoints'
    # auto_map, dropout, aux-loss and init fields are left out (nothing reads them), and DeepSeek-V3's
    # quantization_config (FP8 blocks) too: a preset is random weights in --dtype, and an FP8 config is refused.
    "deepseek-v2-lite": dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
        intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, moe_layer_freq=1, topk_method="greedy", scoring_func="softmax", n_group=1,
        topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=163840,
        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
                          beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
        attention_bias=False, tie_word_embeddings=False, hidden_act="silu", bos_token_id=100000,
        eos_token_id=100001,
    ),
    "moonlight-16b-a3b": dict(  # moonshotai/Moonlight-16B-A3B: DeepSeek-V3's architecture at V2-Lite's size
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=163840, hidden_size=2048,
        intermediate_size=11264, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", n_group=1,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.446, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-5, rope_theta=50000.0,
        max_position_embeddings=8192, rope_scaling=None, num_nextn_predict_layers=0, attention_bias=False,
        tie_word_embeddings=False, hidden_act="silu", bos_token_id=163584, eos_token_id=163585,
    ),
    "deepseek-v3": dict(  # deepseek-ai/DeepSeek-V3 (R1: the same shapes); cut it with --num-layers
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
        num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        first_k_dense_replace=3, moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", n_group=8,
        topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=163840,
        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
                          beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
        num_nextn_predict_layers=1, attention_bias=False, tie_word_embeddings=False, hidden_act="silu",
        bos_token_id=0, eos_token_id=1,
    ),
    "kimi-k2": dict(  # moonshotai/Kimi-K2-Instruct: DeepSeek-V3's architecture, 384 experts, 64 heads; cut it too
        architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", vocab_size=163840, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64,
        num_key_value_heads=64, n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8,
        first_k_dense_replace=1, moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", n_group=1,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-6, rope_theta=50000.0,
        max_position_embeddings=131072,
        # uncertain: rope_scaling's beta_fast (1.0 here, V3's is 32) and eos_token_id (the Instruct release's
        # generation_config ends a turn at 163586, <|im_end|>)
        rope_scaling=dict(type="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0,
                          beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        num_nextn_predict_layers=0, attention_bias=False, tie_word_embeddings=False, hidden_act="silu",
        bos_token_id=163584, eos_token_id=163585,
    ),
    # allenai/OLMoE-1B-7B-0924's config.json as published (written from memory; the shapes match those cited for
    # the release: 16 layers, hidden 2048, 16 heads, 64 experts of 1024, top-8, vocabulary 50304)
    "olmoe-1b-7b": dict(
        architectures=["OlmoeForCausalLM"], model_type="olmoe", vocab_size=50304, hidden_size=2048,
        intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
        num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, clip_qkv=None, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=4096, attention_bias=False,
        tie_word_embeddings=False, hidden_act="silu", pad_token_id=1, bos_token_id=None, eos_token_id=50279,
    ),
    # Mixtral's releases, their config.json fields as published on Hugging Face (mistralai/Mixtral-8x7B-v0.1,
    # mistralai/Mixtral-8x22B-v0.1; written from memory, not copied from the files)
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False, hidden_act="silu",
        router_aux_loss_coef=0.02, bos_token_id=1, eos_token_id=2,
    ),
    "mixtral-8x22b": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000, hidden_size=6144,
        intermediate_size=16384, num_hidden_layers=56, num_attention_heads=48, num_key_value_heads=8,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=65536, rms_norm_eps=1e-5,
        rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False, hidden_act="silu",
        router_aux_loss_coef=0.001, bos_token_id=1, eos_token_id=2,
    ),
    # Qwen2-MoE's releases (Qwen/Qwen1.5-MoE-A2.7B, Qwen/Qwen2-57B-A14B), as published (written from memory and
    # checked against copies of the files in other projects; the value marked "uncertain" differs between them)
    "qwen1.5-moe-a2.7b": dict(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
        norm_topk_prob=False, decoder_sparse_step=1, max_position_embeddings=32768,  # uncertain (8192?)
        rms_norm_eps=1e-6, rope_theta=1000000.0, use_sliding_window=False, sliding_window=32768, max_window_layers=21,
        tie_word_embeddings=False, hidden_act="silu", bos_token_id=151643, eos_token_id=151643,
    ),
    "qwen2-57b-a14b": dict(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", vocab_size=151936, hidden_size=3584,
        intermediate_size=18944, moe_intermediate_size=2560, shared_expert_intermediate_size=20480,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, num_experts=64, num_experts_per_tok=8,
        norm_topk_prob=False, decoder_sparse_step=1, max_position_embeddings=131072, rms_norm_eps=1e-6,
        rope_theta=1000000.0, use_sliding_window=False, sliding_window=131072, max_window_layers=28,
        tie_word_embeddings=False, hidden_act="silu", bos_token_id=151643, eos_token_id=151643,
    ),
    # OpenAI's gpt-oss releases (openai/gpt-oss-20b, openai/gpt-oss-120b), their config.json fields as published
    # (written from memory, not copied from the files). Left out: quantization_config (the releases' experts are
    # MXFP4; a preset is random weights in --dtype) and the aux-loss, dropout and init fields nothing reads.
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
        intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        num_local_experts=32, num_experts_per_tok=4, experts_per_token=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12, max_position_embeddings=131072,
        initial_context_length=4096, rms_norm_eps=1e-5, rope_theta=150000,
        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                          original_max_position_embeddings=4096),
        swiglu_limit=7.0, attention_bias=True, tie_word_embeddings=False, hidden_act="silu", pad_token_id=199999,
        eos_token_id=200002,
    ),
    "gpt-oss-120b": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
        intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        num_local_experts=128, num_experts_per_tok=4, experts_per_token=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 18, max_position_embeddings=131072,
        initial_context_length=4096, rms_norm_eps=1e-5, rope_theta=150000,
        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                          original_max_position_embeddings=4096),
        swiglu_limit=7.0, attention_bias=True, tie_word_embeddings=False, hidden_act="silu", pad_token_id=199999,
        eos_token_id=200002,
    ),
    # GLM-4.5 (Glm4MoeForCausalLM; GLM-4.6 is the same architecture), config.json as published on Hugging Face
    # (zai-org/GLM-4.5-Air, zai-org/GLM-4.5: written from memory, checked against copies quoted in public code, not
    # against the files). The multi-token-prediction layer (num_nextn_predict_layers) is never read.
    "glm-4.5-air": dict(
        architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=151552, hidden_size=4096,
        intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46, num_attention_heads=96,
        num_key_value_heads=8, head_dim=128, n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8,
        first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
        partial_rotary_factor=0.5, rope_theta=1000000, rope_scaling=None, max_position_embeddings=131072,
        rms_norm_eps=1e-5, attention_bias=True, use_qk_norm=False, num_nextn_predict_layers=1,
        tie_word_embeddings=False, hidden_act="silu", pad_token_id=151329, eos_token_id=[151329, 151336, 151338],
    ),
    "glm-4.5": dict(
        architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=151552, hidden_size=5120,
        intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=92, num_attention_heads=96,
        num_key_value_heads=8, head_dim=128, n_routed_experts=160, n_shared_experts=1, num_experts_per_tok=8,
        first_k_dense_replace=3, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        partial_rotary_factor=0.5, rope_theta=1000000, rope_scaling=None, max_position_embeddings=131072,
        rms_norm_eps=1e-5, attention_bias=True, use_qk_norm=True, num_nextn_predict_layers=1,
        tie_word_embeddings=False, hidden_act="silu", pad_token_id=151329, eos_token_id=[151329, 151336, 151338],
    ),
}


class ConfigError(ValueError):
    """A model or engine configuration that Moebius cannot serve."""


@dataclass(frozen=True)
class KVGroup:
    """Layers whose caches share one page table per request: a query of theirs sees its last `window` keys, itself
    included (None: every earlier key). A sliding-window group's pages before a request's window are freed.
    Groups are the engine's rendering of a model's `layer_windows` (`ModelConfig.kv_groups`), as vLLM's KV cache
    groups: every group has its own page ids, so a group's freed pages serve its own layers' later requests."""

    layers: tuple[int, ...]
    window: int | None


def first_live_page(start: int, window: int | None, block_size: int) -> int:
    """The first page a query at position `start` (a chunk's first, or later ones) reads under `window`: the pages
    before hold only keys outside every such query's window."""
    return 0 if window is None else max(0, start - window + 1) // block_size


@dataclass(frozen=True)
class KVSpec:
    """One token's cache entry in one layer: `parts` tensors (K and V: 2; MLA's latent with its rope key: 1) of
    `heads` heads of `dim` values. A layout splits the heads over its TP ranks, at least one a rank (fewer heads than
    ranks are replicated, as MLA's single latent is on every TP rank); EP holds them all (parallel/layout.py)."""

    parts: int
    heads: int
    dim: int


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of a model as every part of the engine sees them (parsed by its family:
    moebius/models/<family>/config.py); `family` names it in moebius/models/registry.py."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP layers
    moe_intermediate_size: int  # one expert
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    family: str = "qwen3_moe"
    kv_parts: int = 2  # the KV spec's (`kv_spec`): 2 for K and V heads of head_dim
    kv_dim: int = 0  # 0: head_dim
    # each layer's attention window (keys a query sees, itself included; None: all): () when no layer has one
    layer_windows: tuple[int | None, ...] = ()
    # --quantization: "fp8": the routed experts and the dense Linear weights held as block-FP8 rows
    # (`specs.linear_spec` says which dense ones); "mxfp4": the routed experts as MXFP4 rows (kernels/rows.py);
    # "": in the dtype
    quantization: str = ""
    # the modules an FP8 checkpoint leaves unquantized (its quantization_config's modules_to_not_convert): kept in
    # the dtype
    quant_skip: tuple[str, ...] = ()
    # --quantization-scope experts: the dense Linear weights held in the dtype (a quantized checkpoint's dequantized
    # at load), the routed experts alone in --quantization's rows
    quantize_dense: bool = True
    # the family's own fields (frozen dataclasses: a ModelConfig is a cache key), read only by its folder
    extra: Any = None

    def extra_as(self, cls: type[E]) -> E:
        """`extra` as the family's own fields class; TypeError naming both where it is another (a config of another
        family handed to this one's code)."""
        if not isinstance(self.extra, cls):
            raise TypeError(f"ModelConfig.extra of a {self.family!r} model is {type(self.extra).__name__}, not "
                            f"{cls.__name__}")
        return self.extra

    def validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads "
                              f"{self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers
                                   or any(w is not None and w < 1 for w in self.layer_windows)):
            raise ConfigError(f"layer_windows must give each of the {self.num_layers} layers a window >= 1 or None, "
                              f"got {self.layer_windows!r}")
        if any(self.is_moe_layer(i) for i in range(self.num_layers)):
            if not 1 <= self.top_k <= self.num_experts:
                raise ConfigError(f"num_experts_per_tok {self.top_k} must be in 1..num_experts {self.num_experts}")
            if self.moe_intermediate_size <= 0:
                raise ConfigError("moe_intermediate_size must be positive for MoE layers")

    def is_moe_layer(self, layer: int) -> bool:
        """Same rule as transformers' Qwen3MoeDecoderLayer; another family states its rule in these fields (DeepSeek:
        its dense layers as mlp_only_layers)."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    def layer_window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def largest_window(self) -> int:
        """The largest sliding window of a layer (0: none slides); the floor model prices window layers by it."""
        return max((w for w in self.layer_windows if w is not None), default=0)

    @functools.cached_property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The layers by window: full-attention layers first (every layer, in most models), then each window's."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        order = sorted(set(windows), key=lambda w: -1 if w is None else w)
        return tuple(KVGroup(tuple(i for i, w in enumerate(windows) if w == win), win) for win in order)

    @functools.cached_property
    def _group_of_layer(self) -> tuple[int, ...]:
        of = [0] * self.num_layers
        for g, grp in enumerate(self.kv_groups):
            for i in grp.layers:
                of[i] = g
        return tuple(of)

    def kv_group_of(self, layer: int) -> int:
        """The index in `kv_groups` of the group holding `layer`."""
        return self._group_of_layer[layer]

    @property
    def kv_spec(self) -> KVSpec:
        """What one token's cache entry is in one layer (its heads are num_kv_heads, split by the layout)."""
        return KVSpec(self.kv_parts, self.num_kv_heads, self.kv_dim or self.head_dim)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def read_hf_config(path: str) -> dict[str, Any]:
    """config.json of a local model directory, or a clear error."""
    if not os.path.isdir(path):
        raise ConfigError(f"model path {path!r} is not a directory (nor a preset: {', '.join(sorted(PRESETS))})")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ConfigError(f"{path!r} has no config.json; is it a Hugging Face model directory?")
    with open(cfg_file) as f:
        return json.load(f)


def _check_type(name: str, v: Any, annotation: str) -> None:
    """ConfigError unless `v` fits the flag's annotation ("int", "float | None", ...): bools are not numbers, ints
    are floats, numbers are finite."""
    kinds = annotation.replace(" ", "").split("|")
    if v is None and "None" in kinds:
        return
    ok = (("int" in kinds and isinstance(v, int) and not isinstance(v, bool))
          or ("float" in kinds and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v))
          or ("str" in kinds and isinstance(v, str)) or ("bool" in kinds and isinstance(v, bool)))
    if not ok:
        want = {"int": "an integer", "float": "a finite number", "str": "a string", "bool": "true or false"}
        raise ConfigError(f"{name} must be {' or '.join(want[k] for k in kinds if k in want)}"
                          f"{' or None' if 'None' in kinds else ''}, got {v!r}")


# Nearer its floor than 2048 when many requests arrive at once (one H200, 30B shapes:
# benchmarks/results/h200-p1-throughput-rollout-budget2048.json against h200-p1-throughput-rollout.json), at the price
# of longer stalls for running streams while a long prompt prefills (h200-p1-long-prompt-budget{2048,8192}.json);
# vLLM and SGLang use 8k-16k.
DEFAULT_TOKEN_BUDGET = 8192


def _flag(default: Any, help: str, choices: tuple[Any, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class EngineConfig:
    """Every engine flag. CLI flags are these names with dashes; LLM(...) takes them as keyword arguments."""

    model: str | None = _flag(None, "local Hugging Face model directory, or a preset name "
                              f"({', '.join(sorted(PRESETS))}) with --load-format dummy; "
                              "default: the small built-in model (random weights, meaningless text)")
    tokenizer: str | None = _flag(None, "directory with tokenizer.json (or a tiktoken.model), for --model (the "
                                  "built-in model has its own); default: the model directory")
    load_format: str = _flag("auto", "auto: safetensors from the model directory; dummy: random weights of the "
                             "right shapes created on the device", ("auto", "safetensors", "dummy"))
    num_layers: int | None = _flag(None, "keep only the first N decoder layers (for benchmarking cut shapes); "
                                   "default: all of them")
    dtype: str = _flag("auto", "weight/activation/KV dtype; auto = bfloat16 on GPU, float32 on CPU",
                       ("auto", "bfloat16", "float16", "float32"))
    quantization: str | None = _flag(None, "fp8: hold the routed experts and the dense Linear weights in block FP8 "
                                     "(128 x 128 blocks, e4m3, a float32 scale a block): a block-FP8 checkpoint as "
                                     "stored, a float one quantized at load. mxfp4: hold the routed experts in MXFP4 "
                                     "(32-value blocks of e2m1 sharing a power-of-two scale, as GPT-OSS's releases): "
                                     "an MXFP4 checkpoint's values as stored, a float one quantized at load. "
                                     "Default: every weight in --dtype (a quantized checkpoint dequantized at load)",
                                     ("fp8", "mxfp4"))
    quantization_scope: str = _flag("all", "with --quantization: all = every weight the format holds (FP8: the "
                                    "routed experts and the dense Linear weights); experts = the routed experts "
                                    "alone, the dense Linear weights (attention's projections, shared experts, "
                                    "dense MLPs) in --dtype, a quantized checkpoint's dequantized at load (twice "
                                    "their bytes; on the GPU their GEMMs are bf16's, faster here than the FP8 "
                                    "projections: docs/performance.md)", ("all", "experts"))
    device: str = _flag("auto", "auto = cuda when available, else cpu", ("auto", "cpu", "cuda"))
    seed: int = _flag(0, "engine seed (0 to 2^63 - 1): dummy weights and the seeds of requests that give none")
    block_size: int = _flag(16, "tokens per KV-cache page")
    max_model_len: int | None = _flag(None, "longest sequence (prompt + output); default: the model's "
                                      "max_position_embeddings")
    max_num_batched_tokens: int = _flag(DEFAULT_TOKEN_BUDGET, "token budget of one step (prefill chunks + "
                                        "decodes)")
    max_running_requests: int = _flag(256, "most requests decoding at once on a rank")
    max_total_tokens: int | None = _flag(None, "KV-cache capacity in tokens per rank; default: from --mem-fraction "
                                         "on GPU, 65536 on CPU")
    mem_fraction: float = _flag(0.85, "fraction of GPU memory for the unified buffer (weights + KV cache)")
    num_ranks: int = _flag(1, "ranks (one process per GPU) serving the model together on this machine; under "
                           "torchrun the world size is taken from the environment instead")
    rank_process: str = _flag("auto", "with one rank: run it in a process of its own, as every rank runs with "
                              "several (on), or in the front end's process (off); auto: its own under `moebius "
                              "serve`, where the HTTP side would otherwise share the GIL with the step launches, "
                              "else in process", ("auto", "on", "off"))
    mode: str | None = _flag(None, "parallel layout: tp (tensor parallel attention and experts), ep (data-parallel "
                             "attention, expert-parallel experts), or auto (switch between them by load); default: "
                             "auto with several ranks (ep alone for a quantized model TP cannot cut), tp with one",
                             ("tp", "ep", "auto"))
    switch_policy: str = _flag("threshold", "auto mode's policy: threshold (switch to EP above --switch-high running "
                               "requests, back to TP below --switch-low) or cost (switch when the calibrated step "
                               "times predict a saving over the work in flight larger than the switch's cost)",
                               ("threshold", "cost"))
    switch_profile: str = _flag("interactive", "auto mode's defaults: interactive (T_l = 0.8 T_h, window 8 steps, "
                                "cooldown 5 s; starts in TP) or rollout (T_l = T_h, window 1; starts in EP)",
                                ("interactive", "rollout"))
    switch_high: float | None = _flag(None, "auto mode: switch TP -> EP when more requests than this run (T_h); "
                                      "default: the crossover measured by calibration at start-up")
    switch_low: float | None = _flag(None, "auto mode: switch EP -> TP when the mean running count over the window "
                                     "falls below this (T_l <= T_h); default: from --switch-profile")
    switch_window: int | None = _flag(None, "auto mode: steps the EP -> TP mean is taken over (W); default: from "
                                      "--switch-profile")
    switch_cooldown: float | None = _flag(None, "auto mode: seconds after a switch (or a refused one) before the "
                                          "next is asked for (C); default: from --switch-profile")
    calibration_dir: str | None = _flag(None, "where calibration profiles are kept and reused (keyed by model, "
                                        "layers, ranks, GPU, dtype, step settings); default: "
                                        "~/.cache/moebius/calibration")
    static_layout: bool = _flag(False, "hold only the --mode layout (no live switching): the fixed-layout engine "
                                "the dual-layout one is compared against")
    switch_overlap: bool = _flag(False, "double-buffer a switch's expert pass: a layer's local permute runs while the "
                                 "layer before it is exchanged (on the GPU from a side stream), for one more layer of "
                                 "expert staging during the switch")
    switch_transport: str = _flag("collective", "how a switch's expert shards travel: collective (torch.distributed "
                                  "all-to-all over the device group) or peer (each rank copies its shards straight "
                                  "into or out of its peers' expert staging: symmetric memory over NVLink on GPUs, "
                                  "shared-memory files on the CPU; the staging is then allocated once at start and "
                                  "kept)", ("collective", "peer"))
    disable_cuda_graph: bool = _flag(False, "run every step eagerly (debugging); by default steps replay CUDA graphs "
                                     "captured at start for both layouts (decode steps whole, other steps in pieces "
                                     "around attention)")
    disable_custom_all_reduce: bool = _flag(False, "TP all-reduces through NCCL only; by default activations up to "
                                            "the step's token budget are summed through symmetric-memory buffers "
                                            "peer GPUs write and read over NVLink (lower latency; up to 8 MiB one "
                                            "launch with the residual add and the next RMSNorm)")
    plans_ahead: int = _flag(1, "with rank processes: plans on their way to the ranks while the front end takes in "
                             "a step's result; 1: the next step's; 2 (what `moebius serve` starts with): also the "
                             "one after, so that a rank does not wait on a busy front end (a server streaming "
                             "hundreds of answers) for its plan, at one more step before a request added or aborted "
                             "counts")
    logprobs_mode: str = _flag("raw_logprobs", "what SamplingParams.logprobs returns (vLLM's names): raw_logprobs, "
                               "the model's distribution before temperature and cuts; processed_logprobs, the one "
                               "a token is drawn from (after temperature, top-k, top-p, min-p); raw_logits / "
                               "processed_logits, the logits themselves",
                               ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"))
    enable_return_routed_experts: bool = _flag(False, "let requests ask for routed experts "
                                               "(SamplingParams.return_routed_experts, /generate's "
                                               "return_routed_experts): every forward then also writes each MoE "
                                               "layer's expert ids (SGLang's flag; off: no step does that work)")
    lm_head_dtype: str = _flag("auto", "dtype of the final projection (lm_head) and of the softmax after it; "
                               "float32: accumulated and returned in float32 even when the model runs in bfloat16 "
                               "(log-probabilities closer to a trainer's); auto: the model's", ("auto", "float32"))
    disable_prefix_caching: bool = _flag(False, "compute every prompt in full; by default a request starts from the "
                                         "KV pages of the longest run of full pages (--block-size tokens) "
                                         "an earlier or concurrent request on its rank computed (shared, not "
                                         "copied; kept until the pool needs the pages), as vLLM's automatic prefix "
                                         "caching: a shared system prompt, the n samples of one request, the "
                                         "earlier turns of a chat (prompt and answer)")
    disable_overlap_schedule: bool = _flag(False, "resolve each step before scheduling the next; by default the "
                                           "next step is launched while the device still runs the current one "
                                           "(its input tokens are taken on the device), hiding host work")
    warmup: str = _flag("auto", "start-up kernel warm-up: full runs one eager step of every shape class the engine "
                        "launches outside its decode graphs (prefill chunks of 1 to --max-num-batched-tokens tokens, "
                        "mixed steps, larger decode batches, sampling) in both layouts before serving, so Triton "
                        "compiles, or loads from its on-disk cache (TRITON_CACHE_DIR), every kernel variant at start "
                        "and not under the first requests; none compiles on first use; auto: full on GPU, none on "
                        "CPU", ("auto", "full", "none"))
    cuda_graph_max_bs: int = _flag(256, "largest per-rank decode batch with a whole-step CUDA graph; larger batches "
                                   "take step pieces (--cuda-graph-max-tokens) or run eagerly")
    cuda_graph_max_tokens: int = _flag(2048, "largest per-rank step of other kinds (prompt chunks, alone or beside "
                                       "decodes; decode batches past --cuda-graph-max-bs) that replays CUDA graphs: "
                                       "captured per token bucket in pieces around each layer's attention, which "
                                       "runs eagerly between them (a step is padded to its bucket); larger steps, or "
                                       "all at 0, run eagerly (there the GPU, not the launches, sets their time)")
    mixed_attention: str = _flag("apart", "how the decodes of a step with prompt chunks attend on the GPU: apart (a "
                                 "decode launch of their own, with KV splits) or shared (as one-token query blocks "
                                 "of the chunks' launch)", ("apart", "shared"))
    prefill_attention: str = _flag("auto", "attention of steps with prompt chunks on the GPU: flash (FlashAttention-4, "
                                   "the flash-attn-4 package: pip install 'moebius[flash]'; Hopper or newer), triton "
                                   "(the paged Triton kernel; cuDNN for a lone first chunk), or auto (flash where it "
                                   "imports and the GPU is Hopper or newer, else triton)", ("auto", "flash", "triton"))
    moe_kernel: str = _flag("triton", "GPU expert kernel for bf16: triton (fused, reads only the experts a batch "
                            "hits) or grouped_mm (torch._grouped_mm)", ("triton", "grouped_mm"))
    disable_pdl: bool = _flag(False, "launch the Triton kernels without programmatic dependent launch (by default, on "
                              "Hopper and newer, a kernel launches while the one before it finishes)")
    fp8_activations: bool = _flag(False, "with --quantization fp8 on the GPU, quantize each 128-column group of a "
                                  "token's activations to FP8 with a scale of its own and multiply FP8 by FP8 (W8A8, "
                                  "as vLLM and SGLang for block FP8); by default each FP8 weight tile is dequantized "
                                  "as loaded and multiplied in --dtype (W8A16: the faster here at decode sizes, and "
                                  "the bf16 model's activations; docs/performance.md)")
    disable_shared_experts_stream: bool = _flag(False, "on the GPU, run the shared experts (DeepSeek, GLM-4.5, "
                                                "Qwen2-MoE) on the main stream after the routed experts' kernels, "
                                                "instead of on a side stream beside them (joined before their sum)")
    disable_reshard_kernel: bool = _flag(False, "a switch's local expert permutes through torch's strided copies "
                                         "instead of the Triton row copy (GPU)")
    admin_port: int | None = _flag(None, "serve operator endpoints (POST /admin/switch, GET /admin/status) on this "
                                   "port; 0 picks a free one; default: none")
    admin_host: str = _flag("127.0.0.1", "address the admin endpoints bind to")
    api_key: str | None = _flag(None, "require 'Authorization: Bearer <key>' on every HTTP route but /health: under "
                                "`moebius serve` the API, /metrics and the operator endpoints; offline, the "
                                "--admin-port endpoints; default: no key asked")
    watchdog_timeout: float = _flag(300.0, "seconds a step (or switch, or query) may take before the ranks are "
                                    "declared stuck (a collective waiting on a rank that no longer takes part) and "
                                    "stopped, so the engine fails with an error instead of hanging; 0 waits forever "
                                    "(spawned ranks; a dead rank process is noticed at once either way)")
    cpu_threads: int = _flag(1, "torch threads per rank when running on CPU (the CPU path serves tests and demos; "
                             "one thread per rank avoids oversubscribing small machines)")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # types first: a later comparison with a wrong type names nothing
            _check_type(f.name, getattr(self, f.name), str(f.type))
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_running_requests <= 0:
            raise ConfigError(f"max_running_requests must be positive, got {self.max_running_requests}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.block_size:
            raise ConfigError(f"max_total_tokens {self.max_total_tokens} is smaller than one block "
                              f"({self.block_size} tokens)")
        if self.num_ranks < 1:
            raise ConfigError(f"num_ranks must be >= 1, got {self.num_ranks}")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ConfigError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.cpu_threads < 1:
            raise ConfigError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.admin_port is not None and not 0 <= self.admin_port <= 65535:
            raise ConfigError(f"admin_port must be a port number (0-65535; 0 picks a free one), got {self.admin_port}")
        if self.switch_high is not None and self.switch_low is not None and self.switch_low > self.switch_high:
            raise ConfigError(f"switch_low {self.switch_low} is above switch_high {self.switch_high} (T_l <= T_h)")
        if self.switch_window is not None and self.switch_window < 1:
            raise ConfigError(f"switch_window must be at least 1 step, got {self.switch_window}")
        if self.cuda_graph_max_bs < 1:
            raise ConfigError(f"cuda_graph_max_bs must be >= 1 (--disable-cuda-graph turns graphs off), got "
                              f"{self.cuda_graph_max_bs}")
        if self.cuda_graph_max_tokens < 0:
            raise ConfigError(f"cuda_graph_max_tokens must be >= 0 (0: steps with prompt chunks run eagerly), got "
                              f"{self.cuda_graph_max_tokens}")
        if self.plans_ahead not in (1, 2):
            raise ConfigError(f"plans_ahead must be 1 or 2, got {self.plans_ahead}")
        if self.watchdog_timeout < 0:
            raise ConfigError(f"watchdog_timeout must be >= 0 seconds (0: no limit), got {self.watchdog_timeout}")
        if self.switch_cooldown is not None and self.switch_cooldown < 0:
            raise ConfigError(f"switch_cooldown must be >= 0 seconds, got {self.switch_cooldown}")
        # a count of requests: below 0 no user threshold means anything (inf is refused as not finite above; auto mode
        # itself uses inf and -1 for a calibration that favours one layout at every batch)
        for name in ("switch_high", "switch_low"):
            if (v := getattr(self, name)) is not None and v < 0:
                raise ConfigError(f"{name} must be >= 0 requests in flight, got {v}")
        if not 0 <= self.seed < 2**63:  # random.Random(-s) is random.Random(s): a negative seed would alias another
            raise ConfigError(f"seed must be in 0..2^63 - 1, got {self.seed}")
        if self.api_key is not None and (not self.api_key.strip()
                                         or any(ord(c) < 32 or ord(c) == 127 for c in self.api_key)):
            raise ConfigError(f"api_key must be a non-empty key without control characters (it is compared with an "
                              f"HTTP header), got {self.api_key!r}")
        for name in ("model", "tokenizer", "calibration_dir", "admin_host"):  # "" would mean something else silently
            if (v := getattr(self, name)) is not None and not v.strip():
                raise ConfigError(f"{name} must not be empty, got {v!r}")
        if self.tokenizer is not None and self.model is None:
            raise ConfigError(f"tokenizer {self.tokenizer!r} needs a model: the built-in demo model (no --model) "
                              f"knows only its own token ids; pass --model with it")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid: {sorted(names)}")
        for f in dataclasses.fields(cls):
            choices = f.metadata.get("choices")
            if f.name in kwargs and choices and kwargs[f.name] not in (*choices, *([None] if f.default is None
                                                                                 else [])):
                raise ConfigError(f"{f.name}={kwargs[f.name]!r} is not one of {list(choices)}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
        """The engine flags as a group of `parser`, but those in `exclude` (field names a sub-command would only
        refuse or ignore). Each help states its default once (parse with HelpFormatter)."""
        unknown = sorted(set(exclude) - {f.name for f in dataclasses.fields(cls)})
        assert not unknown, f"no engine flag {unknown}"
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(cls):
            if f.name in exclude:
                continue
            flag = "--" + f.name.replace("_", "-")
            if str(f.type) == "bool":
                group.add_argument(flag, dest=f.name, action="store_true", help=f.metadata["help"])
                continue
            kind = {"int | None": int, "int": int, "float": float, "float | None": float, "str": str,
                    "str | None": str}[str(f.type)]
            group.add_argument(flag, dest=f.name, type=kind, default=f.default, choices=f.metadata.get("choices"),
                               help=f.metadata["help"])

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        """The config of parsed flags (a flag the parser left out keeps its default); errors name the flags."""
        try:
            return cls(**{f.name: getattr(args, f.name, f.default) for f in dataclasses.fields(cls)})
        except ConfigError as e:
            raise ConfigError(flag_names(str(e), [f.name for f in dataclasses.fields(cls)])) from None


def flag_names(message: str, names: list[str]) -> str:
    """`message` with the field names in it spelt as command-line flags (max_tokens -> --max-tokens): the one it
    starts with, and any other with an underscore (plain words such as "model" may be prose)."""
    for name in sorted(names, key=len, reverse=True):
        flag = "--" + name.replace("_", "-")
        if message.startswith(name + " "):
            message = flag + message[len(name):]
        if "_" in name:
            message = re.sub(rf"(?<![\w-]){name}\b", flag, message)
    return message


class HelpFormatter(argparse.HelpFormatter):
    """Each option's default stated once: "(default: X)" is appended unless its help already says what the default
    is, and never for None (a sentence says what no value means) or an on/off flag (off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        said = re.search(r"\bdefault\b", text, re.IGNORECASE) is not None
        unstated = any(action.default is v for v in (None, False, argparse.SUPPRESS))
        valueless = isinstance(action, argparse._StoreConstAction | argparse._VersionAction | argparse._HelpAction)
        optional = bool(action.option_strings) or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)
        if said or unstated or valueless or not optional:
            return text
        return text + " (default: %(default)s)"
