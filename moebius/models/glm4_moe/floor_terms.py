"""GLM-4.5's terms of the floor model (`FloorTerms`): GQA, a layout's query heads and KV heads (replicated in TP
below P) of head_dim each, K and V cached per KV head (the projections and the scores as Qwen3-MoE's); the shared
experts a 1/P shard of their intermediate dim on every rank in both layouts, run on every token of the batch
(models/grouped_moe.py)."""

from __future__ import annotations

from moebius.config import ModelConfig
from moebius.models import gqa
from moebius.models.glm4_moe.weights import glm_extra
from moebius.models.specs import FloorTerms
from moebius.parallel.layout import Layout


def floor_terms(cfg: ModelConfig, lay: Layout) -> FloorTerms:
    moe = sum(1 for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
    shared = glm_extra(cfg).moe.shared_intermediate_size
    return gqa.floor_terms(cfg, lay, shared_weights=moe * 3 * cfg.hidden_size * shared / lay.world_size)
