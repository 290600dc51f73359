"""Mixtral's weights: every view of a layout with the checkpoint names it is cut from (`weight_specs`), and the views
as the forward takes them (`build_weights`). Attention is models/gqa.py's without q/k norm or bias; the experts are
the shared `ExpertCut`'s under Mixtral's names (`block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1 / w3 /
w2`, from the config's `expert_names`) or transformers 5's fused tensors."""

from __future__ import annotations

import torch

from moebius.config import ModelConfig
from moebius.memory.umm import UnifiedMemory
from moebius.models.gqa import attention_specs, attention_weights
from moebius.models.specs import ParamSpec, routed_expert_specs, spec_view
from moebius.models.weights import LayerWeights, ModelWeights, MoEWeights
from moebius.parallel.layout import Layout


def _norm(name: str, D: int) -> ParamSpec:
    return ParamSpec(name, (D,), lambda f: f(name + ".weight", (D,)))


def weight_specs(cfg: ModelConfig, lay: Layout, elt: int) -> list[ParamSpec]:
    V, D = cfg.vocab_size, cfg.hidden_size
    specs = [ParamSpec("model.embed_tokens", (V, D), lambda f: f("model.embed_tokens.weight", (V, D)))]
    if not cfg.tie_word_embeddings:
        specs.append(ParamSpec("lm_head", (V, D), lambda f: f("lm_head.weight", (V, D))))
    specs += [_norm("model.norm", D), ParamSpec("rope", (cfg.max_position_embeddings, cfg.head_dim), None)]
    for i in range(cfg.num_layers):  # every layer MoE
        p = f"model.layers.{i}."
        specs += [_norm(p + "input_layernorm", D), _norm(p + "post_attention_layernorm", D),
                  *attention_specs(cfg, lay, p, qk_norm=False, bias=False), *routed_expert_specs(cfg, lay, i, elt)]
    return specs


def build_weights(umm: UnifiedMemory, cfg: ModelConfig, lay: Layout, dtype: torch.dtype) -> ModelWeights:
    """The layout's weight views over the buffer (contents are whatever was loaded there)."""
    views = {s.name: spec_view(umm, s, dtype) for s in weight_specs(cfg, lay, dtype.itemsize)}
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        moe = MoEWeights(views[p + "mlp.gate"], views[p + "mlp.experts.w13"], views[p + "mlp.experts.w2"],
                         lay.first_expert)
        layers.append(LayerWeights(views[p + "input_layernorm"], views[p + "post_attention_layernorm"],
                                   attention_weights(views, lay, p), moe))
    embed = views["model.embed_tokens"]
    head = embed if cfg.tie_word_embeddings else views["lm_head"]
    rows = lay.vocab_rows  # TP: this rank's vocabulary slice (a view; see TPComm)
    return ModelWeights(embed, head[rows.start: rows.stop], views["model.norm"], views["rope"], layers)
