"""GLM-4.5's weights: every view of a layout with the checkpoint names transformers writes (`weight_specs`), and the
views as the forward takes them (`build_weights`).

Attention: the shared GQA specs (models/gqa.py: q|k|v cut by heads with their bias, o_proj's columns, the per-head
q/k norms where use_qk_norm). MoE layers: the block shared with DeepSeek (models/grouped_moe.py: the routed experts
through `ExpertCut`, the router's correction bias, the shared experts a 1/P shard on every rank in both layouts).
Dense layers (first_k_dense_replace): a dense MLP sharded by TP and whole in EP. The region "rope" is the table of
the rotated dims only (`GlmConfig.rotary_dim` wide).
"""

from __future__ import annotations

import torch

from moebius.config import ModelConfig
from moebius.memory.umm import UnifiedMemory
from moebius.models.glm4_moe.config import GlmConfig
from moebius.models.gqa import attention_specs, attention_weights
from moebius.models.grouped_moe import moe_specs, moe_weights
from moebius.models.specs import ParamSpec, dense_mlp_specs, spec_view
from moebius.models.weights import DenseWeights, LayerWeights, ModelWeights, MoEWeights
from moebius.parallel.layout import Layout


def glm_extra(cfg: ModelConfig) -> GlmConfig:
    ext = cfg.extra
    if not isinstance(ext, GlmConfig):
        raise TypeError(f"ModelConfig.extra of a {cfg.family!r} model is {type(ext).__name__}, not a GlmConfig")
    return ext


def _layer_specs(cfg: ModelConfig, lay: Layout, i: int, elt: int) -> list[ParamSpec]:
    D, p, ext = cfg.hidden_size, f"model.layers.{i}.", glm_extra(cfg)
    specs = [
        ParamSpec(p + "input_layernorm", (D,), lambda f: f(p + "input_layernorm.weight", (D,))),
        ParamSpec(p + "post_attention_layernorm", (D,), lambda f: f(p + "post_attention_layernorm.weight", (D,))),
        *attention_specs(cfg, lay, p, qk_norm=ext.qk_norm, bias=cfg.attention_bias),
    ]
    return specs + (moe_specs(cfg, ext.moe, lay, i, elt) if cfg.is_moe_layer(i) else dense_mlp_specs(cfg, lay, p))


def weight_specs(cfg: ModelConfig, lay: Layout, elt: int) -> list[ParamSpec]:
    V, D = cfg.vocab_size, cfg.hidden_size
    specs = [ParamSpec("model.embed_tokens", (V, D), lambda f: f("model.embed_tokens.weight", (V, D)))]
    if not cfg.tie_word_embeddings:
        specs.append(ParamSpec("lm_head", (V, D), lambda f: f("lm_head.weight", (V, D))))
    specs.append(ParamSpec("model.norm", (D,), lambda f: f("model.norm.weight", (D,))))
    specs.append(ParamSpec("rope", (cfg.max_position_embeddings, glm_extra(cfg).rotary_dim), None))
    for i in range(cfg.num_layers):
        specs += _layer_specs(cfg, lay, i, elt)
    return specs


def build_weights(umm: UnifiedMemory, cfg: ModelConfig, lay: Layout, dtype: torch.dtype) -> ModelWeights:
    """The layout's weight views over the buffer (contents are whatever was loaded there)."""
    views = {s.name: spec_view(umm, s, dtype) for s in weight_specs(cfg, lay, dtype.itemsize)}
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if cfg.is_moe_layer(i):
            mlp: MoEWeights | DenseWeights = moe_weights(views, lay, i)
        else:
            mlp = DenseWeights(views[p + f"mlp.w13.tp{lay.tp_rank}of{lay.tp}"],
                               views[p + f"mlp.w2.tp{lay.tp_rank}of{lay.tp}"])
        layers.append(LayerWeights(views[p + "input_layernorm"], views[p + "post_attention_layernorm"],
                                   attention_weights(views, lay, p), mlp))
    embed = views["model.embed_tokens"]
    head = embed if cfg.tie_word_embeddings else views["lm_head"]
    rows = lay.vocab_rows  # TP: this rank's vocabulary slice (a view; see TPComm)
    return ModelWeights(embed, head[rows.start: rows.stop], views["model.norm"], views["rope"], layers)
