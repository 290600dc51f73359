"""OLMoE's terms of the floor model (`FloorTerms`): GQA, a layout's query heads and KV heads (replicated in TP below
P) of head_dim each, with their rows of the whole-projection q / k norms; K and V cached per KV head; every layer
MoE, no dense MLP."""

from __future__ import annotations

from moebius.config import ModelConfig
from moebius.models import gqa
from moebius.models.specs import FloorTerms
from moebius.parallel.layout import Layout


def floor_terms(cfg: ModelConfig, lay: Layout) -> FloorTerms:
    # the q / k norms' rows of its heads beside GQA's projections
    return gqa.floor_terms(cfg, lay, attn_extra=(lay.num_heads + lay.num_kv_heads) * cfg.head_dim)
