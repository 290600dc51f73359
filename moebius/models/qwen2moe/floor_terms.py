"""Qwen2-MoE's terms of the floor model (`FloorTerms`): GQA, a layout's query heads and KV heads (replicated in TP
below P) of head_dim each, K and V cached per KV head (the q|k|v biases left out, as norms are); the shared expert a
1/P shard on every rank in both layouts, run on every token of the batch (models/qwen2moe/weights.py), its gate a
D-vector."""

from __future__ import annotations

from moebius.config import ModelConfig
from moebius.models import gqa
from moebius.models.qwen2moe.config import Qwen2MoeFields
from moebius.models.specs import FloorTerms
from moebius.parallel.layout import Layout


def floor_terms(cfg: ModelConfig, lay: Layout) -> FloorTerms:
    ext = cfg.extra_as(Qwen2MoeFields)
    moe = sum(1 for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
    D = cfg.hidden_size
    return gqa.floor_terms(cfg, lay, shared_weights=moe * (3 * D * ext.shared_intermediate_size / lay.world_size + D))
