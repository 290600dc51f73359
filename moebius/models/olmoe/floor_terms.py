"""OLMoE's terms of the floor model (`FloorTerms`): GQA, a layout's query heads and KV heads (replicated in TP below
P) of head_dim each, with their rows of the whole-projection q / k norms; K and V cached per KV head; every layer
MoE, no dense MLP."""

from __future__ import annotations

from moebius.config import ModelConfig
from moebius.models.specs import FloorTerms
from moebius.parallel.layout import Layout


def floor_terms(cfg: ModelConfig, lay: Layout) -> FloorTerms:
    D, d, L = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    qh, kvh, spec = lay.num_heads, lay.num_kv_heads, cfg.kv_spec
    return FloorTerms(
        # q and o of its heads, k and v of its KV heads, the q / k norms' rows of them
        attn_weights=L * ((2 * D + 1) * qh * d + (2 * D + 1) * kvh * d),
        dense_weights=0.0,
        kv_per_token=L * kvh * spec.parts * spec.dim,
        attn_flops_per_key=L * 4 * qh * d,  # q.k and p.v of each of its heads
        moe_layers=L,
    )
