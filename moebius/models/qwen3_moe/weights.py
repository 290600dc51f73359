"""Qwen3-MoE's weights: every view of a layout with the checkpoint names it is cut from (`weight_specs`), and the
views as the forward takes them (`build_weights`)."""

from __future__ import annotations

import torch

from moebius.config import ModelConfig
from moebius.memory.umm import UnifiedMemory
from moebius.models.gqa import attention_specs, attention_weights
from moebius.models.specs import ParamSpec, dense_mlp_specs, routed_expert_specs, spec_view
from moebius.models.weights import DenseWeights, LayerWeights, ModelWeights, MoEWeights
from moebius.parallel.layout import Layout


def _layer_specs(cfg: ModelConfig, lay: Layout, i: int, elt: int) -> list[ParamSpec]:
    D, p = cfg.hidden_size, f"model.layers.{i}."
    specs = [
        ParamSpec(p + "input_layernorm", (D,), lambda f: f(p + "input_layernorm.weight", (D,))),
        ParamSpec(p + "post_attention_layernorm", (D,), lambda f: f(p + "post_attention_layernorm.weight", (D,))),
        *attention_specs(cfg, lay, p, qk_norm=True, bias=cfg.attention_bias),
    ]
    return specs + (routed_expert_specs(cfg, lay, i, elt) if cfg.is_moe_layer(i) else dense_mlp_specs(cfg, lay, p))


def weight_specs(cfg: ModelConfig, lay: Layout, elt: int) -> list[ParamSpec]:
    V, D = cfg.vocab_size, cfg.hidden_size
    embed = ParamSpec("model.embed_tokens", (V, D), lambda f: f("model.embed_tokens.weight", (V, D)))
    head = ParamSpec("lm_head", (V, D), lambda f: f("lm_head.weight", (V, D)))
    specs = [embed] + ([] if cfg.tie_word_embeddings else [head])
    specs.append(ParamSpec("model.norm", (D,), lambda f: f("model.norm.weight", (D,))))
    specs.append(ParamSpec("rope", (cfg.max_position_embeddings, cfg.head_dim), None))
    for i in range(cfg.num_layers):
        specs += _layer_specs(cfg, lay, i, elt)
    return specs


def build_weights(umm: UnifiedMemory, cfg: ModelConfig, lay: Layout, dtype: torch.dtype) -> ModelWeights:
    """The layout's weight views over the buffer (contents are whatever was loaded there)."""
    views = {s.name: spec_view(umm, s, dtype) for s in weight_specs(cfg, lay, dtype.itemsize)}
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = attention_weights(views, lay, p)
        if cfg.is_moe_layer(i):
            mlp: MoEWeights | DenseWeights = MoEWeights(views[p + "mlp.gate"], views[p + "mlp.experts.w13"],
                                                        views[p + "mlp.experts.w2"], lay.first_expert)
        else:
            mlp = DenseWeights(views[p + f"mlp.w13.tp{lay.tp_rank}of{lay.tp}"],
                               views[p + f"mlp.w2.tp{lay.tp_rank}of{lay.tp}"])
        layers.append(LayerWeights(views[p + "input_layernorm"], views[p + "post_attention_layernorm"], attn, mlp))
    embed = views["model.embed_tokens"]
    head = embed if cfg.tie_word_embeddings else views["lm_head"]
    rows = lay.vocab_rows  # TP: this rank's vocabulary slice (a view; see TPComm)
    head = head[rows.start: rows.stop]
    return ModelWeights(embed, head, views["model.norm"], views["rope"], layers)
