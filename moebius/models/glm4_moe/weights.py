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
from moebius.models.specs import ParamSpec, decoder_specs, dense_mlp_specs, spec_views
from moebius.models.weights import ModelWeights, decoder_weights, dense_weights
from moebius.parallel.layout import Layout


def glm_extra(cfg: ModelConfig) -> GlmConfig:
    return cfg.extra_as(GlmConfig)


def _layer_specs(cfg: ModelConfig, lay: Layout, p: str, i: int, elt: int) -> list[ParamSpec]:
    """Layer i's attention (q|k|v bias, optional per-head q/k norm) and its grouped MoE block or dense MLP."""
    ext = glm_extra(cfg)
    mlp = moe_specs(cfg, ext.moe, lay, i, elt) if cfg.is_moe_layer(i) else dense_mlp_specs(cfg, lay, p)
    return attention_specs(cfg, lay, p, qk_norm=ext.qk_norm, bias=cfg.attention_bias) + mlp


def weight_specs(cfg: ModelConfig, lay: Layout, elt: int) -> list[ParamSpec]:
    return decoder_specs(cfg, glm_extra(cfg).rotary_dim, lambda p, i: _layer_specs(cfg, lay, p, i, elt))


def build_weights(umm: UnifiedMemory, cfg: ModelConfig, lay: Layout, dtype: torch.dtype) -> ModelWeights:
    """The layout's weight views over the buffer (contents are whatever was loaded there)."""
    views = spec_views(umm, weight_specs(cfg, lay, dtype.itemsize), dtype)
    return decoder_weights(views, cfg, lay.vocab_rows, lambda p, i: (
        attention_weights(views, lay, p),
        moe_weights(views, lay, i) if cfg.is_moe_layer(i) else dense_weights(views, lay.tp_rank, lay.tp, p)))
