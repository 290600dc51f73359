"""Qwen3-MoE's weights: every view of a layout with the checkpoint names it is cut from (`weight_specs`), and the
views as the forward takes them (`build_weights`)."""

from __future__ import annotations

import torch

from moebius.config import ModelConfig
from moebius.memory.umm import UnifiedMemory
from moebius.models.gqa import AttnWeights, attention_specs, attention_weights
from moebius.models.specs import ParamSpec, decoder_specs, dense_mlp_specs, routed_expert_specs, spec_views
from moebius.models.weights import DenseWeights, ModelWeights, MoEWeights, decoder_weights, dense_weights
from moebius.parallel.layout import Layout


def _layer_specs(cfg: ModelConfig, lay: Layout, p: str, i: int, elt: int) -> list[ParamSpec]:
    """Layer i's attention (per-head q/k norms) and its routed experts or dense MLP."""
    mlp = routed_expert_specs(cfg, lay, i, elt) if cfg.is_moe_layer(i) else dense_mlp_specs(cfg, lay, p)
    return attention_specs(cfg, lay, p, qk_norm=True, bias=cfg.attention_bias) + mlp


def weight_specs(cfg: ModelConfig, lay: Layout, elt: int) -> list[ParamSpec]:
    return decoder_specs(cfg, cfg.head_dim, lambda p, i: _layer_specs(cfg, lay, p, i, elt))


def build_weights(umm: UnifiedMemory, cfg: ModelConfig, lay: Layout, dtype: torch.dtype) -> ModelWeights:
    """The layout's weight views over the buffer (contents are whatever was loaded there)."""
    views = spec_views(umm, weight_specs(cfg, lay, dtype.itemsize), dtype)

    def layer(p: str, i: int) -> tuple[AttnWeights, MoEWeights | DenseWeights]:
        mlp = (MoEWeights(views[p + "mlp.gate"], views[p + "mlp.experts.w13"], views[p + "mlp.experts.w2"],
                          lay.first_expert) if cfg.is_moe_layer(i) else dense_weights(views, lay.tp_rank, lay.tp, p))
        return attention_weights(views, lay, p), mlp

    return decoder_weights(views, cfg, lay.vocab_rows, layer)
